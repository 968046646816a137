"""What a trace says the step computes (``Work``), which the planner's cost model turns into time.

A trace on this CPU plans CUDA runs too, on ops CUDA does not run: attention dispatches CPU's flash
kernel and a 4-bit layer bitsandbytes' ``gemm_4bit``, neither in torch's FLOP registry. Before
they were counted (memtrain.estimator.trace_events.extra_flop_formulas) a long-context plan saw no
attention FLOPs and QLoRA no forward matmuls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY_CONFIGS, causal_recipe

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate

LLAMA = TINY_CONFIGS["llama"]
HEADS, LAYERS = LLAMA["num_attention_heads"], LLAMA["num_hidden_layers"]
HEAD_DIM = LLAMA["hidden_size"] // HEADS


def _work(tmp_path: Path, data: Path, length: int, arch: str = "llama", **memory: object):
    model = memory.pop("model", {})
    recipe = causal_recipe(tmp_path, data, arch, data={"max_length": length}, model=model,
                           training={"micro_batch_size": 1, "gradient_accumulation": 1}, memory=memory)
    return estimate(load_recipe(recipe), device="cuda").work


def test_attention_flops_are_counted_on_this_cpu(tmp_path: Path, tiny_text_file: Path) -> None:
    short, long = (_work(tmp_path, tiny_text_file, n) for n in (64, 128))
    # what grows with the square of the length: per layer and head, QK^T and PV forward (2 matmuls),
    # backward's recompute of the scores and four gradients (5): 2 * s * s * d FLOPs each
    quadratic = long.flops - 2 * short.flops
    assert quadratic == 14 * HEADS * HEAD_DIM * LAYERS * (128**2 - 2 * 64**2)


def test_a_4bit_layer_counts_the_flops_of_the_layer_it_replaces(tmp_path: Path, tiny_text_file: Path) -> None:
    lora = _work(tmp_path, tiny_text_file, 64, model={"dtype": "bf16"})
    qlora = _work(tmp_path, tiny_text_file, 64, model={"dtype": "bf16", "quantization": "nf4"})
    assert qlora.flops == lora.flops > 0


def test_full_checkpointing_repeats_exactly_the_layers_forward(tmp_path: Path, tiny_text_file: Path) -> None:
    plain = _work(tmp_path, tiny_text_file, 64)
    full = _work(tmp_path, tiny_text_file, 64, checkpointing="full")
    assert 0 < plain.layer_forward_flops < plain.flops / 2
    assert full.flops - plain.flops == plain.layer_forward_flops


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_recompute_a_plain_trace_predicts_is_at_most_what_checkpointing_adds(
        tmp_path: Path, tiny_text_file: Path, arch: str) -> None:
    """The planner bounds a checkpointing candidate from the plain trace: its FLOPs, ops and bytes
    written plus what the recompute runs at least (``Work.recomputed``). Each at most what a traced
    step with that checkpointing adds, and close to it (within 10%: a bound that prunes). Planted:
    counting each layer's forward whole, past its last op that saves for backward (torch's early
    stop skips those in the recompute) -> the bytes written exceed what full checkpointing adds."""
    plain = _work(tmp_path, tiny_text_file, 64, arch)
    layers = TINY_CONFIGS[arch].get("num_hidden_layers") or TINY_CONFIGS[arch]["n_layer"]
    for mode, bound in (("full", plain.recomputed), ("selective", plain.recomputed_selective),
                        (1, plain.recomputed.scaled(1 / layers))):
        step = _work(tmp_path, tiny_text_file, 64, arch, checkpointing=mode)
        added = (step.flops - plain.flops, step.ops - plain.ops, step.written - plain.written)
        assert bound.flops == added[0], (mode, bound, added)
        assert bound.ops <= added[1] and 0.9 * added[2] <= bound.written <= added[2], (mode, bound, added)
    assert plain.recomputed_selective.written < plain.recomputed.written  # matmul outputs kept
