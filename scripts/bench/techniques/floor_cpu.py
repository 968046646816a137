"""The floor techniques on this CPU: saving and cost of each, measured by an independent counter.

    python -m scripts run floor_cpu          # writes docs/bench/floor_cpu.md
    python -m scripts run floor_cpu --quick  # the third section only (short batch, ~2 s a row)

Two models: the `tiny-llama-shakespeare` recipe's model (vocabulary 30,522, full training, micro-
batch 16 x 128 tokens) and a Qwen-shaped tiny model with Qwen2's 151,936-token vocabulary (same
batch), then the tiny Llama at 1 x 32 tokens, where gradients and optimizer state set the peak.
Each technique is turned on by a recipe override; the run's real model, optimizer and a
worst-case batch are built the way `memtrain train` builds them, one warm-up step creates the
optimizer state, and the next step is measured:

- **measured peak**: live tensor bytes counted by ``scripts/probes/memprobe.py`` (a dispatch-mode storage
  counter that shares no code with ``memtrain.memory``): the bytes of every tensor the model,
  optimizer and batch hold before the step (unique storages of parameters, buffers, optimizer
  state and bitsandbytes quantization constants) plus the peak of the storages the step creates;
- **predicted**: ``memtrain.estimate`` of the same recipe (fake tensors, no weights);
- **step seconds**: the median of 3 timed steps after the measured one (1 thread), to weigh what
  each technique costs.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from scripts import harness

ROOT = harness.ROOT
QUICK = ["--sections", "3"]  # the short batch: its four rows take seconds, the other sections minutes

MIB = 2**20
RECIPE = ROOT / "recipes" / "tiny-llama-shakespeare.yaml"
QWEN_150K = ["model.from_config.model_type=qwen2", "model.from_config.vocab_size=151936"]
BASE = ["data.packing=false", "training.max_grad_norm=null"]
SETTINGS: list[tuple[str, list[str]]] = [
    ("full fine-tuning, standard loss", []),
    ("chunked loss", ["memory.loss=chunked"]),
    ("optimizer in backward", ["training.optimizer_in_backward=true"]),
    ("chunked loss + optimizer in backward", ["memory.loss=chunked", "training.optimizer_in_backward=true"]),
    ("QLoRA (nf4, bf16), peft's fp32 upcast", ["adapter.method=lora", "model.quantization=nf4",
                                               "model.dtype=bf16", "memory.lean_kbit=false"]),
    ("QLoRA (nf4, bf16), lean loading", ["adapter.method=lora", "model.quantization=nf4",
                                         "model.dtype=bf16", "memory.lean_kbit=true"]),
]


# The step inside backward frees each gradient as it is made, which lowers the peak only where
# gradients and optimizer state set it: at 16 x 128 tokens the peak is in the backward pass before
# any gradient is complete. A short batch shows its effect.
SHORT = ["data.max_length=32", "training.micro_batch_size=1", "training.gradient_accumulation=1"]
SECTIONS: list[tuple[str, list[str], list[tuple[str, list[str]]]]] = [
    ("tiny Llama (vocabulary 30,522), micro-batch 16 x 128 tokens", [], SETTINGS),
    ("Qwen-shaped, vocabulary 151,936, micro-batch 16 x 128 tokens", QWEN_150K, SETTINGS),
    ("tiny Llama, micro-batch 1 x 32 tokens (gradients set the peak)", SHORT, SETTINGS[:4]),
]


def measure(overrides: list[str]) -> dict[str, float]:
    import torch

    from memtrain.config import load_recipe
    from memtrain.estimator.estimate import estimate
    from memtrain.estimator.real_step import warm_recipe_step
    from memtrain.estimator.setup import resolve_config
    from scripts.probes.memprobe import LiveBytes, resident

    cfg = load_recipe(RECIPE, [*BASE, *overrides])
    config, _ = resolve_config(cfg.model)
    torch.manual_seed(0)
    with warm_recipe_step(cfg, config) as (step, model, optimizer, batch):
        before = resident(model, optimizer, batch)
        with LiveBytes() as probe:
            probe.reset_peak()
            step()
        measured = before + probe.device_peak
        times = harness.rounds({"step": step}, 3, say=False)["step"]
    predicted = estimate(copy.deepcopy(cfg), device="cpu").peak_bytes
    return {"measured": measured / MIB, "predicted": predicted / MIB, "seconds": harness.median(times)}


def _bf16_support() -> str:
    """Whether this CPU multiplies bf16 natively: the lean k-bit rows compute in bf16."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "bf16 support unknown"
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"native bf16: {', '.join(native)}" if native else "no native bf16 (no avx512_bf16, amx_bf16)"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sections", type=int, nargs="+", choices=range(1, len(SECTIONS) + 1), default=None,
                        help="only these sections, numbered as on the page (default: all); a part of "
                        "the page goes to a temporary folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from memtrain.memory import hostmem

    hostmem.keep_freed_pages()  # as `memtrain train` on a CPU
    lines = [*harness.header("The floor techniques on a CPU: measured saving and cost"),
             f"{args.threads} intra-op thread(s); this CPU: {_bf16_support()}. "
             "Measured: exact live tensor bytes on CPU from `scripts/probes/memprobe.py` (independent of "
             "memtrain's meter). Predicted: `memtrain.estimate` (`--device cpu`). "
             f"Recipe `{RECIPE.relative_to(ROOT)}` with `{' '.join(BASE)}`. "
             "Step seconds are the median of 3 steps on 1 thread: the cost of each technique on "
             "this CPU, noisy when the machine is shared.", ""]
    for number, (model_label, extra, settings) in enumerate(SECTIONS, 1):
        if args.sections and number not in args.sections:
            continue
        lines += [f"## {model_label}", "",
                  "| setting | measured peak | predicted | predicted − measured | vs first row | step s |",
                  "|---|---|---|---|---|---|"]
        first = None
        for label, overrides in settings:
            row = measure([*extra, *overrides])
            first = first or row
            lines.append(f"| {label} | {row['measured']:.1f} MiB | {row['predicted']:.1f} MiB | "
                         f"{row['predicted'] - row['measured']:+.2f} MiB | "
                         f"{harness.times(row['measured'], first['measured'])} | {row['seconds']:.3f} |")
            print(lines[-1], flush=True)
        lines.append("")
    harness.write("floor_cpu", lines, trial=bool(args.sections))


if __name__ == "__main__":
    main()
