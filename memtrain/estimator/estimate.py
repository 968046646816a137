"""Predict a recipe's peak memory without loading weights: ``memtrain.estimate(recipe)``.

The estimator traces real training steps (forward, backward, optimizer step, after a warm-up
that creates optimizer state) of the recipe's model on fake tensors: the same load arguments,
quantization, patches and Trainer optimizer as training (:mod:`memtrain.trainer.build`), counted
by the same meter. It traces 2 and 3 decoder layers and extrapolates exactly to the real depth
(:mod:`memtrain.estimator.trace` explains why that is exact), so a 70B model costs seconds and no
weight memory; layers of several kinds are traced as their pattern repeats
(:mod:`memtrain.estimator.layers`). With ``memory.checkpointing: n`` (the first n layers) it traces
2+2, 3+2 and 2+3 checkpointed+plain layers and extrapolates in both counts (:data:`KINDS_TRACED`;
2+2 and 3+3 where n is half the depth, :data:`KINDS_EVEN`). The sequence
length is ``data.max_length`` (the worst case; data is never read).

On top of live tensor bytes, a CUDA run pays for the CUDA context and the caching allocator
(512-byte rounding of each allocation, fragmentation). Those appear as separate named lines:
rounding is computed from the traced allocations, the others come from ``memtrain calibrate``'s
profile when one exists, else from the documented defaults in :mod:`memtrain.estimator.calibrate`.

What to trace (architecture, step shape, device; :func:`resolve_config`) is decided in
:mod:`memtrain.estimator.setup`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from memtrain.config import RunConfig
from memtrain.config.batch import resolve_batch
from memtrain.data.rows import Rows
from memtrain.estimator import calibrate, grpo_step
from memtrain.estimator.layers import Pattern
from memtrain.estimator.pool import run_all
from memtrain.estimator.setup import TraceSetup, trace_setup
from memtrain.estimator.trace import (
    HOST,
    PINNED,
    ROUNDED,
    Candidates,
    Trace,
    Work,
    direct,
    extrapolate_checkpointed,
    extrapolate_checkpointed_evenly,
    extrapolate_depth,
    in_batch,
    trace_step,
    with_depth,
)
from memtrain.estimator.trace_events import CATEGORY_NAMES

PHASES = ("forward", "backward", "optimizer")


class Counts(NamedTuple):
    """What a traced step counts besides its bytes, at the model's full depth."""

    parameters: int  # every parameter (4-bit packed weights at their logical size)
    trainable: int
    patches: list[str]  # the patches applied, as their records name them
    work: Work | None  # FLOPs, ops and bytes written (None: not counted)


# With `memory.checkpointing: n` the first n layers differ from the rest: each point is traced at
# (checkpointed, plain) = (2, 2), (3, 2) and (2, 3) layers, as (depth, checkpointed layers).
KINDS_TRACED = [(4, 2), (5, 3), (5, 2)]
# Where as many layers are checkpointed as not (the planner's `n`: half the depth), both counts grow
# together, and (2, 2) and (3, 3) layers pin the line they grow on: two traces, not three (4 and 6
# layers where three trace 14 in all: the 8B at 131,072 tokens, 3.5 s where three took 4.1-4.6 s).
# A model no deeper than the deepest of these traces is traced whole instead: one trace per point,
# no deeper than theirs, and exact (the quickstart's 6-layer MiniLM with `checkpointing: 3`).
KINDS_EVEN = [(4, 2), (6, 3)]


@dataclass
class Estimate:
    """A predicted training step. Byte values; ``total_bytes`` is what the device must hold."""

    model: str
    device: str
    settings: dict[str, Any]
    parameters: int
    trainable: int
    peak_bytes: int  # live tensor bytes at the peak moment
    by_category: dict[str, int]  # at the peak
    by_phase: dict[str, int]  # peak of each phase
    category_at_phase_peak: dict[str, dict[str, int]]
    host_peak_bytes: int  # offloaded tensors in host memory
    host_resident_bytes: int  # of those, what stays on the host all step (weights, optimizer state)
    overheads: dict[str, int]  # named lines on top of tensors (CUDA; on CPU only host_offload)
    overhead_sources: dict[str, str]
    total_bytes: int
    method: str
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # the host bytes that come and go in a step (offloaded activations, looked-up rows) at their
    # size: what crosses to the host and back, without the pinned blocks' rounding (the cost model's)
    host_moved_bytes: int = 0
    work: Work | None = None  # FLOPs, ops and bytes written (the planner's cost model)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


@dataclass
class Sweep:
    """Peak memory as one setting varies: (value, tensor peak bytes, total bytes) per point."""

    micro_batch_size: list[tuple[int, int, int]]
    seq_len: list[tuple[int, int, int]]

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": [list(p) for p in self.micro_batch_size],
                "seq_len": [list(p) for p in self.seq_len]}


def estimate(recipe: RunConfig | str | Path | dict, overrides: Sequence[str] = (), *,
             device: str | None = None, exact: bool = False, rows: Rows | None = None,
             exact_length: bool = False) -> Estimate:
    """Predict the peak memory of one training step of ``recipe``, by category and phase.

    Args:
        recipe: a validated :class:`RunConfig`, a recipe file, shipped recipe name or dict.
        overrides: ``key=value`` overrides, as on the command line.
        device: ``cuda`` or ``cpu``: where the run will train (default: CUDA when this machine
            has it). On a machine without CUDA, a CUDA run is traced on CPU fake tensors with
            CUDA's optimizer kernels.
        exact: trace every layer, and every iteration of the loops over the tokens, instead of
            extrapolating in depth (from 2 and 3 layers) and running a long loop's first and last
            iterations (:mod:`memtrain.memory.loops`); slower, for checks.
        exact_length: run every iteration of the loops over the tokens, still extrapolating in depth.
        rows: the longest batch of the data at hand (:meth:`memtrain.data.prepare.PreparedData.rows`);
            default: the recipe's worst case, every row ``data.max_length`` tokens.

    Raises:
        MemtrainError: a setting the estimator needs is ``auto``, the model is unknown offline,
            or the recipe cannot be built; the message names the field.
    """
    start = time.perf_counter()
    plan = trace_setup(recipe, overrides, device, rows)
    candidates, counts, method = trace_candidates(plan, plan.micro_batch, plan.seq_len, exact,
                                                  exact_length=exact_length)
    return summarize(plan, candidates, counts, method, time.perf_counter() - start)


def sweep(recipe: RunConfig | str | Path | dict, overrides: Sequence[str] = (), *,
          micro_batch_sizes: Sequence[int] | None = None, seq_lens: Sequence[int] | None = None,
          device: str | None = None) -> Sweep:
    """Peak memory against micro-batch size and against sequence length.

    Micro-batch points come from two traced sizes, linear per op (exact, see
    :mod:`memtrain.estimator.trace`); each sequence length is traced (attention can be quadratic).
    """
    plan = trace_setup(recipe, overrides, device)
    sizes = sorted(set(micro_batch_sizes or _doubling(1, max(8, 4 * plan.micro_batch))))
    lengths = sorted(set(seq_lens or _seq_points(plan)))
    base = min(sizes)
    (c1, counts, method), (c2, _, _) = trace_candidates_at(plan, [(base, plan.seq_len),
                                                             (base + 1, plan.seq_len)], exact=False)
    by_batch = []
    for size in sizes:
        cands = in_batch(c1, c2, base, base + 1, size)
        if cands is None:  # per-op structure differs between sizes: trace this point
            cands = trace_candidates(plan, size, plan.seq_len, exact=False)[0]
        est = summarize(plan, cands, counts, method, 0.0)
        by_batch.append((size, est.peak_bytes, est.total_bytes))
    by_length = []
    at_lengths = trace_candidates_at(plan, [(plan.micro_batch, n) for n in lengths], exact=False)
    for length, found in zip(lengths, at_lengths, strict=True):
        est = summarize(plan, *found, 0.0)
        by_length.append((length, est.peak_bytes, est.total_bytes))
    return Sweep(by_batch, by_length)


# ----------------------------------------------------------------------------------- tracing


def trace_candidates(plan: TraceSetup, micro_batch: int, seq_len: int, exact: bool,
                     exact_length: bool = False) -> tuple[Candidates, Counts, str]:
    """Candidate peak ops of the full-depth step, parameter counts, and how they were obtained."""
    return trace_candidates_at(plan, [(micro_batch, seq_len)], exact, exact_length)[0]


def trace_candidates_at(plan: TraceSetup, points: Sequence[tuple[int, int]], exact: bool,
                        exact_length: bool = False) -> list[tuple[Candidates, Counts, str]]:
    """:func:`trace_candidates` at several (micro-batch, sequence length) points, their traces run side
    by side (:mod:`memtrain.estimator.pool`). Unless ``exact`` or ``exact_length``, the loops over
    the tokens (tiled MLP, lean norm, chunked loss) run only some of their iterations
    (:mod:`memtrain.memory.loops`), so a trace costs the same at any length; a trace whose loops
    were not steady is traced again whole."""
    whole = exact or not plan.pattern.worth_extrapolating()
    if whole and not exact and plan.pattern.kinds > 1 and not any("kinds" in n for n in plan.notes):
        plan.notes.append(f"its layers are of {plan.pattern.kinds} kinds that do not repeat often enough "
                          "to extrapolate from shorter traces, so every layer was traced")
    count = plan.cfg.memory.checkpointing
    kinds = not whole and isinstance(count, int)  # the first n layers are checkpointed, the rest not
    unit = checkpointed_unit(plan.pattern, count) if kinds else 1  # layers per group of each kind
    if kinds and not unit:  # two patterns at once, out of step: not extrapolated
        if "checkpointing" not in " ".join(plan.notes):
            period = plan.pattern.period
            why = (f"{count} is not a multiple of their group of {period}" if count % period
                   else "its first layers of their own are more than a group")
            plan.notes.append(f"memory.checkpointing: {count} of {plan.depth} layers where the layers "
                              f"differ ({plan.pattern.describe()}) and {why}, so every layer was traced")
        whole, kinds = True, False
    tail = plan.depth % unit if kinds else 0  # a last group cut short, after the plain groups
    if kinds and not 2 * unit <= count <= plan.depth - tail - 2 * unit:
        if "checkpointing" not in " ".join(plan.notes):
            plan.notes.append(f"memory.checkpointing: {count} of {plan.depth} layers leaves fewer than 2 "
                              f"{'groups of layers' if unit > 1 else 'layers'} checkpointed or not, so "
                              "every layer was traced")
        whole, kinds = True, False
    even = kinds and 2 * count == plan.depth
    if kinds and plan.depth <= unit * max(d for d, _ in (KINDS_EVEN if even else KINDS_TRACED)) + tail:
        whole, kinds, even = True, False, False  # one trace of every layer is no deeper than theirs
    # (depth, checkpointed layers: None for the recipe's own setting) of each trace of a point
    shapes = ([(plan.depth, None)] if whole
              else [(unit * d + tail, unit * n) for d, n in (KINDS_EVEN if even else KINDS_TRACED)] if kinds
              else [(depth, None) for depth in plan.pattern.traced])
    elide = not (exact or exact_length)
    jobs = [functools.partial(_trace, plan if n is None else _checkpointing(plan, n), depth, micro, seq,
                              elide=elide)
            for micro, seq in points for depth, n in shapes]
    traces = run_all(jobs, cuda=plan.trace_device == "cuda")
    # A loop's skipped iterations might have differed: trace again with every loop keeping its
    # first four iterations where some kept three (`loops.LEAN_KEEP`), then with the top-level
    # loops alone elided where only nested ones were unsteady, else whole (a later pass: a
    # top-level loop that was unsteady once the nested ones ran whole).
    tried: dict[int, dict[str, bool]] = {}
    for _ in range(3):
        unsteady = [k for k, t in enumerate(traces) if not t.steady()]
        if not unsteady:
            break
        for k in unsteady:
            tried[k] = _retry(traces[k], tried.get(k, {}))
        again = run_all([functools.partial(jobs[k], **tried[k]) for k in unsteady],
                        cuda=plan.trace_device == "cuda")
        for k, trace in zip(unsteady, again, strict=True):
            traces[k] = trace
    found = []
    for k, (micro, seq) in enumerate(points):
        mine = traces[k * len(shapes):(k + 1) * len(shapes)]
        elided = next((t.elision() for t in mine if t.elision()), "")
        if whole:
            cands, counts, method = _whole(plan, mine[0])
        elif even:
            cands, counts, method = _even_kinds(plan, *mine, micro, seq, unit)
        elif kinds:
            cands, counts, method = _two_kinds(plan, *mine, micro, seq, unit)
        else:
            cands, counts, method = _extrapolated(plan, mine[0], mine[1], micro, seq)
        found.append((cands, counts, method + (f"; {elided}" if elided else "")))
    return found


def _extrapolated(plan: TraceSetup, a: Trace, b: Trace, micro_batch: int, seq_len: int
                  ) -> tuple[Candidates, Counts, str]:
    """The full-depth step from traces at the two depths of the model's layer pattern (2 and 3 where
    its layers are alike: ``a`` and ``b``)."""
    pattern = plan.pattern
    counts = _counts_along(a, b, pattern.repeats - 1)
    found = extrapolate_depth(a, b, plan.depth, pattern)
    if found is not None:
        how = f" ({pattern.describe()})" if not pattern.uniform else ""
        two, three = pattern.traced
        return found, counts, f"traced {two} and {three} of {plan.depth} layers{how}, extrapolated"
    plan.notes.append("layers differ in structure, so every layer was traced")
    return _whole(plan, _trace(plan, plan.depth, micro_batch, seq_len))


def _counts_along(a: Trace, b: Trace, steps: int) -> Counts:
    """Parameters, trainable parameters and work ``steps`` times as far past trace ``a`` as trace
    ``b`` is (one more layer, or one more of each kind)."""
    work = None if a.work is None or b.work is None else a.work + (b.work + a.work.scaled(-1)).scaled(steps)
    return Counts(a.parameters + steps * (b.parameters - a.parameters),
                  a.trainable + steps * (b.trainable - a.trainable), b.patches, work)


def checkpointed_unit(pattern: Pattern, count: int) -> int:
    """How many layers :data:`KINDS_TRACED` and :data:`KINDS_EVEN` count as one where the first
    ``count`` of ``pattern``'s layers are checkpointed: 1 for alike layers; for layers that repeat in
    groups, a group (``period`` layers: Gemma-2's sliding and global pair), where the groups fall in
    step with both kinds: the first layers of their own fit in the first group, and ``count`` is
    whole groups. Then every group after the first is alike within its kind, and the two-kind
    extrapolation holds with groups for layers (:func:`_grouped`); a depth that is not whole groups
    ends with a group cut short after the plain ones (Gemma-3-27B: 62 layers in groups of 6), which
    the traces end with too and which gets a line of its own. 0: out of step."""
    if pattern.uniform:
        return 1
    period = pattern.period
    if pattern.first <= period and count % period == 0:
        return period
    return 0


def _grouped(trace: Trace, unit: int) -> Trace:
    """``trace`` with each group of ``unit`` layers as one layer (its ops in the group's order)."""
    if unit == 1:
        return trace
    return dataclasses.replace(trace, layer=np.where(trace.layer >= 0, trace.layer // unit, trace.layer))


def _two_kinds(plan: TraceSetup, base: Trace, more_checkpointed: Trace, more_plain: Trace,
               micro_batch: int, seq_len: int, unit: int = 1) -> tuple[Candidates, Counts, str]:
    """The full-depth step of a recipe that checkpoints its first n layers, from traces of
    (checkpointed, plain) = (2, 2), (3, 2) and (2, 3) layers (:data:`KINDS_TRACED`), or groups of
    ``unit`` layers (:func:`checkpointed_unit`)."""
    checkpointed = int(plan.cfg.memory.checkpointing) // unit
    tail = plan.depth % unit  # a last group cut short (checkpointed_unit)
    plain = plan.depth // unit - checkpointed
    dc, dp = checkpointed - 2, plain - 2
    base, more_checkpointed, more_plain = (_grouped(t, unit) for t in (base, more_checkpointed, more_plain))

    def plane(at: Any, more_c: Any, more_p: Any) -> Any:  # affine in both counts, as the bytes are
        return at + dc * (more_c - at) + dp * (more_p - at)

    work = None
    if base.work is not None and more_checkpointed.work is not None and more_plain.work is not None:
        less = base.work.scaled(-1)
        work = base.work + (more_checkpointed.work + less).scaled(dc) + (more_plain.work + less).scaled(dp)
    counts = Counts(plane(base.parameters, more_checkpointed.parameters, more_plain.parameters),
                    plane(base.trainable, more_checkpointed.trainable, more_plain.trainable),
                    more_checkpointed.patches, work)
    found = extrapolate_checkpointed(base, more_checkpointed, more_plain, checkpointed, plain, tail > 0)
    if found is not None:
        u, t = unit, tail
        return found, counts, (f"traced {2 * u}+{2 * u + t}, {3 * u}+{2 * u + t} and {2 * u}+{3 * u + t} of "
                               f"{checkpointed * u}+{plain * u + t} layers (checkpointed+plain"
                               f"{_in_groups(plan, unit)}), extrapolated")
    plan.notes.append("layers differ in structure, so every layer was traced")
    return _whole(plan, _trace(plan, plan.depth, micro_batch, seq_len))


def _even_kinds(plan: TraceSetup, base: Trace, more: Trace, micro_batch: int, seq_len: int, unit: int = 1
                ) -> tuple[Candidates, Counts, str]:
    """The full-depth step of a recipe that checkpoints the first half of its layers, from traces of
    (checkpointed, plain) = (2, 2) and (3, 3) layers (:data:`KINDS_EVEN`), or groups of ``unit``
    layers (:func:`checkpointed_unit`)."""
    half = int(plan.cfg.memory.checkpointing) // unit
    counts = _counts_along(base, more, half - 2)
    found = extrapolate_checkpointed_evenly(_grouped(base, unit), _grouped(more, unit), half)
    if found is not None:
        u = unit
        return found, counts, (f"traced {2 * u}+{2 * u} and {3 * u}+{3 * u} of {half * u}+{half * u} "
                               f"layers (checkpointed+plain{_in_groups(plan, unit)}), extrapolated")
    plan.notes.append("layers differ in structure, so every layer was traced")
    return _whole(plan, _trace(plan, plan.depth, micro_batch, seq_len))


def _in_groups(plan: TraceSetup, unit: int) -> str:
    return f", in groups of {unit}: {plan.pattern.describe()}" if unit > 1 else ""


def _checkpointing(plan: TraceSetup, layers: int) -> TraceSetup:
    """``plan`` with its first ``layers`` layers checkpointed (for a shallower trace)."""
    memory = plan.cfg.memory.model_copy(update={"checkpointing": layers})
    return dataclasses.replace(plan, cfg=plan.cfg.model_copy(update={"memory": memory}))


def _whole(plan: TraceSetup, full: Trace) -> tuple[Candidates, Counts, str]:
    """The step from a trace of every layer."""
    return (direct(full), Counts(full.parameters, full.trainable, full.patches, full.work),
            f"traced all {plan.depth} layers")


def _retry(trace: Trace, tried: dict[str, bool]) -> dict[str, bool]:
    """How to trace again after ``trace`` (traced as ``tried`` says) was not steady."""
    if tried.get("lean", True) and trace.lean():
        return {**tried, "lean": False}
    if tried.get("nested", True) and _nested_only(trace):
        return {**tried, "nested": False}
    return {**tried, "elide": False}


def _nested_only(trace: Trace) -> bool:
    """Whether the loops of ``trace`` that were not steady are all nested ones."""
    info = trace.loop_info or {}
    return all(s in info and info[s].nested for s in trace.unsteady())


def _trace(plan: TraceSetup, depth: int, micro_batch: int, seq_len: int, elide: bool = False,
           nested: bool = True, lean: bool = True) -> Trace:
    """One trace; ``elide``: long loops over the tokens run only some iterations (``nested``: those
    inside another loop's iteration too; ``lean``: one fewer where a loop allows it)."""
    if plan.cfg.training.objective == "grpo":  # TRL's own GRPO step (memtrain.estimator.grpo_step)
        found = grpo_step.recipe_trace(plan, depth, micro_batch, seq_len)
        if found is not None:
            return found
    # torch optimizers take their multi-tensor kernels for real CUDA tensors, never for fake ones.
    foreach = plan.device == "cuda"
    rows = micro_batch * (2 if plan.cfg.training.objective == "dpo" else 1)  # DPO: [chosen; rejected]
    return trace_step(plan.cfg, with_depth(plan.config, depth), micro_batch, seq_len,
                      device=plan.trace_device, foreach=foreach, padded=plan.rows.padded(rows), elide=elide,
                      cuda_kernels=plan.device == "cuda", nested=nested, lean=lean)


# --------------------------------------------------------------------------------- reporting


def summarize(plan: TraceSetup, cands: Candidates, counts: Counts, method: str,
               seconds: float) -> Estimate:
    values = np.rint(cands.values).astype(np.int64)
    totals = values[:, :HOST].sum(axis=1)
    top = int(np.argmax(totals))
    by_phase, at_phase = {}, {}
    phases = np.array(cands.phases)
    for phase in PHASES:
        rows = np.flatnonzero(phases == phase)
        if rows.size:
            k = rows[int(np.argmax(totals[rows]))]
            by_phase[phase] = int(totals[k])
            at_phase[phase] = _categories(values[k])
    peak = int(totals[top])
    overheads, sources = _overheads(plan, peak, int(values[:, ROUNDED].max()),
                                    _resident(_categories(values[top])))
    host = values[:, HOST] + values[:, PINNED]  # on CUDA, the pinned tensors at their blocks' size
    shared = int((totals + host).max()) - peak
    if plan.device == "cpu" and shared > 0:  # offloading to the RAM the "device" is: one budget
        overheads["host_offload"] = shared
        sources["host_offload"] = "offloaded tensors: on a CPU the host is the same RAM"
    cfg = plan.cfg
    settings = {
        "task": cfg.model.task, "dtype": cfg.model.dtype, "quantization": cfg.model.quantization,
        "double_quant": cfg.model.double_quant, "adapter": cfg.adapter.method,
        "lora_r": cfg.adapter.r if cfg.adapter.method == "lora" else None,
        "optimizer": cfg.training.optimizer, "micro_batch_size": plan.micro_batch,
        "gradient_accumulation": resolve_batch(cfg.training, cfg.distributed.processes).accumulation,
        "seq_len": plan.seq_len, "checkpointing": cfg.memory.checkpointing,
        "layers": plan.depth, "patches": counts.patches, "processes": cfg.distributed.processes,
        "sharding": cfg.distributed.sharding if cfg.distributed.processes > 1 else "none",
    }
    return Estimate(
        model=plan.label, device=plan.device, settings=settings, parameters=counts.parameters,
        trainable=counts.trainable, peak_bytes=peak, by_category=_categories(values[top]), by_phase=by_phase,
        category_at_phase_peak=at_phase, host_peak_bytes=int(host.max()), host_resident_bytes=int(host.min()),
        host_moved_bytes=int(values[:, HOST].max() - values[:, HOST].min()),
        overheads=overheads, overhead_sources=sources, total_bytes=peak + sum(overheads.values()),
        method=method, notes=list(plan.notes), seconds=round(seconds, 3), work=counts.work,
    )


# what a step holds from its start to its end: the weights, buffers and optimizer state
HELD = tuple(CATEGORY_NAMES.index(name) for name in ("parameters", "buffers", "optimizer_state"))


def held_bytes(cands: Candidates) -> int:
    """Device bytes a step holds from start to end (its weights, buffers and optimizer state), as
    ``cands`` (the ops of a trace that can hold its peak) show them: their least over those ops
    that hold anything on the device (a host-only row, as a derived embedding offload's lookup,
    says nothing of it)."""
    rows = cands.values[cands.values[:, :HOST].sum(axis=1) > 0]
    return int(np.rint(rows[:, HELD].sum(axis=1).min())) if len(rows) else 0


def _categories(row: np.ndarray) -> dict[str, int]:
    return {name: int(v) for name, v in zip(CATEGORY_NAMES, row[:HOST], strict=True)}


# Tensors that live from one step to the next: allocated once (weights at load, optimizer state
# at the first step), never freed, so never split and reused by the caching allocator.
RESIDENT = ("parameters", "buffers", "optimizer_state")


def _resident(categories: dict[str, int]) -> int:
    return sum(categories.get(name, 0) for name in RESIDENT)


def _overheads(plan: TraceSetup, peak: int, rounded_peak: int, resident: int
               ) -> tuple[dict[str, int], dict[str, str]]:
    """Named lines for what a CUDA device holds beyond live tensors (none on CPU).

    Fragmentation is a fraction of the bytes the step allocates and frees (the peak minus the
    resident tensors): the caching allocator fragments by splitting cached blocks for later,
    differently sized requests (PyTorch's "CUDA memory management" notes); a weight allocated at
    load and never freed leaves no block to split. ``memtrain calibrate`` measures the fraction
    against the same base (:func:`memtrain.estimator.calibrate.measure_gpu_overheads`).
    """
    if plan.device != "cuda":
        return {}, {}
    profile = calibrate.overheads()
    rounding = max(0, rounded_peak - peak)
    transient = max(0, peak - resident)
    fragmentation = int(profile.fragmentation * (transient + rounding))
    return (
        {"cuda_context": profile.cuda_context_bytes, "cuda_workspaces": profile.workspace_bytes,
         "allocator_rounding": rounding, "fragmentation": fragmentation},
        {"cuda_context": profile.cuda_context_source, "cuda_workspaces": profile.workspace_source,
         "allocator_rounding": "each allocation rounded up to 512 bytes, from the traced allocations",
         "fragmentation": f"{profile.fragmentation:.0%} of the {transient / 2**30:.2f} GiB the step "
                          "allocates and frees (peak minus parameters, buffers, optimizer state): "
                          f"{profile.fragmentation_source}"},
    )


# -------------------------------------------------------------------------------- sweep axes


def _doubling(low: int, high: int) -> list[int]:
    out, value = [], low
    while value <= high:
        out.append(value)
        value *= 2
    return out


def _seq_points(plan: TraceSetup) -> list[int]:
    limit = getattr(plan.config, "n_positions", None) or getattr(plan.config, "max_position_embeddings", None)
    points = [plan.seq_len * 2**k // 8 for k in range(6)]  # 1/8 ... 4 x max_length
    points = [p for p in points if p >= 16 and (limit is None or p <= limit)]
    return points or [plan.seq_len]
