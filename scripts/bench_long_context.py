"""The longest context memtrain plans for Llama-3.1-8B QLoRA r32, batch 1, per GPU size (issue 27).

Unsloth publishes the longest context it trains for Llama-3.1-8B(-Instruct) QLoRA, LoRA rank 32 on
every linear layer, batch 1, on GPUs of 8 to 80 GB. This script finds, for the same model, adapter
and batch, the longest ``data.max_length`` whose estimate (``memtrain.estimate``, ``--device
cuda``: fake-tensor traces, the CUDA context and allocator fragmentation included) fits the GPU's
memory less memtrain's default margin (10%, ``memory.margin``), with the leanest techniques
memtrain has turned on, and reports the host RAM that plan needs (activation offload) beside it.

The inputs are fixed here (GPU sizes, Unsloth's published figures, the settings); nothing is taken
from memtrain's own output but the estimate being searched. The search: estimates at two lengths
give a line, its crossing with the budget is estimated, and bisection on multiples of 256 tokens
settles the longest length that fits and the next that does not. Writes docs/bench/long_context.md.

    PYTHONPATH=$PWD python scripts/bench_long_context.py
    PYTHONPATH=$PWD python scripts/bench_long_context.py --sizes 8 24   # some GPUs only
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from memtrain.config import MemoryConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import Estimate, estimate
from memtrain.reliability.budget import usable_bytes

GiB = 2**30
OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "long_context.md"
RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
STEP = 256  # lengths are multiples of this
HOST_BUDGET = 256 * GiB  # a GPU server's RAM (issue 27: memory.host_budget=256GiB)
# Unsloth's published longest context (tokens), Llama-3.1-8B QLoRA r32, batch 1, by GPU memory (GB).
UNSLOTH = {8: 2_972, 12: 21_848, 16: 40_724, 24: 78_475, 40: 153_977, 48: 191_728, 80: 342_733}
BASE = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1", "training.effective_batch_size=1",
        "training.gradient_accumulation=1", "memory.checkpointing=full", "memory.loss=chunked",
        "memory.offload.activations=true", "memory.tiled_mlp=true"]
# Techniques that exist in this version of memtrain are added when the schema has their field.
OPTIONAL = {"lean_norm": "memory.lean_norm=true"}


def settings() -> list[str]:
    fields = MemoryConfig.model_fields
    return BASE + [value for name, value in OPTIONAL.items() if name in fields]


def at(length: int, cache: dict[int, Estimate]) -> Estimate:
    if length not in cache:
        cache[length] = estimate(load_recipe(RECIPE, [*settings(), f"data.max_length={length}"]),
                                 device="cuda")
    return cache[length]


def fits(est: Estimate, usable: int) -> bool:
    return est.total_bytes <= usable and est.host_peak_bytes <= HOST_BUDGET


def longest(usable: int, cache: dict[int, Estimate]) -> int:
    """The longest multiple of STEP whose estimate fits ``usable`` (0 if not even STEP does)."""
    a, b = 4096, 32768
    ea, eb = at(a, cache), at(b, cache)
    slope = (eb.total_bytes - ea.total_bytes) / (b - a)
    probe = max(STEP, int(a + (usable - ea.total_bytes) / slope) // STEP * STEP)  # the line's guess
    lo, hi, k = 0, None, 0  # lo fits (0: nothing known to), hi does not (None: not found yet)
    while hi is None or hi - lo > STEP:
        if fits(at(probe, cache), usable):
            lo = probe
        else:
            hi = probe
        if hi is None:  # step up, farther each time
            probe, k = lo + STEP * 2**k, k + 1
        else:  # bisect: hi - lo >= 2 * STEP here, so the middle lies strictly between
            probe = (lo + hi) // 2 // STEP * STEP
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=sorted(UNSLOTH))
    args = parser.parse_args()
    start = time.perf_counter()
    cache: dict[int, Estimate] = {}
    rows = []
    for gb in args.sizes:
        usable = usable_bytes(gb * GiB, 0.10)
        try:
            found = longest(usable, cache)
        except MemtrainError as err:
            print(f"{gb} GiB: {err}", file=sys.stderr)
            continue
        est = at(found, cache) if found else None
        ratio = found / UNSLOTH[gb] if gb in UNSLOTH else float("nan")
        rows.append((gb, found, UNSLOTH.get(gb), ratio, est))
        print(f"{gb} GiB: {found} tokens ({ratio:.2f}x Unsloth)", flush=True)
    write(rows, time.perf_counter() - start)


def write(rows: list, seconds: float) -> None:
    lines = [
        "# Longest context: Llama-3.1-8B QLoRA r32, batch 1 (issue 27)",
        "",
        f"`PYTHONPATH=$PWD python scripts/bench_long_context.py` on {datetime.date.today()}, "
        f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{seconds:.0f} s. **Planned, not trained**: every figure is memtrain's estimate for a CUDA "
        "GPU (`memtrain estimate --device cuda`: fake-tensor traces of the real training step, plus "
        "the CUDA context and allocator fragmentation as `memtrain calibrate`'s defaults say, which "
        "no GPU has measured yet), against the GPU's memory less the default 10% margin. Unsloth's "
        "figures are measured by Unsloth on real GPUs.",
        "",
        f"Settings: `{RECIPE}` with {', '.join(f'`{s}`' for s in settings())}; host RAM allowed "
        f"{HOST_BUDGET // GiB} GiB (activation offload keeps each layer's input there).",
        "",
        "| GPU memory | memtrain plans | Unsloth | ratio | predicted on GPU (total) | host RAM |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for gb, found, unsloth, ratio, est in rows:
        total = f"{est.total_bytes / GiB:.2f} GiB" if est else "-"
        host = f"{est.host_peak_bytes / GiB:.1f} GiB" if est else "-"
        lines.append(f"| {gb} GiB | {found:,} | {unsloth:,} | {ratio:.2f}x | {total} | {host} |")
    lines += ["", "GiB here is 2^30 bytes; Unsloth's table says GB. The usable memory is "
              "0.9 x the GPU's (memory.margin 10%)."]
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
