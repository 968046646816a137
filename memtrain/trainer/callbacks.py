"""Trainer callbacks a plain ``transformers.Trainer`` user can add: memory measured per step.

``MemoryMeterCallback`` wraps training steps in a :class:`~memtrain.memory.meter.MemoryMeter`
and puts what it measured into the Trainer's own logs (``memory/peak_bytes``,
``memory/<category>``, ...), so TensorBoard, W&B or any other tracker records it.

Why :meth:`MemoryMeterCallback.attach`: the Trainer calls callbacks in list order and puts
reporting integrations before user callbacks, so a callback passed in ``callbacks=[...]`` that adds
keys to ``logs`` in ``on_log`` is too late for them (the keys still reach ``state.log_history``).
Callbacks are never handed their Trainer or handler, so the Trainer is given explicitly:
``callback.attach(trainer)`` puts the callback right after ``DefaultFlowCallback``, ahead of the
integrations.

Which steps are measured: the first two, one in ``every`` and the last, and every step whose
largest micro-batch is the largest the run has held so far (rows x tokens). The Trainer fetches an
optimizer step's micro-batches before it calls ``on_step_begin``; ``attach`` lets the callback see
their shapes then. So the step that holds the run's longest batch, the one the estimator predicts
(:mod:`memtrain.data.rows`), is always measured, and the report compares like with like. Without
``attach`` only the scheduled steps are measured, whose batches may be shorter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from memtrain._compat.trl import mark_generation
from memtrain.memory.meter import MemoryMeter, StepMemory, generating
from memtrain.reliability.layouts import stacked_pairs
from memtrain.reliability.recovery import MicroBatchRecovery, recovery_of

if TYPE_CHECKING:
    from typing import Self

    from transformers import Trainer


Shape = tuple[int, int]  # (rows, tokens) of a micro-batch


def batch_shape(inputs: Any) -> Shape | None:
    """(rows, tokens) of a micro-batch: the shape of its ``input_ids`` (or of its first 2-D tensor)."""
    if not isinstance(inputs, Mapping):  # a dict, or the collator's BatchEncoding
        return None
    tensors = [inputs.get("input_ids"), *inputs.values()]
    first = next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    return None if first is None else (int(first.shape[0]), int(first.shape[1]))


def units_shape(trainer: Any, inputs: Any) -> Shape | None:
    """(units, tokens) of a micro-batch in the units a recipe counts its micro-batch in: preference
    pairs for TRL's stacked ``[chosen; rejected]`` batches (``input_ids`` holds 2 rows per pair),
    rows otherwise."""
    shape = batch_shape(inputs)
    if shape is None or not isinstance(inputs, Mapping):
        return shape
    pairs = stacked_pairs(trainer, dict(inputs))
    return shape if pairs is None else (pairs.count, shape[1])


def _rank(result: StepMemory) -> tuple[bool, bool, int]:
    """Steps unlike the run's others rank below any like them: a step redone after an out-of-memory
    error (it also held the failed attempt), then the first step (before the optimizer's state
    exists, which every later step holds: full fine-tuning's first step measured 84 MiB of a
    114.6 MiB steady step); among alike steps, the highest peak."""
    return not result.failed_attempt, not result.before_optimizer_state, result.peak_bytes


def _no_state_yet(optimizer: Any) -> bool:
    """``optimizer`` has trainable parameters and no state yet (a torch optimizer before its first
    step); False where it cannot be told (no optimizer, no ``state`` mapping)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(state, Mapping) or state:
        return False
    return any(p.requires_grad for group in optimizer.param_groups for p in group["params"])


def _size(shape: Shape) -> tuple[int, int]:
    return shape[0] * shape[1], shape[1]  # more tokens first; of as many, the longer rows


class MemoryMeterCallback(TrainerCallback):
    """Measure training steps and log their memory into the Trainer's logs.

    Args:
        every: measure the first two optimizer steps of each ``train()`` call (before and after
            optimizer state exists; a resumed run is measured too), then one step in ``every``
            (1 = all), the last step, and each step whose batch is the largest so far (see the
            module docstring; needs :meth:`attach`). Default: the Trainer's logging interval, so that each log
            entry reports the step it is logged at: measuring adds a Python call per tensor op,
            17-24% of a CPU step (docs/bench/meter_cost.md), too much to pay on every step.
        keep_timeline: keep the per-op timeline of the measured step with the highest peak
            (for the memory report plot).
        predicted_bytes: the estimator's predicted peak, logged as ``memory/predicted_peak_mib``.
        predicted_phases: a GRPO run's predicted peak per phase (``{"generation": ..., "training":
            ...}``), logged as ``memory/predicted_<phase>_peak_mib`` beside the measured
            ``memory/<phase>_peak_mib`` (:func:`memory_logs`).
    """

    def __init__(self, every: int | None = None, keep_timeline: bool = True,
                 predicted_bytes: int | None = None,
                 predicted_phases: dict[str, int] | None = None) -> None:
        self.every = every
        self._every = every or 1  # resolved at train begin
        self.keep_timeline = keep_timeline
        self.predicted_bytes = predicted_bytes  # the estimator's peak, logged beside the measured one
        self.predicted_phases = dict(predicted_phases or {})  # GRPO: "generation" / "training" peaks
        self.steps: dict[int, StepMemory] = {}  # global step -> measurement
        self.worst: StepMemory | None = None
        self.shapes: dict[int, Shape] = {}  # global step -> its largest micro-batch, measured steps
        self.largest: Shape | None = None  # the largest micro-batch of the run so far
        self._upcoming: Shape | None = None  # the next step's largest micro-batch (see attach)
        self._shape: Shape | None = None
        self._meter: MemoryMeter | None = None
        self._since_log: list[StepMemory] = []
        self._first = 0  # the global step training (re)started at
        self._trainer: Trainer | None = None  # set by attach
        self._largest_steady = False  # the largest batch measured in a step like the run's others
        self._stateless = False  # the step being measured began with no optimizer state

    def attach(self, trainer: Trainer) -> Self:
        """Add this callback to ``trainer`` (or move it there) ahead of the reporting integrations,
        so that TensorBoard, W&B, ... receive the memory entries it logs. Returns the callback."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(min(1, len(callbacks)), self)  # after DefaultFlowCallback
        self._trainer = trainer
        self._peek(trainer)
        mark_generation(trainer, generating)  # GRPO: its completions are the "generation" phase
        return self

    def _peek(self, trainer: Trainer) -> None:
        """See each optimizer step's micro-batches when the Trainer fetches them (before
        ``on_step_begin``): ``Trainer.get_batch_samples`` is wrapped on this instance."""
        stock = trainer.get_batch_samples
        if getattr(stock, "memtrain_peek", None) is self:
            return

        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches, items = stock(epoch_iterator, num_batches, device)
            shapes = [s for s in (units_shape(trainer, b) for b in batches) if s is not None]
            self._upcoming = max(shapes, key=_size) if shapes else None
            return batches, items

        get_batch_samples.memtrain_peek = self  # type: ignore[attr-defined]
        trainer.get_batch_samples = get_batch_samples  # type: ignore[method-assign]

    # -- events ---------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        self._first = state.global_step  # a resumed run measures its own first two steps too
        self._every = self.every or logging_interval(args, state)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      model: torch.nn.Module | None = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        step = state.global_step + 1
        if isinstance(getattr(self._trainer, "completion_batches", None), list):
            self._trainer.completion_batches.clear()  # GRPO: this step's generated batches from here
        shape, self._upcoming = self._upcoming, None
        largest = shape is not None and (self.largest is None or _size(shape) > _size(self.largest))
        if largest:
            self.largest, self._largest_steady = shape, False
        # the largest batch again, while it was measured only in a step unlike the others (the first,
        # before the optimizer's state exists, or one redone after an out-of-memory error)
        again = (shape is not None and self.largest is not None and _size(shape) == _size(self.largest)
                 and not self._largest_steady)
        if (step - self._first > 2 and step % self._every and step != state.max_steps  # (logged too)
                and not largest and not again):
            return
        self._shape = shape
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
        self._stateless = _no_state_yet(inner)
        self._meter = MemoryMeter(model, inner if isinstance(inner, torch.optim.Optimizer) else None,
                                  timeline=self.keep_timeline)
        self._meter.__enter__()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._meter is None:
            return
        self._meter.__exit__(None, None, None)
        result = self._meter.result()
        self._meter = None
        recovery = recovery_of(self._trainer) if self._trainer is not None else None
        result.batch, result.accumulation = self._ran(args, recovery)
        generated = getattr(self._trainer, "completion_batches", None)
        if result.batch is None and generated:  # GRPO: (rows, prompt tokens, completion tokens)
            result.batch = max(generated, key=lambda b: (b[0] * (b[1] + b[2]), b[2]))
        result.failed_attempt = recovery is not None and any(e["step"] == state.global_step
                                                             for e in recovery.events)
        result.before_optimizer_state = self._stateless
        if (self._shape is not None and self.largest is not None and _size(self._shape) == _size(self.largest)
                and not (result.failed_attempt or result.before_optimizer_state)):
            self._largest_steady = True
        if self._shape is not None:
            self.shapes[state.global_step] = self._shape
        # the step with the highest peak, of the steps that ran as they were meant to where there
        # are any: a step redone after an out-of-memory error also holds what its failed attempt held
        if self.worst is None or _rank(result) > _rank(self.worst):
            self.worst = result
        if not self.keep_timeline or result is not self.worst:
            result.timeline = []
        self.steps[state.global_step] = result
        self._since_log.append(result)

    def _ran(self, args: TrainingArguments, recovery: MicroBatchRecovery | None) -> tuple[Shape | None, int]:
        """The largest micro-batch the step ran and the micro-batches per optimizer step: after an
        out-of-memory split by ``recovery``, the pieces the step's batches were cut into, each a
        micro-batch of its own."""
        accumulation = int(args.gradient_accumulation_steps)
        if recovery is None or recovery.parts == 1 or self._shape is None:
            return self._shape, accumulation
        units, tokens = self._shape
        return (recovery.micro_batch(units), tokens), accumulation * min(recovery.parts, units)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop measuring (needed when training stopped inside a step, e.g. on an exception)."""
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or not self._since_log or not any(k in logs for k in ("loss", "train_loss")):
            return
        entries = memory_logs(max(self._since_log, key=lambda r: r.peak_bytes))
        if self.predicted_bytes:
            entries["memory/predicted_peak_mib"] = self.predicted_bytes / 2**20
        for phase, predicted in self.predicted_phases.items():
            entries[f"memory/predicted_{phase}_peak_mib"] = predicted / 2**20
        logs.update(entries)  # what trackers (TensorBoard, W&B, ...) receive
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(entries)  # the Trainer stored its copy before on_log
        self._since_log.clear()


def logging_interval(args: TrainingArguments, state: TrainerState) -> int:
    """The Trainer's logging interval in steps (``logging_steps`` below 1 is a fraction of the run,
    which the Trainer has turned into steps in ``state`` by the time training begins)."""
    total = max(1, int(state.max_steps or 1))
    if args.logging_strategy == "epoch":
        return max(1, math.ceil(total / max(1.0, float(args.num_train_epochs))))
    if args.logging_strategy != "steps":  # no logs: the first two steps only
        return total + 1
    steps = state.logging_steps or args.logging_steps
    return max(1, int(steps if steps >= 1 else math.ceil(steps * total)))


def memory_logs(result: StepMemory, prefix: str = "memory/") -> dict[str, float]:
    """Flat log entries (MiB) for a measured step, for the Trainer's logs. A step that generated text
    (GRPO) also logs its two phases apart: ``generation_peak_mib`` and ``training_peak_mib`` (the
    largest of the forward, backward and optimizer phases)."""
    mib = 2**20
    logs = {f"{prefix}peak_mib": result.peak_bytes / mib}
    phases = result.peak_by_phase
    if "generation" in phases:
        logs[f"{prefix}generation_peak_mib"] = phases["generation"] / mib
        logs[f"{prefix}training_peak_mib"] = max(
            (v for k, v in phases.items() if k != "generation"), default=0) / mib
    logs.update({f"{prefix}{k}_mib": v / mib for k, v in result.peak_by_category.items() if v})
    if result.host_peak_bytes:
        logs[f"{prefix}host_peak_mib"] = result.host_peak_bytes / mib
    if result.cuda_max_allocated is not None:
        logs[f"{prefix}cuda_max_allocated_mib"] = result.cuda_max_allocated / mib
        logs[f"{prefix}cuda_max_reserved_mib"] = (result.cuda_max_reserved or 0) / mib
    return logs
