"""The building blocks of the recipe schema: :class:`Section`, :class:`Problem` and shared types.

Checks that involve several fields live in ``after`` validators. They do not raise: they append a
:class:`Problem` to the list passed in the validation context (:func:`report_problem`), so that one
pass reports every mistake of a recipe at once, even when another section has type errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo

from memtrain.errors import MemtrainError

Auto = Literal["auto"]


def decided(value: Any, field: str, choices: str) -> Any:
    """``value`` once the planner has chosen it; a field still at ``auto`` is a user error.

    ``choices`` completes the fix, e.g. ``"true or false"``.
    """
    if value == "auto":
        raise MemtrainError(f"`{field}` is `auto`: run the planner first (`memtrain plan`), "
                            f"or set {choices}.")
    return value


def _unit_fraction(v: float | str) -> float | str:
    if isinstance(v, float) and not 0 <= v < 1:
        raise ValueError("a fraction must be in [0, 1)")
    return v


# A fraction in [0, 1), or one of the words its field allows (checked after the union resolves,
# so a bad number gets one message instead of one per member of the union).
FractionOr = AfterValidator(_unit_fraction)
DType = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Problem:
    """One mistake in a recipe: where it is, what was found, and how to fix it."""

    path: str
    value: Any
    message: str
    fix: str = ""

    def __str__(self) -> str:
        shown = "" if self.value is MISSING else f", got {self.value!r}"
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"`{self.path}`: {self.message}{shown}.{fix}"


# The value of a :class:`Problem` about a key that is absent (required, needed with another
# setting, unknown): its message then shows no ``got ...``. Shared by every section's checks.
MISSING = object()


def report_problem(info: ValidationInfo, problem: Problem) -> None:
    """Record a cross-field problem in the validation context (see module docstring).

    Every section's ``after`` validators call it instead of raising.
    """
    if info.context is not None and "problems" in info.context:
        info.context["problems"].append(problem)
    else:  # validated outside load_recipe: fail loudly rather than lose the problem
        raise ValueError(str(problem))


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

