"""The error a user can fix. The CLI prints its message and exits with status 2, no traceback."""

from __future__ import annotations


class MemtrainError(Exception):
    """A problem with the user's input or environment; the message says what and how to fix it."""

    exit_code = 2
