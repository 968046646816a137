"""Where memtrain computes, and what that device's allocator says: the one device decision.

Training, tuning (``plan --tune``), measurement, calibration, estimation (its default
``--device``), the auto-fit probe and the budget checks all ask here, so a CUDA machine never
times one candidate on the CPU and another on the GPU.

On CUDA what runs out is the caching allocator's reserved memory plus the CUDA context, not the
tensor bytes: :class:`AllocatorBudget` caps the allocator (``set_per_process_memory_fraction``) so
that a step over the budget raises the real ``torch.OutOfMemoryError`` at the allocation that
crosses it, and reports the allocator's reserved peak. On a CPU there is no allocator to ask: budgets
there are enforced on live tensor bytes (:class:`memtrain.reliability.budget.SimulatedBudget`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


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


def place(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Move a model to the compute device, as the Trainer does before training.

    Models ``from_pretrained`` placed with a device map (bitsandbytes' quantized ones) stay where
    they are; so do models already on the device.
    """
    device = device or compute_device()
    if getattr(model, "hf_device_map", None) or device.type == "cpu":
        return model
    first = next(model.parameters(), None)
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
