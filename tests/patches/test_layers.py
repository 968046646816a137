"""One rule for "the repeated layers" (:func:`memtrain.patches.layer_lists`): checkpointing and
activation offload wrap them, the approximate layers and the tiled MLP find their default targets
inside them, and the estimator extrapolates along them. Every one of them must see the same layers,
on every catalog architecture and on a model built to make rules of thumb disagree."""

from __future__ import annotations

import copy

import pytest
from conftest import tiny_catalog_configs, tiny_catalog_model
from torch import nn
from transformers import (
    T5Config,
    T5ForConditionalGeneration,
)

from memtrain import patches
from memtrain.estimator.layers import decoder_layers
from memtrain.patches import checkpointing, tiled_mlp
from memtrain.patches._targets import blocks

CATALOG = tiny_catalog_configs()


def seen_by_each(model: nn.Module) -> dict[str, list[str]]:
    """The layers each part of memtrain finds, by name."""
    names = {id(m): n for n, m in model.named_modules()}
    return {
        "checkpointing": [n for n, _ in checkpointing.find_layers(model)],
        "approximate targets": blocks(model),
        "estimator": [names[id(m)] for m in decoder_layers(model)],
    }


@pytest.mark.parametrize("arch", sorted(CATALOG))
def test_every_part_sees_the_same_layers(arch: str) -> None:
    model = tiny_catalog_model(arch)
    expected = [name for name, _ in patches.layers(model)]
    assert len(expected) == patches.num_layers(model), expected
    assert seen_by_each(model) == dict.fromkeys(seen_by_each(model), expected)


def test_lists_that_look_like_layers_are_not_layers() -> None:
    """Lists that fooled one of the three rules memtrain had (issue 36): experts inside each layer as
    many as the layers (the config-count rule took them), a list of plain projections beside the
    layers as long as they are (Gemma 3n's altup projections), and a list of blocks of another
    length beside them (the largest-list rule could take it)."""
    model = tiny_catalog_model("llama")
    inner = model.model
    count = len(inner.layers)
    width = model.config.hidden_size
    for layer in inner.layers:
        layer.mlp.experts = nn.ModuleList(copy.deepcopy(layer.mlp) for _ in range(count))
    inner.projections = nn.ModuleList(nn.Linear(width, width) for _ in range(count))
    inner.heads = nn.ModuleList(copy.deepcopy(inner.layers[0]) for _ in range(count + 1))
    wanted = [f"model.layers.{i}" for i in range(count)]
    assert seen_by_each(model) == dict.fromkeys(seen_by_each(model), wanted)
    # the tiled MLP's targets lie inside the same layers (none in the list beside them)
    mlps = [n for n, _, _ in tiled_mlp.find_mlps(model)]
    assert mlps and all(n.startswith(tuple(f"{w}." for w in wanted)) for n in mlps), mlps


def test_encoder_decoder_has_two_layer_lists() -> None:
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
                      num_heads=2)
    model = T5ForConditionalGeneration(config)
    assert [n for n, _ in patches.layer_lists(model)] == ["encoder.block", "decoder.block"]
    assert [n for n, _ in checkpointing.find_layers(model)] == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]


def test_a_model_without_layers_names_the_field() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(patches.NoMatchError, match=r"`memory.checkpointing`.*Fix: set"):
        checkpointing.find_layers(model)


def test_a_model_sharing_one_layer_across_its_depth_has_no_layer_list() -> None:
    """ALBERT runs one layer group `num_hidden_layers` times: its list of one group is not the
    layers (the estimator would see one layer where the step runs two)."""
    from transformers import AlbertConfig, AlbertModel

    model = AlbertModel(AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64))
    assert patches.layer_lists(model) == []
    with pytest.raises(patches.NoMatchError, match=r"found no list of 2 transformer layers in AlbertModel"):
        checkpointing.find_layers(model)
