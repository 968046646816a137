"""vLLM colocated with TRL's GRPO, planned in bytes (issue 38, item 3): the utilization against vLLM's
own KV-cache sizing rules, counted here by hand from vLLM's source (v1 engine: ``gpu_worker.py``'s
``requested_memory`` and ``determine_available_memory``, ``kv_cache_utils.py``'s block count and
one-request check, ``kv_cache_interface.py``'s page size), and the plugin setting it.

No vLLM here (it needs a GPU): the rules are written out in the tests, not imported from memtrain.
Planted when written: the KV page without the factor 2 (keys only) -> the 8B block count fails;
vLLM's one-request check ignored -> the 131,072-token case fails; the null block left out -> the
block count fails; tensor parallelism not dividing the KV heads -> the TP test fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memtrain.estimator.vllm_colocate import STEP, colocate_share

GIB = 2**30
# meta-llama/Llama-3.1-8B's config (its published config.json) and weight count
LLAMA_8B = SimpleNamespace(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                           hidden_size=4096, head_dim=128, intermediate_size=14336, vocab_size=128256)
PARAMETERS_8B = 8_030_261_248


def vllm_blocks(kv_bytes: int, text: Any, size: int, tp: int = 1) -> int:
    """vLLM's block count: the memory over one block's bytes (page size of every layer), where the page
    is key and value of 16 tokens: 2 x 16 x kv_heads x head_size x dtype size per layer."""
    page = 2 * 16 * (text.num_key_value_heads // tp) * text.head_dim * size
    return kv_bytes // (page * text.num_hidden_layers)


def vllm_kv_bytes(total: int, utilization: float, non_kv: int) -> int:
    """requested_memory = ceil(total x utilization); the KV cache is what the profile leaves of it."""
    return math.ceil(total * utilization) - non_kv


def test_the_8b_share_holds_the_generation_batch_and_is_the_smallest() -> None:
    total = 80 * GIB
    share = colocate_share(LLAMA_8B, total=total, parameters=PARAMETERS_8B, sequences=8, length=256 + 1024,
                           dtype="float32")  # vLLM loads a float32 config's weights in bfloat16
    assert share.weights == 2 * PARAMETERS_8B
    per_sequence = math.ceil(1280 / 16)  # 80 blocks
    assert share.blocks_needed == 8 * per_sequence + 1  # and the null block the pool holds back
    non_kv = share.weights + share.profile + share.non_torch
    blocks = vllm_blocks(vllm_kv_bytes(total, share.utilization, non_kv), LLAMA_8B, 2)
    assert blocks - 1 >= 8 * per_sequence  # every completion at full length at once
    fewer = vllm_blocks(vllm_kv_bytes(total, share.utilization - STEP, non_kv), LLAMA_8B, 2)
    assert fewer - 1 < 8 * per_sequence  # 0.01 less would not hold them
    assert share.concurrent == (blocks - 1) // per_sequence >= 8
    assert 0.2 < share.utilization < 0.3  # TRL's default 0.3 reserves more than this batch needs
    assert share.held == math.ceil(total * share.utilization) + share.cuda_graphs


def test_vllm_sizes_its_one_request_check_for_max_model_len() -> None:
    """Left unset, vLLM's max_model_len is the model's positions: one request of 131,072 tokens must fit
    (8,192 blocks of 2 MiB: 16 GiB), whatever the generation batch needs."""
    total = 80 * GIB
    short = colocate_share(LLAMA_8B, total=total, parameters=PARAMETERS_8B, sequences=8, length=1280)
    whole = colocate_share(LLAMA_8B, total=total, parameters=PARAMETERS_8B, sequences=8, length=1280,
                           max_model_len=131072)
    assert whole.blocks_needed == 131072 // 16 + 1
    non_kv = whole.weights + whole.profile + whole.non_torch
    blocks = vllm_blocks(vllm_kv_bytes(total, whole.utilization, non_kv), LLAMA_8B, 2)
    assert blocks - 1 >= 131072 // 16  # vLLM's "... KV cache is needed" check passes
    assert whole.utilization - short.utilization >= (131072 // 16 - 640) * 2 * 2**20 / total - STEP


def test_tensor_parallel_and_4_bit_weights() -> None:
    total = 24 * GIB
    embeddings = 2 * 128256 * 4096  # the input embedding and the head stay bf16; the linears are 4-bit
    linears = PARAMETERS_8B - embeddings
    one = colocate_share(LLAMA_8B, total=total, parameters=embeddings, quantized=linears, sequences=16,
                         length=2048)
    assert one.weights == 2 * embeddings + linears // 2 + 4 * math.ceil(linears / 64)  # fp32 absmax per 64
    two = colocate_share(LLAMA_8B, total=total, parameters=embeddings, quantized=linears, sequences=16,
                         length=2048, tensor_parallel=2)
    assert two.block_bytes * 2 == one.block_bytes == 2 * 16 * 8 * 128 * 2 * 32
    assert two.weights == one.weights // 2
    non_kv = two.weights + two.profile + two.non_torch
    assert vllm_blocks(vllm_kv_bytes(total, two.utilization, non_kv), LLAMA_8B, 2, tp=2) - 1 >= 16 * 128


def test_a_utilization_already_built_is_kept_and_its_shortfall_said() -> None:
    share = colocate_share(LLAMA_8B, total=80 * GIB, parameters=PARAMETERS_8B, sequences=64, length=4096,
                           utilization=0.3)
    assert share.utilization == 0.3 and not share.fits
    non_kv = share.weights + share.profile + share.non_torch
    blocks = vllm_blocks(vllm_kv_bytes(80 * GIB, 0.3, non_kv), LLAMA_8B, 2)
    assert share.concurrent == (blocks - 1) // 256 < 64


@pytest.mark.slow
def test_prepare_for_budget_sets_vllms_share_and_plans_training_into_the_rest(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    from plain_trainer import tiny_model

    import memtrain

    budget = 4 * GIB  # on a CPU the budget stands for the GPU vLLM takes its share of
    args = trl.GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate",
                          per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
                          max_completion_length=16, use_cpu=True, report_to="none", bf16=False)
    model = tiny_model()
    text = model.config
    model, new = memtrain.prepare_for_budget(model, args, budget, max_length=48, quiet=True)
    plan = model.memtrain_plan
    share = plan.vllm
    assert share is not None and share.sequences == 8 and share.length == 48  # generation batch, length
    assert new.vllm_gpu_memory_utilization == share.utilization != args.vllm_gpu_memory_utilization
    assert new.vllm_max_model_length == 48 and args.vllm_max_model_length is None
    assert plan.budget == budget - share.held  # the training step gets the rest (no sleep mode)
    weights = sum(p.numel() for p in model.parameters()) * 2  # float32 config: vLLM loads bfloat16
    assert share.weights == weights
    blocks = vllm_blocks(vllm_kv_bytes(budget, share.utilization, weights + share.profile + share.non_torch),
                         SimpleNamespace(num_key_value_heads=text.num_key_value_heads,
                                         head_dim=text.hidden_size // text.num_attention_heads,
                                         num_hidden_layers=text.num_hidden_layers), 2)
    assert blocks - 1 >= 8 * 3  # 8 completions of 48 tokens: 3 blocks each
    assert {c.setting for c in plan.changes} >= {"vllm_gpu_memory_utilization", "vllm_max_model_length"}
    assert any("vLLM colocated" in note for note in plan.notes)
    asleep = trl.GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate",
                            vllm_enable_sleep_mode=True, per_device_train_batch_size=4,
                            gradient_accumulation_steps=2, num_generations=4, max_completion_length=16,
                            use_cpu=True, report_to="none", bf16=False)
    model, _ = memtrain.prepare_for_budget(tiny_model(), asleep, budget, max_length=48, quiet=True)
    assert model.memtrain_plan.budget == budget - model.memtrain_plan.vllm.cuda_graphs  # released to train


@pytest.mark.slow
def test_a_share_that_leaves_training_nothing_is_a_clear_error(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    from plain_trainer import tiny_model

    import memtrain
    from memtrain.errors import MemtrainError

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate",
                          per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
                          use_cpu=True, report_to="none", bf16=False)
    with pytest.raises(MemtrainError) as err:  # vLLM's share and graphs take more than the 1 GiB budget
        memtrain.prepare_for_budget(tiny_model(), args, GIB, max_length=48, quiet=True)
    said = str(err.value)
    assert "vLLM colocated takes" in said and "leaving nothing to train" in said
    assert "vllm_enable_sleep_mode=True" in said and "vllm_mode='server'" in said
