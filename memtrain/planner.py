"""Choose the settings a recipe left ``auto``: the fastest combination whose peak fits the budget.

``memtrain plan RECIPE`` and ``memtrain train`` (when a recipe has ``auto`` fields or a budget) run
:func:`plan`. Only fields set to ``auto`` are chosen; everything the user fixed stays as written,
and the effective batch size is never changed: the micro-batch is a divisor of it and the
gradient accumulation makes up the rest.

How the search works. Each combination of the ``auto`` fields is a *candidate*. Its peak memory
comes from the estimator (fake-tensor traces at micro-batch 1 and 2, exact for every micro-batch
because each op is linear in it, see :mod:`memtrain.memory.trace`), its step time from the cost
model (:mod:`memtrain.costmodel`) applied to the same traces' FLOPs, ops and bytes. Tracing costs
seconds, so the search prunes:

- *branch and bound on time*: a candidate's time at the largest micro-batch (accumulation 1) is a
  lower bound of its time at any micro-batch it fits with; candidates are traced in the order of
  that bound (computed from one trace per adapter and quantization choice plus the known extra
  costs of each technique) and the search stops once the bound exceeds the best time found;
- *memory dominance*: each technique has an order from "keeps more" to "keeps less" (no
  checkpointing > selective > full, AdamW > 8-bit AdamW, ...); a candidate that keeps at least as
  much as one that does not fit at micro-batch 1 in every field does not fit either.

Predicted times within ``TIE`` (5%) of the fastest are within the cost model's error, so among
those the planner takes the candidate with the fewest memory techniques (recompute, 8-bit state,
offload, quantization, approximation, sharding), then the one that leaves the most memory free: a
technique or a fuller device that buys no measurable speed is not worth its risk.

Approximate-gradient layers change the gradients, so they are candidates only when the recipe sets
``memory.allow_approximate: true``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from memtrain import costmodel
from memtrain.autofit import valid_batches
from memtrain.config import RunConfig
from memtrain.config.batch import Batch, resolve_batch
from memtrain.errors import MemtrainError
from memtrain.memory import estimate as est
from memtrain.memory.budget import resolve_budget, usable_bytes
from memtrain.memory.trace import Work, in_batch
from memtrain.units import format_bytes, parse_size

# Predicted step times this close count as equal: the cost model's rank correlation with measured
# steps is 0.89 on scripts/bench_planner.py (docs/bench/planner.md), not 1. Among equals the planner
# takes the candidate with the fewest memory techniques, then the smallest peak.
TIE = 0.05
TUNE_MICROS = 4  # micro-batches per setting that tuning times (the largest that fit)
# Candidate values of each `auto` field, from "keeps most memory" to "keeps least" (see dominance).
APPROX_RANDOMIZED = {"ratio": 0.2, "sketch": "gaussian", "targets": None}
IN_BACKWARD = "training.optimizer_in_backward"


class NothingFits(MemtrainError):
    """No candidate fits the budget; the message names the smallest reachable peak (``smallest``)."""

    def __init__(self, message: str, smallest: Candidate | None = None) -> None:
        super().__init__(message)
        self.smallest = smallest  # the candidate with the smallest reachable peak


@dataclass
class Candidate:
    """One combination of values for the ``auto`` fields, with its predictions."""

    values: dict[str, Any]  # dotted field -> value (the `auto` fields only)
    micro: int = 0
    accumulation: int = 0
    peak: int = 0  # predicted device bytes (tensors + CUDA overheads) at the chosen micro-batch
    seconds: float = math.inf  # predicted seconds per optimizer step
    parts: dict[str, float] = field(default_factory=dict)
    min_peak: int = 0  # predicted peak at the smallest micro-batch
    reason: str = ""  # why it was not chosen
    measured: float | None = None  # seconds of a real step, when the plan was tuned

    def label(self) -> str:
        shown = dict(self.values)
        if self.micro:
            shown.update(micro=self.micro, accumulation=self.accumulation)
        return ", ".join(f"{k.split('.')[-1] if k != 'memory.offload.activations' else 'offload_act'}"
                         f"={_show(v)}" for k, v in shown.items())


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

    def settings(self) -> dict[str, Any]:
        """The decided values, as ``dotted.field: value`` (batch fields included)."""
        out = dict(self.chosen.values)
        out["training.micro_batch_size"] = self.chosen.micro
        out["training.gradient_accumulation"] = self.chosen.accumulation
        return out

    def apply(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` with every ``auto`` field set to the decided value."""
        return with_values(cfg, self.settings())


def auto_fields(cfg: RunConfig) -> list[str]:
    """The dotted fields of ``cfg`` the planner must decide."""
    paths = [*est._NEEDS_VALUE, "distributed.sharding"]
    return [p for p in paths if est._get(cfg, p) == "auto"]


def needs_plan(cfg: RunConfig) -> bool:
    """True when training must plan first: ``auto`` fields, or a budget to check the run against."""
    return bool(auto_fields(cfg)) or cfg.memory.budget is not None


def budget_bytes(cfg: RunConfig, budget: str | int | None = None, device: str | None = None) -> int:
    """The budget in bytes: the argument, else ``memory.budget``, else the simulated one, else free memory."""
    if isinstance(budget, int):
        return budget
    chosen = budget or cfg.memory.budget or cfg.memory.simulate_budget or "auto"
    if chosen != "auto":
        return parse_size(chosen)
    return int(resolve_budget("auto", device))


def plan(cfg: RunConfig, budget: str | int | None = None, *, device: str | None = None,
         tune: int = 0) -> Plan:
    """Decide every ``auto`` field of ``cfg`` (see the module docstring).

    Args:
        cfg: a validated recipe.
        budget: bytes or a size like ``"24GiB"``; default ``memory.budget`` (or the simulated
            budget, or the device's free memory).
        device: ``cuda`` or ``cpu``, where the run trains (default: CUDA when present).
        tune: time this many of the fastest-predicted settings, each at up to four micro-batches
            that fit, with real steps on this machine and choose the fastest measured
            (:func:`tune_choice`). Builds the real model; 0 (default) decides from predictions.

    Raises:
        NothingFits: no candidate fits; the message gives the smallest peak and its settings.
    """
    start = time.perf_counter()
    target = device or ("cuda" if _cuda() else "cpu")
    total = budget_bytes(cfg, budget, target)
    usable = usable_bytes(total, cfg.memory.margin_fraction)
    search = _Search(cfg, target, usable)
    chosen = search.run()
    fits = sorted((c for c in search.done if c.seconds < math.inf and c is not chosen),
                  key=lambda c: c.seconds)
    rejected = [c for c in search.done + search.pruned if c.seconds == math.inf]
    if chosen is None:
        smallest = min(search.done, key=lambda c: c.min_peak)
        margin = cfg.memory.margin_fraction
        raise NothingFits(
            f"Nothing fits the budget: {format_bytes(usable)} usable ({format_bytes(total)} minus the "
            f"{margin:.0%} margin, `memory.margin`). The smallest reachable peak is "
            f"{format_bytes(smallest.min_peak)}, with {smallest.label() or 'the recipe as written'}. "
            f"Fix: raise `memory.budget` to at "
            f"least {format_bytes(int(smallest.min_peak / (1 - margin)) + 1)}, set more fields "
            "to `auto` (or `memory.allow_approximate: true`), or train a smaller model.", smallest)
    if tune > 0:
        chosen, fits = tune_choice(cfg, search, [chosen, *fits], tune)
    return Plan(total, usable, target, auto_fields(cfg), chosen, fits, rejected, search.rates.source,
                time.perf_counter() - start)


def tune_choice(cfg: RunConfig, search: _Search, fits: list[Candidate], count: int, steps: int = 3
                ) -> tuple[Candidate, list[Candidate]]:
    """Time the ``count`` fastest-predicted settings at the micro-batches that fit; keep the fastest.

    The cost model ranks settings well but not finely (rank correlation 0.89 with measured steps
    on scripts/bench_planner.py), so the last word goes to a measurement: each (settings,
    micro-batch) pair's model is built, runs one warm-up optimizer step and ``steps`` timed ones on
    a worst-case batch (``data.max_length`` tokens per example), and the fastest (best of its steps)
    wins. Each setting is timed at up to ``TUNE_MICROS`` micro-batches (:meth:`_Search.micro_options`).
    Returns the choice and every other fitting pair.
    """
    from memtrain import hostmem
    from memtrain.memory.build import time_recipe_step

    if search.device == "cpu":  # time steps as `memtrain train` runs them (memtrain.hostmem)
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


def fit_micro_batch(cfg: RunConfig, usable: int, *, device: str | None = None) -> tuple[int, int, int]:
    """The largest micro-batch (and its accumulation) whose predicted peak fits ``usable`` bytes.

    Every other field must be decided. Returns ``(micro, accumulation, predicted peak bytes)``;
    effective = micro × accumulation × processes holds exactly.

    Raises:
        NothingFits: not even the smallest micro-batch fits.
    """
    target = device or ("cuda" if _cuda() else "cpu")
    search = _Search(with_values(cfg, {"training.micro_batch_size": "auto"}), target, usable, fields=[])
    cand = Candidate({})
    search.evaluate(cand)
    if cand.seconds == math.inf:
        raise NothingFits(f"Micro-batch {cand.micro} needs {format_bytes(cand.min_peak)}, more than the "
                          f"{format_bytes(usable)} usable. Fix: raise `memory.budget` or use techniques "
                          "that save memory (`memtrain plan`).")
    return cand.micro, cand.accumulation, cand.peak


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A re-validated copy of ``cfg`` with dotted fields set.

    Raises:
        ValueError: the combination is invalid (e.g. a quantized base trained in full).
    """
    data = cfg.model_dump(mode="json")
    for path, value in values.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    context: dict[str, Any] = {"problems": []}
    new = RunConfig.model_validate(data, context=context)
    if context["problems"]:
        raise ValueError("; ".join(str(p) for p in context["problems"]))
    return new


# ------------------------------------------------------------------------------------- search


def _options(cfg: RunConfig, path: str, depth: int) -> list[Any]:
    """Candidate values of one `auto` field, from most memory kept to least."""
    approx = cfg.memory.allow_approximate
    return {
        "model.quantization": ["none", "nf4"],
        "adapter.method": ["full", "lora"],
        "training.optimizer": ["adamw", "adamw_8bit"],
        "memory.checkpointing": ["none", "selective", max(1, depth // 2), "full"],
        "memory.offload.activations": [False, True],
        "memory.offload.optimizer": [False, True] if cfg.distributed.processes == 1 else [False],
        "memory.activation_bits": [None, 3] if approx else [None],
        "memory.randomized_linear": [None, APPROX_RANDOMIZED] if approx else [None],
        "distributed.sharding": ["none", "full"],
        "memory.loss": ["standard", "chunked"] if cfg.model.task == "causal-lm" else ["standard"],
        "training.optimizer_in_backward": [False, True],
    }[path]


def _rank(path: str, value: Any, depth: int) -> tuple[int, ...]:
    """Position of ``value`` in its field's memory order, as a vector (checkpointing is 2-D:
    selective and n-of-L are not comparable)."""
    if path == "memory.checkpointing":
        return {"none": (0, 0), "selective": (1, 0), "full": (1, 1)}.get(value, (0, 1))  # type: ignore[arg-type]
    if path == "model.quantization":
        return (0,) if value == "none" else (1,)
    if path == "adapter.method":
        return (0,) if value == "full" else (1,)
    if path == "training.optimizer":
        return (0,) if value == "adamw" else (1,)
    if path == "distributed.sharding":
        return (0,) if value == "none" else (1,)
    if path == "memory.loss":
        return (0,) if value == "standard" else (1,)
    return (0,) if value in (None, False) else (1,)


@dataclass
class _Traced:
    """A candidate's traces at micro-batch 2 and 3 (and single sizes traced on their own)."""

    plan: Any  # the estimator's plan (settings, architecture, device)
    c2: Any
    c3: Any
    counts2: est.Counts
    counts3: est.Counts
    points: dict[int, Any] = field(default_factory=dict)  # micro-batch -> candidates traced directly


_TRACES: dict[str, _Traced] = {}


class _Search:
    """Enumerate, bound and evaluate candidates (see the module docstring)."""

    def __init__(self, cfg: RunConfig, device: str, usable: int, fields: list[str] | None = None) -> None:
        self.cfg, self.device, self.usable = cfg, device, usable
        config, _ = est.resolve_config(cfg.model)
        self.depth = int(config.num_hidden_layers)
        self.fields = [f for f in auto_fields(cfg) if not f.startswith("training.micro")
                       and not f.startswith("training.gradient")] if fields is None else fields
        self.batches = _batches(cfg)
        self.rates = costmodel.rates(device)
        self.host_rates = costmodel.rates("cpu") if device == "cuda" else self.rates
        self.done: list[Candidate] = []
        self.pruned: list[Candidate] = []
        self._traces = _TRACES  # shared by every search in this process: a trace depends only on
        # the settings in its key, never on the budget

    def candidates(self) -> Iterator[Candidate]:
        domains = [_options(self.cfg, f, self.depth) for f in self.fields]
        for combo in itertools.product(*domains):
            values = dict(zip(self.fields, combo, strict=True))
            try:  # e.g. a quantized base trained in full, the step in backward with clipping
                with_values(self.cfg, values)
            except ValueError:
                continue
            yield Candidate(values)

    def run(self) -> Candidate | None:
        cands = list(self.candidates())
        bounds = [(self.lower_bound(c), i) for i, c in enumerate(cands)]
        fastest: Candidate | None = None
        too_big: list[Candidate] = []
        fits: list[Candidate] = []
        for bound, i in sorted(bounds):
            cand = cands[i]
            if fastest is not None and bound > fastest.seconds * (1 + TIE):
                cand.reason = (f"slower: at least {bound:.3g} s per step, the fastest that fits needs "
                               f"{fastest.seconds:.3g} s")
                self.pruned.append(cand)
                continue
            if (big := next((t for t in too_big if self._dominated(cand, t)), None)) is not None:
                cand.reason = f"keeps at least as much as {big.label()}, which does not fit"
                self.pruned.append(cand)
                continue
            self.evaluate(cand)
            if cand.seconds == math.inf:
                too_big.append(cand)
                continue
            fits.append(cand)
            if fastest is None or cand.seconds < fastest.seconds:
                fastest = cand
        if fastest is None:
            return None
        ties = [c for c in fits if c.seconds <= fastest.seconds * (1 + TIE)]
        best = min(ties, key=lambda c: (self.techniques(c), c.peak, c.seconds))
        for cand in fits:
            if cand is best:
                continue
            if cand in ties and self.techniques(cand) > self.techniques(best):
                cand.reason = (f"{cand.seconds:.3g} s per step vs {best.seconds:.3g} s: within the cost "
                               f"model's {TIE:.0%} error, and it uses more memory techniques")
            elif cand in ties and cand.peak > best.peak:
                cand.reason = (f"{cand.seconds:.3g} s per step vs {best.seconds:.3g} s: within the cost "
                               f"model's {TIE:.0%} error, and it leaves less memory free")
            else:
                cand.reason = f"slower: {cand.seconds:.3g} s per step vs {best.seconds:.3g} s"
        return best

    def techniques(self, cand: Candidate) -> int:
        """How many memory techniques ``cand`` turns on (LoRA vs full fine-tuning is not one)."""
        return sum(1 for f, v in cand.values.items()
                   if f != "adapter.method" and any(_rank(f, v, self.depth)))

    def micro_options(self, cand: Candidate) -> list[Candidate]:
        """``cand`` (evaluated, fitting) at up to ``TUNE_MICROS`` of its largest micro-batches that fit.

        Smaller micro-batches than the fitted one are accumulated, so their peak comes from the
        trace on held gradients; micro-batch 1 is left out unless it is the fitted one (it would
        need a trace of its own).
        """
        cfg = with_values(self.cfg, cand.values)
        out = [dataclasses.replace(cand, reason="")]
        for micro, accumulation in reversed(self.batches_for(cand)):
            if len(out) == TUNE_MICROS:
                break
            if micro >= cand.micro or micro == 1:
                continue
            traced = self._traced(cfg, accumulation)
            summary = self._summary(traced, micro)
            if summary.total_bytes > self.usable:
                continue
            work = _work_at(traced.counts2[3], traced.counts3[3], micro)
            cost = self._cost(cfg, cand.values, work, traced.counts2, accumulation, summary.host_peak_bytes)
            out.append(dataclasses.replace(cand, micro=micro, accumulation=accumulation, reason="",
                                           peak=summary.total_bytes, seconds=cost.seconds, parts=cost.parts))
        return out

    def _dominated(self, cand: Candidate, small: Candidate) -> bool:
        """``cand`` keeps at least as much memory as ``small`` in every field.

        The step in backward saves gradients but allows no accumulation (fewer micro-batch
        choices), so candidates that differ in it are not comparable.
        """
        if cand.values.get(IN_BACKWARD, False) != small.values.get(IN_BACKWARD, False):
            return False
        return all(a <= b for f in self.fields for a, b in zip(
            _rank(f, cand.values[f], self.depth), _rank(f, small.values[f], self.depth), strict=True))

    def lower_bound(self, cand: Candidate) -> float:
        """Seconds per step at the largest micro-batch, from the plain trace of its adapter and base."""
        base = {f: v for f, v in cand.values.items() if f in ("model.quantization", "adapter.method")}
        cfg = with_values(self.cfg, {**base, **self._plain(cand)})
        batches = self.batches_for(cand) or self.batches
        micro, accumulation = batches[-1]
        held = 2 if any(a > 1 for _, a in self.batches) else 1
        traced = self._traced(cfg, held)
        work = _work_at(traced.counts2[3], traced.counts3[3], micro)
        ckpt = cand.values.get("memory.checkpointing", self.cfg.memory.checkpointing)
        if ckpt == "full" or isinstance(ckpt, int):  # recompute: one more forward, >= 1/3 of the FLOPs
            share = 1.0 if ckpt == "full" else min(1.0, ckpt / self.depth)
            work = Work(1, work.flops * (1 + share / 3), work.ops, work.written, work.optimizer_ops)
        return self._cost(cfg, cand.values, work, traced.counts2, accumulation, 0).seconds

    def _plain(self, cand: Candidate) -> dict[str, Any]:
        plain = {"training.optimizer": "adamw", "memory.checkpointing": "none",
                 "memory.offload.activations": False, "memory.offload.optimizer": False,
                 "memory.activation_bits": None, "memory.randomized_linear": None,
                 "distributed.sharding": "none", "memory.loss": "standard", IN_BACKWARD: False}
        return {f: v for f, v in plain.items() if f in self.fields}

    def evaluate(self, cand: Candidate) -> None:
        """Trace ``cand``, pick its largest fitting micro-batch, predict its time.

        Accumulation matters to the peak: from the second micro-batch on, gradients are held
        during the forward. Traces of an accumulated micro-batch (on held gradients) bound every
        pair from above; a pair without accumulation is traced on its own only when the gradients it does
        not hold could make the difference.
        """
        cfg = with_values(self.cfg, cand.values)
        batches = self.batches_for(cand)
        if not batches:
            cand.micro, cand.accumulation = self.batches[0]
            cand.reason = ("the optimizer step in backward needs gradient_accumulation 1, and no "
                           "allowed micro-batch equals the effective batch")
            self.pruned.append(cand)
            return
        held = 2 if any(a > 1 for _, a in batches) else 1
        fitted = None
        traced = self._traced(cfg, held)
        for micro, accumulation in reversed(batches):
            summary = self._summary(traced, micro)
            if summary.total_bytes > self.usable and accumulation == 1 and held == 2 \
                    and summary.total_bytes - self._grad_bytes(cfg, traced) <= self.usable:
                summary = self._summary(self._traced(cfg, 1), micro)
                if summary.total_bytes <= self.usable:
                    traced = self._traced(cfg, 1)
            if summary.total_bytes <= self.usable:
                fitted = (micro, accumulation, summary, traced)
                break
        if fitted is None:
            cand.micro, cand.accumulation = batches[0]
            cand.min_peak = self._summary(traced, cand.micro).total_bytes
            cand.reason = (f"does not fit: {format_bytes(cand.min_peak)} at micro-batch {cand.micro} > "
                           f"{format_bytes(self.usable)} usable")
            self.done.append(cand)
            return
        micro, accumulation, summary, traced = fitted
        cand.micro, cand.accumulation, cand.peak = micro, accumulation, summary.total_bytes
        first = batches[0][0]  # below 2 the linear model is not used: bound it from micro 2
        smallest = 2 if first == 1 and micro > 1 else first
        cand.min_peak = self._summary(traced, smallest).total_bytes
        work = _work_at(traced.counts2[3], traced.counts3[3], micro)
        cost = self._cost(cfg, cand.values, work, traced.counts2, accumulation, summary.host_peak_bytes)
        cand.seconds, cand.parts = cost.seconds, cost.parts
        self.done.append(cand)

    def batches_for(self, cand: Candidate) -> list[tuple[int, int]]:
        """The (micro, accumulation) pairs ``cand`` allows: without accumulation when its optimizer
        steps inside backward."""
        if cand.values.get(IN_BACKWARD, self.cfg.training.optimizer_in_backward) is True:
            return [(m, a) for m, a in self.batches if a == 1]
        return self.batches

    def _grad_bytes(self, cfg: RunConfig, traced: _Traced) -> int:
        return traced.counts2[1] * (2 if cfg.model.dtype in ("bf16", "fp16") else 4)

    def _summary(self, traced: _Traced, micro: int) -> est.Estimate:
        """The estimate at ``micro``: linear from the traces at 2 and 3 (size 1 is traced itself:
        some models take other paths for a single example)."""
        cands = in_batch(traced.c2, traced.c3, 2, 3, micro) if micro >= 2 else None
        if cands is None:
            if micro not in traced.points:
                traced.points[micro] = est._candidates(traced.plan, micro, traced.plan.seq_len, False)[0]
            cands = traced.points[micro]
        return est._summarize(traced.plan, cands, traced.counts2, "", 0.0)

    def _cost(self, cfg: RunConfig, values: dict[str, Any], work: Work, counts: est.Counts,
              accumulation: int, offloaded: int) -> costmodel.StepCost:
        get = lambda path: values.get(path, est._get(self.cfg, path))  # noqa: E731
        quantized = get("model.quantization") not in ("none", "auto")
        ckpt = get("memory.checkpointing")
        passes = 1.0 if ckpt == "full" else (min(1.0, ckpt / self.depth) if isinstance(ckpt, int) else 0.0)
        frozen = counts[0] - counts[1]
        opt_off = bool(get("memory.offload.optimizer"))
        return costmodel.step_seconds(
            work, micro_batches=accumulation, rates=self.rates, dtype=cfg.model.dtype,
            optimizer=str(get("training.optimizer")), trainable=counts[1],
            quantized_elements=int(frozen * 0.9) if quantized else 0, recompute_passes=passes,
            offloaded_bytes=offloaded, optimizer_offloaded=opt_off,
            optimizer_rates=self.host_rates if opt_off else None,
            parameter_bytes=2 if cfg.model.dtype in ("bf16", "fp16") else 4)

    def _traced(self, cfg: RunConfig, accumulation: int) -> _Traced:
        """Candidates and counts at micro-batch 2 and 3 (cached per settings and accumulation)."""
        key = cfg.model_dump_json(include={"model", "data", "adapter", "training", "memory", "distributed"},
                                  exclude={"training": {"micro_batch_size", "gradient_accumulation",
                                                        "effective_batch_size"}})
        key += f"|{min(accumulation, 2)}|{self.device}"
        if key not in self._traces:
            one = {"training.micro_batch_size": 1, "training.effective_batch_size": None,
                   "training.gradient_accumulation": min(accumulation, 2)}
            plan = est._plan(with_values(cfg, one), (), self.device)
            c2, counts2, _ = est._candidates(plan, 2, plan.seq_len, False)
            c3, counts3, _ = est._candidates(plan, 3, plan.seq_len, False)
            self._traces[key] = _Traced(plan, c2, c3, counts2, counts3)
        return self._traces[key]


def _work_at(w2: Work | None, w3: Work | None, micro: int) -> Work:
    """Work of one micro-batch of ``micro`` examples (plus one optimizer step), from traces at
    micro-batch 2 and 3: FLOPs and bytes are linear in the batch, op counts do not depend on it."""
    if w2 is None or w3 is None:
        raise MemtrainError("the estimate did not record the step's work (FLOPs); cannot plan")
    f2, f3 = w2.flops / w2.micro_batches, w3.flops / w3.micro_batches
    b2, b3 = w2.written / w2.micro_batches, w3.written / w3.micro_batches
    return Work(1, max(0.0, f2 + (micro - 2) * (f3 - f2)), round(w2.ops / w2.micro_batches),
                max(0, round(b2 + (micro - 2) * (b3 - b2))), w2.optimizer_ops)


def _batches(cfg: RunConfig) -> list[tuple[int, int]]:
    """Valid (micro, accumulation) pairs, smallest micro first; the effective batch never changes."""
    t, procs = cfg.training, cfg.distributed.processes
    if t.micro_batch_size != "auto" and t.gradient_accumulation != "auto":
        batch: Batch = resolve_batch(t, procs)
        return [(batch.micro, batch.accumulation)]
    if t.micro_batch_size == "auto" or (t.micro_batch_size is None and t.effective_batch_size is not None):
        return valid_batches(t, procs)  # the same choices the probe step confirms among
    if t.effective_batch_size is None:
        return [(t.micro_batch_size or 8, 1)]
    per_process = t.effective_batch_size // procs
    return [(t.micro_batch_size, per_process // t.micro_batch_size)]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"ratio {value['ratio']}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def describe(p: Plan) -> dict[str, Any]:
    """JSON-ready summary of a plan."""
    def row(c: Candidate) -> dict[str, Any]:
        return {"values": c.values, "micro_batch_size": c.micro, "gradient_accumulation": c.accumulation,
                "peak_bytes": c.peak, "min_peak_bytes": c.min_peak, "seconds_per_step": c.seconds
                if c.seconds < math.inf else None, "measured_seconds_per_step": c.measured,
                "time_parts": c.parts, "reason": c.reason}
    return {"budget_bytes": p.budget, "usable_bytes": p.usable, "device": p.device, "auto_fields": p.auto,
            "chosen": row(p.chosen), "alternatives": [row(c) for c in p.alternatives],
            "rejected": [row(c) for c in p.rejected], "rates": p.rates_source,
            "planning_seconds": round(p.seconds, 2)}


__all__ = ["Candidate", "NothingFits", "Plan", "auto_fields", "budget_bytes", "describe", "fit_micro_batch",
           "needs_plan", "plan", "tune_choice", "with_values"]
