"""Optimizer-state offload (``memory.offload.optimizer``): state and step on the CPU, one device.

Saves: the optimizer state on the device (8 bytes per trainable fp32 parameter for AdamW).
Costs: host RAM for a copy of each offloaded parameter, its gradient and its state; every step
copies gradients device→host (during backward, on a side stream) and parameters host→device
(after the CPU step); the step itself runs on the CPU, which is slower than on a GPU.

The implementation is torchao's ``CPUOffloadOptimizer`` (``torchao.optim``, single-GPU offload
from pinned memory with a side stream; also used by torchtune). It was chosen over a hand-written
one because it is maintained, small, overlaps the gradient copies with backward, and keeps tiny
tensors (< ``minimal_size`` elements) on the device. memtrain adds two things in a subclass:

- gradient clipping: torchao copies each gradient to the host as soon as backward produced it,
  so clipping the device gradients afterwards (what the Trainer does) would not reach the host
  copies the step uses. :meth:`OffloadOptimizer.clip_grad_norm_` computes the norm on the device
  and scales the host copies instead; :class:`memtrain.trainer.trainer.MemtrainTrainer` calls it.
- a CPU-only mode: torchao refuses to run without CUDA/XPU. On a CPU machine "device" and "host"
  are the same RAM, so offload saves nothing real there; the subclass then builds the same
  structures (host copies, per-parameter optimizers, gradient hooks) with synchronous copies, and
  torchao's own ``step``/``zero_grad``/``state_dict`` run on them. This keeps one code path that
  tests can exercise and lets the memory meter count the host copies apart (:meth:`host_tensors`).

With several processes, optimizer offload is FSDP2's CPU offload policy instead (not here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchao.optim import CPUOffloadOptimizer

from memtrain._compat.torch_tools import foreach_mul_, post_accumulate_grad_hooks
from memtrain.device import host_free_bytes
from memtrain.errors import MemtrainError
from memtrain.memory.meter import mark_host
from memtrain.units import format_bytes

# Optimizer state elements per parameter element, for the host-RAM check.
STATE_PER_PARAM: dict[str, float] = {"AdamW": 2.0, "SGD": 1.0, "Adafactor": 0.1}
HOST_RAM_MARGIN = 0.9


class _SyncStream:
    """Stands in for a CUDA stream and its events on CPU, where copies are synchronous."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self) -> _SyncStream:
        return self

    def synchronize(self) -> None:
        return None


class OffloadOptimizer(CPUOffloadOptimizer):
    """torchao's CPU-offload optimizer, with gradient clipping and a CPU-only mode.

    Args:
        params: parameters or parameter groups (as for any torch optimizer).
        optimizer_class: the optimizer run on the host copies (AdamW, SGD, Adafactor, ...).
        minimal_size: parameters with fewer elements stay on the device with their state.
        **kwargs: passed to ``optimizer_class`` (lr, betas, weight_decay...).
    """

    def __init__(self, params: Any,
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, minimal_size: int = 4096, **kwargs: Any) -> None:
        items = list(params)
        groups = ([dict(g) for g in items] if items and isinstance(items[0], dict)
                  else [{"params": items}])
        for group in groups:
            group["params"] = list(group["params"])  # may be a generator, read more than once
        first = next((p for g in groups for p in g["params"]), None)
        params = [p for g in groups for p in g["params"]]
        before = {p: set(post_accumulate_grad_hooks(p) or ()) for p in params}
        if first is not None and first.device.type == "cpu":
            self._init_on_cpu(groups, optimizer_class, minimal_size, kwargs)
        else:
            super().__init__(groups, optimizer_class, offload_gradients=False,
                             minimal_size=minimal_size, **kwargs)
        # torchao keeps no handles to its gradient hooks: remember the ones it added, by id
        self._hook_ids = {p: set(post_accumulate_grad_hooks(p) or ()) - before[p] for p in params}
        self._host_grad_scale: torch.Tensor | None = None

    def _init_on_cpu(self, groups: list[dict[str, Any]],
                     optimizer_class: type[torch.optim.Optimizer], minimal_size: int,
                     kwargs: dict[str, Any]) -> None:
        """torchao's ``__init__`` for a CPU "device": plain host copies, synchronous hooks."""
        if optimizer_class is torch.optim.AdamW and "fused" not in kwargs:
            kwargs.update(fused=True)  # as torchao does: the fused CPU AdamW kernel
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        self.minimal_size, self.d_opt, self.d_param_groups = minimal_size, None, []
        self.param_d2h_map: dict[torch.Tensor, torch.Tensor] = {}
        self.optim_dict: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.device, self.stream, self.queue = "cpu", _SyncStream(), {}
        for group in groups:
            retained = []
            for p in group.pop("params"):
                if not p.requires_grad:
                    continue
                if p.numel() < minimal_size:
                    retained.append(p)
                    continue
                p_host = p.detach().clone()
                p_host.grad = torch.zeros_like(p_host)
                self.param_d2h_map[p] = p_host
                p.register_post_accumulate_grad_hook(self._grad_to_host)
                self.optim_dict[p] = optimizer_class([{"params": p_host, **group}], **kwargs)
            if retained:
                self.d_param_groups.append({"params": retained, **group})
        if self.d_param_groups:
            self.d_opt = optimizer_class(self.d_param_groups, **kwargs)

    def _grad_to_host(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        self.param_d2h_map[p].grad.copy_(p.grad)
        mark_host(self.param_d2h_map[p].grad)  # the copy is written under an active meter
        self.queue.pop(p, None)  # re-queued at the end, as torchao does for accumulation
        self.queue[p] = self.stream.record_event()

    def remove_hooks(self) -> None:
        """Unregister the gradient hooks and drop the host copies (an optimizer that is thrown away).

        The hooks hold this optimizer: without this, a dropped optimizer (the auto-fit probe's)
        would stay alive with its host state and copy every gradient to the host a second time.
        """
        for p, ids in self._hook_ids.items():
            hooks = post_accumulate_grad_hooks(p)
            for hook_id in ids:
                if hooks is not None:
                    hooks.pop(hook_id, None)
        self._hook_ids = {}
        self.param_d2h_map, self.optim_dict, self.queue = {}, {}, {}

    # ------------------------------------------------------------------------------ clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients the step will use to total norm ``max_norm``; return the norm.

        The norm comes from the device gradients (complete after backward). Device-resident
        parameters are clipped in place; offloaded ones have their host copies scaled at the
        start of :meth:`step`, after the copies have landed.
        """
        params = [*self.param_d2h_map, *(p for g in self.d_param_groups for p in g["params"])]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        norm = torch.nn.utils.get_total_norm(grads)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        retained = [p.grad for g in self.d_param_groups for p in g["params"] if p.grad is not None]
        if retained:
            foreach_mul_(retained, coef.to(retained[0].device))
        self._host_grad_scale = coef
        return norm

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Apply a pending clip to the host gradients, then torchao's step.

        Parameters whose device gradient was dropped after backward (``zero_grad`` between
        backward and step, as memtrain's NaN guard does) are skipped, as a torch optimizer
        skips parameters without a gradient: their host copy is stale.
        """
        self.queue = {p: event for p, event in self.queue.items() if p.grad is not None}
        if self._host_grad_scale is not None:
            self.stream.synchronize()  # every gradient copy has landed on the host
            coef = self._host_grad_scale.to("cpu")
            host_grads = [self.param_d2h_map[p].grad for p in self.queue]
            if host_grads:
                foreach_mul_(host_grads, coef)
            self._host_grad_scale = None
        loss = super().step(closure)
        for tensor in self.host_tensors():  # state created by this step is host memory too
            mark_host(tensor)
        return loss

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The live groups of every inner optimizer (what LR schedulers must change).

        torchao returns its own list of the device-resident groups, which goes stale once the
        on-device optimizer's ``load_state_dict`` replaces its group dicts (accelerate does that
        when it wraps the optimizer): a scheduler would then never reach those parameters.
        """
        device_groups = self.d_opt.param_groups if self.d_opt is not None else []
        return sum((optim.param_groups for optim in self.optim_dict.values()), start=device_groups)

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """Every inner optimizer's state (host copies as keys for offloaded parameters).

        torchao never sets ``state``; memory trackers (torch's MemTracker, memtrain's meter) read
        it to find optimizer tensors.
        """
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for optim in [*self.optim_dict.values(), *([self.d_opt] if self.d_opt else [])]:
            merged.update(optim.state)
        return merged

    # ---------------------------------------------------------------------------- accounting

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer keeps in host memory: copies of params and grads, state."""
        out: list[torch.Tensor] = []
        for p_host in self.param_d2h_map.values():
            out += [p_host, p_host.grad]
        for optim in self.optim_dict.values():
            for state in optim.state.values():
                out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def host_bytes(self) -> int:
        """Bytes of :meth:`host_tensors` (unique storages)."""
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                    for t in self.host_tensors()}
        return sum(storages.values())


def host_bytes_needed(params: list[nn.Parameter], optimizer_class: type, minimal_size: int = 4096
                      ) -> int:
    """Host bytes an :class:`OffloadOptimizer` will hold: copies of params and grads, and state."""
    state = STATE_PER_PARAM.get(optimizer_class.__name__, 2.0)
    moved = [p for p in params if p.requires_grad and p.numel() >= minimal_size]
    return int(sum(p.numel() * p.element_size() * (2 + state) for p in moved))


def build(groups: list[dict[str, Any]], optimizer_class: type, kwargs: dict[str, Any],
          available: int | None = None, field: str = "host RAM") -> OffloadOptimizer:
    """An :class:`OffloadOptimizer` for the Trainer's parameter groups, after checking host RAM:
    ``available`` bytes (the run's ``memory.host_budget``, named by ``field``; default the free RAM).

    Raises:
        MemtrainError: the optimizer is not one that runs per parameter on the CPU, or host RAM
            cannot hold the copies and the state.
    """
    if optimizer_class.__module__.startswith("bitsandbytes"):
        raise MemtrainError(
            f"`memory.offload.optimizer` cannot offload {optimizer_class.__name__} (bitsandbytes "
            "8-bit/paged optimizers manage their own state). Fix: use `training.optimizer: adamw` "
            "with offload, or keep the 8-bit optimizer and set `memory.offload.optimizer: false`."
        )
    params = [p for g in groups for p in g["params"]]
    needed = host_bytes_needed(params, optimizer_class)
    available = host_free_bytes() if available is None else available
    if needed > HOST_RAM_MARGIN * available:
        raise MemtrainError(
            f"`memory.offload.optimizer`: the host copies of {len(params)} parameter tensors, "
            f"their gradients and {optimizer_class.__name__} state need {format_bytes(needed)}, "
            f"but the {field} is {format_bytes(available)} ({HOST_RAM_MARGIN:.0%} of it may be used). "
            "Fix: raise `memory.host_budget` if the machine has more, train fewer parameters "
            "(`adapter.method: lora`), use `training.optimizer: adafactor`, or set "
            "`memory.offload.optimizer: false`."
        )
    return OffloadOptimizer(groups, optimizer_class, **kwargs)
