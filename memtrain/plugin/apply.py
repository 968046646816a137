"""``prepare_for_budget``'s decision applied: memtrain's patches on the model, new TrainingArguments.

What the plugin may choose is read from the registry of techniques (:mod:`memtrain.patches`):
every patch knob with ``plugin=True`` (:func:`memtrain.plugin.describe.patch_knobs`) is ``auto``
in the recipe the plugin plans, unless the user fixed it (``prepare_for_budget(..., memory={...})``).
The decision is applied with the same :func:`memtrain.patches.apply_patches` as ``memtrain train``,
in stage order, limited to the patches the plugin may choose
(:func:`memtrain.plugin.describe.patch_names`; the adapter is the user's own model). The
Trainer-level settings (micro-batch, accumulation, optimizer) become TrainingArguments.

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

from memtrain import patches
from memtrain._compat.transformers_model import disable_own_checkpointing, own_checkpointing_on
from memtrain.config import RunConfig
from memtrain.memory import hostmem
from memtrain.patches import sizes_off
from memtrain.plugin.describe import BudgetPlan, memory_fields, patch_knobs, patch_names
from memtrain.units import format_bytes

log = logging.getLogger("memtrain.plugin.prepare")

# Set by attach's re-plan (memtrain.plugin.trainer_step): the Trainer's own arguments, changed in
# place. A new TrainingArguments (dataclasses.replace) would run its __post_init__, which resets the
# accelerator state the Trainer already built.
IN_PLACE: ContextVar[TrainingArguments | None] = ContextVar("memtrain_plugin_in_place", default=None)


def say(line: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(line, highlight=False)


# The techniques the plugin plans first: a step's two big levers. Only when nothing fits with them
# (and the batch) does it plan every technique it may choose (:func:`patch_knobs`): a search over
# every field costs one trace per candidate, hundreds on a model whose budget fits without them.
FIRST_FIELDS = ("memory.checkpointing", "memory.loss", "memory.activation_bits", "memory.randomized_linear")


def planned_fields(memory: dict[str, Any] | None, user_checkpointing: bool, margin: float,
                   adapter_pending: bool, every: bool = True) -> dict[str, Any]:
    """The recipe fields the plugin sets before planning: every :func:`patch_knobs` field ``auto``
    (an approximate one's options are only "off" without ``allow_approximate``; with ``every``
    False, only :data:`FIRST_FIELDS`, the others off), the batch ``auto``, the user's
    checkpointing as ``full``, and what ``memory=`` fixes.

    Args:
        memory: the ``memory`` fields the user fixed (``{"tiled_mlp": True}``, dotted below
            ``memory``: ``"offload.activations"``; nested dicts are read the same way).
        adapter_pending: a trainer will wrap the model in an adapter later (TRL's ``peft_config=``):
            the input embedding is still trained now, so embedding offload cannot be applied.

    Raises:
        MemtrainError: a ``memory=`` field the plugin cannot apply.
    """
    values: dict[str, Any] = {k.path: "auto" if every or k.path in FIRST_FIELDS else k.off
                              for k in patch_knobs() if k.plannable}
    values.update({"training.micro_batch_size": "auto", "training.gradient_accumulation": "auto",
                   "memory.margin": margin})
    if user_checkpointing:
        values["memory.checkpointing"] = "full"
    if adapter_pending:
        values["memory.offload.embeddings"] = False
    fixed = memory_fields(memory)  # a technique fixed off takes its size's `auto` along
    values.update(sizes_off(fixed))
    return values


def apply_plan(model: nn.Module, args: TrainingArguments, decided: Any, result: BudgetPlan,
               planned: RunConfig) -> tuple[nn.Module, TrainingArguments]:
    """Patch ``model`` as the plan says (after undoing a previous call's patches); new arguments.

    ``planned``: the recipe the planner decided ``decided`` for; its decided copy is what
    :func:`memtrain.patches.apply_patches` reads, as in ``memtrain train``.
    """
    from memtrain.patches import apply_patches, lora, records

    for record in reversed(records(model)):  # a re-run (notebook cell) starts from the plain model
        if record.undo is not None:
            record.undo()
    model.__dict__.pop("_memtrain_patch_records", None)
    inner = patches.base_model(model)
    if own_checkpointing_on(inner):
        disable_own_checkpointing(inner)  # memtrain's patch checkpoints; never both
    # the user's adapter (not memtrain's `lora` patch) keeps its input in its own dtype, as memtrain's
    # estimate of a LoRA model assumes (exact)
    lora.lean_lora_layers(model)
    model = apply_patches(model, decided.apply(planned), only=patch_names())
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
        if result.vllm is not None:  # vLLM colocated: the share it is built with (before the Trainer)
            updates["vllm_gpu_memory_utilization"] = result.vllm.utilization
            if getattr(args, "vllm_max_model_length", None) is None:
                updates["vllm_max_model_length"] = result.vllm.length
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
