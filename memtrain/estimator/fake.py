"""A ``FakeTensorMode`` in which real training code (transformers, peft, bitsandbytes) runs.

The estimator traces training steps on fake tensors: shapes, dtypes and devices without storage,
so a 70B model costs no memory. Three things in the libraries memtrain uses do not work on fake
tensors out of the box; :func:`fake_tensor_mode` fixes each for the duration of the trace only,
and restores everything it touched afterwards:

- ``module.to(dtype)`` on a module with fake parameters (peft casts LoRA weights to the base
  layer's dtype) must swap tensors (``torch.utils.swap_tensors``), which refuses tensors with a
  weak reference. The fake mode's own memo holds one on almost every fake tensor; the memo entry
  is only a conversion cache, so it is dropped right before the swap.
- ``copy.deepcopy`` of a fake tensor (peft copies a classification head it trains) takes the
  real-tensor path through storages and comes back attached to a new fake mode, which the
  original mode then refuses to mix with. A fake tensor is deep-copied by cloning it in its mode.
- transformers asks of the position ids whether several sequences are packed into one row (a
  data-dependent ``.all()``) when a batch comes without an attention mask; on fake tensors it
  cannot ask and assumes packing. The estimator's batch (:func:`memtrain.trainer.build.example_batch`)
  brings an attention mask unless the recipe packs its rows, so the question comes up for a packed
  recipe, where the answer is yes (the block-diagonal mask a real packed row gets), or for rows of
  one token, where it is no. ``fake_tensor_mode(packed=...)`` answers it.
- transformers asks of a 2D attention mask whether it is all ones before building a 4D mask for
  SDPA; on a real batch without padding (a batch of one row, rows all as long: see
  :mod:`memtrain.data.rows`) the answer is yes and attention takes the unmasked, causal-only path
  (no 4D mask, no keys and values repeated per head). On fake tensors it cannot ask and builds the
  mask. ``fake_tensor_mode(padded=False)`` answers yes for the traced (unpadded) batch.
- bitsandbytes builds its 8-bit quantization map with ``.tolist()``, a data-dependent call that
  fake tensors cannot answer. The map is built once for real (256 floats) and handed in as a
  fake constant. bitsandbytes caches maps in module globals; the cache is restored on exit so that
  no fake tensor leaks into later real work.
- FSDP2 hands a 4-bit layer its gathered weight as a plain parameter, without the quantization
  state; bitsandbytes recovers it by wrapping that parameter in ``Params4bit``, which cannot wrap
  a fake tensor. While tracing, the state is put back on the gathered parameter itself (the
  same state object, and no new tensor, as the real wrapper does).
- DTensor (FSDP2's sharded parameters, in the optimizer step and gradient clipping) learns an
  op's output layout the first time it sees the op by running it on fake tensors, in the active
  fake mode if there is one. While tracing that would be the estimator's own mode, and those
  tensors would count as memory of the step, once per new op: it gets a fake mode of its own.
- torch's meta kernel of ``aten._grouped_mm`` (the grouped matmul that transformers' mixture-of-
  experts layers run, Mixtral, Qwen-MoE, ...) repeats the CUDA kernel's old bf16-only check, while
  the CPU kernel (and CUDA's fallback) multiplies any floating dtype: a float32 MoE model trains
  but could not be traced. While tracing, inputs of one other floating dtype get the output the
  meta kernel builds for bf16 (same shape, strides and device helper), in their own dtype.
- Sizes that depend on values (``aten.nonzero``: DeBERTa's classification loss keeps the labels
  ``>= 0`` this way) cannot be known from fake tensors, which refuse them. While tracing they are
  taken at their largest (every element selected), the worst case, as every other size in an
  estimate is (each example ``data.max_length`` tokens long); for DeBERTa's labels it is exact.
- A trainer's own ``compute_loss`` (:mod:`memtrain.estimator.trainer_loss`) reads values for its
  metrics (``.item()``, ``if count > 0``), which fake tensors cannot answer. With
  ``fake_tensor_mode(scalars=True)`` every such read answers 1 (``True``, ``1``, ``1.0``): the
  values only feed metrics, which the trace throws away; a trainer whose memory depended on such
  a value would be traced along the branch that 1 takes.
- bitsandbytes' ``GlobalOptimManager`` is a process-wide singleton that the Trainer fills with
  per-module overrides (embeddings keep 32-bit optimizer state). Its state is saved and restored
  so that a trace does not leave overrides behind for a later real optimizer, or the reverse.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from memtrain._compat import torch_fake, transformers_model
from memtrain._compat.torch_distributed import dtensor_propagation_without_fake_mode
from memtrain._compat.torch_tools import FakeTensor, FakeTensorMode, unset_fake_temporarily
from memtrain.config import RunConfig
from memtrain.distributed.sharding import quant_storage
from memtrain.errors import recipe_stage
from memtrain.estimator.flash_standin import fake_model_kwargs
from memtrain.model import keep_4bit_trainable_on_cpu, model_class
from memtrain.patches import apply_patches
from memtrain.trainer.build import no_kv_cache


@contextmanager
def fake_tensor_mode(packed: bool = False, padded: bool = True, scalars: bool = False
                     ) -> Iterator[FakeTensorMode]:
    """Enter a ``FakeTensorMode`` with the fixes above; yields the mode (for ``from_tensor``).

    Args:
        packed: the traced batches pack several examples per row (``data.packing``).
        padded: the traced batches carry padding; False: their attention masks are all ones.
        scalars: a tensor's value read into Python (``.item()``, ``bool(t)``) answers 1.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with ExitStack() as stack:
        stack.enter_context(torch_fake.swappable_fakes(mode))
        stack.enter_context(torch_fake.deepcopyable_fakes())
        if not packed:
            stack.enter_context(transformers_model.unpacked_positions())
        if not padded:
            stack.enter_context(transformers_model.unpadded_masks())
        stack.enter_context(_bnb_on_fakes(mode))
        stack.enter_context(dtensor_propagation_without_fake_mode())
        stack.enter_context(torch_fake.grouped_mm_any_float())
        stack.enter_context(torch_fake.largest_nonzero())
        if scalars:
            stack.enter_context(torch_fake.any_scalar())
        stack.enter_context(isolated_bnb_overrides())
        stack.enter_context(mode)
        yield mode


@contextmanager
def _bnb_on_fakes(mode: FakeTensorMode) -> Iterator[None]:
    try:
        import bitsandbytes.functional as F
        import bitsandbytes.nn.modules as bnb_modules
    except ImportError:  # optional backend: nothing to fix
        yield
        return
    original = F.create_dynamic_map
    cache = dict(F.name2qmap)
    recover = bnb_modules.fix_4bit_weight_quant_state_from_module

    def fix_4bit_weight_quant_state_from_module(module: torch.nn.Module) -> None:
        weight = module.weight
        if isinstance(weight, FakeTensor) and getattr(weight, "quant_state", None) is None:
            weight.quant_state = module.quant_state  # gathered by FSDP2: see the module docstring
        else:
            recover(module)

    def create_dynamic_map(*args: Any, **kwargs: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            real = original(*args, **kwargs)
        return mode.from_tensor(real)

    F.create_dynamic_map = create_dynamic_map
    bnb_modules.fix_4bit_weight_quant_state_from_module = fix_4bit_weight_quant_state_from_module
    F.name2qmap.clear()
    try:
        yield
    finally:
        bnb_modules.fix_4bit_weight_quant_state_from_module = recover
        F.create_dynamic_map = original
        F.name2qmap.clear()
        F.name2qmap.update(cache)


@contextmanager
def isolated_bnb_overrides() -> Iterator[None]:
    """Run with an empty bitsandbytes ``GlobalOptimManager`` and restore its state afterwards.

    Used around every optimizer that memtrain builds outside the Trainer (estimates, benchmarks),
    so that per-parameter overrides registered for one model never apply to another.
    """
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:
        yield
        return
    manager = GlobalOptimManager.get_instance()
    saved = {k: v for k, v in vars(manager).items()}
    manager.initialize()
    try:
        yield
    finally:
        manager.__dict__.clear()
        manager.__dict__.update(saved)


def build_fake_model(cfg: RunConfig, config: PretrainedConfig) -> nn.Module:
    """The same model on fake tensors; call inside :func:`memtrain.estimator.fake.fake_tensor_mode`.

    Args:
        cfg: the recipe (model section for dtype/quantization, the rest for patches).
        config: the architecture (possibly with fewer layers than the real model).
    """
    source = "model.from_config" if cfg.model.from_config is not None else "model.name"
    with (recipe_stage(source, f"building the {config.model_type} architecture"),
          transformers_model.uninitialized_values()):
        model = model_class(cfg.model).from_config(config, **fake_model_kwargs(cfg.model))
    if cfg.model.quantization not in ("none", "auto"):
        from memtrain.memory.quantized import quantize_fake

        with recipe_stage("model.quantization", f"quantizing to {cfg.model.quantization}"):
            model = quantize_fake(model, cfg.model, quant_storage(cfg))
        if cfg.model.quantization != "int8":
            keep_4bit_trainable_on_cpu(model)
    model.eval()  # as from_pretrained leaves it; the step switches to train mode
    return apply_patches(no_kv_cache(model), cfg)


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Library warnings about a model (or a Trainer) built for a trace, dozens of times per estimate,
    are noise here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
