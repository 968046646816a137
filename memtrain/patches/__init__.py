"""Model patchers: one memory technique per module, applied in a fixed order, and the registry of
every technique and setting the library knows.

Each technique module exposes ``Config`` and ``apply(model, config) -> model`` for Python users, and
registers itself with :func:`register` (a :class:`Technique`: its recipe hook, stage, recipe field,
``Config``, and the :class:`Knob` s the planner chooses). Trainer settings the planner chooses that
patch nothing (the optimizer, the adapter method, quantization, ...) are registered in
:mod:`memtrain.patches.settings` with :func:`register_setting`. What the rest of the library kept by
hand is derived from here: the planner's space and ranking (:mod:`memtrain.plan.space`), its plain
values and patched fields (:mod:`memtrain.plan.search`), what an estimate needs decided
(``memtrain.estimator.setup.NEEDS_VALUE``), and the README's and docs/RECIPES.md's tables of
techniques (``scripts/tools/gen_docs.py``).

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
from typing import TYPE_CHECKING, Any

from torch import nn

from memtrain.errors import MemtrainError, recipe_stage

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
class ModelShape:
    """What a knob's options and memory rank may read about the model (from its config, no weights)."""

    depth: int = 0  # repeated layers (``num_hidden_layers``)
    hidden: int = 0
    vocab: int = 0
    # layers per group where they repeat in groups (Gemma-2's sliding and global pair: 2;
    # memtrain.estimator.layers.Pattern.period), 1 where they are alike
    period: int = 1


@dataclass(frozen=True)
class Pass:
    """Work of part of a pass: matmul FLOPs, ops dispatched, bytes their outputs allocate."""

    flops: float = 0.0
    ops: int = 0
    written: int = 0

    def __add__(self, other: Pass) -> Pass:
        return Pass(self.flops + other.flops, self.ops + other.ops, self.written + other.written)

    def scaled(self, factor: float) -> Pass:
        return Pass(self.flops * factor, round(self.ops * factor), round(self.written * factor))


Options = Callable[["RunConfig", ModelShape], list[Any]]
Rank = Callable[[Any, ModelShape], tuple[int, ...]]
# device bytes a value keeps at least, for a recipe, a model and the rows of one micro-batch
Floor = Callable[["RunConfig", ModelShape, Any, int], int]


@dataclass(frozen=True)
class CostInputs:
    """What a knob's step-time cost hook (``Knob.cost``) reads about one candidate's micro-batch
    (``memtrain.plan.search``: the planner's prediction of a step, and its lower bound)."""

    cfg: RunConfig  # the recipe with the candidate's values: every field decided
    shape: ModelShape
    micro: int  # rows per micro-batch, each ``data.max_length`` tokens
    parameters: int  # every parameter of the model (4-bit ones at their logical size)
    trainable: int
    # a fake model of the recipe with its techniques off, at up to two layers (its shapes; None: none)
    model: Callable[[], nn.Module | None]
    # what checkpointing every decoder layer runs again at least, per micro-batch, and of it the
    # ops a selective checkpoint does not keep (``memtrain.estimator.trace.Work.recomputed``)
    recomputed: Pass
    recomputed_selective: Pass
    # a lower bound: the recipe its trace ran, whose techniques' work the trace counts already
    # (a hook adds the work its technique adds to that trace); None: the candidate's own trace
    traced: RunConfig | None = None

    @property
    def tokens(self) -> int:
        return self.micro * int(self.cfg.data.max_length)

    @property
    def element(self) -> int:
        """Bytes of a parameter element (the model's dtype)."""
        return 2 if self.cfg.model.dtype in ("bf16", "fp16") else 4


# The step-time terms a value adds (``memtrain.plan.costmodel.step_seconds``' arguments, and
# ``extra_flops`` / ``extra_ops`` / ``extra_written``: matmul FLOPs, ops and bytes written a lower
# bound's trace did not run), from a candidate's inputs
Cost = Callable[[CostInputs, Any], dict[str, float]]
COST_TERMS = ("extra_flops", "extra_ops", "extra_written", "recompute_passes", "quantized_elements",
              "extra_dequantized", "embedding_bytes", "optimizer_offloaded")


@dataclass(frozen=True)
class Doc:
    """A technique's row in the README's table and docs/RECIPES.md (``scripts/tools/gen_docs.py``)."""

    title: str
    setting: str  # how a recipe turns it on (markdown)
    trades: str  # what it saves and what it costs
    details: str  # links to the guide and the benchmark tables


@dataclass(frozen=True)
class Knob:
    """One recipe field the planner may decide (``auto``), with everything the planner needs.

    Attributes:
        path: the dotted recipe field.
        options: its candidate values for a recipe and model, from most memory kept to least.
        off: its value with the technique off (what the plain trace of a candidate uses).
        order: where the planner enumerates it among the knobs, and where an estimate checks it
            (lower first: candidates enumerated first win exact ties of the time bound).
        rank: the position of a value in the memory order, as a vector (checkpointing is 2-D:
            selective and n-of-L are not comparable); default ``(0,)`` at ``off``, else ``(1,)``.
        exact: the technique changes no loss or gradient (beyond rounding).
        plannable: ``auto`` is allowed and the planner chooses it.
        plugin: the plugin (``prepare_for_budget``) may choose it for a user's Trainer: a patch's
            knob is then planned and applied by ``memtrain.plugin`` (``apply_patches``, limited to
            such patches); False where it needs memtrain's own Trainer or step, with the reason
            written beside the registration.
        patches_model: a value other than ``off`` patches the model, so its applicability shows on
            a fake model before any trace (``memtrain.plan.search.PATCHED_FIELDS``).
        needs_value: an estimate needs it decided (``memtrain.estimator.setup.NEEDS_VALUE``).
        base: part of the model being trained (quantization, adapter): kept, not turned off, in
            the plain trace of a candidate.
        technique: a value other than ``off`` counts as one memory technique in the planner's tie
            rule (LoRA vs full fine-tuning does not).
        cost: its step-time cost hook (:data:`Cost`): the terms its value adds to the cost
            model's step (:data:`COST_TERMS`), or None where the trace's counts already say it
            (the optimizer's rate is read by its name; activation offload's transfers are the
            estimate's host bytes).
        to_host: a value other than ``off`` moves device bytes to the host, so the memory order
            is reversed on the host (an offload). Every other knob's leaner values keep no more on
            the host either (fewer saved activations offload fewer bytes), which lets the planner
            prune by the host budget too (``memtrain.plan.search``).
        lowers_cost: a value other than ``off`` can make some term of the step cheaper (the lean
            norm writes fewer bytes than the norm it replaces), so the planner's lower bound for a
            candidate traces it as the candidate has it rather than off
            (``memtrain.plan.search.Search.lower_bound``; tests/plan/test_lower_bound.py).
        sizes: the technique field this knob sizes (a tile or chunk size), or "": where the planner
            turns that technique off, a size the recipe fixed is dropped with it
            (``memtrain.plan.space.with_values``), as the recipe's checks require.
        unordered_offloaded: under activation offload its values have no memory order on the
            device (the planner does not prune one by another there;
            ``memtrain.plan.search.Search.dominated``): what the technique keeps on the device is
            partly what offload would have moved. On the host the order holds (what it saves less,
            offload moves less; ``scripts/bench/planner/dominance.py --host`` audits it).
        floor: device bytes a value keeps at least, at one moment of any step, whatever the other
            settings, from the recipe (its ``data.max_length`` rows), the model's shape and the
            rows of a micro-batch (0: no floor); the planner rejects a candidate whose floor
            exceeds the budget without tracing it (``memtrain.plan.search.Search.floor``). A floor
            must hold for every model and library version the estimator traces:
            tests/plan/test_knob_floors.py checks each registered one against traced peaks.
        slower_when_leaner: its leaner values never make a step faster: each only adds work (a
            transfer, a recompute, more and smaller tiles) and lowers no cost term. A candidate
            that is leaner than one that fits only in such fields, with more memory techniques,
            is never chosen, so the planner does not trace it (``memtrain.plan.search``;
            scripts/bench/planner/dominance.py ``--time`` checks the order on every candidate).
        unordered_time_offloaded: under activation offload its leaner values can make a step
            faster after all: they save fewer bytes for backward, and offload moves fewer (the
            tiled MLP keeps only each MLP's input), so ``slower_when_leaner`` holds only without
            activation offload (the audit above: 36 of 1,184 pairs, all tiled MLP on vs off under
            offload, up to 1.07 s of a step faster, before this rule).
        holds_same: its values leave what a step holds on the device from start to end as it is
            (the weights, buffers and optimizer state): it acts on activations alone. A candidate
            that differs from its plain trace (the one its time bound traces) only in such fields
            holds that trace's bytes throughout, which the planner adds to a floor
            (``memtrain.plan.search.Search.floor``; tests/plan/test_knob_floors.py checks the sum
            against traced peaks). False (the default) where a value moves, shards, adds or
            shrinks weights or optimizer state (embedding or optimizer offload, sharding, an 8-bit
            optimizer, a precomputed reference) or has not been checked (the approximate layers).
    """

    path: str
    options: Options
    off: Any
    order: int
    rank: Rank | None = None
    exact: bool = True
    plannable: bool = True
    plugin: bool = False
    patches_model: bool = False
    needs_value: bool = True
    base: bool = False
    technique: bool = True
    cost: Cost | None = None
    to_host: bool = False
    lowers_cost: bool = False
    sizes: str = ""
    unordered_offloaded: bool = False
    floor: Floor | None = None
    slower_when_leaner: bool = False
    unordered_time_offloaded: bool = False
    holds_same: bool = False

    def rank_of(self, value: Any, shape: ModelShape) -> tuple[int, ...]:
        """``value``'s position in this knob's memory order."""
        if self.rank is not None:
            return self.rank(value, shape)
        return (0,) if value == self.off or value is None else (1,)

    def turns_on(self, value: Any) -> bool:
        """Whether ``value`` counts as one memory technique in the planner's tie rule."""
        return self.technique and value != self.off


def fixed(*values: Any) -> Options:
    """Options that do not depend on the recipe or the model."""
    return lambda cfg, shape: list(values)


def one_process(*values: Any) -> Options:
    """``values`` with one process; only the first (off) with several."""
    return lambda cfg, shape: list(values) if cfg.distributed.processes == 1 else [values[0]]


def approximate(*values: Any) -> Options:
    """``values`` when the recipe allows approximate techniques; only the first (off) otherwise."""
    return lambda cfg, shape: list(values) if cfg.memory.allow_approximate else [values[0]]


@dataclass(frozen=True)
class Technique:
    """A registered technique (a patch, ``hook`` and ``stage`` set) or setting (no hook).

    Attributes:
        name: the module's name for a patch (``tiled_mlp``); the setting's short name otherwise.
        field: the recipe field that turns it on, named in build errors.
        stage: when :func:`apply_patches` runs the hook (patches only).
        hook: ``hook(model, run_cfg) -> model | None`` (None: the recipe does not use it).
        config: the ``Config`` class :attr:`apply` takes.
        apply: ``apply(model, config) -> model`` for Python users.
        knobs: the recipe fields the planner may decide for it.
        doc: its row in the generated tables of techniques (None: not listed).
    """

    name: str
    field: str
    stage: int | None = None
    hook: RecipeHook | None = None
    config: type | None = None
    apply: Callable[..., nn.Module] | None = None
    knobs: tuple[Knob, ...] = ()
    doc: Doc | None = None


_REGISTRY: dict[str, Technique] = {}
# names a patch had before the registry used module names: still accepted where a name is read
ALIASES = {"offload": "activation_offload", "offload_embeddings": "embedding_offload"}


class NoMatchError(MemtrainError):
    """A name pattern of a patch matched no module of the model."""


class UnknownPatchError(MemtrainError):
    """A patch name that is not registered."""


def register(name: str, stage: int, field: str, *, config: type | None = None,
             apply: Callable[..., nn.Module] | None = None, knobs: tuple[Knob, ...] = (),
             doc: Doc | None = None) -> Callable[[RecipeHook], RecipeHook]:
    """Register ``hook(model, run_cfg) -> model | None`` (None: the recipe does not use it) as the
    patch ``name`` (its module's name), applied at ``stage`` and turned on by the recipe field
    ``field``; ``config``, ``apply``, ``knobs`` and ``doc`` as in :class:`Technique`."""

    def wrap(hook: RecipeHook) -> RecipeHook:
        module = hook.__module__.rpartition(".")[2]
        if hook.__module__.startswith(f"{__name__}.") and module != name:
            raise ValueError(f"patch {name!r} is registered in module {module!r}: name it {module!r}")
        _add(Technique(name, field, stage, hook, config, apply, knobs, doc))
        return hook

    return wrap


def register_setting(name: str, field: str, knobs: tuple[Knob, ...], doc: Doc | None = None) -> None:
    """Register a setting the planner chooses that patches no model (no hook), e.g. the optimizer."""
    _add(Technique(name, field, knobs=knobs, doc=doc))


def _add(technique: Technique) -> None:
    old = _REGISTRY.get(technique.name)
    if old is not None and (old.hook is not technique.hook or old.hook is None):
        raise ValueError(f"technique {technique.name!r} is registered twice")
    paths = {k.path for t in _REGISTRY.values() if t.name != technique.name for k in t.knobs}
    if clash := paths & {k.path for k in technique.knobs}:
        raise ValueError(f"technique {technique.name!r}: {sorted(clash)} already registered")
    _REGISTRY[technique.name] = technique
    _KNOBS.clear()


_LOADED: list[bool] = []  # the package's modules were all imported once (a listing costs ~1 ms)
_KNOBS: dict[str, Knob] = {}  # path -> knob, rebuilt after a registration


def _load_all() -> None:
    """Import every module of this package: each registers its patch on import."""
    if _LOADED:
        return
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _LOADED.append(True)


def techniques() -> list[Technique]:
    """Every registered technique and setting: patches in application order, then settings by name."""
    _load_all()
    return sorted(_REGISTRY.values(), key=lambda t: (t.stage is None, t.stage or 0, t.name))


def available() -> list[str]:
    """Names of all registered patches, in application order."""
    return [t.name for t in techniques() if t.hook is not None]


def technique(name: str) -> Technique:
    """A registered technique or setting (an old patch name is accepted); unknown names raise an
    error listing the valid ones."""
    _load_all()
    name = ALIASES.get(name, name)
    if name not in _REGISTRY:
        valid = ", ".join(t.name for t in techniques())
        raise UnknownPatchError(f"Unknown patch {name!r}. Valid patches: {valid}.")
    return _REGISTRY[name]


def get(name: str) -> RecipeHook:
    """The recipe hook of a patch; unknown names raise an error listing the valid ones."""
    hook = technique(name).hook
    if hook is None:
        raise UnknownPatchError(f"{name!r} is a setting, not a patch. "
                                f"Valid patches: {', '.join(available())}.")
    return hook


def recipe_field(name: str) -> str:
    """The recipe field of a registered patch (``memory.loss`` for ``chunked_loss``)."""
    return technique(name).field


def knobs() -> list[Knob]:
    """Every field the planner may decide, in the planner's order."""
    return sorted((k for t in techniques() for k in t.knobs), key=lambda k: k.order)


def sizes_off(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (dotted field -> value) with the size of each technique it turns off set off too
    (``Knob.sizes``: a tile size means "if tiled"), unless ``values`` sets that size itself."""
    for k in knobs():
        if k.sizes in values and k.path not in values and values[k.sizes] == knob(k.sizes).off:
            values = {**values, k.path: k.off}
    return values


def knob(path: str) -> Knob:
    """The registered knob of a recipe field.

    Raises:
        KeyError: no technique registers ``path``.
    """
    if not _KNOBS:
        _KNOBS.update((k.path, k) for k in knobs())
    if path in _KNOBS:
        return _KNOBS[path]
    raise KeyError(f"no registered technique decides {path!r}")


def technique_table(reference: bool = False) -> str:
    """Markdown table of every registered technique that has a :class:`Doc` (README's table; with
    ``reference``, docs/RECIPES.md's: the registry name, recipe fields, exactness, `auto`)."""
    if reference:
        rows = ["| technique | registered as | recipe fields | exact | `auto` (planner) |",
                "| --- | --- | --- | --- | --- |"]
        for t in techniques():
            if t.doc is not None:
                fields = ", ".join(f"`{k.path}`" for k in t.knobs) or f"`{t.field}`"
                exact = "yes" if all(k.exact for k in t.knobs) else "approximate"
                auto = "yes" if any(k.plannable for k in t.knobs) else "no"
                kind = f"`patches/{t.name}.py`" if t.hook is not None else f"`{t.name}` (setting)"
                rows.append(f"| {t.doc.title} | {kind} | {fields} | {exact} | {auto} |")
        return "\n".join(rows) + "\n"
    rows = ["| technique | recipe setting | what it trades | details |", "| --- | --- | --- | --- |"]
    rows += [f"| {t.doc.title} | {t.doc.setting} | {t.doc.trades} | {t.doc.details} |"
             for t in techniques() if t.doc is not None]
    return "\n".join(rows) + "\n"


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or ``model`` itself): the one unwrap."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def num_layers(model: nn.Module) -> int | None:
    """The model's layer count from its config (``num_hidden_layers``, ``n_layer``...), if any."""
    config = getattr(base_model(model), "config", None)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's repeated layers, by the one rule every part of memtrain uses (checkpointing and
    activation offload wrap them, the approximate layers and the tiled MLP find their default
    targets inside them, the estimator marks each op with its layer to extrapolate along depth).

    A layer list is an ``nn.ModuleList`` whose entries are all of one class, are composite (have
    submodules) and hold parameters, and which lies inside no other layer list: ``model.layers``,
    ``transformer.h``, ``bert.encoder.layer``, also under a peft wrapper; experts inside a layer
    belong to the layer. Where the config gives a layer count (:func:`num_layers`), only lists of
    that length are layers: a list of blocks beside the layers is not, and a model that shares
    one layer across its depth (ALBERT) has none. An encoder-decoder model has two when its
    decoder is as deep as its encoder (T5's ``num_decoder_layers``), else its encoder's alone.
    Returns ``(name, list)`` in model order.
    """
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():  # pre-order: an outer list comes first
        if not (name and isinstance(module, nn.ModuleList) and len(module) > 0):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        first = module[0]
        if (len({type(m) for m in module}) == 1 and any(True for _ in first.children())
                and any(True for _ in first.parameters())):
            found.append((name, module))
    count = num_layers(model)
    return found if count is None else [(name, module) for name, module in found if len(module) == count]


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every repeated layer (:func:`layer_lists`) with its name in ``model``, in model order."""
    return [(f"{name}.{i}", layer) for name, module in layer_lists(model) for i, layer in enumerate(module)]


def apply_patches(model: nn.Module, cfg: RunConfig, only: Iterable[str] | None = None) -> nn.Module:
    """Apply every patch the recipe asks for, in stage order; returns the (possibly new) model.
    ``memtrain train``, the estimator's fake model and the plugin all patch through here; a library
    error inside a patch becomes a :class:`~memtrain.errors.BuildError` naming its recipe field."""
    wanted = {ALIASES.get(n, n) for n in only} if only is not None else None
    for entry in techniques():
        if entry.hook is None or (wanted is not None and entry.name not in wanted):
            continue
        with recipe_stage(entry.field, f"applying the {entry.name} patch"):
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
    name = ALIASES.get(name, name)
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
