"""``prepare_for_budget``'s decision applied: memtrain's patches on the model, new TrainingArguments.

A re-run (a notebook cell, or ``attach`` re-planning for the Trainer's data) first undoes what the
last call applied, so nothing is nested.
"""

from __future__ import annotations

import dataclasses
import logging
from contextvars import ContextVar
from typing import Any

from torch import nn
from transformers import TrainingArguments

from memtrain.memory import hostmem
from memtrain.plugin.describe import BudgetPlan
from memtrain.units import format_bytes

log = logging.getLogger("memtrain.plugin.prepare")

# Set by attach's re-plan (memtrain.plugin.trainer_step): the Trainer's own arguments, changed in
# place. A new TrainingArguments (dataclasses.replace) would run its __post_init__, which resets the
# accelerator state the Trainer already built.
IN_PLACE: ContextVar[TrainingArguments | None] = ContextVar("memtrain_plugin_in_place", default=None)


def say(line: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(line, highlight=False)


def apply_plan(model: nn.Module, args: TrainingArguments, decided: Any, result: BudgetPlan
                ) -> tuple[nn.Module, TrainingArguments]:
    """Patch ``model`` as the plan says (after undoing a previous call's patches); new arguments."""
    from memtrain.config import FewBitConfig, RandomizedLinearConfig
    from memtrain.patches import checkpointing, chunked_loss, fewbit, lora, randomized_linear, records

    for record in reversed(records(model)):  # a re-run (notebook cell) starts from the plain model
        if record.undo is not None:
            record.undo()
    model.__dict__.pop("_memtrain_patch_records", None)
    inner = getattr(model, "get_base_model", lambda: model)()
    if getattr(inner, "is_gradient_checkpointing", False):
        inner.gradient_checkpointing_disable()  # memtrain's patch checkpoints; never both
    settings = decided.settings()
    lora.lean_lora_layers(model)  # as memtrain's estimate of a LoRA model assumes (exact)
    if settings.get("memory.loss") == "chunked":
        chunked_loss.apply(model)
    if result.settings["checkpointing"] != "none":
        checkpointing.apply(model, result.settings["checkpointing"])
    if settings.get("memory.activation_bits"):
        fewbit.apply(model, FewBitConfig(bits=settings["memory.activation_bits"]))
    if settings.get("memory.randomized_linear"):
        randomized_linear.apply(model, RandomizedLinearConfig(**settings["memory.randomized_linear"]))
    updates: dict[str, Any] = {key: result.settings[key] for key in
                               ("per_device_train_batch_size", "gradient_accumulation_steps", "optim")}
    # memtrain's patch checkpoints; never both (transformers 5 names it activation_checkpointing)
    updates.update({name: False for name in ("activation_checkpointing", "gradient_checkpointing")
                    if hasattr(args, name)})
    if decided.device == "cpu" and hostmem.keep_freed_pages():
        log.info("prepare_for_budget: freed host memory is kept for reuse (memtrain.memory.hostmem)")
    log.info("prepare_for_budget: %s; predicted peak %s of %s usable", decided.chosen.label(),
             format_bytes(decided.chosen.peak), format_bytes(decided.usable))
    model.__dict__["memtrain_plan"] = result  # not a submodule, not saved with the weights
    into = IN_PLACE.get()
    if into is None:
        return model, new_arguments(args, updates)
    for name, value in updates.items():  # a Trainer holds these arguments: no new ones (see IN_PLACE)
        setattr(into, name, type(into.optim)(value) if name == "optim" else value)
    keep_generation_batch(into)
    return model, into


def new_arguments(args: TrainingArguments, updates: dict[str, Any]) -> TrainingArguments:
    """``args`` with ``updates``, as a new object (its ``__post_init__`` checks run again).

    TRL's ``GRPOConfig`` derives ``generation_batch_size`` and ``steps_per_generation`` from each
    other and refuses both set: the new one keeps the completions generated at once
    (``generation_batch_size``; so the completions per optimizer step too) and lets TRL derive
    ``steps_per_generation`` from the new micro-batch (where it divides; else TRL's default, one
    generation per optimizer step).
    """
    if getattr(args, "generation_batch_size", None) is not None and hasattr(args, "steps_per_generation"):
        micro = updates.get("per_device_train_batch_size", args.per_device_train_batch_size)
        if args.generation_batch_size % (micro * args.world_size) == 0:
            updates = {**updates, "steps_per_generation": None}
        else:
            updates = {**updates, "generation_batch_size": None, "steps_per_generation": None}
    return dataclasses.replace(args, **updates)


def keep_generation_batch(args: Any) -> None:
    """After ``per_device_train_batch_size`` changed in place: TRL's GRPOConfig's
    ``steps_per_generation`` follows, so that ``generation_batch_size`` (completions generated at
    once, whole groups of ``num_generations``) stays (see :func:`new_arguments`)."""
    generation = getattr(args, "generation_batch_size", None)
    if generation is None or not hasattr(args, "steps_per_generation"):
        return
    rows = args.per_device_train_batch_size * args.world_size
    if generation % rows == 0:
        args.steps_per_generation = generation // rows
    else:  # TRL's default: one generation per optimizer step
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = rows * args.steps_per_generation
