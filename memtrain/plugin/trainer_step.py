"""What :func:`memtrain.plugin.prepare.attach` learns from the Trainer it is given: its own step.

``prepare_for_budget`` runs before the Trainer exists, so it plans the model's own loss on rows of
``max_length`` tokens. The Trainer may do more: TRL's trainers wrap the model in a peft adapter
(``peft_config=``), compute log-probabilities through a chunked fp32 head, and DPO runs the policy
on ``[chosen; rejected]`` plus a reference forward. So ``attach`` traces the Trainer's own
``training_step`` on fake tensors, over the longest batch its collator makes from its data
(:func:`memtrain.estimator.trainer_loss.trainer_step_estimate`):

- the traced peak becomes the prediction the callback logs (``memory/predicted_peak_mib``);
- above the usable budget, the micro-batch is refitted: the largest ``per_device_train_batch_size``
  whose traced step fits, with ``gradient_accumulation_steps`` raised to keep their product (the
  Trainer's arguments are changed in place, before ``train()`` builds its dataloader); if none
  fits, a warning says so, with the smallest peak and what to change;
- a step that cannot be traced is reported as *not modelled* (a warning, the plan's notes): no
  prediction is logged for it rather than one for a loss the Trainer does not compute.

By default (``estimate="auto"``) only a Trainer whose class overrides ``compute_loss`` or
``training_step`` is traced: for the stock ``Trainer`` the model's own loss is what runs, and
``prepare_for_budget``'s estimate already models it.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer

from memtrain.estimator.trainer_loss import TrainerEstimate, trainer_step_estimate
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

STEP_METHODS = ("compute_loss", "training_step")


def overrides_step(trainer: Trainer) -> bool:
    """Whether the Trainer's class computes its step differently from ``transformers.Trainer``."""
    return any(getattr(type(trainer), name) is not getattr(Trainer, name) for name in STEP_METHODS)


def check_trainer_step(trainer: Trainer, usable: int | None) -> TrainerEstimate:
    """Trace ``trainer``'s own step; refit its micro-batch when the step exceeds ``usable`` bytes.

    Returns:
        The estimate of the step the Trainer will run (after any refit); ``modelled`` False
        (and a warning) where it could not be traced.
    """
    found = trainer_step_estimate(trainer)
    name = found.trainer
    if not found.modelled:
        log.warning("memtrain: %s. Not modelled: no predicted peak is logged for it and the budget is not "
                    "checked before training (measured peaks still are, and out-of-memory recovery works).",
                    found.describe())
        return found
    peak = found.peak_bytes or 0
    log.info("memtrain: %s: predicted peak %s", found.describe(), format_bytes(peak))
    if usable is None or peak <= usable:
        return found
    args = trainer.args
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    total = micro * accumulation
    smallest = found
    for smaller in sorted((d for d in range(1, micro) if total % d == 0), reverse=True):
        candidate = trainer_step_estimate(trainer, smaller, total // smaller)
        if not candidate.modelled or candidate.peak_bytes is None:
            continue
        if candidate.peak_bytes < (smallest.peak_bytes or 0):
            smallest = candidate
        if candidate.peak_bytes <= usable:
            _use(trainer, smaller, total // smaller)
            log.warning("memtrain: %s's step at per_device_train_batch_size=%d is predicted at %s, over the "
                        "usable %s; now per_device_train_batch_size=%d, gradient_accumulation_steps=%d "
                        "(same per-device batch x accumulation), predicted %s.", name, micro,
                        format_bytes(peak), format_bytes(usable), smaller, total // smaller,
                        format_bytes(candidate.peak_bytes))
            return candidate
    log.warning("memtrain: %s's step does not fit the usable %s: predicted %s at "
                "per_device_train_batch_size=%d; the smallest is %s at per_device_train_batch_size=%d. "
                "Fix: a larger budget, shorter examples (your trainer's `max_length`), "
                "`gradient_checkpointing=True` before prepare_for_budget, or %s. Training goes on; "
                "out-of-memory recovery splits what it can.", name, format_bytes(usable), format_bytes(peak),
                micro, format_bytes(smallest.peak_bytes or 0), smallest.micro_batch,
                "a smaller LoRA rank" if hasattr(trainer.model, "peft_config")
                else "a LoRA adapter (`peft_config=`)")
    return found


def _use(trainer: Trainer, micro: int, accumulation: int) -> None:
    """Train at ``micro`` × ``accumulation`` (before ``train()``, which sizes its dataloader from these)."""
    args: Any = trainer.args
    args.per_device_train_batch_size = micro
    args.gradient_accumulation_steps = accumulation
    trainer._train_batch_size = args.train_batch_size
