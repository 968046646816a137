"""Few-bit activation backward: save a k-bit interval code per element instead of the input.

Saves: an activation such as GELU keeps its input (2-4 bytes per element) for backward; this
patch keeps ``k/8`` bytes per element instead (k = 1..4, bit-packed for real: 3 bits cost 3/8
byte). In a BERT or RoBERTa layer the GELU input (tokens × 4 × hidden) is, with the attention
probabilities, the largest tensor saved for backward.
Costs: the backward uses a piecewise-constant derivative with 2^k levels (3 bits: expected squared
error 1.9e-3 for GELU under N(0, 1) inputs, against a derivative variance of 0.21), plus a cheap
element-wise encode in forward and decode in backward. The forward output is bit-identical: the
original activation module computes it.

Follows Novikov et al., ICML 2023, "Few-Bit Backward: Quantized Gradients of Activation Functions
for Memory Footprint Reduction". Their code (SkoltechAI/fewbit) ships C++/CUDA kernels and
precomputed tables; here the tables are computed by memtrain (``_fewbit_tables``) and the
packing uses plain torch ops, so it runs on any device, under ``FakeTensorMode`` and on meta
tensors, which lets the estimator trace it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain._compat.torch_tools import unset_fake_temporarily
from memtrain.config import FewBitConfig, RunConfig, decided
from memtrain.memory import loops
from memtrain.patches import (
    APPROXIMATE,
    Doc,
    Knob,
    PatchRecord,
    add_records,
    approximate,
    find_modules,
    register,
    set_submodule,
)
from memtrain.patches._fewbit_tables import FUNCTIONS, FewBitTable, fewbit_table
from memtrain.patches._fewbit_tables import derivative as derivative  # public here (docs' tables)
from memtrain.patches._targets import check_every_pattern, default_modules

Config = FewBitConfig

# Elements encoded or decoded per step. The int32 bucket indices, unpacked bit planes and
# looked-up levels of one chunk are temporaries: a chunk bounds them to ~50 MiB rather than 2-3x
# the activation's own size, while keeping the op count low (a fake-tensor trace pays per op).
_CHUNK = 1 << 22


# ------------------------------------------------------------------ which function is it?


def _torch_activation(module: nn.Module) -> str | None:
    if type(module) is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return {nn.SiLU: "silu", nn.ReLU: "relu", nn.Tanh: "tanh"}.get(type(module))


def _transformers_activation(module: nn.Module) -> str | None:
    from transformers import activations as act

    # Exact types only: a subclass may compute something else.
    names: dict[type, str] = {
        act.GELUActivation: "gelu",
        act.GELUTanh: "gelu_tanh",
        act.NewGELUActivation: "gelu_tanh",
        act.FastGELUActivation: "gelu_tanh",
        act.AccurateGELUActivation: "gelu_tanh",
        act.QuickGELUActivation: "quick_gelu",
        act.SiLUActivation: "silu",
    }
    return names.get(type(module))


def _probed_activation(module: nn.Module) -> str | None:
    """Any other parameter-free leaf (a model's own activation class, say): the function whose
    values it reproduces on the probe input, if one does."""
    if type(module) in _NOT_ACTIVATIONS or next(module.children(), None) is not None:
        return None
    if next(module.parameters(), None) is not None:
        return None
    out = _probe(module)
    if out is None:
        return None
    return next((name for name in FUNCTIONS if _same(out, name)), None)


# Parameter-free leaves that are never activations: the probe skips them without calling them.
_NOT_ACTIVATIONS: set[type[nn.Module]] = {nn.Dropout, nn.Identity}

# Dispatch list: the first matcher that names a function wins.
MATCHERS: list[Callable[[nn.Module], str | None]] = [
    _torch_activation, _transformers_activation, _probed_activation]

# Wide enough that a clipped activation (transformers' ClippedGELUActivation(-10, 10)) differs.
_PROBE = (-20.0, 20.0, 801)


def _probe(module: nn.Module) -> torch.Tensor | None:
    """``module`` applied to the probe input, or None when it is no one-tensor element-wise op.

    Real CPU values, also inside a fake-tensor trace or a meta-device context; a module that draws
    random numbers does not move the global RNG.
    """
    with unset_fake_temporarily(), torch.no_grad(), torch.device("cpu"), \
            torch.random.fork_rng(devices=[]):
        probe = torch.linspace(*_PROBE)
        try:
            out = module(probe)
        except Exception:  # any failure means: not an activation module
            return None
    return out if isinstance(out, torch.Tensor) and out.shape == probe.shape else None


def _same(out: torch.Tensor, function: str) -> bool:
    with unset_fake_temporarily(), torch.no_grad(), torch.device("cpu"):
        expected = FUNCTIONS[function](torch.linspace(*_PROBE))
        return out.dtype == expected.dtype and torch.allclose(out, expected, rtol=0, atol=1e-5)


def identify(module: nn.Module) -> str | None:
    """The function (a key of ``_fewbit_tables.FUNCTIONS``) that ``module`` computes, or None.

    Known activation types are matched by type, any other parameter-free leaf module by its
    values. A type's answer is checked on the probe input too, so a module whose type looks right
    but whose forward was swapped (e.g. for another approximation) is not patched with the wrong
    table.
    """
    for matcher in MATCHERS:
        name = matcher(module)
        if name is not None:
            out = _probe(module)
            return name if out is not None and _same(out, name) else None
    return None


# ------------------------------------------------------------------------------ bit packing


def _shifts(n: int, device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(n, dtype=torch.uint8, device=device).view(shape)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack 1-D uint8 codes < 2**bits into a (bits, ceil(n / 8)) uint8 tensor of bit planes.

    Plane b, byte j holds bit b of codes 8j..8j+7. Plain uint8 shifts and sums: no custom
    kernel, so it runs on any device, on meta and under FakeTensorMode.
    """
    pad = -codes.numel() % 8
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    planes = (codes.view(1, -1, 8) >> _shifts(bits, codes.device, (bits, 1, 1))) & 1
    return (planes << _shifts(8, codes.device, (8,))).sum(-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: 1-D uint8 codes (a multiple of 8 of them)."""
    planes = (packed[:, :, None] >> _shifts(8, packed.device, (8,))) & 1
    return (planes << _shifts(bits, packed.device, (bits, 1, 1))).sum(0, dtype=torch.uint8).view(-1)


def encode(x: torch.Tensor, boundaries: torch.Tensor, bits: int) -> torch.Tensor:
    """Interval index of every element of ``x``, bit-packed: ``bits * ceil(numel / 8)`` bytes."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    packed = torch.empty(bits, math.ceil(n / 8), dtype=torch.uint8, device=x.device)
    for _, start, _stop in loops.chunks("fewbit_encode", n, _CHUNK):
        part = flat[start:start + _CHUNK]
        codes = torch.bucketize(part.float(), boundaries, out_int32=True).to(torch.uint8)
        packed[:, start // 8:start // 8 + math.ceil(part.numel() / 8)] = pack_codes(codes, bits)
    return packed


def decode_mul(grad: torch.Tensor, packed: torch.Tensor, levels: torch.Tensor,
               bits: int) -> torch.Tensor:
    """``grad * levels[code]`` element-wise, decoding the codes chunk by chunk."""
    flat = grad.reshape(-1)
    n = flat.numel()
    out = torch.empty_like(flat)
    levels = levels.to(grad.dtype)
    for _, start, end in loops.chunks("fewbit_decode", n, _CHUNK):
        codes = unpack_codes(packed[:, start // 8:math.ceil(end / 8)], bits)[:end - start]
        torch.mul(flat[start:end], levels.index_select(0, codes.int()), out=out[start:end])
    return out.view(grad.shape)


class _FewBitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, inner: nn.Module, boundaries: torch.Tensor,
                levels: torch.Tensor, bits: int) -> torch.Tensor:
        packed = encode(x, boundaries, bits)  # before `inner`: an in-place activation overwrites x
        out = inner(x)
        if out is x:
            ctx.mark_dirty(x)
        ctx.save_for_backward(packed)
        ctx.levels, ctx.bits = levels, bits
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (packed,) = ctx.saved_tensors
        return decode_mul(grad, packed, ctx.levels, ctx.bits), None, None, None, None


class FewBitActivation(nn.Module):
    """An activation whose backward uses a k-bit table; the forward is the wrapped module's."""

    def __init__(self, inner: nn.Module, function: str, bits: int) -> None:
        super().__init__()
        self.inner, self.function, self.bits = inner, function, bits
        self.table: FewBitTable = fewbit_table(function, bits)
        # Stored as the int32 bit patterns of float32 values: `model.to(bf16)` casts floating
        # buffers, which would move the boundaries; integer buffers only change device.
        for name, values in (("boundary_bits", self.table.boundaries),
                             ("level_bits", self.table.levels)):
            as_int = torch.tensor(values, dtype=torch.float32).view(torch.int32)
            self.register_buffer(name, as_int, persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and input.requires_grad):
            return self.inner(input)
        if self.boundary_bits.device != input.device:  # placed by a device map after patching
            self.boundary_bits = self.boundary_bits.to(input.device)
            self.level_bits = self.level_bits.to(input.device)
        return _FewBitFunction.apply(input, self.inner, self.boundary_bits.view(torch.float32),
                                     self.level_bits.view(torch.float32), self.bits)

    def extra_repr(self) -> str:
        return f"function={self.function}, bits={self.bits}, error={self.table.error:.2e}"


def apply(model: nn.Module, cfg: FewBitConfig,
          field: str = "memory.activation_targets") -> nn.Module:
    """Give the targeted activation modules a ``cfg.bits``-bit backward (in place).

    Args:
        model: a (possibly peft-wrapped) transformers model.
        cfg: bits and target name patterns (None: every supported activation module inside the
            model's repeated blocks, see :mod:`memtrain.patches._targets`).
        field: the recipe field named in error messages.

    Raises:
        MemtrainError: no targets given and no supported activation module inside the blocks.
        NoMatchError: the patterns match no supported activation module.
    """
    known: dict[nn.Module, str | None] = {}  # identify() runs the module: once per module

    def function_of(module: nn.Module) -> str | None:
        if module not in known:
            known[module] = identify(module)
        return known[module]

    if cfg.targets:
        found = find_modules(model, cfg.targets, lambda m: function_of(m) is not None, field)
        # a user's pattern that matches nothing is a typo, even if others match
        check_every_pattern(cfg.targets, [name for name, _ in found], field)
    else:
        found = default_modules(model, field, "few-bit backward", "activation module",
                                lambda _, m: function_of(m) is not None)
    originals: dict[str, nn.Module] = {}
    functions: set[str] = set()
    for name, module in found:
        function = function_of(module)
        assert function is not None  # the predicate checked it
        functions.add(function)
        originals[name] = set_submodule(model, name, FewBitActivation(module, function, cfg.bits))

    def undo() -> None:
        for name, module in originals.items():
            set_submodule(model, name, module)

    errors = ", ".join(f"{f} E={fewbit_table(f, cfg.bits).error:.1e}" for f in sorted(functions))
    detail = f"{cfg.bits}-bit activation backward on {len(originals)} modules ({errors})"
    add_records(model, [PatchRecord("fewbit", list(originals), detail, undo)])
    return model


KNOBS = (Knob("memory.activation_bits", approximate(None, 3), None, order=80, exact=False, plugin=True,
              patches_model=True),)
DOC = Doc("few-bit activation backward", "`memory.activation_bits: 3`",
          "saved activations to k bits; approximate gradients", "[approx.md](docs/bench/approx.md)")


@register("fewbit", APPROXIMATE, "memory.activation_bits", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    decided(cfg.memory.activation_bits, "memory.activation_bits", "a number of bits (1-4) or null")
    fewbit = cfg.memory.fewbit
    if fewbit is None:
        return None
    return apply(model, fewbit)
