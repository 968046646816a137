"""torch's memory trackers (``torch.distributed._tools``: ``MemTracker``, ``FSDPMemTracker``,
``ModTracker``) behind public names.

What it touches: the private module ``torch.distributed._tools`` (its reference-type enums,
``_TOTAL_KEY``, ``get_untyped_storages``), the trackers' private hooks (``_pre_fw_hook``,
``_post_fw_hook``, ``_pre_bw_hook``, ``_post_bw_hook``, ``_track``, ``_update_snap``,
``_update_peak_stats``, ``_track_module_params_and_buffers``, ``_fsdp_state_pre_forward``;
ModTracker's ``_fw_pre_hook``, ``_fw_post_hook``, ``_maybe_set_engine_callback``) and private
state (``_curr_mem_snap``, ``_peak_mem``, ``_peak_mem_snap``, ``_WINFO``, ``_mod_tracker``,
``_in_opt``, ``_ac_mod``, ``_in_ac``, ``_depth``, ``_param_to_grad_hook_handles``, ``_root_mod``;
ModTracker's ``_active_module_cnt``, ``_post_bw_callbacks_to_enqueue``, ``_has_callback``), a
tensor's ``_backward_hooks`` and ``Variable._execution_engine``.

Why no public API: torch exposes the trackers (``MemTracker().get_tracker_snapshot()``,
``track_external``, ``ModTracker.register_user_hooks``) but no way to be told of each tensor
update, to replace the per-module bookkeeping (which made a measured step several times slower and
refuses gradient accumulation) or to let go of a pass that failed; the whole ``_tools`` package is
private (torch's docs do not list it).

memtrain's trackers (:mod:`memtrain.memory.trackers`, :mod:`memtrain.estimator.trace_events`,
:mod:`memtrain.reliability.budget`) subclass :class:`MemTrackerBase` / :class:`FSDPMemTrackerBase`
and implement the public-named methods below (``on_*``); the private overrides live only here.

Checked on: torch 2.13.0 (this CPU) and 2.11 (the GPU image, docs/devices.md); the tested range of
:data:`memtrain._compat.versions.TESTED` (2.10–2.15) per issue 35's runs.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType as FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as TOTAL_KEY
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mem_tracker import _MemRefType as MemRefType
from torch.distributed._tools.mem_tracker import _RefType as RefType
from torch.distributed._tools.mem_tracker import _UpdateType as UpdateType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves

from memtrain._compat.versions import private, require

__all__ = ["TOTAL_KEY", "FSDPMemTrackerBase", "FSDPRefType", "MemRefType", "MemTrackerBase", "RefType",
           "ReleasableModTracker", "UpdateType", "get_untyped_storages", "release_module_tracking"]

_SHIM = "torch_trackers"
# ModTracker warns "Please file a bug to PyTorch" when a module runs again inside its own forward (a
# block a model calls twice, SmolLM3, Qwen3.5, LFM2): the memory counted is the same (each run is
# counted; the estimates equal the measured steps), and the user can do nothing about it. It is
# silenced where it is raised (ReleasableModTracker._fw_pre_hook), not by a process-wide filter that
# the caller's own warning settings (pytest's per-test ones, for one) would undo.
_MESSED_UP = "The module hierarchy tracking maybe be messed up"
_MEM_TRACKER_HOOKS = ("_track", "_update_snap", "_update_peak_stats", "_pre_fw_hook", "_post_fw_hook",
                      "_pre_bw_hook", "_post_bw_hook", "_track_module_params_and_buffers",
                      "_update_and_maybe_create_winfos")
_MOD_TRACKER_HOOKS = ("_fw_pre_hook", "_fw_post_hook", "_maybe_set_engine_callback")


@functools.cache
def _check(cls: type, names: tuple[str, ...]) -> None:
    require(cls, names, _SHIM, "torch")


class ReleasableModTracker(ModTracker):
    """torch's ``ModTracker`` that keeps (weakly) the backward hooks it adds during a forward, so
    that a pass that failed can be let go of (:meth:`release`; see :mod:`memtrain.memory.trackers`).

    The hooks are found by the keys torch's tracker adds to each tensor's ``_backward_hooks``; the
    list is forgotten (not removed: a retained graph may run backward again) when a backward ends.
    Touches ``_fw_pre_hook``, ``_fw_post_hook``, ``_maybe_set_engine_callback`` (overridden),
    ``_has_callback``, ``_active_module_cnt``, ``_post_bw_callbacks_to_enqueue``, a tensor's
    ``_backward_hooks`` and ``Variable._execution_engine``; torch has no public way to remove the
    hooks ``register_multi_grad_hook`` added. Checked on torch 2.11 and 2.13.0.
    """

    def __init__(self) -> None:
        _check(ModTracker, _MOD_TRACKER_HOOKS)
        super().__init__()
        self._added: list[tuple[weakref.ref[OrderedDict], int]] = []

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        tensors, before = _hook_keys(input)
        formatwarning = warnings.formatwarning  # torch replaces it before that warning
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_MESSED_UP)
            super()._fw_pre_hook(mod, input)
        warnings.formatwarning = formatwarning
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
        _forget_running_modules(self)


def _forget_running_modules(modules: ModTracker) -> None:
    modules.parents = {"Global"}
    modules._active_module_cnt.clear()
    modules._post_bw_callbacks_to_enqueue.clear()
    modules._has_callback = False


def _hook_keys(obj: Any) -> tuple[list[torch.Tensor], list[set[int]]]:
    """The tensors of a module's inputs or outputs that ModTracker hooks, and their hook keys now."""
    tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.requires_grad]
    return tensors, [set(t._backward_hooks or ()) for t in tensors]


def release_module_tracking() -> None:
    """In every tracker on the dispatch-mode stack (a user's included), forget the modules a failed
    forward or backward left "running" (:meth:`ReleasableModTracker.release` where it is one) and
    leave any activation-checkpointing region. Touches ``torch.utils._python_dispatch``'s
    ``_get_current_dispatch_mode_stack`` and the trackers' ``_mod_tracker``, ``_ac_mod``, ``_in_ac``;
    torch offers no reset of a tracker after an exception. Checked on torch 2.11 and 2.13.0."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        modules = getattr(mode, "_mod_tracker", None)
        if modules is None:
            continue
        if callable(getattr(modules, "release", None)):
            modules.release()
        _forget_running_modules(modules)
        if hasattr(mode, "_ac_mod"):
            mode._ac_mod, mode._in_ac = None, False


class _TrackerAdapter:
    """MemTracker's private hooks forwarded to public-named methods, and its private state read
    through properties. Each ``on_*`` method's default is torch's own behaviour."""

    # ---- the private hooks torch calls, forwarded (the only overrides of torch's private names)
    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        self.on_track(reftype, t)

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                     old_reftype: Any = None) -> None:
        self.on_snapshot_update(u_type, winfo, old_mem_consumed, old_reftype)

    def _update_peak_stats(self, peak_state: Any) -> None:
        self.on_peak_update(peak_state)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        self.on_module_pre_forward(module, inputs)

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        self.on_module_post_forward(module, inputs, outputs)

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        self.on_module_pre_backward(module, args)

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        self.on_module_post_backward(module, args)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        return self.track_module_state(module, install_grad_hooks)

    # ---- public names with torch's behaviour by default
    def on_track(self, reftype: Any, t: torch.Tensor) -> None:
        """A tensor is being tracked as ``reftype``."""
        super()._track(reftype, t)  # type: ignore[misc]

    def on_snapshot_update(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                           old_reftype: Any = None) -> None:
        """A storage was added, deleted, resized or re-typed (``UpdateType``)."""
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]

    def on_peak_update(self, peak_state: Any) -> None:
        """After every op that changed the snapshot: update the peaks."""
        super()._update_peak_stats(peak_state)  # type: ignore[misc]

    def on_module_pre_forward(self, module: nn.Module, inputs: Any) -> None:
        super()._pre_fw_hook(module, inputs)  # type: ignore[misc]

    def on_module_post_forward(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        super()._post_fw_hook(module, inputs, outputs)  # type: ignore[misc]

    def on_module_pre_backward(self, module: nn.Module, args: Any) -> None:
        super()._pre_bw_hook(module, args)  # type: ignore[misc]

    def on_module_post_backward(self, module: nn.Module, args: Any) -> None:
        super()._post_bw_hook(module, args)  # type: ignore[misc]

    def track_module_state(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        """Track a module's parameters and buffers (and, with ``install_grad_hooks``, hook every
        parameter's gradient); returns torch's (parameter bytes, buffer bytes)."""
        return super()._track_module_params_and_buffers(  # type: ignore[misc]
            module, install_grad_hooks=install_grad_hooks)

    # ---- calls into torch's bookkeeping
    def track_tensor(self, tensor: torch.Tensor, reftype: Any) -> None:
        """Count ``tensor``'s storages as ``reftype`` (created if new)."""
        self._update_and_maybe_create_winfos(tensor, reftype)  # type: ignore[attr-defined]

    def update_snapshot(self, u_type: Any, winfo: Any) -> None:
        self._update_snap(u_type, winfo)

    def storage_info(self, storage: Any) -> Any:
        """torch's record (``_WeakRefInfo``: ``device``, ``mem_consumed``, ...) of a storage, or None."""
        winfo, _ = self._WINFO.get(storage, (None, None))  # type: ignore[attr-defined]
        return winfo

    # ---- private state behind public names
    @property
    def current_snapshot(self) -> dict:
        """device -> {reference type or ``TOTAL_KEY``: bytes} now (torch's own dict)."""
        return self._curr_mem_snap  # type: ignore[attr-defined]

    @property
    def peak_by_device(self) -> dict:
        """device -> peak bytes (torch's own dict: writing it sets the peak)."""
        return self._peak_mem  # type: ignore[attr-defined]

    @property
    def peak_snapshot_by_device(self) -> dict:
        """device -> the snapshot at the peak (torch's own dict)."""
        return self._peak_mem_snap  # type: ignore[attr-defined]

    @property
    def module_tracker(self) -> ModTracker:
        return self._mod_tracker  # type: ignore[attr-defined]

    @module_tracker.setter
    def module_tracker(self, tracker: ModTracker) -> None:
        self._mod_tracker = tracker

    @property
    def depth(self) -> int:
        """How many times the tracker was entered and not left (0: not tracking)."""
        return getattr(self, "_depth", 0)

    @property
    def in_optimizer_step(self) -> bool:
        return self._in_opt  # type: ignore[attr-defined]

    @property
    def grad_hook_handles(self) -> Any:
        """parameter -> its gradient hooks' handles (torch's own dict)."""
        return self._param_to_grad_hook_handles  # type: ignore[attr-defined]

    @property
    def recompute_module(self) -> nn.Module | None:
        """The module whose forward is being recomputed in backward (activation checkpointing)."""
        ref = self._ac_mod  # type: ignore[attr-defined]
        return ref() if ref is not None else None

    @property
    def in_recompute(self) -> bool:
        return self._ac_mod is not None  # type: ignore[attr-defined]

    def start_recompute(self, module: nn.Module) -> None:
        """Count what follows as recomputed activations, until :meth:`end_recompute`."""
        self._ac_mod = weakref.ref(module)
        self._in_ac = True

    def end_recompute(self) -> None:
        self._ac_mod = None
        self._in_ac = False


class MemTrackerBase(_TrackerAdapter, MemTracker):
    """torch's ``MemTracker`` with its private hooks and state behind public names (see
    :class:`_TrackerAdapter`). Checked on torch 2.11 and 2.13.0."""

    def __init__(self) -> None:
        _check(MemTracker, _MEM_TRACKER_HOOKS)
        super().__init__()


class FSDPMemTrackerBase(_TrackerAdapter, FSDPMemTracker):
    """torch's ``FSDPMemTracker`` likewise, plus ``_fsdp_state_pre_forward`` forwarded to
    :meth:`wrap_fsdp_pre_forward` and ``_root_mod`` as :attr:`root_module`. Checked on torch 2.11
    and 2.13.0."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        _check(FSDPMemTracker, (*_MEM_TRACKER_HOOKS, "_fsdp_state_pre_forward"))
        super().__init__(model, optimizer)

    def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        return self.wrap_fsdp_pre_forward(fsdp_mod, orig)

    def wrap_fsdp_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        """The function FSDP's pre-forward of ``fsdp_mod`` runs under the tracker (torch's wrapper)."""
        return super()._fsdp_state_pre_forward(fsdp_mod, orig)

    @property
    def root_module(self) -> nn.Module:
        return private(self, "_root_mod", _SHIM, "torch")

