"""Per-process memory with FSDP2: 1 process vs. 2, measured and estimated.

    python scripts/bench_fsdp.py            # writes docs/bench/fsdp.md

Trains the shipped ``tiny-llama-shakespeare`` recipe (tied embeddings) and a variant with
separate input/output embeddings, in full and with LoRA, for a few steps with 1 and with 2
processes (CPU, gloo), the same micro-batch per process. Reports the measured step with the
highest peak of rank 0 (exact live-tensor bytes on CPU) and the per-process estimate of
:func:`memtrain.distributed.estimate_process_step` (fake process group, no weights).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

import accelerate
import torch
import transformers
from transformers import AutoModelForCausalLM

from memtrain import distributed, patches
from memtrain.config import load_recipe
from memtrain.model import build_config
from memtrain.runner import train

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-llama-shakespeare.yaml"
OUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "fsdp.md"
MICRO, SEQ, STEPS = 8, 128, 3
COLUMNS = ("parameters", "gradients", "optimizer_state", "unsharded")


def config(tmp: str, adapter: str, tied: bool, processes: int) -> object:
    return load_recipe(RECIPE, [
        f"adapter.method={adapter}", f"model.from_config.tie_word_embeddings={str(tied).lower()}",
        f"distributed.processes={processes}", f"training.micro_batch_size={MICRO}",
        f"training.max_steps={STEPS}", "training.logging_steps=1", "data.max_examples=2000",
        "data.eval_split=0", "output.save_model=false", "output.report=false",
        f"output.dir={tmp}/{adapter}-{tied}-{processes}"])


def estimate(cfg: object) -> int:
    def build() -> torch.nn.Module:
        return patches.apply_patches(AutoModelForCausalLM.from_config(build_config(cfg.model)), cfg)

    shapes = {"input_ids": (MICRO, SEQ), "labels": (MICRO, SEQ)}
    return distributed.estimate_process_step(build, cfg, shapes).peak_bytes


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for adapter in ("full", "lora"):
            for tied in (True, False):
                for processes in (1, 2):
                    cfg = config(tmp, adapter, tied, processes)
                    result = train(cfg)
                    measured = result.process_memory[0] if result.process_memory else result.memory
                    predicted = estimate(cfg) if processes > 1 else None
                    rows.append((adapter, tied, processes, measured, predicted))
    lines = [
        "# FSDP2: per-process memory, 1 vs. 2 processes",
        "",
        f"Command: `python scripts/bench_fsdp.py` (recipe `recipes/{RECIPE.name}`, {STEPS} steps, "
        f"micro-batch {MICRO} × {SEQ} tokens per process).",
        f"Versions: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, Python {platform.python_version()}.",
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores shared by the processes, gloo.",
        "",
        "MiB of rank 0 at the step with the highest peak; exact live-tensor bytes (CPU). "
        "`parameters`, `gradients`, `unsharded`: highest during the step; `optimizer_state`: at the peak. "
        "`unsharded` = full weights/gradients FSDP gathers for the layers being computed.",
        "",
        "| adapter | embeddings | processes | peak | " + " | ".join(COLUMNS) + " | estimate | error |",
        "|---|---|---:|---:|" + "---:|" * len(COLUMNS) + "---:|---:|",
    ]
    for adapter, tied, processes, m, predicted in rows:
        values = [m.max_by_category[c] if c != "optimizer_state" else m.peak_by_category[c] for c in COLUMNS]
        est = mib(predicted) if predicted else "–"
        err = f"{(predicted - m.peak_bytes) / m.peak_bytes:+.2%}" if predicted else "–"
        lines.append(f"| {adapter} | {'tied' if tied else 'separate'} | {processes} | {mib(m.peak_bytes)} | "
                     + " | ".join(mib(v) for v in values) + f" | {est} | {err} |")
    lines += [
        "",
        "Reading it: parameters, gradients and optimizer state halve exactly (AdamW's per-tensor "
        "`step` scalars aside), and the estimate traces the same sharding under a fake process group. "
        "The peak hardly moves on this model because its peak is the logits of a 30,522-token "
        "vocabulary, which sharding does not touch, while FSDP adds `unsharded`: the full weights "
        "(and gradients) of the unit being computed, here the 15 MiB embedding (all-gather buffer "
        "and copy). With LoRA on a model this small, that copy costs more than sharding saves. "
        "Sharding pays off when weights, gradients and optimizer state outweigh one layer's full "
        "weights plus the activations, as in multi-billion-parameter models.",
    ]
    table = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(table, encoding="utf-8")
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
