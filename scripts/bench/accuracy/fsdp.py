"""Per-process memory with several processes: predicted (``memtrain.estimate``) vs measured.

    python -m scripts run fsdp            # writes docs/bench/fsdp.md (about 9 minutes on 2 cores)
    python -m scripts run fsdp --quick    # 2 processes only, fp32 and QLoRA: a smoke run, its page not kept

For full fine-tuning, LoRA and QLoRA, in fp32 and bf16 (QLoRA: bf16 only, its 4-bit weights
compute in bf16), at 1, 2 and 4 processes and every ``distributed.sharding`` (``none``: DDP
replicas; ``grad_op``; ``full``; ``full`` with ``memory.offload.parameters``), a tiny Llama from a
config (hidden 128, 2 layers, untied 30,522-token embeddings) trains for 2 steps with real
processes (CPU, gloo; `memtrain.run.train.train`, as a `memtrain train` worker runs it).

- **measured**: every process counts its live tensor bytes with ``scripts/probes/fsdp.py``, a
  dispatch-mode storage counter that shares no code with ``memtrain.memory`` (it follows storage
  resizes, which FSDP2 uses to free gathered weights, and counts from before the model is built,
  so weights, optimizer state and DDP's buckets are in it); the peak of the second step (the first
  creates the optimizer state), the largest over the processes;
- **predicted**: ``memtrain.estimate`` of the same recipe: one process traced on fake tensors, in
  a fake process group when sharded (``total_bytes``: on a CPU nothing is added to the tensors).

Every micro-batch row is full and holds two examples of ``data.max_length / 2`` tokens (token ids
given as they are, ``data.packing``): the layout the estimate traces for a packed recipe
(:func:`memtrain.trainer.build.example_batch`), so the estimate's worst case is the run itself. The
two examples of a row attend only within themselves (transformers' block-diagonal mask, with the
grouped-query keys and values repeated for every head): the masked attention path, which real
batches with padding or packing take, and full rows of one example each would not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts import harness

ROOT = harness.ROOT
QUICK = ["--quick"]  # the script's own: 2 processes, fp32 full and QLoRA only

OUT = ROOT / "docs" / "bench" / "fsdp.md"
RECIPE = ROOT / "recipes" / "tiny-llama-shakespeare.yaml"
MICRO, SEQ, STEPS = 2, 64, 2
MODEL = ["model.from_config.hidden_size=128", "model.from_config.num_hidden_layers=2",
         "model.from_config.tie_word_embeddings=false"]
METHODS: list[tuple[str, str, list[str]]] = [  # (adapter, dtype, overrides)
    ("full", "fp32", []), ("full", "bf16", ["model.dtype=bf16"]),
    ("lora", "fp32", ["adapter.method=lora"]), ("lora", "bf16", ["adapter.method=lora", "model.dtype=bf16"]),
    ("qlora", "bf16", ["adapter.method=lora", "model.quantization=nf4", "model.dtype=bf16"]),
]
SHARDINGS: dict[str, list[str]] = {
    "none": ["distributed.sharding=none"], "grad_op": ["distributed.sharding=grad_op"],
    "full": ["distributed.sharding=full"],
    "full+offload": ["distributed.sharding=full", "memory.offload.parameters=true"],
}
READING = """\
Reading it:

- `none` (DDP) is one replica plus DDP's gradient buckets: with `gradient_as_bucket_view=False`
  (accelerate's default, kept by the Trainer) DDP copies every trained gradient into flat buckets
  it all-reduces, allocated when the model is wrapped and held for the run. Full fine-tuning pays
  one more copy of the gradients (fp32: {replica} MiB per process against {single} MiB for one
  process); LoRA a copy of the adapters' gradients only. The same at 2 and 4 processes.
- `full` divides parameters, gradients and optimizer state by the processes and adds the full
  weights (and, in backward, full gradients) of the unit being computed; here the units are the
  2 layers and the two 30,522 × 128 embeddings, so an embedding's gathered copy is a large part of
  what is left.
- `grad_op` keeps each unit's gathered weights from its forward to its backward, so at the end of
  the forward a process holds the whole model's weights. With LoRA and QLoRA almost all weights
  are frozen, sharding saves little gradient and optimizer state, and `grad_op` holds more than a
  replica; the planner therefore never assumes `grad_op` is smaller than `none`.
- `full+offload` (`memory.offload.parameters`, FSDP2's CPU offload) measures the same as `full`:
  on a CPU the host is the same memory, and the shards are not copied.
- With gradient accumulation (1 × 2), the first micro-batch does not reduce-scatter (accelerate's
  `no_sync`): each FSDP2 process holds the whole model's gradients, unsharded, until the last
  micro-batch; the estimate traces both micro-batches.
- Where the processes of a run differ (4 processes, full fine-tuning): the 30,522 embedding rows
  do not divide by 4, and FSDP2 gives the last process 2 rows fewer of each embedding (its peak is
  4 KiB lower in fp32). The estimate traces rank 0, whose shards are the largest.
- Not in either column: what gloo allocates outside PyTorch tensors.
"""


def corpus(folder: Path) -> Path:
    """Examples of exactly ``SEQ / 2`` token ids: packed, every training row holds two, none padded."""
    path = folder / "halves.jsonl"
    rows = [{"input_ids": [1000 + (i * 7 + j) % 5000 for j in range(SEQ // 2)]} for i in range(128)]
    with path.open("w", encoding="utf-8") as file:  # training data in a temporary folder, not a page
        file.write("\n".join(json.dumps(r) for r in rows))
    return path


Row = tuple[str, str, int, str, int]  # adapter, dtype, processes, sharding, gradient accumulation


def rows(quick: bool) -> list[Row]:
    """Every row: each method at 1 process, then at 2 and 4 with each sharding; then full fp32
    with gradient accumulation (the same examples per process, as 2 micro-batches of 1)."""
    methods = [m for m in METHODS if not quick or m[:2] in (("full", "fp32"), ("qlora", "bf16"))]
    out: list[Row] = []
    for adapter, dtype, _ in methods:
        for processes in ((2,) if quick else (1, 2, 4)):
            names = ["none"] if processes == 1 else [
                s for s in SHARDINGS if s != "full+offload" or processes == 2]
            out += [(adapter, dtype, processes, s, 1) for s in names]
    return out + [("full", "fp32", 2, s, 2) for s in ("none", "grad_op", "full")]


def recipe(folder: Path, data: Path, row: Row) -> Any:
    from memtrain.config import load_recipe

    adapter, dtype, processes, sharding, accumulation = row
    method = next(o for a, d, o in METHODS if (a, d) == (adapter, dtype))
    return load_recipe(RECIPE, [
        *MODEL, *method, *SHARDINGS[sharding], f"distributed.processes={processes}",
        f"data.source={data}", "data.format=tokenized", "data.packing=true", f"data.max_length={SEQ}",
        "data.max_examples=128",
        "data.eval_split=0", f"training.micro_batch_size={MICRO // accumulation}",
        f"training.gradient_accumulation={accumulation}",
        f"training.max_steps={STEPS}", "training.logging_steps=100", "output.save_model=false",
        "output.report=false", "output.overwrite=true",
        f"output.dir={folder}/{adapter}-{dtype}-{processes}-{sharding}-{accumulation}"])


def measure(folder: Path, data: Path, table: list[Row]) -> dict[Row, list[int]]:
    """Per row and process: the peak of the steps after the first."""
    from memtrain.config import dump_recipe
    from scripts.probes import fsdp as _fsdp_probe

    out = {}
    for processes in sorted({r[2] for r in table}):
        group = [r for r in table if r[2] == processes]
        start = time.perf_counter()
        peaks = _fsdp_probe.launch(processes, [dump_recipe(recipe(folder, data, r)) for r in group])
        took = time.perf_counter() - start
        print(f"{processes} processes: {len(group)} runs in {took:.0f} s", file=sys.stderr)
        for row, by_rank in zip(group, peaks, strict=True):
            out[row] = [max(steps[1:]) for steps in by_rank]
            print(f"{row}: peak by process {out[row]}", file=sys.stderr)
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def render(table: list[Row], measured: dict[Row, list[int]], predicted: dict[Row, int],
           seconds: float) -> list[str]:
    lines = [
        *harness.header("Several processes: predicted vs measured per-process peak"),
        f"{seconds / 60:.0f} minutes on this machine, its cores shared by the processes (gloo); `--quick` "
        "for a smoke run.",
        "",
        f"Model: tiny Llama from a config (hidden 128, 2 layers, untied 30,522-token embeddings; "
        f"`recipes/{RECIPE.name}` with overrides), AdamW, micro-batch {MICRO} × {SEQ} tokens per "
        f"process, every row two packed examples of {SEQ // 2} token ids (full, no padding; transformers' "
        "block-diagonal attention mask). Measured: live tensor bytes (exact on CPU) counted in "
        "every process by `scripts/probes/fsdp.py` (independent of memtrain's meter), peak of the "
        "second optimizer step, the largest over the processes. Predicted: `memtrain.estimate` "
        "(fake tensors, one process in a fake process group).",
        "",
        "| adapter | dtype | processes | sharding | micro-batch × accumulation | measured MiB | "
        "predicted MiB | error |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for row in table:
        m, p = max(measured[row]), predicted[row]
        err = (p - m) / m
        worst = max(worst, abs(err))
        adapter, dtype, processes, sharding, accumulation = row
        lines.append(f"| {adapter} | {dtype} | {processes} | {sharding if processes > 1 else '–'} | "
                     f"{MICRO // accumulation} × {accumulation} | {mib(m)} | {mib(p)} | {err:+.3%} |")
    several = [r for r in table if r[2] > 1]
    same = sum(len(set(measured[r])) == 1 for r in several)
    lines += ["", f"Largest error: {worst:.3%} over {len(table)} rows (target: 2%). Every process of a "
              f"run measured the same peak in {same} of the {len(several)} runs with several processes.",
              "", READING.format(**_quoted(measured))]
    return lines


def _quoted(measured: dict[Row, list[int]]) -> dict[str, str]:
    """The measured figures the reading notes quote (a dash where the run was left out)."""
    rows = {"single": ("full", "fp32", 1, "none", 1), "replica": ("full", "fp32", 2, "none", 1)}
    return {key: mib(max(measured[row])) if row in measured else "–" for key, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true",
                        help="2 processes, fp32 full and QLoRA only; the page written to a temporary folder")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.quick:
        os.environ[harness.QUICK_ENV] = "1"  # a smoke run: harness.write keeps its page out of docs/bench
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from memtrain import estimate

    table = rows(args.quick)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        folder = Path(tmp)
        data = corpus(folder)
        predicted = {r: estimate(recipe(folder, data, r)).total_bytes for r in table}
        measured = measure(folder, data, table)
    lines = render(table, measured, predicted, time.perf_counter() - start)
    print("\n".join(lines))
    harness.write("fsdp", lines, out=args.out)


if __name__ == "__main__":
    main()
