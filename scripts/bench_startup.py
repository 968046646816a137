"""How long the CLI takes, whole commands in fresh processes: start-up and the 70B estimate.

Each command runs ``--repeats`` times in a new process (imports included, as a user runs it); the
table has the best and the median wall time. Beside them, the floor no code of memtrain's can go
under: a bare ``python -c`` importing the libraries an estimate of a QLoRA recipe loads (torch,
transformers' model classes and Trainer, peft, bitsandbytes) and leaving as ``memtrain`` does,
without the interpreter's teardown (``os._exit``), and the same with the teardown. The 70B
estimate also runs with its two traces one after the other (``MEMTRAIN_TRACE_PROCESSES=1``).
Writes docs/bench/startup.md.

    PYTHONPATH=$PWD python scripts/bench_startup.py            # the table in docs/
    PYTHONPATH=$PWD python scripts/bench_startup.py --repeats 1 --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "memtrain"]
LIBRARIES = "import torch, transformers.modeling_utils, transformers.trainer, peft, bitsandbytes"
ESTIMATE_70B = [*CLI, "estimate", "recipes/llama-3.1-8b-qlora.yaml",
                "model.name=meta-llama/Llama-3.1-70B", "--device", "cuda"]
# (name, command, extra environment)
COMMANDS: list[tuple[str, list[str], dict[str, str]]] = [
    ("memtrain --help", [*CLI, "--help"], {}),
    ("memtrain validate recipes/quickstart.yaml", [*CLI, "validate", "recipes/quickstart.yaml"], {}),
    ("the floor: the libraries, no teardown", [sys.executable, "-c", f"{LIBRARIES}, os; os._exit(0)"], {}),
    ("the libraries, with the interpreter's teardown", [sys.executable, "-c", LIBRARIES], {}),
    ("memtrain estimate 70B QLoRA (--device cuda)", ESTIMATE_70B, {}),
    ("the same, traces one after the other", ESTIMATE_70B, {"MEMTRAIN_TRACE_PROCESSES": "1"}),
]


def wall_times(command: list[str], repeats: int, extra: dict[str, str]) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the two light commands only, nothing written")
    args = parser.parse_args()
    rows = ["| command | best s | median s |", "|---|---:|---:|"]
    for name, command, extra in COMMANDS[:2] if args.quick else COMMANDS:
        times = wall_times(command, args.repeats, extra)
        rows.append(f"| `{name}` | {min(times):.2f} | {statistics.median(times):.2f} |")
        print(rows[-1], flush=True)
    if args.quick:
        return
    text = "\n".join([
        "# CLI start-up and the 70B estimate", "",
        f"`python scripts/bench_startup.py` on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; each command {args.repeats} times "
        "in a fresh process (wall time, imports included).", "", *rows, "",
        "The floor row is what loading the libraries an estimate of a QLoRA recipe loads (torch, "
        "transformers' model classes and Trainer, peft, bitsandbytes) costs on this machine before any "
        "memtrain code runs, leaving as `memtrain` does (`os._exit` once its work and exit handlers are "
        "done); the next row pays the interpreter's teardown too. The 70B estimate's own work is the "
        "difference; its last row traces depths 2 and 3 one after the other instead of side by side "
        "(memtrain/memory/trace_pool.py).", ""])
    out = ROOT / "docs" / "bench" / "startup.md"
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
