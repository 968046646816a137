"""Where a plan's time goes: every candidate the technique search traced, in the order it did.

    python -m scripts.tools.plan_log --budget 8GiB                       # issue 37's 8B command
    python -m scripts.tools.plan_log recipes/quickstart.yaml training.micro_batch_size=auto \\
        memory.checkpointing=auto --budget 200MiB --device cpu

Runs :func:`memtrain.plan.planner.plan` in this process and prints, for each traced candidate:
the wall seconds its evaluation took (its traces, or none where the cache had them), its lower
bound and its predicted time (what the search ranks by), its smallest peak, and its settings;
then the total. A candidate traced long before the fastest that fits, with a bound far below its
predicted time, is where a tighter bound would save traces (issue 37's note of 2026-12-02: at 8
GiB the bound leaves out activation offload's transfer time, 2.4 of the chosen's 9.9 s). A
diagnostic: it wraps two methods of ``memtrain.plan.search.Search`` for the run's duration.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from memtrain.config import load_recipe
from memtrain.plan import planner
from memtrain.plan.search import Search
from scripts.bench.planner.plan_speed import AUTO as ISSUE_37  # the issue's command, as the benchmark runs it
from scripts.bench.planner.plan_speed import RECIPE


@contextlib.contextmanager
def logged(bounds: dict[str, float], order: list[tuple[Any, float]]) -> Iterator[None]:
    """Record each candidate's lower bound and each evaluation's wall time while the block runs."""
    bound, evaluate = Search.lower_bound, Search.evaluate

    def lower_bound(self: Search, cand: Any) -> float:
        bounds[_key(cand)] = value = bound(self, cand)
        return value

    def timed(self: Search, cand: Any) -> None:
        start = time.perf_counter()
        try:
            evaluate(self, cand)
        finally:
            order.append((cand, time.perf_counter() - start))

    Search.lower_bound, Search.evaluate = lower_bound, timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        Search.lower_bound, Search.evaluate = bound, evaluate  # type: ignore[method-assign]


def _key(cand: Any) -> str:
    return repr(sorted(cand.values.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=RECIPE)
    parser.add_argument("overrides", nargs="*", help=f"default (with the 8B recipe): {' '.join(ISSUE_37)}")
    parser.add_argument("--budget", default="8GiB")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--alternatives", action="store_true",
                        help="also trace what cannot change the choice (as `memtrain plan --alternatives`)")
    args = parser.parse_args()
    overrides = args.overrides or (ISSUE_37 if args.recipe == RECIPE else [])
    cfg = load_recipe(args.recipe, overrides)
    bounds: dict[str, float] = {}
    order: list[tuple[Any, float]] = []
    start = time.perf_counter()
    with logged(bounds, order):
        chosen = planner.plan(cfg, args.budget, device=args.device, alternatives=args.alternatives)
    total = time.perf_counter() - start
    print(f"{'wall s':>7} {'bound':>9} {'predicted':>9} {'min peak':>10}  settings")
    for cand, wall in order:
        seconds = "no fit" if cand.seconds == math.inf else f"{cand.seconds:.4g}"
        peak = f"{cand.min_peak / 2**30:.2f} GiB" if cand.min_peak else "-"
        print(f"{wall:7.1f} {bounds.get(_key(cand), math.nan):9.4g} {seconds:>9} {peak:>10}  {cand.label()}")
    print(f"planned in {total:.1f} s, {sum(w for _, w in order):.1f} s of it evaluating {len(order)} "
          f"candidates; chosen: {chosen.chosen.label()} ({chosen.chosen.seconds:.4g} s per step)")
    if chosen.length is not None:
        print(chosen.length.explain())


if __name__ == "__main__":
    main()
