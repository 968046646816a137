"""Floors (``Knob.floor``): device bytes a setting keeps at least, known without a trace.

The planner rejects a candidate whose floor exceeds the budget without tracing it
(:meth:`memtrain.plan.search.Search.floor`), so a floor must never exceed the traced peak: checked
here for every registered floor on unlike families and dtypes, with the techniques around it on and
off. The only floor so far is the standard loss's (two float32 copies of every position's logits:
:func:`memtrain.patches.chunked_loss.standard_loss_floor`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import TINY_CONFIGS, causal_recipe

from memtrain import patches
from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
from memtrain.plan import planner, space
from memtrain.plan.search import Search

GEMMA = {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 30522,
         "max_position_embeddings": 256}


def _cfg(tmp_path: Path, corpus: Path, arch: str, **sections: object) -> object:
    recipe = causal_recipe(tmp_path, corpus, "llama", **sections)
    recipe["model"]["from_config"] = copy.deepcopy(GEMMA if arch == "gemma" else TINY_CONFIGS[arch])
    return load_recipe(recipe)


def _plan_tracing(cfg: object, budget: int, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[dict]]:
    """The plan of ``cfg`` at ``budget`` on the CPU, and the values of every candidate its search
    traces (this plan's, and those of later plans in the test)."""
    traced: list[dict] = []
    evaluate = Search.evaluate

    def counted(self: Search, cand: object) -> None:
        traced.append(dict(cand.values))  # type: ignore[attr-defined]
        evaluate(self, cand)  # type: ignore[arg-type]

    monkeypatch.setattr(Search, "evaluate", counted)
    return planner.plan(cfg, budget, device="cpu"), traced


def _floored_standard(decided: object, traced: list[dict]) -> list:
    """The standard-loss candidates ``decided`` rejected, after checking that it chose the chunked
    loss and traced none of them."""
    assert decided.chosen.values["memory.loss"] == "chunked"  # type: ignore[attr-defined]
    assert not any(v["memory.loss"] == "standard" for v in traced), traced
    floored = [c for c in decided.rejected if c.values["memory.loss"] == "standard"]  # type: ignore[attr-defined]
    assert floored
    return floored


def test_every_floor_is_registered_where_the_planner_reads_it() -> None:
    floors = [k.path for k in patches.knobs() if k.floor is not None]
    assert floors == ["memory.loss"]


@pytest.mark.parametrize(("arch", "dtype", "memory"), [
    ("llama", "bf16", {"checkpointing": "none"}),
    ("llama", "fp32", {"checkpointing": "full", "offload": {"activations": True, "min_tensor_bytes": 1024}}),
    ("qwen2", "bf16", {"checkpointing": "full", "lean_norm": True, "tiled_mlp": True}),
    ("gemma", "bf16", {"checkpointing": "none", "offload": {"activations": True, "min_tensor_bytes": 1024}}),
    ("gpt2", "fp32", {"checkpointing": "full"}),
])
def test_the_standard_loss_floor_is_at_most_the_traced_peak(tmp_path: Path, tiny_text_file: Path, arch: str,
                                                            dtype: str, memory: dict) -> None:
    """At most the traced tensor peak (on fake CUDA, as a GPU plan traces it), and not vacuous: the
    logits dominate these models (hidden 64, vocabulary 30,522), and the floor is more than half the
    peak. Planted: 16 bytes per logit (a third copy counted) -> above the peak in every case."""
    cfg = _cfg(tmp_path, tiny_text_file, arch, data={"max_length": 256},
               model={"dtype": dtype},
               training={"micro_batch_size": 2, "gradient_accumulation": 1},
               memory={"loss": "standard", **memory})
    traced = estimate(cfg, device="cuda")
    floor, path = space.floor(cfg, space.model_shape(cfg), 2)
    assert path == "memory.loss"
    assert 0.5 * traced.peak_bytes < floor <= traced.peak_bytes, (floor, traced.peak_bytes)
    chunked = planner.with_values(cfg, {"memory.loss": "chunked"})
    assert space.floor(chunked, space.model_shape(chunked), 2)[0] == 0


@pytest.mark.long  # a pruning that must keep the choice, like test_planner.py's host-budget pruning
def test_the_planner_rejects_what_its_floor_rules_out_untraced_and_chooses_the_same(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget the standard loss cannot fit: the standard-loss candidates are rejected with their
    floor, none traced, and the plan is the one found by tracing them. Where nothing fits at all,
    the smallest peak reported is a traced one, never a floor. Planted: the floor check skipped in
    the search -> standard-loss candidates traced; the rejection not naming the field -> fails."""
    cfg = _cfg(tmp_path, tiny_text_file, "llama", data={"max_length": 256},
               training={"micro_batch_size": 1, "gradient_accumulation": 1, "effective_batch_size": 1},
               memory={"loss": "auto", "loss_chunk_tokens": 32, "checkpointing": "auto"})
    standard = planner.with_values(cfg, {"memory.loss": "standard", "memory.checkpointing": "full"})
    budget = int(space.floor(standard, space.model_shape(standard), 1)[0] * 0.95 / 0.9)
    decided, traced = _plan_tracing(cfg, budget, monkeypatch)
    assert all("`memory.loss: standard`" in c.reason and "keeps at least" in c.reason
               for c in _floored_standard(decided, traced))
    floor = space.floor
    monkeypatch.setattr(space, "floor", lambda *args: (0, ""))  # no floors: every candidate traced
    assert planner.plan(cfg, budget, device="cpu").chosen.values == decided.chosen.values

    fixed = planner.with_values(cfg, {"memory.loss": "standard"})  # the recipe's own loss is floored
    traced.clear()
    with pytest.raises(planner.NothingFits) as err:  # still without floors: every trace it needs
        planner.plan(fixed, budget, device="cpu")
    unfloored, without = err.value.smallest, len(traced)
    monkeypatch.setattr(space, "floor", floor)
    traced.clear()
    with pytest.raises(planner.NothingFits) as err:
        planner.plan(fixed, budget, device="cpu")
    smallest = err.value.smallest
    assert smallest is not None and "not traced" not in smallest.reason
    assert (smallest.values, smallest.min_peak) == (unfloored.values, unfloored.min_peak)
    # the floored candidates traced to find it are pruned as a search prunes (keeping at least as
    # much as a traced one that does not fit): no more traces than without floors (planted: every
    # floored candidate traced -> more; in the plugin's searches, 6x the suite time)
    assert len(traced) <= without, (len(traced), without)


@pytest.mark.parametrize(("arch", "dtype", "values"), [
    ("llama", "bf16", {"memory.checkpointing": "full", "memory.offload.activations": True,
                       "memory.lean_norm": True, "memory.tiled_mlp": True}),
    ("gemma", "bf16", {"memory.checkpointing": "selective", "memory.offload.activations": False,
                       "memory.lean_norm": False, "memory.tiled_mlp": True}),
    ("gpt2", "fp32", {"memory.checkpointing": "none", "memory.offload.activations": True,
                      "memory.lean_norm": False, "memory.tiled_mlp": False}),
])
def test_a_floor_with_what_the_step_holds_is_at_most_the_traced_peak(
        tmp_path: Path, tiny_text_file: Path, arch: str, dtype: str, values: dict) -> None:
    """The search adds to a knob's floor what the candidate's step holds from start to end (weights,
    buffers, optimizer state: ``Search.held``), read from the plain trace its time bound made,
    where the candidate differs from that trace only in fields that act on activations alone
    (``Knob.holds_same``): the sum is at most the candidate's traced peak and more than the knob's
    floor alone; a candidate that offloads its embeddings (weights off the device) gets none.
    Planted: activations counted as held -> above the peak; the embedding offload marked
    ``holds_same`` -> its candidate gets the plain trace's bytes."""
    cfg = _cfg(tmp_path, tiny_text_file, arch, data={"max_length": 256}, model={"dtype": dtype},
               training={"micro_batch_size": 2, "gradient_accumulation": 1},
               memory={"loss": "auto", "checkpointing": "auto", "lean_norm": "auto", "tiled_mlp": "auto",
                       "offload": {"activations": "auto", "embeddings": "auto", "min_tensor_bytes": 1024}})
    search = Search(cfg, "cuda", 1 << 40)
    wanted = {**values, "memory.loss": "standard"}
    cands = [c for c in search.candidates() if all(c.values[k] == v for k, v in wanted.items())]
    kept = next(c for c in cands if not c.values["memory.offload.embeddings"])
    moved = next(c for c in cands if c.values["memory.offload.embeddings"])
    search.lower_bound(kept)  # traces its plain settings, as a search does first
    chosen = planner.with_values(cfg, kept.values)
    knob, _ = space.floor(chosen, search.shape, 2)
    held = search.held(kept)
    assert held is not None and held > 0
    assert search.held(moved) == 0
    peak = estimate(chosen, device="cuda").peak_bytes
    assert knob < search.floor(kept) == knob + held <= peak, (knob, held, peak)


def test_what_the_step_holds_rejects_the_standard_loss_where_its_floor_alone_would_not(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget above the standard loss's floor but below it plus the weights and optimizer state
    every step holds: the standard-loss candidates are rejected untraced, their reason naming both,
    and the plan is the one found without the held bytes, which traces them. Planted: the held
    bytes left out of the floor (``Search.held`` 0) -> standard-loss candidates traced."""
    cfg = _cfg(tmp_path, tiny_text_file, "llama", data={"max_length": 256},
               training={"micro_batch_size": 1, "gradient_accumulation": 1, "effective_batch_size": 1},
               memory={"loss": "auto", "loss_chunk_tokens": 32, "checkpointing": "auto"})
    probe = Search(cfg, "cpu", 1 << 40)
    standard = next(c for c in probe.candidates() if c.values["memory.loss"] == "standard")
    probe.lower_bound(standard)
    knob = space.floor(planner.with_values(cfg, standard.values), probe.shape, 1)[0]
    held = probe.held(standard)
    assert held
    budget = int((knob + held // 2) / 0.9)  # the planner's usable share of a CPU budget: 90%
    decided, traced = _plan_tracing(cfg, budget, monkeypatch)
    assert all("of weights and optimizer state every step holds" in c.reason
               for c in _floored_standard(decided, traced))
    traced.clear()
    monkeypatch.setattr(Search, "held", lambda self, cand: 0)
    assert planner.plan(cfg, budget, device="cpu").chosen.values == decided.chosen.values
    assert any(v["memory.loss"] == "standard" for v in traced)  # the loss's floor alone does not reject


def test_what_a_step_holds_with_its_embeddings_on_the_host_leaves_them_out(
        tmp_path: Path, tiny_text_file: Path) -> None:
    """Where the recipe itself offloads the embeddings and a step is one row (its plain trace is
    derived from the one without the offload, row 1 alone), the held bytes are read from the
    derived trace: fewer than with the embeddings on the device, and the floor still at most the
    traced peak. Planted: the derived trace's row read as if traced (``points[1]``) -> KeyError;
    its host-only lookup row (no device bytes) counted -> held 0, fails."""
    held = {}
    for offload in (False, True):
        cfg = _cfg(tmp_path, tiny_text_file, "llama", data={"max_length": 256},
                   training={"micro_batch_size": 1, "gradient_accumulation": 1, "effective_batch_size": 1},
                   memory={"loss": "auto", "checkpointing": "auto", "offload": {"embeddings": offload}})
        search = Search(cfg, "cuda", 1 << 40)
        cand = next(c for c in search.candidates()
                    if c.values == {"memory.checkpointing": "full", "memory.loss": "standard"})
        search.lower_bound(cand)
        held[offload] = search.held(cand)
        peak = estimate(planner.with_values(cfg, cand.values), device="cuda").peak_bytes
        assert held[offload] and search.floor(cand) <= peak, (offload, search.floor(cand), peak)
    assert held[True] < held[False], held
