"""How long memtrain takes to estimate and plan a long context (issue 37), each command timed alone.

Times, with ``/usr/bin/time`` (wall seconds of a fresh process, imports included, median of
``--repeat`` runs):

- ``memtrain estimate`` of Llama-3.1-8B QLoRA r32, batch 1, with every long-context technique
  (full checkpointing, chunked loss, activation and embedding offload, tiled MLP with 256-token
  tiles, lean norm) at ``--tokens`` tokens (default 907,520; YaRN in ``model.config_overrides``
  raises the model's 131,072 positions, as docs/bench/long_context.md does). Beside it, at
  ``--whole-tokens``, the same estimate with every loop iteration run (``exact_length=True``;
  the estimator before issue 37 traced every tile at any length).
- ``memtrain plan`` of the issue's command: that recipe with ``data.max_length=auto`` and every
  long-context technique ``auto``, per GPU size (``--sizes``); beside it, for ``--whole-sizes``,
  the length search alone with every estimate running every loop iteration.
- ``memtrain plan recipes/quickstart.yaml training.micro_batch_size=auto memory.checkpointing=auto
  --budget 200MiB``.

Writes docs/bench/plan_speed.md with the machine's load when it started.

    python -m scripts run plan_speed
    python -m scripts run plan_speed --repeat 3 --whole-sizes 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from scripts import harness

ROOT = harness.ROOT
RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
EXTEND = ("model.config_overrides={rope_scaling: {rope_type: yarn, factor: 8, "
          "original_max_position_embeddings: 131072}}")
SETTINGS = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1",
            "training.effective_batch_size=1", "training.gradient_accumulation=1",
            "memory.checkpointing=full", "memory.loss=chunked", "memory.offload.activations=true",
            "memory.tiled_mlp=true", "memory.offload.embeddings=true", "memory.host_budget=256GiB",
            "memory.lean_norm=true", EXTEND]
GiB = 2**30
# CI-sized: the estimates at 4,096 and 1,024 tokens and the quickstart plan; no 8B plan.
QUICK = ["--tokens", "4096", "--whole-tokens", "1024", "--sizes", "--whole-sizes", "--timeout", "300"]
AUTO = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1", "training.effective_batch_size=1",
        "training.gradient_accumulation=1", "data.max_length=auto", "memory.host_budget=256GiB",
        "memory.checkpointing=auto", "memory.loss=auto", "memory.tiled_mlp=auto",
        "memory.tiled_mlp_tile_tokens=auto", "memory.offload.activations=auto",
        "memory.offload.embeddings=auto", "memory.lean_norm=auto"]  # the command
QUICKSTART = ["recipes/quickstart.yaml", "training.micro_batch_size=auto", "memory.checkpointing=auto",
              "--budget", "200MiB"]

# The length search with every loop iteration run (the estimator before issue 37 did that).
WHOLE_SEARCH = """
import json
from memtrain.config import load_recipe
from memtrain.plan import length
from memtrain.reliability.budget import usable_bytes
cfg = load_recipe({recipe!r}, {overrides!r})
found = length.longest_length(cfg, "cuda", usable_bytes({gb} * 2**30, 0.10), host=256 * 2**30,
                              exact_length=True)
print(json.dumps({{"tokens": found.chosen, "probes": len(found.probes)}}))
"""
WHOLE_ESTIMATE = """
import json
from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
est = estimate(load_recipe({recipe!r}, {overrides!r}), device="cuda", exact_length=True)
print(json.dumps({{"total": est.total_bytes, "method": est.method}}))
"""


def timed(argv: list[str], timeout: float) -> tuple[float | None, dict | None]:
    """(wall seconds by /usr/bin/time, the last JSON object printed) of ``argv``; (None, None) past the
    timeout or on failure."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as clock:
        cmd = ["/usr/bin/time", "-f", "%e", "-o", clock.name, *argv]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, None
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return None, None
        text = out.stdout[out.stdout.index("{"):] if "{" in out.stdout else "{}"
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            found = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        return float(clock.read().split()[-1]), found


def median(argv: list[str], repeat: int, timeout: float
           ) -> tuple[float | None, dict | None, list[float | None]]:
    """(median seconds, a result, each run's seconds) of ``repeat`` runs one after the other."""
    runs = [timed(argv, timeout) for _ in range(repeat)]
    seconds = [s for s, _ in runs if s is not None]
    result = next((r for _, r in runs if r is not None), None)
    return (harness.median(seconds) if len(seconds) == len(runs) else None), result, [s for s, _ in runs]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "memtrain", *args]


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=907_520)
    parser.add_argument("--whole-tokens", type=int, default=16_384)
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 24, 80])
    parser.add_argument("--whole-sizes", type=int, nargs="*", default=[8])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    args = parser.parse_args()
    load = os.getloadavg()
    rows = []
    tile = [*SETTINGS, "memory.tiled_mlp_tile_tokens=256"]

    def row(what: str, at: str, how: str, argv: list[str], show) -> None:
        seconds, result, runs = median(argv, args.repeat, args.timeout)
        shown = show(result) if result else f"no answer within {args.timeout:.0f} s"
        rows.append((what, at, how, seconds, runs, shown))
        print(rows[-1], flush=True)

    def total(r: dict) -> str:
        return f"{r['total'] / GiB:.3f} GiB; {r['method']}"

    for tokens in (args.tokens, args.whole_tokens):
        row("memtrain estimate", f"{tokens:,} tokens", "loops elided",
            cli("estimate", RECIPE, "--device", "cuda", "--json", *tile, f"data.max_length={tokens}"),
            lambda r: f"{r['total_bytes'] / GiB:.3f} GiB; {r['method']}")
    row("estimate, every iteration", f"{args.whole_tokens:,} tokens", "exact_length=True",
        python(WHOLE_ESTIMATE.format(recipe=RECIPE,
                                     overrides=[*tile, f"data.max_length={args.whole_tokens}"])),
        total)
    for gb in args.sizes:
        row("memtrain plan (every technique auto)", f"{gb} GiB GPU", "loops elided",
            cli("plan", RECIPE, "--device", "cuda", "--budget", f"{gb}GiB", "--json", *AUTO), _plan)
    for gb in args.whole_sizes:
        row("length search alone, every iteration", f"{gb} GiB GPU", "exact_length=True",
            python(WHOLE_SEARCH.format(recipe=RECIPE, gb=gb, overrides=[
                *SETTINGS, "memory.tiled_mlp_tile_tokens=auto", "data.max_length=auto"])),
            lambda r: f"{r['tokens']:,} tokens, {r['probes']} lengths estimated")
    row("memtrain plan", "quickstart, 200 MiB", "", cli("plan", *QUICKSTART, "--json"), _plan)
    write(rows, args, load)


def _plan(result: dict) -> str:
    chosen = result.get("chosen") or {}
    length = result.get("max_length")
    length = length.get("chosen") if isinstance(length, dict) else length
    head = f"{length:,} tokens; " if isinstance(length, int) else ""
    values = ", ".join(f"{k.split('.', 1)[-1]}={v}" for k, v in (chosen.get("values") or {}).items())
    peak = chosen.get("peak_bytes", 0) / GiB
    return f"{head}{values}; micro-batch {chosen.get('micro_batch_size')}; peak {peak:.2f} GiB"


def write(rows: list[tuple], args: argparse.Namespace, load: tuple[float, float, float]) -> None:
    lines = [
        *harness.header("Planning speed: estimates and plans at long contexts (issue 37)"),
        f"Load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} when it started. **The machine was shared and loaded: absolute times are "
        "inflated; compare rows of this run.** Seconds are `/usr/bin/time` wall time of a fresh "
        f"process (imports included), median of {args.repeat}; *each run* lists them in the order they "
        "ran (this VM's speed varies by up to half from one minute to the next: the rows that did not "
        "change between two pages show it).",
        "",
        f"Llama-3.1-8B QLoRA r32, batch 1, `{RECIPE}`. Estimates: "
        f"{', '.join(f'`{x}`' for x in SETTINGS[:-1])}, "
        "`memory.tiled_mlp_tile_tokens=256` and YaRN (`model.config_overrides`, 1,048,576 positions). "
        f"Plans: the issue's command, {', '.join(f'`{x}`' for x in AUTO)}, no YaRN (the model's 131,072 "
        "positions bound the search). *loops elided*: an estimate runs a long loop's first four "
        "iterations and its last, three where it settles from its second (memtrain/memory/loops.py; "
        "equal to running every iteration byte for byte, tests/estimator/test_loop_elision.py). "
        "*exact_length=True*: every iteration run, as the estimator did before issue 37.",
        "",
        "| what | at | how | seconds | each run | result |",
        "|---|---|---|---:|---|---|",
    ]
    for what, at, how, seconds, runs, result in rows:
        each = " / ".join("-" if s is None else f"{s:.1f}" for s in runs)
        lines.append(f"| {what} | {at} | {how} | {'-' if seconds is None else f'{seconds:.1f}'} | {each} | "
                     f"{result} |")
    harness.write("plan_speed", lines)


if __name__ == "__main__":
    main()
