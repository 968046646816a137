"""Target finding shared by the approximate-layer patches (not a patch: not auto-imported).

Default targets are found from the model's structure, not from a table per model type, so they
work for any decoder or encoder model transformers builds: the *blocks* are the model's repeated
layers by memtrain's one rule (:func:`memtrain.patches.layer_lists`: ``model.layers``,
``transformer.h``, ``bert.encoder.layer``, also under a peft wrapper), and a
patch's default targets are the modules inside those blocks that it can change. Embeddings, the
final norm and the task head live outside the blocks, so they are never defaults.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memtrain.errors import MemtrainError
from memtrain.patches import NoMatchError, layer_lists, layers, matches


def check_every_pattern(patterns: list[str], found: list[str], field: str,
                        also: Callable[[str], list[str]] = lambda p: []) -> None:
    """Raise :class:`NoMatchError` naming the patterns (or their ``also`` forms) that matched nothing."""
    unmatched = [p for p in patterns if not any(matches(n, q) for n in found for q in [p, *also(p)])]
    if unmatched:
        raise NoMatchError(
            f"`{field}`: the patterns {unmatched} match no module this patch can change (the other "
            f"patterns do). Fix: correct or remove them; matched so far: {', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}.")


def block_lists(model: nn.Module) -> list[str]:
    """Names of the model's repeated-layer lists (:func:`memtrain.patches.layer_lists`)."""
    return [name for name, _ in layer_lists(model)]


def blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks themselves (``model.layers.0``, ``model.layers.1``, ...)."""
    return [name for name, _ in layers(model)]


def default_modules(model: nn.Module, field: str, technique: str, what: str,
                    accept: Callable[[str, nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The modules inside the model's blocks that ``accept(name, module)`` takes, in model order.

    Args:
        field: the recipe field that overrides the defaults, for the message.
        technique: the patch, for the message (e.g. ``few-bit backward``).
        what: what the patch changes, for the message (e.g. ``activation module``).

    Raises:
        MemtrainError: the model has no block list, or no accepted module inside one; the message
            lists accepted modules anywhere in this model as examples for ``field``.
    """
    prefixes = tuple(f"{outer}." for outer in block_lists(model))
    found = [(name, module) for name, module in model.named_modules()
             if name.startswith(prefixes) and accept(name, module)] if prefixes else []
    if found:
        return found
    where = ("inside its repeated blocks (" + ", ".join(p[:-1] for p in prefixes) + ")" if prefixes
             else "because it has no repeated blocks (an nn.ModuleList of layers)")
    candidates = [n for n, m in model.named_modules() if n and accept(n, m)]
    shown = (", ".join(candidates[:4]) + (", ..." if len(candidates) > 4 else "")
             or f"(this model has no {what} this patch can change)")
    raise MemtrainError(
        f"`{field}`: {technique} has no default targets for this model: it finds no {what} "
        f"{where}. Fix: set `{field}` to {what} name patterns, e.g. {shown}.")
