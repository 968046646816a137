"""The estimator's meter: the memory meter's trackers, recording every op's bytes.

:func:`memtrain.estimator.trace.trace_step` measures its fake step with :class:`TracingMeter`, a
:class:`memtrain.memory.meter.MemoryMeter` whose tracker (torch's ``MemTracker``, or
``FSDPMemTracker`` for an FSDP2 model, as in the meter) records, after every op that changes
them, the raw bytes per category on the device and the host, the phase, and the decoder layer the
op ran in: the rows that :mod:`memtrain.estimator.trace` extrapolates. It also counts the step's work
(matmul FLOPs, ops, bytes written) for the planner's cost model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from memtrain._compat.torch_tools import (
    active_fake_mode,
    extra_flop_formulas,
    fake_device,
    flash_attention_backward_ops,
    overload_packet,
)
from memtrain._compat.torch_trackers import MemRefType, UpdateType
from memtrain.estimator.cuda_allocator import round_size
from memtrain.memory import loops, trackers
from memtrain.memory import meter as meter_mod
from memtrain.patches import Pass, checkpointing

CATEGORY_NAMES = trackers.CATEGORY_NAMES  # the meter's, so that estimates and measurements match


def _entered(tracker: _EventRecorder, layer: int, module: nn.Module, args: Any) -> None:
    tracker.layer_grad[layer] = torch.is_grad_enabled()


def _any_requires_grad(args: Any) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def cuda_runs_flash(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether CUDA runs its flash kernel where a trace on a machine without CUDA ran CPU's
    flash-attention backward (``args`` and ``kwargs`` of that op): where CUDA's flash kernel takes
    the call (fp16 or bf16, no explicit mask, head_dim a multiple of 8 up to 256); elsewhere CUDA
    runs the memory-efficient kernel, whose backward is not modelled here."""
    query = args[1]
    mask = kwargs.get("attn_mask", args[8] if len(args) > 8 else None)
    head_dim = query.shape[-1]
    return (query.dtype in (torch.float16, torch.bfloat16) and mask is None
            and head_dim % 8 == 0 and head_dim <= 256)


def flash_backward_scratch(query: torch.Tensor, key: torch.Tensor) -> list[int]:
    """Bytes CUDA's flash-attention backward (FlashAttention-2 as vendored in PyTorch,
    ``mha_bwd`` in ``aten/.../flash_attn/flash_api.cpp``) allocates for the length of the call,
    besides the gradients it returns; ``query`` ``[batch, heads, q_len, head_dim]`` and ``key``
    ``[batch, kv_heads, k_len, head_dim]`` as SDPA passes them. A fake tensor's kernel allocates
    only the outputs, so a trace never sees these:

    - ``softmax_d``: fp32, ``batch x heads x q_len`` rounded up to 128;
    - ``dq_accum``: fp32, ``batch x q_len (rounded to 128) x heads x head_dim`` (rounded to 32, or
      64 above 128);
    - with grouped-query attention (fewer key/value heads), ``dk_expanded`` and ``dv_expanded``: key
      and value gradients per query head, ``batch x k_len x heads x head_dim`` in the inputs' dtype,
      summed into the returned ``dk``/``dv`` before the call ends.

    At 131,840 tokens of a Llama-3.2-1B shape (32 heads, 8 key/value heads, head_dim 64) that is
    2.0 GiB, which a long-context plan without it does not have (the H200 run of 2026-11-27).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    q_rounded = -(-q_len // 128) * 128
    step = 32 if head_dim <= 128 else 64
    dim_rounded = -(-head_dim // step) * step
    parts = [batch * heads * q_rounded * 4, batch * q_rounded * heads * dim_rounded * 4]
    if kv_heads != heads:
        parts += [batch * k_len * heads * head_dim * query.element_size()] * 2
    return parts


@dataclass
class _StandIn:
    """An elided loop's stand-in iteration (:func:`memtrain.memory.loops.weight` > 1): while it
    runs, and once ended, while the iteration after it runs."""

    mark: tuple[int, int]  # (loop instance, iteration)
    times: int  # iterations it stands for
    start: dict[Any, list[int]]  # device -> bytes per category when it began
    freed: dict[Any, list[int]]  # device -> bytes per category of multiplied storages it freed, all copies
    survivors: dict[int, Any] = field(default_factory=dict)  # id(winfo) -> winfo allocated in it, alive
    after: tuple[int, int] | None = None  # once ended: the iteration after it
    added: dict[Any, list[int]] = field(default_factory=dict)  # once ended: what it added, net
    first_row: int = 0  # once ended: the first row recorded after it
    events: tuple[int, int] = (0, 0)  # its span of the recorded allocations (start, end once ended)


def _pin_extra(nbytes: int) -> int:
    """What CUDA's pinned-memory allocator adds to a pinned host tensor of ``nbytes``."""
    return trackers.pinned_bytes(nbytes) - nbytes


class _EventRecorder:
    """What the tracing meter adds to the meter's trackers: raw bytes per category after every op
    (one row per op that changes them), the phase and decoder layer of each row, and the step's
    work (FLOPs, ops, bytes written) for the cost model."""

    def _init_events(self, layers: list[nn.Module]) -> None:
        self._index = {ref: CATEGORY_NAMES.index(name) for ref, name in self.categories.items()}  # type: ignore[attr-defined]
        self._layers = layers
        self._fqns: list[str | None] = [None] * len(layers)
        self._raw = {d: [0] * len(CATEGORY_NAMES) for d in (self.compute_device, self.host_device)}  # type: ignore[attr-defined]
        self._rounded = 0
        self._pinned = 0  # what the pinned host tensors' blocks add to their bytes (PINNED)
        self.phases: list[str] = []
        self.rows: list[tuple[int, ...]] = []
        # per row: (loop instance, iteration) at the top level and nested in it (memory.loops)
        self.marks: list[tuple[int, int, int, int]] = []
        self.ops = {"step": 0, "optimizer": 0}
        self.written = 0
        self.flops = 0
        # what checkpointing recomputes at least (trace.Work.recomputed): committed at each FLOP op
        # that saves inputs for backward, pending since the last one in the same layer's forward
        self._recomputed = {"all": [0.0, 0, 0], "selective": [0.0, 0, 0]}
        self._since_save = {"all": [0.0, 0, 0], "selective": [0.0, 0, 0]}
        self._since_save_layer = -1
        self.layer_grad = [True] * len(layers)  # whether grad was on when each layer was entered
        self._extra_flops = extra_flop_formulas()
        # the estimate is for CUDA: kernels' own scratch memory counts (flash_backward_scratch)
        self.cuda_kernels = False
        # the device's allocations and frees in order, (1, key, bytes) / (0, key, 0), for the
        # caching allocator's replay (memtrain.estimator.cuda_allocator); None: not recorded
        self.allocations: list[tuple[int, object, int]] | None = None
        self._copies: dict[int, list[object]] = {}  # a multiplied storage's copies (_multiply)
        self._serial = 0  # the next recorded storage's key
        self._flash_backward = flash_attention_backward_ops()
        self._entry_fake_mode: Any = None
        # An elided loop's stand-in iteration (memtrain.memory.loops.weight() > 1): the storages it
        # allocates that outlive the iteration after it count once per iteration it stands for.
        self._stand_in: _StandIn | None = None  # running
        self._pending: _StandIn | None = None  # ended, the iteration after it running
        self.scaled: set[int] = set()  # loop instances whose stand-in's storages were multiplied
        self.irregular: set[int] = set()  # loop instances whose stand-in also freed or moved others

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Fake tensors answer `.device` through dispatch: thousands of ops that allocate nothing.
        if func is torch.ops.prim.device.default:
            device = fake_device(args[0])  # FakeTensor's own answer, without a second dispatch
            return device if device is not None else func(*args, **(kwargs or {}))
        phase = self.phase()  # type: ignore[attr-defined]
        written = self.written
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]
        if out is NotImplemented:  # a DTensor op (FSDP2): its local ops come back through here
            return out
        if active_fake_mode() is not self._entry_fake_mode:
            return out  # DTensor's layout propagation (memtrain.estimator.fake): not part of the step
        times = loops.weight()  # an elided loop's kept iteration counts for the skipped ones
        self.ops["optimizer" if phase == "optimizer" else "step"] += times
        packet = overload_packet(func)
        count = flop_registry.get(packet) or self._extra_flops.get(packet)
        flops = 0
        if count is not None and phase != "optimizer":  # what FlopCounterMode counts, without its mode
            flops = times * flop_count(count, args, kwargs or {}, out)
            self.flops += flops
        if phase == "forward":
            # a FLOP op (matmul, attention) with an input that requires grad saves tensors for
            # backward: itself where grad is on, or the custom autograd Function it runs in (4-bit
            # matmul, lean LoRA, tiled MLP: grad is off inside) when its forward returns
            saves = count is not None and _any_requires_grad(args)
            self._count_recomputed(packet, times, flops, self.written - written, saves)
        kernel = self._flash_backward.get(packet) if self.cuda_kernels else None
        if kernel == "cuda" or (kernel == "cpu" and cuda_runs_flash(args, kwargs or {})):
            self._scratch(flash_backward_scratch(args[1], args[2]))
        return out

    def _count_recomputed(self, packet: Any, times: int, flops: float, written: int, saves: bool) -> None:
        """Count a forward op toward what checkpointing its layer runs again: pending until the
        layer's next FLOP op with an input that requires grad (it saves tensors for backward, which
        a recompute must bring back), dropped if the layer's forward ends first. Ops of a layer
        entered without grad (a no-grad forward, such as GRPO's log-probabilities) are never
        recomputed."""
        layer = self._current_layer()
        if layer != self._since_save_layer:
            self._since_save = {"all": [0.0, 0, 0], "selective": [0.0, 0, 0]}
            self._since_save_layer = layer
        if layer < 0 or not self.layer_grad[layer]:  # a forward without grad keeps nothing
            return
        kinds = ("all",) if packet in checkpointing.SAVED_OPS else ("all", "selective")
        for kind in kinds:
            pending = self._since_save[kind]
            pending[0] += flops
            pending[1] += times
            pending[2] += written
        if saves:
            for kind, pending in self._since_save.items():
                self._recomputed[kind] = [a + b for a, b in zip(self._recomputed[kind], pending, strict=True)]
                self._since_save[kind] = [0.0, 0, 0]

    def recomputed(self) -> tuple[Pass, Pass]:
        """What checkpointing every layer recomputes at least, and of it a selective checkpoint
        (:attr:`memtrain.estimator.trace.Work.recomputed`)."""
        full, selective = (self._recomputed[k] for k in ("all", "selective"))
        return Pass(float(full[0]), int(full[1]), int(full[2])), Pass(float(selective[0]), int(selective[1]),
                                                                      int(selective[2]))

    def _scratch(self, parts: list[int]) -> None:
        """A kernel's own allocations, alive for its call: one row with them held as temporaries
        beside the op's outputs (already counted), then gone."""
        counts = self._raw[self.compute_device]  # type: ignore[attr-defined]
        slot, total, rounded = CATEGORY_NAMES.index("temporaries"), sum(parts), sum(map(round_size, parts))
        if self.allocations is not None:
            keys = [("scratch", len(self.allocations), i) for i in range(len(parts))]
            self.allocations.extend((1, key, n) for key, n in zip(keys, parts, strict=True))
            self.allocations.extend((0, key, 0) for key in keys)
        counts[slot] += total
        self._rounded += rounded
        self.on_peak_update(None)
        counts[slot] -= total
        self._rounded -= rounded
        self.on_peak_update(None)

    def on_snapshot_update(self, u_type: UpdateType, winfo: object, old_mem_consumed: int | None = None,
                           old_reftype: Any = None) -> None:
        self._account(u_type, winfo, old_reftype)
        super().on_snapshot_update(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]

    def _account(self, u_type: UpdateType, winfo: Any, old_reftype: Any) -> None:
        # MemTracker rounds CUDA sizes into its own totals; these are raw bytes, rounded kept apart.
        self._follow_loops()
        counts = self._raw.get(winfo.device)
        if counts is None:
            return
        raw = winfo.size * winfo.element_size
        old = getattr(winfo, "_memtrain_raw", raw)
        times = getattr(winfo, "_memtrain_times", 1)  # > 1: a stand-in iteration's storage
        if times > 1 and u_type != UpdateType.ADD and loops.current()[0] >= 0:
            self.scaled.add(loops.current()[0])  # its loop sees the multiplied bytes go
        slot = self._index[winfo.reftype]
        delta_rounded = 0
        if self.allocations is not None and winfo.device == self.compute_device:  # type: ignore[attr-defined]
            self._record(u_type, winfo, raw)
        if u_type == UpdateType.ADD:
            counts[slot] += raw
            delta_rounded = round_size(raw)
            if winfo.device == self.compute_device and self.phase() != "optimizer":  # type: ignore[attr-defined]
                self.written += raw * loops.weight()
            if self._stand_in is not None:
                self._stand_in.survivors[id(winfo)] = winfo
        elif u_type == UpdateType.DEL:
            counts[slot] -= old * times
            if self._stand_in is not None and times > 1:
                self._stand_in.freed[winfo.device][slot] += old * times
            delta_rounded = -round_size(old) * times
            for stand_in in (self._stand_in, self._pending):
                if stand_in is not None:
                    stand_in.survivors.pop(id(winfo), None)
        elif u_type == UpdateType.REF and old_reftype is not None:
            counts[self._index[old_reftype]] -= old * times
            counts[slot] += old * times
        elif u_type == UpdateType.SIZE:
            counts[slot] += (raw - old) * times
            delta_rounded = (round_size(raw) - round_size(old)) * times
        winfo._memtrain_raw = raw
        if winfo.device == self.compute_device:  # type: ignore[attr-defined]
            self._rounded += delta_rounded
        elif getattr(winfo, "_memtrain_pinned", False):  # host memory CUDA pins (move_to_host)
            if u_type == UpdateType.ADD:
                self._pinned += _pin_extra(raw)
            elif u_type == UpdateType.DEL:
                self._pinned -= _pin_extra(old) * times
            elif u_type == UpdateType.SIZE:
                self._pinned += (_pin_extra(raw) - _pin_extra(old)) * times

    def _record(self, u_type: UpdateType, winfo: Any, raw: int) -> None:
        # a serial number, not id(): a storage's id is reused once it is gone
        key, log = getattr(winfo, "_memtrain_key", None), self.allocations
        assert log is not None
        if key is None:
            key = winfo._memtrain_key = self._serial
            self._serial += 1
        if u_type in (UpdateType.DEL, UpdateType.SIZE):
            log.append((0, key, 0))
            log.extend((0, copy, 0) for copy in self._copies.pop(key, []))
        if u_type in (UpdateType.ADD, UpdateType.SIZE):
            log.append((1, key, raw))

    def _follow_loops(self) -> None:
        """Start or end an elided loop's stand-in iteration (:func:`memtrain.memory.loops.weight`)
        and the iteration after it."""
        mark = loops.current()
        if self._pending is not None and mark != self._pending.after:
            self._multiply(self._pending)
            self._pending = None
        if self._stand_in is not None and mark != self._stand_in.mark:
            ended = self._stand_in
            ended.after, ended.first_row = mark, len(self.rows)
            ended.events = (ended.events[0], len(self.allocations or ()))
            ended.added = {d: [now - before + freed for now, before, freed in
                               zip(self._raw[d], ended.start[d], ended.freed[d], strict=True)]
                           for d in self._raw}  # net, but for multiplied storages (of a loop before) it freed
            self._pending, self._stand_in = ended, None
        if self._stand_in is None and loops.top_weight() > 1:
            self._stand_in = _StandIn(mark, loops.top_weight(), {d: list(c) for d, c in self._raw.items()},
                                      {d: [0] * len(c) for d, c in self._raw.items()})
            self._stand_in.events = (len(self.allocations or ()), 0)

    def _multiply(self, pending: _StandIn) -> None:
        """The iteration after an elided loop's stand-in has ended. What the stand-in allocated and
        still holds (outputs kept for backward, a selective checkpoint's saved matmuls; not a loop
        variable the next iteration replaced) each skipped iteration would hold too: each such
        storage counts ``times`` over from the stand-in's end until it goes, the rows recorded since
        included. That is exact when those storages are all the stand-in added: it freed or moved
        nothing of before it but storages multiplied by an earlier loop's stand-in (a recompute
        consuming a forward's saved chunks). When it added nothing (it replaced what an earlier
        iteration left, as an accumulated gradient), no storage is multiplied; otherwise the loop is
        marked irregular and :meth:`memtrain.estimator.trace.Trace.steady` sends it to a whole trace."""
        held = {d: [0] * len(c) for d, c in self._raw.items()}
        for winfo in pending.survivors.values():
            if winfo.device in held:
                held[winfo.device][self._index[winfo.reftype]] += winfo._memtrain_raw
        if held != pending.added:
            if any(any(v) for v in pending.added.values()) or any(any(v) for v in held.values()):
                self.irregular.add(pending.mark[0])
            return
        if not any(any(v) for v in held.values()):
            return
        extra = pending.times - 1
        device, host = held[self.compute_device], sum(held[self.host_device])  # type: ignore[attr-defined]
        rounded = sum(round_size(w._memtrain_raw) for w in pending.survivors.values()
                      if w.device == self.compute_device)  # type: ignore[attr-defined]
        pinned = sum(_pin_extra(w._memtrain_raw) for w in pending.survivors.values()
                     if w.device == self.host_device and getattr(w, "_memtrain_pinned", False))  # type: ignore[attr-defined]
        for d, counts in held.items():
            for slot, n in enumerate(counts):
                self._raw[d][slot] += n * extra
        self._rounded += rounded * extra
        self._pinned += pinned * extra
        for winfo in pending.survivors.values():
            winfo._memtrain_times = pending.times
        if self.allocations is not None:
            self._repeat(pending)
        shift = np.array([0, 0, *device, host, rounded, pinned], dtype=np.int64) * extra
        self.rows[pending.first_row:] = [tuple(int(v) for v in np.add(row, shift))
                                         for row in self.rows[pending.first_row:]]
        self.scaled.add(pending.mark[0])

    def _repeat(self, pending: _StandIn) -> None:
        """The skipped iterations' allocations, for the allocator's replay: the stand-in's own
        (its span of the log) once per iteration it stands for, right after it. What it keeps (the
        survivors) each copy keeps until the original goes; what it allocates and does not free (a
        loop variable the next iteration replaces) the next copy frees as it starts, and the last
        copy's goes when the original's would (in the iteration after the loop's stand-ins)."""
        log = self.allocations
        assert log is not None
        start, end = pending.events
        body = log[start:end]
        survivors = {w._memtrain_key for w in pending.survivors.values()
                     if w.device == self.compute_device and hasattr(w, "_memtrain_key")}  # type: ignore[attr-defined]
        freed = {key for alloc, key, _ in body if not alloc}
        passing = [key for alloc, key, _ in body if alloc and key not in freed and key not in survivors]
        copies: list[tuple[int, object, int]] = []
        for k in range(1, pending.times):
            copies += [(0, key if k == 1 else (key, k - 1), 0) for key in passing]
            copies += [(alloc, (key, k), n) for alloc, key, n in body]
        log[end:end] = copies
        for key in survivors:
            self._copies[key] = [(key, k) for k in range(1, pending.times)]
        last = {key: (key, pending.times - 1) for key in passing}
        after = end + len(copies)  # the iteration after the stand-in, already recorded
        for i in range(len(log) - 1, after - 1, -1):  # a loop variable it already freed: with it
            alloc, key, _ = log[i]
            if not alloc and key in last:
                log.insert(i + 1, (0, last.pop(key), 0))
        for key, copy in last.items():
            self._copies[key] = [copy]

    def on_peak_update(self, peak_state: object) -> None:
        self._follow_loops()
        phase = self.phase()  # type: ignore[attr-defined]
        if not self.phases or self.phases[-1] != phase:
            self.phases.append(phase)
        row = (len(self.phases) - 1, self._current_layer(), *self._raw[self.compute_device],  # type: ignore[attr-defined]
               sum(self._raw[self.host_device]), self._rounded, self._pinned)  # type: ignore[attr-defined]
        mark = (*loops.current(), *loops.inner())  # the loop iterations (tile, chunk) it ran in, if any
        # ops that allocate nothing (views) add no row
        if not self.rows or row != self.rows[-1] or mark != self.marks[-1]:
            self.rows.append(row)
            self.marks.append(mark)

    def _current_layer(self) -> int:
        parents = self.module_tracker.parents  # type: ignore[attr-defined]
        for i, module in enumerate(self._layers):
            fqn = self._fqns[i] = self._fqns[i] or self.module_tracker.get_known_fqn(module)  # type: ignore[attr-defined]
            if fqn is not None and fqn in parents:
                return i
        return -1


class _EventTracker(_EventRecorder, trackers.Tracker):
    """The meter's tracker, recording raw bytes per op instead of keeping running peaks."""

    def __init__(self, device: torch.device, host: torch.device, layers: list[nn.Module]) -> None:
        super().__init__(device, host, timeline=False)
        self._init_events(layers)


class _FSDPEventTracker(_EventRecorder, trackers.FSDPTracker):
    """The meter's FSDP2 tracker (sharded vs. gathered state), recording raw bytes per op."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 host: torch.device, layers: list[nn.Module]) -> None:
        super().__init__(model, optimizer, device, host, timeline=False)
        self._init_events(layers)


def flop_count(count: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int:
    """``count`` (a ``flop_registry`` formula) of one op. Attention with fewer key/value heads
    than query heads (grouped-query attention, which CUDA's flash kernel takes unexpanded) is
    counted as the kernel works, with key and value broadcast to the query's heads: torch 2.13's
    formula does so, torch 2.11's asserts equal heads (every micro-batch-1 estimate of a GQA model
    failed on an H100 with it)."""
    try:
        return int(count(*args, **kwargs, out_val=out))
    except AssertionError:
        heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)
        if not heads:
            raise
        grown = [torch.Size((a.shape[0], heads, *a.shape[2:]))
                 if isinstance(a, torch.Tensor) and a.dim() == 4 and heads % a.shape[1] == 0 else a
                 for a in args]
        return int(count(*grown, **kwargs, out_val=out))


class TracingMeter(meter_mod.MemoryMeter):
    """A MemoryMeter (so offload code's ``mark_host`` reaches it) with the recording tracker.

    ``gradients``: tensors that hold gradient bytes from before the step (DDP's buckets), counted
    as ``gradients`` from the start.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict,
                 layers: list[nn.Module], gradients: list[torch.Tensor], cuda_kernels: bool = False) -> None:
        super().__init__(model, optimizer, inputs=batch)
        host = self._tracker.host_device
        self.tracker: _EventTracker | _FSDPEventTracker = (
            _FSDPEventTracker(model, optimizer, self.device, host, layers)
            if isinstance(self._tracker, trackers.FSDPTracker)
            else _EventTracker(self.device, host, layers))
        self.tracker.cuda_kernels = cuda_kernels
        self._tracker = self.tracker
        self._layers = layers
        self._hooks: list[Any] = []
        self._gradients = gradients

    def __enter__(self) -> TracingMeter:
        for tensor in self._gradients:
            self.tracker.track_tensor(tensor, MemRefType.GRAD)
        self._hooks = [layer.register_forward_pre_hook(functools.partial(_entered, self.tracker, i))
                       for i, layer in enumerate(self._layers)]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)
