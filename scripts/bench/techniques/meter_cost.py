"""What measuring a step costs: step time and peak memory with and without memtrain's meter.

The plugin's ``MemoryBudgetCallback`` and ``memtrain train`` wrap measured steps in
:class:`memtrain.memory.meter.MemoryMeter`, a dispatch mode that runs Python on every tensor
operation. This times the same training step (forward, backward, AdamW update; Llama shapes
built from config, fp32 on a CPU, bf16 on CUDA) bare and metered, best of ``--repeats`` after a
warm-up, and the step's peak as counted by the independent counter (scripts/probes/memprobe.py: the
meter's own bookkeeping, torch's ModTracker, keeps some tensors alive longer), and writes
docs/bench/meter_cost.md (or docs/bench/meter_cost_cuda.md on a GPU).

    python -m scripts run meter_cost            # the table in docs/
    python -m scripts run meter_cost --quick    # one shape (its page to a temporary folder)
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memtrain.device import compute_device, synchronize
from memtrain.memory.meter import MemoryMeter
from memtrain.trainer.step import training_step
from scripts import harness
from scripts.probes import memprobe

QUICK = ["--quick"]

# (name, hidden, layers, micro-batch, tokens): from a toy to a small model; the meter's cost is
# per operation, so it shrinks as each operation does more work
SHAPES = [("tiny 2x128", 128, 2, 4, 128), ("small 4x512", 512, 4, 4, 256), ("medium 8x1024", 1024, 8, 4, 512)]


def measure(hidden: int, layers: int, micro: int, tokens: int, metered: bool,
            repeats: int) -> tuple[float, int]:
    """Best step time over ``repeats`` and the peak bytes of one more step (independent counter)."""
    device = compute_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 128), vocab_size=32000)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (micro, tokens), device=device)
    batch = {"input_ids": ids, "labels": ids}

    def step() -> None:
        if metered:
            with MemoryMeter(model, optimizer, inputs=batch):
                training_step(model, batch, optimizer)
        else:
            training_step(model, batch, optimizer)

    training_step(model, batch, optimizer)  # warm-up: optimizer state, kernels
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    peak = memprobe.probe_step(step, model, optimizer, batch)["peak"] if device.type == "cpu" else 0
    return best, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one shape; the page goes to a temporary folder")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = compute_device()
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = ["| shape (hidden x layers, batch x tokens) | bare step s | metered step s | time cost "
            "| bare peak MiB | metered peak MiB | memory cost |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, hidden, layers, micro, tokens in shapes:
        bare, bare_peak = measure(hidden, layers, micro, tokens, False, args.repeats)
        metered, metered_peak = measure(hidden, layers, micro, tokens, True, args.repeats)
        memory = (f"{bare_peak / 2**20:.1f} | {metered_peak / 2**20:.1f} | "
                  f"{100 * (metered_peak / bare_peak - 1):+.1f}%") if bare_peak else "- | - | -"
        rows.append(f"| {name}, {micro} x {tokens} | {bare:.3f} | {metered:.3f} | "
                    f"{100 * (metered / bare - 1):+.0f}% | {memory} |")
        print(rows[-1], flush=True)
    lines = [
        *harness.header("What measuring a step costs"),
        f"Best of {args.repeats} steps after a warm-up, fp32 on CPU ({torch.get_num_threads()} threads), "
        "bf16 on CUDA; peaks by the independent "
        "counter (CPU only); timings mean something only on a quiet machine (the load average above, "
        "taken at the end).", "", *rows, "",
        "The plugin's `MemoryBudgetCallback(every=...)` measures the first two steps and then one step "
        "in `every`; its default follows from this table (docs/plugin.md).", ""]
    harness.write("meter_cost_cuda" if device.type == "cuda" else "meter_cost", lines, trial=args.quick)


if __name__ == "__main__":
    main()
