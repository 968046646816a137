"""The time bound of a candidate under activation offload, raised by what a traced one moved.

Before its trace a candidate's bound counts no transfer (the bytes offload moves are not known), so
the candidates that offload rank with the fastest and were traced one by one. Once one is traced,
every candidate not judged yet that moves at least its bytes (:meth:`Search.moves_at_least`) has
those bytes' transfers added to its bound (:meth:`Search._raise_bounds`), and the search takes
the least bound left next.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import causal_recipe

from memtrain.config import load_recipe
from memtrain.plan.search import Search

GiB = 1 << 30


def _cfg(tmp_path: Path, corpus: Path, **memory: object) -> object:
    recipe = causal_recipe(tmp_path, corpus, "llama", data={"max_length": 128},
                           training={"micro_batch_size": 1, "gradient_accumulation": 1,
                                     "effective_batch_size": 1},
                           memory={"offload": {"activations": "auto", "min_tensor_bytes": 1024}, **memory})
    return load_recipe(recipe)


def test_a_candidate_that_keeps_at_least_as_much_on_the_host_moves_at_least_as_much(
        tmp_path: Path, tiny_text_file: Path) -> None:
    """Every offloading candidate of a search traced (on fake CUDA, at its one micro-batch); for every
    pair the search calls "a moves at least what b moved", a's moved bytes are at least b's; and
    some pairs differ, so the order is not vacuous. Planted: ``moves_at_least`` without its host
    dominance (any two offloading candidates) -> a leaner one moves less, fails."""
    cfg = _cfg(tmp_path, tiny_text_file, checkpointing="auto", lean_norm="auto", tiled_mlp="auto",
               tiled_mlp_tile_tokens=32)
    search = Search(cfg, "cuda", 1)  # nothing fits: each is traced at its smallest micro-batch
    offloading = [c for c in search.candidates() if c.values["memory.offload.activations"]]
    assert len(offloading) == 16
    for cand in offloading:
        search.evaluate(cand)
        assert cand.moved > 0
    pairs = [(a, b) for a, b in itertools.permutations(offloading, 2) if search.moves_at_least(a, b)]
    wrong = [(a.label(), a.moved, b.label(), b.moved) for a, b in pairs if a.moved < b.moved]
    assert not wrong, wrong
    assert len(pairs) >= 20 and any(a.moved > b.moved for a, b in pairs), len(pairs)


def test_the_bound_counts_the_transfers_of_the_bytes_given(tmp_path: Path, tiny_text_file: Path) -> None:
    """``lower_bound(cand, moved)`` is the bound plus the cost model's transfer of ``moved`` bytes to
    the host and back (per step here: the micro-batch is fixed). Planted: ``moved`` not passed to
    the cost -> equal bounds."""
    cfg = _cfg(tmp_path, tiny_text_file, checkpointing="full")
    search = Search(cfg, "cuda", GiB)
    cand = next(c for c in search.candidates() if c.values["memory.offload.activations"])
    moved = 10**9
    extra = search.lower_bound(cand, moved) - search.lower_bound(cand)
    assert extra == pytest.approx(2 * moved / search.rates.host_bandwidth)


def test_a_traced_offload_defers_and_prunes_the_candidates_that_move_more(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search's order with evaluations made up (a tiny model's transfers are too small to
    matter): without checkpointing and offload the step does not fit, with offload it does but
    moves a GB per step, and with checkpointing it fits without. Tracing the leanest offloading
    candidate raises the bound of the one without the tiled MLP above a checkpointed step's time, so
    it is pruned untraced ("slower"), where without the raise it is traced; the choice is the same.
    Planted: ``_raise_bounds`` a no-op -> traced."""
    cfg = _cfg(tmp_path, tiny_text_file, checkpointing="auto", tiled_mlp="auto", tiled_mlp_tile_tokens=32)
    usable = GiB
    traced: list[dict] = []

    def made_up(self: Search, cand: object) -> None:
        values = cand.values  # type: ignore[attr-defined]
        traced.append(dict(values))
        cand.micro, cand.accumulation = self.batches[0]  # type: ignore[attr-defined]
        offload, plain = values["memory.offload.activations"], values["memory.checkpointing"] == "none"
        cand.moved = (10**9 if plain else 10**6) if offload else 0  # type: ignore[attr-defined]
        if plain and not offload:  # too big
            cand.min_peak = cand.host = 2 * usable  # type: ignore[attr-defined]
        else:
            cand.min_peak = cand.peak = usable // 2  # type: ignore[attr-defined]
            cand.seconds = self.lower_bound(cand, cand.moved)  # type: ignore[attr-defined,arg-type]
        self.done.append(cand)  # type: ignore[arg-type]

    monkeypatch.setattr(Search, "evaluate", made_up)

    def search() -> tuple[object, list[dict], Search]:
        traced.clear()
        found = Search(cfg, "cuda", usable, alternatives=False)
        return found.run(), list(traced), found

    chosen, judged, found = search()
    untiled = {"memory.checkpointing": "none", "memory.offload.activations": True, "memory.tiled_mlp": False}
    assert {**untiled, "memory.tiled_mlp": True} in judged
    assert untiled not in judged, judged
    pruned = next(c for c in found.pruned if c.values == untiled)
    assert pruned.reason.startswith("slower: at least"), pruned.reason
    monkeypatch.setattr(Search, "_raise_bounds", lambda self, *args: None)
    unraised, judged_unraised, _ = search()
    assert untiled in judged_unraised
    assert unraised.values == chosen.values  # type: ignore[attr-defined]
    assert not chosen.values["memory.offload.activations"]  # type: ignore[attr-defined]
