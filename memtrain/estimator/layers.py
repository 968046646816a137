"""Which of a model's decoder layers are alike, so the estimator knows what short traces to take.

The estimator extrapolates a step along depth from two short traces (:mod:`memtrain.estimator.trace`).
That is exact when the traced layers stand for every layer. Many models mix kinds of layer: Gemma-3
puts one full-attention layer after five sliding-window ones, Qwen3.5 one full-attention layer after
three linear-attention (Gated DeltaNet) ones, DeepSeek-V3 starts with three dense layers before its
mixture-of-experts layers. Cutting such a model to its first 2 and 3 layers traces one kind only:
Qwen3.5's 2- and 3-layer traces hold no full-attention layer at all, so its parameters, LoRA weights
and activations were counted as if every layer were linear attention.

A model's layers are a :class:`Pattern`: ``first`` layers of their own (layer 0, which follows the
embedding, and the first layer of each kind, where what all layers of the kind share is made), then
groups of ``period`` alike layers, the last group possibly cut short (``tail`` layers). Alike layers
are ``first 1, period 1``. The traces are the model cut to its first ``first + period + tail`` and
``first + 2·period + tail`` layers: the first layers of the real model, so each traced layer is the
kind the real one is at that index, and the cut-short group ends both as it ends the model. The step
extrapolates in groups (:func:`memtrain.estimator.trace.extrapolate_depth`). Where no pattern makes
the two traces shorter than the model, every layer is traced.

A layer's kind is what could make its step differ: its ``config.layer_types`` entry, the class, name
and parameter shapes of each of its modules, and their plain settings (numbers, strings, flags: a
``use_rope`` that Llama-4 sets per layer), less the layer's own index. The model is built on the meta
device at full depth to read them (a fraction of a second; no memory).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Hashable, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from memtrain import patches
from memtrain.config import RunConfig


@dataclasses.dataclass(frozen=True)
class Pattern:
    """How ``depth`` layers repeat: ``first`` layers of their own, then groups of ``period`` alike
    layers, the last cut to ``tail`` layers. Uniform layers: ``first 1, period 1`` (layer 0 follows
    the embedding, so it is one of its own in any model; so is the first layer of each kind)."""

    depth: int
    first: int = 1
    period: int = 1
    kinds: int = 1  # how many kinds of layer the model has

    @property
    def repeats(self) -> int:
        """Whole groups after the first layers."""
        return (self.depth - self.first) // self.period

    @property
    def tail(self) -> int:
        """Layers of a last, cut-short group."""
        return (self.depth - self.first) % self.period

    @property
    def traced(self) -> tuple[int, int]:
        """The depths of the two traces: the first layers, one and two groups, and the tail."""
        one = self.first + self.period + self.tail
        return one, one + self.period

    @property
    def uniform(self) -> bool:
        return self.first == 1 and self.period == 1

    def worth_extrapolating(self) -> bool:
        """Whether the two traces hold fewer layers than one trace of the whole depth."""
        return self.repeats >= 2 and sum(self.traced) < self.depth

    def describe(self) -> str:
        """How the layers repeat, for the estimate's method ("" for uniform layers)."""
        if self.uniform:
            return ""
        group = f"a group of {self.period} layers repeated" if self.period > 1 else "alike layers"
        return group if self.first == 1 else f"{self.first} layers of their own, then {group}"


def find_pattern(kinds: Sequence[Hashable]) -> Pattern:
    """The cheapest :class:`Pattern` that ``kinds`` (one per layer) follows: the fewest layers traced.
    Where none is worth extrapolating (:meth:`Pattern.worth_extrapolating`), the period-1 one: the
    estimator traces every layer."""
    depth = len(kinds)
    # The first layer of each kind is one of its own, as layer 0 is of alike layers: what all layers
    # of a kind share is made (and its gradient summed) there.
    firsts = 1 + max((kinds.index(kind) for kind in set(kinds)), default=0)
    found = [Pattern(depth, max(firsts, _head(kinds, period)), period, len(set(kinds)))
             for period in range(1, max(depth, 2))]
    worth = [p for p in found if p.worth_extrapolating()]
    return min(worth, key=lambda p: sum(p.traced)) if worth else found[0]


def _head(kinds: Sequence[Hashable], period: int) -> int:
    """The fewest leading layers after which ``kinds`` repeats every ``period`` layers."""
    for i in range(len(kinds) - period - 1, -1, -1):
        if kinds[i] != kinds[i + period]:
            return i + 1
    return 0


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated layers whose count the depth sets (:func:`memtrain.patches.layer_lists`; of
    several lists, the one with the most parameters)."""
    lists = patches.layer_lists(model)
    if not lists:
        return []
    return list(max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))[1])


_CACHE: dict[str, Pattern] = {}


def layer_pattern(cfg: RunConfig, config: PretrainedConfig, depth: int) -> Pattern:
    """The :class:`Pattern` of the recipe's model (``depth`` layers); uniform where its layers cannot
    be found or counted."""
    from memtrain.estimator.flash_standin import fake_model_kwargs
    from memtrain.model import model_class

    key = f"{cfg.model.task}|{cfg.model.dtype}|{cfg.model.attn_implementation}|{config.to_json_string()}"
    if depth < 6:  # the model is traced whole anyway (`Pattern.worth_extrapolating`)
        return Pattern(depth)
    if key not in _CACHE:
        from memtrain._compat import transformers_model
        from memtrain.estimator.fake import quiet_libraries

        try:
            with torch.device("meta"), transformers_model.uninitialized_values(), quiet_libraries():
                kwargs = fake_model_kwargs(cfg.model)
                model = model_class(cfg.model).from_config(copy.deepcopy(config), **kwargs)
        except Exception:  # the trace builds it again and reports what fails
            return Pattern(depth)
        layers = decoder_layers(model)
        types = getattr(config, "layer_types", None)
        if not isinstance(types, list) or len(types) != len(layers):
            types = [None] * len(layers)
        kinds = [(kind, _structure(layer)) for kind, layer in zip(types, layers, strict=True)]
        _CACHE[key] = find_pattern(kinds) if len(layers) == depth else Pattern(depth)
    return _CACHE[key]


# Whole numbers by these names count or seed something per layer (layer_idx, layer_id, layer_number,
# block_index, a random seed): they differ from layer to layer and change no tensor.
_INDEX = re.compile(r"(idx|index|layer_id|layer_num|block_id|seed)", re.IGNORECASE)


def _setting(key: str, value: object) -> object:
    """What a module's plain attribute says of its step (``_IGNORED``: nothing)."""
    if key.startswith("_") or key == "training" or not isinstance(value, (bool, int, float, str, type(None))):
        return _IGNORED
    if type(value) is int and _INDEX.search(key):
        return _IGNORED
    if type(value) is float:  # a scale or coefficient (DiffLlama's lambda per layer): only 0 changes a step
        return value == 0.0
    return value


_IGNORED = object()


def _structure(layer: nn.Module) -> tuple:
    """What could make a layer step differently from another: each module's name, class, plain settings
    (:func:`_setting`) and parameters' and buffers' shapes and dtypes."""
    found = []
    for name, module in layer.named_modules():
        settings = tuple(sorted((key, shown) for key, value in vars(module).items()
                                if (shown := _setting(key, value)) is not _IGNORED))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(recurse=False),
                                                                   *module.named_buffers(recurse=False)))
        found.append((name, type(module).__name__, settings, tensors))
    return tuple(found)
