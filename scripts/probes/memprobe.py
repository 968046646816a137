"""Measure a training step's memory without memtrain's meter: the benchmarks' "measured" side.

A benchmark that compares memtrain's prediction with a measurement made by memtrain's own meter
checks the two against each other, not against the machine: a counting mistake shared by both
would never show. This module shares no code with ``memtrain.memory`` (it imports nothing from
memtrain), so the benchmarks (``scripts/bench_*.py``, which import it as ``memprobe``) and the
tests (``from scripts.probes.memprobe import LiveBytes``) measure independently:

- :class:`LiveBytes`: exact live tensor bytes on CPU, split into device and host (offloaded)
  bytes. A dispatch mode counts every storage an op creates until it is freed, and follows
  storages that are resized in place (``UntypedStorage.resize_``, as FSDP2 frees and regathers
  weights; ``Tensor.resize_`` and ``out=`` ops). Host bytes are the storages a saved-tensor pack
  hook creates (``torch.autograd.graph.saved_tensors_hooks``: what activation offload, torch's
  ``save_on_cpu`` among them, moves off the device), known from torch, not from the offload
  code's own bookkeeping; the rest is device. It works on fake tensors too (their storages have
  sizes), which is how a benchmark counts a trace with the same counter.
- :func:`resident`: the bytes a step finds already allocated (parameters, buffers, bitsandbytes
  quantization constants, optimizer state, the batch), counted once per storage;
  :func:`host_resident`: those an optimizer keeps as copies apart from the model (an offloading
  optimizer's host copies of parameters, their gradients and state).
- :func:`trainer_steps`: a ``transformers.TrainerCallback`` that counts every optimizer step of a
  real ``Trainer`` run (the Trainer's own steps: its ``training_step``, clipping, optimizer and
  scheduler steps, ``zero_grad``) with :class:`LiveBytes` plus :func:`resident`.
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


class _Cell:
    """What the counter knows of one storage: bytes it counts for it, its size when last seen,
    and whether it is host memory."""

    __slots__ = ("counted", "host", "seen")

    def __init__(self, counted: int, seen: int, host: bool) -> None:
        self.counted, self.seen, self.host = counted, seen, host


class LiveBytes(TorchDispatchMode):
    """Counts storages created (or resized) inside it; ``device_peak`` excludes host bytes.

    Storages that existed before it started are never counted (the caller adds them, see
    :func:`resident`), except by what a resize inside it changes (an FSDP2 parameter freed to 0
    bytes and gathered again), and :meth:`adopt` counts tensors that appear without an op.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0  # device and host
        self.host_current = 0
        self.device_peak = 0
        self.host_peak = 0
        self.peak = 0  # device and host together (on a CPU both are the same RAM)
        self._cells: Any = WeakIdKeyDictionary()  # storage -> _Cell
        self._packing = 0  # > 0 while a saved-tensor pack hook runs
        self._patched: list[tuple[Any, str, Any]] = []

    @property
    def device_current(self) -> int:
        return self.current - self.host_current

    def reset_peak(self) -> None:
        self.device_peak, self.host_peak, self.peak = self.device_current, self.host_current, self.current

    def __enter__(self) -> LiveBytes:
        self._patch(torch.UntypedStorage, "resize_", self._resize_wrapper)
        self._patch(torch.autograd.graph.saved_tensors_hooks, "__enter__", self._hooks_wrapper)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        while self._patched:
            owner, name, own, wrapper = self._patched.pop()
            if owner.__dict__.get(name) is not wrapper:
                continue  # replaced since: torch's MemTracker, entered first and left first,
                # put back what it found; keep that
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        super().__exit__(*exc)

    def adopt(self, tensors: Iterable[Any]) -> int:
        """Count tensors that exist without an op having made them here (a batch the caller
        made before the counter started), unless they are counted already; the bytes added."""
        before = self.current
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self._update_peaks()
        return self.current - before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share an input's storage: only new storages are counted
        # (so parameters and inputs made before the tracker started are never counted), and a
        # counted storage an op resized (``Tensor.resize_``, ``out=``) is counted at its new size.
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if id(storage) not in inputs:
                    self._track(storage)
                elif storage in self._cells:
                    self._resized(storage, self._cells[storage])
        self._update_peaks()
        return out

    # -------------------------------------------------------------------------- bookkeeping

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._cells:
            return
        nbytes = storage.nbytes()
        cell = _Cell(nbytes, nbytes, self._packing > 0)
        self._cells[storage] = cell
        self._add(cell, nbytes)
        weakref.finalize(storage, self._free, cell)

    def _resized(self, storage: torch.UntypedStorage, cell: _Cell) -> None:
        nbytes = storage.nbytes()
        if nbytes != cell.seen:
            self._add(cell, nbytes - cell.seen)
            cell.counted += nbytes - cell.seen
            cell.seen = nbytes

    def _add(self, cell: _Cell, nbytes: int) -> None:
        self.current += nbytes
        if cell.host:
            self.host_current += nbytes

    def _free(self, cell: _Cell) -> None:
        self._add(cell, -cell.counted)

    def _update_peaks(self) -> None:
        self.device_peak = max(self.device_peak, self.device_current)
        self.host_peak = max(self.host_peak, self.host_current)
        self.peak = max(self.peak, self.current)

    # ------------------------------------------------------ what no dispatch mode sees

    def _patch(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        own = owner.__dict__.get(name)  # None: inherited (from torch's C base), deleted again on exit
        wrapper = wrap(getattr(owner, name))
        self._patched.append((owner, name, own, wrapper))
        setattr(owner, name, wrapper)

    def _resize_wrapper(self, original: Any) -> Any:
        """``UntypedStorage.resize_`` runs below the dispatcher (FSDP2 frees and regathers
        weights with it), as torch's own ``MemTracker`` also notes: follow the new size. A
        storage made before the counter started is counted by what the resize adds (or frees)."""
        probe = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            out = original(storage, size)
            cell = probe._cells.get(storage)
            if cell is None:
                cell = _Cell(0, before, probe._packing > 0)
                probe._cells[storage] = cell
                weakref.finalize(storage, probe._free, cell)
            if cell is not None:
                probe._resized(storage, cell)
                probe._update_peaks()
            return out

        return resize_

    def _hooks_wrapper(self, original: Any) -> Any:
        """``saved_tensors_hooks.__enter__``: storages its pack hook creates are host memory."""
        probe = self

        def __enter__(hooks: Any) -> Any:
            pack = hooks.pack_hook

            def counted_pack(tensor: torch.Tensor) -> Any:
                probe._packing += 1
                try:
                    return pack(tensor)
                finally:
                    probe._packing -= 1

            hooks.pack_hook = counted_pack  # what the original pushes; then the hooks' own again
            try:
                return original(hooks)
            finally:
                hooks.pack_hook = pack

        return __enter__


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


def _optimizer_copies(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """Tensors an optimizer steps that are not the model's parameters (an offloading optimizer's
    host copies), with their gradients and optimizer state."""
    if optimizer is None:
        return []
    own = {id(p) for p in model.parameters()}
    copies = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    out = [*copies, *(p.grad for p in copies)]
    for p in copies:
        out += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return out


def resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, batch: dict,
             device_type: str = "cpu") -> int:
    """Bytes held before a step: parameters, buffers, quantization constants, optimizer state of
    the model's parameters, batch (an offloading optimizer's copies: :func:`host_resident`)."""
    tensors: list[Any] = [*model.parameters(), *model.buffers(), *batch.values()]
    for param in model.parameters():
        tensors += _quant_tensors(getattr(param, "quant_state", None))
    own = {id(p) for p in model.parameters()}
    for key, state in (optimizer.state.items() if optimizer is not None else []):
        if id(key) in own:
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors, device_type)


def host_resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  device_type: str = "cpu") -> int:
    """Bytes an optimizer holds apart from the model (an offloading optimizer's host copies of
    parameters, their gradients and their state), read from the optimizer's parameter groups."""
    return storage_bytes(_optimizer_copies(model, optimizer), device_type)


def trainer_steps() -> Any:
    """A ``TrainerCallback`` counting every optimizer step of a real ``transformers.Trainer`` run.

    The count of a step runs from ``on_step_begin`` (its batch already loaded) to ``on_step_end``
    (after the optimizer step, the scheduler step and ``zero_grad``): the Trainer's own
    ``training_step`` with its loss bookkeeping, clipping and optimizer. What exists at
    ``on_step_begin`` is :func:`resident` (model, optimizer state) and :func:`host_resident`; the
    tensors the model's forward is called with (the batch, the Trainer's token count) are adopted
    by :meth:`LiveBytes.adopt` as the forward starts (callbacks are not handed the batch; nothing
    allocates between the two). With gradient accumulation the Trainer loads every micro-batch of
    a step before it begins, and each is counted only from its own forward on.

    ``callback.steps`` gets one dict per step: ``step`` (the global step it ends), ``peak``
    (device bytes at the step's worst moment), ``host_peak``, ``total_peak`` (device and host
    together at their worst moment: what a CPU holds), ``resident`` (at ``on_step_begin``),
    ``inputs`` (the bytes adopted from the forward's arguments).
    """
    from transformers import TrainerCallback

    class TrainerSteps(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, int]] = []
            self._probe: LiveBytes | None = None
            self._held = self._host_held = self._inputs = 0
            self._hook: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          optimizer: Any = None, **kwargs: Any) -> None:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
            inner = inner if isinstance(inner, torch.optim.Optimizer) else None
            device_type = next(model.parameters()).device.type
            self._held = resident(model, inner, {}, device_type)
            self._host_held = host_resident(model, inner)
            probe = self._probe = LiveBytes()
            self._inputs = 0

            def adopt_inputs(module: Any, positional: Any, named: Any) -> None:
                self._inputs += probe.adopt(pytree.tree_leaves((positional, named)))

            self._hook = model.register_forward_pre_hook(adopt_inputs, with_kwargs=True)
            probe.__enter__()
            probe.reset_peak()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            probe = self._probe
            if probe is None:
                return
            probe.__exit__(None, None, None)
            self._hook.remove()
            self._probe = None
            self.steps.append({"step": state.global_step, "peak": self._held + probe.device_peak,
                               "host_peak": self._host_held + probe.host_peak,
                               "total_peak": self._held + self._host_held + probe.peak,
                               "resident": self._held, "inputs": self._inputs})

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._probe is not None:  # a step that raised: leave the dispatch mode
                self._probe.__exit__(None, None, None)
                self._hook.remove()
                self._probe = None

    return TrainerSteps()


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
