"""Batch arithmetic: effective = micro × accumulation × processes, exactly.

The user may state any of the three numbers; the missing ones are derived here. ``auto`` values
must be decided by the planner before this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtrain.config.schema import TrainingConfig

DEFAULT_MICRO_BATCH = 8  # used only when the recipe states no batch size at all
MICRO_CAP = 1024  # largest micro-batch considered when the effective batch does not bound it


@dataclass(frozen=True)
class Batch:
    """The batch sizes a run uses; ``processes`` is the world size (all machines' processes)."""

    micro: int
    accumulation: int
    processes: int = 1

    @property
    def effective(self) -> int:
        return self.micro * self.accumulation * self.processes

    def __str__(self) -> str:
        procs = f" × {self.processes} processes" if self.processes > 1 else ""
        return f"{self.effective} = {self.micro} per step × {self.accumulation} accumulated{procs}"


def resolve_batch(training: TrainingConfig, processes: int = 1) -> Batch:
    """Derive the missing batch numbers (the schema has already checked they can agree).

    Raises:
        ValueError: a field is still ``auto`` (the planner must fill it first).
    """
    eff = training.effective_batch_size
    micro, accum = training.micro_batch_size, training.gradient_accumulation
    if micro == "auto" or accum == "auto":
        raise ValueError("micro_batch_size/gradient_accumulation are `auto`: run the planner first")
    if micro is not None and accum is not None:
        return Batch(micro, accum, processes)
    if eff is None:
        return Batch(micro or DEFAULT_MICRO_BATCH, accum or 1, processes)
    if micro is not None:
        return Batch(micro, eff // (micro * processes), processes)
    if accum is not None:
        return Batch(eff // (accum * processes), accum, processes)
    return Batch(eff // processes, 1, processes)


def valid_batches(training: TrainingConfig, processes: int = 1) -> list[tuple[int, int]]:
    """The (micro, accumulation) pairs ``micro_batch_size: auto`` may choose, smallest first.

    With an effective batch, the micro-batches that divide it per process (and a fixed
    accumulation, if one is given); without one, any micro-batch with the given accumulation
    (for GRPO, one that makes whole groups of ``num_generations`` completions per step).
    """
    eff, accum = training.effective_batch_size, training.gradient_accumulation
    if eff is None:
        fixed = accum if isinstance(accum, int) else 1
        # GRPO: TRL generates whole groups, so the completions per optimizer step (micro ×
        # accumulation × processes) are a multiple of num_generations (an effective batch is one)
        group = training.grpo_num_generations if training.objective == "grpo" else 1
        return [(m, fixed) for m in range(1, MICRO_CAP + 1) if (m * fixed * processes) % group == 0]
    per_process = eff // processes
    if isinstance(accum, int):
        return [(per_process // accum, accum)]
    return [(m, per_process // m) for m in range(1, per_process + 1) if per_process % m == 0]
