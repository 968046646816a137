"""Randomized linear backward: save a random sketch of a linear layer's input, not the input.

Saves: a trainable linear layer keeps its input X (N × d_in, N = batch × sequence) to compute its
weight gradient G^T X. This patch keeps S^T X instead, for a random N × k sketch S with
k = ceil(ratio × N) (Gaussian or Rademacher entries, E[S S^T] = k I), plus the integer seed that
generated S: ``ratio`` of the input's bytes. Backward regenerates S from the seed and returns the
unbiased estimate (S^T G)^T (S^T X) / k of the weight gradient; the input gradient G W and the
bias gradient stay exact, and so does the forward output (bit-identical: the same op computes it).
Costs: gradient noise on the weights (variance ~ 1/k), and compute: the weight gradient takes
2 N k (d_in + d_out) + 2 k d_in d_out FLOPs (sketching X and G, then the small product) instead
of 2 N d_in d_out, a factor of about ratio × (1 + N (1/d_in + 1/d_out)). That is a saving only for
short batches of wide layers; at N = 16384 rows of a 384-wide layer it is ~17x the exact weight
gradient (docs/bench/approx.md measures whole steps), plus drawing the N × k sketch twice.
Frozen layers (LoRA base weights, quantized weights) are left alone: without a weight gradient a
plain linear saves no input at all, and this patch never changes that.

Follows Bershatsky et al., 2022, "Memory-Efficient Backpropagation through Large Linear Layers"
(randomized matrix multiplication over the flattened batch axis). Written here rather than taken
from their code so that it runs on every device, under ``FakeTensorMode`` and on meta tensors (the
estimator traces it), regenerates the sketch block by block (the full N × k sketch is never held),
and also covers GPT-2's ``Conv1D`` and peft's LoRA ``lora_A`` linears. A sketched ``lora_A`` runs
through peft's own LoRA layer, not memtrain's lean one (which keeps no copy of the input at all,
:mod:`memtrain.patches.lora`), so on LoRA models the sketch often costs more than it saves; the
estimator traces both and the planner chooses.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from memtrain._compat.torch_tools import is_fake
from memtrain.config import RandomizedLinearConfig, RunConfig, decided
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
from memtrain.patches._targets import check_every_pattern, default_modules

Config = RandomizedLinearConfig

# Sketch elements drawn at a time: bounds the temporary sketch block to 64 MiB in fp32 (the
# whole N x k sketch is 215 MiB at N = 16384, ratio 0.2) while keeping the op count low.
_SKETCH_BLOCK = 1 << 24


# ---------------------------------------------------------------------------------- sketching


def sketch_rows(n: int, ratio: float) -> int:
    """k, the rows of the saved sketch for an input of ``n`` rows."""
    return max(1, min(n, math.ceil(ratio * n)))


def _generator(like: torch.Tensor, seed: int) -> torch.Generator | None:
    """A generator on ``like``'s device; None under fake tensors and on meta (no values drawn)."""
    if is_fake(like) or like.device.type == "meta":
        return None
    return torch.Generator(device=like.device).manual_seed(seed)


def _draw(kind: str, shape: tuple[int, int], gen: torch.Generator | None,
          like: torch.Tensor) -> torch.Tensor:
    if kind == "gaussian":
        return torch.randn(shape, generator=gen, device=like.device, dtype=like.dtype)
    signs = torch.empty(shape, device=like.device, dtype=like.dtype).bernoulli_(0.5, generator=gen)
    return signs.mul_(2).sub_(1)


def sketch_product(m: torch.Tensor, k: int, kind: str, seed: int) -> torch.Tensor:
    """S^T m / sqrt(k) for the (n, k) sketch S that ``seed`` determines; ``m`` is (n, d).

    S is drawn in row blocks from one generator, so the same seed gives the same S whatever ``m``
    is: the forward applies it to the input, the backward to the output gradient. Only one block
    of S exists at a time.
    """
    n = m.shape[0]
    gen = _generator(m, seed)
    step = max(1, _SKETCH_BLOCK // k)
    if n <= step:  # one block: the common case
        return (_draw(kind, (n, k), gen, m).t() @ m).mul_(1 / math.sqrt(k))
    acc: torch.Tensor | None = None
    for _, start, stop in loops.chunks("sketch", n, step):
        block = m[start:stop]
        part = _draw(kind, (block.shape[0], k), gen, m).t() @ block
        # Sum the blocks in at least fp32: bf16 partial sums would lose the small terms.
        if acc is None:
            acc = part.to(torch.promote_types(part.dtype, torch.float32))
        else:
            acc.add_(part)
    assert acc is not None  # n > step >= 1, so the loop ran
    return acc.mul_(1 / math.sqrt(k)).to(part.dtype)  # part.dtype: the matmul's (autocast) dtype


# ------------------------------------------------------------------------ autograd function

# layout -> (forward op, weight as (out, in)): nn.Linear keeps weight (out, in), GPT-2's
# Conv1D keeps it (in, out) and runs addmm; each forward is the layer's own op, bit for bit.
_LAYOUTS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": lambda x, w, b: F.linear(x, w, b),
    "conv1d": lambda x, w, b: torch.addmm(b, x.view(-1, x.size(-1)), w).view(
        *x.shape[:-1], w.shape[1]),
}


class _RandomizedLinearFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layout: str, ratio: float, kind: str, seed: int) -> torch.Tensor:
        out = _LAYOUTS[layout](x, weight, bias)
        rows = x.detach().reshape(-1, x.shape[-1])
        k = sketch_rows(rows.shape[0], ratio)
        proj = sketch_product(rows, k, kind, seed) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(proj, weight)
        ctx.layout, ctx.k, ctx.kind, ctx.seed, ctx.x_shape = layout, k, kind, seed, x.shape
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        proj, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        conv = ctx.layout == "conv1d"
        if ctx.needs_input_grad[0]:
            grad_x = (g @ (weight.t() if conv else weight)).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            proj_g = sketch_product(g, ctx.k, ctx.kind, ctx.seed)
            grad_w = proj.t() @ proj_g if conv else proj_g.t() @ proj
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


class _Randomized:
    """What both layer kinds share: settings, a per-layer seed stream, the forward."""

    layout: str
    ratio: float
    sketch: str
    _seeds: random.Random

    def _setup(self, old: nn.Module, ratio: float, sketch: str, seed: str) -> None:
        self.register_parameter("weight", old.weight)  # type: ignore[attr-defined]
        self.register_parameter("bias", old.bias)  # type: ignore[attr-defined]
        self.train(old.training)  # type: ignore[attr-defined]
        self.ratio, self.sketch = ratio, sketch
        # A private stream: drawing seeds must not move the global RNG (dropout masks would change).
        self._seeds = random.Random(seed)

    def _randomized(self, input: torch.Tensor,
                    plain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        weight: nn.Parameter = self.weight  # type: ignore[attr-defined]
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return plain(input)  # no weight gradient: nothing to sketch (frozen or eval)
        return _RandomizedLinearFunction.apply(input, weight, self.bias,  # type: ignore[attr-defined]
                                               self.layout, self.ratio, self.sketch,
                                               self._seeds.getrandbits(63))


class RandomizedLinear(_Randomized, nn.Linear):
    """``nn.Linear`` with randomized weight-gradient backward; shares the original's parameters."""

    layout = "linear"

    def __init__(self, old: nn.Linear, ratio: float, sketch: str, seed: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = old.in_features, old.out_features
        self._setup(old, ratio, sketch, seed)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._randomized(input, super().forward)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ratio={self.ratio}, sketch={self.sketch}"


class RandomizedConv1D(_Randomized, Conv1D):
    """GPT-2's ``Conv1D`` with randomized weight-gradient backward; shares the parameters."""

    layout = "conv1d"

    def __init__(self, old: Conv1D, ratio: float, sketch: str, seed: str) -> None:
        nn.Module.__init__(self)
        self.nf, self.nx = old.nf, old.nx
        self._setup(old, ratio, sketch, seed)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._randomized(input, super().forward)


def _plain_linear(module: nn.Module) -> type[nn.Module] | None:
    # Exact type: bitsandbytes' Linear4bit/8bitLt subclass nn.Linear but compute differently.
    return RandomizedLinear if type(module) is nn.Linear else None


def _transformers_conv1d(module: nn.Module) -> type[nn.Module] | None:
    return RandomizedConv1D if type(module) is Conv1D else None


# Dispatch list: the first matcher that returns a replacement class wins.
MATCHERS: list[Callable[[nn.Module], type[nn.Module] | None]] = [
    _plain_linear, _transformers_conv1d]


def replacement(module: nn.Module) -> type[nn.Module] | None:
    """The randomized class for a trainable linear-like layer, else None."""
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, nn.Parameter) and weight.requires_grad):
        return None
    return next((cls for m in MATCHERS if (cls := m(module)) is not None), None)


def apply(model: nn.Module, cfg: RandomizedLinearConfig, seed: int = 0,
          field: str = "memory.randomized_linear.targets") -> nn.Module:
    """Give the targeted trainable linear layers a randomized weight-gradient backward (in place).

    The default targets are every trainable linear layer inside the model's repeated blocks
    (:mod:`memtrain.patches._targets`), never the embeddings or the task head. A glob pattern
    naming a LoRA-adapted layer (``attention.self.query``) also selects its trainable ``lora_A``
    linear, whose input is the layer's full-width input. Neither selects ``lora_B``: its input has
    only r columns, so sketching it would save almost nothing and still add gradient noise (target
    ``*.lora_B.*`` explicitly to have it anyway). Frozen layers never match.

    Args:
        model: a (possibly peft-wrapped) transformers model.
        cfg: sketch ratio and kind, target name patterns (None: the blocks' trainable linears).
        seed: seeds the per-layer sketch seed streams (the global RNG is not touched).
        field: the recipe field named in error messages.

    Raises:
        MemtrainError: no targets given and no trainable linear layer inside the blocks.
        NoMatchError: the patterns match no trainable linear layer.
    """
    if cfg.targets:
        patterns = list(cfg.targets) + [q for p in cfg.targets for q in _lora_forms(p)]
        found = find_modules(model, patterns, lambda m: replacement(m) is not None, field)
        # a user's pattern that matches nothing is a typo, even if others match
        check_every_pattern(cfg.targets, [name for name, _ in found], field, _lora_forms)
    else:
        found = default_modules(model, field, "randomized backward", "trainable linear layer",
                                lambda name, m: ".lora_B." not in name and replacement(m) is not None)
    originals: dict[str, nn.Module] = {}
    for name, module in found:
        cls = replacement(module)
        assert cls is not None  # the predicate checked it
        new = cls(module, cfg.ratio, cfg.sketch, f"{seed}:{name}")
        originals[name] = set_submodule(model, name, new)

    def undo() -> None:
        for name, module in originals.items():
            set_submodule(model, name, module)

    detail = f"randomized backward ({cfg.sketch}, ratio {cfg.ratio:g}) on {len(originals)} linears"
    add_records(model, [PatchRecord("randomized_linear", list(originals), detail, undo)])
    return model


def _lora_forms(pattern: str) -> list[str]:
    """The wide-input trainable linear peft puts inside a LoRA-adapted layer ``pattern`` names."""
    return [] if pattern.startswith("re:") else [f"{pattern}.lora_A.*"]


# the setting the planner tries (the recipe's form: `memory.randomized_linear: {ratio: 0.2}`)
APPROX_RANDOMIZED = {"ratio": 0.2, "sketch": "gaussian", "targets": None}
KNOBS = (Knob("memory.randomized_linear", approximate(None, APPROX_RANDOMIZED), None, order=90, exact=False,
              plugin=True, patches_model=True),)
DOC = Doc("randomized linear backward", "`memory.randomized_linear: {ratio: 0.2}`",
          "saved linear inputs to a sketch; approximate gradients", "[approx.md](docs/bench/approx.md)")


@register("randomized_linear", APPROXIMATE, "memory.randomized_linear", config=Config, apply=apply,
          knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    settings = decided(cfg.memory.randomized_linear, "memory.randomized_linear", "{ratio: 0.2} or null")
    if not isinstance(settings, RandomizedLinearConfig):
        return None
    return apply(model, settings, seed=cfg.training.seed)
