"""bitsandbytes-quantized layers on fake tensors, and the bytes quantization state really takes.

Loading a model with ``BitsAndBytesConfig`` (what :func:`memtrain.model.load_model` does) swaps
linear layers for ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` and quantizes each weight as it is
read from the checkpoint. The estimator has no checkpoint and works on fake tensors, and
bitsandbytes' parameter classes (``Params4bit``, ``Int8Params``) cannot wrap a fake tensor. So
:func:`quantize_fake` does what transformers does, with transformers' own quantizer deciding
which modules to convert, and bitsandbytes' own quantization functions producing the packed
weight and its state, but stores the result in a plain (fake) ``nn.Parameter`` carrying the same
attributes bitsandbytes reads (``quant_state``, ``CB``/``SCB``, ...). The layers keep their real
bitsandbytes classes, so peft wraps them exactly as it wraps a real QLoRA model, and their
forward and backward run bitsandbytes' real code, whose custom ops have fake implementations.

What a quantized weight holds (bitsandbytes 0.4x+, blocksize 64 for 4-bit):

- 4-bit: the packed data, ``ceil(n / 2)`` bytes; ``absmax``, one float32 per 64 values; the
  16-value code book (float32). With double quantization ``absmax`` is stored as uint8 plus a
  nested float32 ``absmax`` per 256 blocks, the shared 256-entry dynamic code book and an offset.
- 8-bit (LLM.int8): int8 data, ``n`` bytes, plus ``SCB``, one float32 scale per output row.

None of these side tensors is a parameter or buffer, so a tracker that counts module parameters
misses them; :func:`quantization_state_tensors` lists them for the meter.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from memtrain._compat.torch_tools import FakeTensor, unset_fake_temporarily
from memtrain.config import ModelConfig


def quantization_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors that quantized layers of ``module`` hold outside their parameters and buffers.

    Duck-typed on the attributes bitsandbytes uses, so it needs no bitsandbytes import.
    """
    found: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        states = [getattr(weight, "quant_state", None), getattr(sub, "quant_state", None)]
        for state in states:
            for tensor in _quant_state_tensors(state):
                found[id(tensor)] = tensor
        for holder in (weight, getattr(sub, "state", None)):  # int8 row scales (CB aliases the weight)
            tensor = getattr(holder, "SCB", None)
            if isinstance(tensor, torch.Tensor):
                found[id(tensor)] = tensor
    return list(found.values())


def _quant_state_tensors(state: Any) -> list[torch.Tensor]:
    if state is None or not hasattr(state, "absmax"):
        return []
    out = [state.absmax, state.code, getattr(state, "offset", None)]
    nested = getattr(state, "state2", None)
    if nested is not None:
        out += [nested.absmax, nested.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def quantize_fake(model: nn.Module, cfg: ModelConfig, quant_storage: torch.dtype | None = None) -> nn.Module:
    """Quantize a fake model's linear layers the way loading with ``model.quantization`` does.

    Args:
        model: a transformers model whose parameters are fake tensors (built in ``cfg.dtype``).
        cfg: the ``model`` section; ``quantization`` must be nf4, fp4 or int8.
        quant_storage: the dtype packed 4-bit weights are stored in (default uint8; a sharded
            run stores them in the compute dtype, :func:`memtrain.distributed.sharding.quant_storage`).

    Returns:
        The same model, with bitsandbytes layers holding fake quantized weights, marked as
        loaded in 4 or 8 bits like a model from ``from_pretrained``.
    """
    import bitsandbytes as bnb
    from transformers.quantizers import AutoHfQuantizer

    from memtrain.model import quantization_config

    quant = quantization_config(cfg, quant_storage)
    if quant is None:
        raise ValueError(f"model.quantization={cfg.quantization!r} is not a bitsandbytes setting")
    quantizer = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    sources = {name: module for name, module in model.named_modules()}
    device = next(model.parameters()).device
    # The quantizer creates bitsandbytes modules on the meta device; their parameter classes
    # cannot wrap fake tensors, so module surgery runs outside the fake mode.
    with unset_fake_temporarily():
        quantizer.preprocess_model(model=model, dtype=model.dtype, device_map={"": device},
                                   checkpoint_files=None, use_kernels=False)
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.weight = _fake_params4bit(module, _source_weight(sources[name]), device)
        elif isinstance(module, bnb.nn.Linear8bitLt):
            module.weight = _fake_int8params(_source_weight(sources[name]), device)
        else:
            continue
        bias = sources[name].bias
        module.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def _source_weight(module: nn.Module) -> torch.Tensor:
    """The weight as a checkpoint stores it for a linear layer: (out, in). GPT-2's Conv1D is (in, out)."""
    from transformers.pytorch_utils import Conv1D

    weight = module.weight.detach()
    return weight.T if isinstance(module, Conv1D) else weight


def _fake_params4bit(module: nn.Module, weight: torch.Tensor, device: torch.device) -> nn.Parameter:
    """What ``Params4bit(weight, **meta_param.__dict__).to(device)`` holds, as a fake parameter."""
    import bitsandbytes as bnb

    meta = module.weight  # the meta Params4bit the quantizer created: it carries the settings
    packed, state = bnb.functional.quantize_4bit(
        weight.contiguous().to(device), blocksize=meta.blocksize,
        compress_statistics=meta.compress_statistics, quant_type=meta.quant_type,
        quant_storage=meta.quant_storage,
    )
    param = nn.Parameter(packed, requires_grad=False)
    if isinstance(param, FakeTensor):
        # peft's fp32 upcast (`prepare_model_for_kbit_training`) skips 4-bit weights by their class
        # name; stored in bf16 (sharded runs) a fake one would be upcast, as a real one is not
        param.__class__ = _fake_params4bit_class()
    for key in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
        setattr(param, key, getattr(meta, key))
    param.quant_state = state
    param.bnb_quantized = True
    param.module = module
    module.quant_state = state
    return param


@functools.cache
def _fake_params4bit_class() -> type:
    """A fake tensor that answers to bitsandbytes' class name ``Params4bit``."""
    return type("Params4bit", (FakeTensor,), {"__module__": __name__})


def _fake_int8params(weight: torch.Tensor, device: torch.device) -> nn.Parameter:
    """What ``Int8Params(weight).to(device)`` holds: int8 rows and one float32 scale per row."""
    import bitsandbytes as bnb

    data, scales, _ = bnb.functional.int8_vectorwise_quant(
        weight.contiguous().to(device=device, dtype=torch.float16))
    param = nn.Parameter(data, requires_grad=False)
    param.CB, param.SCB, param.has_fp16_weights = data, scales, False
    return param
