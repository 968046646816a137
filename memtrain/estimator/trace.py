"""Trace a training step on fake tensors and extrapolate it in depth and micro-batch size.

:func:`trace_step` builds the recipe's model on fake tensors (:mod:`memtrain.trainer.build`), runs
a warm-up step (so optimizer state exists) and measures a second one with the memory meter
(with gradient accumulation, only its second micro-batch runs, on the gradients the first one
leaves: every later micro-batch holds the same memory, and the trace costs one forward+backward),
recording after every op the live bytes per category, the host bytes, the phase and the decoder
layer the op ran in.

Why extrapolation is exact. Decoder layers are identical, so an op inside layer ``i`` of an
``L``-layer model sees ``c + p·i + q·L`` bytes: state of all ``L`` layers (``q``), activations
saved by the layers before it or gradients of the layers after it (``p``), and its own work
(``c``). Layer 0 is special when its input needs no gradient (LoRA on a frozen embedding saves
less), so it gets its own line. Ops outside the layers (embedding, head, loss, optimizer) see
``c + q·L``. Tracing depths 2 and 3 pins every coefficient of every op: layer 0 from its two
occurrences, the regular layers from layer 1 at both depths and layer 2 at depth 3. The peak of
an ``L``-layer model is then the largest op value, where each regular-layer op is evaluated at
``i = 1`` and ``i = L - 1`` (a linear function of ``i`` peaks at an end). The same argument makes
every op linear in the micro-batch size. Ops that do not align across depths (per-parameter
loops in the optimizer and in gradient clipping, per-layer cache set-up before the first layer,
whose op count grows with depth) are each a fixed cost on top of state that grows linearly, so
their maximum is linear in ``L``. Where layers are of several kinds (Qwen3.5's linear and full
attention, DeepSeek-V3's dense then expert layers, Gemma's sliding and global attention), the same
argument holds for groups of layers that repeat: :mod:`memtrain.estimator.layers` finds the pattern
(the first layers of their own, then a group repeated), the two traces hold one and two groups, and
the regular "layer" above is a group. If the layer structure does not align, the caller traces the
full depth instead. ``tests/estimator/test_estimate.py`` and ``test_layer_patterns.py`` check
extrapolated == full trace.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from memtrain import patches
from memtrain.config import RunConfig
from memtrain.distributed import sharding
from memtrain.errors import recipe_stage
from memtrain.estimator.fake import build_fake_model, fake_tensor_mode, quiet_libraries
from memtrain.estimator.layers import Pattern, decoder_layers
from memtrain.estimator.trace_events import CATEGORY_NAMES, Pass, TracingMeter
from memtrain.memory import loops
from memtrain.model import count_parameters
from memtrain.trainer.build import build_optimizer, example_batch, step_loss, step_settings
from memtrain.trainer.step import hold_gradients, training_step

# extra value columns: host bytes (tensors at their size), the device's 512-byte rounding, and what
# CUDA's pinned-memory allocator adds to the host's pinned tensors (each a power of two:
# memtrain.memory.trackers.pinned_bytes)
HOST, ROUNDED, PINNED = len(CATEGORY_NAMES), len(CATEGORY_NAMES) + 1, len(CATEGORY_NAMES) + 2


@dataclass
class Trace:
    """One traced step: per op, its phase occurrence, layer (-1: none) and byte values."""

    phases: list[str]  # phase name of each occurrence (forward, backward, forward, ..., optimizer)
    occurrence: np.ndarray  # (ops,)
    layer: np.ndarray  # (ops,)
    values: np.ndarray  # (ops, categories + host + rounded + pinned)
    parameters: int
    trainable: int
    patches: list[str]  # what the applied patches did
    work: Work | None = None  # what the step computes, for the planner's cost model
    marks: np.ndarray | None = None  # (ops, 4): loop instance and iteration of each op, at the top
    # level and nested in it (-1: none)
    loop_info: dict[int, loops.Loop] | None = None  # the loop instances (memtrain.memory.loops)
    elided: frozenset[int] = frozenset()  # loop instances that ran only some iterations
    scaled: frozenset[int] = frozenset()  # of those, whose stand-in's kept storages were multiplied
    irregular: frozenset[int] = frozenset()  # of those, whose stand-in could not be multiplied
    # the device's allocations and frees in order, when recorded (memtrain.estimator.cuda_allocator)
    allocations: list[tuple[int, object, int]] | None = None

    def steady(self) -> bool:
        """Every elided loop's skipped iterations would have recorded what its stand-in iteration
        (``keep - 2``) says they would (:mod:`memtrain.memory.loops`): see :meth:`unsteady`."""
        return not self.unsteady()

    def unsteady(self) -> set[int]:
        """The elided loops whose skipped iterations might have recorded something else than their
        stand-in iteration says. Its neighbours in the order the iterations ran (``before``,
        ``after``) show it. Either the stand-in recorded the same rows as ``after`` and no storage
        was multiplied: the skipped iterations, the same ops on the same shapes, record those rows
        too. Or each iteration leaves the same bytes ``D`` behind at every row, and the storages it
        keeps were counted once per iteration the stand-in stands for (``weight``;
        :meth:`_EventRecorder._multiply`): then ``after`` is ``before + (weight + 1) D`` on every
        row (it stands for the last skipped iteration), and each row of the stand-in is
        ``before + D`` or, once it freed multiplied storages, ``before + weight D``; each row is
        then a row the whole loop records, its peak among them. A nested loop's stand-in is never
        multiplied: only the first holds for it."""
        if not self.elided:
            return set()
        if self.marks is None or self.loop_info is None:
            return set(self.elided)
        return {serial for serial in self.elided if not self._steady_loop(serial)}

    def _steady_loop(self, serial: int) -> bool:
        assert self.marks is not None and self.loop_info is not None
        if serial in self.irregular:
            return False
        nested = self.loop_info[serial].nested
        column = 2 if nested else 0  # the nested loop's marks follow the top level's
        loop, index = self.marks[:, column], self.marks[:, column + 1]
        rows = np.flatnonzero(loop == serial)
        cuts = np.flatnonzero(np.diff(index[rows])) + 1
        split = np.split(rows, cuts)
        groups, order = [self.values[g] for g in split], [int(index[g[0]]) for g in split]
        keep = self.loop_info[serial].keep
        if keep - 2 not in order:
            return False
        k = order.index(keep - 2)
        if k + 1 >= len(order):
            return False
        stand_in, after = groups[k], groups[k + 1]
        if serial not in self.scaled and np.array_equal(stand_in, after):
            return True
        if nested or k == 0 or not stand_in.shape == after.shape == groups[k - 1].shape:
            return False
        weight = self.loop_info[serial].count - keep
        span, gap = after - groups[k - 1], stand_in - groups[k - 1]
        if not (span == span[0]).all() or (span[0] % (weight + 1)).any():
            return False
        each = span[0] // (weight + 1)
        return bool(((gap == each).all(axis=1) | (gap == weight * each).all(axis=1)).all())

    def lean(self) -> bool:
        """Whether an elided loop kept fewer than :data:`memtrain.memory.loops.KEEP` iterations."""
        return self.loop_info is not None and any(self.loop_info[s].keep < loops.KEEP for s in self.elided)

    def elision(self) -> str:
        """How much of the loops the trace ran ('' when it ran them whole)."""
        if not self.elided or self.loop_info is None:
            return ""
        longest = max(self.elided, key=lambda s: self.loop_info[s].count)
        loop = self.loop_info[longest]
        return f"loops of up to {loop.count:,} iterations traced by {loop.keep + 1}"


@dataclass(frozen=True)
class Work:
    """What one traced step computes: the planner's cost model turns it into seconds.

    Forward and backward figures cover ``micro_batches`` micro-batches (recompute included);
    optimizer figures cover one optimizer step (with gradient clipping).
    """

    micro_batches: int
    flops: float  # matmul / attention FLOPs of forward + backward (torch's FlopCounterMode rules)
    ops: int  # ops dispatched in forward + backward (each costs a launch on a GPU)
    written: int  # bytes of the tensors forward + backward allocate (memory traffic)
    optimizer_ops: int
    # Of forward + backward, what checkpointing every decoder layer runs again at least (the
    # planner's lower bound for a candidate it has not traced): each layer's forward up to its last
    # FLOP op (a matmul or attention, which saves its inputs for backward: a checkpoint's recompute
    # stops once the last saved tensor is back, torch's early stop, so the ops after it may not run
    # again), and of those, the ops a selective checkpoint does not keep (``recomputed_selective``).
    recomputed: Pass = field(default_factory=Pass)
    recomputed_selective: Pass = field(default_factory=Pass)

    @property
    def layer_forward_flops(self) -> float:
        """The FLOPs of the forward inside the decoder layers (all recomputed by checkpointing)."""
        return self.recomputed.flops

    def __add__(self, other: Work) -> Work:
        return Work(self.micro_batches, self.flops + other.flops, self.ops + other.ops,
                    self.written + other.written, self.optimizer_ops + other.optimizer_ops,
                    self.recomputed + other.recomputed,
                    self.recomputed_selective + other.recomputed_selective)

    def scaled(self, factor: float) -> Work:
        """Every figure times ``factor`` (a linear extrapolation step)."""
        return Work(self.micro_batches, self.flops * factor, round(self.ops * factor),
                    round(self.written * factor), round(self.optimizer_ops * factor),
                    self.recomputed.scaled(factor), self.recomputed_selective.scaled(factor))


@dataclass
class Candidates:
    """Byte values of the ops that can hold the peak, each with its phase."""

    phases: list[str]
    values: np.ndarray  # float64 (candidates, categories + host + rounded)


def with_depth(config: PretrainedConfig, depth: int) -> PretrainedConfig:
    """A copy of ``config`` with ``depth`` decoder layers (per-layer lists cut to match)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth  # attribute maps cover n_layer (GPT-2) and friends
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) != depth:
        with contextlib.suppress(AttributeError):  # a property of the depth (Falcon-H1): it follows
            config.layer_types = types[:depth]
    return config


def trace_step(cfg: RunConfig, config: PretrainedConfig, batch_size: int, seq_len: int,
               device: torch.device | str = "cpu", foreach: bool = False, padded: bool = True,
               elide: bool = False, cuda_kernels: bool = False, allocations: bool = False,
               nested: bool = True, lean: bool = True) -> Trace:
    """Trace one steady-state training step of the recipe on fake tensors, as one of its processes.

    With ``distributed.sharding`` ``full`` or ``grad_op`` the model is sharded by the same
    :func:`memtrain.distributed.fsdp.shard_model` as training, in a fake process group where this
    process is rank 0 of ``distributed.processes`` (collectives do nothing); with ``none`` and
    several processes the step holds DDP's gradient buckets (:func:`_ddp_buckets`).

    Args:
        cfg: the recipe (no `auto` fields).
        config: the architecture, possibly with fewer layers (:func:`with_depth`).
        batch_size: micro-batch size.
        seq_len: tokens per example.
        device: the device the fake tensors claim to be on.
        foreach: make torch optimizers use their multi-tensor (foreach) kernels, as they do for
            real CUDA tensors (fake tensors never get them by default).
        padded: the batch carries padding (masked attention); False: every row is ``seq_len``
            tokens (:func:`memtrain.trainer.build.example_batch`).
        elide: long loops over the tokens run only some of their iterations
            (:mod:`memtrain.memory.loops`); the caller checks :meth:`Trace.steady`.
        nested: with ``elide``, loops nested in another loop's iteration (LoRA's row chunks in a
            tiled MLP tile) too.
        lean: with ``elide``, loops steady from their second iteration run one fewer
            (:data:`memtrain.memory.loops.LEAN_KEEP`); never under a selective checkpoint, which
            keeps each LoRA chunk's matmul output (its first chunks settle later).
        cuda_kernels: the step is for CUDA: count what its kernels allocate inside a call
            (:func:`memtrain.estimator.trace_events.flash_backward_scratch`), which no fake tensor does.
        allocations: record the device's allocations and frees in order (:attr:`Trace.allocations`).
    """
    settings = step_settings(cfg)
    accumulation = min(settings["accumulation"], 2)  # a third micro-batch looks like the second
    # TRL's DPO loss reads metric values into Python (.item(), `if count > 0`); they answer 1.
    fake = fake_tensor_mode(packed=cfg.data.packing, padded=padded, scalars=cfg.training.objective == "dpo")
    with _process_group(cfg, device) as mesh, fake, _default_device(device), quiet_libraries():
        model = build_fake_model(cfg, config)
        total, trainable = count_parameters(model)  # before sharding: 4-bit weights lose their marks
        if mesh is not None:
            from memtrain.distributed.fsdp import shard_model

            model = shard_model(model, cfg, mesh)
        optimizer = build_optimizer(cfg, model)
        if foreach:
            for group in optimizer.param_groups:
                if "foreach" in group and not group.get("fused"):
                    group["foreach"] = True
        batch = example_batch(cfg, config, batch_size, seq_len, device, padded=padded)
        loss_fn = step_loss(cfg, model)
        step = (model, batch, optimizer, accumulation, settings["max_grad_norm"])
        create_optimizer_state(model, optimizer)
        # With accumulation, the first micro-batch's gradients are put in place before the meter
        # starts and only the second runs; under FSDP2 the first leaves full gradients inside
        # FSDP (no gradient sync), so both micro-batches run.
        held = accumulation > 1 and mesh is None
        if held:
            hold_gradients(model)
        layers = decoder_layers(model)
        meter = TracingMeter(model, optimizer, batch, layers, _ddp_buckets(cfg, model), cuda_kernels)
        if allocations:
            meter.tracker.allocations = []
        with recipe_stage("model", "a training step on fake tensors"), meter, loops.recording(
                elide, nested, lean and cfg.memory.checkpointing != "selective"):
            training_step(*step, held_gradients=held, loss_fn=loss_fn)
            marked, elided = loops.loops(), loops.elided()
        done = [r.detail or r.name for r in patches.records(model)]
    tracker = meter.tracker
    work = Work(1, float(tracker.flops), tracker.ops["step"], tracker.written,
                tracker.ops["optimizer"], *tracker.recomputed())
    rows = np.array(tracker.rows, dtype=np.int64)
    marks = np.array(tracker.marks, dtype=np.int64).reshape(-1, 4)
    return Trace(tracker.phases, rows[:, 0], rows[:, 1], rows[:, 2:], total, trainable, done, work,
                 marks, marked, frozenset(elided), frozenset(tracker.scaled), frozenset(tracker.irregular),
                 tracker.allocations)


@contextlib.contextmanager
def _process_group(cfg: RunConfig, device: torch.device | str) -> Iterator[Any]:
    """A fake process group and its mesh when the recipe shards the model, else None."""
    if not sharding.sharded(cfg):
        yield None
        return
    from memtrain.distributed.fsdp import fake_process_group

    with fake_process_group(cfg.distributed.processes, torch.device(device).type) as mesh:
        yield mesh


def _ddp_buckets(cfg: RunConfig, model: nn.Module) -> list[torch.Tensor]:
    """DDP's gradient buckets, for replicas (``sharding: none``) in several processes.

    ``DistributedDataParallel`` copies every gradient into flat buckets (one per 25 MiB, per dtype)
    that it all-reduces; with ``gradient_as_bucket_view=False`` (accelerate's default, which the
    Trainer keeps) they are a second copy of the trained gradients, allocated when the model is
    wrapped and held for the whole run. Measured: one 2-process run holds exactly the trained
    gradients' bytes more than one process (docs/bench/fsdp.md).
    """
    if not sharding.ddp_replicas(cfg):
        return []
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.requires_grad:
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    device = next(model.parameters()).device
    return [torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()]


def create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What the warm-up step leaves behind, without its forward and backward: optimizer state.

    An optimizer step on zero gradients creates exactly the state a real first step creates
    (its shapes and dtypes depend on the parameters, not on gradient values). torch's optimizers
    take this step with their multi-tensor (foreach) kernels whatever the traced step uses: their
    state is made the same way on either path (``_init_group``, before the update), and a trace
    costs per op: a dozen ops for all the parameters instead of a dozen for each (LoRA's, hundreds).
    """
    model.train()
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    single = [(group, group["foreach"]) for group in optimizer.param_groups
              if "foreach" in group and not group["foreach"] and not group.get("fused")]
    for group, _ in single:
        group["foreach"] = True
    try:
        optimizer.step()
    finally:
        for group, value in single:
            group["foreach"] = value
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------ extrapolation


def direct(trace: Trace) -> Candidates:
    """Every op of a full-depth trace is a candidate."""
    return Candidates([trace.phases[o] for o in trace.occurrence], trace.values.astype(np.float64))


def _split(trace: Trace, occ: int) -> tuple[np.ndarray, dict[int, np.ndarray], np.ndarray] | None:
    """(ops before the layers, ops per layer, ops after) of one phase occurrence; None if tangled."""
    mask = trace.occurrence == occ
    values, layer = trace.values[mask], trace.layer[mask]
    inside = np.flatnonzero(layer >= 0)
    if inside.size == 0:
        return values, {}, values[:0]
    first, last = inside[0], inside[-1]
    blocks: dict[int, list[int]] = {}
    current = -1
    waiting: list[int] = []
    # Ops between two layers belong to the layer after them: FSDP2 gathers a layer's weights in a
    # hook that runs before the module tracker enters the layer (unsharded steps have none).
    for k in range(first, last + 1):
        if layer[k] < 0:
            waiting.append(k)
            continue
        if layer[k] != current:
            current = int(layer[k])
            if current in blocks:
                return None  # a layer ran twice in one phase: no simple structure
            blocks[current] = []
        blocks[current] += [*waiting, k]
        waiting = []
    return values[:first], {i: values[idx] for i, idx in blocks.items()}, values[last + 1:]


def extrapolate_depth(a: Trace, b: Trace, depth: int, pattern: Pattern | None = None) -> Candidates | None:
    """Candidates of a ``depth``-layer step from traces at the two depths of ``pattern``
    (:attr:`memtrain.estimator.layers.Pattern.traced`; default: alike layers, traced at depths 2 and 3).

    Returns None when the two traces do not align layer by layer (then trace the full depth).
    """
    pattern = pattern or Pattern(depth)
    steps = pattern.repeats - 1  # extrapolation distance from trace `a`, in groups of layers
    at_a, at_b = pattern.traced

    def phase(pre: tuple, blocks: tuple, post: tuple) -> np.ndarray | None:
        (pre_a, pre_b), (blocks_a, blocks_b), (post_a, post_b) = pre, blocks, post
        if not blocks_a and not blocks_b:
            return _outside_layers(pre_a, pre_b, steps)
        if sorted(blocks_a) == list(range(at_a)) and sorted(blocks_b) == list(range(at_b)):
            return _with_layers(pre_a, pre_b, post_a, post_b, blocks_a, blocks_b, pattern)
        return None

    return _per_phase((a, b), phase)


def _per_phase(traces: tuple[Trace, ...], build: Callable[[tuple, tuple, tuple], np.ndarray | None]
               ) -> Candidates | None:
    """Candidates from short traces, phase occurrence by phase occurrence: ``build`` gets each
    trace's (ops before the layers, ops per layer, ops after) (:func:`_split`) and returns the
    extrapolated rows, or None when the traces do not align (as when their phases differ)."""
    if any(t.phases != traces[0].phases for t in traces):
        return None
    phases: list[str] = []
    rows: list[np.ndarray] = []
    for occ, phase in enumerate(traces[0].phases):
        split = [_split(t, occ) for t in traces]
        if any(s is None for s in split):
            return None
        new = build(*zip(*split, strict=True))  # type: ignore[arg-type]
        if new is None:
            return None
        phases += [phase] * len(new)
        rows.append(new)
    return Candidates(phases, np.concatenate(rows).astype(np.float64))


def _line(va: np.ndarray, vb: np.ndarray, steps: int) -> np.ndarray:
    return va + steps * (vb - va)


def _outside_layers(va: np.ndarray, vb: np.ndarray, steps: int) -> np.ndarray:
    if len(va) == len(vb):
        return _line(va, vb, steps)
    if len(va) == 0 or len(vb) == 0:
        return va[:0] if len(va) == 0 else va  # cannot pair: keep what was seen (never the peak)
    # Op counts differ (a per-parameter loop, a per-layer cache entry): extrapolate the largest op.
    top_a = va[np.argmax(va[:, :HOST].sum(axis=1))]
    top_b = vb[np.argmax(vb[:, :HOST].sum(axis=1))]
    return _line(top_a, top_b, steps)[None, :]


def _with_layers(pre_a: np.ndarray, pre_b: np.ndarray, post_a: np.ndarray, post_b: np.ndarray,
                 blocks_a: dict[int, np.ndarray], blocks_b: dict[int, np.ndarray],
                 pattern: Pattern) -> np.ndarray | None:
    """The step's ops of a pattern of layers: the first layers, then groups of ``period`` alike
    layers, the last cut short (the ``tail``). Trace ``a`` holds one group, ``b`` two.

    An op of a group sees what the layers before it saved and the gradients of those after it, a
    fixed number of bytes per group, so its value is affine in the number of groups and in its
    group's index: at group 0 it is on the line through ``a`` and ``b``, each later group adds the
    slope from group 0 to group 1 of ``b``, and a group between the first and the last is never
    above both. The first layers (they follow the embedding) and the tail get their own lines."""
    first, period, tail = pattern.first, pattern.period, pattern.tail
    steps = pattern.repeats - 1

    def group(blocks: dict[int, np.ndarray], start: int, count: int) -> np.ndarray:
        return np.concatenate([blocks[i] for i in range(start, start + count)] or [pre_a[:0]])

    one_a, one_b, two_b = group(blocks_a, first, period), group(blocks_b, first, period), \
        group(blocks_b, first + period, period)
    head = group(blocks_a, 0, first), group(blocks_b, 0, first)
    ends = group(blocks_a, first + period, tail), group(blocks_b, first + 2 * period, tail)
    if (len({len(one_a), len(one_b), len(two_b)}) != 1 or len(head[0]) != len(head[1])
            or len(ends[0]) != len(ends[1])):
        return None
    at_one = _line(one_a, one_b, steps)  # group 0 of the full depth
    at_last = at_one + (pattern.repeats - 1) * (two_b - one_b)  # its last group
    parts = [_outside_layers(pre_a, pre_b, steps), _line(*head, steps), at_one, at_last, _line(*ends, steps),
             _outside_layers(post_a, post_b, steps)]
    return np.concatenate(parts)


def extrapolate_checkpointed(base: Trace, more_checkpointed: Trace, more_plain: Trace, checkpointed: int,
                             plain: int, tail: bool = False) -> Candidates | None:
    """Candidates of a step whose first ``checkpointed`` layers are checkpointed and the next ``plain``
    are not (``memory.checkpointing: n``), from traces of (checkpointed, plain) = (2, 2) (``base``),
    (3, 2) and (2, 3) layers.

    The argument of :func:`extrapolate_depth` with two kinds of layer: an op inside a layer sees the
    state of ``c`` checkpointed and ``p`` plain layers, what the layers before it saved and the
    gradients of those after it, each a fixed number of bytes per layer of a kind, so its value is
    affine in ``(c, p)`` and, within a kind, in its index there. The three traces pin every
    coefficient: ``v(c, p) = v(2, 2) + (c - 2)·(v(3, 2) - v(2, 2)) + (p - 2)·(v(2, 3) - v(2, 2))``
    for the ops outside the layers and for the first and second layer of each kind (the first of a
    kind gets its own line, as layer 0 does in depth: it follows an embedding or a layer of the other
    kind); the last layer of a kind is its second plus the per-index slope (layers 2 - 1 of the (3, 2)
    trace, 4 - 3 of the (2, 3) one). With ``tail``, each trace ends with one more block, a group cut
    short after the plain layers (layers in groups: :func:`memtrain.estimator.estimate.checkpointed_unit`),
    which gets its own plane, as the first layers do. Returns None when the traces do not align
    (then trace the full depth).
    """
    steps = (checkpointed - 2, plain - 2)
    expected = [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    if tail:
        expected = [[*e, len(e)] for e in expected]

    def phase(pre: tuple, blocks: tuple, post: tuple) -> np.ndarray | None:
        if not any(blocks):
            return _outside_plane(pre, steps)
        if [sorted(b) for b in blocks] != expected:
            return None
        if not tail:
            return _with_two_kinds(pre, post, blocks, steps)
        ends = tuple(b[e[-1]] for b, e in zip(blocks, expected, strict=True))
        if len({len(v) for v in ends}) != 1:
            return None
        body = tuple({k: v for k, v in b.items() if k != e[-1]}
                     for b, e in zip(blocks, expected, strict=True))
        return _with_two_kinds(pre, post, body, steps, _plane(ends, steps))

    return _per_phase((base, more_checkpointed, more_plain), phase)


# Representative layers of the (2, 2), (3, 2) and (2, 3) traces: the first and second layer of each kind.
_FIRST_AND_SECOND = ((0, 0, 0), (1, 1, 1), (2, 3, 2), (3, 4, 3))


def _plane(values: tuple[np.ndarray, ...], steps: tuple[int, int]) -> np.ndarray:
    """Values at (2 + steps[0], 2 + steps[1]) layers from those at (2, 2), (3, 2) and (2, 3)."""
    at, more_checkpointed, more_plain = values
    return _line(at, more_checkpointed, steps[0]) + steps[1] * (more_plain - at)


def _outside_plane(values: tuple[np.ndarray, ...], steps: tuple[int, int]) -> np.ndarray:
    """:func:`_outside_layers` in two directions."""
    if len({len(v) for v in values}) == 1:
        return _plane(values, steps)
    if min(len(v) for v in values) == 0:
        return values[0]  # cannot pair: keep what was seen (never the peak)
    tops = tuple(v[np.argmax(v[:, :HOST].sum(axis=1))] for v in values)
    return _plane(tops, steps)[None, :]


def _with_two_kinds(pre: tuple[np.ndarray, ...], post: tuple[np.ndarray, ...],
                    blocks: tuple[dict[int, np.ndarray], ...], steps: tuple[int, int],
                    tail: np.ndarray | None = None) -> np.ndarray | None:
    _, more_checkpointed, more_plain = blocks
    slopes = ((more_checkpointed[1], more_checkpointed[2]), (more_plain[3], more_plain[4]))
    if any(len(a) != len(b) for a, b in slopes):
        return None
    first_and_second = []
    for layers in _FIRST_AND_SECOND:
        values = tuple(b[i] for b, i in zip(blocks, layers, strict=True))
        if len({len(v) for v in values}) != 1:
            return None
        first_and_second.append(_plane(values, steps))
    first_c, second_c, first_p, second_p = first_and_second
    last_c = second_c + steps[0] * (slopes[0][1] - slopes[0][0])  # layer c - 1
    last_p = second_p + steps[1] * (slopes[1][1] - slopes[1][0])  # layer c + p - 1
    parts = [_outside_plane(pre, steps), first_c, second_c, last_c, first_p, second_p, last_p,
             *([] if tail is None else [tail]), _outside_plane(post, steps)]
    return np.concatenate(parts)


def extrapolate_checkpointed_evenly(base: Trace, more: Trace, half: int) -> Candidates | None:
    """Candidates of a step whose first ``half`` layers are checkpointed and the next ``half`` not,
    from traces of (checkpointed, plain) = (2, 2) (``base``) and (3, 3) layers (``more``).

    :func:`extrapolate_checkpointed` along its plane's diagonal: with both counts equal, ``v(c, c) =
    v(2, 2) + (c - 2)·(v(3, 3) - v(2, 2))`` for the ops outside the layers and the first and second
    layer of each kind, and the last of each kind is its second plus its per-index slope (layers
    2 - 1 and 5 - 4 of the (3, 3) trace). Returns None when the traces do not align.
    """
    steps = half - 2

    def phase(pre: tuple, blocks: tuple, post: tuple) -> np.ndarray | None:
        (pre_a, pre_b), (post_a, post_b) = pre, post
        if not any(blocks):
            return _outside_layers(pre_a, pre_b, steps)
        if [sorted(b) for b in blocks] != [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]:
            return None
        at, more_layers = blocks
        slopes = ((more_layers[1], more_layers[2]), (more_layers[4], more_layers[5]))
        if any(len(a) != len(b) for a, b in slopes):
            return None
        first_and_second = []
        for i, j in ((0, 0), (1, 1), (2, 3), (3, 4)):  # first and second checkpointed, then plain
            if len(at[i]) != len(more_layers[j]):
                return None
            first_and_second.append(_line(at[i], more_layers[j], steps))
        first_c, second_c, first_p, second_p = first_and_second
        last_c = second_c + steps * (slopes[0][1] - slopes[0][0])
        last_p = second_p + steps * (slopes[1][1] - slopes[1][0])
        return np.concatenate([_outside_layers(pre_a, pre_b, steps), first_c, second_c, last_c,
                               first_p, second_p, last_p, _outside_layers(post_a, post_b, steps)])

    return _per_phase((base, more), phase)


def in_batch(c1: Candidates, c2: Candidates, b1: int, b2: int, batch: int) -> Candidates | None:
    """Candidates at micro-batch ``batch``, linear per op from those at ``b1`` and ``b2``."""
    if c1.phases != c2.phases:
        return None
    slope = (c2.values - c1.values) / (b2 - b1)
    return Candidates(c1.phases, c1.values + (batch - b1) * slope)


def _default_device(device: torch.device | str) -> Any:
    # A torch.device context intercepts every torch call; on CPU it changes nothing, so skip it.
    return contextlib.nullcontext() if torch.device(device).type == "cpu" else torch.device(device)
