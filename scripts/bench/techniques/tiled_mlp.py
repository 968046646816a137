"""Benchmark the tiled MLP against the untiled one, with and without activation checkpointing.

A Llama-shaped model whose MLP is 3.5 times as wide as its hidden state (Llama-3.1-8B's ratio)
trains full fine-tuning steps (forward, backward, AdamW) on one long row. For each setting the
peak of exact live tensor bytes of a steady-state step (``memprobe.LiveBytes``, no memtrain code;
CPU tensors), the FLOPs of forward + backward (``FlopCounterMode``, in a separate step: counting
raises the peak it would measure) and the median step time over rounds that interleave the
settings (machine noise hits all alike) are measured. Writes docs/bench/tiled_mlp.md.

    python -m scripts run tiled_mlp            # the table in docs/
    python -m scripts run tiled_mlp --quick    # a tiny smoke run
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from memtrain.patches import checkpointing, tiled_mlp
from scripts import harness
from scripts.probes.memprobe import LiveBytes
from scripts.probes.steps import llama, step, weights_and_state

MiB = 2**20
QUICK = ["--quick"]
SETTINGS = [(ckpt, tiled) for ckpt in ("none", "full", "selective") for tiled in (False, True)]


def build(args: argparse.Namespace) -> nn.Module:
    return llama(args.hidden, args.intermediate, args.layers, args.heads, args.vocab, args.seq).train()


def measure(base: nn.Module, ids: torch.Tensor, tiles: int | None) -> dict[tuple[str, bool], dict[str, Any]]:
    """Per setting: FLOPs (first step), exact peak bytes (second step), then interleaved timings."""
    runs: dict[tuple[str, bool], dict[str, Any]] = {}
    for ckpt, tiled in SETTINGS:
        model = copy.deepcopy(base)
        if tiled:
            tiled_mlp.apply(model, tiles)
        checkpointing.apply(model, ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with FlopCounterMode(display=False) as flops:
            step(model, opt, ids)  # also creates the optimizer state
        resident = weights_and_state(model, opt)
        with LiveBytes() as probe:
            step(model, opt, ids)
        runs[(ckpt, tiled)] = {"model": model, "opt": opt, "flops": flops.get_total_flops(),
                               "peak": resident + probe.device_peak, "times": []}
    return runs


def table(runs: dict[tuple[str, bool], dict[str, Any]], args: argparse.Namespace, tiles: int) -> list[str]:
    one = args.seq * args.intermediate * 4  # bytes of one fp32 tokens × intermediate tensor
    lines = ["| checkpointing | MLP | peak (MiB) | tiled − untiled (MiB) | FLOPs ×untiled | "
             "median step (s) | step ×untiled |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for ckpt, tiled in SETTINGS:
        run, plain = runs[(ckpt, tiled)], runs[(ckpt, False)]
        median, plain_median = harness.median(run["times"]), harness.median(plain["times"])
        saved = f"{(run['peak'] - plain['peak']) / MiB:+.1f} ({(run['peak'] - plain['peak']) / one:+.1f} I)" \
            if tiled else ""
        lines.append(f"| {ckpt} | {'tiled' if tiled else 'untiled'} | {run['peak'] / MiB:.1f} | {saved} | "
                     f"{harness.ratio(run['flops'], plain['flops']):.3f} | {median:.3f} | "
                     f"{harness.ratio(median, plain_median):.2f} |")
    lines.append("")
    lines.append(f"*I* = one tokens × intermediate fp32 tensor ({one / MiB:.1f} MiB); tiles: {tiles} "
                 "(ALST's rule, ceil(tokens / hidden)) unless `--tiles` is given.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=896)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tiles", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (page to a temp folder)")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.seq, args.repeats = 64, 224, 2, 256, 1
    base = build(args)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    tiles = args.tiles or tiled_mlp.default_tiles(args.seq, args.hidden)
    runs = measure(base, ids, args.tiles)
    times = harness.rounds({key: (lambda run=run: step(run["model"], run["opt"], ids))
                            for key, run in runs.items()}, args.repeats)
    for key, run in runs.items():
        run["times"] = times[key]
    lines = [*harness.header("Tiled MLP: memory and step time"),
             f"Llama-shaped, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
             f"{args.heads} heads, vocabulary {args.vocab}; full fine-tuning in fp32, AdamW, one row of "
             f"{args.seq} tokens. Peak: exact live tensor bytes of a steady-state step on CPU "
             "(parameters, gradients, optimizer state and activations; `scripts/probes/memprobe.py`). Step "
             f"time: median of {args.repeats} interleaved rounds, {torch.get_num_threads()} threads.", "",
             *table(runs, args, tiles), ""]
    print("\n".join(lines))
    harness.write("tiled_mlp", lines, trial=args.quick)


if __name__ == "__main__":
    main()
