"""Target checks shared by the approximate-layer patches (not a patch: not auto-imported)."""

from __future__ import annotations

from collections.abc import Callable

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
