"""What a replayed optimizer step must not do twice, and how recovery logs in the middle of a step.

Out-of-memory recovery (:mod:`memtrain.reliability.recovery`) redoes an optimizer step's
micro-batches after a failed attempt. The Trainer's loop counts each micro-batch's loss once (only
the current micro-batch's loss is returned to it), but a trainer's ``compute_loss`` may have side
effects of its own: TRL's trainers append metrics to ``_metrics`` and add the batch's tokens to
``_total_train_tokens`` (logged as ``num_tokens``) on every call. Those are copied when the step
begins and put back before it is replayed, so each micro-batch is counted once. Only the
attributes named in :data:`SIDE_EFFECTS` are known; a trainer with other side effects in
``compute_loss`` would see them repeated.
"""

from __future__ import annotations

import copy
from typing import Any

# Trainer attributes a step changes as a side effect and a replay would change again: TRL's metric
# lists (averaged at each log) and its running count of training tokens (logged as `num_tokens`).
SIDE_EFFECTS = ("_metrics", "_total_train_tokens")


def snapshot_effects(trainer: Any) -> dict[str, Any]:
    """A copy of the trainer's :data:`SIDE_EFFECTS` (those it has)."""
    return {name: copy.deepcopy(trainer.__dict__[name]) for name in SIDE_EFFECTS if name in trainer.__dict__}


def restore_effects(trainer: Any, effects: dict[str, Any]) -> None:
    """Put the trainer's :data:`SIDE_EFFECTS` back as :func:`snapshot_effects` copied them."""
    for name, value in effects.items():
        trainer.__dict__[name] = copy.deepcopy(value)


def log_entry(trainer: Any, logs: dict[str, float]) -> None:
    """Log in the middle of an optimizer step, stamped with that step (``global_step + 1``).

    Not through ``trainer.log``: a subclass's ``log`` may flush state meant for the step's own
    log (TRL's averages its ``_metrics`` there and clears them). The callbacks (reporting
    integrations) are called with ``state.global_step`` set to the step being redone, so that
    they file the entry under it too.
    """
    state = trainer.state
    done = state.global_step
    entry = dict(logs)
    if state.epoch is not None:
        entry["epoch"] = state.epoch
    state.log_history.append({**entry, "step": done + 1})
    state.global_step = done + 1
    try:
        trainer.control = trainer.callback_handler.on_log(trainer.args, state, trainer.control, entry)
    finally:
        state.global_step = done
