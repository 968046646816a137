"""The estimator across the torch versions a GPU machine may have (pyproject: torch>=2.6).

The first GPU session ran torch 2.11 (the CPU tests run 2.13): there every estimate failed, first
on a MemTracker attribute 2.13 added, then, for micro-batch-1 rows of grouped-query models, on
torch 2.11's attention FLOP formula, which asserts equal query and key/value heads.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from memtrain.estimator.trace_events import flop_count


def _torch_2_11_sdpa(query, key, value, *args, out_val=None, **kwargs) -> int:
    """torch 2.11's rule: equal heads or an AssertionError; 4·b·h·s_q·s_k·d forward."""
    b, h, s_q, d = query.shape if isinstance(query, torch.Tensor) else query
    kshape = key.shape if isinstance(key, torch.Tensor) else key
    if tuple(kshape[:2]) != (b, h):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    return 4 * b * h * s_q * kshape[2] * d


def _qkv(kv_heads: int) -> tuple[torch.Tensor, ...]:
    with FakeTensorMode():
        q = torch.empty(2, 8, 64, 32, dtype=torch.bfloat16)
        k = torch.empty(2, kv_heads, 64, 32, dtype=torch.bfloat16)
        return q, k, torch.empty_like(k)


def test_grouped_query_attention_counts_as_broadcast_heads() -> None:
    assert flop_count(_torch_2_11_sdpa, _qkv(2), {}, None) == 4 * 2 * 8 * 64 * 64 * 32
    assert flop_count(_torch_2_11_sdpa, _qkv(2), {}, None) == flop_count(_torch_2_11_sdpa, _qkv(8), {}, None)


def test_this_torch_agrees_with_the_broadcast_count() -> None:
    count = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
    assert flop_count(count, _qkv(2), {}, None) == flop_count(count, _qkv(8), {}, None) > 0


def test_other_assertions_still_raise() -> None:
    def broken(*args, out_val=None, **kwargs) -> int:
        raise AssertionError("not about heads")

    with pytest.raises(AssertionError):
        flop_count(broken, (torch.empty(3),), {}, None)
