"""Target checks shared by the approximate-layer patches (not a patch: not auto-imported)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from memtrain.errors import MemtrainError
from memtrain.patches import NoMatchError, matches


def check_every_pattern(patterns: list[str], found: list[str], field: str,
                        also: Callable[[str], list[str]] = lambda p: []) -> None:
    """Raise :class:`NoMatchError` naming the patterns (or their ``also`` forms) that matched nothing."""
    unmatched = [p for p in patterns if not any(matches(n, q) for n in found for q in [p, *also(p)])]
    if unmatched:
        raise NoMatchError(
            f"`{field}`: the patterns {unmatched} match no module this patch can change (the other "
            f"patterns do). Fix: correct or remove them; matched so far: {', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}.")


def default_targets(model: nn.Module, field: str, defaults: dict[str, list[str]], technique: str,
                    can_patch: Callable[[nn.Module], Any], what: str) -> list[str]:
    """The architecture's default target patterns, or an error listing modules ``can_patch`` accepts.

    Args:
        defaults: model type -> patterns.
        technique: the patch, for the message (e.g. ``few-bit backward``).
        what: what the patterns name, for the message (e.g. ``activation module``).
    """
    from memtrain.patches import model_type

    kind = model_type(model)
    if kind in defaults:
        return defaults[kind]
    candidates = [n for n, m in model.named_modules() if n and can_patch(m) is not None]
    shown = ", ".join(candidates[:4]) or f"(this model has no {what} it can change)"
    raise MemtrainError(
        f"`{field}`: {technique} has no default targets for model type {kind!r}. Fix: set `{field}` "
        f"to {what} name patterns, e.g. {shown}."
    )
