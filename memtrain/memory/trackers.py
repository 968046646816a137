"""The trackers behind :class:`memtrain.memory.meter.MemoryMeter`: torch's ``MemTracker`` (one
process) and ``FSDPMemTracker`` (FSDP2), with what memtrain adds to both (``_MeterMixin``): phase
peaks, category maxima, a host bucket, a timeline. See :mod:`memtrain.memory.meter`. The
estimator's tracing meter (:mod:`memtrain.estimator.trace_events`) and the budget guard
(:mod:`memtrain.reliability.budget`) subclass :class:`Tracker` and :class:`FSDPTracker`.

Both track modules with :class:`memtrain._compat.torch_trackers.ReleasableModTracker`, torch's
``ModTracker`` plus a way to let go of a forward or backward that failed (its ``release``): torch's
tracker hooks every module's input tensors with ``register_multi_grad_hook``, whose closure holds the
autograd nodes of those tensors while the nodes hold the closure, a reference cycle through C++ that
Python's garbage collector cannot see. A pass whose backward never ran therefore keeps its whole
autograd graph, and every activation saved in it, alive for good (a tiny Llama's failed forward:
6.6 MiB kept after ``gc.collect()``; none once the hooks are removed). Out-of-memory recovery
calls ``release`` through :func:`memtrain.reliability.recovery.reset_module_tracking`.

torch's trackers are private (``torch.distributed._tools``): the trackers here subclass
:mod:`memtrain._compat.torch_trackers`' bases and implement their public-named methods (``on_*``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memtrain._compat.torch_tools import active_fake_mode
from memtrain._compat.torch_trackers import (
    TOTAL_KEY,
    FSDPMemTrackerBase,
    FSDPRefType,
    MemRefType,
    MemTrackerBase,
    RefType,
    ReleasableModTracker,
    UpdateType,
    get_untyped_storages,
)

CATEGORIES: dict[MemRefType, str] = {
    MemRefType.PARAM: "parameters",
    MemRefType.BUFFER: "buffers",
    MemRefType.GRAD: "gradients",
    MemRefType.OPT: "optimizer_state",
    MemRefType.ACT: "activations",
    MemRefType.TEMP: "temporaries",
    MemRefType.OTH: "inputs",
}
# Under FSDP, "parameters" and "gradients" are this process's shards; "unsharded" holds the full
# parameters and gradients of the layers being computed and the all-gather / reduce-scatter buffers
# (transient: freed when a layer is resharded).
FSDP_CATEGORIES: dict[RefType, str] = {
    FSDPRefType.SHARDED_PARAM: "parameters",
    FSDPRefType.BUFFER: "buffers",
    FSDPRefType.SHARDED_GRAD: "gradients",
    FSDPRefType.OPT: "optimizer_state",
    FSDPRefType.ACT: "activations",
    FSDPRefType.TEMP: "temporaries",
    FSDPRefType.INP: "inputs",
    FSDPRefType.UNSHARDED_PARAM: "unsharded",
    FSDPRefType.UNSHARDED_GRAD: "unsharded",
    FSDPRefType.ALL_GATHER: "unsharded",
    FSDPRefType.REDUCE_SCATTER: "unsharded",
}
CATEGORY_NAMES: tuple[str, ...] = (*CATEGORIES.values(), "unsharded")
# "generation": text generation inside a step (GRPO's completions, under ``meter.generating()``).
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "generation")
# The key host bytes are filed under while the meter runs. On a CPU-only machine "cpu" is the
# compute device, so host copies get a distinct (otherwise unused) CPU index.
HOST_ON_CPU = torch.device("cpu", 1)


def pinned_bytes(nbytes: int) -> int:
    """The host bytes a pinned allocation of ``nbytes`` holds on CUDA: torch's caching host
    allocator (``pin_memory=True``, ``Tensor.pin_memory()``) rounds every request up to a power of
    two before asking CUDA for it (``CachingHostAllocator.h``: ``PowerOf2Ceil``; torch 2.11-2.15),
    so a 376 MB layer input of the 1.24B at 91,904 tokens pins 537 MB."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def host_key(device: torch.device) -> torch.device:
    """The key a tracker files host bytes under when ``device`` computes: the CPU, or, where the CPU
    is the compute device, :data:`HOST_ON_CPU`. (The meter and the simulated budget both ask here.)"""
    return torch.device("cpu") if device.type != "cpu" else HOST_ON_CPU


class _MeterMixin:
    """What memtrain adds to torch's trackers: phase peaks, category maxima, a host bucket, a
    timeline, and device peaks without MemTracker's per-module snapshots (see ``Tracker``)."""

    categories: dict[RefType, str] = CATEGORIES  # type: ignore[assignment]

    def _setup_meter(self, device: torch.device, host: torch.device, timeline: bool) -> None:
        self.compute_device = device
        self.host_device = host
        self.phase_peak: dict[str, dict[str, int]] = {}
        self.category_max: dict[str, int] = dict.fromkeys(CATEGORY_NAMES, 0)
        self.host_peak: dict[str, int] = {}
        self.record_timeline = timeline
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self._backward_seen = False
        self.generating = 0  # > 0 inside meter.generating(): every op belongs to "generation"

    def __enter__(self) -> Any:
        # The fake mode active when tracking starts (None in eager): an op under another one is
        # DTensor's layout propagation, no memory. torch 2.13's trackers skip those themselves;
        # torch 2.11's counted them (AdamW's step on FSDP2 shards as 5x the optimizer state, and
        # every estimate failed reading the attribute 2.13 keeps), so memtrain records the mode.
        if not self.depth:  # type: ignore[attr-defined]
            self._entry_fake_mode = active_fake_mode()
        return super().__enter__()  # type: ignore[misc]

    def on_track(self, reftype: Any, t: torch.Tensor) -> None:
        if active_fake_mode() is getattr(self, "_entry_fake_mode", None):
            super().on_track(reftype, t)  # type: ignore[misc]

    def named(self, snap: dict | None) -> dict[str, int]:
        """A device snapshot keyed by torch's reference types -> bytes per memtrain category."""
        out = dict.fromkeys(CATEGORY_NAMES, 0)
        for ref, value in (snap or {}).items():
            if ref in self.categories:
                out[self.categories[ref]] += int(value)
        return out

    def phase(self) -> str:
        # Work outside any module after a backward (gradient clipping, zero_grad) belongs to the
        # optimizer step; a module running again means the next micro-batch's forward, and the
        # work outside modules after it (the loss scaled by 1/accumulation) belongs to that forward.
        # An optimizer step inside backward (training.optimizer_in_backward) is part of backward.
        if self.generating:
            return "generation"
        if self.in_optimizer_step and not self.module_tracker.is_bw:  # type: ignore[attr-defined]
            return "optimizer"
        if self.module_tracker.is_bw:  # type: ignore[attr-defined]
            self._backward_seen = True
            return "backward"
        if self.module_tracker.parents <= {"Global"}:  # type: ignore[attr-defined]
            return "optimizer" if self._backward_seen else "forward"
        self._backward_seen = False
        return "forward"

    def on_peak_update(self, peak_state: Any) -> None:
        for dev, dev_snap in self.current_snapshot.items():  # type: ignore[attr-defined]
            if self.peak_by_device.get(dev, 0) < dev_snap[TOTAL_KEY]:  # type: ignore[attr-defined]
                self.peak_by_device[dev] = dev_snap[TOTAL_KEY]  # type: ignore[attr-defined]
                self.peak_snapshot_by_device[dev] = dict(dev_snap)  # type: ignore[attr-defined]
        device_snap = self.named(self.current_snapshot.get(self.compute_device))  # type: ignore[attr-defined]
        phase = self.phase()
        if sum(device_snap.values()) > sum(self.phase_peak.get(phase, {}).values()):
            self.phase_peak[phase] = device_snap
        for name, value in device_snap.items():
            self.category_max[name] = max(self.category_max[name], value)
        self._update_host_peak()
        if self.record_timeline:
            self.timeline.append((phase, device_snap))

    def _update_host_peak(self) -> None:
        host_snap = self.named(self.current_snapshot.get(self.host_device))  # type: ignore[attr-defined]
        if sum(host_snap.values()) > sum(self.host_peak.values()):
            self.host_peak = host_snap

    def move_to_host(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """File ``tensor``'s storages as host memory; ``pinned``: at the size CUDA's pinned-memory
        allocator gives them (:func:`pinned_bytes`)."""
        for storage in get_untyped_storages(tensor):
            winfo = self.storage_info(storage)  # type: ignore[attr-defined]
            if winfo is None or winfo.device == self.host_device:
                continue
            if winfo.mem_consumed > 0:
                self.update_snapshot(UpdateType.DEL, winfo)  # type: ignore[attr-defined]
            winfo.device = self.host_device
            if pinned:  # both the tracker's totals and a trace's raw bytes (trace_events) see it
                winfo.mem_consumed = pinned_bytes(storage.nbytes())
                winfo._memtrain_pinned = True
            if winfo.mem_consumed > 0:
                self.update_snapshot(UpdateType.ADD, winfo)  # type: ignore[attr-defined]
        self._update_host_peak()


class Tracker(_MeterMixin, MemTrackerBase):
    """MemTracker's tensor accounting, with lean module hooks, phase peaks, a host bucket.

    MemTracker also keeps per-module snapshots: it walks every tracked module and deep-copies
    snapshots on each op, which made a measured step several times slower, and it refuses a
    second top-level call (gradient accumulation). memtrain reads only device totals, so the
    module hooks here keep just what the totals need: parameter/gradient tracking on a module's
    first call and the activation-checkpointing region (a forward call during backward).
    """

    def __init__(self, device: torch.device, host: torch.device, timeline: bool) -> None:
        super().__init__()
        self.module_tracker = ReleasableModTracker()
        self._setup_meter(device, host, timeline)
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def on_module_pre_forward(self, module: nn.Module, inputs: Any) -> None:
        if module not in self._seen:
            self._seen.add(module)
            self.track_module_state(module, install_grad_hooks=True)
        elif self.module_tracker.is_bw and not self.in_recompute:  # recompute in backward
            self.start_recompute(module)

    def on_module_post_forward(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self.module_tracker.is_bw and self.in_recompute and self.recompute_module is module:
            self.end_recompute()

    def on_module_pre_backward(self, module: nn.Module, args: Any) -> None:
        pass

    def on_module_post_backward(self, module: nn.Module, args: Any) -> None:
        pass

    def track_module_state(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, and torch refuses a hook on a frozen one
        # (LoRA base weights): hook only the parameters that get gradients.
        sizes = super().track_module_state(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self.grad_hook_handles:
                    self.grad_hook_handles[param] = (
                        param.register_hook(self._grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_hook(p.grad)),
                    )
        return sizes

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self.track_tensor(grad, MemRefType.GRAD)


class FSDPTracker(_MeterMixin, FSDPMemTrackerBase):
    """FSDPMemTracker (sharded vs. unsharded state of an FSDP2 model) plus memtrain's additions.

    Why not the plain tracker: it files the full weights FSDP all-gathers for each layer's forward
    as ``parameters``, so a process would seem to hold its shard *and* the whole weights.
    """

    categories = FSDP_CATEGORIES

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
                 host: torch.device, timeline: bool) -> None:
        super().__init__(model, optimizer)
        self.module_tracker = ReleasableModTracker()
        self._setup_meter(device, host, timeline)

    def track_external(self, *external: Any) -> None:
        # FSDPMemTracker was handed the model and the optimizer; only input tensors are left.
        tensors = tuple(t for t in external if isinstance(t, torch.Tensor))
        if tensors:
            self.track_inputs(tensors)

    def wrap_fsdp_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        # FSDPMemTracker refuses a second forward of the root in one session; gradient
        # accumulation makes one per micro-batch, so module statistics restart there (the device
        # totals, which are all memtrain reads, are unaffected).
        inner = super().wrap_fsdp_pre_forward(fsdp_mod, orig)

        def restart_then_run(*args: Any, **kwargs: Any) -> Any:
            again = fsdp_mod is self.root_module and fsdp_mod in self.memory_tracking
            if again and not self.module_tracker.is_bw:
                self.reset_mod_stats()
            return inner(*args, **kwargs)

        return restart_then_run
