"""The trackers behind :class:`memtrain.memory.meter.MemoryMeter`: torch's ``MemTracker`` (one
process) and ``FSDPMemTracker`` (FSDP2), with what memtrain adds to both (``_MeterMixin``): phase
peaks, category maxima, a host bucket, a timeline. See :mod:`memtrain.memory.meter`.

Both track modules with :class:`ReleasableModTracker`, torch's ``ModTracker`` plus a way to let go
of a forward or backward that failed (:meth:`ReleasableModTracker.release`): torch's tracker hooks
every module's input tensors with ``register_multi_grad_hook``, whose closure holds the autograd
nodes of those tensors while the nodes hold the closure, a reference cycle through C++ that
Python's garbage collector cannot see. A pass whose backward never ran therefore keeps its whole
autograd graph, and every activation saved in it, alive for good (a tiny Llama's failed forward:
6.6 MiB kept after ``gc.collect()``; none once the hooks are removed). Out-of-memory recovery
calls :meth:`~ReleasableModTracker.release` through
:func:`memtrain.reliability.recovery.reset_module_tracking`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.autograd import Variable
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _RefType, _UpdateType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves

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


class ReleasableModTracker(ModTracker):
    """torch's ``ModTracker`` that keeps (weakly) the backward hooks it adds during a forward, so
    that a pass that failed can be let go of (:meth:`release`; see the module docstring).

    The hooks are found by the keys torch's tracker adds to each tensor's ``_backward_hooks``; the
    list is forgotten (not removed: a retained graph may run backward again) when a backward ends.
    """

    def __init__(self) -> None:
        super().__init__()
        self._added: list[tuple[weakref.ref[OrderedDict], int]] = []

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        tensors, before = _hook_keys(input)
        super()._fw_pre_hook(mod, input)
        self._keep(tensors, before)

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        tensors, before = _hook_keys(output)
        super()._fw_post_hook(mod, input, output)
        self._keep(tensors, before)

    def _keep(self, tensors: list[torch.Tensor], before: list[set[int]]) -> None:
        for tensor, keys in zip(tensors, before, strict=True):
            hooks = tensor._backward_hooks
            if hooks:
                self._added.extend((weakref.ref(hooks), key) for key in hooks if key not in keys)

    def _maybe_set_engine_callback(self) -> None:
        if self._has_callback:
            return
        super()._maybe_set_engine_callback()
        Variable._execution_engine.queue_callback(self._added.clear)  # the backward went through

    def release(self) -> None:
        """Remove the hooks of the pass that failed (the cycle that kept its graph alive) and forget
        the modules it left "running", so that the next pass starts from a clean state."""
        for ref, key in self._added:
            hooks = ref()
            if hooks is not None:
                hooks.pop(key, None)
        self._added.clear()
        self.parents = {"Global"}
        self._active_module_cnt.clear()
        self._post_bw_callbacks_to_enqueue.clear()
        self._has_callback = False


def _hook_keys(obj: Any) -> tuple[list[torch.Tensor], list[set[int]]]:
    """The tensors of a module's inputs or outputs that ModTracker hooks, and their hook keys now."""
    tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors, [set(t._backward_hooks or ()) for t in tensors]


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

    def __enter__(self) -> Any:
        # The fake mode active when tracking starts (None in eager): an op under another one is
        # DTensor's layout propagation, no memory. torch 2.13's trackers skip those themselves;
        # torch 2.11's counted them (AdamW's step on FSDP2 shards as 5x the optimizer state, and
        # every estimate failed reading the attribute 2.13 keeps), so memtrain records the mode.
        if not getattr(self, "_depth", 0):
            self._entry_fake_mode = active_fake_mode()
        return super().__enter__()  # type: ignore[misc]

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if active_fake_mode() is getattr(self, "_entry_fake_mode", None):
            super()._track(reftype, t)  # type: ignore[misc]

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
        self._mod_tracker = ReleasableModTracker()
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
        self._mod_tracker = ReleasableModTracker()
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
