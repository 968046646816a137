"""What smaller tiled-MLP tiles cost in step time on a 4-bit (QLoRA) model, measured and predicted.

    python -m scripts run tile_cost            # writes docs/bench/tile_cost.md
    python -m scripts run tile_cost --quick    # a tiny smoke run (its page to a temporary folder)

``memory.tiled_mlp_tile_tokens: auto`` (issue 27) lets the planner shrink the MLP's tiles to
``hidden_size / 4`` or ``/ 16`` tokens when only they fit; each tile dequantizes the 4-bit MLP
weights again in forward, recompute and backward, which the cost model charges
(:func:`memtrain.patches.tiled_mlp.tiled_dequantized`). This measures that cost on this CPU: a
Llama-shaped QLoRA model (nf4 base, LoRA r 8, full checkpointing, chunked loss, the tiled MLP)
built as ``memtrain train`` builds it, trained one row at each tile size, median step time over
interleaved rounds (one intra-op thread; see scripts/bench/techniques/lean_norm.py), beside the step time the
planner's cost model predicts for the same settings with this machine's measured rates. Time only:
the memory side of the tile sizes is docs/bench/tile_size.md and tests/patches/test_tiled_mlp.py.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from memtrain.config import load_recipe
from memtrain.model import build_config
from memtrain.plan.search import Search
from memtrain.plan.space import Candidate, with_values
from memtrain.trainer.build import build_model, build_optimizer, example_batch, step_settings
from memtrain.trainer.step import training_step
from scripts import harness
from scripts.probes.steps import llama_recipe

QUICK = ["--quick"]
TILE = "memory.tiled_mlp_tile_tokens"
SHAPE = {"hidden": 512, "intermediate": 1792, "layers": 2, "heads": 8, "vocab": 4096, "seq": 2048}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (page to a temp folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = dict(SHAPE)
    if args.quick:
        shape.update(hidden=64, intermediate=224, heads=4, seq=256)
        args.rounds = 1
    start = time.perf_counter()
    memory = {"loss": "chunked", "checkpointing": "full", "tiled_mlp": True, "tiled_mlp_tile_tokens": "auto"}
    auto = load_recipe(llama_recipe(shape, {"quantization": "nf4"}, memory))
    sizes = [None, shape["hidden"] // 4, shape["hidden"] // 16]
    search = Search(auto, "cpu", 2**40, fields=[TILE])
    runs: dict[Any, dict[str, Any]] = {}
    for size in sizes:
        cfg = with_values(auto, {TILE: size})
        config = build_config(cfg.model)
        settings = step_settings(cfg)
        torch.manual_seed(0)
        model = build_model(cfg, None, config.pad_token_id).train()
        optimizer = build_optimizer(cfg, model)
        batch = example_batch(cfg, config, 1, shape["seq"], "cpu", padded=False)
        cand = Candidate({TILE: size})
        search.evaluate(cand)

        def step(model: Any = model, optimizer: Any = optimizer, batch: Any = batch,
                 settings: dict = settings) -> None:
            training_step(model, batch, optimizer, settings["accumulation"], settings["max_grad_norm"])

        step()  # the optimizer state exists from here on
        runs[size] = {"step": step, "predicted": cand.seconds, "parts": cand.parts}
    times = harness.rounds({size: run["step"] for size, run in runs.items()}, args.rounds)
    for size, run in runs.items():
        run["times"] = times[size]
    base = runs[None]
    measured0, predicted0 = harness.median(base["times"]), base["predicted"]
    lines = [*harness.header("What smaller MLP tiles cost in step time on a 4-bit model (issue 27)"),
             f"One intra-op thread, {args.rounds} interleaved rounds.", "",
             f"Llama-shaped, hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
             f"{shape['layers']} layers, vocabulary {shape['vocab']:,}; nf4 base (bitsandbytes), fp32 "
             f"compute, LoRA r 8, full checkpointing, chunked loss, tiled MLP; one row of {shape['seq']:,} "
             "tokens. Measured: median step of memtrain's own training step on the model `memtrain "
             "train` builds. Predicted: the planner's cost model for the same settings with this "
             "machine's measured rates (its dequantization part: each tile dequantizes the MLP's 4-bit "
             "weights in forward, recompute and backward).", "",
             "| tokens per tile | tiles | measured step (s) | x hidden_size tiles | predicted step (s) | "
             "x hidden_size tiles | predicted dequantization (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for size, run in runs.items():
        tokens = size or shape["hidden"]
        median = harness.median(run["times"])
        label = f"{tokens:,}{' (hidden_size)' if size is None else ''}"
        lines.append(f"| {label} | {-(-shape['seq'] // tokens)} | "
                     f"{median:.3f} | {harness.ratio(median, measured0):.2f} | {run['predicted']:.3f} | "
                     f"{harness.ratio(run['predicted'], predicted0):.2f} | "
                     f"{run['parts'].get('dequantize', 0.0):.3f} |")
    lines += ["", f"{time.perf_counter() - start:.0f} s. The planner ranks settings by these ratios; its "
              "absolute seconds come from rates `memtrain calibrate` measured with every core, while "
              "these steps run on one thread. On a CPU bitsandbytes dequantizes on the CPU and the "
              "matmuls are slow, so the ratios are not a GPU's, where the matmuls are far faster and "
              "the dequantization's share larger. No GPU has measured it yet."]
    print("\n".join(lines))
    harness.write("tile_cost", lines, trial=args.quick)


if __name__ == "__main__":
    main()
