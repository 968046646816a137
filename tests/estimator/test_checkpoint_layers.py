"""`memory.checkpointing: n` (the first n of L layers) estimated from three short traces.

With n checkpointed layers and L - n plain ones, the estimator traces (checkpointed, plain) =
(2, 2), (3, 2) and (2, 3) layers and extrapolates every representative op affinely in both counts
(:func:`memtrain.estimator.trace.extrapolate_checkpointed`); where n = L / 2 (the planner's n),
(2, 2) and (3, 3) layers along the diagonal
(:func:`memtrain.estimator.trace.extrapolate_checkpointed_evenly`). Each case compares that, figure
by figure (peak, phases, categories, host, CUDA lines, parameter counts and the step's work), with a
trace of every layer (``exact=True``), on 8-layer models: Llama, Qwen2 (grouped-query attention)
and GPT-2, with LoRA and full fine-tuning, activation offload on and off, and the long-context loops
(tiled MLP, chunked loss) elided. Where the traces ran every iteration, the extrapolated candidate
ops are also compared row by row with those of the same layers in the whole trace (the figures of
an estimate are maxima, which a tiny model's head and loss often hold).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memtrain.config import load_recipe
from memtrain.estimator import estimate as est
from memtrain.estimator import pool
from memtrain.estimator.estimate import estimate
from memtrain.estimator.trace import HOST, Trace, extrapolate_checkpointed, extrapolate_checkpointed_evenly
from tests.conftest import TINY_CONFIGS, causal_recipe

DEPTH = 8  # deeper than the 2 + 3 layers traced, so the fast estimate extrapolates
COMPARED = ("peak_bytes", "by_category", "by_phase", "category_at_phase_peak", "host_peak_bytes",
            "host_resident_bytes", "host_moved_bytes", "overheads", "overhead_sources", "total_bytes",
            "parameters", "trainable", "work")
FULL = {"adapter": {"method": "full"}}
OFFLOAD = {"offload": {"activations": True, "min_tensor_bytes": 0}}
LONG = {"loss": "chunked", "loss_chunk_tokens": 48, "tiled_mlp": True, "tiled_mlp_tile_tokens": 64}

CASES: dict[str, tuple[str, int, dict[str, Any], dict[str, Any]]] = {  # arch, n, memory, other sections
    "llama-lora-3": ("llama", 3, {}, {}),
    "llama-full-5": ("llama", 5, {}, FULL),
    "qwen2-lora-4": ("qwen2", 4, {}, {}),
    "qwen2-full-3-offload": ("qwen2", 3, OFFLOAD, FULL),
    "gpt2-full-4": ("gpt2", 4, {}, FULL),
    "gpt2-lora-3-offload": ("gpt2", 3, OFFLOAD, {}),
    "llama-lora-4-offload-accumulation": ("llama", 4, OFFLOAD,
                                          {"training": {"micro_batch_size": 2, "gradient_accumulation": 2}}),
}


def _cfg(tmp_path: Path, data: Path, arch: str, n: int, memory: dict[str, Any],
         sections: dict[str, Any], length: int = 32) -> Any:
    sections = copy.deepcopy(sections)
    training = {"micro_batch_size": 1, **sections.pop("training", {})}
    recipe = causal_recipe(tmp_path, data, arch, training=training,
                           memory={**memory, "checkpointing": n}, **sections)
    recipe["model"]["from_config"] = config = copy.deepcopy(TINY_CONFIGS[arch])
    gpt2 = arch == "gpt2"
    config["n_layer" if gpt2 else "num_hidden_layers"] = DEPTH
    config["n_positions" if gpt2 else "max_position_embeddings"] = max(256, length)
    recipe["data"]["max_length"] = length
    return load_recipe(recipe)


@pytest.fixture
def traced(monkeypatch) -> list[list[Trace]]:
    """The traces of each :func:`memtrain.estimator.pool.run_all` call the estimates make."""
    seen: list[list[Trace]] = []

    def run_all(jobs: Any, cuda: bool = False) -> list[Trace]:
        seen.append(pool.run_all(jobs, cuda))
        return seen[-1]

    monkeypatch.setattr(est, "run_all", run_all)
    return seen


def _same(cfg: Any, traced: list[list[Trace]]) -> Any:
    fast = estimate(cfg, device="cuda")  # CUDA: the allocator's rounding and fragmentation lines too
    short = traced[-1]
    full = estimate(cfg, device="cuda", exact=True)
    n = cfg.memory.checkpointing
    shapes = "2+2 and 3+3" if 2 * n == DEPTH else "2+2, 3+2 and 2+3"  # half: two traces (KINDS_EVEN)
    assert fast.method.startswith(f"traced {shapes} of {n}+{DEPTH - n} layers (checkpointed+plain), "
                                  "extrapolated"), fast.method
    assert full.method == f"traced all {DEPTH} layers"
    for name in COMPARED:
        assert getattr(fast, name) == getattr(full, name), name
    assert full.work is not None and full.overheads["allocator_rounding"] > 0
    if not any(t.elided for t in short):
        _same_rows(short, traced[-1][0], n)
    return fast


def _same_rows(short: list[Trace], whole: Trace, n: int) -> None:
    """The extrapolated candidates are the whole trace's ops of layers 0, 1, n - 1 (checkpointed),
    n, n + 1, L - 1 (plain) and of those outside the layers, phase occurrence by occurrence (where
    the op count of an occurrence outside the layers depends on the depth, as a per-parameter loop
    in the optimizer would, the extrapolation keeps its largest op)."""
    found = (extrapolate_checkpointed_evenly(*short, n) if len(short) == 2 else
             extrapolate_checkpointed(*short, n, DEPTH - n))
    assert found is not None
    labels = np.array(found.phases)
    starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])  # one run per phase occurrence
    runs = np.split(found.values, starts[1:])
    assert [found.phases[k] for k in starts] == whole.phases
    for occ, got in enumerate(runs):
        want = _representative(whole, occ, [0, 1, n - 1, n, n + 1, DEPTH - 1]).astype(np.float64)
        if got.shape != want.shape and not (whole.layer[whole.occurrence == occ] >= 0).any():
            top = lambda v: v[np.argmax(v[:, :HOST].sum(axis=1))]  # noqa: E731
            got, want = top(got), top(want)
        assert np.array_equal(got, want), (whole.phases[occ], occ)


def _representative(trace: Trace, occ: int, layers: list[int]) -> np.ndarray:
    """One phase occurrence's ops before the layers, those of ``layers`` in that order, those after."""
    mask = trace.occurrence == occ
    values, owner = trace.values[mask], trace.layer[mask].copy()
    inside = np.flatnonzero(owner >= 0)
    if inside.size == 0:
        return values
    first, last = inside[0], inside[-1]
    for k in range(last - 1, first, -1):  # ops between two layers belong to the layer after them
        if owner[k] < 0:
            owner[k] = owner[k + 1]
    return np.concatenate([values[:first], *(values[owner == i] for i in layers), values[last + 1:]])


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_and_plain_layers_extrapolate_to_the_whole_trace(case: str, tmp_path: Path,
                                                                      tiny_text_file: Path, traced) -> None:
    arch, n, memory, sections = CASES[case]
    fast = _same(_cfg(tmp_path, tiny_text_file, arch, n, memory, sections), traced)
    if memory:
        assert fast.host_peak_bytes > 0


@pytest.mark.parametrize("n", [3, pytest.param(DEPTH // 2, marks=pytest.mark.long)])
def test_elided_loops_with_checkpointed_layers(n: int, tmp_path: Path, tiny_text_file: Path, traced) -> None:
    """Tiled MLP and chunked loss at 512 tokens: the short traces (three; two where half the layers
    are checkpointed) run the loops' first and last iterations; the whole trace runs every
    iteration of every layer."""
    cfg = _cfg(tmp_path, tiny_text_file, "llama", n, {**LONG, **OFFLOAD}, {}, length=512)
    fast = _same(cfg, traced)
    assert "traced by" in fast.method, fast.method


@pytest.mark.parametrize("n", [1, DEPTH - 1])
def test_fewer_than_two_of_a_kind_are_traced_whole(n: int, tmp_path: Path, tiny_text_file: Path) -> None:
    found = estimate(_cfg(tmp_path, tiny_text_file, "llama", n, {}, {}), device="cuda")
    assert found.method == f"traced all {DEPTH} layers"
    assert f"memory.checkpointing: {n} of {DEPTH} layers leaves fewer than 2" in " ".join(found.notes)


def test_traces_that_do_not_align_fall_back_to_the_whole_depth(tmp_path: Path, tiny_text_file: Path,
                                                               monkeypatch) -> None:
    cfg = _cfg(tmp_path, tiny_text_file, "llama", 3, {}, {})
    monkeypatch.setattr(est, "extrapolate_checkpointed", lambda *args: None)
    found = estimate(cfg, device="cuda")
    assert found.method == f"traced all {DEPTH} layers"
    assert "layers differ in structure, so every layer was traced" in found.notes
    assert found.peak_bytes == estimate(cfg, device="cuda", exact=True).peak_bytes


def test_a_model_no_deeper_than_the_kinds_traces_is_traced_whole(tmp_path: Path, tiny_text_file: Path,
                                                                  traced) -> None:
    """6 layers with 3 checkpointed: the (2, 2) and (3, 3) traces would be 4 and 6 layers deep, so
    one trace of the 6 layers replaces them (the quickstart's MiniLM under the planner's n)."""
    cfg = _cfg(tmp_path, tiny_text_file, "llama", 3, OFFLOAD, {})
    cfg.model.from_config["num_hidden_layers"] = 6
    fast = estimate(cfg, device="cuda")
    assert fast.method == "traced all 6 layers" and len(traced[-1]) == 1
    full = estimate(cfg, device="cuda", exact=True)
    for name in COMPARED:
        assert getattr(fast, name) == getattr(full, name), name


# Layers that repeat in groups: Gemma-2 alternates sliding-window and global attention (groups of 2,
# its first 2 layers of their own); the Gemma-3 layout here is two sliding layers, then a global one
# (groups of 3). Where n and the depth are whole groups, the kinds are traced in groups of layers.
PATTERNED = {
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 30522, "max_position_embeddings": 256,
               "sliding_window": 8},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 30522,
                    "max_position_embeddings": 256, "sliding_window": 8},
}
GROUPED_CASES: dict[str, tuple[str, int, int, dict[str, Any], dict[str, Any]]] = {  # arch, depth, n, ...
    "gemma2-lora-4-of-16": ("gemma2", 16, 4, {}, {}),
    "gemma2-full-8-of-16-offload": ("gemma2", 16, 8, OFFLOAD, FULL),  # half: two traces
    "gemma3-lora-6-of-18-offload": ("gemma3_text", 18, 6, OFFLOAD, {}),
}


def _patterned(tmp_path: Path, data: Path, arch: str, depth: int, n: int, memory: dict[str, Any],
               sections: dict[str, Any]) -> Any:
    recipe = causal_recipe(tmp_path, data, training={"micro_batch_size": 1},
                           memory={**memory, "checkpointing": n}, **copy.deepcopy(sections))
    config = {**PATTERNED[arch], "num_hidden_layers": depth}
    if arch == "gemma3_text":
        config["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"] * (depth // 3)
    recipe["model"]["from_config"] = config
    return load_recipe(recipe)


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_layers_in_groups_extrapolate_by_groups_to_the_whole_trace(case: str, tmp_path: Path,
                                                                   tiny_text_file: Path, traced) -> None:
    arch, depth, n, memory, sections = GROUPED_CASES[case]
    cfg = _patterned(tmp_path, tiny_text_file, arch, depth, n, memory, sections)
    fast = estimate(cfg, device="cuda")
    unit = 2 if arch == "gemma2" else 3
    assert f"(checkpointed+plain, in groups of {unit}" in fast.method, fast.method
    assert max(t.layer.max() for t in traced[-1]) + 1 < depth  # shorter traces than the model
    full = estimate(cfg, device="cuda", exact=True)
    assert full.method == f"traced all {depth} layers"
    for name in COMPARED:
        assert getattr(fast, name) == getattr(full, name), name


def test_n_out_of_step_with_the_groups_is_traced_whole(tmp_path: Path, tiny_text_file: Path) -> None:
    found = estimate(_patterned(tmp_path, tiny_text_file, "gemma2", 16, 5, {}, {}), device="cuda")
    assert found.method == "traced all 16 layers"
    assert "5 is not a multiple of their group of 2" in " ".join(found.notes)


def test_the_planners_n_is_whole_groups_so_its_estimate_extrapolates(tmp_path: Path, tiny_text_file: Path,
                                                                     traced) -> None:
    """18 layers: n = 9 for alike layers (Llama), 8 for Gemma-2's pairs, whose estimate then traces
    groups of each kind (9 of its layers would be out of step: every layer traced)."""
    from memtrain.plan import space

    gemma = _patterned(tmp_path, tiny_text_file, "gemma2", 18, 8, {}, {})
    llama = _cfg(tmp_path, tiny_text_file, "llama", 3, {}, {})
    llama.model.from_config["num_hidden_layers"] = 18
    n_of = lambda cfg: [v for v in space.options(cfg, "memory.checkpointing", space.model_shape(cfg))  # noqa: E731
                        if isinstance(v, int)]
    assert n_of(llama) == [9] and n_of(gemma) == [8]
    assert "in groups of 2" in estimate(gemma, device="cuda").method


@pytest.mark.parametrize(("arch", "depth", "n"), [("gemma2", 17, 4), ("gemma3_text", 20, 6)])
def test_a_depth_that_ends_in_a_group_cut_short_extrapolates_too(arch: str, depth: int, n: int,
                                                                 tmp_path: Path, tiny_text_file: Path,
                                                                 traced) -> None:
    """17 layers in pairs (one left over), 20 in threes (two left over; Gemma-3-27B: 62 in sixes):
    the traces end with the same short group after the plain ones, and it gets its own line."""
    cfg = _patterned(tmp_path, tiny_text_file, arch, depth, n, {}, {})
    # a small vocabulary and longer rows: the layers' activations, not the logits, hold the peak
    cfg.model.from_config.update(vocab_size=512, max_position_embeddings=512)
    cfg.data.max_length = 256
    if arch == "gemma3_text":
        layers = ["sliding_attention", "sliding_attention", "full_attention"] * 7
        cfg.model.from_config["layer_types"] = layers[:depth]
    fast = estimate(cfg, device="cuda")
    assert "in groups of" in fast.method, fast.method
    short = traced[-1]
    assert max(t.layer.max() for t in short) + 1 < depth
    full = estimate(cfg, device="cuda", exact=True)
    for name in COMPARED:
        assert getattr(fast, name) == getattr(full, name), name
    # row by row (the figures are maxima, which the short group rarely holds): the extrapolated ops
    # of groups 0, 1, c - 1 (checkpointed), c, c + 1, the last whole group (plain) and the short one
    unit = 2 if arch == "gemma2" else 3
    c, q = n // unit, depth // unit - n // unit
    found = extrapolate_checkpointed(*(est._grouped(t, unit) for t in short), c, q, tail=True)
    assert found is not None
    whole = est._grouped(traced[-1][0], unit)
    labels = np.array(found.phases)
    starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
    compared = 0
    for occ, got in enumerate(np.split(found.values, starts[1:])):
        if not (whole.layer[whole.occurrence == occ] >= 0).any():
            continue  # outside the layers (the optimizer's): the figures above
        want = _representative(whole, occ, [0, 1, c - 1, c, c + 1, c + q - 1, c + q]).astype(np.float64)
        assert np.array_equal(got, want), (whole.phases[occ], occ)
        compared += 1
    assert compared >= 2  # forward and backward
