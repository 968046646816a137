"""Exact live tensor bytes on CPU, split into device and host (offloaded) bytes.

A small dispatch-mode tracker for the checkpointing/offload tests and benchmark: every storage an
op creates is counted until it is freed. Bytes an offload ledger holds are host bytes, the rest is
device. (memtrain's MemoryMeter does the same with categories; this stays independent of it.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
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
