"""`adapter.target_modules`: every name must match a module; the error names each one that matched
nothing and lists the model's linear layers (issue 35 part 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import causal_recipe, tiny_model
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import AdapterConfig
from memtrain.patches import NoMatchError, records
from memtrain.patches.lora import apply

LLAMA_LINEAR = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


def _adapt(arch: str, targets: list[str]):
    return apply(tiny_model(arch), AdapterConfig(target_modules=targets, r=2, alpha=4, dropout=0.0))


def test_a_wrong_name_beside_a_right_one_is_refused_not_skipped() -> None:
    with pytest.raises(NoMatchError) as err:
        _adapt("llama", ["q_proj", "wq"])
    said = str(err.value)
    assert said.startswith("`adapter.target_modules`: `wq` matches no module of this model (`q_proj` did)")
    assert "refused, not skipped" in said and f"linear layers are named: {LLAMA_LINEAR}." in said
    assert "Fix: correct or remove `wq`" in said and "`adapter.target_modules: all-linear`" in said


def test_when_no_name_matches_the_model_names_its_layers_instead_of_peft() -> None:
    with pytest.raises(NoMatchError, match=r"`adapter.target_modules`: no name matches a module of this "
                                           r"model \(`wq`, `wk`\)\. This model's linear layers are named: "
                                           r"c_attn, c_proj, c_fc, lm_head\."):
        _adapt("gpt2", ["wq", "wk"])  # GPT-2's layers are transformers' Conv1D


def test_names_match_as_peft_matches_them() -> None:
    model = _adapt("llama", ["q_proj", "self_attn.v_proj"])  # a last name, and a dotted end
    adapted = records(model)[0].modules
    assert len(adapted) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in adapted)
    with pytest.raises(NoMatchError, match="`_proj`"):  # a part of a name is not an end of it
        _adapt("llama", ["q_proj", "_proj"])


def test_estimate_exits_2_naming_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path, tiny_text_file)), encoding="utf-8")
    result = CliRunner().invoke(app, ["estimate", str(path), "--device", "cpu",
                                      "adapter.target_modules=[q_proj, wq]"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "`adapter.target_modules`: `wq` matches no module" in said and LLAMA_LINEAR in said
    assert "Traceback" not in said


def test_building_the_adapter_prints_no_deprecation_of_transformers_names() -> None:
    """peft 0.21 reads ``is_gradient_checkpointing``, which transformers 5.24 renamed (a FutureWarning
    on every LoRA run, nothing a user can act on); memtrain's LoRA patch builds the adapter without
    it. (Planted: ``get_peft_model`` called bare -> the FutureWarning, an error here, fails it on
    5.24; 5.19-5.23 never warn.)"""
    import warnings

    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        adapted = apply(model, AdapterConfig(), "causal-lm")
    assert any(".lora_A." in name for name, _ in adapted.named_parameters())


def test_all_linear_leaves_alone_a_linear_layer_that_returns_more_than_its_output() -> None:
    """Llama-4's router is an ``nn.Linear`` that returns (scores, logits): peft's all-linear adapted
    it and the step failed adding LoRA's update to a tuple (an internal error in train and estimate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama4_text", hidden_size=32, intermediate_size=64,
                                  intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                  num_experts_per_tok=1, vocab_size=128)
    torch.manual_seed(0)
    model = apply(AutoModelForCausalLM.from_config(config), AdapterConfig(r=2, alpha=4, dropout=0.0))
    adapted = records(model)[0].modules
    assert adapted and not any(n.endswith("router") for n in adapted)
    assert any(n.endswith("shared_expert.down_proj") for n in adapted)  # the others are adapted
    out = model(input_ids=torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8)))
    out.loss.backward()


def test_all_linear_on_a_mamba_mixer_names_the_field_and_the_fix() -> None:
    """peft refuses LoRA on Falcon-H1's Mamba projections; with `all-linear` the user cannot simply
    drop them, so the error names `adapter.target_modules` and says what to list instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtrain.config import RecipeError

    config = AutoConfig.for_model("falcon_h1", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
                                  mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                                  vocab_size=128)
    with pytest.raises(RecipeError, match=r"`adapter.target_modules`: peft cannot adapt some of these layers "
                                          r"\(.*Mamba.*\), got 'all-linear'\. Fix: list the layers"):
        apply(AutoModelForCausalLM.from_config(config), AdapterConfig(r=2, alpha=4, dropout=0.0))
    model = apply(AutoModelForCausalLM.from_config(config),
                  AdapterConfig(target_modules=["q_proj", "v_proj"], r=2, alpha=4, dropout=0.0))
    assert len(records(model)[0].modules) == 4
