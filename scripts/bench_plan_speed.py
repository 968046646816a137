"""How long memtrain takes to plan a long context (issue 37): extrapolated along the sequence vs traced.

Times, with ``/usr/bin/time`` (wall seconds, median of ``--repeat`` runs), each in a fresh process:

- ``estimate``: ``memtrain estimate`` of Llama-3.1-8B QLoRA r32, batch 1, with every long-context
  technique (full checkpointing, chunked loss, activation and embedding offload, tiled MLP with
  256-token tiles, lean norm) at ``--tokens`` tokens (default 900,000; YaRN in
  ``model.config_overrides`` raises the model's 131,072 positions, as docs/bench/long_context.md
  does). ``traced`` runs the same estimate with ``exact_length=True`` (the whole length traced; the
  depth extrapolated as always) — hours at 900k tokens, so only at ``--traced-tokens``.
- ``length search``: the planner's ``data.max_length: auto`` search
  (:func:`memtrain.plan.length.longest_length`) with those settings, per GPU size; ``traced`` runs
  it with every estimate traced at its length (the search before issue 37, regula falsi over full
  traces), only for the sizes in ``--traced-sizes``.

Writes docs/bench/plan_speed.md. The machine is shared and its load is printed beside the table:
absolute times on a loaded machine are inflated, compare rows of one run.

    PYTHONPATH=$PWD python scripts/bench_plan_speed.py
    PYTHONPATH=$PWD python scripts/bench_plan_speed.py --sizes 8 24 80 --traced-sizes 8 --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "bench" / "plan_speed.md"
RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
EXTEND = ("model.config_overrides={rope_scaling: {rope_type: yarn, factor: 8, "
          "original_max_position_embeddings: 131072}}")
SETTINGS = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1",
            "training.effective_batch_size=1", "training.gradient_accumulation=1",
            "memory.checkpointing=full", "memory.loss=chunked", "memory.offload.activations=true",
            "memory.tiled_mlp=true", "memory.offload.embeddings=true", "memory.host_budget=256GiB",
            "memory.lean_norm=true", EXTEND]
GiB = 2**30

# Run in a fresh interpreter: one estimate, or one length search; prints a JSON line.
ESTIMATE = """
import json, sys
from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
cfg = load_recipe({recipe!r}, {overrides!r})
est = estimate(cfg, device="cuda", exact_length={traced!r})
print(json.dumps({{"total": est.total_bytes, "host": est.host_peak_bytes, "method": est.method}}))
"""
SEARCH = """
import json
from memtrain.config import load_recipe
from memtrain.plan.length import longest_length
from memtrain.reliability.budget import usable_bytes
if {traced!r}:
    from memtrain.estimator import seqlen
    seqlen.plan = lambda *args, **kwargs: None  # every estimate traced at its length
cfg = load_recipe({recipe!r}, {overrides!r})
found = longest_length(cfg, "cuda", usable_bytes({gb} * 2**30, 0.10), host=256 * 2**30)
print(json.dumps({{"tokens": found.chosen, "probes": len(found.probes), "leanest": found.leanest}}))
"""


def timed(code: str, timeout: float) -> tuple[float | None, dict | None]:
    """(wall seconds by /usr/bin/time, the JSON line) of ``python -c code``; (None, None) past the timeout."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as clock:
        cmd = ["/usr/bin/time", "-f", "%e", "-o", clock.name, sys.executable, "-c", code]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, None
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return None, None
        last = [line for line in out.stdout.splitlines() if line.startswith("{")][-1]
        return float(clock.read().split()[-1]), json.loads(last)


def median(code: str, repeat: int, timeout: float) -> tuple[float | None, dict | None]:
    runs = [timed(code, timeout) for _ in range(repeat)]
    seconds = [s for s, _ in runs if s is not None]
    result = next((r for _, r in runs if r is not None), None)
    return (statistics.median(seconds) if len(seconds) == len(runs) else None), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=900_000)
    parser.add_argument("--traced-tokens", type=int, default=16_384)
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 24, 80])
    parser.add_argument("--traced-sizes", type=int, nargs="*", default=[8])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    args = parser.parse_args()
    load = os.getloadavg()
    rows = []
    tile = ["memory.tiled_mlp_tile_tokens=256"]
    for tokens, traced in ((args.tokens, False), (args.traced_tokens, False), (args.traced_tokens, True)):
        code = ESTIMATE.format(recipe=RECIPE, overrides=[*SETTINGS, *tile, f"data.max_length={tokens}"],
                               traced=traced)
        seconds, result = median(code, args.repeat, args.timeout)
        rows.append(("estimate", f"{tokens:,} tokens", "traced" if traced else "extrapolated", seconds,
                     f"{result['total'] / GiB:.3f} GiB; {result['method']}" if result else "-"))
        print(rows[-1], flush=True)
    search = ["memory.tiled_mlp_tile_tokens=auto", "data.max_length=auto"]
    for gb in args.sizes:
        for traced in (False, True):
            if traced and gb not in args.traced_sizes:
                continue
            code = SEARCH.format(recipe=RECIPE, overrides=[*SETTINGS, *search], traced=traced, gb=gb)
            seconds, result = median(code, args.repeat, args.timeout)
            what = (f"{result['tokens']:,} tokens, {result['probes']} lengths estimated" if result
                    else f"no answer within {args.timeout:.0f} s")
            how = "traced" if traced else "extrapolated"
            rows.append(("length search", f"{gb} GiB GPU", how, seconds, what))
            print(rows[-1], flush=True)
    write(rows, args, load)


def write(rows: list[tuple], args: argparse.Namespace, load: tuple[float, float, float]) -> None:
    import torch
    import transformers

    lines = [
        "# Planning speed: a long context from short traces (issue 37)",
        "",
        f"`PYTHONPATH=$PWD python scripts/bench_plan_speed.py {' '.join(sys.argv[1:])}` on "
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} when it started. **The machine was shared and loaded: absolute times are "
        "inflated; compare rows of this run.** Seconds are `/usr/bin/time` wall time of a fresh "
        f"process (imports included), median of {args.repeat}.",
        "",
        f"Llama-3.1-8B QLoRA r32, batch 1, `{RECIPE}` with {', '.join(f'`{s}`' for s in SETTINGS[:-1])} "
        "and YaRN (`model.config_overrides`, 1,048,576 positions). *extrapolated*: the estimate traces a few "
        "short lengths and extrapolates along the sequence (memtrain/estimator/seqlen.py; equal to the "
        "traced length byte for byte, tests/estimator/test_seq_extrapolation.py); the length search "
        "solves the affine model and confirms (memtrain/plan/length.py). *traced*: every estimate "
        "traces its whole length (depth still extrapolated), the search as before issue 37.",
        "",
        "| what | at | how | seconds | result |",
        "|---|---|---|---:|---|",
    ]
    for what, at, how, seconds, result in rows:
        lines.append(f"| {what} | {at} | {how} | {'-' if seconds is None else f'{seconds:.1f}'} | {result} |")
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
