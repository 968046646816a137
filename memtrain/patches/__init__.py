"""Model patchers: one memory technique per module, applied in a fixed order.

Each technique module exposes ``Config`` and ``apply(model, cfg) -> model`` for Python users, and
registers a recipe hook with :func:`register` that reads its settings from a :class:`RunConfig`.
:func:`apply_patches` runs the hooks in order: adapter -> loss -> approximate layers -> tiling (lean
norm, tiled MLP) -> checkpointing -> offload (an adapter changes module names and which weights need
gradients; checkpointing must wrap layers whose contents are final, the tiled MLP and lean norms
included; offload hooks see what checkpointing saves). Patches of one stage run in name order.

Patches record what they touched (:class:`PatchRecord`, read back with :func:`records`) and
raise :class:`NoMatchError` when a name pattern matches nothing.
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from memtrain.errors import MemtrainError

if TYPE_CHECKING:
    from memtrain.config import RunConfig

# Stages, in the order they are applied.
ADAPTER, LOSS, APPROXIMATE, TILING, CHECKPOINTING, OFFLOAD = 10, 15, 20, 25, 30, 40

RecipeHook = Callable[[nn.Module, "RunConfig"], nn.Module | None]


@dataclass
class PatchRecord:
    """What a patch did: its name, the modules it changed, a one-line summary, how to undo it."""

    name: str
    modules: list[str]
    detail: str = ""
    undo: Callable[[], None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Entry:
    name: str
    stage: int
    hook: RecipeHook
    field: str  # the recipe field that turns it on, named in errors


_REGISTRY: dict[str, _Entry] = {}


class NoMatchError(MemtrainError):
    """A name pattern of a patch matched no module of the model."""


class UnknownPatchError(MemtrainError):
    """A patch name that is not registered."""


def register(name: str, stage: int, field: str) -> Callable[[RecipeHook], RecipeHook]:
    """Register ``hook(model, run_cfg) -> model | None`` (None: the recipe does not use it) as the
    patch ``name``, applied at ``stage`` and turned on by the recipe field ``field``."""

    def wrap(hook: RecipeHook) -> RecipeHook:
        if name in _REGISTRY and _REGISTRY[name].hook is not hook:
            raise ValueError(f"patch {name!r} is registered twice")
        _REGISTRY[name] = _Entry(name, stage, hook, field)
        return hook

    return wrap


def _load_all() -> None:
    """Import every module of this package: each registers its patch on import."""
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def available() -> list[str]:
    """Names of all registered patches, in application order."""
    _load_all()
    return [e.name for e in sorted(_REGISTRY.values(), key=lambda e: (e.stage, e.name))]


def get(name: str) -> RecipeHook:
    """The recipe hook of a patch; unknown names raise an error listing the valid ones."""
    _load_all()
    if name not in _REGISTRY:
        raise UnknownPatchError(f"Unknown patch {name!r}. Valid patches: {', '.join(available())}.")
    return _REGISTRY[name].hook


def recipe_field(name: str) -> str:
    """The recipe field of a registered patch (``memory.loss`` for ``chunked_loss``)."""
    get(name)  # loads the registry; an unknown name lists the valid ones
    return _REGISTRY[name].field


def apply_patches(model: nn.Module, cfg: RunConfig, only: Iterable[str] | None = None) -> nn.Module:
    """Apply every patch the recipe asks for, in stage order; returns the (possibly new) model."""
    _load_all()
    wanted = set(only) if only is not None else None
    for entry in sorted(_REGISTRY.values(), key=lambda e: (e.stage, e.name)):
        if wanted is not None and entry.name not in wanted:
            continue
        patched = entry.hook(model, cfg)
        if patched is not None:
            if patched is not model:
                add_records(patched, records(model))
            model = patched
    return model


# -------------------------------------------------------------------------------- bookkeeping

_RECORDS_ATTR = "_memtrain_patch_records"


def add_records(model: nn.Module, new: Iterable[PatchRecord]) -> None:
    """Attach patch records to a model (kept in its ``__dict__``, not as a submodule)."""
    existing = model.__dict__.setdefault(_RECORDS_ATTR, [])
    existing.extend(r for r in new if r not in existing)


def records(model: nn.Module) -> list[PatchRecord]:
    """The patches applied to ``model`` (also through a peft wrapper), in order."""
    return list(model.__dict__.get(_RECORDS_ATTR, []))


def undo_records(model: nn.Module, name: str) -> nn.Module:
    """Undo what the patch ``name`` applied to ``model`` and drop its records; returns ``model``."""
    for record in records(model):
        if record.name == name and record.undo is not None:
            record.undo()
    model.__dict__[_RECORDS_ATTR] = [r for r in records(model) if r.name != name]
    return model


# ------------------------------------------------------------------------------ name matching


def matches(name: str, pattern: str) -> bool:
    """Does module ``name`` match ``pattern``?

    ``re:<regex>`` is searched in the full name; any other pattern is a glob matched against the
    full name or against any dotted suffix of it (``mlp.act_fn`` matches
    ``model.layers.3.mlp.act_fn``).
    """
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def find_modules(
    model: nn.Module,
    patterns: Iterable[str],
    predicate: Callable[[nn.Module], bool] = lambda m: True,
    field_name: str = "targets",
) -> list[tuple[str, nn.Module]]:
    """Modules whose name matches any pattern and which satisfy ``predicate``.

    Raises:
        NoMatchError: nothing matched; the message lists a few candidate names.
    """
    patterns = list(patterns)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name and predicate(module) and any(matches(name, p) for p in patterns)
    ]
    if not found:
        candidates = [n for n, m in model.named_modules() if n and predicate(m)]
        shown = ", ".join(candidates[:6]) + (", ..." if len(candidates) > 6 else "")
        raise NoMatchError(
            f"`{field_name}`: the patterns {patterns} match no module of this model. "
            f"Fix: use name patterns such as {shown or '(no module of the right type exists)'}."
        )
    return found


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Replace the submodule at dotted ``name``; returns the old one."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, new)
    return old


def model_type(model: nn.Module) -> str:
    """The transformers ``model_type`` of a (possibly peft-wrapped) model, or ``""``."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", "") or ""
