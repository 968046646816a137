"""The default recipe as a user runs it: predicted vs measured peak, time, accuracy.

Three runs of ``recipes/quickstart.yaml``, each a real ``memtrain train``:

1. ``memtrain train recipes/quickstart.yaml`` as a user types it (a subprocess, nothing attached):
   wall seconds of the whole command, the Trainer's training seconds, eval accuracy against the
   majority baseline, the process's peak RSS (``/usr/bin/time``-style, from ``ru_maxrss``);
2. the same recipe in this process with ``scripts/probes/memprobe.py``'s ``trainer_steps`` attached: the
   live tensor bytes of *every* optimizer step, counted with no memtrain code. The predicted peak
   is the one the run's report shows (``memory_report.json``: the estimate for the longest batch
   of the data, read before the model loads); the measured peak is memprobe's highest step. The
   run's own report says which step its meter compared (it meters the step holding the longest
   batch); that sentence is quoted.
3. the same with ``data.max_length=7``: every line of the data is at least 7 tokens, so every row
   is cut to exactly 7 and no batch is padded (full rows, unmasked attention).

The probe's dispatch mode slows the counted runs; their times are not the user's and are not shown.
Writes docs/bench/quickstart.md and the report plot of run 1 to docs/quickstart_report.png.

    python -m scripts run quickstart
    python -m scripts run quickstart --max-steps 10   # shorter, no file written
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from memtrain.config import load_recipe
from memtrain.run.train import train
from scripts import harness
from scripts.probes.memprobe import trainer_steps

ROOT = harness.ROOT
RECIPE = "recipes/quickstart.yaml"
PLOT = ROOT / "docs" / "quickstart_report.png"
MiB = 2**20
CASES = (("the default recipe", []), ("every row full (`data.max_length=7`)", ["data.max_length=7"]))


def cli_run(out: Path, extra: list[str]) -> dict[str, Any]:
    """``memtrain train`` as a user runs it: wall time, its metrics, peak RSS of the process."""
    command = [sys.executable, "-m", "memtrain", "train", RECIPE, f"output.dir={out}", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, the largest child so far
    metrics = json.loads((out / "metrics.json").read_text())
    return {"wall": wall, "metrics": metrics, "rss": rss * 1024 if rss > before else None}


def counted_run(out: Path, extra: list[str]) -> dict[str, Any]:
    """The recipe trained here with memprobe counting every optimizer step."""
    cfg = load_recipe(RECIPE, [f"output.dir={out}", *extra])
    counter = trainer_steps()
    train(cfg, console=Console(quiet=True), callbacks=[counter])
    report = json.loads((out / "memory_report.json").read_text())
    steps = counter.steps
    worst = max(steps, key=lambda s: s["peak"])
    from memtrain.memory.report import Report, comparison

    return {"predicted": report["predicted"]["peak_bytes"], "batch": report["predicted"]["batch"],
            "rows": report["predicted"]["rows"], "counted": worst["peak"], "step": worst["step"],
            "steps": len(steps), "sentence": comparison(Report(**report))}


QUICK = ["--max-steps", "3"]  # CI-sized: three steps of each run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop each run after this many steps (a smoke run; its page goes to a "
                             "temporary folder, the plot is not kept)")
    args = parser.parse_args()
    extra = [f"training.max_steps={args.max_steps}"] if args.max_steps else []
    with tempfile.TemporaryDirectory(prefix="bench-quickstart-") as tmp:
        print("1/3 memtrain train recipes/quickstart.yaml ...", flush=True)
        user = cli_run(Path(tmp) / "cli", extra)
        if not args.max_steps:
            shutil.copyfile(Path(tmp) / "cli" / "memory_report.png", PLOT)
        counted = []
        for i, (name, overrides) in enumerate(CASES, start=2):
            print(f"{i}/3 {name}, every step counted by memprobe ...", flush=True)
            counted.append((name, overrides, counted_run(Path(tmp) / f"counted{i}", overrides + extra)))
    text = report(args, user, counted)
    print(text)
    harness.write("quickstart", text.splitlines(), trial=bool(args.max_steps))


def report(args: argparse.Namespace, user: dict[str, Any], counted: list[tuple[str, list[str], dict]]) -> str:
    m = user["metrics"]
    rss = f"{user['rss'] / 2**30:.2f} GiB" if user["rss"] else "not measured"
    rows = ["| recipe | predicted peak | measured peak (memprobe, every step) | predicted − measured | "
            "predicted / measured | the step measured highest | steps counted | what the prediction is for |",
            "|---|---|---|---|---|---|---|---|"]
    for name, _, r in counted:
        rows.append(f"| {name} | {r['predicted'] / MiB:.2f} MiB | {r['counted'] / MiB:.2f} MiB | "
                    f"{r['predicted'] - r['counted']:+,} bytes | {r['predicted'] / r['counted']:.6f} | "
                    f"{r['step']} | {r['steps']} | {r['rows']} |")
    sentences = [f"- {name}: \"{r['sentence']}\"" for name, _, r in counted]
    steps = f" (`training.max_steps={args.max_steps}`)" if args.max_steps else ""
    return "\n".join([
        *harness.header("The default recipe"),
        f"Generated by `scripts/bench/recipes/quickstart.py`; do not edit by hand.{steps} Torch threads: "
        f"{torch.get_num_threads()}, CPU only, shared with other jobs (times vary with their load); the "
        f"report plot of run 1 is docs/{PLOT.name}.", "",
        "## As a user runs it", "",
        f"`memtrain train {RECIPE}` (LoRA r 8 on all linear layers of the pretrained MiniLM, "
        "3,960 training lines, batch 32, one epoch):", "",
        "| eval accuracy | majority baseline | training (s) | whole command (s) | peak RSS |",
        "|---|---|---|---|---|",
        f"| {m.get('eval_accuracy', float('nan')):.4f} | {m.get('eval_majority_baseline', float('nan')):.4f} "
        f"| {m['train_runtime']:.1f} | {user['wall']:.1f} | {rss} |", "",
        "The whole command includes imports, tokenizing, loading the model, the memory prediction, "
        "training, evaluation and saving.", "",
        "## Predicted vs measured peak", "",
        "Live tensor bytes on the CPU. *Predicted* is what the run's memory report shows: the "
        "estimate for the longest batch of the data at hand, read before the model loads. "
        "*Measured* is the highest optimizer step of the same run, every step counted by "
        "`scripts/probes/memprobe.py` (no memtrain code). Target: predicted ≥ measured and ≤ 1.10 × "
        "measured.", "",
        *rows, "",
        "The estimated step holds what the Trainer's step holds, the two fp32 scalars included "
        "(`num_items_in_batch` and accelerate's divided loss; tests/end_to_end/"
        "test_independent_count.py), so an exact prediction differs by 0 bytes.", "",
        "What each run's own report said it compared (its meter measures the step that holds the "
        "longest batch):", "",
        *sentences, "",
    ])


if __name__ == "__main__":
    main()
