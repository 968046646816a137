"""Measure what a training step really holds: peak live tensor bytes by category and phase.

Built on torch's dispatch-level ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which
sees every tensor an op creates and sorts it into parameters, buffers, gradients, activations
(created in forward), temporaries (created in backward) and optimizer state. It works on CPU, on
CUDA and under ``FakeTensorMode`` (the estimator traces fake steps with it). memtrain adds:

- per-phase peaks (forward / backward / optimizer) with the category split at each peak, and a
  ``generation`` phase for text generated inside a step (GRPO's completions; :func:`generating`);
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

The trackers themselves (and the category names) are in :mod:`memtrain.memory.trackers`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from memtrain._compat.torch_distributed import fsdp_device
from memtrain._compat.torch_trackers import TOTAL_KEY, FSDPRefType, MemRefType
from memtrain.device import kept_on_host, model_device
from memtrain.memory.quantized import quantization_state_tensors
from memtrain.memory.trackers import (
    PHASES,
    FSDPTracker,
    Tracker,
    host_key,
)

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
    # (rows, tokens) of the step's largest micro-batch, if known; GRPO's: (completions, prompt
    # tokens, completion tokens) of the generated batch
    batch: tuple[int, ...] | None = None
    accumulation: int | None = None  # micro-batches per optimizer step when it ran, if known
    failed_attempt: bool = False  # the step ran out of memory once and was redone in pieces
    before_optimizer_state: bool = False  # the step began before the optimizer had any state

    def to_dict(self, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready dict (the timeline only when asked: it can be long)."""
        out = asdict(self)
        if not timeline:
            out.pop("timeline")
        return out


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
        host = host_key(self.device)
        self._tracker: Tracker | FSDPTracker = (
            FSDPTracker(model, optimizer, self.device, host, timeline) if isinstance(model, FSDPModule)
            else Tracker(self.device, host, timeline))
        self._external = [x for x in (model, optimizer) if x is not None]
        if inputs is not None:
            self._external.extend(t for t in _tensors(inputs))
        self._token: contextvars.Token | None = None
        self._result: StepMemory | None = None

    def __enter__(self) -> MemoryMeter:
        if self._external:
            self._tracker.track_external(*self._external)
        fsdp = isinstance(self._tracker, FSDPTracker)
        param_ref = FSDPRefType.SHARDED_PARAM if fsdp else MemRefType.PARAM
        for obj in self._external:  # bitsandbytes keeps quantization constants outside parameters
            if isinstance(obj, nn.Module):
                for tensor in quantization_state_tensors(obj):
                    self._tracker.track_tensor(tensor, param_ref)
        for tensor in _host_tensors(self._external):  # an offloaded optimizer's host copies
            self._tracker.track_tensor(tensor, MemRefType.OPT)
            self._tracker.move_to_host(tensor)
        for obj in self._external:  # weights a patch keeps in host memory (offloaded embeddings)
            if isinstance(obj, nn.Module):
                for param in obj.parameters():
                    if kept_on_host(param):  # pinned on CUDA (embedding_offload)
                        self._tracker.move_to_host(param, self.for_cuda())
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

    def mark_host(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """Count ``tensor``'s storage as host memory from now on (offloaded copies); ``pinned``: at
        the power of two CUDA's pinned allocator rounds it to (:func:`pinned_bytes`)."""
        self._tracker.move_to_host(tensor, pinned)

    def for_cuda(self) -> bool:
        """Whether this meter measures a CUDA step, or traces one on fake tensors for CUDA."""
        return self.device.type == "cuda" or bool(getattr(self._tracker, "cuda_kernels", False))

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
            peak_bytes=int(peak_snap.get(TOTAL_KEY, sum(peak.values()))),
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


def mark_host(tensor: torch.Tensor, pinned: bool = False) -> None:
    """Tell the active meter (if any) that ``tensor`` lives in host memory (for offload code);
    ``pinned``: it is (or, in a trace for CUDA, stands for) pinned memory."""
    meter = _ACTIVE.get()
    if meter is not None:
        meter.mark_host(tensor, pinned)


def traced_for_cuda() -> bool:
    """Whether the active meter traces a step that stands for a CUDA run on fake tensors (an estimate
    for ``--device cuda`` traced on a CPU): code whose CUDA path allocates more than its CPU path
    (the activation offload's prefetch) allocates it there too, so the trace counts it."""
    meter = _ACTIVE.get()
    return meter is not None and bool(getattr(meter._tracker, "cuda_kernels", False))


@contextlib.contextmanager
def generating() -> Iterator[None]:
    """Inside, the active meter (if any) files every op under the ``generation`` phase: the text
    generation a GRPO step runs before its loss (its KV cache and sampling tensors), told apart from
    the training step's forward and backward."""
    meter = _ACTIVE.get()
    tracker = meter._tracker if meter is not None else None
    if tracker is not None:
        tracker.generating += 1
    try:
        yield
    finally:
        if tracker is not None:
            tracker.generating -= 1


def _host_tensors(objects: list[Any]) -> list[torch.Tensor]:
    """Tensors that objects (e.g. ``memtrain.trainer.optimizer_offload.OffloadOptimizer``, also wrapped by
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
        return fsdp_device(model)
    return model_device(model) if model is not None else torch.device("cpu")


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
