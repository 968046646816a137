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

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from transformers import Trainer

from memtrain import patches
from memtrain._compat.transformers_trainer import set_train_batch_size
from memtrain.data.rows import Rows
from memtrain.estimator.grpo import generation_beside, phase_peaks
from memtrain.estimator.trainer_loss import TrainerEstimate, longest_batch_rows, trainer_step_estimate
from memtrain.plugin.apply import IN_PLACE, keep_generation_batch
from memtrain.plugin.describe import BudgetPlan
from memtrain.plugin.options import Seen, option_notes
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

STEP_METHODS = ("compute_loss", "training_step")


def overrides_step(trainer: Trainer) -> bool:
    """Whether the Trainer's class computes its step differently from ``transformers.Trainer``."""
    return any(getattr(type(trainer), name) is not getattr(Trainer, name) for name in STEP_METHODS)


def check_trainer_step(trainer: Trainer, usable: int | None, grow: bool = False) -> TrainerEstimate:
    """Trace ``trainer``'s own step; refit its micro-batch when the step exceeds ``usable`` bytes.

    ``grow``: the micro-batch is memtrain's choice (a plan), so a larger one whose traced step
    fits is taken too (the largest divisor of per-device batch x accumulation that fits).

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
    args = trainer.args
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    total = micro * accumulation
    if usable is not None and peak <= usable and grow:
        for larger in (d for d in range(micro + 1, total + 1) if total % d == 0):
            candidate = trainer_step_estimate(trainer, larger, total // larger)
            if not candidate.modelled or (candidate.peak_bytes or 0) > usable:
                break
            found = candidate
        if found.micro_batch != micro:
            _use(trainer, found.micro_batch, found.accumulation)
        return found
    if usable is None or peak <= usable:
        return found
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
    keep_generation_batch(args)  # TRL's GRPO: the same completions per generation
    set_train_batch_size(trainer, args.train_batch_size)


def _adapter_of_the_trainer(trainer: Trainer, plan: BudgetPlan) -> None:
    """A Trainer that wrapped the model in a LoRA adapter ``prepare_for_budget`` was not told of
    (TRL's ``peft_config=`` given to the trainer alone): the traced step trains the adapter, so the
    plan says so, with a note on what its own search did not know."""
    configs = getattr(trainer.model, "peft_config", None)
    if plan.settings.get("adapter") != "full" or not configs:
        return
    lora = next(iter(configs.values()))
    rank = getattr(lora, "r", None)
    plan.settings["adapter"] = "lora" + (f" r={rank}" if rank is not None else "")
    plan.notes.append(f"the Trainer trains a peft adapter ({plan.settings['adapter']}) that "
                      "prepare_for_budget was not given: the prediction is the Trainer's traced step with "
                      "it, but the techniques were planned for full fine-tuning. Pass the same "
                      "`peft_config=` to prepare_for_budget to plan them for the adapter.")


def _check_stated_length(trainer: Trainer, plan: BudgetPlan) -> None:
    """A ``max_length=`` shorter than the Trainer's longest batch: its steps hold more than planned
    (on a GPU, an out-of-memory error in the first long step). Said in the plan's notes and logged."""
    from memtrain._compat.trl import is_grpo

    if is_grpo(trainer):  # prompts: the batch is the generation's worst case, not the data's
        return
    stated = plan.settings.get("max_length")
    try:
        _, rows = longest_batch_rows(trainer, trainer.args.per_device_train_batch_size)
    except Exception:  # data attach cannot read: not this check's to report
        return
    if isinstance(stated, int) and rows.longest > stated:
        note = (f"the Trainer's longest batch has rows of {rows.longest} tokens, more than the "
                f"max_length={stated} planned for, so its steps hold more than planned. Fix: cut the data "
                f"at {stated} tokens (the tokenizer's truncation or your collator), or pass "
                f"max_length={rows.longest} to prepare_for_budget")
        plan.notes.append(note)
        log.warning("memtrain: %s.", note)


def complete_plan(trainer: Trainer, plan: BudgetPlan, estimate: bool | str, prepare: Callable[..., Any]
                  ) -> TrainerEstimate | None:
    """What ``attach`` adds to ``prepare_for_budget``'s plan, now that the Trainer exists.

    1. A plan made for an assumed length is made again for the longest batch of the Trainer's
       data through its collator (capped by the model's positions), and the Trainer's arguments
       follow it (in place, before ``train()``).
    2. The Trainer's own step is traced (``estimate=True``; ``"auto"``: a Trainer that computes its
       own loss, or a collator that flattens a batch into one row): its peak is the plan's, and the
       micro-batch is the largest whose traced step fits.
    (``prepare``: :func:`memtrain.plugin.prepare.prepare_for_budget`, which imports this module.)
    3. The plan is printed (unless ``quiet``) if ``prepare_for_budget`` left it pending or it changed.

    Returns:
        The trace (None: not traced).
    """
    shown = (plan.predicted_peak, dict(plan.settings))
    flattened = False
    if plan.length_from == "assumed":
        try:
            batch, rows = longest_batch_rows(trainer, trainer.args.per_device_train_batch_size)
        except Exception as err:
            plan.notes.append(f"attach could not read the Trainer's data ({type(err).__name__}: {err}); the "
                              "plan stays for the assumed length")
        else:
            flattened = rows.packed and batch["input_ids"].shape[0] == 1
            _replan(trainer, plan, rows, prepare)
    elif plan.length_from == "max_length=":
        _check_stated_length(trainer, plan)
    plan.notes += option_notes(Seen(trainer.args, trainer.model, trainer.data_collator, trainer),
                               only=lambda rule: rule.option in ("data_collator", "ref_model"))
    flattened = flattened or any("DataCollatorWithFlattening" in note for note in plan.notes)
    found = None
    if estimate is True or (estimate == "auto" and (overrides_step(trainer) or flattened)):
        found = check_trainer_step(trainer, plan.usable, grow=True)
        plan.notes.append(found.describe())
        if found.modelled and found.peak_bytes is not None:
            peak = _with_generation(trainer, plan, found)
            plan.use_micro_batch(found.micro_batch, found.accumulation, peak)
            before = plan.settings["max_length"]
            shape = found.batch.get("input_ids", (0, before))  # (rows, tokens) of the traced batch
            traced = plan.settings["max_length"] = shape[-1]
            if (flattened or plan.settings.get("packed")) and shape[0] == 1 and traced > before:  # end to end
                plan.notes.append(f"the traced step's batch is one flattened row of {traced:,} tokens (the "
                                  f"collator lays its rows of up to {before:,} tokens end to end): the "
                                  "plan's length is that row's")
            plan.length_from = "the Trainer's longest batch, its step traced"
            _adapter_of_the_trainer(trainer, plan)
    if not plan.quiet and (plan.pending or (plan.predicted_peak, plan.settings) != shown):
        plan.print(by="attach")
    plan.pending = False
    return found


def _with_generation(trainer: Trainer, plan: BudgetPlan, found: TrainerEstimate) -> int:
    """The predicted peak: the traced step's; for TRL's GRPOTrainer the larger of it and the generation
    phase (:func:`memtrain.estimator.grpo.trainer_generation_phase`, which the plan's notes state)."""
    peak = found.peak_bytes or 0
    phases = phase_peaks(trainer, found)
    if not phases:
        return peak
    plan.phase_peaks = phases
    larger = "the generation phase" if phases["generation"] > peak else "the training step"
    plan.notes.append(f"{generation_beside(trainer, found).describe()}; the predicted peak is {larger}'s "
                      f"(training step traced: {format_bytes(peak)})")
    return max(phases.values())


def _replan(trainer: Trainer, plan: BudgetPlan, rows: Rows, prepare: Callable[..., Any]) -> None:
    """``prepare_for_budget`` again, for ``rows`` read from the Trainer's data; its arguments follow."""
    from memtrain.estimator.setup import position_limit

    request = plan.request
    model = request["model"]
    limit = position_limit(patches.base_model(model).config)
    notes = [f"the Trainer's longest batch has rows of {rows.longest} tokens, more than the model's {limit} "
             f"positions: planned for {limit} (cut longer rows)"] if limit and rows.longest > limit else []
    if notes:
        rows = dataclasses.replace(rows, longest=limit)
    token = IN_PLACE.set(trainer.args)
    try:
        _, args = prepare(model, request["args"], request["budget"], rows=rows, quiet=True,
                                     **request["options"])
    finally:
        IN_PLACE.reset(token)
        # the estimator's traces build TrainingArguments of their own, which reset accelerate's
        # process-wide state: the Trainer's accelerator is made again, from its (changed) arguments
        trainer.create_accelerator_and_postprocess()
    new = model.__dict__["memtrain_plan"]
    new.notes[:0] = [*notes, f"the Trainer's longest batch through its collator: rows of {rows.longest} "
                     f"tokens{', packed' if rows.packed else ''} (was assumed {plan.settings['max_length']})"]
    new.length_from, new.quiet, new.pending = "the data", plan.quiet, plan.pending
    plan.__dict__.update(new.__dict__)
    model.__dict__["memtrain_plan"] = plan  # one plan object: the callback's, the model's
    _use(trainer, args.per_device_train_batch_size, args.gradient_accumulation_steps)
