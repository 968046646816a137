"""Memory budgets: parse ``memory.budget`` and ``memory.host_budget`` (:class:`HostBudget`), detect
free device memory, simulate a budget on CPU.

:class:`SimulatedBudget` raises the framework's own out-of-memory error
(``torch.OutOfMemoryError``, what CUDA raises) as soon as the live tensor bytes it tracks exceed a
limit (on a CPU, offloaded "host" tensors count too: they live in the same RAM). With it, auto-fit
and out-of-memory recovery run for real on a machine without a GPU: the code under test sees
exactly the exception a GPU would raise, at the op that would have failed.
It counts tensor bytes as the meter does (no allocator caching or fragmentation).

With several processes it *defers* instead (``defer=True``): it notes the first op that crossed
the limit and lets the micro-batch finish, and the processes compare notes after it
(:mod:`memtrain.reliability.recovery`, :func:`memtrain.plan.autofit.confirm`). An error raised at
the op in one
process would leave the others waiting in a collective (an FSDP all-gather or reduce-scatter,
DDP's all-reduce) that process never joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from memtrain._compat.torch_trackers import TOTAL_KEY
from memtrain.config import MemoryConfig
from memtrain.device import AllocatorBudget, compute_device, host_budget_bytes, host_free_bytes
from memtrain.memory.trackers import Tracker, host_key
from memtrain.units import format_bytes, parse_size


def device_free_bytes(device: torch.device | str | None = None) -> int:
    """Free memory of the compute device: CUDA's free bytes, or available RAM on CPU."""
    device = torch.device(device) if device is not None else compute_device()
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return host_free_bytes()


def resolve_budget(budget: str | None, device: torch.device | str | None = None) -> int | None:
    """``memory.budget`` in bytes: ``auto`` detects the free memory, None means no budget."""
    if budget is None:
        return None
    if budget == "auto":
        return device_free_bytes(device)
    return parse_size(budget)


def usable_bytes(budget: int, margin: float) -> int:
    """What plans may use of a budget: the safety margin is kept free."""
    return int(budget * (1.0 - margin))


@dataclass(frozen=True)
class HostBudget:
    """``memory.host_budget``: the host RAM a plan may keep (offloaded activations, an offloaded
    optimizer's state and host copies, offloaded embeddings), less the margin.

    Attributes:
        setting: the field as written (``auto`` or a size).
        total: its bytes (``auto``: the host RAM free when it was resolved).
        margin: the fraction kept free (``memory.margin``).
    """

    setting: str
    total: int
    margin: float

    @classmethod
    def of(cls, memory: MemoryConfig) -> HostBudget:
        """The recipe's host budget, resolved now."""
        return cls(memory.host_budget, host_budget_bytes(memory.host_budget), memory.margin_fraction)

    @property
    def usable(self) -> int:
        return usable_bytes(self.total, self.margin)

    def fits(self, needed: int) -> bool:
        return needed <= self.usable

    def shortfall(self, needed: int) -> str:
        """Why ``needed`` host bytes do not fit, and what to change."""
        said = (f"{format_bytes(self.total)} free on this machine" if self.setting == "auto"
                else format_bytes(self.total))
        return (f"host RAM {format_bytes(needed)} needed, `memory.host_budget` {self.setting} = {said} "
                f"({format_bytes(self.usable)} usable with the {self.margin:.0%} margin, `memory.margin`). "
                f"Fix: raise `memory.host_budget` to at least "
                f"{format_bytes(int(needed / (1 - self.margin)) + 1)} if the machine has it, keep less on "
                "the host (`memory.offload.activations`, `memory.offload.optimizer` or "
                "`memory.offload.embeddings` false, or `auto`), or lower `training.micro_batch_size` "
                "or `data.max_length`.")


class _BudgetTracker(Tracker):
    def __init__(self, device: torch.device, limit: int, defer: bool = False) -> None:
        host = host_key(device)
        super().__init__(device, host, timeline=False)
        self.limit = limit
        self.defer = defer
        self.overrun: str | None = None  # deferred: the first crossing since it was last taken

    def live(self) -> int:
        """Live bytes that count against the limit: on a CPU also the offloaded ones (same RAM)."""
        snap = self.current_snapshot
        live = snap.get(self.compute_device, {}).get(TOTAL_KEY, 0)
        if self.compute_device.type == "cpu":
            live += snap.get(self.host_device, {}).get(TOTAL_KEY, 0)
        return int(live)

    def on_peak_update(self, peak_state: Any) -> None:
        # Only the device total and its peak: nothing reads the meter's phase and category
        # bookkeeping here, and it ran after every op of a guarded step.
        live = self.live()
        if live > self.peak_by_device.get(self.compute_device, 0):
            self.peak_by_device[self.compute_device] = live
        if live > self.limit:
            # The wording CUDA's allocator uses, so that code which recognises an out-of-memory
            # error by its message (accelerate's find_executable_batch_size) sees this one too.
            message = (f"Simulated: tried to allocate past the budget, device out of memory. "
                       f"{format_bytes(live)} of live tensors exceed the simulated budget of "
                       f"{format_bytes(self.limit)} (memory.simulate_budget).")
            if not self.defer:
                raise torch.OutOfMemoryError(message)
            self.overrun = self.overrun or message


class SimulatedBudget:
    """Context manager: raise ``torch.OutOfMemoryError`` when live tensor bytes exceed ``limit``.

    Args:
        limit: bytes, or a size like ``"2GiB"``.
        track: modules, optimizers or tensors created before entering that count from the start.
        device: the compute device whose bytes count (default: CUDA if present, else CPU).
        defer: note the first crossing (:meth:`take_overrun`) instead of raising at that op (for
            several processes, see the module docstring).
    """

    def __init__(self, limit: int | str, *track: Any, device: torch.device | str | None = None,
                 defer: bool = False) -> None:
        self.limit = parse_size(limit)
        device = torch.device(device) if device is not None else compute_device()
        if device.type == "cpu":  # CPU tensors carry no index; a launched process's args.device does
            device = torch.device("cpu")
        self._tracker = _BudgetTracker(device, self.limit, defer)
        self._tracked_objects = [t for t in track if t is not None]

    def __enter__(self) -> SimulatedBudget:
        if self._tracked_objects:
            self._tracker.track_external(*self._tracked_objects)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)

    @property
    def live_bytes(self) -> int:
        return self._tracker.live()

    @property
    def peak_bytes(self) -> int:
        return int(self._tracker.peak_by_device.get(self._tracker.compute_device, 0))

    def take_overrun(self) -> str | None:
        """With ``defer``: the error the first crossing since the last call would have raised, else
        None; the next call starts afresh."""
        message, self._tracker.overrun = self._tracker.overrun, None
        return message


def budget_guard(limit: int, *track: Any, device: torch.device | None = None,
                 simulated: bool = False, defer: bool = False) -> SimulatedBudget | AllocatorBudget:
    """What enforces ``limit`` for a step: the allocator itself on CUDA (reserved memory and the
    context, :class:`memtrain.device.AllocatorBudget`), live tensor bytes on a CPU or when the
    budget is a simulated one (``memory.simulate_budget``: tensor bytes on every device).

    Both raise ``torch.OutOfMemoryError`` when the step goes over and report ``peak_bytes``.
    ``defer`` (several processes, see the module docstring): live tensor bytes on every device,
    noted rather than raised; the allocator's cap cannot wait for the end of the step.
    """
    device = device or compute_device()
    if device.type == "cuda" and not simulated and not defer:
        return AllocatorBudget(limit, device)
    return SimulatedBudget(limit, *track, device=device, defer=defer)


class HeldBudget:
    """A :class:`SimulatedBudget` held for a training run: entered when training begins, left
    around evaluation (:meth:`paused`), left for good by :meth:`close`. The one lifecycle of
    ``memtrain train``'s :class:`SimulatedBudgetCallback` and the plugin's callback."""

    def __init__(self, limit: int | str, defer: bool = False) -> None:
        self.limit, self.defer = limit, defer
        self.active: SimulatedBudget | None = None
        self._tracked: tuple[Any, Any, Any] = (None, None, None)

    def start(self, model: torch.nn.Module | None, optimizer: Any, device: torch.device) -> None:
        """Hold the budget over ``model`` and the optimizer's state (a Trainer's optimizer may be
        accelerate's wrapper: its inner one is tracked). Leaves a budget still held first (a
        training loop restarted by ``auto_find_batch_size`` never ended)."""
        self.close()
        inner = getattr(optimizer, "optimizer", optimizer)
        opt = inner if isinstance(inner, torch.optim.Optimizer) else None
        self._tracked = (model, opt, device)
        self._enter()

    def _enter(self) -> None:
        model, optimizer, device = self._tracked
        self.active = SimulatedBudget(self.limit, model, optimizer, device=device, defer=self.defer)
        self.active.__enter__()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No limit inside (evaluation: the budget limits training steps; tracking every op would
        also slow evaluation several times over); held again after."""
        if self.active is None:
            yield
            return
        self.close()
        try:
            yield
        finally:
            self._enter()

    def close(self) -> None:
        """Leave the budget (also after training stopped with an exception)."""
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.active = None


class SimulatedBudgetCallback(TrainerCallback):
    """Keep a :class:`SimulatedBudget` active from the start to the end of training (:class:`HeldBudget`).

    With several processes the budget defers (see the module docstring): out-of-memory recovery
    takes what it noted after every micro-batch (:meth:`take_overrun`); a crossing outside the
    micro-batches (the optimizer step) makes every process raise together at the end of the step.
    """

    def __init__(self, limit: int | str) -> None:
        self.limit = limit
        self.held = HeldBudget(limit)

    @property
    def budget(self) -> SimulatedBudget | None:
        """The budget held now (None outside training and during evaluation)."""
        return self.held.active

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.held.defer = getattr(args, "world_size", 1) > 1
        self.held.start(model, optimizer, args.device)

    def take_overrun(self) -> str | None:
        """What the deferring budget noted since the last call (None: nothing, or not deferring)."""
        return self.budget.take_overrun() if self.budget is not None else None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if not self.held.defer:
            return
        from memtrain.distributed.together import flagged_ranks

        message = self.take_overrun()
        ranks = flagged_ranks(message is not None, args.device)  # every process, every step
        if ranks:
            raise torch.OutOfMemoryError(
                f"{message or 'Simulated: device out of memory.'} (process(es) {ranks} of "
                f"{args.world_size}, outside the micro-batches: in the optimizer step)")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """No limit inside (evaluation), held again after (:meth:`HeldBudget.paused`)."""
        return self.held.paused()

    def close(self) -> None:
        """Leave the budget (also after training stopped with an exception)."""
        self.held.close()
