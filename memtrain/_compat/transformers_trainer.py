"""transformers' ``Trainer``: the private methods memtrain overrides or calls, and private state.

Public first: memtrain's Trainer uses the public hooks where they exist (``training_step``,
``compute_loss``, ``prediction_step``, ``create_optimizer``, ``create_accelerator_and_postprocess``,
``evaluate``, callbacks). What is here has none:

- :class:`TrainerHooks` overrides ``_run_epoch``, ``_build_accelerator_args``, ``_save_checkpoint``
  and ``_clip_grad_norm`` and forwards each to a public-named method (:meth:`run_epoch`,
  :meth:`accelerator_arguments`, :meth:`save_checkpoint`, :meth:`clip_grad_norm`) that memtrain's
  Trainer overrides; no callback can skip an epoch before its first step, hand ``Accelerator`` an
  FSDP plugin, wrap the checkpoint write, or clip gradients held by the optimizer on the host;
- functions for the private methods and state memtrain calls or sets (``_prepare_inputs``,
  ``_remove_unused_columns``, ``_get_collator_with_removed_columns``, ``_train_batch_size``,
  ``_loss_shifts_labels``) and ``loss_is_scaled_for_ga`` (public, but only from transformers 5.19:
  before, writing it is silently ignored, issue 35).

Checked on transformers 5.24 and 5.25 (installed); the tested range is
:data:`memtrain._compat.versions.TESTED` (5.19–5.25: issue 35's runs, 5.25 on 2026-12-03).
"""

from __future__ import annotations

import functools
from typing import Any

from memtrain._compat.versions import compat_error, private, require

_SHIM = "transformers_trainer"
_HOOKS = ("_run_epoch", "_build_accelerator_args", "_save_checkpoint", "_clip_grad_norm")


@functools.cache
def _check_hooks(cls: type) -> None:
    require(cls, _HOOKS, f"{_SHIM}.TrainerHooks", "transformers")


class TrainerHooks:
    """A mixin before ``transformers.Trainer`` (or a subclass) in the bases: its private hooks
    forwarded to public names. Each public method's default is the Trainer's own behaviour."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from transformers import Trainer

        _check_hooks(Trainer)
        super().__init__(*args, **kwargs)

    # ---- the private hooks the Trainer calls
    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        return self.run_epoch(*args, **kwargs)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        return self.accelerator_arguments(**kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        return self.save_checkpoint(model, trial)

    def _clip_grad_norm(self, model: Any) -> Any:
        return self.clip_grad_norm(model)

    # ---- public names, the Trainer's behaviour by default
    def run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """One epoch of the training loop (``Trainer._run_epoch``)."""
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def accelerator_arguments(self, **kwargs: Any) -> dict[str, Any]:
        """The keyword arguments the Trainer builds ``Accelerator`` with (``_build_accelerator_args``)."""
        return super()._build_accelerator_args(**kwargs)  # type: ignore[misc]

    def save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write a checkpoint (``Trainer._save_checkpoint``)."""
        return super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def clip_grad_norm(self, model: Any) -> Any:
        """Clip the gradients to ``args.max_grad_norm``; returns the norm (``_clip_grad_norm``)."""
        return super()._clip_grad_norm(model)  # type: ignore[misc]


def prepare_inputs(trainer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """A batch moved and prepared as the training loop does (``Trainer._prepare_inputs``; no
    public equivalent)."""
    return private(trainer, "_prepare_inputs", f"{_SHIM}.prepare_inputs", "transformers")(inputs)


def remove_unused_columns(trainer: Any, dataset: Any, description: str) -> Any:
    """The dataset without the columns the model's forward does not take, as the Trainer's
    dataloader drops them (``Trainer._remove_unused_columns``; no public equivalent)."""
    method = private(trainer, "_remove_unused_columns", f"{_SHIM}.remove_unused_columns", "transformers")
    return method(dataset, description=description)


def collator_with_removed_columns(trainer: Any, collator: Any, description: str) -> Any:
    """The collator the Trainer's dataloader uses for an iterable dataset
    (``Trainer._get_collator_with_removed_columns``; no public equivalent)."""
    method = private(trainer, "_get_collator_with_removed_columns",
                     f"{_SHIM}.collator_with_removed_columns", "transformers")
    return method(collator, description=description)


def set_train_batch_size(trainer: Any, size: int) -> None:
    """Set the batch size the Trainer's loop and dataloader read (``Trainer._train_batch_size``,
    which ``train()`` sets from the arguments before a run; no public setter)."""
    if not hasattr(trainer, "_train_batch_size"):
        raise compat_error(f"{_SHIM}.set_train_batch_size", "transformers", "Trainer._train_batch_size")
    trainer._train_batch_size = size


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the Trainer's loss shifts the labels itself (``Trainer._loss_shifts_labels``, a
    causal-LM loss; False where the Trainer does not say)."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def set_loss_scaled_for_ga(trainer: Any, scaled: bool) -> None:
    """Tell the Trainer whether the model's loss is already scaled for gradient accumulation
    (``Trainer.loss_is_scaled_for_ga``, transformers >= 5.19). Below 5.19 the Trainer never reads
    it and a classifier's gradients would grow with accumulation, so its absence is an error."""
    if not hasattr(trainer, "loss_is_scaled_for_ga"):
        raise compat_error(f"{_SHIM}.set_loss_scaled_for_ga", "transformers", "Trainer.loss_is_scaled_for_ga")
    trainer.loss_is_scaled_for_ga = scaled


def own_checkpointing_off() -> dict[str, bool]:
    """The ``TrainingArguments`` fields that turn transformers' own activation checkpointing off
    (memtrain checkpoints as ``memory.checkpointing`` says). transformers 5.24 renamed
    ``gradient_checkpointing`` to ``activation_checkpointing``: the old name set alone then warns
    (FutureWarning, "removed in v6"), and TRL's configs set it alone (default True), so every
    DPO and GRPO run warned. Both names where both exist (the new one wins, silently); the old one
    alone before 5.24."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {name: False for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}
