"""The memory-floor techniques end to end: lean k-bit loading trains like peft's upcast path, the
estimator traces each technique exactly, and the planner chooses them when the budget needs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import causal_recipe, merge, write_jsonl

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
from memtrain.estimator.real_step import measure_recipe_step
from memtrain.estimator.setup import resolve_config
from memtrain.plan import planner
from memtrain.plan.search import TraceCache

QWEN_150K = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936,
             "max_position_embeddings": 256, "tie_word_embeddings": True}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl",
                       [{"text": f"to be or not to be that is the question {i % 4}"} for i in range(80)])


@pytest.mark.slow
@pytest.mark.heavy
def test_lean_kbit_loading_trains_like_peft_upcast(tmp_path: Path, corpus: Path) -> None:
    """20 QLoRA steps (bf16 compute, nf4 base): the loss curve of the lean path stays within 0.5% of
    peft's fp32-upcast path at every logged step; frozen embeddings stay bf16, LoRA weights fp32."""
    from memtrain.run.train import train

    curves, models = {}, {}
    for lean in (True, False):
        recipe = causal_recipe(tmp_path / str(lean), corpus, model={"dtype": "bf16", "quantization": "nf4"},
                               training={"max_steps": 20, "learning_rate": 3e-3, "max_grad_norm": None,
                                         "micro_batch_size": 2},
                               memory={"lean_kbit": lean})
        result = train(load_recipe(recipe))
        curves[lean] = [h["loss"] for h in result.log_history if "loss" in h]
        models[lean] = result.model
    assert len(curves[True]) == 20 and curves[True][-1] < curves[True][0] - 0.25, curves  # it learns
    for step, (lean, upcast) in enumerate(zip(curves[True], curves[False], strict=True)):
        assert lean == pytest.approx(upcast, rel=0.005), f"step {step + 1}: {curves}"
    embed = dict(models[True].named_parameters())
    assert next(p for n, p in embed.items() if "embed_tokens" in n).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in embed.items() if p.requires_grad)
    upcast = dict(models[False].named_parameters())
    assert next(p for n, p in upcast.items() if "embed_tokens" in n).dtype == torch.float32


@pytest.mark.parametrize(("arch", "config"), [("llama", None), ("qwen-150k", QWEN_150K)])
@pytest.mark.parametrize("setting", [
    {"memory": {"loss": "chunked"}},
    {"adapter": {"method": "full"}, "training": {"optimizer_in_backward": True, "max_grad_norm": None}},
])
def test_estimator_equals_the_measured_step(tmp_path: Path, corpus: Path, arch: str, config: dict | None,
                                            setting: dict) -> None:
    """Each technique on the tiny Llama (vocabulary 30,522) and a Qwen shape with 151,936 tokens:
    the fake-tensor trace predicts the real step's live bytes exactly (both measured by the meter)."""
    recipe = causal_recipe(tmp_path, corpus, **setting)
    if config is not None:
        recipe["model"]["from_config"] = dict(config)
    cfg = load_recipe(recipe)
    predicted = estimate(cfg, device="cpu")
    measured = measure_recipe_step(cfg, resolve_config(cfg.model)[0])
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.by_category == measured.peak_by_category


def _peak(cfg: object) -> int:
    return estimate(cfg, device="cpu").peak_bytes  # type: ignore[arg-type]


@pytest.mark.parametrize(("auto", "lean", "full", "shape"), [
    # a 151,936-token vocabulary at 4 x 32 tokens: the logits set the peak
    ({"memory": {"loss": "auto"}}, {"memory": {"loss": "chunked"}}, {"memory": {"loss": "standard"}},
     {"model": {"from_config": dict(QWEN_150K)}, "training": {"micro_batch_size": 4}}),
    # the tiny Llama at 1 x 32 tokens: gradients and optimizer state set the peak (with many tokens
    # or a tied 150k embedding the peak is in the backward pass before any gradient is complete,
    # and the step inside backward saves nothing there: the planner then rightly leaves it off)
    ({"training": {"optimizer_in_backward": "auto"}}, {"training": {"optimizer_in_backward": True}},
     {"training": {"optimizer_in_backward": False}}, {"training": {"micro_batch_size": 1}}),
])
def test_planner_chooses_the_technique_only_when_the_budget_needs_it(
        tmp_path: Path, corpus: Path, auto: dict, lean: dict, full: dict, shape: dict) -> None:
    base = causal_recipe(tmp_path, corpus, adapter={"method": "full"},
                         training={"max_grad_norm": None, "gradient_accumulation": 1},
                         memory={"margin": 0.0})
    base = merge(base, shape)
    merged = lambda extra: load_recipe(merge(base, extra))  # noqa: E731
    small, large = _peak(merged(lean)), _peak(merged(full))
    assert small < large
    (field, value), = ((f"{k}.{kk}", vv) for k, v in lean.items() for kk, vv in v.items())
    cache = TraceCache()  # the plans below share their traces (none depends on the budget)
    tight = planner.plan(merged(auto), (small + large) // 2, device="cpu", cache=cache)
    assert tight.settings()[field] == value
    roomy = planner.plan(merged(auto), 2 * large, device="cpu", cache=cache)
    assert roomy.settings()[field] != value  # not worth it when everything fits
