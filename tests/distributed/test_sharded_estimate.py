"""One of several processes, estimated: FSDP2 (`full`, `grad_op`) and DDP replicas (`none`).

Fast: every estimate here traces a tiny Llama in a fake process group, no process starts. What
they check is what sharding must and must not change, against the single-process estimate of
the same recipe (each setting's effect on what forward saves is the single-process one) and
against exact arithmetic (shards are halves, DDP adds one copy of the trained gradients). The
measured side, with real processes, is in tests/distributed/test_distributed.py and
scripts/bench/accuracy/fsdp.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_CONFIGS, causal_recipe, merge

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import Estimate, estimate
from memtrain.plan import planner
from memtrain.plan.search import TraceCache

# Untied embeddings, so that the input embedding and the head are FSDP units of their own.
ARCH = {**copy.deepcopy(TINY_CONFIGS["llama"]), "tie_word_embeddings": False}


def recipe(tmp: Path, data: Path, processes: int = 2, sharding: str = "full", **sections: Any) -> Any:
    base = causal_recipe(tmp, data, model={"from_config": ARCH}, adapter={"method": "full"},
                         data={"max_length": 32},
                         training={"micro_batch_size": 2, "gradient_accumulation": 1},
                         distributed={"processes": processes, "sharding": sharding})
    return load_recipe(merge(base, sections))


# Each recipe setting the sharded trace must honour, as recipe sections.
SETTINGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"model": {"dtype": "bf16"}},
    "eager attention": {"model": {"attn_implementation": "eager"}},
    "lora": {"adapter": {"method": "lora"}},
    "qlora": {"adapter": {"method": "lora"}, "model": {"quantization": "nf4", "dtype": "bf16"}},
    "qlora, peft's fp32 upcast": {"adapter": {"method": "lora"}, "memory": {"lean_kbit": False},
                                  "model": {"quantization": "nf4", "dtype": "bf16"}},
    "checkpointing full": {"memory": {"checkpointing": "full"}},
    "checkpointing selective": {"memory": {"checkpointing": "selective"}},
    "checkpointing 1 layer": {"memory": {"checkpointing": 1}},
    "chunked loss": {"memory": {"loss": "chunked"}},
    "activation offload": {"memory": {"offload": {"activations": True}}},
    "few-bit activations": {"memory": {"allow_approximate": True, "activation_bits": 3}},
    "randomized linear": {"memory": {"allow_approximate": True, "randomized_linear": {"ratio": 0.2}}},
}


def saved_in_forward(est: Estimate) -> int:
    return est.category_at_phase_peak["forward"]["activations"]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_setting_saves_in_forward_what_one_process_saves(setting: str, tmp_path: Path,
                                                                tiny_text_file: Path) -> None:
    sections = SETTINGS[setting]
    one = estimate(recipe(tmp_path, tiny_text_file, 1, "none", **sections))
    two = estimate(recipe(tmp_path, tiny_text_file, 2, "full", **sections))
    assert saved_in_forward(two) == saved_in_forward(one) > 0
    assert two.parameters == one.parameters and two.trainable == one.trainable
    assert any("FSDP2" in note for note in two.notes)
    if not setting.startswith("qlora"):  # 4-bit quantization constants stay whole in every process
        # every dim 0 of the tiny Llama is even: each process holds exactly half the weights
        shard, whole = (e.category_at_phase_peak["optimizer"]["parameters"] for e in (two, one))
        assert shard * 2 == whole


def test_sharded_qlora_shards_the_packed_weights_and_keeps_their_constants(tmp_path: Path,
                                                                          tiny_text_file: Path) -> None:
    from memtrain.estimator.fake import build_fake_model, fake_tensor_mode
    from memtrain.memory.quantized import quantization_state_tensors
    from memtrain.model import build_config

    sections = SETTINGS["qlora"]
    cfg = recipe(tmp_path, tiny_text_file, 1, "none", **sections)
    with fake_tensor_mode():
        model = build_fake_model(cfg, build_config(cfg.model))
        constants = sum(t.nbytes for t in quantization_state_tensors(model))
        weights = sum(p.nbytes for p in model.parameters())
    two = estimate(recipe(tmp_path, tiny_text_file, 2, "full", **sections))
    # packed 4-bit weights stored in bf16 (FSDP shards them like the others): the same bytes as uint8
    assert two.category_at_phase_peak["optimizer"]["parameters"] == weights // 2 + constants


def test_a_ddp_replica_holds_its_gradient_buckets(tmp_path: Path, tiny_text_file: Path) -> None:
    bf16 = {"model": {"dtype": "bf16"}}
    # (sections, bytes per trained value): peft keeps LoRA factors in fp32 on a bf16 base
    for sections, size in (({}, 4), (bf16, 2), ({**bf16, "adapter": {"method": "lora"}}, 4)):
        one = estimate(recipe(tmp_path, tiny_text_file, 1, "none", **sections))
        two = estimate(recipe(tmp_path, tiny_text_file, 2, "none", **sections))
        # DDP (gradient_as_bucket_view=False) keeps a flat copy of every trained gradient
        assert two.peak_bytes - one.peak_bytes == one.trainable * size
        assert two.by_category["gradients"] - one.by_category["gradients"] == one.trainable * size
        assert any("DDP" in note for note in two.notes)


def test_grad_op_keeps_the_gathered_layers_until_backward(tmp_path: Path, tiny_text_file: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    full, grad_op = (estimate(recipe(tmp_path, tiny_text_file, 2, s)) for s in ("full", "grad_op"))
    values = dict(ARCH)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    layer = sum(p.nbytes for p in model.model.layers[0].parameters())
    embedding = model.model.embed_tokens.weight.nbytes
    at_end = [e.category_at_phase_peak["forward"]["unsharded"] for e in (full, grad_op)]
    # at the end of forward grad_op still holds both layers and the input embedding whole
    assert at_end[1] - at_end[0] == 2 * layer + embedding
    assert grad_op.peak_bytes > full.peak_bytes
    assert grad_op.category_at_phase_peak["optimizer"] == full.category_at_phase_peak["optimizer"]


def test_unsynced_accumulation_holds_full_gradients(tmp_path: Path, tiny_text_file: Path) -> None:
    one, two = (estimate(recipe(tmp_path, tiny_text_file, training={
        "micro_batch_size": 1, "gradient_accumulation": a})) for a in (1, 2))
    # the first micro-batch reduce-scatters nothing (accelerate's no_sync): every process holds the
    # whole model's gradients until the last micro-batch
    assert two.by_phase["forward"] - one.by_phase["forward"] == one.trainable * 4


def test_sharded_traces_extrapolate_in_depth_exactly(tmp_path: Path, tiny_text_file: Path) -> None:
    deep = {"model": {"from_config": {**ARCH, "num_hidden_layers": 6}}}
    for sharding in ("full", "grad_op"):
        cfg = recipe(tmp_path, tiny_text_file, 2, sharding, **deep)
        fast, exact = estimate(cfg), estimate(cfg, exact=True)
        assert "extrapolated" in fast.method
        assert fast.peak_bytes == exact.peak_bytes and fast.by_phase == exact.by_phase


def test_what_cannot_run_sharded_is_refused_naming_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    with pytest.raises(MemtrainError, match=r"`distributed\.sharding` is `auto`"):
        estimate(recipe(tmp_path, tiny_text_file, 2, "auto"))
    with pytest.raises(MemtrainError, match=r"`training\.optimizer`: adamw_8bit cannot update FSDP2"):
        estimate(recipe(tmp_path, tiny_text_file, 2, "grad_op", training={"optimizer": "adamw_8bit"}))
    assert estimate(recipe(tmp_path, tiny_text_file, 1, "auto")).settings["sharding"] == "none"


def test_planner_shards_only_when_replicas_do_not_fit(tmp_path: Path, tiny_text_file: Path) -> None:
    # (the budgets come from estimates: this checks the planner's choice, not the estimator)
    cfg = recipe(tmp_path, tiny_text_file, 2, "auto", memory={"margin": 0.0})
    peaks = {s: estimate(planner.with_values(cfg, {"distributed.sharding": s})).total_bytes
             for s in ("none", "grad_op", "full")}
    assert peaks["full"] < peaks["grad_op"] < peaks["none"]
    chosen = {}
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    for budget in (peaks["none"], peaks["grad_op"], peaks["full"]):
        decided = planner.plan(cfg, budget, device="cpu", cache=cache)
        chosen[budget] = decided.chosen.values["distributed.sharding"]
    # replicas when they fit (no technique); else grad_op, one all-gather per step; else full
    assert list(chosen.values()) == ["none", "grad_op", "full"]
    with pytest.raises(planner.NothingFits):
        planner.plan(cfg, peaks["full"] - 1, device="cpu", cache=cache)
    fixed = recipe(tmp_path, tiny_text_file, 2, "full", training={"optimizer": "auto"})
    # 8-bit AdamW cannot run on shards
    decided = planner.plan(fixed, peaks["none"], device="cpu", cache=cache)
    assert decided.chosen.values == {"training.optimizer": "adamw"}
    assert not decided.alternatives and not decided.rejected
