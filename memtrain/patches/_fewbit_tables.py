"""Optimal piecewise-constant derivatives for few-bit activation backward (Novikov et al., 2023).

For an element-wise activation f and a budget of k bits, few-bit backward replaces f'(x) by a
step function q(x) with 2^k steps: the real line is cut at 2^k - 1 boundaries, and every interval
gets one level. The forward stores only the interval index of each input (k bits); the backward
multiplies the incoming gradient by that interval's level.

Boundaries and levels minimise the weighted L2 error of the derivative

    E = ∫ (f'(x) - q(x))^2 p(x) dx,        p = standard normal density,

which is the expected squared gradient error for unit upstream gradients and N(0, 1) inputs. For
fixed intervals the best level is the p-weighted mean of f' over the interval, so only the
boundaries need searching: exact dynamic programming over a grid of 0.01-wide bins on [-5, 5]
finds the best partition of the grid into 2^k contiguous intervals.
Lloyd iterations would be simpler but quantize the *values* of f', which for non-monotone
derivatives (GELU, SiLU) does not give contiguous intervals of x; the DP does, and is optimal on
its grid. The levels and the reported error are then recomputed by a much finer quadrature, so
the error printed in the docs is the error of the exact table that the patch uses.

Tables are computed by memtrain itself on first use (0.1-1 s on a laptop CPU core, most for 4 bits)
and cached per process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from memtrain._compat.torch_tools import unset_fake_temporarily

# Functions few-bit backward knows, by the name the patch's matchers return. Each is the exact
# forward of the activation modules mapped to it (see fewbit.py); derivatives come from autograd.
FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
    "tanh": torch.tanh,
}

_SPAN = 8.0  # integrals cover [-8, 8]: the normal mass outside is ~1e-15
_CUT_SPAN = 5.0  # boundaries lie in [-5, 5] (mass outside: 6e-7); the rest folds into end bins
_BIN = 0.01  # DP resolution: boundaries are multiples of 0.01
_FINE = 160_000  # midpoint-rule cells for the final levels and error: width 1e-4, so every
# possible boundary (a multiple of 0.01) is a cell edge and no cell straddles two intervals


@dataclass(frozen=True)
class FewBitTable:
    """A k-bit piecewise-constant derivative: interval i is (boundaries[i-1], boundaries[i]].

    Attributes:
        function: name of the activation (a key of ``FUNCTIONS``).
        bits: bits per element; there are ``2**bits`` levels and ``2**bits - 1`` boundaries.
        boundaries: increasing interval boundaries.
        levels: the derivative used in each interval (p-weighted mean of f' over it).
        error: E = ∫ (f' - q)^2 p dx for this table.
        variance: ∫ (f' - mean f')^2 p dx, the error of a 0-bit table, to put ``error`` in scale.
    """

    function: str
    bits: int
    boundaries: tuple[float, ...]
    levels: tuple[float, ...]
    error: float
    variance: float


def derivative(function: str, x: torch.Tensor) -> torch.Tensor:
    """f'(x) of a known activation, by autograd (x is not modified)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(FUNCTIONS[function](x).sum(), x)
    return grad


def normal_pdf(x: torch.Tensor) -> torch.Tensor:
    """The standard normal density."""
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@cache
def fewbit_table(function: str, bits: int) -> FewBitTable:
    """The optimal ``bits``-bit table for ``function`` under a standard normal input.

    Raises:
        KeyError: unknown function (the patch only asks for names it matched).
        ValueError: ``bits`` outside 1..4.
    """
    if function not in FUNCTIONS:
        raise KeyError(f"no few-bit table for {function!r}; known: {', '.join(FUNCTIONS)}")
    if not 1 <= bits <= 4:
        raise ValueError(f"few-bit tables have 1 to 4 bits, got {bits}")
    # Real CPU tensors even when asked from inside a fake-tensor trace (the estimator) or a
    # meta-device context: the table is data, not part of the traced step.
    with unset_fake_temporarily(), torch.inference_mode(False), torch.device("cpu"):
        cuts = _optimal_cuts(function, 2**bits)
        # Rounded so the middle edge is exactly 0.0 (ReLU'(0) = 0 must stay in the left interval).
        boundaries = tuple(round(-_CUT_SPAN + c * _BIN, 9) for c in cuts)
        levels, error, variance = _levels_and_error(function, boundaries)
    return FewBitTable(function, bits, boundaries, levels, error, variance)


def _bin_moments(function: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per DP bin: ∫p, ∫f'p and ∫f'^2 p, by Simpson's rule on 8 sub-intervals per 0.01.

    The first and last bins also hold the tails [-8, -5] and [5, 8].
    """
    sub, bins = 8, round(2 * _SPAN / _BIN)
    x = torch.linspace(-_SPAN, _SPAN, bins * sub + 1, dtype=torch.float64)
    d, p = derivative(function, x), normal_pdf(x)
    simpson = torch.ones(sub + 1, dtype=torch.float64)
    simpson[1:-1:2], simpson[2:-1:2] = 4.0, 2.0
    simpson *= (x[1] - x[0]) / 3
    # unfold: one window of sub + 1 points per bin (neighbouring bins share their edge point)
    tail = round((_SPAN - _CUT_SPAN) / _BIN)
    moments = []
    for v in (p, d * p, d * d * p):
        per_bin = (v.unfold(0, sub + 1, sub) * simpson).sum(1)
        inner = per_bin[tail:bins - tail].clone()
        inner[0] += per_bin[:tail].sum()
        inner[-1] += per_bin[bins - tail:].sum()
        moments.append(inner)
    return moments[0], moments[1], moments[2]


def _optimal_cuts(function: str, intervals: int) -> list[int]:
    """Indices of the DP grid edges (-5, -4.99, ..., 5) where the optimal intervals meet."""
    mass, first, second = _bin_moments(function)
    bins = mass.numel()
    zero = torch.zeros(1, dtype=torch.float64)
    cum_w, cum_1, cum_2 = (torch.cat([zero, m.cumsum(0)]) for m in (mass, first, second))
    # cost[a, b]: weighted variance of f' over bins a..b-1 (interval between edges a and b).
    w = cum_w[None, :] - cum_w[:, None]
    s1 = cum_1[None, :] - cum_1[:, None]
    s2 = cum_2[None, :] - cum_2[:, None]
    cost = s2 - s1 * s1 / w.clamp_min(1e-300)
    a, b = torch.meshgrid(torch.arange(bins + 1), torch.arange(bins + 1), indexing="ij")
    cost = torch.where(b > a, cost.clamp_min(0.0), torch.inf)
    best = cost[0].clone()  # best[b]: one interval covering bins 0..b-1
    choices = []
    for _ in range(intervals - 1):
        totals = best[:, None] + cost  # end the previous intervals at a, add interval a..b
        best, arg = totals.min(0)
        choices.append(arg)
    cuts, end = [], bins
    for arg in reversed(choices):
        end = int(arg[end])
        cuts.append(end)
    return sorted(cuts)


def _levels_and_error(function: str, boundaries: tuple[float, ...]
                      ) -> tuple[tuple[float, ...], float, float]:
    """Levels (weighted means of f') and the error, by the midpoint rule on a fine grid."""
    h = 2 * _SPAN / _FINE
    x = -_SPAN + h * (torch.arange(_FINE, dtype=torch.float64) + 0.5)
    d = derivative(function, x)
    weight = normal_pdf(x) * h
    index = torch.bucketize(x, torch.tensor(boundaries, dtype=torch.float64))
    mass = torch.zeros(len(boundaries) + 1, dtype=torch.float64).index_add_(0, index, weight)
    total = torch.zeros_like(mass).index_add_(0, index, weight * d)
    levels = total / mass.clamp_min(1e-300)
    error = float((weight * (d - levels[index]) ** 2).sum())
    mean = float((weight * d).sum() / weight.sum())
    variance = float((weight * (d - mean) ** 2).sum())
    return tuple(float(v) for v in levels), error, variance
