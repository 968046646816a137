"""How long the CLI takes, whole commands in fresh processes: start-up and the 70B estimate.

Each command runs ``--repeats`` times in a new process (imports included, as a user runs it), in
rounds (every command once per round, so a machine that slows down or speeds up meanwhile weighs
on all rows alike); the table has the best and the median wall time. Beside them, the libraries
an estimate of a QLoRA recipe loads (torch, transformers' model classes and Trainer, peft,
bitsandbytes): a bare ``python -c`` importing them and leaving as ``memtrain`` does, without the
interpreter's teardown (``os._exit``); the same with the teardown; the same imports with the
set-up that the ``memtrain`` command defers (:mod:`memtrain.lazy_setup`); and those inside
``lazy_setup.importing`` (no garbage-collector passes while importing), the floor under its
commands. The 70B estimate also runs with its two traces one after the other
(``MEMTRAIN_TRACE_PROCESSES=1``). Writes docs/bench/startup.md.

    python -m scripts run startup            # the table in docs/
    python -m scripts run startup --repeats 1 --quick
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from scripts import harness

ROOT = harness.ROOT
CLI = [sys.executable, "-m", "memtrain"]
LIBRARIES = "import torch, transformers.modeling_utils, transformers.trainer, peft, bitsandbytes"
ESTIMATE_70B = [*CLI, "estimate", "recipes/llama-3.1-8b-qlora.yaml",
                "model.name=meta-llama/Llama-3.1-70B", "--device", "cuda"]
# (name, command, extra environment)
COMMANDS: list[tuple[str, list[str], dict[str, str]]] = [
    ("memtrain --help", [*CLI, "--help"], {}),
    ("memtrain validate recipes/quickstart.yaml", [*CLI, "validate", "recipes/quickstart.yaml"], {}),
    ("the libraries, no teardown", [sys.executable, "-c", f"{LIBRARIES}, os; os._exit(0)"], {}),
    ("the libraries, with the interpreter's teardown", [sys.executable, "-c", LIBRARIES], {}),
    ("the libraries with the set-up deferred, the collector's passes kept", [sys.executable, "-c",
     f"from memtrain import lazy_setup; lazy_setup.install(); {LIBRARIES}, os; os._exit(0)"], {}),
    ("the floor: the libraries as memtrain loads them", [sys.executable, "-c", "from memtrain import "
     f"lazy_setup; lazy_setup.install()\nwith lazy_setup.importing():\n    {LIBRARIES}, os\nos._exit(0)"],
     {}),
    ("memtrain estimate 70B QLoRA (--device cuda)", ESTIMATE_70B, {}),
    ("the same, traces one after the other", ESTIMATE_70B, {"MEMTRAIN_TRACE_PROCESSES": "1"}),
]


def wall_time(command: list[str], extra: dict[str, str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return took


QUICK = ["--quick", "--repeats", "2"]  # CI-sized: the two light commands, twice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the two light commands only")
    args = parser.parse_args()
    commands = COMMANDS[:2] if args.quick else COMMANDS
    times: list[list[float]] = [[] for _ in commands]
    for round_ in range(args.repeats):
        for k, (_, command, extra) in enumerate(commands):
            times[k].append(wall_time(command, extra))
        print(f"round {round_ + 1}: " + ", ".join(f"{t[-1]:.2f}" for t in times), flush=True)
    rows = ["| command | best s | median s |", "|---|---:|---:|"]
    for (name, _, _), took in zip(commands, times, strict=True):
        rows.append(f"| `{name}` | {min(took):.2f} | {harness.median(took):.2f} |")
    print("\n".join(rows))
    harness.write("startup", [
        *harness.header("CLI start-up and the 70B estimate",
                        libraries=("torch", "transformers", "peft", "bitsandbytes", "torchao")),
        f"Each command {args.repeats} times in a fresh process, in rounds (wall time, imports included).",
        "", *rows, "",
        "The library rows are what loading the libraries an estimate of a QLoRA recipe loads (torch, "
        "transformers' model classes and Trainer, peft, bitsandbytes) costs on this machine before any "
        "of memtrain's work, leaving as `memtrain` does (`os._exit` once its work and exit handlers are "
        "done); the next row pays the interpreter's teardown too; the next two load them as the "
        "`memtrain` command does, with bitsandbytes' import-time `torch.compile` calls deferred, "
        "`datasets` loaded on first use, transformers' scan of its model folders read from the store "
        "an earlier run left in `~/.cache/memtrain` and SciPy's optimizers imported when first called "
        "(its object-detection losses), first with Python's garbage collector making its full passes "
        "over the growing heap, then as the command imports: without them (`lazy_setup.importing`), the "
        "floor (memtrain/lazy_setup.py). The 70B estimate's own work is its "
        "time above the floor; its last row traces depths 2 and 3 one after the other instead of side "
        "by side (memtrain/estimator/pool.py)."], trial=args.quick)

if __name__ == "__main__":
    main()
