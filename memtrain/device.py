"""Where memtrain computes, and what that device's allocator says: the one device decision.

Training, tuning (``plan --tune``), measurement, calibration, estimation (its default
``--device``), the auto-fit probe and the budget checks all ask here, so a CUDA machine never
times one candidate on the CPU and another on the GPU.

On CUDA what runs out is the caching allocator's reserved memory plus the CUDA context, not the
tensor bytes: :class:`AllocatorBudget` caps the allocator (``set_per_process_memory_fraction``) so
that a step over the budget raises the real ``torch.OutOfMemoryError`` at the allocation that
crosses it, and reports the allocator's reserved peak. On a CPU there is no allocator to ask: budgets
there are enforced on live tensor bytes (:class:`memtrain.reliability.budget.SimulatedBudget`).

The allocator's settings (expandable segments, :mod:`memtrain.allocator`) are applied here too
(:func:`configure_allocator`).

Host RAM is asked here too (:func:`host_free_bytes`, :func:`host_budget_bytes`): offloaded
activations, an offloaded optimizer and offloaded embeddings live there, under ``memory.host_budget``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from memtrain import allocator
from memtrain.units import parse_size


def configure_allocator() -> str:
    """memtrain's allocator settings (:mod:`memtrain.allocator`) for this process and the ones it
    starts, unless the user chose their own; returns the settings in effect. Where this process
    already uses CUDA (a user's script calling the plugin after moving a model), they are also
    applied to the running allocator, for the segments it maps from now on."""
    chosen_by_user = bool(os.environ.get(allocator.ENV))
    settings = allocator.set_default()
    if not chosen_by_user and cuda_available() and torch.cuda.is_initialized():
        from memtrain._compat.torch_tools import set_allocator_settings

        set_allocator_settings(settings)  # a torch without the setter: nothing applied, as before
    return settings


def cuda_available() -> bool:
    """Whether this process computes on a CUDA device."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device this process computes on: its local rank's GPU (launchers set ``LOCAL_RANK``),
    the current GPU, or the CPU."""
    if not cuda_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def device_type() -> str:
    """``"cuda"`` or ``"cpu"``: what estimates and plans assume when no device is given."""
    return compute_device().type


def host_free_bytes() -> int:
    """Host RAM available to new allocations without swapping: psutil's ``available``, else the
    kernel's own estimate (``MemAvailable`` in /proc/meminfo)."""
    try:
        import psutil
    except ImportError:  # psutil is a dependency; a stripped environment still has /proc
        return _meminfo_available()
    return int(psutil.virtual_memory().available)


def _meminfo_available(path: str = "/proc/meminfo") -> int:
    with open(path, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    raise OSError(f"{path} has no MemAvailable line: cannot tell the free host RAM")


def host_budget_bytes(setting: str) -> int:
    """``memory.host_budget`` in bytes: ``auto`` is the host RAM free now (:func:`host_free_bytes`)."""
    return host_free_bytes() if setting == "auto" else parse_size(setting)


_ON_HOST = "_memtrain_on_host"  # set on a parameter that a patch keeps in host memory


def keep_on_host(param: nn.Parameter, kept: bool = True) -> None:
    """Mark ``param`` as kept in host memory on purpose (``memory.offload.embeddings``): the memory
    meter counts it as host bytes, and :func:`model_device` looks past it. ``kept=False`` unmarks."""
    if kept:
        setattr(param, _ON_HOST, True)
    else:
        param.__dict__.pop(_ON_HOST, None)


def kept_on_host(tensor: torch.Tensor) -> bool:
    """Was ``tensor`` marked by :func:`keep_on_host`?"""
    return bool(getattr(tensor, _ON_HOST, False))


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its first parameter not kept on the host (CPU for
    a model without parameters)."""
    first = next((p for p in model.parameters() if not kept_on_host(p)), None)
    return first.device if first is not None else torch.device("cpu")


def place(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Move a model to the compute device, as the Trainer does before training.

    Models ``from_pretrained`` placed with a device map (bitsandbytes' quantized ones) stay where
    they are; so do models already on the device.
    """
    device = device or compute_device()
    if getattr(model, "hf_device_map", None) or device.type == "cpu":
        return model
    first = next((p for p in model.parameters() if not kept_on_host(p)), None)
    if first is not None and first.device != device:
        model.to(device)
    return model


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (timings on CUDA measure nothing without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def outside_allocator_bytes(device: torch.device) -> int:
    """Device memory this process uses outside the caching allocator: the CUDA context, cuBLAS
    workspaces, ... (device used minus reserved; other processes on the same GPU count too, which
    errs on the safe side)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total - free) - int(torch.cuda.memory_reserved(device)))


def allocator_fraction(limit: int, total: int, outside: int) -> float:
    """The ``set_per_process_memory_fraction`` that keeps reserved + ``outside`` under ``limit``.

    Raises:
        ValueError: the limit does not even hold what lives outside the allocator.
    """
    if limit <= outside:
        raise ValueError(f"a budget of {limit} bytes is used up by the {outside} bytes the CUDA context "
                         "and libraries hold before any tensor")
    return min(1.0, (limit - outside) / total)


class AllocatorBudget:
    """On CUDA: cap the caching allocator so reserved memory + the context stay under ``limit``.

    A step that needs more raises ``torch.OutOfMemoryError`` at the allocation that does not fit
    (after the allocator has freed its cached blocks and retried, as on a full GPU). On exit the
    cap is lifted and cached blocks are returned, so the next measurement starts clean.

    Args:
        limit: bytes the whole process may use on the device (tensors, cache and context).
        device: a CUDA device.
    """

    def __init__(self, limit: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"AllocatorBudget needs a CUDA device, got {device}")
        self.limit, self.device = int(limit), device
        self.outside = 0

    def __enter__(self) -> AllocatorBudget:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.outside = outside_allocator_bytes(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(self.limit, total, self.outside),
                                                   self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        torch.cuda.empty_cache()

    @property
    def peak_bytes(self) -> int:
        """Reserved peak plus what lives outside the allocator: the process's device peak."""
        return int(torch.cuda.max_memory_reserved(self.device)) + self.outside
