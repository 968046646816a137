"""The built-in catalog: every entry's parameter count is the published one; names resolve offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from memtrain.config import ModelConfig
from memtrain.errors import MemtrainError
from memtrain.estimator import catalog
from memtrain.estimator.setup import resolve_config

GOLDEN = json.loads((Path(__file__).parents[1] / "assets" / "catalog_parameters.json").read_text())["counts"]


def test_every_entry_has_the_published_parameter_count() -> None:
    assert set(catalog.names()) == set(GOLDEN)
    for name in catalog.names():
        _, values = catalog.lookup(name)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        auto = AutoModel if config.model_type in ("bert", "roberta") else AutoModelForCausalLM
        with torch.device("meta"):  # shapes only: a 72B model costs nothing
            model = auto.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == GOLDEN[name], name


@pytest.mark.parametrize("alias,hub_id", [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
    ("llama-3.1-70b", "meta-llama/Llama-3.1-70B"),
    ("QWEN/qwen2.5-7b-instruct", "Qwen/Qwen2.5-7B"),
    ("gpt2", "openai-community/gpt2"),
    ("bert-base-uncased", "google-bert/bert-base-uncased"),
    ("roberta-large", "FacebookAI/roberta-large"),
    ("google/gemma-2-9b-it", "google/gemma-2-9b"),
])
def test_aliases_and_case_resolve(alias: str, hub_id: str) -> None:
    found = catalog.lookup(alias)
    assert found is not None and found[0] == hub_id


def test_resolve_config_uses_the_catalog_offline() -> None:
    config, label = resolve_config(ModelConfig(name="mistralai/Mistral-7B-v0.1"))
    assert label == "mistralai/Mistral-7B-v0.1"
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("mistral", 32, 32000)


def test_unknown_model_says_which_field_and_what_to_do() -> None:
    with pytest.raises(MemtrainError) as err:
        resolve_config(ModelConfig(name="acme/unknown-13b"))
    message = str(err.value)
    assert "`model.name`" in message and "acme/unknown-13b" in message
    assert "Qwen/Qwen2.5-72B" in message and "model.from_config" in message
