"""Choose the settings a recipe left ``auto``: the fastest combination whose peak fits the budget.

``memtrain plan RECIPE`` and ``memtrain train`` (when a recipe has ``auto`` fields or a budget) run
:func:`plan`. Only fields set to ``auto`` are chosen; everything the user fixed stays as written,
and the effective batch size is never changed: the micro-batch is a divisor of it and the
gradient accumulation makes up the rest.

How the search works. Each combination of the ``auto`` fields is a *candidate*. Its peak memory
comes from the estimator (fake-tensor traces at micro-batch 1 and 2, exact for every micro-batch
because each op is linear in it, see :mod:`memtrain.estimator.trace`), its step time from the cost
model (:mod:`memtrain.plan.costmodel`) applied to the same traces' FLOPs, ops and bytes. Tracing costs
seconds, so the search prunes (after rejecting, first, any candidate with a technique that has
nothing to act on in this model, found by applying its patch to a fake model):

- *branch and bound on time*: a candidate's time at the largest micro-batch (accumulation 1) is a
  lower bound of its time at any micro-batch it fits with; candidates are traced in the order of
  that bound (computed from one trace per adapter and quantization choice plus the known extra
  costs of each technique; a traced activation offload adds its transfers to the bounds of the
  candidates that move at least as much) and the search stops once the bound exceeds the best
  time found;
- *memory dominance*: each technique has an order from "keeps more" to "keeps less" (no
  checkpointing > selective > full, AdamW > 8-bit AdamW, ...); a candidate that keeps at least as
  much as one that does not fit at micro-batch 1 in every field does not fit either.

Predicted times within ``TIE`` (5%) of the fastest are within the cost model's error, so among
those the planner takes the candidate with the fewest memory techniques (recompute, 8-bit state,
offload, quantization, approximation, sharding), then the one that leaves the most memory free: a
technique or a fuller device that buys no measurable speed is not worth its risk.

``data.max_length: auto`` is settled before the search: the longest multiple of 256 tokens at
which the leanest settings fit, no longer than the data's longest row where the data was read
(:mod:`memtrain.plan.length`), then the search above runs at that length. The plan reports the
length as ``data.max_length`` (and how it was found).

Approximate-gradient layers change the gradients, so they are candidates only when the recipe sets
``memory.allow_approximate: true``.

The candidate space (values of each field, in memory order) is :mod:`memtrain.plan.space`; the
search (bounds, dominance, traces, ties) is :mod:`memtrain.plan.search`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memtrain.config import RunConfig
from memtrain.data.rows import Rows
from memtrain.errors import MemtrainError
from memtrain.estimator.pool import kept_workers
from memtrain.plan.length import LengthSearch, longest_length
from memtrain.plan.search import Search, TraceCache
from memtrain.plan.space import Candidate, auto_fields, with_values
from memtrain.reliability.budget import HostBudget, resolve_budget, usable_bytes
from memtrain.units import format_bytes, parse_size


class NothingFits(MemtrainError):
    """No candidate fits the budget; the message names the smallest reachable peak (``smallest``)."""

    def __init__(self, message: str, smallest: Candidate | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest  # the candidate with the smallest reachable peak


@dataclass
class Plan:
    """The planner's decision and its explanation."""

    budget: int
    usable: int
    device: str
    auto: list[str]
    chosen: Candidate
    alternatives: list[Candidate]  # the next best that fit, fastest first
    rejected: list[Candidate]  # traced or pruned, each with its reason
    rates_source: str
    seconds: float  # planning time
    host: HostBudget | None = None  # the host RAM the plan may keep (``memory.host_budget``)
    length: LengthSearch | None = None  # how `data.max_length: auto` was decided
    notes: list[str] = field(default_factory=list)  # what the user should know about the decision

    def settings(self) -> dict[str, Any]:
        """The decided values, as ``dotted.field: value`` (batch fields included)."""
        out = dict(self.chosen.values)
        if self.length is not None:
            out["data.max_length"] = self.length.chosen
        out["training.micro_batch_size"] = self.chosen.micro
        out["training.gradient_accumulation"] = self.chosen.accumulation
        return out

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with every ``auto`` field set to the decided value."""
        return with_values(cfg, self.settings())


def needs_plan(cfg: RunConfig) -> bool:
    """True when training must plan first: ``auto`` fields, or a budget to check the run against."""
    return bool(auto_fields(cfg)) or cfg.memory.budget is not None


def budget_bytes(cfg: RunConfig, budget: str | int | None = None, device: str | None = None) -> int:
    """The budget in bytes: the argument, else the recipe's (``memory.budget_setting``: the simulated
    budget, else ``memory.budget``), else the device's free memory."""
    if isinstance(budget, int):
        return budget
    chosen = budget or cfg.memory.budget_setting or "auto"
    if chosen != "auto":
        return parse_size(chosen)
    return int(resolve_budget("auto", device))


def plan(cfg: RunConfig, budget: str | int | None = None, *, device: str | None = None,
         tune: int = 0, rows: Rows | None = None, alternatives: bool = True,
         cache: TraceCache | None = None) -> Plan:
    """Decide every ``auto`` field of ``cfg`` (see the module docstring).

    Args:
        cfg: a validated recipe.
        budget: bytes or a size like ``"24GiB"``; default the recipe's
            (``memory.budget_setting``: the simulated budget, else ``memory.budget``), else the
            device's free memory.
        device: ``cuda`` or ``cpu``, where the run trains (default: CUDA when present).
        tune: time this many of the fastest-predicted settings, each at up to four micro-batches
            that fit, with real steps on this machine and choose the fastest measured
            (:func:`tune_choice`). Builds the real model; 0 (default) decides from predictions.
        rows: the longest batch of the data at hand (:mod:`memtrain.data.rows`); default: the
            recipe's worst case, every row ``data.max_length`` tokens. With ``data.max_length:
            auto``, rows read uncut (:func:`memtrain.data.prepare.read_rows`): the length searched
            goes no further than the data's longest row.
        alternatives: False traces only the candidates that can change the choice (the plugin's
            plans, which show none): the same choice, fewer traces, and ``Plan.alternatives``
            lists only those traced. Tuning needs them (``tune`` > 0 keeps them).
        cache: the traces and estimates to plan with and keep (:class:`TraceCache`); default: a
            new one for this call (pass one to several calls to reuse what each traced).

    Raises:
        NothingFits: no candidate fits; the message gives the smallest peak and its settings.
    """
    start = time.perf_counter()
    target = device or ("cuda" if _cuda() else "cpu")
    total = budget_bytes(cfg, budget, target)
    usable = usable_bytes(total, cfg.memory.margin_fraction)
    host = HostBudget.of(cfg.memory)
    auto = auto_fields(cfg)
    cache = TraceCache() if cache is None else cache
    length = None
    with kept_workers():  # one set of trace workers for every group the searches trace
        if cfg.data.max_length == "auto":  # the length first, then the fastest settings at that length
            # rows read uncut (not packed: packed rows fill any length) bound the search: no length
            # past the data's longest row; the search at the chosen length then traces the data's rows
            # where nothing is cut, the worst case where the length cuts them
            data_longest = rows.longest if rows is not None and not rows.packed else None
            length = longest_length(cfg, target, usable, host=host.usable, cache=cache,
                                    data_longest=data_longest)
            cfg = with_values(cfg, {"data.max_length": length.chosen})
            if data_longest is None or length.chosen < data_longest:
                rows = None
        search = Search(cfg, target, usable, rows=rows, host=host, alternatives=alternatives or tune > 0,
                        cache=cache)
        chosen = search.run()
    fits = sorted((c for c in search.done if c.seconds < math.inf and c is not chosen),
                  key=lambda c: c.seconds)
    rejected = [c for c in search.done + search.pruned if c.seconds == math.inf]
    if chosen is None:
        on_device = [c for c in search.done if c.min_peak <= usable]  # these failed on host RAM
        if on_device:
            smallest = min(on_device, key=lambda c: c.host)
            raise NothingFits(
                f"Nothing fits the host budget: every setting that fits the device "
                f"({format_bytes(usable)} usable) keeps too much in host memory. The least, with "
                f"{smallest.label() or 'the recipe as written'}: {host.shortfall(smallest.host)}",
                smallest)
        smallest = min(search.done, key=lambda c: c.min_peak)
        margin = cfg.memory.margin_fraction
        raise NothingFits(
            f"Nothing fits the budget: {format_bytes(usable)} usable ({format_bytes(total)} minus the "
            f"{margin:.0%} margin, `memory.margin`). The smallest reachable peak is "
            f"{format_bytes(smallest.min_peak)}, with {smallest.label() or 'the recipe as written'}. "
            f"Fix: raise `{cfg.memory.budget_field}` to at "
            f"least {format_bytes(int(smallest.min_peak / (1 - margin)) + 1)}, set more fields "
            f"to `auto`{'' if cfg.memory.allow_approximate else ' (or `memory.allow_approximate: true`)'}, "
            "or train a smaller model.", smallest)
    if tune > 0:
        chosen, fits = tune_choice(cfg, search, [chosen, *fits], tune)
    return Plan(total, usable, target, auto, chosen, fits, rejected, search.rates.source,
                time.perf_counter() - start, host, length, batch_notes(cfg, chosen))


def batch_notes(cfg: RunConfig, chosen: Candidate) -> list[str]:
    """Where the recipe fixes no effective batch and the micro-batch is planned, the effective
    batch is whatever micro-batch fits times the accumulation: said, with how to keep one."""
    t = cfg.training
    if t.micro_batch_size != "auto" or t.effective_batch_size is not None:
        return []
    processes = cfg.distributed.processes
    each = f" x {processes} processes" if processes > 1 else ""
    return [f"the effective batch follows the planned micro-batch: {chosen.micro} x {chosen.accumulation} "
            f"accumulated{each} = {chosen.micro * chosen.accumulation * processes} examples per optimizer "
            "step, as the recipe sets no `training.effective_batch_size`. Set it to keep the effective "
            "batch whatever micro-batch fits (the accumulation then makes up the rest)."]


def tune_choice(cfg: RunConfig, search: Search, fits: list[Candidate], count: int, steps: int = 3
                ) -> tuple[Candidate, list[Candidate]]:
    """Time the ``count`` fastest-predicted settings at the micro-batches that fit; keep the fastest.

    The cost model ranks settings well but not finely (rank correlation 0.89 with measured steps
    over 40 candidates, scripts/bench/planner/planner.py as of commit aa39ed3), so the last word goes to a
    measurement: each (settings, micro-batch) pair's model is built, runs one warm-up optimizer
    step and ``steps`` timed ones on a worst-case batch (``data.max_length`` tokens per example),
    and the fastest (best of its steps) wins. Each setting is timed at up to ``TUNE_MICROS``
    micro-batches (:meth:`Search.micro_options`).
    Returns the choice and every other fitting pair.
    """
    from memtrain.estimator.real_step import time_recipe_step
    from memtrain.memory import hostmem

    if search.device == "cpu":  # time steps as `memtrain train` runs them (memtrain.memory.hostmem)
        hostmem.keep_freed_pages()
    timed = [option for cand in fits[:count] for option in search.micro_options(cand)]
    for cand in timed:
        settings = {**cand.values, "training.micro_batch_size": cand.micro,
                    "training.gradient_accumulation": cand.accumulation}
        cand.measured = time_recipe_step(with_values(cfg, settings), steps)
    best = min(timed, key=lambda c: c.measured or math.inf)
    for cand in timed + fits[count:]:
        if cand is not best:
            cand.reason = (f"measured {cand.measured:.3g} s per step vs {best.measured:.3g} s"
                           if cand.measured is not None else
                           f"slower: {cand.seconds:.3g} s per step predicted, not among the settings timed")
    rest = [c for c in timed if c is not best] + fits[count:]
    return best, sorted(rest, key=lambda c: (c.measured is None, c.measured or c.seconds))


def fit_micro_batch(cfg: RunConfig, usable: int, *, device: str | None = None,
                    rows: Rows | None = None) -> tuple[int, int, int]:
    """The largest micro-batch (and its accumulation) whose predicted peak fits ``usable`` bytes.

    Every other field must be decided. Returns ``(micro, accumulation, predicted peak bytes)``;
    effective = micro × accumulation × processes holds exactly.

    Raises:
        NothingFits: not even the smallest micro-batch fits.
    """
    target = device or ("cuda" if _cuda() else "cpu")
    host = HostBudget.of(cfg.memory)
    search = Search(with_values(cfg, {"training.micro_batch_size": "auto"}), target, usable, fields=[],
                     rows=rows, host=host)
    cand = Candidate({})
    search.evaluate(cand)
    if cand.seconds == math.inf and cand.min_peak <= usable:
        raise NothingFits(f"Micro-batch {cand.micro}: {host.shortfall(cand.host)}")
    if cand.seconds == math.inf:
        raise NothingFits(f"Micro-batch {cand.micro} needs {format_bytes(cand.min_peak)}, more than the "
                          f"{format_bytes(usable)} usable. Fix: raise `{cfg.memory.budget_field}` or use "
                          "techniques that save memory (`memtrain plan`).")
    return cand.micro, cand.accumulation, cand.peak


def _cuda() -> bool:
    from memtrain.device import cuda_available

    return cuda_available()


def describe(p: Plan) -> dict[str, Any]:
    """JSON-ready summary of a plan."""
    def row(c: Candidate) -> dict[str, Any]:
        return {"values": c.values, "micro_batch_size": c.micro, "gradient_accumulation": c.accumulation,
                "peak_bytes": c.peak, "min_peak_bytes": c.min_peak, "seconds_per_step": c.seconds
                if c.seconds < math.inf else None, "measured_seconds_per_step": c.measured,
                "time_parts": c.parts, "reason": c.reason, "host_bytes": c.host}
    host = ({"host_budget": p.host.setting, "host_budget_bytes": p.host.total,
             "host_usable_bytes": p.host.usable} if p.host is not None else {})
    return {"budget_bytes": p.budget, "usable_bytes": p.usable, **host, "device": p.device,
            "auto_fields": p.auto,
            "chosen": row(p.chosen), "alternatives": [row(c) for c in p.alternatives],
            "rejected": [row(c) for c in p.rejected], "rates": p.rates_source,
            "planning_seconds": round(p.seconds, 2), "settings": p.settings(),
            "max_length": None if p.length is None else {**p.length.to_dict(), "why": p.length.explain()},
            "notes": p.notes}


__all__ = ["Candidate", "NothingFits", "Plan", "TraceCache", "auto_fields", "budget_bytes", "describe",
           "fit_micro_batch", "needs_plan", "plan", "tune_choice", "with_values"]
