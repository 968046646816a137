"""The planner's lower bound never exceeds the time it predicts once it has traced a candidate.

The search skips a candidate whose bound is over the fastest that fits (branch and bound,
memtrain/plan/search.py): a bound above the candidate's own prediction would drop the winner
unseen. Every technique the planner searches over, on two MLP shapes (Llama's three projections,
GPT-2's two), against the nominal CUDA rates the long-context plans use.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import causal_recipe

from memtrain.config import load_recipe
from memtrain.patches import tiled_mlp
from memtrain.plan import costmodel
from memtrain.plan.search import Search, TraceCache

FIELDS = {"checkpointing": "auto", "tiled_mlp": "auto", "lean_norm": "auto",
          "offload": {"activations": "auto"}, "loss": "auto"}


def _rates(term: str) -> costmodel.Rates:
    """Rates under which one term of the cost model is the whole step time (the others free), so
    the bound is checked term by term rather than hidden in the slack of another."""
    free = 1e30
    values = {"matmul_flops": {"fp32": free, "bf16": free, "fp16": free}, "memory_bandwidth": free,
              "host_to_device_bandwidth": free, "device_to_host_bandwidth": free, "op_seconds": 0.0,
              "optimizer_seconds_per_parameter": {"adamw": 0.0}, "dequantize_nf4_elements": free}
    slow = {"matmul": ("matmul_flops", {"fp32": 1e9, "bf16": 1e9, "fp16": 1e9}),
            "memory": ("memory_bandwidth", 1e9), "launch": ("op_seconds", 1e-5),
            "offload": ("host_to_device_bandwidth", 1e8)}[term]
    return costmodel.Rates(f"{term} only", {**values, slow[0]: slow[1]})


@pytest.mark.parametrize(("arch", "fields"), [
    pytest.param("llama", FIELDS, marks=pytest.mark.long),  # every technique: 52 s in the suite
    ("llama", {"checkpointing": "full", "tiled_mlp": True, "offload": {"activations": "auto"},
               "loss": "auto"}),  # its offload and loss terms, in the suite
    ("gpt2", {"checkpointing": "auto", "tiled_mlp": "auto"}),
    # techniques the recipe fixes are in the bound's trace already: not added again
    ("llama", {"checkpointing": "full", "tiled_mlp": True, "tiled_mlp_tile_tokens": "auto",
               "lean_norm": "auto"}),
])
def test_the_bound_is_at_most_the_prediction(tmp_path: Path, tiny_text_file: Path, arch: str, fields: dict,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, arch, data={"max_length": 64},
                           training={"micro_batch_size": 1, "gradient_accumulation": 1},
                           memory={"tiled_mlp_tile_tokens": 32, **fields})
    cfg = load_recipe(recipe)
    cache = TraceCache()  # one cache for the four searches: each setting is traced once
    for term in ("matmul", "memory", "launch", "offload"):
        monkeypatch.setattr(costmodel, "rates", lambda device, term=term: _rates(term))
        search = Search(cfg, "cuda", 2**40, cache=cache)
        assert search.cost_model is not None
        checked = 0
        for cand in search.candidates():
            if search.inapplicable(cand) is not None:
                continue
            search.evaluate(cand)
            assert cand.seconds < math.inf, cand.reason
            bound = search.lower_bound(cand)
            assert bound <= cand.seconds * (1 + 1e-9), (term, cand.label(), bound, cand.seconds, cand.parts)
            checked += 1
        assert checked >= 2 ** len([v for v in fields.values() if v == "auto"])


def test_the_tiled_bound_counts_the_mlp_forward_it_repeats() -> None:
    weights = 32 * 3 * 4096 * 14336  # Llama-3.1-8B's MLPs
    assert tiled_mlp.tiled_recompute_flops(weights, 131_072) == 2 * weights * 131_072


@pytest.mark.long  # the bound term by term, in the suite: test_the_bound_is_at_most_the_prediction
def test_the_bound_holds_at_the_micro_batch_that_fits() -> None:
    """The bound is computed before the trace says which micro-batch fits. The quickstart with
    `micro_batch_size: auto` and no effective batch, where a step grows with the micro-batch:
    candidates are ranked, and bounded, per example there (at the largest micro-batch an example
    costs least). Bounded per step at micro-batch 1,024, every candidate but full checkpointing was
    pruned once a leanest-first trace had found that one fitting at micro-batch 25 (`checkpointing:
    none` fits 6 and is faster per step and per example). (Planted: the per-step bound -> fails.)"""
    cfg = load_recipe("recipes/quickstart.yaml", ["training.micro_batch_size=auto",
                                                  "memory.checkpointing=auto"])
    search = Search(cfg, "cpu", 180 * 2**20)
    micros = set()
    for cand in search.candidates():
        search.evaluate(cand)
        assert cand.seconds < math.inf
        assert search.per_example
        assert search.lower_bound(cand) <= search.time(cand) * (1 + 1e-9), (cand.label(), cand.parts)
        micros.add(cand.micro)
    assert len(micros) >= 2  # candidates fit different micro-batches
