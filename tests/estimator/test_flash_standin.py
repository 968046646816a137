"""FlashAttention in an estimate: traced as a stand-in that keeps what it keeps
(memtrain/estimator/flash_standin.py), and a clear error where it cannot run or the model has none."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_CONFIGS, causal_recipe

from memtrain.config import RecipeError, load_recipe
from memtrain.estimator.estimate import estimate

COMPARED = ("peak_bytes", "by_category", "by_phase", "category_at_phase_peak", "overheads", "total_bytes",
            "parameters", "trainable")
GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 30522,
          "max_position_embeddings": 1024}


def _cfg(tmp_path: Path, corpus: Path, config: dict[str, Any], attn: str, length: int = 32) -> Any:
    recipe = causal_recipe(tmp_path, corpus, model={"attn_implementation": attn},
                           training={"micro_batch_size": 1, "gradient_accumulation": 1})
    recipe["model"]["from_config"] = copy.deepcopy(config)
    recipe["data"]["max_length"] = length
    return load_recipe(recipe)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_flash_attention_is_traced_as_sdpas_flash_kernel_without_dropout(arch: str, tmp_path: Path,
                                                                         tiny_text_file: Path) -> None:
    # Llama (no attention dropout): every figure as SDPA's. GPT-2's attention dropout (0.1) sends
    # SDPA to its math path on a CPU (an s x s matrix); FlashAttention keeps none: as SDPA without it.
    config = TINY_CONFIGS[arch]
    no_dropout = {**config, "attn_pdrop": 0.0} if arch == "gpt2" else config
    flash = estimate(_cfg(tmp_path, tiny_text_file, config, "flash_attention_2"), device="cuda")
    sdpa = estimate(_cfg(tmp_path, tiny_text_file, no_dropout, "sdpa"), device="cuda")
    for name in COMPARED:
        assert getattr(flash, name) == getattr(sdpa, name), name
    (note,) = [n for n in flash.notes if n.startswith("attention:")]
    assert note.startswith("attention: flash_attention_2, traced as a stand-in") and "4D mask" in note
    if arch == "gpt2":
        dropped = estimate(_cfg(tmp_path, tiny_text_file, config, "sdpa"), device="cuda")
        assert dropped.peak_bytes > flash.peak_bytes


def test_gemma2_with_flash_attention_grows_linearly_where_eager_grows_quadratically(
        tmp_path: Path, tiny_text_file: Path) -> None:
    """Gemma-2's class has no SDPA: by default eager, an s x s matrix per head. With FlashAttention
    the peak is affine in the length (equal steps, equal growth); eager's is not."""
    def second_difference(attn: str) -> int:
        p = [estimate(_cfg(tmp_path, tiny_text_file, GEMMA2, attn, length), device="cpu").peak_bytes
             for length in (128, 256, 384)]
        return p[2] - 2 * p[1] + p[0]

    assert second_difference("flash_attention_2") == 0
    assert second_difference("eager") >= 4 * 128 * 128 * 4  # heads x (s steps)^2 x float32, at least


def test_flash_attention_on_a_model_without_it_names_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    bloom = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 30522}
    with pytest.raises(RecipeError) as err:
        estimate(_cfg(tmp_path, tiny_text_file, bloom, "flash_attention_2"), device="cuda")
    (problem,) = err.value.problems
    assert problem.path == "model.attn_implementation" and problem.value == "flash_attention_2"
    assert "eager" in problem.fix  # Bloom has no SDPA either


def test_training_where_flash_attention_cannot_run_names_the_field(tmp_path: Path,
                                                                   tiny_text_file: Path) -> None:
    """No flash-attn package and no CUDA here: loading the model for training says which field, and
    that estimates need neither."""
    from memtrain.model import load_model

    cfg = _cfg(tmp_path, tiny_text_file, TINY_CONFIGS["llama"], "flash_attention_2")
    with pytest.raises(RecipeError) as err:
        load_model(cfg.model)
    (problem,) = err.value.problems
    assert problem.path == "model.attn_implementation" and "flash-attn" in problem.fix


@pytest.mark.parametrize(("found", "planned"), [("flash_attention_2", "flash_attention_2"),
                                                ("kernels-community/flash-attn2", "flash_attention_2"),
                                                ("flash_attention_3", "flash_attention_3"),
                                                ("eager", "eager"), ("flex_attention", None), (None, None)])
def test_the_plugin_plans_a_users_flash_kernel_as_flash(found: str | None, planned: str | None,
                                                        monkeypatch) -> None:
    import torch

    from memtrain.plugin import options

    monkeypatch.setattr(options, "attn_implementation", lambda config: found)
    model = torch.nn.Linear(2, 2)
    model.config = object()  # type: ignore[assignment]
    assert options.planned_attention(model) == planned


def test_a_users_gemma2_on_flash_attention_is_planned_without_eagers_matrices(tmp_path: Path) -> None:
    """Through the plugin, as a GPU script leaves the model (``from_pretrained(...,
    attn_implementation="flash_attention_2")`` sets the config): the plan traces the stand-in, not
    eager attention (tokens x tokens per head), which transformers 5.25 gives Gemma-2 by default."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    import memtrain

    def gemma2(attn: str) -> Any:
        config = AutoConfig.for_model(**{**GEMMA2, "vocab_size": 512, "max_position_embeddings": 2048})
        model = AutoModelForCausalLM.from_config(config)
        model.config._attn_implementation = attn
        return model

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[])
    peaks = {}
    for attn in ("eager", "flash_attention_2"):
        model, _ = memtrain.prepare_for_budget(gemma2(attn), args, "2GiB", max_length=1024, quiet=True)
        peaks[attn] = model.memtrain_plan.predicted_peak
    assert peaks["flash_attention_2"] * 4 < peaks["eager"]
