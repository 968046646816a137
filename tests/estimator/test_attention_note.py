"""The estimate says which attention kernel it traced, and when it holds an s x s matrix."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import causal_recipe

from memtrain.config import load_recipe
from memtrain.estimator.setup import trace_setup


def _note(tmp_path: Path, corpus: Path, arch: str, device: str, **model: object) -> str:
    recipe = causal_recipe(tmp_path, corpus, arch=arch, model=model,
                           training={"micro_batch_size": 1, "gradient_accumulation": 1})
    notes = trace_setup(load_recipe(recipe), (), device).notes
    (note,) = [n for n in notes if n.startswith("attention:")]
    return note


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_sdpa_without_dropout_is_traced_as_the_cpu_flash_kernel(tmp_path: Path, tiny_text_file: Path,
                                                                 device: str) -> None:
    note = _note(tmp_path, tiny_text_file, "llama", device)  # attention_dropout 0, one unpadded row
    assert note.startswith("attention: SDPA traced as PyTorch's CPU flash kernel: no s x s matrix")
    assert ("CUDA's flash (no mask) and memory-efficient (masked)" in note) == (device == "cuda")
    assert "mask" not in note.split("kept for backward")[0] and "4D attention mask" not in note


def test_attention_dropout_is_the_math_path_on_a_cpu_and_an_upper_bound_for_cuda(
        tmp_path: Path, tiny_text_file: Path) -> None:
    note = _note(tmp_path, tiny_text_file, "gpt2", "cuda")  # GPT-2: attn_pdrop 0.1
    assert note.startswith("attention: SDPA with dropout 0.1 takes PyTorch's math path on a CPU, an s x s")
    assert "this CUDA estimate is an upper bound" in note
    assert "upper bound" not in _note(tmp_path, tiny_text_file, "gpt2", "cpu")


def test_eager_attention_says_it_is_quadratic(tmp_path: Path, tiny_text_file: Path) -> None:
    note = _note(tmp_path, tiny_text_file, "llama", "cuda", attn_implementation="eager")
    assert note == ("attention: eager, an s x s matrix of scores per head kept for backward "
                    "(quadratic in length)")


# A model class without SDPA in every transformers memtrain supports: Bloom (Gemma-2, which found
# this, lost it in 5.25 for its soft-capped scores and has it in 5.19).
BLOOM = {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 30522}


def _bloom(tmp_path: Path, corpus: Path, **model: object) -> dict:
    recipe = causal_recipe(tmp_path, corpus, model=model,
                           training={"micro_batch_size": 1, "gradient_accumulation": 1})
    recipe["model"]["from_config"] = dict(BLOOM)
    return recipe


def test_a_model_without_sdpa_is_traced_and_named_as_eager(tmp_path: Path, tiny_text_file: Path) -> None:
    # transformers builds such a model with eager attention when none is asked for: the trace holds
    # its s x s matrices, and the note says so (it said SDPA before)
    plan = trace_setup(load_recipe(_bloom(tmp_path, tiny_text_file)), (), "cuda")
    (note,) = [n for n in plan.notes if n.startswith("attention:")]
    assert note.startswith("attention: eager, an s x s matrix") and "default" in note and "Bloom" in note


def test_sdpa_asked_of_a_model_without_it_names_the_field(tmp_path: Path, tiny_text_file: Path) -> None:
    from memtrain.config import RecipeError
    from memtrain.model import load_model

    recipe = load_recipe(_bloom(tmp_path, tiny_text_file, attn_implementation="sdpa"))
    for build in (lambda: trace_setup(recipe, (), "cpu"), lambda: load_model(recipe.model)):
        with pytest.raises(RecipeError) as err:
            build()
        (problem,) = err.value.problems
        assert problem.path == "model.attn_implementation" and problem.value == "sdpa"
        assert "eager" in problem.fix
