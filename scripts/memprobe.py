"""Measure a training step's memory without memtrain's meter: the benchmarks' "measured" side.

A benchmark that compares memtrain's prediction with a measurement made by memtrain's own meter
checks the two against each other, not against the machine: a counting mistake shared by both
would never show. This module shares no code with ``memtrain.memory`` (it imports nothing from
memtrain), so the benchmarks (``scripts/bench_*.py``, which import it as ``memprobe``) and the
tests (``from scripts.memprobe import LiveBytes``) measure independently:

- :class:`LiveBytes`: exact live tensor bytes on CPU, split into device and host (offloaded)
  bytes. A dispatch mode counts every storage an op creates until it is freed; bytes an offload
  ledger holds are host bytes, the rest is device. It works on fake tensors too (their storages
  have sizes), which is how a benchmark counts a trace with the same counter.
- :func:`resident`: the bytes a step finds already allocated (parameters, buffers, bitsandbytes
  quantization constants, optimizer state, the batch), counted once per storage.
- :func:`reset_peak_rss` / :func:`peak_rss` / :func:`current_rss`: the process's resident set
  size and its peak, reset before a step: the operating system's view beside the tensor count
  (it also holds the interpreter, the libraries and memory the allocator keeps, so it is a
  ceiling, never equal to tensor bytes).
- :func:`probe_step`: all of the above around one step.
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Counts storages created inside it; ``device_peak`` excludes ``host_bytes()``."""

    def __init__(self, host_bytes: Callable[[], int] = lambda: 0) -> None:
        super().__init__()
        self.host_bytes = host_bytes
        self.current = 0
        self.device_peak = 0
        self.host_peak = 0
        self._sizes: Any = WeakIdKeyDictionary()

    @property
    def device_current(self) -> int:
        return self.current - self.host_bytes()

    def reset_peak(self) -> None:
        self.device_peak, self.host_peak = self.device_current, self.host_bytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: only new storages are counted
        # (so parameters and inputs made before the tracker started are never counted).
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and id(leaf.untyped_storage()) not in inputs:
                self._track(leaf.untyped_storage())
        self._update_peaks()
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[storage] = nbytes
        self.current += nbytes
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _update_peaks(self) -> None:
        self.device_peak = max(self.device_peak, self.device_current)
        self.host_peak = max(self.host_peak, self.host_bytes())


def storage_bytes(tensors: Iterable[Any], device_type: str = "cpu") -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device_type`` (views counted once).

    Storages are told apart by their C++ object, not their data pointer: a fake tensor's storage
    has no data, so every pointer would be 0.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device_type:
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _quant_tensors(obj: Any, depth: int = 0) -> list[Any]:
    """Tensors inside a bitsandbytes quant_state (absmax, code, nested state2)."""
    if obj is None or depth > 3:
        return []
    out = []
    for value in vars(obj).values() if hasattr(obj, "__dict__") else []:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith("bitsandbytes"):
            out += _quant_tensors(value, depth + 1)
    return out


def resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batch: dict,
             device_type: str = "cpu") -> int:
    """Bytes held before a step: parameters, buffers, quantization constants, optimizer state, batch."""
    tensors: list[Any] = [*model.parameters(), *model.buffers(), *batch.values()]
    for param in model.parameters():
        tensors += _quant_tensors(getattr(param, "quant_state", None))
    for state in (optimizer.state.values() if optimizer is not None else []):
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors, device_type)


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux ``/proc/self/clear_refs``, value 5); False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """Resident set size now, in bytes (``VmRSS``; 0 where ``/proc`` is missing)."""
    return _status_kib("VmRSS:") * 1024


def peak_rss() -> int:
    """Peak resident set size in bytes: ``VmHWM`` (since :func:`reset_peak_rss`), else ``ru_maxrss``."""
    return _status_kib("VmHWM:") * 1024 or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def probe_step(step: Callable[[], None], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 batch: dict) -> dict[str, int]:
    """Run ``step()`` once under the counter; return its peak and the process's RSS beside it.

    ``peak`` is what the step holds at its worst moment: :func:`resident` bytes before it plus the
    peak of the storages it creates. ``rss_before``/``rss_peak`` are the operating system's view
    of the whole process just before the step and at its highest during it.
    """
    held = resident(model, optimizer, batch)
    rss_before = current_rss()
    reset_peak_rss()
    with LiveBytes() as probe:
        probe.reset_peak()
        step()
    return {"peak": held + probe.device_peak, "resident": held, "rss_before": rss_before,
            "rss_peak": peak_rss()}
