"""Benchmark embedding offload (``memory.offload.embeddings``): what it moves off the device, what it costs.

Measured (CPU): a Llama-shaped model with LoRA on every linear layer of its blocks (peft; the
embedding table frozen, as LoRA and QLoRA leave it) trains steps (forward, backward, AdamW) on one
row, plain and with the table offloaded (``memtrain.patches.embedding_offload.apply``). The live
tensor bytes of a steady-state step are counted by ``memprobe.LiveBytes`` plus the resident tensors
(no memtrain code); on a CPU the "host" table is in the same RAM, so the device's share is that
count less the table's bytes, sized from its shape here. Step time: the median over rounds that
interleave the two (machine noise hits both alike), on one intra-op thread (see
scripts/bench/techniques/lean_norm.py for why on this shared 2-core machine).

Planned (no GPU here): ``memtrain estimate --device cuda`` of Llama-3.1-8B QLoRA r32 batch 1 at a
few lengths, with the long-context bench's settings, without and with the offload (alone, with
the optimizer's state offloaded, with the optimizer step in backward), against an 8 GiB GPU's
usable 7.2 GiB (10% margin).
Writes docs/bench/embedding_offload.md.

    python -m scripts run embedding_offload
    python -m scripts run embedding_offload --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate
from memtrain.patches import embedding_offload
from scripts import harness
from scripts.probes.memprobe import LiveBytes, resident
from scripts.probes.steps import llama, step

MiB, GiB = 2**20, 2**30
QUICK = ["--quick"]
RECIPE = "recipes/llama-3.1-8b-qlora.yaml"
LONG_CONTEXT = ["adapter.r=32", "adapter.alpha=32", "training.micro_batch_size=1",
                "training.effective_batch_size=1", "training.gradient_accumulation=1",
                "memory.checkpointing=full", "memory.loss=chunked", "memory.offload.activations=true",
                "memory.tiled_mlp=true", "memory.lean_norm=true", "memory.host_budget=256GiB"]
# Each variant at the lengths around its longest fit (found by hand with `memtrain estimate`; the
# chunked loss's power-of-two chunks make the fit non-monotonic in the length, see long_context.md).
VARIANTS = {"as the long-context bench": ([], [3072]),
            "+ embedding offload": (["memory.offload.embeddings=true"],
                                    [3072, 3584, 3840, 4096, 5632, 5888, 6144]),
            "+ embedding offload, AdamW state offloaded": ([
                "memory.offload.embeddings=true", "training.optimizer=adamw",
                "memory.offload.optimizer=true"], [3072, 6656, 6912]),
            "+ embedding offload, optimizer step in backward, no clipping": ([
                "memory.offload.embeddings=true", "training.optimizer_in_backward=true",
                "training.max_grad_norm=null"], [7680, 7936]),
            # ALST's tile rule gives one tile up to 4,096 tokens (ceil(tokens / hidden)): the whole
            # 14,336-wide intermediate; 32 tiles keep it small at every length
            "+ embedding offload, `memory.tiled_mlp_tiles=32`": ([
                "memory.offload.embeddings=true", "memory.tiled_mlp_tiles=32"], [4096, 8192, 11776, 12032])}
USABLE_8GIB = int(8 * GiB * 0.9)


def build(args: argparse.Namespace) -> nn.Module:
    model = llama(args.hidden, args.hidden * 7 // 2, args.layers, 8, args.vocab, args.seq,
                  tie_word_embeddings=False)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=targets)).train()


def measure(args: argparse.Namespace, ids: torch.Tensor) -> dict[str, dict[str, Any]]:
    base = build(args)
    runs = {}
    for name in ("plain", "offloaded"):
        model = copy.deepcopy(base)
        if name == "offloaded":
            embedding_offload.apply(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        step(model, opt, ids)  # optimizer state exists from here on
        before = resident(model, opt, {"input_ids": ids})
        with LiveBytes() as probe:
            step(model, opt, ids)
        table = model.get_input_embeddings().weight
        runs[name] = {"model": model, "opt": opt, "all": before + probe.peak,
                      "host": table.numel() * table.element_size() if name == "offloaded" else 0,
                      "times": []}
    return runs


def planned(quick: bool) -> list[str]:
    lines = ["| settings | tokens | parameters | total on cuda | fits 7.2 GiB | host |",
             "|---|---:|---:|---:|:---:|---:|"]
    for label, (extra, lengths) in VARIANTS.items():
        for length in lengths[:1] if quick else lengths:
            est = estimate(load_recipe(RECIPE, [*LONG_CONTEXT, *extra, f"data.max_length={length}"]),
                           device="cuda")
            fits = "yes" if est.total_bytes <= USABLE_8GIB else "no"
            lines.append(f"| {label} | {length:,} | {est.by_category['parameters'] / GiB:.2f} GiB | "
                         f"{est.total_bytes / GiB:.3f} GiB | {fits} | {est.host_peak_bytes / GiB:.2f} GiB |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.vocab, args.seq, args.rounds = 64, 2, 512, 64, 2
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(0))
    runs = measure(args, ids)
    times = harness.rounds({name: (lambda run=run: step(run["model"], run["opt"], ids))
                            for name, run in runs.items()}, args.rounds, say=False)
    for name, run in runs.items():
        run["times"] = times[name]
    plain_time = harness.median(runs["plain"]["times"])
    lines = [
        *harness.header("Embedding offload (`memory.offload.embeddings`): memory and step time"),
        f"Measured: Llama-shaped, {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab:,}, "
        "untied; LoRA r16 on every linear layer of the blocks (peft), fp32, AdamW, one row of "
        f"{args.seq} tokens. Bytes: exact live tensor bytes of a steady-state step on CPU "
        "(`scripts/probes/memprobe.py`: the step's peak plus the resident parameters and optimizer state); "
        "on a CPU host and device are the same RAM, so the device's share is the count less the "
        "table's bytes (its shape × 4). Step time: median of "
        f"{args.rounds} interleaved rounds, {args.threads} thread(s).", "",
        "| setting | live bytes, all (MiB) | of which the host table (MiB) | device (MiB) "
        "| median step (s) | step ×plain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        median = harness.median(run["times"])
        lines.append(f"| {name} | {run['all'] / MiB:.1f} | {run['host'] / MiB:.1f} | "
                     f"{(run['all'] - run['host']) / MiB:.1f} | {median:.3f} | "
                     f"{harness.ratio(median, plain_time):.2f} |")
    print("\n".join(lines), flush=True)
    lines += ["", "Planned for a GPU (`memtrain estimate --device cuda`; no GPU measured it): "
              f"`{RECIPE}` with {', '.join(f'`{s}`' for s in LONG_CONTEXT)}; 8 GiB GPU: 7.2 GiB usable.", ""]
    lines += planned(args.quick)
    print("\n".join(lines))
    harness.write("embedding_offload", lines, trial=args.quick)


if __name__ == "__main__":
    main()
