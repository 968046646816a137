"""Where a plan's time goes: every trace group the planner runs, its settings and its seconds (issue 37).

Runs :func:`memtrain.plan.planner.plan` in this process on the issue's command (Llama-3.1-8B QLoRA
r32, batch 1, ``data.max_length=auto`` and every long-context technique ``auto``) at one GPU size,
and times each call of :func:`memtrain.estimator.estimate.trace_candidates_at`: one group of traces
(an estimate's depths, or n-of-L's three shapes) of one setting at one length, run side by side
(:mod:`memtrain.estimator.pool`). The page lists the groups by phase (the length search, then the
technique search at the chosen length), the setting each traced, and the totals per kind of
checkpointing: what a faster search has to avoid or make cheaper. Wall seconds of this machine, a
plan's own imports left out.

    python -m scripts run plan_traces
    python -m scripts run plan_traces --budget 24
    python -m scripts run plan_traces --budget 24 --out docs/bench/plan_traces_gemma2.md \
        --overrides model.name=google/gemma-2-9b <the issue's overrides>   # layers in groups
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

from scripts import harness

RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
AUTO = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1", "training.effective_batch_size=1",
        "training.gradient_accumulation=1", "data.max_length=auto", "memory.host_budget=256GiB",
        "memory.checkpointing=auto", "memory.loss=auto", "memory.tiled_mlp=auto",
        "memory.tiled_mlp_tile_tokens=auto", "memory.offload.activations=auto",
        "memory.offload.embeddings=auto", "memory.lean_norm=auto"]  # the command
FIELDS = {"memory.checkpointing": "checkpointing", "memory.offload.activations": "offload",
          "memory.offload.embeddings": "embeddings", "memory.loss": "loss", "memory.tiled_mlp": "tiled MLP",
          "memory.tiled_mlp_tile_tokens": "tile", "memory.lean_norm": "lean norm"}
# CI-sized: the quickstart's plan (a MiniLM, micro-batch and checkpointing auto), seconds
QUICK = ["--recipe", "recipes/quickstart.yaml", "--budget-mib", "200", "--device", "cpu", "--overrides",
         "training.micro_batch_size=auto", "memory.checkpointing=auto"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8, help="device size in GiB (the plan's budget)")
    parser.add_argument("--budget-mib", type=int, help="the budget in MiB instead (small recipes)")
    parser.add_argument("--device", default="cuda", help="where the planned run trains")
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--overrides", nargs="*", default=AUTO)
    parser.add_argument("--out", help="write the page here (default docs/bench/plan_traces.md)")
    parser.add_argument("--alternatives", action="store_true",
                        help="also trace what cannot change the choice (`memtrain plan --alternatives`)")
    args = parser.parse_args()
    started = time.perf_counter()

    from memtrain.config import load_recipe
    from memtrain.estimator import estimate
    from memtrain.plan import planner

    groups: list[dict[str, Any]] = []
    original = estimate.trace_candidates_at

    def timed(plan: Any, points: Any, *rest: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        found = original(plan, points, *rest, **kwargs)
        memory = plan.cfg.memory
        groups.append({"seconds": time.perf_counter() - begin, "points": list(points),
                       "method": found[0][2].split(";")[0] if found else "",
                       "settings": {name: _value(memory, path) for path, name in FIELDS.items()}})
        return found

    estimate.trace_candidates_at = timed
    try:
        imported = time.perf_counter()
        cfg = load_recipe(args.recipe, args.overrides)
        budget = f"{args.budget_mib}MiB" if args.budget_mib else f"{args.budget}GiB"
        # as `memtrain plan` runs it: only the candidates that can change the choice are traced
        result = planner.plan(cfg, budget, device=args.device, alternatives=args.alternatives)
        planned = time.perf_counter() - imported
    finally:
        estimate.trace_candidates_at = original
    length = result.length.chosen if result.length is not None else None

    lines = harness.header(f"Where a plan's time goes: its traces ({args.recipe}, {budget} {args.device})")
    chosen = ", ".join(f"{k}={v}" for k, v in result.chosen.values.items())
    flag = " --alternatives" if args.alternatives else ""
    lines += [f"`planner.plan` of `{args.recipe}` with {', '.join(f'`{o}`' for o in args.overrides)} at a "
              f"{budget} {args.device} device, as `memtrain plan{flag}` "
              f"runs it: **{planned:.1f} s** in this process after its imports "
              f"({imported - started:.1f} s), {len(groups)} trace groups. Chosen: "
              f"{f'{length:,} tokens, ' if length else ''}{chosen or 'the recipe as written'}. "
              "A group is one call of `estimate.trace_candidates_at` (its traces run side by side); "
              "the length search's groups come first, at the lengths it probed.", "",
              "| # | tokens | settings | traced | seconds |", "|---:|---:|---|---|---:|"]
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for i, g in enumerate(groups, 1):
        tokens = ", ".join(f"{seq:,}" for _, seq in g["points"])
        shown = ", ".join(f"{k}={v}" for k, v in g["settings"].items() if v is not None)
        lines.append(f"| {i} | {tokens} | {shown} | {g['method']} | {g['seconds']:.1f} |")
        kind = str(g["settings"]["checkpointing"])
        by_kind["n of L" if kind.isdigit() else kind].append(g["seconds"])
    total = sum(g["seconds"] for g in groups)
    lines += ["", f"Trace groups: {total:.1f} s of the plan's {planned:.1f} s.", "",
              "| checkpointing | groups | seconds | share of the traces |", "|---|---:|---:|---:|"]
    for kind, seconds in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        share = sum(seconds) / max(total, 1e-9)
        lines.append(f"| {kind} | {len(seconds)} | {sum(seconds):.1f} | {share:.0%} |")
    harness.write("plan_traces", lines, args.out)


def _value(memory: Any, path: str) -> Any:
    value: Any = memory
    for part in path.split(".")[1:]:
        value = getattr(value, part, None)
    return value


if __name__ == "__main__":
    main()
