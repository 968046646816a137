"""The error a user can fix. The CLI prints its message and exits with status 2, no traceback."""

from __future__ import annotations


class MemtrainError(Exception):
    """A problem with the user's input or environment; the message says what and how to fix it."""

    exit_code = 2


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type name when the message is empty), for a
    :class:`MemtrainError` that names what went wrong underneath."""
    message = str(err).strip()
    return message.splitlines()[0] if message else type(err).__name__


TRL_MISSING = ("`training.objective: dpo` (and `data.format: preference`) run TRL's DPOTrainer, and TRL is "
               "not installed. Fix: pip install 'trl>=1.16' (or memtrain[dpo]).")
