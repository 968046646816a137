"""Activation checkpointing modes: same gradients, less saved memory, counted recompute."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.patches import NoMatchError, apply_patches, records
from memtrain.patches import checkpointing as ckpt
from scripts.probes.memprobe import LiveBytes
from tests.conftest import TINY_CONFIGS, causal_recipe

CPU = torch.device("cpu")
BATCH, SEQ = 2, 32


def build_model(arch: str = "llama", layers: int = 2, attn: str = "sdpa",
                **extra: Any) -> nn.Module:
    """A tiny model with dropout off (so runs are deterministic), in train mode."""
    values = {**TINY_CONFIGS[arch], "vocab_size": 256, **extra}
    values.pop("model_type")
    key = "n_layer" if arch == "gpt2" else "num_hidden_layers"
    values[key] = layers
    config = AutoConfig.for_model(arch, **values)
    config._attn_implementation = attn
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    encoder = arch in ("bert", "roberta")
    auto = AutoModelForSequenceClassification if encoder else AutoModelForCausalLM
    return auto.from_config(config).train()


def inputs(arch: str = "llama") -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1]) if arch in ("bert", "roberta") else ids
    return {"input_ids": ids, "labels": labels}


def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One forward/backward: loss, gradients, bytes alive after forward, backward FLOPs."""
    with LiveBytes() as tracker:
        loss = model(**batch).loss
        saved = tracker.current
        with FlopCounterMode(display=False) as flops:
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads, "saved": saved, "flops": flops.get_total_flops()}


def run_mode(base: nn.Module, mode: Any, arch: str = "llama") -> dict[str, Any]:
    model = ckpt.apply(copy.deepcopy(base), mode)
    return step(model, inputs(arch))


def assert_same_grads(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-6) -> None:
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in a["grads"].items():
        torch.testing.assert_close(grad, b["grads"][name], atol=atol, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("mode", ["full", 1, "selective"])
def test_modes_leave_gradients_unchanged(mode: Any) -> None:
    base = build_model()
    assert_same_grads(run_mode(base, mode), run_mode(base, "none"))


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gpt2", "bert", "roberta"])
def test_finds_layers_and_keeps_gradients_across_architectures(arch: str) -> None:
    base = build_model(arch)
    expected = {"mistral": "model.layers", "qwen2": "model.layers", "gpt2": "transformer.h",
                "bert": "bert.encoder.layer", "roberta": "roberta.encoder.layer"}[arch]
    assert [n for n, _ in ckpt.find_layers(base)] == [f"{expected}.0", f"{expected}.1"]
    for mode in ("full", "selective"):
        assert_same_grads(run_mode(base, mode, arch), run_mode(base, "none", arch))


def test_lora_model_keeps_names_and_gradients(tmp_path: Any) -> None:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    lora = get_peft_model(build_model(), config)
    keys = list(lora.state_dict())
    plain = step(copy.deepcopy(lora), inputs())
    patched = ckpt.apply(copy.deepcopy(lora), "full")
    assert list(patched.state_dict()) == keys  # adapters save and load under the same names
    assert next(n for n, _ in ckpt.find_layers(patched)) == "base_model.model.model.layers.0"
    assert_same_grads(step(patched, inputs()), plain)


def test_selective_with_4bit_qlora_matches_plain(tmp_path: Any) -> None:
    pytest.importorskip("bitsandbytes")
    from memtrain.config import AdapterConfig, ModelConfig
    from memtrain.model import load_model
    from memtrain.patches import lora

    cfg = ModelConfig(from_config={**TINY_CONFIGS["llama"], "vocab_size": 256},
                      tokenizer="x", quantization="nf4", dtype="fp32")
    model = lora.apply(load_model(cfg), AdapterConfig(r=4, dropout=0.0)).train()
    plain = step(model, inputs())
    model.zero_grad()
    for mode in ("full", "selective"):
        patched = ckpt.apply(model, mode)
        assert_same_grads(step(patched, inputs()), plain, atol=1e-5)
        ckpt.undo(patched)
        model.zero_grad()


def test_no_recompute_in_eval_or_no_grad() -> None:
    base = build_model()
    model = ckpt.apply(copy.deepcopy(base), "full").eval()
    plain = copy.deepcopy(base).eval()
    assert step(model, inputs())["flops"] == step(plain, inputs())["flops"]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs())
    with FlopCounterMode(display=False) as plain_counter:
        plain(**inputs())  # grad enabled, eval mode: no checkpoint either
    assert counter.get_total_flops() == plain_counter.get_total_flops()


@pytest.mark.parametrize("mode", ["full", 1, "selective"])
def test_traces_under_fake_tensor_mode_from_meta(mode: Any) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        model = build_model()
    ckpt.apply(model, mode)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        with LiveBytes():
            model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------------ effect


def test_full_keeps_one_hidden_state_per_layer() -> None:
    """Adding layers to a fully checkpointed model adds exactly one hidden state each."""
    hidden = TINY_CONFIGS["llama"]["hidden_size"]
    two, four = run_mode(build_model(layers=2), "full"), run_mode(build_model(layers=4), "full")
    assert four["saved"] - two["saved"] == 2 * BATCH * SEQ * hidden * 4
    none_two = run_mode(build_model(layers=2), "none")
    none_four = run_mode(build_model(layers=4), "none")
    assert (none_four["saved"] - none_two["saved"]) > 10 * (four["saved"] - two["saved"])


def test_layer_count_trades_memory_and_recompute_linearly() -> None:
    base = build_model(layers=4)
    runs = [run_mode(base, mode) for mode in ("none", 1, 2, 3, "full")]
    saved = [r["saved"] for r in runs]
    flops = [r["flops"] for r in runs]
    saving_per_layer = saved[0] - saved[1]
    assert saving_per_layer > 0
    for k, s in enumerate(saved):  # linear to within a few bytes (a (b, s, 1) norm statistic)
        assert abs(saved[0] - s - k * saving_per_layer) <= 0.01 * saving_per_layer
    recompute_per_layer = flops[1] - flops[0]
    assert [f - flops[0] for f in flops] == [k * recompute_per_layer for k in range(5)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_selective_saves_much_for_little_recompute(attn: str) -> None:
    """Korthikanti et al.'s trade: much of full recompute's saving, a small share of its FLOPs."""
    base = build_model(layers=2, attn=attn, hidden_size=128, intermediate_size=344,
                       num_attention_heads=4, num_key_value_heads=4)
    none, full, selective = (run_mode(base, m) for m in ("none", "full", "selective"))
    saving_share = (none["saved"] - selective["saved"]) / (none["saved"] - full["saved"])
    recompute_share = (selective["flops"] - none["flops"]) / (full["flops"] - none["flops"])
    assert saving_share > 0.4
    assert saving_share >= 4 * recompute_share
    if attn == "sdpa":  # only element-wise work is recomputed: no matmul FLOPs at all
        assert recompute_share == 0


# ------------------------------------------------------------------------------ failure paths


def test_bad_layer_counts_and_modes_name_the_field() -> None:
    model = build_model()
    with pytest.raises(MemtrainError, match=r"memory.checkpointing.*3 layers asked.*has 2"):
        ckpt.apply(model, 3)
    with pytest.raises(MemtrainError, match=r"memory\.checkpointing"):
        ckpt.apply(model, "sometimes")
    with pytest.raises(NoMatchError, match=r"memory\.checkpointing"):
        ckpt.apply(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "full")


def test_undo_restores_the_model() -> None:
    model = build_model()
    ckpt.apply(model, "selective")
    assert model.config.use_cache is False
    assert all(ckpt.is_checkpointed(layer) for _, layer in ckpt.find_layers(model))
    ckpt.undo(model)
    assert not any("forward" in layer.__dict__ for _, layer in ckpt.find_layers(model))
    assert model.config.use_cache is True
    assert not records(model)


def test_recipe_hook(tmp_path: Any, tiny_text_file: Any) -> None:
    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"checkpointing": 1}))
    model = apply_patches(build_model(), cfg, only=["checkpointing"])
    assert [r.modules for r in records(model)] == [["model.layers.0"]]
    auto = load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"checkpointing": "auto"}))
    with pytest.raises(MemtrainError, match="auto"):
        apply_patches(build_model(), auto, only=["checkpointing"])


def test_transformers_own_checkpointing_is_turned_off_without_its_deprecated_names() -> None:
    """A model with transformers' own checkpointing on gets memtrain's instead (never both), read
    and turned off through the names the installed transformers keeps: from 5.24 the old
    ``is_gradient_checkpointing`` / ``gradient_checkpointing_disable`` warn (FutureWarning,
    "removed in v6"), which users saw on every checkpointed run. (Planted: the old names read
    again -> the FutureWarning, an error here, fails it.)"""
    import warnings

    from memtrain._compat.transformers_model import own_checkpointing_on
    from tests.conftest import tiny_model

    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the enabling call, whatever name this version has
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    assert own_checkpointing_on(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ckpt.apply(model, "full")
        assert not own_checkpointing_on(model)
    assert not own_checkpointing_on(nn.Linear(2, 2))  # not a transformers model: off
    old = type("Old", (), {"is_gradient_checkpointing": property(lambda self: True)})()
    assert own_checkpointing_on(old)  # transformers before 5.24: the old name alone
