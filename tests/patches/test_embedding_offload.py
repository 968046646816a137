"""Embedding offload: the frozen input table in host memory, the same loss and gradients."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.config import load_recipe
from memtrain.device import kept_on_host, model_device
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import estimate
from memtrain.memory.meter import MemoryMeter
from memtrain.patches import NoMatchError, records
from memtrain.patches import embedding_offload as emb
from tests.conftest import TINY_CONFIGS, causal_recipe
from tests.patches.test_checkpointing import BATCH, SEQ, build_model, inputs

LLAMA = TINY_CONFIGS["llama"]


def frozen_table(model: nn.Module) -> nn.Module:
    """The model as LoRA leaves it, as far as the table goes: its embedding frozen."""
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def run(model: nn.Module) -> dict[str, Any]:
    loss = model(**inputs()).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads}


def test_the_loss_and_every_gradient_are_the_plain_ones_bit_for_bit() -> None:
    base = frozen_table(build_model(layers=2))
    plain = run(copy.deepcopy(base))
    patched = emb.apply(copy.deepcopy(base))
    moved = run(patched)
    assert torch.equal(moved["loss"], plain["loss"])
    assert moved["grads"].keys() == plain["grads"].keys() and len(plain["grads"]) > 0
    for name, grad in plain["grads"].items():
        assert torch.equal(moved["grads"][name], grad), name
    assert [r.name for r in records(patched)] == ["embedding_offload"]


def test_the_meter_files_the_table_and_the_looked_up_rows_as_host_memory() -> None:
    """Effect on the real step: the device holds the table's bytes less, the host holds them."""
    base = frozen_table(build_model(layers=2))
    table = 256 * LLAMA["hidden_size"] * 4  # fp32, vocabulary 256 (build_model)
    rows = BATCH * SEQ * LLAMA["hidden_size"] * 4  # the looked-up rows, briefly on the host
    measured = {}
    for name, model in (("plain", copy.deepcopy(base)), ("offloaded", emb.apply(copy.deepcopy(base)))):
        with MemoryMeter(model) as meter:
            model(**inputs()).loss.backward()
        measured[name] = meter.result()
    plain, moved = measured["plain"], measured["offloaded"]
    assert plain.peak_bytes - moved.peak_bytes == table
    assert plain.host_peak_bytes == 0 and moved.host_peak_bytes == table + rows


def test_the_estimate_moves_the_table_to_the_host(tmp_path: Path, tiny_text_file: Path) -> None:
    """On CUDA the table is pinned (``Tensor.pin_memory``), a block of the next power of two; the
    looked-up rows are a plain host gather."""
    from memtrain.memory.trackers import pinned_bytes

    recipe = causal_recipe(tmp_path, tiny_text_file)
    plain = estimate(load_recipe(recipe), device="cuda")
    moved = estimate(load_recipe(recipe, ["memory.offload.embeddings=true"]), device="cuda")
    table = LLAMA["vocab_size"] * LLAMA["hidden_size"] * 4  # fp32 tiny Llama, untied
    rows = 4 * 32 * LLAMA["hidden_size"] * 4  # micro-batch 4 x 32 tokens
    assert plain.by_category["parameters"] - moved.by_category["parameters"] == table
    assert plain.peak_bytes - moved.peak_bytes == table
    assert pinned_bytes(table) > table  # 30,522 x 64 x 4 bytes: not a power of two
    pinned = pinned_bytes(table)
    assert (moved.host_peak_bytes, moved.host_resident_bytes) == (pinned + rows, pinned)
    on_cpu = estimate(load_recipe(recipe, ["memory.offload.embeddings=true"]), device="cpu")
    assert on_cpu.host_resident_bytes == table  # nothing is pinned on a CPU


def test_model_to_leaves_the_table_where_it_is_and_undo_restores_it() -> None:
    model = emb.apply(frozen_table(build_model(layers=1)))
    weight = model.get_input_embeddings().weight
    model.to(torch.float64)  # what the Trainer's placement does with a device
    assert weight.dtype == torch.float32 and kept_on_host(weight)
    assert model_device(model) == torch.device("cpu") and model.lm_head.weight.dtype == torch.float64
    emb.undo(model)
    assert not kept_on_host(weight) and "forward" not in model.get_input_embeddings().__dict__
    assert records(model) == []


def test_what_cannot_be_offloaded_names_the_field() -> None:
    trained = build_model(layers=1)  # full fine-tuning: the table gets gradients
    with pytest.raises(NoMatchError, match=r"memory\.offload\.embeddings.*trained"):
        emb.apply(trained)
    tied = frozen_table(build_model(layers=1, tie_word_embeddings=True))
    with pytest.raises(NoMatchError, match=r"memory\.offload\.embeddings.*shares"):
        emb.apply(tied)
    once = emb.apply(frozen_table(build_model(layers=1)))
    with pytest.raises(MemtrainError, match="already offloaded"):
        emb.apply(once)


def test_full_fine_tuning_with_it_is_a_build_error_naming_the_field(tmp_path: Path,
                                                                     tiny_text_file: Path) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, adapter={"method": "full"},
                           memory={"offload": {"embeddings": True}})
    with pytest.raises(MemtrainError, match=r"memory\.offload\.embeddings"):
        estimate(load_recipe(recipe), device="cpu")
    data = json.loads(json.dumps(recipe))
    data["memory"]["offload"]["embeddings"] = "sometimes"
    with pytest.raises(MemtrainError, match=r"memory\.offload\.embeddings"):
        load_recipe(data)


def test_several_processes_are_refused_naming_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, distributed={"processes": 2},
                                    memory={"offload": {"embeddings": True}}))
    with pytest.raises(MemtrainError, match=r"memory\.offload\.embeddings.*several processes"):
        emb._from_recipe(frozen_table(build_model(layers=1)), cfg)
