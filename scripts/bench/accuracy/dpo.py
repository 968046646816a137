"""The offline DPO recipe: does the reward margin rise, and does the estimate hold the real step?

    python -m scripts run dpo                       # writes docs/bench/dpo.md
    python -m scripts run dpo training.max_steps=8  # recipe overrides: a shorter run

Trains ``recipes/tiny-llama-dpo.yaml`` through :func:`memtrain.run.train.train` (TRL's DPOTrainer
behind memtrain's) with ``scripts/probes/memprobe.py``'s Trainer-step counter attached (live tensor bytes,
no memtrain code), and estimates the recipe for the data at hand (its longest batch). Reported: the
first and last logged ``rewards/margins`` and ``rewards/accuracies``, the evaluation's, the
estimate beside the largest counted step (the estimate is for the longest batch the data makes;
a step of shorter rows holds less), wall time. Writes docs/bench/dpo.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from rich.console import Console

from scripts import harness

ROOT = harness.ROOT

from memtrain.config import load_recipe  # noqa: E402
from memtrain.data.prepare import prepare_data  # noqa: E402
from memtrain.estimator.estimate import estimate  # noqa: E402
from memtrain.model import load_tokenizer  # noqa: E402
from memtrain.run.train import train  # noqa: E402
from scripts.probes.memprobe import trainer_steps  # noqa: E402

RECIPE = ROOT / "recipes" / "tiny-llama-dpo.yaml"
MIB = 2**20
# 6 optimizer steps of the same recipe (64 pairs, 4 of them held out): logged at steps 1 and 5
QUICK = ["data.max_examples=64", "training.max_steps=6"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="overrides of the recipe (none: the recipe as shipped)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_recipe(RECIPE, [*args.overrides, f"output.dir={tmp}/run", "output.report=false"])
        rows = prepare_data(cfg, load_tokenizer(cfg.model)).rows(cfg)
        predicted = estimate(cfg, rows=rows, device="cpu")
        counter = trainer_steps()
        start, cpu_start = time.perf_counter(), time.process_time()
        result = train(cfg, console=Console(quiet=True), callbacks=[counter])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    logged = [h for h in result.log_history if "rewards/margins" in h]
    first, last = logged[0], logged[-1]
    counted = max(s["peak"] for s in counter.steps if s["step"] >= 2)
    pairs, steps, metrics = int(cfg.training.micro_batch_size), result.log_history[-1]["step"], result.metrics
    span = f"step {first['step']} → step {last['step']}"
    lines = [
        "| quantity | value |", "| --- | --- |",
        f"| optimizer steps | {steps} ({pairs} pairs each) |",
        f"| rewards/margins, {span} | {first['rewards/margins']:.4f} → {last['rewards/margins']:.4f} |",
        f"| rewards/accuracies, {span} | {first['rewards/accuracies']:.3f} → "
        f"{last['rewards/accuracies']:.3f} |",
        f"| eval rewards/margins, accuracies (held-out pairs) | {metrics['eval_rewards/margins']:.4f}, "
        f"{metrics['eval_rewards/accuracies']:.3f} |",
        f"| train_loss (ln 2 = 0.6931 at the start) | {metrics['train_loss']:.4f} |",
        f"| estimate, longest batch ({rows.longest} tokens x {2 * pairs} rows) | "
        f"{predicted.peak_bytes:,} B ({predicted.peak_bytes / MIB:.1f} MiB) |",
        f"| largest counted step (memprobe) | {counted:,} B ({counted / MIB:.1f} MiB) |",
        f"| counted - estimate | {counted - predicted.peak_bytes:+,} B (completion_mask, {2 * pairs} x "
        f"{rows.longest} int64, is no forward argument) |",
        f"| time of `train`: CPU, wall (one thread, shared machine) | {cpu:.0f} s, {seconds:.0f} s |",
    ]
    print("\n".join(lines))
    trend = ["| step | rewards/margins | rewards/accuracies | loss |", "| --- | --- | --- | --- |"]
    trend += [f"| {h['step']} | {h['rewards/margins']:.4f} | {h['rewards/accuracies']:.3f} | "
              f"{h.get('loss', float('nan')):.4f} |" for h in logged]
    page = [
        *harness.header("DPO: the offline recipe"), "One CPU thread (`torch.set_num_threads(1)`).", "",
        "`recipes/tiny-llama-dpo.yaml`: a tiny Llama from config (random weights) with LoRA r 16; "
        "pairs from `builtin:shakespeare-preference` (a line as the prompt, the next line chosen, the "
        "same words shuffled rejected). Memory is live tensor bytes on the CPU, counted by "
        "`scripts/probes/memprobe.py` in the real Trainer steps; the estimate is for the longest batch the "
        "data makes (steps of shorter rows hold less; tests/end_to_end/test_dpo.py holds a batch of "
        "one shape to the byte).", "", *lines, "", "Logged every "
        f"{cfg.training.logging_steps} steps (each entry the mean over those steps):", "", *trend, ""]
    harness.write("dpo", page)


if __name__ == "__main__":
    main()
