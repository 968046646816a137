"""Measure what a training step really holds: peak live tensor bytes by category and phase.

Built on torch's dispatch-level ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which
sees every tensor an op creates and sorts it into parameters, buffers, gradients, activations
(created in forward), temporaries (created in backward) and optimizer state. It works on CPU, on
CUDA and under ``FakeTensorMode`` (the estimator traces fake steps with it). memtrain adds:

- per-phase peaks (forward / backward / optimizer) with the category split at each peak;
- a *host* bucket: tensors that offload code moved to host memory (:meth:`MemoryMeter.mark_host`)
  are counted apart from the compute device, also on a CPU-only machine where both are RAM;
- gradient accumulation (the root module runs several times in one step);
- the quantization constants of bitsandbytes layers (absmax, code books, int8 row scales), which
  live outside parameters and buffers, counted as ``parameters``;
- a compact timeline of the step for reports, and CUDA allocator peaks beside the tensor bytes;
- FSDP2 models (several processes): measured with torch's ``FSDPMemTracker`` instead, so that a
  process's *sharded* parameters and gradients are told apart from the full (``unsharded``) copies
  FSDP all-gathers for the layers being computed, and from its collective buffers.

On CPU the figures are exact live-tensor bytes; on CUDA they are allocation-rounded tensor bytes,
and ``cuda_max_allocated`` / ``cuda_max_reserved`` report what the caching allocator saw.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _RefType, _UpdateType
from torch.distributed.fsdp import FSDPModule

from memtrain.memory.quantized import quantization_state_tensors

CATEGORIES: dict[_MemRefType, str] = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "inputs",
}
# Under FSDP, "parameters" and "gradients" are this process's shards; "unsharded" holds the full
# parameters and gradients of the layers being computed and the all-gather / reduce-scatter buffers
# (transient: freed when a layer is resharded).
FSDP_CATEGORIES: dict[_RefType, str] = {
    _FSDPRefType.SHARDED_PARAM: "parameters",
    _FSDPRefType.BUFFER: "buffers",
    _FSDPRefType.SHARDED_GRAD: "gradients",
    _FSDPRefType.OPT: "optimizer_state",
    _FSDPRefType.ACT: "activations",
    _FSDPRefType.TEMP: "temporaries",
    _FSDPRefType.INP: "inputs",
    _FSDPRefType.UNSHARDED_PARAM: "unsharded",
    _FSDPRefType.UNSHARDED_GRAD: "unsharded",
    _FSDPRefType.ALL_GATHER: "unsharded",
    _FSDPRefType.REDUCE_SCATTER: "unsharded",
}
CATEGORY_NAMES: tuple[str, ...] = (*CATEGORIES.values(), "unsharded")
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")
# The key host bytes are filed under while the meter runs. On a CPU-only machine "cpu" is the
# compute device, so host copies get a distinct (otherwise unused) CPU index.
_HOST_ON_CPU = torch.device("cpu", 1)

_ACTIVE: contextvars.ContextVar[MemoryMeter | None] = contextvars.ContextVar("memtrain_meter", default=None)


@dataclass
class StepMemory:
    """The memory of one measured step. All values are bytes."""

    device: str
    peak_bytes: int
    peak_by_category: dict[str, int]
    max_by_category: dict[str, int]
    peak_by_phase: dict[str, int]
    category_at_phase_peak: dict[str, dict[str, int]]
    host_peak_bytes: int = 0
    host_by_category: dict[str, int] = field(default_factory=dict)
    cuda_max_allocated: int | None = None
    cuda_max_reserved: int | None = None
    timeline: list[tuple[str, dict[str, int]]] = field(default_factory=list, repr=False)

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready dict (the timeline only when asked: it can be long)."""
        out = asdict(self)
        if not timeline:
            out.pop("timeline")
        return out


class _MeterMixin:
    """What memtrain adds to torch's trackers: phase peaks, category maxima, a host bucket, a
    timeline, and device peaks without MemTracker's per-module snapshots (see ``_Tracker``)."""

    categories: dict[_RefType, str] = CATEGORIES  # type: ignore[assignment]

    def _setup_meter(self, device: torch.device, host: torch.device, timeline: bool) -> None:
        self.compute_device = device
        self.host_device = host
        self.phase_peak: dict[str, dict[str, int]] = {}
        self.category_max: dict[str, int] = dict.fromkeys(CATEGORY_NAMES, 0)
        self.host_peak: dict[str, int] = {}
        self.record_timeline = timeline
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self._backward_seen = False

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
        if self._in_opt and not self._mod_tracker.is_bw:  # type: ignore[attr-defined]
            return "optimizer"
        if self._mod_tracker.is_bw:  # type: ignore[attr-defined]
            self._backward_seen = True
            return "backward"
        if self._mod_tracker.parents <= {"Global"}:  # type: ignore[attr-defined]
            return "optimizer" if self._backward_seen else "forward"
        self._backward_seen = False
        return "forward"

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:  # type: ignore[attr-defined]
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]  # type: ignore[attr-defined]
                self._peak_mem_snap[dev] = dict(dev_snap)  # type: ignore[attr-defined]
        device_snap = self.named(self._curr_mem_snap.get(self.compute_device))  # type: ignore[attr-defined]
        phase = self.phase()
        if sum(device_snap.values()) > sum(self.phase_peak.get(phase, {}).values()):
            self.phase_peak[phase] = device_snap
        for name, value in device_snap.items():
            self.category_max[name] = max(self.category_max[name], value)
        self._update_host_peak()
        if self.record_timeline:
            self.timeline.append((phase, device_snap))

    def _update_host_peak(self) -> None:
        host_snap = self.named(self._curr_mem_snap.get(self.host_device))  # type: ignore[attr-defined]
        if sum(host_snap.values()) > sum(self.host_peak.values()):
            self.host_peak = host_snap

    def move_to_host(self, tensor: torch.Tensor) -> None:
        for storage in get_untyped_storages(tensor):
            winfo, _ = self._WINFO.get(storage, (None, None))  # type: ignore[attr-defined]
            if winfo is None or winfo.device == self.host_device:
                continue
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.DEL, winfo)  # type: ignore[attr-defined]
            winfo.device = self.host_device
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.ADD, winfo)  # type: ignore[attr-defined]
        self._update_host_peak()


class _Tracker(_MeterMixin, MemTracker):
    """MemTracker's tensor accounting, with lean module hooks, phase peaks, a host bucket.

    MemTracker also keeps per-module snapshots: it walks every tracked module and deep-copies
    snapshots on each op, which made a measured step several times slower, and it refuses a
    second top-level call (gradient accumulation). memtrain reads only device totals, so the
    module hooks here keep just what the totals need: parameter/gradient tracking on a module's
    first call and the activation-checkpointing region (a forward call during backward).
    """

    def __init__(self, device: torch.device, host: torch.device, timeline: bool) -> None:
        super().__init__()
        self._setup_meter(device, host, timeline)
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module not in self._seen:
            self._seen.add(module)
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        elif self._mod_tracker.is_bw and self._ac_mod is None:  # recompute in backward
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _track_module_params_and_buffers(self, module: nn.Module,
                                         install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, and torch refuses a hook on a frozen one
        # (LoRA base weights): hook only the parameters that get gradients.
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for param in module.parameters():
                if param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(self._grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: self._grad_hook(p.grad)),
                    )
        return sizes

    def _grad_hook(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)


class _FSDPTracker(_MeterMixin, FSDPMemTracker):
    """FSDPMemTracker (sharded vs. unsharded state of an FSDP2 model) plus memtrain's additions.

    Why not the plain tracker: it files the full weights FSDP all-gathers for each layer's forward
    as ``parameters``, so a process would seem to hold its shard *and* the whole weights.
    """

    categories = FSDP_CATEGORIES

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device,
                 host: torch.device, timeline: bool) -> None:
        super().__init__(model, optimizer)
        self._setup_meter(device, host, timeline)

    def track_external(self, *external: Any) -> None:
        # FSDPMemTracker was handed the model and the optimizer; only input tensors are left.
        tensors = tuple(t for t in external if isinstance(t, torch.Tensor))
        if tensors:
            self.track_inputs(tensors)

    def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        # FSDPMemTracker refuses a second forward of the root in one session; gradient
        # accumulation makes one per micro-batch, so module statistics restart there (the device
        # totals, which are all memtrain reads, are unaffected).
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def restart_then_run(*args: Any, **kwargs: Any) -> Any:
            again = fsdp_mod is self._root_mod and fsdp_mod in self.memory_tracking
            if again and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            return inner(*args, **kwargs)

        return restart_then_run


class MemoryMeter:
    """Context manager measuring one training step (forward, backward, optimizer step).

    Example::

        with MemoryMeter(model, optimizer) as meter:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(meter.result().peak_bytes)

    Args:
        model: the model; its parameters, buffers and existing gradients are counted from the start.
        optimizer: its existing state is counted from the start (optional).
        inputs: tensors created before the step that it holds (the batch), counted as ``inputs``.
        device: the compute device; defaults to the device of the model's first parameter (of
            FSDP's device for an FSDP2 model, whose shards may be offloaded).
        timeline: keep a per-op snapshot list for plots.
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 inputs: Any = None, device: torch.device | str | None = None,
                 timeline: bool = False) -> None:
        if device is None:
            device = _compute_device(model)
        self.device = _canonical(torch.device(device))
        host = torch.device("cpu") if self.device.type != "cpu" else _HOST_ON_CPU
        self._tracker: _Tracker | _FSDPTracker = (
            _FSDPTracker(model, optimizer, self.device, host, timeline) if isinstance(model, FSDPModule)
            else _Tracker(self.device, host, timeline))
        self._external = [x for x in (model, optimizer) if x is not None]
        if inputs is not None:
            self._external.extend(t for t in _tensors(inputs))
        self._token: contextvars.Token | None = None
        self._result: StepMemory | None = None

    def __enter__(self) -> MemoryMeter:
        if self._external:
            self._tracker.track_external(*self._external)
        fsdp = isinstance(self._tracker, _FSDPTracker)
        param_ref = _FSDPRefType.SHARDED_PARAM if fsdp else _MemRefType.PARAM
        for obj in self._external:  # bitsandbytes keeps quantization constants outside parameters
            if isinstance(obj, nn.Module):
                for tensor in quantization_state_tensors(obj):
                    self._tracker._update_and_maybe_create_winfos(tensor, param_ref)
        for tensor in _host_tensors(self._external):  # an offloaded optimizer's host copies
            self._tracker._update_and_maybe_create_winfos(tensor, _MemRefType.OPT)
            self._tracker.move_to_host(tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._tracker.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
        self._tracker.__exit__(*exc)
        self._result = self._collect()

    def mark_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory from now on (offloaded copies)."""
        self._tracker.move_to_host(tensor)

    def result(self) -> StepMemory:
        """The measurement; available after the ``with`` block."""
        if self._result is None:
            raise RuntimeError("MemoryMeter.result() is available after the `with` block ends")
        return self._result

    def _collect(self) -> StepMemory:
        t = self._tracker
        peak_snap = t.get_tracker_snapshot("peak").get(self.device, {})
        peak = t.named(peak_snap)
        cuda_alloc = cuda_reserved = None
        if self.device.type == "cuda":
            cuda_alloc = torch.cuda.max_memory_allocated(self.device)
            cuda_reserved = torch.cuda.max_memory_reserved(self.device)
        return StepMemory(
            device=str(self.device),
            peak_bytes=int(peak_snap.get(_TOTAL_KEY, sum(peak.values()))),
            peak_by_category=peak,
            max_by_category=dict(t.category_max),
            peak_by_phase={p: sum(t.phase_peak[p].values()) for p in PHASES if p in t.phase_peak},
            category_at_phase_peak={p: t.phase_peak[p] for p in PHASES if p in t.phase_peak},
            host_peak_bytes=sum(t.host_peak.values()),
            host_by_category=t.host_peak,
            cuda_max_allocated=cuda_alloc,
            cuda_max_reserved=cuda_reserved,
            timeline=t.timeline,
        )


def mark_host(tensor: torch.Tensor) -> None:
    """Tell the active meter (if any) that ``tensor`` lives in host memory (for offload code)."""
    meter = _ACTIVE.get()
    if meter is not None:
        meter.mark_host(tensor)


def _host_tensors(objects: list[Any]) -> list[torch.Tensor]:
    """Tensors that objects (e.g. ``memtrain.optim_offload.OffloadOptimizer``, also wrapped by
    accelerate) declare as kept in host memory through a ``host_tensors()`` method."""
    found: list[torch.Tensor] = []
    for obj in objects:
        declare = getattr(getattr(obj, "optimizer", obj), "host_tensors", None)
        if callable(declare):
            found.extend(declare())
    return found


def _compute_device(model: nn.Module | None) -> torch.device:
    """Where the model computes: FSDP's device (its shards may be offloaded to the CPU), else the
    device of its first parameter."""
    if isinstance(model, FSDPModule):
        return model._get_fsdp_state()._device
    first = next(model.parameters(), None) if model is not None else None
    return first.device if first is not None else torch.device("cpu")


def _canonical(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def measure_step(model: nn.Module, batch: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer | None = None, timeline: bool = False) -> StepMemory:
    """Run and measure one step: forward, backward, and the optimizer step if one is given.

    The loss is the model's own (``model(**batch).loss``); gradients are cleared afterwards the
    way the Trainer does (``zero_grad(set_to_none=True)``), inside the measurement.
    """
    model.train()
    with MemoryMeter(model, optimizer, inputs=batch, timeline=timeline) as meter:
        loss = model(**batch).loss
        loss.backward()
        del loss
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return meter.result()
