"""The error a user can fix. The CLI prints its message and exits with status 2, no traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MemtrainError(Exception):
    """A problem with the user's input or environment; the message says what and how to fix it."""

    exit_code = 2


class BuildError(MemtrainError):
    """Building what a recipe describes failed; the message names the recipe field involved."""


@contextmanager
def recipe_stage(field: str, what: str) -> Iterator[None]:
    """Turn a library exception raised while doing ``what`` into a :class:`BuildError` naming ``field``."""
    try:
        yield
    except MemtrainError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise BuildError(f"`{field}`: {what} failed: {type(err).__name__}: {first}. Fix: check `{field}` "
                         "(and that the model supports it).") from err


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type name when the message is empty), for a
    :class:`MemtrainError` that names what went wrong underneath."""
    message = str(err).strip()
    return message.splitlines()[0] if message else type(err).__name__


TRL_MISSING = ("`training.objective: dpo` (and `data.format: preference`) run TRL's DPOTrainer, and TRL is "
               "not installed. Fix: pip install 'trl>=1.16' (or memtrain[dpo]).")
