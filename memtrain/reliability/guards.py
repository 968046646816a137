"""Guards of a training run: stop cleanly on SIGINT/SIGTERM, skip NaN steps.

- :class:`GracefulStop` turns the first SIGINT/SIGTERM into a request that the training loop
  honours at the next optimizer-step boundary (save a checkpoint, then stop); a second signal
  interrupts at once.
- Checkpoints are staged, synced, verified and renamed into place by :mod:`memtrain.reliability.checkpoints`.
- :class:`NonFiniteLossGuard` skips optimizer steps whose loss is NaN/inf and stops the run after
  ``training.max_nonfinite_steps`` in a row.

The Trainer has no hook for any of these, hence this module; :class:`memtrain.trainer.trainer.MemtrainTrainer`
wires them in.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from memtrain.distributed.together import largest
from memtrain.errors import MemtrainError
from memtrain.reliability.checkpoints import newest_finite

log = logging.getLogger(__name__)



class Interrupted(MemtrainError):
    """Training stopped on a signal after saving a checkpoint; the exit status is 128 + signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class GracefulStop:
    """Context manager: the first SIGINT/SIGTERM sets :attr:`signum`; a second one interrupts."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s received: finishing the current step, saving a checkpoint, then stopping "
                    "(send it again to stop at once)", signal.Signals(signum).name)

    def __enter__(self) -> GracefulStop:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                break
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class StopOnSignal(TrainerCallback):
    """At the end of an optimizer step after a signal: save a checkpoint and stop training.

    With several processes, all stop at the same step when any of them got a signal (they meet
    in collectives every step: one stopping alone would leave the others waiting forever);
    :attr:`signum` is then the signal in every process.
    """

    def __init__(self, stop: GracefulStop) -> None:
        self.stop = stop
        self.signum: int | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        signum = largest([self.stop.signum or 0], args.device)[0]
        if signum:
            self.signum = signum
            control.should_save = True
            control.should_training_stop = True


# ------------------------------------------------------------------------------------- NaN guard


class NonFiniteLossGuard(TrainerCallback):
    """Skip optimizer steps whose loss was NaN/inf; stop after ``limit`` such steps in a row.

    The trainer calls :meth:`flag` when a micro-batch's loss is not finite (its backward then
    touches no parameter); before the optimizer step the whole step's gradients are dropped, so
    the weights and the optimizer state stay as they were.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_row = 0
        self.skipped: list[int] = []
        self.stopped_at: int | None = None
        self._flagged = False

    def flag(self) -> None:
        self._flagged = True

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, model: torch.nn.Module | None = None,
                              **kwargs: Any) -> None:
        if not self._flagged:
            self.in_row = 0
            return
        self._flagged = False
        step = state.global_step + 1
        self.skipped.append(step)
        self.in_row += 1
        if model is not None:
            model.zero_grad(set_to_none=True)  # the optimizer skips parameters without a gradient
        log.warning("step %d: the loss is NaN or infinite; the step is skipped (%d in a row, limit %d)",
                    step, self.in_row, self.limit)
        if self.in_row > self.limit:
            self.stopped_at = step
            control.should_training_stop = True

    def error(self, output_dir: Path) -> MemtrainError:
        """The message for a run stopped by too many non-finite steps."""
        last = newest_finite(output_dir)
        kept = (f"The newest checkpoint with finite weights is {last}." if last
                else "No checkpoint with finite weights was saved before it.")
        return MemtrainError(
            f"Training stopped at step {self.stopped_at}: the loss was NaN or infinite in "
            f"{self.in_row} optimizer steps in a row (`training.max_nonfinite_steps` = {self.limit}). "
            f"{kept} Fix: lower `training.learning_rate`, use `model.dtype: bf16` instead of fp16, "
            "or look for broken examples in the data."
        )
