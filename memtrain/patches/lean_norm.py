"""Lean RMSNorm: keep only a norm's input and one fp32 number per token for backward.

Saves: transformers' RMSNorms compute in fp32 (``x.float()``, ``pow(2).mean``, ``x * rsqrt``,
then the weight), and autograd keeps what each op needs: the fp32 copy of the input, the
normalized fp32 tensor and the cast result, three to four tokens × hidden tensors per norm, twice
the input's bytes each in fp32. At 65,536 tokens of Llama-3.1-8B one fp32 copy is 1 GiB, and
under full checkpointing the recompute and backward of one layer hold several of them at the
step's peak. Here a norm runs inside one ``torch.autograd.Function`` that saves its input as
given (bf16 stays bf16; under checkpointing it is the layer input or the residual sum, which live
anyway) and ``rstd``, the reciprocal root mean square, one fp32 value per token. Forward and
backward both work over tiles of tokens (``hidden`` tokens each, ALST's rule), so at most one
tile's fp32 intermediates exist at any moment.

Costs: backward recomputes ``x.float() * rstd`` per tile (element-wise, no matmul FLOPs) and each
tile is a few more kernel launches (about 16 tiles per norm at 64k tokens of a 4096-wide model).

Exact: forward runs the model's own ops in the model's order on each tile (the statistics of a
token depend on that token alone), so outputs are bit-identical to the module's in fp32 and bf16.
Backward is the analytic RMSNorm gradient, all in fp32 per tile: ``g_n = g · (offset + w)``,
``dx = rstd · (g_n - n · mean(g_n · n))`` with ``n = x · rstd``, cast to the input's dtype once;
the weight gradient ``Σ g · n`` (``n.to(dtype)`` where the module casts before the weight) is
summed over tiles in fp32 and cast to the weight's dtype once (skipped when the weight is frozen,
as under LoRA and QLoRA). Gradients equal autograd's up to fp32 rounding; in bf16 they differ from
autograd's by the bf16 roundings autograd makes in between (``w · g`` and ``g · y`` rounded to
bf16 before their fp32 use), one rounding less than autograd's.

Follows Liger-Kernel's ``LigerRMSNorm`` and Unsloth's ``fast_rms_layernorm`` (both save the input
and ``rstd`` and compute backward from them, with the ``casting_mode`` and Gemma's ``1 + weight``
offset that match each model). Written in pure PyTorch rather than imported because those are
Triton kernels: they need CUDA, so neither the CPU tests nor the fake-tensor estimator could run
them, and the estimate would not be the step that trains.

Which norms: a norm is matched when its class's ``forward`` (and Gemma's ``_norm``) compiles to
the same code as one of the reference implementations below, copies of transformers'
``LlamaRMSNorm`` (142 norm classes of transformers 5.24 share its code: Mistral, Qwen2/3, Phi-3,
Granite, ...), ``GemmaRMSNorm`` (13: Gemma 1-3, Qwen3-Next: ``(x · (1 + w)).to(dtype)``),
``Olmo2RMSNorm`` (12: weight before the cast) and ``T5LayerNorm`` (10). A norm that does
anything else, even slightly, is left alone instead of being given other math. Not covered:
Cohere's mean-subtracting LayerNorm (its QK-norm has a 2-D weight), Gemma 3n/4
(``pow(ms, -0.5)``), ``nn.LayerNorm`` (torch's kernel already saves only the input, mean and
rstd).

Order (stage ``TILING``, like the tiled MLP: a lean re-implementation of a per-token layer): after
the adapter, whose k-bit preparation may change norm dtypes; before checkpointing, which wraps
layers whose contents are final. The norms are patched in place, so module names and state dicts
do not change. Under selective checkpointing the Function runs inside
:func:`memtrain.patches.checkpointing.never_saved`: it keeps what it needs itself.
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from memtrain.config import RunConfig, decided
from memtrain.errors import MemtrainError
from memtrain.memory import loops
from memtrain.patches import TILING, Doc, Knob, NoMatchError, base_model, fixed, register, undo_records
from memtrain.patches.checkpointing import never_saved, wrap_each

_MARK = "__memtrain_lean_norm__"
_HALF = (torch.float16, torch.bfloat16)

# --------------------------------------------------------- reference implementations (transformers')
# Verbatim copies, compared by their compiled code (kind_of), never called.


def _llama_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _olmo2_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


def _t5_forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states


@dataclass(frozen=True)
class Kind:
    """One family of RMSNorm: the code that identifies it and how it scales and casts.

    ``scale_first``: ``(n · (offset + w)).to(x.dtype)`` (Gemma, OLMo 2); otherwise
    ``w · n.to(cast)``, where ``cast`` is the input's dtype (Llama) or, for T5, the weight's
    dtype when it is half precision and fp32 otherwise.
    """

    name: str
    methods: dict[str, Callable[..., Any]] = field(hash=False)
    eps: str
    scale_first: bool = False
    offset: float = 0.0
    cast_to_weight: bool = False


# First match wins.
KINDS: tuple[Kind, ...] = (
    Kind("llama", {"forward": _llama_forward}, "variance_epsilon"),
    Kind("gemma", {"forward": _gemma_forward, "_norm": _gemma_norm}, "eps", scale_first=True, offset=1.0),
    Kind("olmo2", {"forward": _olmo2_forward}, "variance_epsilon", scale_first=True),
    Kind("t5", {"forward": _t5_forward}, "variance_epsilon", cast_to_weight=True),
)


@functools.cache
def _code(fn: Any) -> tuple[Any, ...] | None:
    """``fn``'s instructions, local variables by slot (so their names do not matter)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return tuple((i.opname, i.arg if "FAST" in i.opname else i.argval)
                 for i in dis.get_instructions(code) if i.opname not in ("NOP", "CACHE"))


def kind_of(module: nn.Module) -> Kind | None:
    """The first :data:`KINDS` entry whose reference code ``module``'s class runs, or None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    for kind in KINDS:
        if isinstance(getattr(module, kind.eps, None), float) and all(
                _code(getattr(type(module), name, None)) == _code(ref) for name, ref in kind.methods.items()):
            return kind
    return None


# ------------------------------------------------------------------------------- the Function


class _LeanNorm(torch.autograd.Function):
    """The module's RMSNorm over row tiles; saves ``x`` and ``rstd`` (fp32, one per row)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, kind: Kind, eps: float,
                tile: int) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        cast = (weight.dtype if weight.dtype in _HALF else torch.float32) if kind.cast_to_weight else x.dtype
        scale = weight.float() + kind.offset if kind.offset else weight.float()  # no +0.0: keeps -0.0
        out_dtype = x.dtype if kind.scale_first else torch.promote_types(weight.dtype, cast)
        out = flat.new_empty(flat.shape, dtype=out_dtype)
        rstd = flat.new_empty((flat.shape[0], 1), dtype=torch.float32)
        with never_saved():
            for _, start, stop in loops.chunks("lean_norm", flat.shape[0], tile, keep=loops.LEAN_KEEP):
                xf = flat[start:stop].to(torch.float32)
                r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                normed = xf * r
                if kind.scale_first:  # (n · s).to(x.dtype): the copy into `out` is the cast
                    out[start:stop] = normed.mul_(scale)
                else:
                    torch.mul(weight, normed.to(cast), out=out[start:stop])
                rstd[start:stop] = r
        ctx.save_for_backward(x, rstd)
        ctx.weight, ctx.scale, ctx.kind, ctx.cast, ctx.tile = weight, scale, kind, cast, tile
        return out.view(*x.shape[:-1], x.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, rstd = ctx.saved_tensors
        kind, weight, need_x, need_w = ctx.kind, ctx.weight, *ctx.needs_input_grad[:2]
        flat, grads = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        tiles = loops.chunks("lean_norm_backward", flat.shape[0], ctx.tile, keep=loops.LEAN_KEEP)
        for _, start, stop in tiles:
            r = rstd[start:stop]
            normed = flat[start:stop] * r  # fp32: forward's x.float() * rstd
            g = grads[start:stop].to(torch.float32, copy=True)  # its own buffer: changed in place
            if grad_w is not None:  # the weight multiplies n (Gemma, OLMo 2) or n.to(cast) (Llama, T5)
                grad_w += (g * (normed if kind.scale_first else normed.to(ctx.cast))).sum(0)
            g.mul_(ctx.scale)  # the gradient of n: g · (offset + w), in fp32
            if grad_x is not None:
                dot = (g * normed).mean(-1, keepdim=True)
                grad_x[start:stop] = g.sub_(normed.mul_(dot)).mul_(r)  # the copy casts to x.dtype
            del normed, g
        return (None if grad_x is None else grad_x.view(x.shape),
                None if grad_w is None else grad_w.to(weight.dtype), None, None, None)


def lean_norm(x: torch.Tensor, weight: torch.Tensor, kind: Kind, eps: float,
              tile: int | None = None) -> torch.Tensor:
    """The RMSNorm of ``kind`` on ``x`` (see the module docstring); ``tile`` rows per tile,
    default ``hidden`` (``x.shape[-1]``)."""
    return _LeanNorm.apply(x, weight, kind, eps, tile or x.shape[-1])


# ----------------------------------------------------------------------------------- patching


def find_norms(model: nn.Module) -> list[tuple[str, nn.Module, Kind]]:
    """Every norm of the model this patch knows, in model order (the final norm and QK-norms too).

    Raises:
        NoMatchError: none exists; the message names ``memory.lean_norm`` and the fix.
    """
    found = [(n, m, k) for n, m in model.named_modules() if (k := kind_of(m)) is not None]
    if not found:
        inner = base_model(model)
        norms = sorted({type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()})
        raise NoMatchError(
            f"`memory.lean_norm`: got true, but {type(inner).__name__} has no norm this patch knows "
            f"(its norm classes: {', '.join(norms) or 'none'}); it replaces norms that compute what "
            "transformers' LlamaRMSNorm, GemmaRMSNorm, Olmo2RMSNorm or T5LayerNorm compute. "
            "Fix: set `memory.lean_norm: false` for this architecture.")
    return found


def _leaning(module: nn.Module, kind: Kind, tile: int | None
             ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def lean_forward(*args: Any, **kwargs: Any) -> Any:
            values = [*args, *kwargs.values()]
            x = values[0] if len(values) == 1 and isinstance(values[0], torch.Tensor) else None
            weight = module.weight
            if x is None or x.dim() < 1 or not torch.is_grad_enabled() \
                    or not (x.requires_grad or weight.requires_grad):
                return forward(*args, **kwargs)  # inference: the module's own forward
            return lean_norm(x, weight, kind, getattr(module, kind.eps), tile)

        setattr(lean_forward, _MARK, True)
        return lean_forward

    return make


@dataclass(frozen=True)
class Config:
    """Rows (tokens) per tile of a norm's backward; None: the norm's width (``hidden`` tokens)."""

    tile: int | None = None


def apply(model: nn.Module, config: Config | int | None = None) -> nn.Module:
    """Make every supported RMSNorm of ``model`` lean (see the module docstring).

    Args:
        model: a transformers model, possibly wrapped by peft and/or quantized.
        config: a :class:`Config`, or its ``tile`` alone.

    Returns:
        The same model, patched in place; :func:`undo` reverts it.

    Raises:
        NoMatchError: the model has no norm this patch knows.
        MemtrainError: ``tile`` is not a positive integer.
    """
    tile = config.tile if isinstance(config, Config) else config
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise MemtrainError(f"lean norm: `tile` must be a positive integer or None, got {tile!r}.")
    norms = [(n, m, k) for n, m, k in find_norms(model)
             if not getattr(m.__dict__.get("forward"), _MARK, False)]
    if not norms:
        return model  # patched already
    kind_of = {id(m): k for _, m, k in norms}
    kinds = sorted({k.name for _, _, k in norms})
    detail = (f"lean norm: {len(norms)} {'/'.join(kinds)} RMSNorms keep input + rstd, "
              f"{tile or 'hidden'} tokens per tile")
    return wrap_each(model, "lean_norm", [(n, m) for n, m, _ in norms],
                     lambda m: _leaning(m, kind_of[id(m)], tile), detail)


def undo(model: nn.Module) -> nn.Module:
    """Remove what this module applied to ``model``."""
    return undo_records(model, "lean_norm")


# keeps each norm's input and rstd; element-wise recompute
# unordered under offload: at 14,336 tokens (Llama-3.1-8B QLoRA) it kept 1 MiB more than the plain
# norm (scripts/bench/planner/dominance.py)
KNOBS = (Knob("memory.lean_norm", fixed(False, True), False, order=150, plugin=True, patches_model=True,
              lowers_cost=True, unordered_offloaded=True, holds_same=True),)
DOC = Doc("lean RMSNorm", "`memory.lean_norm: true`",
          "each norm keeps its input and rstd, not its fp32 intermediates; element-wise recompute",
          "[lean_norm.md](docs/bench/lean_norm.md)")


@register("lean_norm", TILING, "memory.lean_norm", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if not decided(cfg.memory.lean_norm, "memory.lean_norm", "true or false"):
        return None
    return apply(model, Config())
