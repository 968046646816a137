"""The planner's candidate space: which values each ``auto`` field can take, in memory order.

Every field the planner may decide is a :class:`memtrain.patches.Knob`, registered with its
technique (:mod:`memtrain.patches`): this module only reads the registry. A *candidate*
(:class:`Candidate`) is one combination of values for the ``auto`` fields of a recipe.
:func:`options` lists a field's values from "keeps most memory" to "keeps least" and :func:`rank`
places a value in that order (the search prunes by it, see :mod:`memtrain.plan.planner`).
:func:`with_values` sets dotted fields on a recipe and re-validates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memtrain import patches
from memtrain.config import RunConfig
from memtrain.config.batch import Batch, resolve_batch, valid_batches
from memtrain.estimator.layers import layer_pattern
from memtrain.estimator.setup import NEEDS_VALUE, recipe_value, resolve_config
from memtrain.patches import ModelShape

IN_BACKWARD = "training.optimizer_in_backward"


@dataclass
class Candidate:
    """One combination of values for the ``auto`` fields, with its predictions."""

    values: dict[str, Any]  # dotted field -> value (the `auto` fields only)
    micro: int = 0
    accumulation: int = 0
    peak: int = 0  # predicted device bytes (tensors + CUDA overheads) at the chosen micro-batch
    seconds: float = math.inf  # predicted seconds per optimizer step
    parts: dict[str, float] = field(default_factory=dict)
    min_peak: int = 0  # predicted peak at the smallest micro-batch
    host: int = 0  # predicted host bytes (offloaded tensors) at the chosen micro-batch, else the smallest
    moved: int = 0  # activation bytes its offload moves to the host per micro-batch, at ``host``'s
    reason: str = ""  # why it was not chosen
    measured: float | None = None  # seconds of a real step, when the plan was tuned

    def label(self) -> str:
        shown = dict(self.values)
        if self.micro:
            shown.update(micro=self.micro, accumulation=self.accumulation)
        return ", ".join(f"{SHORT.get(k, k.split('.')[-1])}={_show(v)}" for k, v in shown.items())


# labels of fields whose last name says too little (`optimizer=false` beside `optimizer=adamw_8bit`)
SHORT = {"memory.offload.activations": "offload_act", "memory.offload.optimizer": "offload_opt"}


def auto_fields(cfg: RunConfig) -> list[str]:
    """The dotted fields of ``cfg`` the planner must decide."""
    searched = [k.path for k in patches.knobs() if k.plannable and k.path not in NEEDS_VALUE]
    paths = [*NEEDS_VALUE, *searched, "data.max_length"]
    return [p for p in paths if recipe_value(cfg, p) == "auto"]


def model_shape(cfg: RunConfig, depth: int | None = None) -> ModelShape:
    """What the knobs read about ``cfg``'s model (its config, no weights); ``depth`` overrides
    the config's layer count."""
    config = resolve_config(cfg.model)[0]
    size = lambda name: int(getattr(config, name, 0) or 0)  # noqa: E731
    layers = size("num_hidden_layers") if depth is None else depth
    period = layer_pattern(cfg, config, layers).period  # layers repeating in groups (Gemma-2: 2)
    return ModelShape(layers, size("hidden_size"), size("vocab_size"), period)


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A re-validated copy of ``cfg`` with dotted fields set.

    A technique ``values`` turns off drops the size the recipe fixed for it (``Knob.sizes``: a
    tile size means "if tiled"), unless ``values`` sets that size too.

    Raises:
        ValueError: the combination is invalid (e.g. a quantized base trained in full).
    """
    data = cfg.model_dump(mode="json")
    values = patches.sizes_off(values)
    for path, value in values.items():
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    context: dict[str, Any] = {"problems": []}
    new = RunConfig.model_validate(data, context=context)
    if context["problems"]:
        raise ValueError("; ".join(str(p) for p in context["problems"]))
    return new


def options(cfg: RunConfig, path: str, shape: ModelShape) -> list[Any]:
    """Candidate values of one `auto` field, from most memory kept to least (its registered knob)."""
    return patches.knob(path).options(cfg, shape)


def ladder(cfg: RunConfig, path: str) -> list[Any]:
    """The values the planner tries for the `auto` field ``path`` of ``cfg``'s model, most memory
    first (its knob's options for the model's shape: a tile or chunk size ladder, for example)."""
    return options(cfg, path, model_shape(cfg))


def rank(path: str, value: Any, depth: int, vocab: int = 0) -> tuple[int, ...]:
    """Position of ``value`` in its field's memory order, as a vector (checkpointing is 2-D:
    selective and n-of-L are not comparable); ``vocab`` places a loss chunk size around the rule."""
    return patches.knob(path).rank_of(value, ModelShape(depth, 0, vocab))


def to_host(path: str) -> bool:
    """Whether ``path``'s technique moves device bytes to the host (its knob's ``to_host``)."""
    return patches.knob(path).to_host


def turns_on(path: str, value: Any, depth: int) -> bool:
    """Whether ``value`` of ``path`` counts as one memory technique in the tie rule: a value other
    than its knob's off value (LoRA vs full fine-tuning is not one; a size other than its default
    is, so ties keep the default)."""
    return patches.knob(path).turns_on(value)


def plain(fields: list[str]) -> dict[str, Any]:
    """Each of ``fields`` with its technique off; the model's own fields (quantization, adapter) are
    left out: a plain trace keeps them."""
    by_path = {k.path: k for k in patches.knobs()}
    return {f: by_path[f].off for f in fields if f in by_path and not by_path[f].base}


def base_fields() -> tuple[str, ...]:
    """The fields that describe the model being trained (kept in a plain trace)."""
    return tuple(k.path for k in patches.knobs() if k.base)


def bound_fields() -> tuple[str, ...]:
    """The fields a lower bound traces as the candidate has them: the model's own, and techniques
    that can make a step cheaper (``Knob.lowers_cost``)."""
    return tuple(k.path for k in patches.knobs() if k.base or k.lowers_cost)


def holds_same_fields() -> tuple[str, ...]:
    """The fields whose values leave the bytes a step holds throughout as they are
    (``Knob.holds_same``)."""
    return tuple(k.path for k in patches.knobs() if k.holds_same)


def unordered_offloaded_fields() -> tuple[str, ...]:
    """The fields with no memory order under activation offload (``Knob.unordered_offloaded``)."""
    return tuple(k.path for k in patches.knobs() if k.unordered_offloaded)


def slower_when_leaner_fields() -> tuple[str, ...]:
    """The fields whose leaner values never make a step faster (``Knob.slower_when_leaner``)."""
    return tuple(k.path for k in patches.knobs() if k.slower_when_leaner)


def unordered_time_offloaded_fields() -> tuple[str, ...]:
    """The fields whose time order does not hold under activation offload
    (``Knob.unordered_time_offloaded``)."""
    return tuple(k.path for k in patches.knobs() if k.unordered_time_offloaded)


def floor(cfg: RunConfig, shape: ModelShape, micro: int) -> tuple[int, str]:
    """Device bytes a step of ``cfg`` (every field decided) keeps at least at ``micro`` rows,
    without a trace, and the field whose value keeps them: the largest of its knobs' floors
    (``Knob.floor``; ``(0, "")`` where none has one)."""
    return max(((k.floor(cfg, shape, recipe_value(cfg, k.path), micro), k.path) for k in patches.knobs()
                if k.floor is not None), default=(0, ""))


def cost_terms(inputs: patches.CostInputs) -> dict[str, float]:
    """The step-time terms the candidate's values add (each knob's ``cost`` hook, summed per term;
    :data:`memtrain.patches.COST_TERMS`)."""
    terms = dict.fromkeys(patches.COST_TERMS, 0.0)
    for k in patches.knobs():
        if k.cost is not None:
            for name, value in k.cost(inputs, recipe_value(inputs.cfg, k.path)).items():
                terms[name] += value
    return terms


def patched_fields() -> tuple[str, ...]:
    """The fields whose techniques patch the model, so whose applicability a fake model shows
    before any trace."""
    return tuple(k.path for k in patches.knobs() if k.patches_model)


def batches(cfg: RunConfig) -> list[tuple[int, int]]:
    """Valid (micro, accumulation) pairs, smallest micro first; the effective batch never changes."""
    t, procs = cfg.training, cfg.distributed.processes
    if t.micro_batch_size != "auto" and t.gradient_accumulation != "auto":
        batch: Batch = resolve_batch(t, procs)
        return [(batch.micro, batch.accumulation)]
    if t.micro_batch_size == "auto" or (t.micro_batch_size is None and t.effective_batch_size is not None):
        return valid_batches(t, procs)  # the same choices the probe step confirms among
    if t.effective_batch_size is None:
        return [(t.micro_batch_size or 8, 1)]
    per_process = t.effective_batch_size // procs
    return [(t.micro_batch_size, per_process // t.micro_batch_size)]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"ratio {value['ratio']}"
    if value is None:
        return "null"  # as a recipe writes it
    return str(value).lower() if isinstance(value, bool) else str(value)
