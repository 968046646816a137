"""Encoder classifiers beyond BERT and RoBERTa: what each needs from the estimator's fake mode and
from the LoRA patch, checked as the estimator is everywhere (the fake step equals the real one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import causal_recipe

from memtrain.config import AdapterConfig, load_recipe
from memtrain.estimator import real_step
from memtrain.estimator.estimate import estimate
from memtrain.estimator.fake import fake_tensor_mode
from memtrain.estimator.setup import resolve_config
from memtrain.patches import NoMatchError, lora
from memtrain.plan.planner import fit_micro_batch, plan

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 30522, "max_position_embeddings": 256}
ARCHS: dict[str, dict[str, Any]] = {
    # its classification loss keeps the labels >= 0 through aten.nonzero (a data-dependent size)
    "deberta-v2": {"model_type": "deberta-v2", **SMALL},
    # its initializer (trunc_normal_) resamples until no value is out of bounds (asks the values)
    "modernbert": {"model_type": "modernbert", **SMALL, "global_attn_every_n_layers": 1, "pad_token_id": 0},
    # one layer's weights shared by every layer: no list of layers to checkpoint
    "albert": {"model_type": "albert", **SMALL, "embedding_size": 32},
    # its head is two new linear layers, pre_classifier and classifier
    "distilbert": {"model_type": "distilbert", "dim": 64, "hidden_dim": 128, "n_layers": 2, "n_heads": 4,
                   "vocab_size": 30522},
}


def classifier(tmp_path: Path, data: Path, arch: str, **sections: Any) -> Any:
    """A tiny two-class recipe on ``arch`` (from ARCHS); ``sections`` are merged in."""
    recipe = causal_recipe(tmp_path, data, "bert", model={"task": "sequence-classification"},
                           data={"format": "classification"}, **sections)
    recipe["model"]["from_config"] = dict(ARCHS[arch])
    return load_recipe(recipe)


def albert(tmp_path: Path, data: Path, checkpointing: str) -> Any:
    """ALBERT trained in full, micro-batch left to the planner, the given checkpointing."""
    return classifier(tmp_path, data, "albert", adapter={"method": "full"},
                      memory={"checkpointing": checkpointing},
                      training={"micro_batch_size": "auto", "effective_batch_size": 8})


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", ["lora", "full"])
def test_estimate_equals_the_measured_step(arch: str, method: str, tmp_path: Path,
                                           tiny_classification_file: Path) -> None:
    cfg = classifier(tmp_path, tiny_classification_file, arch, adapter={"method": method})
    predicted = estimate(cfg, device="cpu")
    measured = real_step.measure_recipe_step(cfg, resolve_config(cfg.model)[0])
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.by_category == measured.peak_by_category


def test_data_dependent_sizes_are_taken_at_their_largest() -> None:
    with fake_tensor_mode() as mode:
        mask = mode.from_tensor(torch.tensor([[True, False, True], [False, False, True]]))
        assert tuple(mask.nonzero().shape) == (6, 2)  # every element, the worst case
    assert tuple(torch.tensor([True, False]).nonzero().shape) == (1, 1)  # real tensors: untouched


def test_lora_trains_a_two_layer_head_in_full_and_adapts_the_rest() -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    values = dict(ARCHS["distilbert"])
    config = AutoConfig.for_model(values.pop("model_type"), num_labels=2, **values)
    model = lora.apply(AutoModelForSequenceClassification.from_config(config), AdapterConfig(),
                       "sequence-classification")
    trained = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained == {f"base_model.model.{layer}.modules_to_save.default.{kind}"
                       for layer in ("pre_classifier", "classifier") for kind in ("weight", "bias")}
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert len(adapted) == 2 * 6  # q, k, v, out, ffn lin1, lin2 in each of the 2 layers


@pytest.mark.parametrize("matmul_flops", [1e8, 1e13])  # recompute ranks "full" slower, or costs nothing
def test_the_planner_passes_over_checkpointing_where_there_are_no_layers_to_checkpoint(
        tmp_path: Path, tiny_classification_file: Path, monkeypatch: pytest.MonkeyPatch,
        matmul_flops: float) -> None:
    """The reason is the same whatever the machine's speed: with measured rates under which
    recompute looked slow, `full` was once rejected as slower before its applicability was
    checked (issue 26). Both extremes of fixed rates here."""
    from memtrain.plan import costmodel

    values = {**costmodel.rates("cpu").values, "matmul_flops": {"fp32": matmul_flops, "bf16": matmul_flops}}
    monkeypatch.setattr(costmodel, "rates", lambda device: costmodel.Rates("fixed (test)", values))
    decided = plan(albert(tmp_path, tiny_classification_file, "auto"), "1GiB", device="cpu")
    assert decided.settings()["memory.checkpointing"] == "none"
    skipped = {str(c.values["memory.checkpointing"]): c.reason for c in decided.rejected}
    assert set(skipped) == {"selective", "1", "full"}
    reason = ("not applicable to this model: `memory.checkpointing`: found no list of 2 transformer "
              "layers in AlbertForSequenceClassification")
    assert all(r.startswith(reason) for r in skipped.values()), skipped


def test_checkpointing_set_by_the_recipe_on_such_a_model_names_the_field(
        tmp_path: Path, tiny_classification_file: Path) -> None:
    """Only the search passes over an inapplicable technique; a recipe that fixes it gets the error."""
    with pytest.raises(NoMatchError, match=r"`memory.checkpointing`: found no list of 2 .*Fix: set "
                                           r"`memory.checkpointing: none`"):
        fit_micro_batch(albert(tmp_path, tiny_classification_file, "full"), 2**30, device="cpu")
