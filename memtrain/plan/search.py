"""The planner's search: enumerate candidates, bound their step time, trace the ones that may win.

See :mod:`memtrain.plan.planner` for how the search prunes (branch and bound on time, memory dominance)
and how it breaks ties (``TIE``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memtrain.config import RecipeError, RunConfig
from memtrain.data.rows import Rows
from memtrain.distributed import sharding
from memtrain.errors import MemtrainError
from memtrain.estimator import derive
from memtrain.estimator import estimate as est
from memtrain.estimator.fake import build_fake_model, fake_tensor_mode, quiet_libraries
from memtrain.estimator.grpo import generation_phase
from memtrain.estimator.layers import layer_pattern
from memtrain.estimator.setup import recipe_value, resolve_config, trace_setup
from memtrain.estimator.trace import Work, in_batch, with_depth
from memtrain.patches import CostInputs, ModelShape, NoMatchError
from memtrain.plan import costmodel, space
from memtrain.plan.space import IN_BACKWARD, Candidate, auto_fields, batches, options, rank, with_values
from memtrain.reliability.budget import HostBudget
from memtrain.units import format_bytes

if TYPE_CHECKING:
    import torch

# Predicted step times this close count as equal: the cost model's rank correlation with measured
# steps was 0.89 over 40 candidates (scripts/bench/planner/planner.py as of commit aa39ed3), not 1. Among
# equals the planner takes the candidate with the fewest memory techniques, then the smallest peak.
TIE = 0.05
TUNE_MICROS = 4  # micro-batches per setting that tuning times (the largest that fit)


@dataclass
class _Traced:
    """A candidate's traces at micro-batch 2 and 3 (and single sizes traced on their own); when the
    search allows only micro-batch 1, that one alone (``c2``, ``c3`` None; both counts its)."""

    plan: Any  # the estimator's plan (settings, architecture, device)
    c2: Any
    c3: Any
    counts2: est.Counts
    counts3: est.Counts
    points: dict[int, Any] = field(default_factory=dict)  # micro-batch -> candidates traced directly
    # derived with the embedding offload: (the traces without it, what it moves); points derive too
    derived_from: tuple[_Traced, derive.Table] | None = None


class TraceCache:
    """What a plan traces, kept for the searches it runs: traces keyed by the settings they depend
    on (never the budget), and the length search's estimates keyed by settings and length.

    Owned by whoever plans: :func:`memtrain.plan.planner.plan` makes one per call and hands it to
    the length search and the search at the chosen length (the length search's last probe is the
    leanest candidate of the search after it: traced once). Pass one to several calls to share
    more (a benchmark planning one recipe for several budgets); a :class:`Search` made without one
    keeps its own. At most ``limit`` entries of each kind, the least recently used dropped first.
    """

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self.traces: OrderedDict[str, _Traced] = OrderedDict()
        self.estimates: OrderedDict[tuple[str, int], est.Estimate] = OrderedDict()

    def trace(self, key: str, make: Callable[[], _Traced]) -> _Traced:
        """The traces of ``key``, made by ``make`` the first time."""
        return _kept(self.traces, key, make, self.limit)

    def estimate(self, base: str, length: int, make: Callable[[], est.Estimate]) -> est.Estimate:
        """The estimate of the settings ``base`` at ``length`` tokens, made by ``make`` the first time."""
        return _kept(self.estimates, (base, length), make, self.limit)

    def lengths(self, base: str) -> list[int]:
        """The lengths estimated so far with the settings ``base``."""
        return [n for key, n in self.estimates if key == base]


def _kept(store: OrderedDict[Any, Any], key: Any, make: Callable[[], Any], limit: int) -> Any:
    if key in store:
        store.move_to_end(key)
        return store[key]
    store[key] = value = make()
    while len(store) > limit:
        store.popitem(last=False)
    return value

OFFLOADED = "memory.offload.activations"
EMBEDDINGS = "memory.offload.embeddings"
# the fields with no memory order under activation offload (Knob.unordered_offloaded)
UNORDERED_OFFLOADED = space.unordered_offloaded_fields()
# the fields whose leaner values never make a step faster (Knob.slower_when_leaner)
SLOWER_WHEN_LEANER = space.slower_when_leaner_fields()
# of them, those whose time order does not hold under activation offload (Knob.unordered_time_offloaded)
UNORDERED_TIME_OFFLOADED = space.unordered_time_offloaded_fields()

# The fields whose techniques patch the model, so whose applicability a fake model shows before
# any trace (see Search.inapplicable): the registered knobs that say so (Knob.patches_model).
PATCHED_FIELDS = space.patched_fields()
# the fields that describe the model being trained: a plain trace keeps them
BASE_FIELDS = space.base_fields()
# and the techniques a lower bound keeps as well (they can make a step cheaper than plain)
BOUND_FIELDS = space.bound_fields()
# the fields whose values leave the weights, buffers and optimizer state as they are (Knob.holds_same)
HOLDS_SAME = space.holds_same_fields()


class Search:
    """Enumerate, bound and evaluate candidates (see the module docstring): the search behind
    :func:`memtrain.plan.planner.plan` and the leanest candidate of :mod:`memtrain.plan.length`."""

    def __init__(self, cfg: RunConfig, device: str, usable: int, fields: list[str] | None = None,
                 rows: Rows | None = None, host: HostBudget | None = None, alternatives: bool = True,
                 exact_length: bool = False, cache: TraceCache | None = None) -> None:
        self.cfg, self.device, self.usable = cfg, device, usable
        # True: every trace runs every loop iteration (the estimator before issue 37; benchmarks)
        self.exact_length = exact_length
        # False: trace only what can change the choice (see run); the alternatives are not all known
        self.alternatives = alternatives
        self.host = host  # the host RAM a plan may keep (None: no limit)
        self.rows = rows  # the data's longest batch (None: the recipe's worst case)
        self.config, _ = resolve_config(cfg.model)
        self.depth = int(self.config.num_hidden_layers)
        self.hidden = int(getattr(self.config, "hidden_size", 0) or 0)
        self.vocab = int(getattr(self.config, "vocab_size", 0) or 0)
        skip = ("training.micro", "training.gradient", "data.")  # batches: below; the length: plan.length
        self.fields = [f for f in auto_fields(cfg) if not f.startswith(skip)] if fields is None else fields
        self.batches = batches(cfg)
        # Without a fixed effective batch a larger micro-batch is a larger step: candidates, which fit
        # different micro-batches, are compared per example then (per step otherwise: the same order)
        self.per_example = len({m * a for m, a in self.batches}) > 1
        self.unit = "s per example" if self.per_example else "s per step"
        period = layer_pattern(cfg, self.config, self.depth).period  # layers repeating in groups
        self.shape = ModelShape(self.depth, self.hidden, self.vocab, period)
        self.rates = costmodel.rates(device)
        self.host_rates = costmodel.rates("cpu") if device == "cuda" else self.rates
        self.done: list[Candidate] = []
        self.pruned: list[Candidate] = []
        self._patch_errors: dict[str, str | None] = {}  # applicability of one technique value
        self._tables: dict[str, derive.Table | None] = {}  # what an embedding offload moves
        self._floors: dict[str, tuple[int, str, int]] = {}  # bytes, the knob's field, held of them
        self._cfgs: dict[str, RunConfig] = {}
        self.floored: list[Candidate] = []  # rejected by their floor, untraced (in `pruned` too)
        # the plan's traces (a trace depends only on the settings in its key, never on the budget)
        self.cache = TraceCache() if cache is None else cache

    def candidates(self) -> Iterator[Candidate]:
        domains = [options(self.cfg, f, self.shape) for f in self.fields]
        for combo in itertools.product(*domains):
            values = dict(zip(self.fields, combo, strict=True))
            try:  # e.g. a quantized base trained in full, the step in backward with clipping,
                sharding.sharded(with_values(self.cfg, values))  # an 8-bit optimizer on shards
            except (ValueError, MemtrainError):
                continue
            yield Candidate(values)

    def run(self) -> Candidate | None:
        cands = list(self.candidates())
        bound_of = {i: self.lower_bound(c) for i, c in enumerate(cands)}
        fastest: Candidate | None = None
        too_big: list[Candidate] = []
        host_big: list[Candidate] = []  # fit the device, not the host
        fits: list[Candidate] = []
        seen: set[int] = set()  # judged: in the loop below, or traced ahead of their turn by it

        def judge(cand: Candidate) -> None:
            """Trace ``cand`` and file it: fits, too big for the device, or for the host; or, where
            a patch finds nothing to act on (checkpointing a model without a list of layers,
            ALBERT), not applicable."""
            nonlocal fastest
            try:
                self.evaluate(cand)
            except NoMatchError as err:
                cand.reason = "not applicable to this model: " + str(err).split(" Fix:")[0]
                self.pruned.append(cand)
                return
            if cand.seconds == math.inf:
                if cand.min_peak > self.usable:  # the device is too small
                    too_big.append(cand)
                elif self._host_short(cand):
                    host_big.append(cand)
                return
            fits.append(cand)
            if fastest is None or self.time(cand) < self.time(fastest):
                fastest = cand

        moved_of: dict[int, int] = {}  # the bytes each candidate's bound counts as moved so far

        def judged(cand: Candidate) -> None:
            judge(cand)
            self._raise_bounds(cand, cands, bound_of, seen, moved_of)

        # in the order of their bounds, which a traced offload can raise for the others (see
        # _raise_bounds): the next is the least of what is left, so the order never goes down
        while left := [k for k in range(len(cands)) if k not in seen]:
            i = min(left, key=lambda k: (bound_of[k], k))
            cand, bound = cands[i], bound_of[i]
            if self._pruned(cand, bound, fastest, fits, too_big, host_big):
                seen.add(i)
                continue
            # Near the limit (a candidate was too big), before tracing it, the leanest candidate it
            # keeps at least as much as, if that one could win too (its bound within reach): where
            # that does not fit, neither does this one nor any other above it, all pruned by
            # dominance for one trace. (With room to spare it would only trace slower candidates.)
            k = self._leaner(cands, i, bound_of, seen, fastest, too_big, fits) if too_big else None
            if k is not None:
                seen.add(k)
                judged(cands[k])
                if bound_of[i] > bound:  # its bound raised by that trace: back in line
                    continue
                if self._pruned(cand, bound, fastest, fits, too_big, host_big):
                    seen.add(i)
                    continue
            seen.add(i)
            judged(cand)
        if fastest is None:
            self._smallest_traced()
            return None
        ties = [c for c in fits if self.time(c) <= self.time(fastest) * (1 + TIE)]
        best = min(ties, key=lambda c: (self.techniques(c), _gathers(c), c.peak, self.time(c)))
        self._settle(best)
        for cand in fits:
            if cand is best:
                continue
            if cand in ties and self.techniques(cand) > self.techniques(best):
                cand.reason = (f"{self.time(cand):.3g} {self.unit} vs {self.time(best):.3g} s: within the "
                               f"cost model's {TIE:.0%} error, and it uses more memory techniques")
            elif cand in ties and _gathers(cand) > _gathers(best):
                cand.reason = (f"{self.time(cand):.3g} {self.unit} vs {self.time(best):.3g} s: within the "
                               f"cost model's {TIE:.0%} error, and it gathers every layer's weights twice "
                               "per step (`sharding: full`) where `grad_op` gathers them once")
            elif cand in ties and cand.peak > best.peak:
                cand.reason = (f"{self.time(cand):.3g} {self.unit} vs {self.time(best):.3g} s: within the "
                               f"cost model's {TIE:.0%} error, and it leaves less memory free")
            else:
                cand.reason = f"slower: {self.time(cand):.3g} {self.unit} vs {self.time(best):.3g} s"
        return best

    def _raise_bounds(self, traced: Candidate, cands: list[Candidate], bound_of: dict[int, float],
                      seen: set[int], moved_of: dict[int, int]) -> None:
        """After ``traced`` was evaluated: the bounds of the candidates not judged yet that move at
        least its offloaded bytes (:meth:`moves_at_least`), with those bytes' transfers counted
        (``moved_of``: the bytes each bound counts already; fewer raise nothing)."""
        if not traced.moved:
            return
        for k, cand in enumerate(cands):
            if k in seen or traced.moved <= moved_of.get(k, 0) or not self.moves_at_least(cand, traced):
                continue
            moved_of[k] = traced.moved
            bound_of[k] = max(bound_of[k], self.lower_bound(cand, traced.moved))

    def moves_at_least(self, cand: Candidate, traced: Candidate) -> bool:
        """``cand``'s activation offload moves at least the bytes ``traced``'s (evaluated) moved per
        micro-batch: both offload activations, at the one micro-batch the search allows (so at
        the same one), with the same other offloads (the same bytes resident on the host), and
        ``cand`` keeps at least as much on the host in every field (:meth:`dominated` with
        ``host``: it saves at least as much for backward, so offload moves at least as much).
        ``tests/plan/test_offload_bound.py`` audits it on every pair of a search."""
        if len(self.batches) != 1 or not self._offloaded(cand) or not self._offloaded(traced):
            return False
        if any(space.to_host(f) and cand.values[f] != traced.values[f] for f in self.fields):
            return False
        return self.dominated(cand, traced, host=True)

    def _pruned(self, cand: Candidate, bound: float, fastest: Candidate | None, fits: list[Candidate],
                too_big: list[Candidate], host_big: list[Candidate]) -> bool:
        """Whether ``cand`` is judged without a trace (its reason set, added to ``pruned``):
        inapplicable, slower than the fastest by its bound, dominated by one that does not fit,
        or (without alternatives) unable to change the choice."""
        if (why := self.inapplicable(cand)) is not None:  # before any ranking: true on any machine
            cand.reason = "not applicable to this model: " + why
        elif self.floored_out(cand):
            cand.micro, cand.accumulation = (self.batches_for(cand) or self.batches)[0]
            cand.min_peak, path, held = self._floor(cand)
            value = cand.values.get(path, recipe_value(self.cfg, path))
            kept = (f"keeps at least {format_bytes(cand.min_peak - held)} beside the "
                    f"{format_bytes(held)} of weights and optimizer state every step holds, "
                    f"{format_bytes(cand.min_peak)}" if held else
                    f"alone keeps at least {format_bytes(cand.min_peak)}")
            cand.reason = (f"does not fit: `{path}: {value}` {kept} at micro-batch {cand.micro} > "
                           f"{format_bytes(self.usable)} usable (not traced)")
            self.floored.append(cand)
        elif fastest is not None and bound > self.time(fastest) * (1 + TIE):
            cand.reason = (f"slower: at least {bound:.3g} {self.unit}, the fastest that fits needs "
                           f"{self.time(fastest):.3g} s")
        elif (big := next((t for t in too_big if self.dominated(cand, t)), None)) is not None:
            cand.reason = f"keeps at least as much as {big.label()}, which does not fit"
        elif (big := next((t for t in host_big if self.dominated(cand, t, host=True)), None)) is not None:
            cand.reason = (f"keeps at least as much on the host as {big.label()}, which does not fit "
                           "the host")
        elif (quick := self._outrun_by(cand, fits)) is not None:
            cand.reason = (f"not traced: no faster than {quick.label()}, which fits at the largest "
                           "micro-batch and differs only in techniques that add work, fewer of them")
        elif (fewest := self._unchosen(cand, bound, fastest, fits)) is not None:
            assert fastest is not None
            cand.reason = (f"not traced: at least {bound:.3g} {self.unit}, no faster than "
                           f"{self.time(fastest):.3g} s, with more memory techniques than "
                           f"{fewest.label() or 'the recipe as written'}, which fits within the "
                           f"cost model's {TIE:.0%} error")
        else:
            return False
        self.pruned.append(cand)
        return True

    def _unchosen(self, cand: Candidate, bound: float, fastest: Candidate | None,
                  fits: list[Candidate]) -> Candidate | None:
        """Without alternatives, the fitting candidate the tie rule picks over ``cand`` whatever
        ``cand``'s trace says (None where there is none): ``cand``, by its bound, is no faster than
        the fastest, and turns on more techniques than the one with the fewest in the tie window.

        Candidates come in the order of their bounds: none from here on is faster than `fastest`,
        so the tie window is final, and one with more techniques than a candidate inside it cannot
        be chosen (the tie rule counts techniques first). (Before the window is final, a faster
        candidate with more techniques, skipped, could have pushed the pick out of it:
        tests/plan/test_planner.py.)
        """
        if self.alternatives or fastest is None or bound < self.time(fastest):
            return None
        fewest = min((c for c in fits if self.time(c) <= self.time(fastest) * (1 + TIE)), key=self.techniques)
        return fewest if self.techniques(cand) > self.techniques(fewest) else None

    def _leaner(self, cands: list[Candidate], i: int, bound_of: dict[int, float], seen: set[int],
                fastest: Candidate | None, too_big: list[Candidate], fits: list[Candidate]) -> int | None:
        """The leanest candidate not judged yet that ``cands[i]`` keeps at least as much as, in
        every field, and whose bound could still win; None where there is none but ``cands[i]``."""
        reach = self.time(fastest) * (1 + TIE) if fastest is not None else math.inf
        best, lean = None, -1
        for k, other in enumerate(cands):
            if k == i or k in seen or bound_of[k] > reach or not self.dominated(cands[i], other):
                continue
            if (any(self.dominated(other, t) for t in too_big) or self.inapplicable(other) is not None
                    or self.floored_out(other)):
                continue
            if self._outrun_by(other, fits) is not None:  # keeps no more than one that fits: fits
                continue
            if self._unchosen(other, bound_of[k], fastest, fits) is not None:
                continue  # cannot be chosen: its trace would only prune
            score = self.leanness(other)
            if score > lean:
                best, lean = k, score
        return best

    def _settle(self, cand: Candidate) -> None:
        """The chosen candidate's own peak, where the search bounded it from above.

        When other micro-batches accumulate, every pair is judged on a trace whose micro-batch
        runs beside the gradients of an earlier one; a choice without accumulation never holds
        them, so its predicted peak is taken from a trace without them (lower, and what the
        callback's comparison with the measured steps should see).
        """
        if cand.accumulation != 1 or not any(a > 1 for _, a in self.batches_for(cand)):
            return
        cfg = self._cfg(cand)
        summary = self._summary(self._traced(cfg, 1), cand.micro, cand.accumulation)
        cand.peak, cand.host = summary.total_bytes, summary.host_peak_bytes

    def leanness(self, cand: Candidate) -> int:
        """How far down the fields' memory orders ``cand`` sits (the sum of its ranks): the
        candidate with the most is the leanest."""
        return sum(sum(rank(f, v, self.depth, self.vocab)) for f, v in cand.values.items())

    def time(self, cand: Candidate) -> float:
        """What the search ranks ``cand`` (evaluated) by: seconds per step, or per example where the
        effective batch is not fixed (``per_example``)."""
        return cand.seconds / (cand.micro * cand.accumulation) if self.per_example else cand.seconds

    def techniques(self, cand: Candidate) -> int:
        """How many memory techniques ``cand`` turns on (LoRA vs full fine-tuning is not one)."""
        return sum(1 for f, v in cand.values.items() if space.turns_on(f, v, self.depth))

    def micro_options(self, cand: Candidate) -> list[Candidate]:
        """``cand`` (evaluated, fitting) at up to ``TUNE_MICROS`` of its largest micro-batches that fit.

        Smaller micro-batches than the fitted one are accumulated, so their peak comes from the
        trace on held gradients; micro-batch 1 is left out unless it is the fitted one (it would
        need a trace of its own).
        """
        cfg = self._cfg(cand)
        out = [dataclasses.replace(cand, reason="")]
        for micro, accumulation in reversed(self.batches_for(cand)):
            if len(out) == TUNE_MICROS:
                break
            if micro >= cand.micro or micro == 1:
                continue
            traced = self._traced(cfg, accumulation)
            summary = self._summary(traced, micro, accumulation)
            if not self.fits(summary):
                continue
            work = costmodel.work_at(traced.counts2.work, traced.counts3.work, micro)
            cost = self._cost(cfg, work, traced.counts2, accumulation, summary, micro)
            out.append(dataclasses.replace(cand, micro=micro, accumulation=accumulation, reason="",
                                           peak=summary.total_bytes, host=summary.host_peak_bytes,
                                           seconds=cost.seconds, parts=cost.parts))
        return out

    def dominated(self, cand: Candidate, small: Candidate, host: bool = False) -> bool:
        """``cand`` keeps at least as much memory as ``small`` in every field: on the device, or
        with ``host``, on the host (where an offload's order is reversed: :func:`space.to_host`).

        The step in backward saves gradients but allows no accumulation (fewer micro-batch
        choices), so candidates that differ in it are not comparable; nor, on a CPU device, are
        candidates that differ in an offload (the "host" is the same memory, and the offload's
        copies add to it: ``python -m scripts run dominance --quick``).
        """
        if cand.values.get(IN_BACKWARD, False) != small.values.get(IN_BACKWARD, False):
            return False
        # Under activation offload some fields' memory orders do not hold (Knob.unordered_offloaded:
        # checkpointing, the lean norm; found by scripts/bench/planner/dominance.py)
        offloaded = self._offloaded(cand, small)
        at = functools.partial(rank, depth=self.depth, vocab=self.vocab)
        for f in self.fields:
            if self.device == "cpu" and space.to_host(f) and cand.values[f] != small.values[f]:
                return False  # a CPU's host is its device: an offload moves nothing off it, and copies
            if f in UNORDERED_OFFLOADED and offloaded and not host and cand.values[f] != small.values[f]:
                return False  # on the device; on the host, what a technique saves less is moved less
            pairs = zip(at(f, cand.values[f]), at(f, small.values[f]), strict=True)
            if host and space.to_host(f):
                if any(a < b for a, b in pairs):
                    return False
            elif any(a > b for a, b in pairs):
                return False
        return True

    def _outrun_by(self, cand: Candidate, fits: list[Candidate]) -> Candidate | None:
        """A fitting candidate the search chooses over ``cand`` whatever ``cand``'s trace says
        (:meth:`_outrun`); None when there is none, or the alternatives are wanted."""
        return None if self.alternatives else next((f for f in fits if self._outrun(cand, f)), None)

    def _outrun(self, cand: Candidate, fast: Candidate) -> bool:
        """``fast`` (evaluated, fitting) is chosen over ``cand`` whatever ``cand``'s trace would
        say: ``cand`` is :meth:`no_faster` than it and turns on more memory techniques, while
        ``fast`` fits at the largest micro-batch either may use (``cand``, keeping no more, fits
        there too). The tie rule prefers ``fast`` (fewer techniques), and ``cand`` cannot move the
        fastest, so the window stays."""
        if fast.seconds == math.inf or (fast.micro, fast.accumulation) != self.batches_for(fast)[-1]:
            return False
        return self.techniques(cand) > self.techniques(fast) and self.no_faster(cand, fast)

    def no_faster(self, cand: Candidate, other: Candidate) -> bool:
        """``cand`` differs from ``other`` only in fields whose leaner values never make a step
        faster (``SLOWER_WHEN_LEANER``; under activation offload, not those that save less for
        backward: ``UNORDERED_TIME_OFFLOADED``), and is leaner or equal in each: at the same
        micro-batch its predicted step is no faster. (scripts/bench/planner/dominance.py ``--time`` checks
        the claim on every pair of a search's candidates.)"""
        if cand.values.get(IN_BACKWARD, False) != other.values.get(IN_BACKWARD, False):
            return False
        at = functools.partial(rank, depth=self.depth, vocab=self.vocab)
        offloaded = self._offloaded(cand, other)
        for f in self.fields:
            a, b = cand.values[f], other.values[f]
            if a == b:
                continue
            if f not in SLOWER_WHEN_LEANER or (offloaded and f in UNORDERED_TIME_OFFLOADED):
                return False
            if any(x < y for x, y in zip(at(f, a), at(f, b), strict=True)):
                return False
        return True

    def _offloaded(self, *cands: Candidate) -> bool:
        """Whether any of ``cands`` offloads activations (as it sets it, else as the recipe does)."""
        return any(c.values.get(OFFLOADED, recipe_value(self.cfg, OFFLOADED)) is True for c in cands)

    def _host_short(self, cand: Candidate) -> bool:
        """``cand`` (evaluated, not fitting) fits the device but not the host budget."""
        return cand.min_peak <= self.usable and self.host is not None and not self.host.fits(cand.host)

    def floor(self, cand: Candidate) -> int:
        """Device bytes ``cand`` keeps at least at its smallest micro-batch, without a trace of its
        own: its knobs' ``floor`` (:func:`space.floor`), plus what the step holds beside it from
        start to end (:meth:`held`) where a knob has one; 0 when the search plans for the data at
        hand (``rows``: its rows may be shorter than ``data.max_length``)."""
        return self._floor(cand)[0]

    def _floor(self, cand: Candidate) -> tuple[int, str, int]:
        """:meth:`floor`, the field whose knob gives it, and the held bytes in it."""
        key = _key(cand.values)
        if key not in self._floors:
            micro = (self.batches_for(cand) or self.batches)[0][0]
            if self.rows is not None:
                return 0, "", 0
            found, path = space.floor(self._cfg(cand), self.shape, micro)
            held = self.held(cand) if found else 0
            if held is None:
                return found, path, 0  # its plain trace is not made yet: kept until it is
            self._floors[key] = (found + held, path, held)
        return self._floors[key]

    def held(self, cand: Candidate) -> int | None:
        """Device bytes every step of ``cand`` holds from start to end (its weights, buffers and
        optimizer state), from the trace its time bound made (:meth:`_bound_trace`: the searched
        fields off but the model's own and those that can make a step cheaper): ``cand`` holds the
        same where it differs from that trace only in fields that act on activations alone
        (``Knob.holds_same``), else 0 (unknown). None where that trace is not made yet."""
        cfg, accumulation, values = self._bound_trace(cand)
        if any(cand.values[f] != values.get(f, cand.values[f]) and f not in HOLDS_SAME for f in self.fields):
            return 0
        traced = self.cache.traces.get(self._trace_key(cfg, accumulation))
        if traced is None:
            return None
        return est.held_bytes(traced.c2 if traced.c2 is not None else self._point(traced, 1))

    def floored_out(self, cand: Candidate) -> bool:
        """``cand``'s floor alone exceeds the usable budget: it does not fit, untraced."""
        return self.floor(cand) > self.usable

    def _smallest_traced(self) -> None:
        """Where nothing fits, trace the candidates rejected by their floor that could still have
        the smallest peak, so that the smallest peak the planner reports (``NothingFits``) is an
        estimate, never a floor: in floor order (the leanest first among equal floors), while a
        floor is below the smallest traced peak, each that does not keep at least as much as a
        traced candidate that does not fit (one that does keeps at least its peak: the search's own
        dominance pruning)."""
        for cand in sorted(self.floored, key=lambda c: (c.min_peak, -self.leanness(c))):  # leanest first
            traced = [c for c in self.done if c.min_peak]
            if cand.min_peak >= min((c.min_peak for c in traced), default=math.inf):
                break
            if any(c.min_peak > self.usable and self.dominated(cand, c) for c in traced):
                continue
            self.pruned.remove(cand)
            try:
                self.evaluate(cand)
            except NoMatchError as err:
                cand.reason = "not applicable to this model: " + str(err).split(" Fix:")[0]
                self.pruned.append(cand)

    def lower_bound(self, cand: Candidate, moved: int = 0) -> float:
        """What :meth:`time` ranks ``cand`` by, at least: from the plain trace of its adapter and
        base (and of the techniques that can make a step cheaper, as ``cand`` has them), plus what
        its other techniques add at least (a checkpoint's recompute, the tiled MLP's), at the
        largest micro-batch: where a step with a fixed effective batch, or an example, costs least
        (the micro-batch ``cand`` fits is not known before its trace). ``moved``: activation bytes
        ``cand``'s offload moves to the host per micro-batch at least (:meth:`moves_at_least`),
        whose transfers count too (0: unknown before its trace)."""
        cfg, traced_at, _ = self._bound_trace(cand)
        batches = self.batches_for(cand) or self.batches
        try:
            traced = self._traced(cfg, traced_at)
        except NoMatchError:  # e.g. a lean norm on a model without RMSNorm: `inapplicable` prunes it
            return 0.0
        micro, accumulation = batches[-1]  # a step, or an example, costs least there
        work = costmodel.work_at(traced.counts2.work, traced.counts3.work, micro)
        # what the candidate's techniques add to the bound's trace (each knob's cost hook; where the
        # recipe fixes a technique, that trace has its work already)
        cost = self._cost(self._cfg(cand), work, traced.counts2, accumulation, None, micro, traced=cfg,
                          moved=moved)
        seconds = cost.seconds
        return seconds / (micro * accumulation) if self.per_example else seconds

    def _bound_trace(self, cand: Candidate) -> tuple[RunConfig, int, dict[str, Any]]:
        """The recipe :meth:`lower_bound` traces for ``cand``, the accumulation it traces it at, and
        the values it sets: the searched fields off, but the model's own and the techniques that
        can make a step cheaper as ``cand`` has them."""
        base = {f: v for f, v in cand.values.items() if f in BOUND_FIELDS}
        values = {**self._plain(cand), **base}
        accumulation = 2 if any(a > 1 for _, a in self.batches) else 1
        return self._with(values), accumulation, values

    @functools.cached_property
    def cost_model(self) -> torch.nn.Module | None:
        """A fake model of the recipe as written with its techniques off, at up to two layers: the
        shapes a knob's cost hook reads (``CostInputs.model``); None where no candidate or no model."""
        first = next(self.candidates(), None)  # the projections' shapes are the same in any
        if first is None:  # quantization and adapter: the first candidate's, its techniques off
            return None
        cfg = with_values(self.cfg, {**first.values, **self._plain(first)})
        config, _ = resolve_config(cfg.model)
        try:
            with fake_tensor_mode(packed=cfg.data.packing), quiet_libraries():
                return build_fake_model(cfg, with_depth(config, min(2, self.depth)))
        except NoMatchError:
            return None

    def inapplicable(self, cand: Candidate) -> str | None:
        """Why one of ``cand``'s techniques cannot be applied to this model, or None.

        Each technique value is checked on its own (the others plain, the candidate's adapter and
        quantization kept) by applying the patches to a fake model, once per search; a technique
        whose patch finds nothing to patch (checkpointing a model without a list of layers,
        ALBERT) is named here, whatever the machine's speed would rank it. Errors only a trace
        shows still come from :meth:`evaluate`.
        """
        base = {f: v for f, v in cand.values.items() if f in BASE_FIELDS}
        plain = {**cand.values, **self._plain(cand), **base}
        if self._patch_error(plain) is not None:
            return None  # fails without any technique: not a technique's fault (evaluate reports it)
        for path, value in cand.values.items():
            if path in PATCHED_FIELDS and any(rank(path, value, self.depth)):
                why = self._patch_error({**plain, path: value})
                if why is not None:
                    return why
        return None

    def _patch_error(self, values: dict[str, Any]) -> str | None:
        """The :class:`NoMatchError` (without its fix) of applying the patches of ``values``, cached.

        Built with 2 layers first (cheap); a failure is confirmed at the model's depth.
        """
        key = _key(values)
        if key not in self._patch_errors:
            try:
                cfg = with_values(self.cfg, values)
            except (ValueError, MemtrainError):
                self._patch_errors[key] = None  # not a valid combination: candidates() skips those
                return None
            config, _ = resolve_config(cfg.model)
            why = None
            for depth in sorted({min(2, self.depth), self.depth}):
                why = _patch_error(cfg, with_depth(config, depth))
                if why is None:
                    break
            self._patch_errors[key] = why
        return self._patch_errors[key]

    def _plain(self, cand: Candidate) -> dict[str, Any]:
        """The searched fields with their techniques off (each registered knob's ``off``)."""
        return space.plain(self.fields)

    def evaluate(self, cand: Candidate) -> None:
        """Trace ``cand``, pick its largest fitting micro-batch, predict its time.

        Accumulation matters to the peak: from the second micro-batch on, gradients are held
        during the forward. Traces of an accumulated micro-batch (on held gradients) bound every
        pair from above; a pair without accumulation is traced on its own only when the gradients it does
        not hold could make the difference.
        """
        cfg = self._cfg(cand)
        batches = self.batches_for(cand)
        if not batches:
            cand.micro, cand.accumulation = self.batches[0]
            cand.reason = ("the optimizer step in backward needs gradient_accumulation 1, and no "
                           "allowed micro-batch equals the effective batch")
            self.pruned.append(cand)
            return
        held = 2 if any(a > 1 for _, a in batches) else 1
        traced = self._traced(cfg, held)

        def fit_at(micro: int, accumulation: int) -> tuple[int, int, est.Estimate, _Traced] | None:
            at, summary = traced, self._summary(traced, micro, accumulation)
            if summary.total_bytes > self.usable and accumulation == 1 and held == 2 \
                    and summary.total_bytes - self._grad_bytes(cfg, traced) <= self.usable:
                summary = self._summary(self._traced(cfg, 1), micro, accumulation)
                if summary.total_bytes <= self.usable:
                    at = self._traced(cfg, 1)
            return (micro, accumulation, summary, at) if self.fits(summary) else None

        linear = traced.c2 is not None and in_batch(traced.c2, traced.c3, 2, 3, 4) is not None
        if not linear and len(batches) > 2 and len({a for _, a in batches}) == 1:
            # Each micro-batch would be traced on its own (the traces at 2 and 3 do not line up, or
            # only 1 was traced); with one accumulation for all, a larger micro-batch keeps more:
            # bisect for the largest that fits (about 10 traces of up to 1,024 micro-batches)
            # micro-batch 2 and 3 are the traces themselves (not where accumulation 1 would need
            # a trace without held gradients): checked first, for free
            known = [k for k, (m, a) in enumerate(batches) if m in (2, 3) and traced.c2 is not None
                     and (held == 1 or a > 1)]
            fitted = _largest(batches, fit_at, known)
        elif linear and len({a for _, a in batches}) == 1 and not (traced.c3.values < traced.c2.values).any():
            # every op's bytes grow with the micro-batch (the line through 2 and 3): so does the peak,
            # and where one micro-batch does not fit no larger one does; bisect (no trace is made)
            # instead of predicting each of up to 1,024 from the largest down; from micro-batches 2
            # and 3 (the traces themselves: micro-batch 1 is traced on its own, only where 2 does
            # not fit)
            fitted = _largest(batches, fit_at, [k for k, (m, _) in enumerate(batches) if m in (2, 3)])
        else:
            fitted = next((f for m, a in reversed(batches) if (f := fit_at(m, a)) is not None), None)
        if fitted is None:
            cand.micro, cand.accumulation = batches[0]
            smallest = self._summary(traced, cand.micro, cand.accumulation)
            cand.min_peak, cand.host = smallest.total_bytes, smallest.host_peak_bytes
            cand.moved = smallest.host_moved_bytes
            cand.reason = (f"does not fit: {format_bytes(cand.min_peak)} at micro-batch {cand.micro} > "
                           f"{format_bytes(self.usable)} usable" if cand.min_peak > self.usable else
                           f"does not fit the host: at micro-batch {cand.micro}, "
                           + self.host.shortfall(cand.host))  # type: ignore[union-attr]
            self.done.append(cand)
            return
        micro, accumulation, summary, traced = fitted
        cand.micro, cand.accumulation, cand.peak = micro, accumulation, summary.total_bytes
        cand.host, cand.moved = summary.host_peak_bytes, summary.host_moved_bytes
        first = batches[0][0]  # below 2 the linear model is not used: bound it from micro 2
        smallest = 2 if first == 1 and micro > 1 else first
        cand.min_peak = self._summary(traced, smallest, dict(batches).get(smallest, accumulation)).total_bytes
        work = costmodel.work_at(traced.counts2.work, traced.counts3.work, micro)
        cost = self._cost(cfg, work, traced.counts2, accumulation, summary, micro)
        cand.seconds, cand.parts = cost.seconds, cost.parts
        self.done.append(cand)

    def estimate_of(self, micro: int, accumulation: int) -> est.Estimate:
        """The estimate of the recipe as given (no field ``auto``) at ``micro`` x ``accumulation``,
        from the traces this search shares (:attr:`cache`): a later search with the same cache that
        evaluates the same settings reuses them (the length search's probe at the chosen length is the leanest
        candidate of the search that follows it)."""
        return self._summary(self._traced(self.cfg, accumulation), micro, accumulation)

    def fits(self, s: est.Estimate) -> bool:
        """The device total fits the usable budget, and the host bytes the host budget."""
        return s.total_bytes <= self.usable and (self.host is None or self.host.fits(s.host_peak_bytes))

    def batches_for(self, cand: Candidate) -> list[tuple[int, int]]:
        """The (micro, accumulation) pairs ``cand`` allows: without accumulation when its optimizer
        steps inside backward."""
        if cand.values.get(IN_BACKWARD, self.cfg.training.optimizer_in_backward) is True:
            return [(m, a) for m, a in self.batches if a == 1]
        return self.batches

    def _grad_bytes(self, cfg: RunConfig, traced: _Traced) -> int:
        return traced.counts2.trainable * (2 if cfg.model.dtype in ("bf16", "fp16") else 4)

    def _summary(self, traced: _Traced, micro: int, accumulation: int = 1) -> est.Estimate:
        """The estimate at ``micro``: linear from the traces at 2 and 3 (size 1 is traced itself:
        some models take other paths for a single example). For GRPO, the larger of the training
        step and the generation phase of ``micro`` x ``accumulation`` completions (TRL generates a
        whole generation batch at once, before the step's micro-batches): a plan must fit both."""
        cands = in_batch(traced.c2, traced.c3, 2, 3, micro) if micro >= 2 and traced.c2 is not None else None
        if cands is None:
            cands = self._point(traced, micro)
        summary = est.summarize(traced.plan, cands, traced.counts2, "", 0.0)
        if traced.plan.cfg.training.objective != "grpo":
            return summary
        held = sum(summary.by_category.get(name, 0) for name in ("parameters", "buffers", "optimizer_state"))
        generation = generation_phase(traced.plan.cfg, traced.plan.seq_len, micro * accumulation, held)
        if generation.peak_bytes <= summary.peak_bytes:
            return summary
        more = generation.peak_bytes - summary.peak_bytes
        return dataclasses.replace(summary, peak_bytes=generation.peak_bytes,
                                   total_bytes=summary.total_bytes + more,
                                   by_phase={**summary.by_phase, "generation": generation.peak_bytes})

    def _point(self, traced: _Traced, micro: int) -> Any:
        """The candidates of ``traced``'s settings at ``micro``, traced on their own (or derived
        from the traces without the embedding offload); kept in ``traced.points``. At micro-batch 2
        and 3 they are the traces the line is drawn through (``c2``, ``c3``): never traced again."""
        if micro not in traced.points:
            if micro in (2, 3) and traced.c2 is not None:
                traced.points[micro] = traced.c2 if micro == 2 else traced.c3
            elif traced.derived_from is not None:
                without, moved = traced.derived_from
                traced.points[micro] = derive.table_offloaded(self._point(without, micro), moved,
                                                              micro * traced.plan.seq_len)
            else:
                traced.points[micro] = est.trace_candidates(traced.plan, micro, traced.plan.seq_len, False)[0]
        return traced.points[micro]

    def _cost(self, cfg: RunConfig, work: Work, counts: est.Counts, accumulation: int,
              summary: est.Estimate | None, micro: int,
              traced: RunConfig | None = None, moved: int = 0) -> costmodel.StepCost:
        """Step time of the candidate recipe ``cfg`` at ``micro`` from ``work`` (its trace's, or with
        ``traced``, a lower bound's trace of that recipe); each technique adds its terms (its
        knob's cost hook: :func:`space.cost_terms`). ``summary`` (None: a lower bound) gives the
        bytes activation offload moves to the host and back per micro-batch
        (``host_moved_bytes``: the tensors' bytes, not the pinned blocks' size); without it, a lower
        bound, ``moved`` such bytes at least."""
        offloaded = summary.host_moved_bytes if summary is not None else moved
        inputs = CostInputs(cfg, self.shape, micro, counts.parameters, counts.trainable,
                            lambda: self.cost_model, work.recomputed, work.recomputed_selective, traced)
        terms = space.cost_terms(inputs)
        if terms["extra_flops"] or terms["extra_ops"] or terms["extra_written"]:
            work = Work(1, work.flops + terms["extra_flops"], work.ops + round(terms["extra_ops"]),
                        work.written + round(terms["extra_written"]), work.optimizer_ops)
        opt_off = bool(terms["optimizer_offloaded"])
        return costmodel.step_seconds(
            work, micro_batches=accumulation, rates=self.rates, dtype=cfg.model.dtype,
            optimizer=str(cfg.training.optimizer), trainable=counts.trainable,
            quantized_elements=int(terms["quantized_elements"]), recompute_passes=terms["recompute_passes"],
            offloaded_bytes=offloaded, optimizer_offloaded=opt_off,
            optimizer_rates=self.host_rates if opt_off else None, parameter_bytes=inputs.element,
            embedding_bytes=int(terms["embedding_bytes"]), extra_dequantized=int(terms["extra_dequantized"]))

    def _cfg(self, cand: Candidate) -> RunConfig:
        """The recipe with ``cand``'s values (cached per candidate: a pydantic validation each)."""
        return self._with(cand.values)

    def _with(self, values: dict[str, Any]) -> RunConfig:
        """The recipe with ``values`` of the searched fields (cached: a pydantic validation each)."""
        key = _key(values)
        if key not in self._cfgs:
            self._cfgs[key] = with_values(self.cfg, values)
        return self._cfgs[key]

    def _trace_key(self, cfg: RunConfig, accumulation: int) -> str:
        key = cfg.model_dump_json(include={"model", "data", "adapter", "training", "memory", "distributed"},
                                  exclude={"training": {"micro_batch_size", "gradient_accumulation",
                                                        "effective_batch_size"}})
        return key + f"|{min(accumulation, 2)}|{self.device}|{self.rows}|{self.single}|{self.exact_length}"

    @property
    def single(self) -> bool:
        """The search allows micro-batch 1 alone (a long context): traced at 1, not at 2 and 3."""
        return max(m for m, _ in self.batches) == 1

    def _traced(self, cfg: RunConfig, accumulation: int) -> _Traced:
        """Candidates and counts at micro-batch 2 and 3, or 1 alone when the search allows no other
        (cached per settings and accumulation). With the embedding offload, those of the same
        settings without it, derived (:mod:`memtrain.estimator.derive`): traced once for both."""
        key = self._trace_key(cfg, accumulation)
        if key not in self.cache.traces and derive.offloadable(cfg, self.device):
            moved = self._moved_table(cfg)
            if moved is not None:  # trace the step without the offload (or reuse it), derive this one
                without = self._traced(with_values(cfg, {EMBEDDINGS: False}), accumulation)
                return self.cache.trace(key, lambda: self._table_offloaded(without, moved))

        def make() -> _Traced:
            # the traces' own micro-batches are 2 and 3; a GRPO recipe is valid only in whole groups
            micro = cfg.training.grpo_num_generations if cfg.training.objective == "grpo" else 1
            one = {"training.micro_batch_size": micro, "training.effective_batch_size": None,
                   "training.gradient_accumulation": min(accumulation, 2)}
            plan = trace_setup(with_values(cfg, one), (), self.device, self.rows)
            if self.single:  # the linear model in the micro-batch is not needed: trace 1 alone
                c1, counts1, _ = est.trace_candidates(plan, 1, plan.seq_len, False, self.exact_length)
                return _Traced(plan, None, None, counts1, counts1, {1: c1})
            (c2, counts2, _), (c3, counts3, _) = est.trace_candidates_at(
                plan, [(2, plan.seq_len), (3, plan.seq_len)], False, self.exact_length)
            return _Traced(plan, c2, c3, counts2, counts3)

        return self.cache.trace(key, make)

    def _moved_table(self, cfg: RunConfig) -> derive.Table | None:
        """What the embedding offload of ``cfg`` moves (a fake model of 2 layers shows it), or None
        where a step with it is not derived (:func:`derive.table`) or it does not apply (its
        trace then says why)."""
        key = cfg.model_dump_json(exclude={"training"})
        if key not in self._tables:
            depth, built = min(2, self.depth), cfg  # any depth shows the table and the patches before it
            if isinstance(cfg.memory.checkpointing, int) and cfg.memory.checkpointing > depth:
                memory = cfg.memory.model_copy(update={"checkpointing": depth})
                built = cfg.model_copy(update={"memory": memory})
            try:
                with fake_tensor_mode(packed=cfg.data.packing), quiet_libraries():
                    self._tables[key] = derive.table(build_fake_model(built, with_depth(self.config, depth)))
            except NoMatchError:
                self._tables[key] = None
        return self._tables[key]

    def _table_offloaded(self, without: _Traced, moved: derive.Table) -> _Traced:
        """The traces with the embedding offload from ``without``'s (the same settings without it)."""
        plan = dataclasses.replace(without.plan, cfg=with_values(without.plan.cfg, {EMBEDDINGS: True}),
                                   notes=list(without.plan.notes))
        seq = plan.seq_len

        def counts(c: est.Counts, micro: int) -> est.Counts:
            return est.Counts(c.parameters, c.trainable, derive.patches_offloaded(c.patches, moved),
                              derive.work_offloaded(c.work, moved, micro * seq))

        if without.c2 is None:  # micro-batch 1 alone: its point derives (`_point`)
            one = counts(without.counts2, 1)
            return _Traced(plan, None, None, one, one, derived_from=(without, moved))
        return _Traced(plan, derive.table_offloaded(without.c2, moved, 2 * seq),
                       derive.table_offloaded(without.c3, moved, 3 * seq),
                       counts(without.counts2, 2), counts(without.counts3, 3), derived_from=(without, moved))


def _patch_error(cfg: RunConfig, config: Any) -> str | None:
    """Why the recipe's patches cannot be applied to a fake model of ``config`` (None: they can)."""
    err = _no_match(cfg, config)
    return None if err is None else str(err).split(" Fix:")[0]


def _no_match(cfg: RunConfig, config: Any) -> NoMatchError | None:
    try:
        with fake_tensor_mode(packed=cfg.data.packing), quiet_libraries():
            build_fake_model(cfg, config)
    except NoMatchError as err:
        return err
    except RecipeError:  # a setting no technique changes (the adapter's): the recipe's to fix
        raise
    except Exception:  # any other failure is the trace's to report, naming its field
        return None
    return None


def check_patches(cfg: RunConfig) -> None:
    """The techniques the recipe fixes apply to its model, as ``memtrain train`` finds once the
    model loads: each patch finds what it patches in a fake model built from the config (no
    weights; 2 layers, a failure confirmed at the model's depth). Fields left ``auto`` are off here
    (the planner skips a technique that does not apply). Quiet when the config needs the network.

    Raises:
        NoMatchError: a technique finds nothing to patch (lean norm on GPT-2's LayerNorm, embedding
            offload under a tied head); its message names the field and the fix.
    """
    try:
        config, _ = resolve_config(cfg.model)
        cfg = with_values(cfg, space.plain(space.auto_fields(cfg)))
    except (ValueError, MemtrainError):
        return  # the config is out of reach (ConfigNotFound), or the recipe's other checks report it
    depth = int(getattr(config, "num_hidden_layers", 0) or 0)
    err = None
    for layers in sorted({min(2, depth), depth}) if depth else [None]:
        err = _no_match(cfg, config if layers is None else with_depth(config, layers))
        if err is None:
            return
    raise err


def _largest(batches: list[tuple[int, int]], fit_at: Any, known: Iterable[int] = ()) -> Any:
    """``fit_at`` of the largest of ``batches`` (smallest first) where it is not None, by bisection:
    where a pair does not fit, no larger one does. ``known``: indices of ``batches`` whose
    ``fit_at`` costs no trace (checked first: each narrows the bisection for free)."""
    low, high, found = -1, len(batches), None  # fits at low (-1: none yet), not at high
    for i in sorted(known):
        if low < i < high:
            if (at := fit_at(*batches[i])) is not None:
                low, found = i, at
            else:
                high = i
    if high == len(batches):  # no pair known not to fit: the largest first (room to spare: one trace)
        if (top := fit_at(*batches[-1])) is not None:
            return top
        high -= 1
    if low < 0:
        if high == 0 or (found := fit_at(*batches[0])) is None:
            return None
        low = 0
    while high - low > 1:
        middle = (low + high) // 2
        if (at := fit_at(*batches[middle])) is not None:
            low, found = middle, at
        else:
            high = middle
    return found


def _key(values: dict[str, Any]) -> str:
    """A candidate's values as a dictionary key."""
    return json.dumps(values, sort_keys=True, default=str)


def _gathers(cand: Candidate) -> int:
    """All-gathers of every layer's weights per step (the cost model does not see collectives)."""
    return {"grad_op": 1, "full": 2}.get(cand.values.get("distributed.sharding", ""), 0)
