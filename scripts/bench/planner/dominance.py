"""Audit the planner's memory orders: estimate every candidate, list the pairs dominance gets wrong.

The planner's search prunes a candidate that keeps at least as much as one that does not fit, field
by field along each field's memory order (:meth:`memtrain.plan.search.Search.dominated`). That is
sound only if the orders hold. This script builds the search of a recipe (every technique ``auto``
by default: the long-context plan's fields), estimates every applicable candidate at micro-batch 1
with a budget of 1 byte (so each one's smallest peak is computed, none fits), and prints every pair
(a, b) the search would call "a keeps at least as much as b" where a's estimate is smaller.

    python -m scripts run dominance --length 14336
    python -m scripts run dominance --recipe recipes/quickstart.yaml --length 128 \\
        --set memory.checkpointing=auto --set memory.offload.activations=auto

The long-context plan at 14,336 tokens (256 candidates, ~13 min on a 2-core CPU): 58 pairs before
checkpointing's order was made partial (selective over none) and the lean norm unordered under
activation offload, 0 after (docs/planner.md).

``--moved`` audits the order the search raises bounds by (:meth:`Search.moves_at_least`: a
candidate that keeps at least as much on the host as a traced one that offloads, with the same
other offloads, moves at least the bytes it moved; its transfers then count in its bound). On
2026-12-05: 0 wrong of 368 pairs (the 8B plan's fields at 4,096 tokens, ``--set
memory.tiled_mlp_tile_tokens=1024``: 128 candidates, 91 s) and 0 of 184 (Gemma-2-9B with
FlashAttention at 8,192 tokens, 896-token tiles: 64 candidates, 240 s).

``--time`` audits the time order the search prunes by (``Knob.slower_when_leaner``: a candidate
leaner than a fitting one only in fields that add work, with more techniques, is not traced).
"""

from __future__ import annotations

import argparse
import json
import time

from memtrain.config import load_recipe
from memtrain.plan.search import Search

# CI-sized: the quickstart's 4 candidates at 128 tokens.
QUICK = ["--recipe", "recipes/quickstart.yaml", "--length", "128", "--device", "cpu",
         "--set", "memory.checkpointing=auto", "--set", "memory.offload.activations=auto"]

LONG_CONTEXT = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1",
                "training.effective_batch_size=1", "training.gradient_accumulation=1",
                "memory.host_budget=256GiB", "memory.checkpointing=auto", "memory.loss=auto",
                "memory.tiled_mlp=auto", "memory.tiled_mlp_tile_tokens=auto",
                "memory.offload.activations=auto", "memory.offload.embeddings=auto", "memory.lean_norm=auto"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/llama-3.1-8b-qlora.yaml")
    parser.add_argument("--length", type=int, default=14336)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--set", action="append", default=None,
                        help="recipe overrides (default: the long-context plan's fields, all auto)")
    parser.add_argument("--save", help="write every candidate's values and smallest peak to this JSON file")
    parser.add_argument("--time", action="store_true",
                        help="audit the time order instead: an unbounded budget (every candidate fits at "
                        "its largest micro-batch), and every pair the search calls \"a no faster than b\" "
                        "(Search.no_faster) where a's predicted step is faster")
    parser.add_argument("--host", action="store_true",
                        help="audit the host order instead: every pair the search calls \"a keeps at least "
                        "as much on the host as b\" (Search.dominated with host=True) where a's host peak "
                        "is smaller")
    parser.add_argument("--moved", action="store_true",
                        help="audit the offload order instead: every pair the search calls \"a moves at "
                        "least what b moved\" (Search.moves_at_least) where a moves fewer bytes")
    args = parser.parse_args()
    overrides = [*(args.set if args.set is not None else LONG_CONTEXT), f"data.max_length={args.length}"]
    search = Search(load_recipe(args.recipe, overrides), args.device, 2**62 if args.time else 1)
    cands = [c for c in search.candidates() if search.inapplicable(c) is None]
    started = time.perf_counter()
    for cand in cands:
        search.evaluate(cand)
    print(f"{len(cands)} candidates estimated in {time.perf_counter() - started:.0f} s")
    if args.save:
        with open(args.save, "w", encoding="utf-8") as out:
            json.dump([[c.values, c.min_peak] for c in cands], out, default=str)
    if args.time:
        timed = [c for c in cands if c.seconds < float("inf")]
        slower = sorted(((b.seconds - a.seconds, a, b) for a in timed for b in timed
                         if a is not b and search.no_faster(a, b) and a.seconds < b.seconds and
                         (a.micro, a.accumulation) == (b.micro, b.accumulation)), key=lambda x: -x[0])
        pairs = sum(1 for a in timed for b in timed if a is not b and search.no_faster(a, b))
        print(f"{len(slower)} of {pairs} pairs where the search claims a no faster than b, and a is faster")
        for gap, a, b in slower:
            print(f"  {gap:.4g} s faster: {a.label()}  vs  {b.label()}")
        return
    if args.moved:
        claims = [(a, b) for a in cands for b in cands if a is not b and search.moves_at_least(a, b)]
        fewer = sorted(((b.moved - a.moved, a, b) for a, b in claims if a.moved < b.moved),
                       key=lambda x: -x[0])
        print(f"{len(fewer)} of {len(claims)} pairs where the search claims a moves at least what b moved, "
              "and a moves less")
        for gap, a, b in fewer:
            print(f"  {gap / 2**20:10.1f} MiB less moved: {a.label()}  vs  {b.label()}")
        return
    kept = (lambda c: c.host) if args.host else (lambda c: c.min_peak)
    claims = [(a, b) for a in cands for b in cands if a is not b and search.dominated(a, b, host=args.host)]
    wrong = sorted(((kept(b) - kept(a), a, b) for a, b in claims if kept(a) < kept(b)), key=lambda x: -x[0])
    where = " on the host" if args.host else ""
    print(f"{len(wrong)} of {len(claims)} pairs where dominance claims a keeps at least as much{where} as b, "
          "and a keeps less")
    for gap, a, b in wrong:
        print(f"  {gap / 2**20:10.1f} MiB less{where}: {a.label()}  vs  {b.label()}")


if __name__ == "__main__":
    main()
