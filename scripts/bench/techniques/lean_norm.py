"""Benchmark the lean RMSNorm against transformers' own, in fp32 and bf16, with and without checkpointing.

A Llama-shaped model (Llama-3.1-8B's MLP ratio) trains full fine-tuning steps (forward, backward,
AdamW) on one long row. For each setting the peak of exact live tensor bytes of a steady-state step
(``memprobe.LiveBytes``, no memtrain code; CPU tensors) and the median step time over rounds that
interleave the settings (machine noise hits all alike) are measured, on one intra-op thread by
default: on this project's shared 2-core machine, under other engineers' load, two threads made
every op wait for a descheduled thread (by hand, 2026-11-25: a norm's forward + backward at
2048 × 256 took 92 ms on two threads, 3.4 ms on one), so time grew with the number of ops, not
their work. Writes docs/bench/lean_norm.md.

    python -m scripts run lean_norm            # the table in docs/
    python -m scripts run lean_norm --quick    # a tiny smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from memtrain.patches import checkpointing, lean_norm
from scripts import harness
from scripts.probes.memprobe import LiveBytes
from scripts.probes.steps import llama, step, weights_and_state

MiB = 2**20
QUICK = ["--quick"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS = 15  # of the norm alone
SETTINGS = [(dtype, ckpt, lean) for dtype in DTYPES for ckpt in ("none", "full") for lean in (False, True)]


def build(args: argparse.Namespace, dtype: torch.dtype) -> nn.Module:
    model = llama(args.hidden, args.intermediate, args.layers, args.heads, args.vocab, args.seq)
    return model.to(dtype).train()


def measure(args: argparse.Namespace, ids: torch.Tensor) -> dict[tuple[str, str, bool], dict[str, Any]]:
    """Per setting: a warm-up step (optimizer state), then the exact peak of the next step."""
    bases = {name: build(args, dtype) for name, dtype in DTYPES.items()}
    runs: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for dtype, ckpt, lean in SETTINGS:
        model = copy.deepcopy(bases[dtype])
        if lean:
            lean_norm.apply(model)
        checkpointing.apply(model, ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        step(model, opt, ids)
        resident = weights_and_state(model, opt)
        with LiveBytes() as probe:
            step(model, opt, ids)
        runs[(dtype, ckpt, lean)] = {"model": model, "opt": opt, "peak": resident + probe.device_peak,
                                     "times": []}
    return runs


def _fwd_bwd(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor, times: int = 1) -> None:
    for _ in range(times):
        norm(x).backward(grad)
        x.grad = norm.weight.grad = None


def norm_alone(shapes: list[tuple[int, int]], rounds: int) -> list[str]:
    """One LlamaRMSNorm alone, forward + backward (weight trained): exact peak bytes and the median
    over interleaved rounds of 5 calls (short rounds: most miss a shared machine's load spikes)."""
    lines = ["| dtype | tokens × hidden | plain peak (MiB) | lean peak (MiB) | plain (ms) | lean (ms) | "
             "lean ×plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, dtype in DTYPES.items():
        for tokens, hidden in shapes:
            plain = LlamaRMSNorm(hidden).to(dtype)
            lean = lean_norm.apply(copy.deepcopy(plain))
            x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)
            x.requires_grad_(True)
            grad = torch.ones_like(x)
            peaks = []
            for norm in (plain, lean):
                with LiveBytes() as probe:
                    _fwd_bwd(norm, x, grad)
                peaks.append(probe.device_peak)
            times = harness.rounds({k: (lambda norm=norm, x=x, grad=grad: _fwd_bwd(norm, x, grad, 5))
                                    for k, norm in enumerate((plain, lean))}, rounds, say=False)
            a, b = harness.median(t / 5 for t in times[0]), harness.median(t / 5 for t in times[1])
            lines.append(f"| {name} | {tokens} × {hidden} | {peaks[0] / MiB:.1f} | {peaks[1] / MiB:.1f} | "
                         f"{a * 1e3:.2f} | {b * 1e3:.2f} | {harness.ratio(b, a):.2f} |")
    return lines


def table(runs: dict[tuple[str, str, bool], dict[str, Any]], args: argparse.Namespace) -> list[str]:
    one = args.seq * args.hidden * 4  # bytes of one fp32 tokens × hidden tensor
    lines = ["| dtype | checkpointing | norm | peak (MiB) | lean − plain (MiB) | median step (s) | "
             "step ×plain |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for dtype, ckpt, lean in SETTINGS:
        run, plain = runs[(dtype, ckpt, lean)], runs[(dtype, ckpt, False)]
        median, plain_median = harness.median(run["times"]), harness.median(plain["times"])
        delta = run["peak"] - plain["peak"]
        saved = f"{delta / MiB:+.1f} ({delta / one:+.2f} N)" if lean else ""
        lines.append(f"| {dtype} | {ckpt} | {'lean' if lean else 'plain'} | {run['peak'] / MiB:.1f} | "
                     f"{saved} | {median:.3f} | {harness.ratio(median, plain_median):.2f} |")
    norms = 2 * args.layers + 1
    lines += ["", f"*N* = one fp32 tokens × hidden tensor ({one / MiB:.1f} MiB). Norms: {norms} "
              f"({args.layers} layers × 2 and the final one); tiles of {args.hidden} tokens."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=896)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; 1 by default: on a shared 2-core machine two threads time "
                        "the wait for a descheduled thread at every op, not the op")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (page to a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.seq, args.repeats = 64, 224, 2, 256, 1
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    runs = measure(args, ids)
    load_before = os.getloadavg()[0]
    times = harness.rounds({key: (lambda run=run: step(run["model"], run["opt"], ids))
                            for key, run in runs.items()}, args.repeats)
    for key, run in runs.items():
        run["times"] = times[key]
    shapes = [(args.seq, args.hidden), (8 * args.seq // (2 if args.quick else 1), 1024)]
    alone = norm_alone(shapes, 3 if args.quick else ROUNDS)
    load = f"load average {load_before:.1f} before the timing rounds, {os.getloadavg()[0]:.1f} after"
    lines = [*harness.header("Lean RMSNorm: memory and step time"),
             f"Llama-shaped, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
             f"{args.heads} heads, vocabulary {args.vocab}; full fine-tuning, AdamW, one row of {args.seq} "
             "tokens. Peak: exact live tensor bytes of a steady-state step on CPU (parameters, gradients, "
             "optimizer state and activations; `scripts/probes/memprobe.py`). Step time: median of "
             f"{args.repeats} interleaved rounds, {torch.get_num_threads()} threads; {load}.", "",
             *table(runs, args), "",
             "One norm alone (`LlamaRMSNorm`, weight trained, forward + backward with tiles of hidden "
             "tokens): the peak counts the output, what forward saves and what backward makes (the input "
             f"gradient included, the input not); time: median of {ROUNDS} interleaved rounds of 5 calls.",
             "", *alone, ""]
    print("\n".join(lines))
    harness.write("lean_norm", lines, trial=args.quick)


if __name__ == "__main__":
    main()
