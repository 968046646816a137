"""``data.max_length: auto``: the longest context that fits the budget.

The planner settles the length first, then chooses the recipe's other ``auto`` fields at that
length with its usual search (:mod:`memtrain.plan.search`). A length *fits* when the recipe's
leanest settings fit there: every ``auto`` field at the last value of its memory order
(:func:`memtrain.plan.space.options`: full checkpointing, chunked loss, activation offload, ...)
and the smallest micro-batch the effective batch allows. Memory grows with the length, so the
longest length the leanest settings fit is the longest any settings fit; the search at that
length then finds the fastest settings that fit it, which may keep more than the leanest.

Lengths are multiples of ``LENGTH_STEP`` tokens. Each probe is one estimate (fake-tensor traces of
the real step, seconds each; :func:`memtrain.estimator.estimate.estimate`), so the search probes
few: two lengths give a line and its crossing with the budget, then regula falsi (Illinois) between
the longest length that fits and the shortest that does not (a bisection every fourth probe, should
the estimate bend), until they are one step apart. An estimate costs about the same at any length
(the loops over the tokens run a few iterations, :mod:`memtrain.memory.loops`) and, with no
``L x L`` attention matrix, its peak is affine in the length between kernel changes; so the search
first solves that model (:func:`_solve`): the budget's crossing of a line through two lengths far
apart, confirmed by an estimate at the answer and one at the next step. Estimates are kept in
the plan's :class:`memtrain.plan.search.TraceCache`, so a caller planning the same recipe for
several budgets with one cache (scripts/bench/planner/long_context.py) starts from every length probed
before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memtrain.config import RunConfig
from memtrain.errors import MemtrainError
from memtrain.estimator import estimate as est
from memtrain.estimator.setup import position_limit, resolve_config
from memtrain.plan.search import Search, TraceCache
from memtrain.plan.space import Candidate, with_values
from memtrain.units import format_bytes

LENGTH_STEP = 256  # planned lengths are multiples of this many tokens
FIRST_PROBE = 4096
LONGEST = 2**24  # no search beyond 16M tokens
MAX_KEY = "data.max_length"
SOLVE_SPAN = 8  # the affine model's second length: this many times the first
SOLVE_ROUNDS = 3


@dataclass
class LengthSearch:
    """The longest length that fits, and what the search saw on the way."""

    chosen: int  # tokens (a multiple of ``step``)
    step: int
    usable: int
    leanest: dict[str, Any]  # the settings each length was probed with (auto fields, batch)
    probes: dict[int, int] = field(default_factory=dict)  # length -> predicted total bytes
    limit: int | None = None  # the model's position limit, when it bounded the search
    estimate: est.Estimate | None = None  # the leanest settings at ``chosen``
    data_longest: int | None = None  # the data's longest row (read uncut), when it bounded the search
    host: int | None = None  # the host memory allowed, when the search held the host to it
    host_over: dict[int, int] = field(default_factory=dict)  # length -> host bytes, over ``host``

    def needs(self, length: int) -> str:
        """What ``length`` needs that does not fit: its host memory where that was over the host's
        budget (its probe then reads as one byte over the device's), else its device bytes."""
        if length in self.host_over and self.host is not None:
            return (f"{format_bytes(self.host_over[length])} of host memory, more than the "
                    f"{format_bytes(self.host)} allowed")
        return format_bytes(self.probes[length])

    def explain(self) -> str:
        """One sentence: the length, what the next one needs, and the settings it was found with."""
        with_ = ", ".join(f"{k}={_short(v)}" for k, v in self.leanest.items()) or "the recipe as written"
        fit = f"fit {format_bytes(self.usable)} ({format_bytes(self.probes[self.chosen])}"
        if self.chosen == self.data_longest:  # nothing longer to train on: the data bounded the search
            return (f"data.max_length {self.chosen:,} tokens: the data's longest row (read uncut), whose "
                    f"leanest settings {fit}); probed {_count(len(self.probes), 'length')} with {with_}")
        nxt = self.chosen + self.step
        why = (f"{nxt:,} needs {self.needs(nxt)}" if nxt in self.probes else
               f"the model's {self.limit:,} positions" if self.limit is not None else "the search's end")
        return (f"data.max_length {self.chosen:,} tokens: the longest multiple of {self.step} whose "
                f"leanest settings {fit}; {why}); probed {_count(len(self.probes), 'length')} with {with_}")

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "step": self.step, "leanest": self.leanest,
                "probes": {str(k): v for k, v in sorted(self.probes.items())}, "position_limit": self.limit,
                "data_longest": self.data_longest}


def longest_length(cfg: RunConfig, device: str, usable: int, step: int | None = None,
                   host: int | None = None, exact_length: bool = False,
                   cache: TraceCache | None = None, data_longest: int | None = None) -> LengthSearch:
    """The longest ``data.max_length`` (a multiple of ``step``, default ``LENGTH_STEP``) whose
    leanest settings fit ``usable`` device bytes (and ``host`` bytes of host memory, when given).
    ``data_longest``: the data's longest row, read uncut; no length past it is searched (the data
    has nothing longer to train on), and it is a length the search may answer itself.
    ``exact_length``: every estimate runs every loop iteration (as the estimator did before issue
    37: scripts/bench/planner/plan_speed.py times the difference). ``cache``: the plan's traces and
    estimates (default: a new one, this search's own).

    Raises:
        MemtrainError: not even ``step`` tokens fit (the message gives the peak at ``step``).
    """
    step = step or LENGTH_STEP
    config, _ = resolve_config(cfg.model)
    limit = position_limit(config)
    top = LONGEST
    if limit is not None:
        step = min(step, limit)
        top = min(top, limit // step * step)
    if data_longest is not None:
        top = min(top, data_longest)
    cache = TraceCache() if cache is None else cache
    lean = _leanest(cfg, device, usable, step, exact_length, cache)
    settings = {**lean.values, "training.micro_batch_size": lean.micro,
                "training.gradient_accumulation": lean.accumulation}
    found = LengthSearch(0, step, usable, settings, limit=limit,
                         data_longest=data_longest if data_longest == top else None, host=host)
    base = with_values(cfg, {**settings, MAX_KEY: 1}).model_dump_json() + f"|{device}|{exact_length}"

    def at(length: int) -> est.Estimate:
        def make() -> est.Estimate:
            probe = Search(with_values(cfg, {**settings, MAX_KEY: length}), device, usable, fields=[],
                           exact_length=exact_length, cache=cache)
            return probe.estimate_of(lean.micro, lean.accumulation)

        estimate = cache.estimate(base, length, make)
        found.probes[length] = estimate.total_bytes
        if host is not None and estimate.host_peak_bytes > host:
            found.probes[length] = max(found.probes[length], usable + 1)  # does not fit: the host's
            found.host_over[length] = estimate.host_peak_bytes
        return estimate

    for length in cache.lengths(base):  # lengths probed before with these settings and this cache
        if (length % step == 0 or length == top) and length <= top:
            at(length)
    _solve(found, at, usable, step, top, limit_first=not exact_length)
    lo = max((n for n, b in found.probes.items() if b <= usable), default=0)
    hi = min((n for n, b in found.probes.items() if b > usable and n > lo), default=None)
    count, kept, weight = 0, "", [1.0, 1.0]  # Illinois: an end kept twice counts half in the line
    while (probe := _next(found.probes, lo, hi, usable, step, top, count, weight)) is not None:
        at(probe)
        side = "hi" if found.probes[probe] <= usable else "lo"  # the end this probe keeps
        lo, hi = (probe, hi) if side == "hi" else (lo, probe)
        weight[side == "hi"] = weight[side == "hi"] / 2 if kept == side else 1.0
        weight[side == "lo"] = 1.0
        kept, count = side, count + 1
    if lo == 0:
        shortest = min(found.probes)
        raise MemtrainError(
            f"`data.max_length`: `auto` finds no length that fits: {shortest:,} tokens need "
            f"{found.needs(shortest)} with the leanest settings"
            + ("" if shortest in found.host_over else f", more than the {format_bytes(usable)} usable")
            + f". Fix: raise `{cfg.memory.budget_field}`"
            + (" or `memory.host_budget`" if found.host_over else "")
            + ", set more fields to `auto`, or train a smaller model.")
    found.chosen, found.estimate = lo, at(lo)
    return found


def _solve(found: LengthSearch, at: Callable[[int], est.Estimate], usable: int, step: int, top: int,
           limit_first: bool = True) -> None:
    """Solve the affine model for the longest length, then confirm it: an estimate at the answer
    and one at the next step (what regula falsi below ends on, in fewer estimates); the next step
    only where the line through the answer's own estimate still puts the answer there (else that
    line's answer is the next guess).

    An estimate costs about the same at any length, and where attention keeps no ``L x L`` matrix its
    bytes are affine in the length op by op, so the peak is the largest of a few lines: the line
    through two lengths far apart meets the budget at or past the answer, the line through the two
    probes nearest the crossing at the answer. Where the model's position limit lies past both
    lengths, the limit is probed first: with room to spare (Llama-3.1-8B's 131,072 positions at 24
    GiB and up, with every long-context technique) that one estimate is the answer, and where it does
    not fit, it is the line's far end in place of the second length (``limit_first``; not where
    every loop iteration runs, ``exact_length``: there an estimate's cost grows with the length,
    and one at the limit costs more than the search it could save; each guess no further than
    ``SOLVE_SPAN`` times the longest length that fits: a far line crosses the budget well past a
    peak that bends, as a loss chunk growing to its cap makes it at short lengths). At most
    ``SOLVE_ROUNDS`` rounds; where the peak bends (quadratic attention) the guesses are only
    guesses, and the search goes on from the probes made here, so the answer is regula falsi's
    either way.
    """
    if found.probes or top <= step:
        return
    first = min(FIRST_PROBE, top)
    second = min(top, max(first + step, _down(first * SOLVE_SPAN, step)))
    if limit_first and found.limit is not None and top > second:  # where it fits, one estimate answers
        at(top)
        if found.probes[top] <= usable:
            return
    if at(first) is None or found.probes[first] > usable:
        return
    if top not in found.probes:
        at(second)
    for _ in range(SOLVE_ROUNDS):
        line = _crossing(found, usable, step, top)
        if line is None:
            return
        lo, hi, crossing = line
        guess = min(top, max(lo + step, crossing if hi is None else min(hi - step, crossing)))
        # no further than the second length is from the first: a line to a far end (the position
        # limit) may cross the budget far past a peak that bends (a loss chunk growing to its cap)
        guess = min(guess, max(lo + step, _down(lo * SOLVE_SPAN, step)))
        at(guess)
        if guess == top or found.probes[guess] > usable:
            continue
        # it fits: confirm it with the next step only where the line through it still says it is
        # the answer (the peak bends between the first length and the answer, as the 8B's does at
        # 8 GiB: a line from 4,096 tokens put the answer at 11,520, the line from there 12,288)
        again = _crossing(found, usable, step, top)
        if again is None or again[2] <= guess:
            at(guess + step)


def _crossing(found: LengthSearch, usable: int, step: int, top: int) -> tuple[int, int | None, int] | None:
    """(the longest length that fits, the shortest that does not (None: none yet), where the line
    through the probes nearest the budget crosses it, rounded down to a step); None where the
    search is over (the two one step apart, or the longest at ``top``) or the line does not rise."""
    fits = sorted(n for n, b in found.probes.items() if b <= usable)
    over = sorted(n for n, b in found.probes.items() if b > usable)
    lo, hi = fits[-1], (over[0] if over else None)
    if lo == top or (hi is not None and hi - lo <= step) or (hi is None and len(fits) < 2):
        return None
    a, b = (lo, hi) if hi is not None else (fits[-2], lo)
    slope = (found.probes[b] - found.probes[a]) / (b - a)
    if slope <= 0:
        return None
    return lo, hi, _down(a + (usable - found.probes[a]) / slope, step)


def _next(probes: dict[int, int], lo: int, hi: int | None, usable: int, step: int, top: int,
          count: int, weight: list[float]) -> int | None:
    """The next length to probe, or None when ``lo`` fits and ``lo + step`` does not (or is past
    ``top``). ``weight`` scales the excess of (``lo``, ``hi``) in the line between them (regula
    falsi's Illinois variant: an end kept by two probes in a row counts half)."""
    if hi is not None and hi - lo <= step:
        return None
    if hi is None:
        if lo >= top:
            return None
        if lo == 0:
            return min(FIRST_PROBE, top)
        below = [n for n in probes if n < lo]
        if not below:  # one point: quadruple
            return min(top, lo * 4)
        a = max(below)
        slope = (probes[lo] - probes[a]) / (lo - a)
        if slope <= 0:
            return min(top, lo * 4)
        guess = lo + (usable - probes[lo]) / slope
        return min(top, max(lo + step, _down(guess, step) + step))  # one step over: to bracket it
    if lo == 0 or count % 4 == 3:  # nothing fits yet, or every fourth probe: bisect
        middle = _down((lo + hi) / 2, step)
        return max(step, middle) if middle > lo else lo + step
    below, above = (usable - probes[lo]) * weight[0], (probes[hi] - usable) * weight[1]
    guess = lo + below * (hi - lo) / (below + above)
    return min(hi - step, max(lo + step, _down(guess, step)))


def _down(tokens: float, step: int) -> int:
    return int(tokens) // step * step


def _leanest(cfg: RunConfig, device: str, usable: int, step: int, exact_length: bool,
             cache: TraceCache) -> Candidate:
    """The valid, applicable candidate that keeps least: the most fields at the end of their
    memory order (:func:`memtrain.plan.space.rank`)."""
    search = Search(with_values(cfg, {MAX_KEY: step}), device, usable, exact_length=exact_length, cache=cache)
    cands = sorted(search.candidates(), key=lambda c: -search.leanness(c))
    for cand in cands:
        if search.batches_for(cand) and search.inapplicable(cand) is None:
            cand.micro, cand.accumulation = search.batches_for(cand)[0]
            return cand
    raise MemtrainError("`data.max_length`: `auto` needs settings to probe lengths with, and no "
                        "combination of the recipe's `auto` fields applies to this model. Fix: set "
                        "`data.max_length` to a number.")


def _short(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
