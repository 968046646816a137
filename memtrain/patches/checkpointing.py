"""Activation checkpointing: keep less of each decoder layer for backward, recompute the rest.

Modes (``memory.checkpointing``):

- ``none``: nothing changes.
- ``full``: every decoder layer keeps only its input and re-runs its forward during backward.
  Saves nearly all activation memory inside the layers (about one hidden state per layer is left);
  costs one more forward pass of every layer (about a third more step FLOPs).
- ``n`` (an integer, 1 ≤ n ≤ L): the first ``n`` of the L layers are checkpointed in full. Memory
  and recompute both scale linearly with ``n``, which lets the planner stop exactly where the
  budget is met. The first layers are chosen because their activations live longest.
- ``selective``: every layer keeps the outputs of its matmuls (linear projections, including
  LoRA's) and of fused attention kernels, and recomputes everything else: norms, activation
  functions, rotary embeddings, residual adds, dropout, casts, and the attention internals of
  eager attention (the s × s scores and softmax). This follows Korthikanti et al., 2022 ("Reducing
  Activation Recomputation in Large Transformer Models"): element-wise work holds a large share of
  the saved bytes but almost none of the FLOPs. The policy is torch's selective checkpointing
  (``create_selective_checkpoint_contexts``), the same mechanism torchtitan's op-level SAC uses.

All modes use torch's non-reentrant ``torch.utils.checkpoint``: it works with inputs that do not
require grad (frozen embeddings under LoRA), with keyword arguments, with 4-bit (QLoRA) layers and
under ``FakeTensorMode``. Nothing is recomputed in eval mode or under ``no_grad``. The layers are
patched in place (their ``forward`` is wrapped), not wrapped in a new module, so module names,
state-dict keys and LoRA target patterns stay the same; :func:`undo` removes the wrapping.
transformers' own ``gradient_checkpointing_enable`` is not used because it offers neither a layer
count nor a selective policy, and differs between architectures.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memtrain._compat.torch_tools import selective_checkpoint_options
from memtrain._compat.transformers_model import disable_own_checkpointing, own_checkpointing_on
from memtrain.config import RunConfig, decided
from memtrain.errors import MemtrainError
from memtrain.patches import (
    CHECKPOINTING,
    CostInputs,
    Doc,
    Knob,
    ModelShape,
    NoMatchError,
    PatchRecord,
    add_records,
    base_model,
    layers,
    num_layers,
    register,
    undo_records,
)

Mode = str | int  # none, full, selective or a number of layers (the first ones)


@dataclass(frozen=True)
class Config:
    """Which layers are checkpointed: one family of modes, from keeping most memory to least:
    ``none``, a number of layers (the first ones), ``selective`` (recompute element-wise ops and
    attention, keep matmul outputs), ``full`` (keep only each layer's input)."""

    mode: Mode = "full"

aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the matmuls of linear layers and the fused
# attention kernels (their output is O(s·h) like a projection's, and re-running them would cost
# the attention FLOPs). ``bmm`` is deliberately absent: in eager attention it computes the s × s
# scores, the "attention internals" that Korthikanti et al. recompute.
SAVED_OPS: frozenset[Any] = frozenset(
    op
    for name in (
        "mm", "addmm", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if (op := getattr(aten, name, None)) is not None
)


# Set inside regions that keep nothing for backward by design and recompute themselves (the tiled
# MLP's forward): selective checkpointing caches the outputs of the ops it keeps whatever the grad
# mode, so it would otherwise hold every tile's matmul outputs from forward to backward.
_NEVER_SAVED: contextvars.ContextVar[bool] = contextvars.ContextVar("memtrain_never_saved", default=False)


@contextmanager
def never_saved() -> Iterator[None]:
    """Ops run inside are recomputed, never kept, by selective checkpointing."""
    token = _NEVER_SAVED.set(True)
    try:
        yield
    finally:
        _NEVER_SAVED.reset(token)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep matmul and fused-attention outputs; recompute everything else (and everything inside
    :func:`never_saved`)."""
    if _NEVER_SAVED.get():
        return CheckpointPolicy.PREFER_RECOMPUTE
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


# ----------------------------------------------------------------------------- finding layers


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated transformer blocks, in order, with their names in ``model``
    (:func:`memtrain.patches.layers`: ``model.layers`` for Llama/Mistral/Qwen2, ``transformer.h``
    for GPT-2, ``encoder.layer`` for BERT/RoBERTa, also through a peft wrapper).

    Raises:
        NoMatchError: the model has none.
    """
    found = layers(model)
    if not found:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        shown = ", ".join(f"{n} ({len(m)} × {type(m[0]).__name__})" for n, m in lists) or "none"
        raise NoMatchError(
            f"`memory.checkpointing`: found no list of {num_layers(model) or 'repeated'} transformer "
            f"layers in {type(base_model(model)).__name__} (module lists: {shown}). Fix: set "
            "`memory.checkpointing: none` for this architecture."
        )
    return found


def _checkpointed(layer: nn.Module, forward: Callable[..., Any],
                  context_fn: Callable[[], tuple[Any, Any]] | None) -> Callable[..., Any]:
    """``forward`` run under non-reentrant checkpointing while the layer trains with grad."""
    kwargs_ckpt: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:  # selective: what it keeps stays on the device
        kwargs_ckpt.update(context_fn=context_fn, **selective_checkpoint_options())

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (layer.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        # Meta tensors have no RNG state to stash (the estimator may trace on meta).
        on_meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values()))
        return checkpoint(forward, *args, preserve_rng_state=not on_meta, **kwargs_ckpt, **kwargs)

    run.__memtrain_checkpointed__ = True  # type: ignore[attr-defined]
    return run


def wrap_forward(module: nn.Module, make: Callable[[Callable[..., Any]], Callable[..., Any]]
                 ) -> Callable[[], None]:
    """Replace ``module.forward`` by ``make(current_forward)`` on the instance; returns the undo."""
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = make(module.forward)  # type: ignore[method-assign]

    def undo() -> None:
        if had_own:
            module.forward = previous  # type: ignore[method-assign]
        else:
            module.__dict__.pop("forward", None)

    return undo


def wrap_each(model: nn.Module, name: str, found: list[tuple[str, nn.Module]],
              make: Callable[[nn.Module], Callable[[Callable[..., Any]], Callable[..., Any]]],
              detail: str) -> nn.Module:
    """Wrap the forward of each ``(path, module)`` in ``found`` with ``make(module)`` and record it
    as patch ``name`` (one record whose undo restores every forward); returns ``model``."""
    undos = [wrap_forward(module, make(module)) for _, module in found]

    def undo_all() -> None:
        for fn in undos:
            fn()

    add_records(model, [PatchRecord(name, [path for path, _ in found], detail, undo=undo_all)])
    return model


def disable_kv_cache(model: nn.Module) -> Callable[[], None]:
    """Turn off the model's KV cache (returns the undo).

    A training forward with ``use_cache`` builds a KV cache that keeps every layer's keys and
    values alive on the device: a checkpoint recompute would fill it twice, and offloading them
    would free nothing.
    """
    config = getattr(base_model(model), "config", None)
    before = getattr(config, "use_cache", None)
    if config is None or not before:
        return lambda: None
    config.use_cache = False

    def restore() -> None:
        config.use_cache = before

    return restore


def _layer_count(model: nn.Module, mode: Mode, total: int) -> int:
    """How many layers ``mode`` checkpoints; bad modes raise naming the recipe field."""
    if mode in ("full", "selective"):
        return total
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise MemtrainError(
            f"`memory.checkpointing` must be none, full, selective or a number of layers, got "
            f"{mode!r}. Fix: use one of those (`auto` is decided by the planner first)."
        )
    if not 1 <= mode <= total:
        raise MemtrainError(
            f"`memory.checkpointing`: {mode} layers asked, but {type(base_model(model)).__name__} "
            f"has {total}. Fix: use a number from 1 to {total}, or `full`."
        )
    return mode


def apply(model: nn.Module, config: Config | Mode = Config()) -> nn.Module:
    """Checkpoint the model's transformer layers as ``config`` says (see the module docstring).

    Args:
        model: a transformers model, possibly wrapped by peft and/or quantized.
        config: a :class:`Config` (or its mode alone: ``none``, ``full``, ``selective`` or a number
            of layers).

    Returns:
        The same model, patched in place; :func:`undo` reverts it.
    """
    mode = config.mode if isinstance(config, Config) else config
    if mode == "none":
        return model
    layers = find_layers(model)
    count = _layer_count(model, mode, len(layers))
    base = base_model(model)
    if own_checkpointing_on(base):
        disable_own_checkpointing(base)  # one recompute mechanism, not two nested
    context_fn = _selective_context if mode == "selective" else None
    undos = [wrap_forward(layer, functools.partial(_checkpointed, layer, context_fn=context_fn))
             for _, layer in layers[:count]]
    restore_cache = disable_kv_cache(model)

    def undo_all() -> None:
        for fn in undos:
            fn()
        restore_cache()

    kind = {"full": "full", "selective": "selective (recompute element-wise and attention)"}
    detail = kind.get(str(mode), f"{count} of {len(layers)} layers")
    add_records(model, [PatchRecord("checkpointing", [n for n, _ in layers[:count]],
                                    f"activation checkpointing: {detail}", undo=undo_all)])
    return model


def undo(model: nn.Module) -> nn.Module:
    """Remove the checkpointing this module applied to ``model``."""
    return undo_records(model, "checkpointing")


def is_checkpointed(layer: nn.Module) -> bool:
    """Does ``layer``'s forward run under checkpointing (at any depth of forward wrappers)?"""
    forward = layer.__dict__.get("forward")
    while forward is not None:
        if getattr(forward, "__memtrain_checkpointed__", False):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _rank(value: Any, shape: ModelShape) -> tuple[int, ...]:
    # 2-D: selective (recompute inside each layer) and n-of-L (all of some layers) are not comparable,
    # and neither are selective and none: a selective checkpoint's region boundaries can keep more
    # than the lean layers keep without it (Llama-3.1-8B QLoRA at 14,336 tokens, lean norm: 117.4 GiB
    # selective, 107.6 GiB none; an audit of all 256 candidates of the long-context plan)
    return {"none": (0, 0), "selective": (1, -1), "full": (1, 1)}.get(value, (0, 1))


def half_of_the_groups(shape: ModelShape) -> int:
    """The planner's ``n`` of L: half the layers, rounded down to whole groups where layers repeat in
    groups, so that the estimate traces groups of each kind, not every layer
    (:func:`memtrain.estimator.estimate.checkpointed_unit`; Gemma-2-9B: 20 of 42)."""
    return max(1, shape.period * (shape.depth // (2 * shape.period)))


def recompute_passes(value: Any, depth: int) -> float:
    """Extra forward passes over the decoder layers' weights per micro-batch that checkpointing
    ``value`` recomputes (0 to 1: ``n`` layers of ``depth`` recompute n/depth of one pass; the
    selective checkpoint recomputes only cheap ops, counted by the trace itself)."""
    if value == "full":
        return 1.0
    return min(1.0, value / max(1, depth)) if isinstance(value, int) and not isinstance(value, bool) else 0.0


def _cost(inputs: CostInputs, value: Any) -> dict[str, float]:
    """The recompute: each checkpointed layer's forward once more (the passes dequantize 4-bit
    weights too); a lower bound traced without checkpointing adds what the recompute runs at least:
    its FLOPs, ops and bytes written (a selective checkpoint: of the ops it does not keep)."""
    passes = recompute_passes(value, inputs.shape.depth)
    terms = {"recompute_passes": passes}
    if inputs.traced is None or inputs.traced.memory.checkpointing != "none":
        return terms
    again = inputs.recomputed_selective if value == "selective" else inputs.recomputed.scaled(passes)
    terms.update(extra_flops=again.flops, extra_ops=again.ops, extra_written=again.written)
    return terms


KNOBS = (Knob("memory.checkpointing",
              lambda cfg, shape: ["none", "selective", half_of_the_groups(shape), "full"], "none",
              order=40, rank=_rank, plugin=True, patches_model=True, cost=_cost,
              # under offload: without checkpointing every saved activation leaves the device, where
              # a selective checkpoint's region boundaries stay on it (Llama-3.1-8B at 131,072
              # tokens: 15.1 GiB without checkpointing, 226.9 GiB selective)
              unordered_offloaded=True, holds_same=True),)
DOC = Doc("activation checkpointing", "`memory.checkpointing: full \\| selective \\| n`",
          "activations for recompute FLOPs", "[memory_modes.md](docs/bench/memory_modes.md)")


@register("checkpointing", CHECKPOINTING, "memory.checkpointing", config=Config, apply=apply, knobs=KNOBS,
          doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    mode = decided(cfg.memory.checkpointing, "memory.checkpointing", "none, full, selective or a layer count")
    if mode == "none":
        return None
    return apply(model, Config(mode))
