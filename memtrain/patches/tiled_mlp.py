"""Tiled MLP: run each decoder MLP over tiles of tokens, recompute each tile in backward.

Saves: a transformer MLP keeps its per-token intermediates for backward, several tensors of
tokens × intermediate (a gated MLP keeps the gate and up projections, the activation and their
product: about 4 × 14,336 values per token and layer on Llama-3.1-8B, 3.5 times as wide as the
hidden state). Here the MLP runs inside one ``torch.autograd.Function``: forward runs the MLP
tile by tile without grad and keeps only the MLP input; backward runs each tile's forward again
with grad and back-propagates it at once, so the intermediates of one tile exist at a time, in
forward and in backward. What is left per layer is the MLP input (one hidden state), and the
transient peak of the MLP shrinks by the number of tiles. Under full checkpointing this is what
remains of a long sequence's activation peak besides attention and the loss (ALST's "floor").

Costs: the MLP's forward runs once more, in backward (about two thirds of a Llama layer's matmul
FLOPs are the MLP's, so roughly +20% of the step's FLOPs). Under full checkpointing add the down
projection, which the layer's recompute would otherwise skip (torch's early stop ends a recompute
after its last saved tensor; the Function saves its input only after all tiles ran); under
selective checkpointing a second MLP forward (see Order). On 4-bit layers bitsandbytes
dequantizes each weight once per tile and pass.

Exact: the tiles are row blocks of the flattened tokens and an MLP treats every token alone, so
outputs and gradients equal the untiled MLP's up to summation order (input gradients are copied
per tile; parameter gradients are the sum over tiles, in the parameter's dtype). Random ops inside
(LoRA dropout) replay the generator state saved in forward; GPT-2's output dropout runs on the
whole output, outside the tiles, so its mask is the untiled one.

Follows ALST (Bekman et al., 2025, arXiv 2506.13996: DeepSpeed's ``TiledMLP``, also in
Liger-Kernel and Unsloth), including its default tile count, ``ceil(tokens / hidden_size)``, so
one tile's intermediate is at most hidden × intermediate values whatever the length. Unlike ALST's
equal tiles, every default tile holds ``hidden_size`` tokens but the last (:func:`tile_size`):
the largest tile then never shrinks as the length grows, and neither does the estimate, so the
longest-length search (``data.max_length: auto``) sees a monotone fit. Written
here rather than imported because those libraries accumulate parameter gradients by calling
``backward`` per tile, which fires gradient hooks once per tile (memtrain's optimizer step
inside backward, FSDP's reduce-scatter); this Function returns the summed gradients, so hooks
fire once. The MLP is found by structure (children that are its projections, an activation and
a dropout), patched in place (module names, LoRA targets and state dicts are unchanged), and any
layer inside it (peft LoRA, bitsandbytes 4-bit, few-bit or randomized layers) is simply called.

Order (stage ``TILING``, after the adapter and approximate layers, before checkpointing): the
tiles call whatever layers the MLP holds when it runs, so the adapter must exist first; the
decoder layer's checkpoint then wraps the tiled MLP. Under full checkpointing the layer keeps its
input, its recompute runs the tiled forward (keeping the MLP input), and the MLP's backward
recomputes per tile. Under selective checkpointing the tiles run inside
:func:`memtrain.patches.checkpointing.never_saved`, or the policy would keep every tile's matmul
outputs, the whole intermediate, until backward; the layer's recompute then runs the tiles again,
so the MLP runs three times a step: full checkpointing is the cheaper partner.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from memtrain.config import RunConfig, decided
from memtrain.errors import MemtrainError
from memtrain.memory import loops
from memtrain.patches import (
    TILING,
    CostInputs,
    Doc,
    Knob,
    ModelShape,
    NoMatchError,
    base_model,
    fixed,
    register,
    undo_records,
)
from memtrain.patches._targets import block_lists
from memtrain.patches.checkpointing import never_saved, recompute_passes, wrap_each

_MARK = "__memtrain_tiled_mlp__"
_ACTIVATIONS = frozenset({"act", "act_fn", "activation_fn", "activation", "dropout"})


@dataclass(frozen=True)
class Config:
    """How each MLP call is tiled: ``tiles`` equal tiles, else tiles of ``tokens`` tokens, the last
    one shorter (None: ``hidden_size`` tokens)."""

    tiles: int | None = None
    tokens: int | None = None


def tile_ladder(hidden: int) -> list[int]:
    """The MLP tile sizes below the default (``hidden`` tokens) the planner tries: a quarter and a
    sixteenth of it (one tile's intermediate exists at a time; 4-bit weights are dequantized once
    per tile and pass, so smaller tiles are slower)."""
    return sorted({max(1, hidden // 4), max(1, hidden // 16)}, reverse=True) if hidden else []


def tile_rank(value: int | None, shape: ModelShape) -> tuple[int, ...]:
    """Memory order of a tile size: smaller tiles keep less (hidden_size (None) < hidden/4 < hidden/16)."""
    return (0,) if value is None else ((2**16 // max(1, int(value))).bit_length() + 1,)


def default_tiles(tokens: int, hidden: int) -> int:
    """ALST's count: ``ceil(tokens / hidden)`` tiles, at least 1 (the default tiles hold ``hidden``
    tokens each but the last, :func:`tile_size`)."""
    return max(1, math.ceil(tokens / max(1, hidden)))


def tile_size(rows: int, hidden: int, tiles: int | None = None, tokens: int | None = None) -> int:
    """Tokens per tile: ``rows / tiles`` rounded up when ``tiles`` is given (equal tiles), else
    ``tokens`` or ``hidden`` (every tile full but the last). Full tiles keep the largest tile, and with it the
    MLP's transient memory, from shrinking as the length grows: ALST's equal tiles are half as
    large just past twice ``hidden`` as just below it, so the fit was not monotone in the length
    (at 8 GiB, Llama-3.1-8B QLoRA fitted 3,584 and 5,888 tokens but not 3,840-4,096)."""
    if tiles is not None:
        return math.ceil(rows / max(1, min(tiles, rows)))
    return max(1, min(rows, tokens or hidden))


def _spans(rows: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, rows)) for start in range(0, rows, max(1, size))]


# ------------------------------------------------------------------------- the Function


@contextlib.contextmanager
def _replayed_rng(state: tuple[torch.Tensor, torch.Tensor | None] | None,
                  device: torch.device) -> Iterator[None]:
    """Run with the generator state saved in forward (nothing to do when ``state`` is None)."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _TiledMLP(torch.autograd.Function):
    """``run(x)`` computed over row tiles of ``x``; only ``x`` is kept for backward.

    ``params`` are the trainable tensors ``run`` uses: they are inputs so that autograd asks for
    their gradients, which backward returns summed over tiles. They are kept on ``ctx`` rather
    than saved: they live anyway, and saving them would pass them through saved-tensor hooks
    (offload would copy the weights to the host).
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                size: int, random: bool, *params: torch.Tensor) -> torch.Tensor:
        device = x.device
        ctx.run, ctx.params, ctx.size = run, params, size
        ctx.rng = None
        if random:
            ctx.rng = (torch.get_rng_state(),
                       torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        ctx.autocast = None  # recomputed under the autocast state forward ran in
        if torch.amp.is_autocast_available(device.type):  # not on meta
            ctx.autocast = (device.type, torch.get_autocast_dtype(device.type),
                            torch.is_autocast_enabled(device.type))
        ctx.save_for_backward(x)
        flat = x.detach().reshape(-1, x.shape[-1])  # tiles that look like no-grad tensors to hooks
        out = rows = None
        with never_saved():
            for _, start, stop in loops.chunks("tiled_mlp", flat.shape[0], size, keep=loops.LEAN_KEEP):
                y = run(flat[start:stop])
                if out is None:
                    # allocated in its final shape and returned as is: a view returned from a custom
                    # Function may not be changed in place, and Falcon adds to its MLP's output in place
                    out = y.new_empty((*x.shape[:-1], y.shape[-1]))
                    rows = out.view(-1, y.shape[-1])
                rows[start:stop] = y
        assert out is not None  # at least one tile: x has at least one row
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat_x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        amp = torch.autocast(*ctx.autocast) if ctx.autocast is not None else contextlib.nullcontext()
        with _replayed_rng(ctx.rng, x.device), torch.enable_grad(), amp:
            for _, start, stop in loops.chunks("tiled_mlp_backward", flat_x.shape[0], ctx.size):
                piece = flat_x[start:stop].detach().requires_grad_(need_x)
                # The MLP gets a view, not the leaf: module hooks that watch input gradients
                # (FlopCounterMode's ModuleTracker) cannot take a leaf inside autograd.grad.
                y = ctx.run(piece.view_as(piece) if need_x else piece)
                inputs = ([piece] if need_x else []) + [ctx.params[i] for i in wanted]
                grads = list(torch.autograd.grad(y, inputs, flat_g[start:stop], allow_unused=True))
                if grad_x is not None:
                    grad_x[start:stop] = grads.pop(0)
                for k, grad in enumerate(grads):
                    if grad is not None:
                        sums[k] = grad if sums[k] is None else sums[k].add_(grad)  # type: ignore[union-attr]
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        for k, i in enumerate(wanted):
            param_grads[i] = sums[k]
        return (None, None if grad_x is None else grad_x.view(x.shape), None, None, *param_grads)


def tiled(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: list[torch.Tensor],
          tiles: int | None = None, random: bool = False, tokens: int | None = None) -> torch.Tensor:
    """``run(x)`` for a per-token ``run``, computed tile by tile (see the module docstring).

    Args:
        run: a function of one tensor that treats each row (token) alone.
        x: its input, ``(..., hidden)``.
        params: the trainable tensors ``run`` uses (their gradients are returned to autograd).
        tiles: number of equal row tiles (default: tiles of ``hidden`` rows, :func:`tile_size`).
        random: ``run`` draws random numbers (dropout): save the generator state to replay.
        tokens: rows per tile when ``tiles`` is None (default: ``hidden``, the last dimension).
    """
    size = tile_size(x.numel() // x.shape[-1], x.shape[-1], tiles, tokens)
    return _TiledMLP.apply(run, x, size, random, *params)


# ------------------------------------------------------------------- which modules tile


@dataclass(frozen=True)
class Kind:
    """How one family of MLP module is tiled: the projections that identify it, and whether its
    last child (dropout) runs on the whole output instead of per tile."""

    name: str
    projections: tuple[str, ...]
    dropout_outside: bool = False


# First match wins; a module matches when these projections are modules and every other child
# is an activation or a dropout (so a decoder layer that holds fc1/fc2 itself, as OPT's does,
# never matches: its attention would be tiled over tokens).
KINDS: tuple[Kind, ...] = (
    Kind("gated", ("gate_proj", "up_proj", "down_proj")),  # Llama, Mistral, Qwen2, Gemma, ...
    Kind("gated-fused", ("gate_up_proj", "down_proj")),  # Phi-3
    Kind("gpt2", ("c_fc", "c_proj"), dropout_outside=True),
    Kind("two-layer", ("fc1", "fc2")),  # Phi
    Kind("two-layer", ("dense_h_to_4h", "dense_4h_to_h")),  # GPT-NeoX, Falcon
)


def kind_of(module: nn.Module) -> Kind | None:
    """The first :data:`KINDS` entry ``module`` is an MLP of, or None."""
    children = dict(module.named_children())
    for kind in KINDS:
        if all(isinstance(children.get(p), nn.Module) for p in kind.projections) \
                and set(children) - set(kind.projections) <= _ACTIVATIONS:
            return kind
    return None


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module, Kind]]:
    """The MLP modules inside the model's repeated blocks, outermost only, in model order.

    Raises:
        NoMatchError: none exists; the message names ``memory.tiled_mlp`` and the fix.
    """
    prefixes = tuple(f"{outer}." for outer in block_lists(model))
    found: list[tuple[str, nn.Module, Kind]] = []
    for name, module in model.named_modules():
        if not name.startswith(prefixes) or any(name.startswith(f"{n}.") for n, _, _ in found):
            continue
        kind = kind_of(module)
        if kind is not None:
            found.append((name, module, kind))
    if not found:
        inner = base_model(model)
        where = ", ".join(p[:-1] for p in prefixes) or "none: the model has no nn.ModuleList of layers"
        shapes = "; ".join("/".join(k.projections) for k in KINDS)
        raise NoMatchError(
            f"`memory.tiled_mlp`: got true, but {type(inner).__name__} has no MLP module this patch "
            f"can tile inside its repeated blocks ({where}); it tiles modules whose children are "
            f"the projections {shapes} plus an activation or dropout. "
            "Fix: set `memory.tiled_mlp: false` for this architecture.")
    return found


def mlp_weights(model: nn.Module) -> list[int]:
    """Weight elements (``in x out``) of each MLP's projections, per MLP in model order: what one
    more MLP forward multiplies (2 FLOPs each per token) and what a 4-bit MLP dequantizes per pass.
    Reads each projection's ``in_features`` and ``out_features`` (``nn.Linear``, bitsandbytes' and
    peft's layers) or its 2-D weight's shape (GPT-2's ``Conv1D``); adapters are left out.

    Raises:
        NoMatchError: the model has no MLP this patch can tile (:func:`find_mlps`).
    """
    def elements(layer: nn.Module) -> int:
        inner, outer = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
        if isinstance(inner, int) and isinstance(outer, int):
            return inner * outer
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[0] * weight.shape[1])
        return 0

    return [sum(elements(getattr(m, p)) for p in kind.projections) for _, m, kind in find_mlps(model)]


# ----------------------------------------------------------------------------- patching


def _random(module: nn.Module, skip: nn.Module | None) -> bool:
    """Does ``module`` (except ``skip``) hold a dropout that is active now?"""
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training
               for m in module.modules() if m is not skip)


def _tiling(module: nn.Module, kind: Kind, tiles: int | None, tokens: int | None
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The forward wrapper of one MLP: tiled while it trains with grad, its own forward otherwise."""

    def make(forward: Callable[..., Any]) -> Callable[..., Any]:
        dropout: nn.Module | None = None
        run: Callable[[torch.Tensor], torch.Tensor] = forward
        act = next((n for n, _ in module.named_children() if n in _ACTIVATIONS - {"dropout"}), None)
        outside = getattr(module, "dropout", None) if kind.dropout_outside else None
        if act is not None and isinstance(outside, nn.Module):
            first, last = kind.projections  # looked up at each call: a later patch may replace one
            dropout = outside
            run = lambda t: getattr(module, last)(getattr(module, act)(getattr(module, first)(t)))  # noqa: E731

        @functools.wraps(forward)
        def tiled_forward(*args: Any, **kwargs: Any) -> Any:
            values = [*args, *kwargs.values()]
            x = values[0] if len(values) == 1 and isinstance(values[0], torch.Tensor) else None
            if x is None or x.dim() < 2 or not (module.training and torch.is_grad_enabled()):
                return forward(*args, **kwargs)
            params = [p for p in module.parameters() if p.requires_grad]
            if not (params or x.requires_grad):
                return forward(*args, **kwargs)
            out = tiled(run, x, params, tiles, _random(module, dropout), tokens)
            return dropout(out) if dropout is not None else out

        setattr(tiled_forward, _MARK, True)
        return tiled_forward

    return make


def apply(model: nn.Module, config: Config | int | None = None, tokens: int | None = None) -> nn.Module:
    """Tile every MLP inside the model's repeated blocks (see the module docstring).

    Args:
        model: a transformers model, possibly wrapped by peft and/or quantized.
        config: a :class:`Config`; or, as before it, ``tiles`` (equal tiles per MLP call; None: tiles
            of ``tokens`` tokens, the last one shorter) with ``tokens`` (None: ``hidden_size``).

    Returns:
        The same model, patched in place; its record's ``undo`` (or :func:`undo`) reverts it.

    Raises:
        NoMatchError: the model has no MLP module this patch knows.
        MemtrainError: ``tiles`` or ``tokens`` is not a positive integer.
    """
    tiles = config.tiles if isinstance(config, Config) else config
    tokens = config.tokens if isinstance(config, Config) else tokens
    for name, value in (("tiled_mlp_tiles", tiles), ("tiled_mlp_tile_tokens", tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MemtrainError(f"`memory.{name}` must be a positive integer or null, got {value!r}. "
                                "Fix: use e.g. 4 tiles or 1024 tokens, or null for tiles of hidden_size "
                                "tokens.")
    mlps = [(n, m, k) for n, m, k in find_mlps(model)
            if not getattr(m.__dict__.get("forward"), _MARK, False)]
    if not mlps:
        return model  # patched already (prepare_for_budget run twice on one model)
    kind_of = {id(m): k for _, m, k in mlps}
    kinds = sorted({k.name for _, _, k in mlps})
    size = (f"{tiles} tiles" if tiles is not None else
            f"tiles of {tokens if tokens is not None else 'hidden_size'} tokens")
    detail = f"tiled MLP: {len(mlps)} {'/'.join(kinds)} MLPs, {size}"
    return wrap_each(model, "tiled_mlp", [(n, m) for n, m, _ in mlps],
                     lambda m: _tiling(m, kind_of[id(m)], tiles, tokens), detail)


def undo(model: nn.Module) -> nn.Module:
    """Remove the tiling this module applied to ``model``."""
    return undo_records(model, "tiled_mlp")


def tiled_dequantized(weights: int, hidden: int, tokens: int, tiles: int | None, tile_tokens: int | None,
                      recompute_passes: float) -> int:
    """4-bit MLP weight elements the tiled MLP dequantizes beyond the untiled passes, for one
    micro-batch of ``tokens`` tokens: each tile runs the MLP in forward, in the layer's recompute
    and twice in backward (its recompute with grad, then the backward), where the untiled MLP
    dequantizes once per pass (``memtrain.plan.costmodel.step_seconds``' ``extra_dequantized``).
    ``weights``: the elements of every MLP's projections (:func:`mlp_weights`)."""
    count = tiles or math.ceil(tokens / max(1, int(tile_tokens or hidden or tokens)))
    return int(weights * max(0.0, count * (3 + recompute_passes) - (2 + recompute_passes)))


def tiled_recompute_flops(weights: int, tokens: int) -> float:
    """Matmul FLOPs the tiled MLP adds to a micro-batch of ``tokens`` tokens, at least: each tile's
    forward runs once more in backward (its Function keeps only the input), checkpointed or not,
    so one more forward of every MLP projection (``weights`` elements, 2 FLOPs each per token).
    A trace without the tiling does not see them; the planner's lower bound adds them."""
    return 2.0 * weights * tokens


def model_mlp_weights(inputs: CostInputs) -> int:
    """Elements of every MLP projection of the candidate's model, at least: the lightest of the cost
    model's layers' MLPs times the depth; 0 where no MLP can be tiled."""
    model = inputs.model()
    if model is None:
        return 0
    if (known := _MLP_WEIGHTS.get(model)) is None:
        try:
            per_layer = mlp_weights(model)
        except NoMatchError:
            per_layer = []
        known = _MLP_WEIGHTS[model] = min(per_layer) if per_layer else 0
    return known * inputs.shape.depth


_MLP_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # per cost model


def _cost(inputs: CostInputs, value: Any) -> dict[str, float]:
    """The 4-bit weights dequantized once per tile and pass; a lower bound traced without the
    tiling adds each tile's second forward."""
    if value is not True:
        return {}
    cfg, terms = inputs.cfg, {}
    if cfg.model.quantization not in ("none", "auto"):
        passes = recompute_passes(cfg.memory.checkpointing, inputs.shape.depth)
        terms["extra_dequantized"] = float(tiled_dequantized(
            model_mlp_weights(inputs), inputs.shape.hidden, inputs.tokens, cfg.memory.tiled_mlp_tiles,
            cfg.memory.tiled_mlp_tile_tokens, passes))
    if inputs.traced is not None and inputs.traced.memory.tiled_mlp is not True:
        terms["extra_flops"] = tiled_recompute_flops(model_mlp_weights(inputs), inputs.tokens)
    return terms


KNOBS = (
    # keeps only each MLP's input; one more MLP forward (4-bit weights dequantized once per tile)
    Knob("memory.tiled_mlp", fixed(False, True), False, order=130, plugin=True, patches_model=True,
         cost=_cost, slower_when_leaner=True, unordered_time_offloaded=True, holds_same=True),
    # smaller tiles: more launches and dequantizations for the same work
    Knob("memory.tiled_mlp_tile_tokens", lambda cfg, shape: [None, *tile_ladder(shape.hidden)], None,
         order=140, rank=tile_rank, plugin=True, sizes="memory.tiled_mlp", slower_when_leaner=True,
         holds_same=True),
)
DOC = Doc("tiled MLP",
          "`memory.tiled_mlp: true`, `memory.tiled_mlp_tile_tokens: auto` (tile sized from the budget)",
          "the MLP's wide intermediate for one sequence tile at a time; one extra MLP forward",
          "[tiled_mlp.md](docs/bench/tiled_mlp.md), [tile_size.md](docs/bench/tile_size.md)")


@register("tiled_mlp", TILING, "memory.tiled_mlp", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    if not decided(cfg.memory.tiled_mlp, "memory.tiled_mlp", "true or false"):
        return None
    tokens = decided(cfg.memory.tiled_mlp_tile_tokens, "memory.tiled_mlp_tile_tokens", "a number or null")
    return apply(model, Config(cfg.memory.tiled_mlp_tiles, tokens))
