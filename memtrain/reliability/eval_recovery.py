"""Out-of-memory recovery in evaluation: an evaluation batch that does not fit is split and redone.

Evaluation holds no gradients and no optimizer step to protect, so recovery is simpler than in
training (:mod:`memtrain.reliability.recovery`): when the Trainer's ``prediction_step`` on a batch runs out of
memory (``torch.OutOfMemoryError``, or the ``RuntimeError`` of a failed CPU allocation), the batch
is split in two along its rows, each piece is predicted alone and the results are put back
together: logits and labels concatenated in row order, the loss averaged with each piece weighted
by its share of the batch's items (labels other than -100, as
:func:`memtrain.reliability.recovery.count_items`
counts them), which is exact for a mean loss such as the models' own. The split is kept for the
rest of the run and halves again on a further error, down to one example.

Pieces are cut from the padded batch, so they keep its sequence length and their logits
concatenate as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain.reliability.recovery import (
    MicroBatchTooLarge,
    batch_rows,
    count_items,
    free_memory,
    is_out_of_memory,
    reset_module_tracking,
    split_batch,
)

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

    def install(self) -> EvalBatchRecovery:
        """Make the trainer predict through :meth:`prediction_step` (an instance attribute)."""
        self.trainer.prediction_step = self.prediction_step
        return self

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """The Trainer's ``prediction_step``, recovering from out-of-memory errors (same signature)."""
        while True:
            try:
                return self._predict(model, inputs, prediction_loss_only, ignore_keys)
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if isinstance(err, MicroBatchTooLarge) or not is_out_of_memory(err):
                    raise
                message = str(err)
            # Outside the except block the failed attempt's tensors are gone.
            self._shrink(inputs, message)

    def _predict(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                 ignore_keys: list[str] | None) -> tuple[Any, Any, Any]:
        if self.parts == 1:
            return self.predict_fn(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        pieces = split_batch(inputs, self.parts)
        results = [self.predict_fn(model, piece, prediction_loss_only, ignore_keys=ignore_keys)
                   for piece in pieces]
        losses = [r[0] for r in results]
        loss = None
        if all(v is not None for v in losses):
            items = [count_items(self.trainer, piece) for piece in pieces]
            weights = items if sum(items) else [batch_rows(piece) for piece in pieces]
            loss = sum(v * (w / sum(weights)) for v, w in zip(losses, weights, strict=True))
        return loss, concat([r[1] for r in results]), concat([r[2] for r in results])

    def _shrink(self, inputs: dict[str, Any], message: str) -> None:
        free_memory()
        reset_module_tracking()
        rows = batch_rows(inputs)
        before = -(-rows // min(self.parts, rows))
        if before <= 1:
            raise MicroBatchTooLarge(
                "Out of memory evaluating one example: no split of the evaluation batch can help. Fix: a "
                "larger budget, a shorter maximum length, or `eval_strategy='no'`.\n"
                f"The error was: {message}")
        self.parts = min(self.parts * 2, rows)
        after = -(-rows // self.parts)
        log.warning("Out of memory in evaluation with batch %d: freed memory, predicting it in pieces of %d "
                    "(results are put back together). First line of the error: %s", before, after,
                    message.splitlines()[0] if message else "")
        self.events.append({"eval_batch_before": before, "eval_batch": after})


def concat(parts: list[Any]) -> Any:
    """Put the pieces' logits or labels back together along the rows (nested tuples, lists, dicts)."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else first
    if isinstance(first, dict):
        return type(first)({k: concat([p[k] for p in parts]) for k in first})
    if isinstance(first, (tuple, list)):
        return type(first)(concat(list(group)) for group in zip(*parts, strict=True))
    return first
