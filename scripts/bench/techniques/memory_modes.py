"""Benchmark activation checkpointing and offload modes on a mid-size Llama-shaped model.

For each mode, one full fine-tuning step (forward, backward, AdamW step) is measured for exact
live tensor bytes (device and host, counted by ``memprobe``: host bytes are what saved-tensor
pack hooks create and an offloading optimizer's copies; memtrain's offload ledgers are not read),
the activations saved by forward, the FLOPs recomputed in backward (``FlopCounterMode``), and the
median step time over a few steps run round-robin across modes (so that machine noise hits them
all alike). Writes docs/bench/memory_modes.md.

    python -m scripts run memory_modes            # the table in docs/
    python -m scripts run memory_modes --quick    # a tiny smoke run
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.config import OffloadConfig
from memtrain.patches import activation_offload as offload
from memtrain.patches import checkpointing
from memtrain.trainer.optimizer_offload import OffloadOptimizer
from scripts import harness
from scripts.probes.memprobe import LiveBytes, host_resident, resident

MiB = 2**20
QUICK = ["--quick"]


@dataclass
class Mode:
    """A benchmarked setting: checkpointing mode, activation offload, optimizer offload."""

    name: str
    checkpointing: Any = "none"
    activations: bool = False
    optimizer: bool = False
    layers: int | None = None  # None: the benchmark's depth
    results: dict[str, Any] = field(default_factory=dict)


def build(args: argparse.Namespace, layers: int) -> nn.Module:
    config = AutoConfig.for_model(
        "llama", hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        vocab_size=args.vocab, max_position_embeddings=args.seq, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def prepare(base: nn.Module, mode: Mode, min_bytes: int) -> nn.Module:
    model = checkpointing.apply(copy.deepcopy(base), mode.checkpointing)
    if mode.activations:
        offload.apply(model, OffloadConfig(activations=True, min_tensor_bytes=min_bytes))
    return model


def make_optimizer(model: nn.Module, mode: Mode) -> torch.optim.Optimizer:
    if mode.optimizer:
        return OffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    return loss.item()


def measure(model: nn.Module, opt: torch.optim.Optimizer, mode: Mode, ids: torch.Tensor) -> None:
    """Exact bytes and backward FLOPs of a steady-state step (optimizer state already exists),
    counted by memprobe alone: what the step finds (parameters, buffers, optimizer state; an
    offloading optimizer's copies are host bytes) and what it creates (host: what saved-tensor
    pack hooks make)."""
    held, host_held = resident(model, opt, {}), host_resident(model, opt)
    with LiveBytes() as tracker:
        loss = model(input_ids=ids, labels=ids).loss
        saved = tracker.device_current
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    mode.results.update(
        loss=loss.item(), peak=held + tracker.device_peak, saved=saved,
        host_peak=host_held + tracker.host_peak, ram_peak=held + host_held + tracker.peak)


def warm_up(model: nn.Module, opt: torch.optim.Optimizer, mode: Mode, ids: torch.Tensor) -> None:
    """A first step (creates the optimizer state), with its backward FLOPs counted.

    FLOPs are counted here, not in the measured step: ``FlopCounterMode`` around a backward
    with full checkpointing raises the memory peak it would measure.
    """
    loss = model(input_ids=ids, labels=ids).loss
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    opt.step()
    model.zero_grad(set_to_none=True)
    mode.results["backward_flops"] = flops.get_total_flops()


def run_modes(base: nn.Module, modes: list[Mode], ids: torch.Tensor, min_bytes: int,
              repeats: int) -> None:
    """Per mode a warm-up step (FLOPs counted) and a measured step (bytes); then timed steps,
    modes interleaved so that changes in machine load hit all of them alike."""
    runs = []
    for mode in modes:
        print(f"measuring {mode.name} ...", flush=True)
        model = prepare(base, mode, min_bytes)
        opt = make_optimizer(model, mode)
        warm_up(model, opt, mode, ids)  # the measured step is then a steady-state one
        measure(model, opt, mode, ids)
        runs.append((mode, model, opt))
    times = harness.rounds({i: (lambda model=model, opt=opt: train_step(model, opt, ids))
                            for i, (_, model, opt) in enumerate(runs)}, repeats)
    for i, (mode, _, _) in enumerate(runs):
        mode.results["times"] = times[i]


def table(modes: list[Mode], layers: int) -> list[str]:
    none = next(m for m in modes if m.name == "none").results
    full = next(m for m in modes if m.name == "full").results
    full_saving = none["saved"] - full["saved"]
    full_recompute = full["backward_flops"] - none["backward_flops"]
    base_time = harness.median(none["times"])
    rows = ["| mode | peak device | × none | saved activations (device) | × none | share of full's "
            "saving | host peak | device + host (this CPU's RAM) | × none | recompute (GFLOP) | "
            "share of full's recompute | step time (s, median) | × none |", "|" + "---|" * 13]
    for m in modes:
        r = m.results
        if "times" not in r:
            continue
        recompute = r["backward_flops"] - none["backward_flops"]
        median = harness.median(r["times"])
        rows.append(
            f"| {m.name} | {r['peak'] / MiB:,.0f} MiB | {r['peak'] / none['peak']:.2f} | "
            f"{r['saved'] / MiB:,.1f} MiB | {r['saved'] / none['saved']:.3f} | "
            f"{(none['saved'] - r['saved']) / full_saving:.0%} | {r['host_peak'] / MiB:,.0f} MiB | "
            f"{r['ram_peak'] / MiB:,.0f} MiB | {r['ram_peak'] / none['ram_peak']:.2f} | "
            f"{recompute / 1e9:,.1f} | {recompute / full_recompute:.0%} | {median:.2f} | "
            f"{harness.ratio(median, base_time):.2f} |")
    return rows


def depth_table(pairs: list[tuple[Mode, Mode]]) -> list[str]:
    rows = ["| mode | layers | saved activations (device) | peak device − parameters − "
            "gradients | host peak |", "|---|---|---|---|---|"]
    for pair in pairs:
        for m in pair:
            r = m.results
            rows.append(f"| {m.name} | {m.layers} | {r['saved'] / MiB:,.1f} MiB | "
                        f"{r['activation_peak'] / MiB:,.1f} MiB | "
                        f"{r['host_peak'] / MiB:,.0f} MiB |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-bytes", type=int, default=2**20)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the page to a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.heads = 2, 64, 172, 4
        args.vocab, args.seq, args.batch, args.repeats, args.min_bytes = 256, 64, 2, 1, 1024
    torch.set_num_threads(torch.get_num_threads())
    L = args.layers
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    modes = [Mode("none"), Mode("full", "full"), Mode(f"{L // 2} of {L} layers", L // 2),
             Mode("selective", "selective"), Mode("offload", activations=True),
             Mode("full + offload", "full", activations=True),
             Mode("optimizer offload", optimizer=True)]
    base = build(args, L)
    run_modes(base, modes, ids, args.min_bytes, args.repeats)
    del base
    pairs = depth_check(args, ids)
    lines = report(args, modes, pairs)
    print("\n".join(lines))
    harness.write("memory_modes", lines, trial=args.quick)


def depth_check(args: argparse.Namespace, ids: torch.Tensor) -> list[tuple[Mode, Mode]]:
    """Device activation memory at L and 2L layers: full checkpointing with and without offload.

    One forward and backward each (no optimizer): the peak minus the gradients is what the
    activations (saved and recomputed) need at most.
    """
    pairs = []
    for name, activations in (("full", False), ("full + offload", True)):
        pair = []
        for layers in (args.layers, 2 * args.layers):
            print(f"depth check: {name}, {layers} layers ...", flush=True)
            mode = Mode(name, "full", activations=activations, layers=layers)
            model = prepare(build(args, layers), mode, args.min_bytes)
            grads = sum(p.numel() * p.element_size() for p in model.parameters())
            with LiveBytes() as tracker:
                loss = model(input_ids=ids, labels=ids).loss
                saved = tracker.device_current
                loss.backward()
            mode.results.update(saved=saved, activation_peak=tracker.device_peak - grads,
                                host_peak=tracker.host_peak)
            pair.append(mode)
            del model
        pairs.append((pair[0], pair[1]))
    return pairs


def report(args: argparse.Namespace, modes: list[Mode], pairs: list[tuple[Mode, Mode]]) -> list[str]:
    none = modes[0].results
    losses = {m.name: m.results["loss"] for m in modes}
    same_loss = all(abs(v - none["loss"]) < 1e-5 for v in losses.values())
    lines = [
        *harness.header("Memory modes: checkpointing and offload"),
        "Generated by `scripts/bench/techniques/memory_modes.py`; do not edit by hand.", "",
        f"Model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.heads} heads, vocab {args.vocab}, SDPA attention, fp32, full "
        f"fine-tuning with AdamW. Micro-batch {args.batch} × {args.seq} tokens. Offload threshold "
        f"{args.min_bytes:,} bytes.", "",
        f"{torch.get_num_threads()} torch threads, CPU only (shared with other jobs).", "",
        "Memory figures are exact live tensor bytes of one steady-state training step on CPU, "
        "counted by `scripts/probes/memprobe.py` (no memtrain code; memtrain's offload ledgers are not "
        "read). *Device* is the tensors the step computes with; *host* is what saved-tensor pack "
        "hooks create and an offloading optimizer's copies of parameters, gradients and state. "
        "On this CPU-only machine both are the same RAM: *device + host* (both at their "
        "worst moment together) is what the machine holds, and offload lowers it nowhere; the "
        "device columns say what a GPU would hold, the host column what its host RAM would. "
        "Peak device includes parameters, buffers, "
        "gradients and AdamW state (on the host with optimizer offload). *Saved activations* "
        "are the device bytes forward leaves alive for backward. "
        "*Recompute* is backward FLOPs minus those of `none` (matmul and attention FLOPs, as "
        "`torch.utils.flop_counter.FlopCounterMode` counts them; element-wise work is not "
        "counted). "
        f"Step time: median of {args.repeats} steps after a warm-up and the measured step, "
        "modes interleaved." + (
            " With fewer than 3 timed steps per mode on a shared machine the step times are "
            "load noise, not a comparison; the memory figures are exact either way."
            if args.repeats < 3 else ""), "",
        *table(modes, args.layers), "",
        f"Loss of the measured step identical in every mode: {'yes' if same_loss else 'NO'} "
        f"({none['loss']:.6f}).", "",
        "## Checkpointing + offload as depth doubles", "",
        *depth_table(pairs), "",
        *_conclusions(modes, pairs), "",
    ]
    return lines


def _conclusions(modes: list[Mode], pairs: list[tuple[Mode, Mode]]) -> list[str]:
    r = {m.name: m.results for m in modes}
    none, full, sel = r["none"], r["full"], r["selective"]
    saving = (none["saved"] - sel["saved"]) / (none["saved"] - full["saved"])
    recompute = (sel["backward_flops"] - none["backward_flops"]) / (
        full["backward_flops"] - none["backward_flops"])
    off_ratio = harness.ratio(harness.median(r["offload"]["times"]), harness.median(none["times"]))
    off, off_opt = r["offload"], r["optimizer offload"]
    (_, _), (flat_l, flat_2l) = pairs
    return [
        "## Targets", "",
        f"- Selective: {saving:.0%} of full checkpointing's activation saving for {recompute:.0%} "
        f"of its recompute FLOPs (target: saving share ≥ 4 × recompute share): "
        f"{'met' if saving >= 4 * recompute else 'NOT met'}.",
        f"- Full checkpointing + offload, {flat_l.layers} → {flat_2l.layers} layers: saved device "
        f"activations {flat_l.results['saved'] / MiB:.1f} → "
        f"{flat_2l.results['saved'] / MiB:.1f} MiB "
        f"({'flat' if flat_2l.results['saved'] == flat_l.results['saved'] else 'not flat'}).",
        f"- What offload moves, and what it saves on this CPU: activation offload takes the "
        f"device peak from {none['peak'] / MiB:,.0f} to {off['peak'] / MiB:,.0f} MiB by holding "
        f"{off['host_peak'] / MiB:,.0f} MiB on the host; device + host together "
        f"{off['ram_peak'] / MiB:,.0f} MiB against {none['ram_peak'] / MiB:,.0f} without offload "
        f"(×{off['ram_peak'] / none['ram_peak']:.2f}); optimizer offload "
        f"{off_opt['ram_peak'] / MiB:,.0f} MiB (×{off_opt['ram_peak'] / none['ram_peak']:.2f}). "
        "A saving of RAM on a CPU-only machine is not shown here; the device figures are what a "
        "GPU would hold, measured as bytes moved, not as GPU memory.",
        f"- Activation offload's step-time overhead on this CPU: ×{off_ratio:.2f} (copies are "
        "synchronous here; on CUDA they run on a side stream from pinned buffers and overlap "
        "compute by design, with backward prefetching the next tensors).",
    ]


if __name__ == "__main__":
    main()
