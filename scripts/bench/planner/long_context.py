"""The longest context memtrain plans for Llama-3.1-8B QLoRA r32, batch 1, per GPU size (issue 27).

Unsloth publishes the longest context it trains for Llama-3.1-8B(-Instruct) QLoRA, LoRA rank 32 on
every linear layer, batch 1, on GPUs of 8 to 80 GB. This script finds, for the same model, adapter
and batch, the longest ``data.max_length`` whose estimate (``memtrain.estimate``, ``--device
cuda``: fake-tensor traces, the CUDA context and allocator fragmentation included) fits the GPU's
memory less memtrain's default margin (10%, ``memory.margin``), with the leanest techniques
memtrain has turned on, and reports the host RAM that plan needs (activation offload) beside it.
Llama-3.1-8B has 131,072 positions, and the planner never plans past a model's positions
(:func:`memtrain.estimator.setup.position_limit`): the recipe extends them as a user would, with
YaRN in ``model.config_overrides`` (8 x 131,072 = 1,048,576 positions; RoPE's type changes no
tensor the step keeps, so no figure here depends on it).

The inputs are fixed here (GPU sizes, Unsloth's published figures, the settings); nothing is taken
from memtrain's own output but the estimate being searched. The search is the planner's own for
``data.max_length: auto`` (:func:`memtrain.plan.length.longest_length`: a line through two
estimates, then regula falsi on multiples of 256 tokens until the longest length that fits and the
next that does not are found); its estimates are kept across GPU sizes, so each row starts from
the lengths the smaller ones probed. Beside each row: the estimate's categories at the length
found, and the bytes each added token costs between rows. Writes docs/bench/long_context.md.

    python -m scripts run long_context
    python -m scripts run long_context --sizes 8 24   # some GPUs only
"""

from __future__ import annotations

import argparse
import sys
import time

from memtrain.config import MemoryConfig, load_recipe
from memtrain.errors import MemtrainError
from memtrain.estimator.estimate import estimate
from memtrain.plan.length import LENGTH_STEP, LengthSearch, longest_length
from memtrain.plan.search import TraceCache
from memtrain.reliability.budget import usable_bytes
from scripts import harness

GiB = 2**30
RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
HOST_BUDGET = 256 * GiB  # a GPU server's RAM (issue 27: memory.host_budget=256GiB)
# Unsloth's published longest context (tokens), Llama-3.1-8B QLoRA r32, batch 1, by GPU memory (GB).
# CI-sized: one searched row (8 GiB), nothing extrapolated.
QUICK = ["--sizes", "8"]
UNSLOTH = {8: 2_972, 12: 21_848, 16: 40_724, 24: 78_475, 40: 153_977, 48: 191_728, 80: 342_733}
# Beyond the model's 131,072 positions (the longest rows plan 212,736 tokens and more): YaRN
EXTEND = ("model.config_overrides={rope_scaling: {rope_type: yarn, factor: 8, "
          "original_max_position_embeddings: 131072}}")
BASE = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1", "training.effective_batch_size=1",
        "training.gradient_accumulation=1", "memory.checkpointing=full", "memory.loss=chunked",
        "memory.offload.activations=true", "memory.tiled_mlp=true", "memory.offload.embeddings=true",
        "memory.host_budget=256GiB", "memory.tiled_mlp_tile_tokens=auto", EXTEND]
# Techniques that exist in this version of memtrain are added when the schema has their field.
OPTIONAL = {"lean_norm": "memory.lean_norm=true"}


def settings() -> list[str]:
    fields = MemoryConfig.model_fields
    return BASE + [value for name, value in OPTIONAL.items() if name in fields]


CACHE = TraceCache()  # every size's search starts from the lengths the sizes before it estimated


def longest(usable: int) -> LengthSearch:
    """The planner's longest length for these settings (``data.max_length: auto``)."""
    cfg = load_recipe(RECIPE, [*settings(), "data.max_length=auto"])
    return longest_length(cfg, "cuda", usable, host=HOST_BUDGET, cache=CACHE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=sorted(UNSLOTH))
    parser.add_argument("--searched-up-to", type=int, default=80, help="GPU sizes (GiB) above this are "
                        "extrapolated from the two longest searched rows, not searched")
    parser.add_argument("--check", action="store_true", help="estimate the first extrapolated row's "
                        "length exactly and print how far the line is off")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = [{"gb": gb, "usable": usable_bytes(gb * GiB, 0.10), "tokens": 0, "est": None, "probes": 0,
             "line": None} for gb in args.sizes]
    for row in rows:
        if row["gb"] > args.searched_up_to:
            continue
        try:
            found = longest(row["usable"])
        except MemtrainError as err:
            print(f"{row['gb']} GiB: {err}", file=sys.stderr, flush=True)
            continue
        size = found.leanest.get("memory.tiled_mlp_tile_tokens")
        row.update(tokens=found.chosen, est=found.estimate, probes=len(found.probes), leanest=found.leanest,
                   tile=f"{size:,}" if size else "4,096 (hidden_size)")
        print(f"{row['gb']} GiB: {found.chosen} tokens; {found.explain()} "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
        finish(rows, None, time.perf_counter() - start)  # each row as it comes: a stopped run keeps them
    later = finish(rows, None, time.perf_counter() - start)
    if args.check and later:
        lean = next(r["leanest"] for r in reversed(rows) if r["est"] is not None)  # the line's settings
        chosen = [f"{k}={'null' if v is None else v}" for k, v in lean.items() if k.startswith("memory.")]
        cfg = load_recipe(RECIPE, [*settings(), *chosen, f"data.max_length={later[0]['tokens']}"])
        exact = estimate(cfg, device="cuda")
        print(f"check: {later[0]['tokens']} tokens, line {later[0]['line'][0] / GiB:.3f} GiB, "
              f"estimate {exact.total_bytes / GiB:.3f} GiB [{time.perf_counter() - start:.0f} s]", flush=True)
        finish(rows, (later[0], exact), time.perf_counter() - start)


def finish(rows: list[dict], check: tuple | None, seconds: float) -> list[dict]:
    """Rows not searched (yet) extrapolated from the two longest searched ones; the page written.
    Returns the extrapolated rows."""
    searched = [r for r in rows if r["est"] is not None]
    longest = max((r["gb"] for r in searched), default=0)
    for row in rows:
        row["line"] = None
        if len(searched) >= 2 and row["gb"] > longest:
            row["tokens"], row["line"] = extrapolate(searched[-2], searched[-1], row["usable"])
    write(rows, searched[-2:] if len(searched) >= 2 else [], check, seconds)
    return [r for r in rows if r["line"] is not None]


def extrapolate(a: dict, b: dict, usable: int) -> tuple[int, tuple[float, float]]:
    """The longest multiple of the planner's step on the line through two searched rows' estimates
    (device total and host bytes both linear in the length), and the line's (total, host) there."""
    span = b["tokens"] - a["tokens"]
    slope = (b["est"].total_bytes - a["est"].total_bytes) / span
    host_slope = (b["est"].host_peak_bytes - a["est"].host_peak_bytes) / span
    tokens = b["tokens"] + (usable - b["est"].total_bytes) / slope
    if host_slope > 0:
        tokens = min(tokens, b["tokens"] + (HOST_BUDGET - b["est"].host_peak_bytes) / host_slope)
    tokens = int(tokens) // LENGTH_STEP * LENGTH_STEP
    return tokens, (b["est"].total_bytes + slope * (tokens - b["tokens"]),
                    b["est"].host_peak_bytes + host_slope * (tokens - b["tokens"]))


CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
OVERHEADS = ("cuda_context", "fragmentation")


def write(rows: list[dict], line: list[dict], check: tuple | None, seconds: float) -> None:
    lines = [
        *harness.header("Longest context: Llama-3.1-8B QLoRA r32, batch 1 (issue 27)"),
        f"{seconds:.0f} s. **Planned, not trained**: every figure is memtrain's estimate for a CUDA "
        "GPU (`memtrain estimate --device cuda`: fake-tensor traces of the real training step, plus "
        "the CUDA context, cuBLAS workspaces and allocator fragmentation as `memtrain calibrate`'s "
        "defaults say: the context and workspaces as an H100 measured them (docs/bench/gpu.md), the "
        "fragmentation under expandable segments an assumption), against the GPU's memory less the "
        "default 10% margin. Unsloth's "
        "figures are measured by Unsloth on real GPUs. Searched rows: the planner's "
        "`data.max_length: auto` search (`memtrain.plan.length`), the longest multiple of "
        f"{LENGTH_STEP} tokens that fits and the next one not; an estimate costs seconds at any "
        "length (long loops elided, memtrain/memory/loops.py). *Extrapolated* rows (above "
        "`--searched-up-to`): the line through the two longest searched rows' estimates (device "
        "total and host RAM), not searched. *MLP tile*: the tokens per tiled-MLP tile the "
        "search needed (`memory.tiled_mlp_tile_tokens: auto`: 4,096 = hidden_size, 1,024 or 256); "
        "smaller tiles keep less and dequantize the 4-bit MLP weights once per tile and pass, so the "
        "step is slower.",
        "",
        f"Settings: `{RECIPE}` with {', '.join(f'`{s}`' for s in settings())}; host RAM allowed "
        f"{HOST_BUDGET // GiB} GiB (activation offload keeps each layer's input there).",
        "",
        "| GPU memory | memtrain plans | Unsloth | ratio | how | MLP tile | predicted on GPU (total) "
        "| host RAM |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        gb, tokens, est, extra = row["gb"], row["tokens"], row["est"], row["line"]
        unsloth = UNSLOTH.get(gb)
        ratio = f"{tokens / unsloth:.2f}x" if unsloth else "-"
        if est is not None:
            how, total, host = (f"searched ({row['probes']} estimates)", est.total_bytes, est.host_peak_bytes)
        elif extra is not None:
            how, (total, host) = "extrapolated", extra
        else:
            how, total, host = "nothing fits", None, None
        cell = (lambda v, d: "-" if v is None else f"{v / GiB:.{d}f} GiB")  # noqa: E731
        tile = row.get("tile") or ("as the line's rows" if extra is not None else "-")
        lines.append(f"| {gb} GiB | {tokens:,} | {unsloth:,} | {ratio} | {how} | {tile} | {cell(total, 2)} | "
                     f"{cell(host, 1)} |")
    lines += ["", "GiB here is 2^30 bytes; Unsloth's table says GB. The usable memory is "
              "0.9 x the GPU's (memory.margin 10%). `estimates`: lengths the search estimated for "
              "that row (those of earlier rows reused)."]
    if line:
        a, b = line
        per = (b["est"].total_bytes - a["est"].total_bytes) / (b["tokens"] - a["tokens"])
        host = (b["est"].host_peak_bytes - a["est"].host_peak_bytes) / (b["tokens"] - a["tokens"])
        lines += ["", f"The line: {per / 1024:.1f} KiB of device memory and {host / 1024:.1f} KiB of "
                  f"host RAM per added token, through {a['tokens']:,} and {b['tokens']:,} tokens. "
                  "The host RAM grows in steps: CUDA pins each offloaded layer input in a block of the "
                  "next power of two (torch's pinned-memory allocator; docs/estimate.md), so the host "
                  "column doubles where the inputs cross one, and a row whose next length's blocks "
                  "would pass the host RAM allowed stops there (the search's `probes` say which)."]
    if check is not None:
        row, exact = check
        lines += [f"Check (`--check`): at {row['tokens']:,} tokens the line says "
                  f"{row['line'][0] / GiB:.3f} GiB, the estimate {exact.total_bytes / GiB:.3f} GiB "
                  f"(usable {row['usable'] / GiB:.2f} GiB); host {exact.host_peak_bytes / GiB:.1f} GiB."]
    lines += ["", "What the device holds at the peak of each searched plan (GiB; the estimate's categories "
              "at the length found; the total adds the 0.06 GiB of cuBLAS workspaces and the allocator's "
              "rounding), and the bytes per token added since the row above:", "",
              "| GPU memory | tokens | " + " | ".join(CATEGORIES + OVERHEADS) + " | per added token |",
              "|---|---:|" + "---:|" * (len(CATEGORIES) + len(OVERHEADS) + 1)]
    previous = None
    exacts = [(r["gb"], r["tokens"], r["est"]) for r in rows if r["est"] is not None]
    if check is not None:
        exacts.append((check[0]["gb"], check[0]["tokens"], check[1]))
    for gb, tokens, est in exacts:
        cells = [f"{est.by_category.get(c, 0) / GiB:.2f}" for c in CATEGORIES]
        cells += [f"{est.overheads.get(c, 0) / GiB:.2f}" for c in OVERHEADS]
        per = (f"{(est.total_bytes - previous[1]) / (tokens - previous[0]) / 1024:.0f} KiB"
               if previous and tokens > previous[0] else "-")
        lines.append(f"| {gb} GiB | {tokens:,} | " + " | ".join(cells) + f" | {per} |")
        previous = (tokens, est.total_bytes)
    print("\n".join(lines))
    harness.write("long_context", lines)


if __name__ == "__main__":
    main()
