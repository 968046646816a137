"""Out-of-memory recovery in evaluation: an evaluation batch that does not fit is split and redone.

Evaluation holds no gradients and no optimizer step to protect, so recovery is simpler than in
training (:mod:`memtrain.reliability.recovery`): when the Trainer's ``prediction_step`` on a batch runs out of
memory (``torch.OutOfMemoryError``, or the ``RuntimeError`` of a failed CPU allocation), the batch
is split in two as its layout allows (:mod:`memtrain.reliability.layouts`: rows, whole preference
pairs, packed sequences; a batch that must not be cut is refused), each piece is predicted alone
and the results are put back together in the batch's order (for TRL's stacked preference batches,
every chosen row before every rejected one), the loss averaged with each piece weighted by its
share of the batch's items (labels other than -100, as
:func:`memtrain.reliability.layouts.count_items` counts them, else its pairs or examples), which
is exact for a mean loss such as the models' own or DPO's. The split is kept for the rest of the
run and halves again on a further error, down to one example. Metric side effects of the failed
attempt are put back (:mod:`memtrain.reliability.replay`).

Pieces are cut from the padded batch, so they keep its sequence length and their logits
concatenate as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain._compat.trl import generation_steps
from memtrain.reliability.layouts import Layout, count_items, layout_of
from memtrain.reliability.recovery import (
    MicroBatchTooLarge,
    UnsplittableBatch,
    free_memory,
    is_out_of_memory,
    reset_module_tracking,
)
from memtrain.reliability.replay import restore_effects, snapshot_effects

log = logging.getLogger(__name__)

PredictFn = Callable[..., tuple[Any, Any, Any]]


class EvalBatchRecovery:
    """Wrap a Trainer's ``prediction_step`` so that an out-of-memory evaluation batch is split.

    Args:
        trainer: the ``transformers.Trainer`` whose evaluation to protect.
        predict_fn: the prediction step run on each piece (default: the trainer's
            ``prediction_step`` as it is when this object is created).
    """

    def __init__(self, trainer: Any, predict_fn: PredictFn | None = None) -> None:
        self.trainer = trainer
        self.predict_fn: PredictFn = predict_fn or trainer.prediction_step
        self.parts = 1  # pieces each evaluation batch is split into
        self.events: list[dict[str, int]] = []  # one per split: rows before and after
        # TRL's GRPOTrainer generates completions for every evaluation batch inside its prediction
        # step: such a batch is prompts, and splitting it would generate again; it is not split
        self.generates = generation_steps(trainer) is not None

    def install(self) -> EvalBatchRecovery:
        """Make the trainer predict through :meth:`prediction_step` (an instance attribute)."""
        self.trainer.prediction_step = self.prediction_step
        return self

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The Trainer's ``prediction_step``, recovering from out-of-memory errors (same signature)."""
        if self.generates:
            return self.predict_fn(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        effects = snapshot_effects(self.trainer)
        while True:
            try:
                return self._predict(model, inputs, prediction_loss_only, ignore_keys)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if isinstance(err, MicroBatchTooLarge) or not is_out_of_memory(err):
                    raise
                message = str(err)
            # Outside the except block the failed attempt's tensors are gone.
            restore_effects(self.trainer, effects)
            self._shrink(inputs, message)

    def _predict(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                 ignore_keys: list[str] | None) -> tuple[Any, Any, Any]:
        layout = layout_of(self.trainer, inputs) if self.parts > 1 else None
        if layout is None or layout.refusal or layout.count <= 1:  # whole: refused only if it fails
            return self.predict_fn(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        pieces = layout.split(self.parts)
        results = [self.predict_fn(model, piece, prediction_loss_only, ignore_keys=ignore_keys)
                   for piece in pieces]
        losses = [r[0] for r in results]
        loss = None
        if all(v is not None for v in losses):
            items = [count_items(self.trainer, piece) for piece in pieces]
            weights = items if sum(items) else [end - start for start, end in layout.bounds(self.parts)]
            loss = sum(v * (w / sum(weights)) for v, w in zip(losses, weights, strict=True))
        logits = concat([r[1] for r in results], layout, self.parts)
        return loss, logits, concat([r[2] for r in results], layout, self.parts)

    def _shrink(self, inputs: dict[str, Any], message: str) -> None:
        reset_module_tracking()
        free_memory()
        layout = layout_of(self.trainer, inputs)
        before = -(-layout.count // min(self.parts, layout.count))
        if before <= 1:
            raise MicroBatchTooLarge(
                f"Out of memory evaluating one {layout.unit}: no split of the evaluation batch can help. "
                "Fix: a larger budget, a shorter maximum length, or `eval_strategy='no'`.\n"
                f"The error was: {message}")
        if layout.refusal:
            raise UnsplittableBatch(
                f"Out of memory evaluating a batch of {before} {layout.unit}s, and "
                f"{type(self.trainer).__name__}'s batch cannot be split for recovery: {layout.refusal}. "
                "Fix: a smaller evaluation batch (`per_device_eval_batch_size`).\n"
                f"The error was: {message}")
        self.parts = min(self.parts * 2, layout.count)
        after = -(-layout.count // self.parts)
        log.warning("Out of memory in evaluation with batch %d (%ss): freed memory, predicting it in pieces "
                    "of %d (results are put back together). First line of the error: %s", before, layout.unit,
                    after, message.splitlines()[0] if message else "")
        self.events.append({"eval_batch_before": before, "eval_batch": after})


def concat(parts: list[Any], layout: Layout, count: int) -> Any:
    """Put the pieces' logits or labels back together in the batch's order (nested tuples, lists,
    dicts), as ``layout`` cut it into ``count`` pieces."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return layout.join(parts, count) if first.dim() else first
    if isinstance(first, dict):
        return type(first)({k: concat([p[k] for p in parts], layout, count) for k in first})
    if isinstance(first, (tuple, list)):
        return type(first)(concat(list(group), layout, count) for group in zip(*parts, strict=True))
    return first
