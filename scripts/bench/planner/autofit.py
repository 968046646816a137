"""Benchmark auto-fit micro-batch against ``TrainingArguments(auto_find_batch_size=True)``.

Two models (the pretrained MiniLM classifier with LoRA, as in ``recipes/quickstart.yaml``, and the
tiny Llama trained in full, as in ``recipes/tiny-llama-shakespeare.yaml``), each under the same 4
budgets: ``BUDGETS_MIB``, a fixed ladder of round sizes written in this file, not derived from
memtrain's estimate nor from an earlier run of this table, spanning from about what micro-batch 1
needs to above what 6 need (memprobe's counts of each micro-batch, the table at the end). Four
budgets, not more, to keep the run to minutes on 2 shared cores. The user's
effective batch is 12 examples; every batch holds ``data.max_length`` tokens per example (packed
text; classification texts longer than the limit), so every step is the worst case.

A CPU has no device limit to run out of, so the out-of-memory errors both methods react to come
from a simulated device: memtrain's ``memory.simulate_budget`` (torch's out-of-memory error when the
live tensor bytes memtrain's tracker counts exceed the budget), the same for both. It is the
environment, not the judge.

- **HF**: a plain ``transformers.Trainer`` with ``per_device_train_batch_size=12`` and
  ``auto_find_batch_size=True`` (accelerate's ``find_executable_batch_size``: on out-of-memory,
  restart the training loop with the batch × 0.9; accumulation stays 1).
- **memtrain**: ``training.micro_batch_size: auto`` as ``memtrain train`` runs it: prediction
  (:func:`memtrain.plan.autofit.predict`), one probe step (:func:`memtrain.plan.autofit.confirm`), then
  training with out-of-memory recovery; with margin 0 (what the default ``memory.margin: auto``
  gives a simulated budget alone: it counts the live tensor bytes the estimator predicts exactly)
  and with the 10% margin ``auto`` keeps against a real device's budget. Both are reported.
- **Judge** (``scripts/probes/memprobe.py``, no memtrain code in the count): every run of either method
  carries memprobe's ``trainer_steps``, which counts the live tensor bytes of each real Trainer
  step; the method's result *fits* when its step 2 (optimizer state exists) counted at most the
  budget. The same callback counts the rows the model's forward is handed in each optimizer step:
  the *effective batch* reported is that count, so the auto-fit invariant (12 rows a step) is
  checked on what trained, not on the settings. *Truth*, the largest micro-batch that divides 12
  (what keeps the effective batch exact) and fits, comes from real 2-step Trainer runs at each such
  micro-batch with accumulation min(12 / micro, 2) (which reaches the step's peak), no budget,
  counted by memprobe.

Both sides train 2 optimizer steps; the clock runs from the start of sizing (prediction, or the
Trainer's ``train()``) to the end of optimizer step 1. Model loading and data preparation are
outside the clock for both; memtrain's clock includes building its Trainer. Every memtrain run
traces its prediction afresh, as each ``memtrain train`` process does. The process keeps freed
memory for reuse (``memtrain.memory.hostmem``, as ``memtrain train`` on a CPU), which speeds both sides.
Writes docs/bench/autofit.md.

    python -m scripts run autofit           # the table in docs/
    python -m scripts run autofit --quick   # 1 model, 2 budgets
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

from memtrain.config import RunConfig, load_recipe
from memtrain.config.batch import valid_batches
from memtrain.data.prepare import PreparedData, prepare_data
from memtrain.errors import MemtrainError
from memtrain.memory import hostmem
from memtrain.model import load_tokenizer
from memtrain.plan import autofit
from memtrain.reliability.budget import SimulatedBudgetCallback
from memtrain.trainer.build import build_model
from memtrain.trainer.trainer import build_trainer, optimizer_arguments
from scripts.probes.memprobe import trainer_steps

ROOT = harness.ROOT
EFFECTIVE = 12
# Fixed budgets, the same for both models (see the module docstring); --quick takes 2.
BUDGETS_MIB = (100, 120, 140, 165)
MiB = 2**20


@dataclass
class Setup:
    name: str
    recipe: str  # the shipped recipe it starts from
    cfg: RunConfig  # micro_batch_size: auto, effective 12, 2 steps, no budget yet
    tokenizer: Any
    data: PreparedData


class Timer(TrainerCallback):
    """Clock to optimizer step 1; count training-loop starts (HF restarts after out-of-memory)."""

    def __init__(self, start: float) -> None:
        self.start, self.first_step_s, self.starts, self.micro_at_first = start, None, 0, None
        self.micro_at_end: int | None = None  # the batch the run finished with (HF: after restarts)
        self.starts_before_first = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.micro_at_end = state.train_batch_size
        if state.global_step == 1 and self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.start
            self.starts_before_first = self.starts
            self.micro_at_first = state.train_batch_size


class Judge(TrainerCallback):
    """memprobe's count of every optimizer step, and the rows the model's forward saw in it.

    Put first among the callbacks: when HF restarts its loop after an out-of-memory error, the
    counter of the step that raised is still open and must be left before the simulated budget
    re-enters (dispatch modes leave in the reverse order they entered)."""

    def __init__(self) -> None:
        self.counter = trainer_steps()
        self.rows: list[int] = []  # rows per optimizer step, of the last training loop
        self._seen = 0
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.counter.on_train_end(args, state, control)  # a step that raised: leave its count
        self.counter.steps.clear()
        self.rows, self._seen = [], 0
        if self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, positional: Any, named: Any) -> None:
        ids = named.get("input_ids", positional[0] if positional else None)
        if module.training and isinstance(ids, torch.Tensor):
            self._seen += ids.shape[0]

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.counter.on_step_begin(*args, **kwargs)

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.counter.on_step_end(*args, **kwargs)
        self.rows.append(self._seen)
        self._seen = 0

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self.counter.on_train_end(*args, **kwargs)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def step2(self) -> int:
        """Counted bytes of step 2 (device and host: on a CPU, the same RAM)."""
        return next(s["total_peak"] for s in self.counter.steps if s["step"] == 2)


class RestartingBudget(SimulatedBudgetCallback):
    """The simulated budget, re-entered when HF restarts its loop (the failed loop never ended)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
        super().on_train_begin(args, state, control, **kwargs)


def setups(tmp: Path, quick: bool) -> list[Setup]:
    text = tmp / "cls.csv"
    words = ["thou", "art", "more", "lovely", "and", "more", "temperate", "rough", "winds", "do",
             "shake", "the", "darling", "buds", "of", "may"]
    with text.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(2 * EFFECTIVE + 8):
            writer.writerow([" ".join(words[(i + k) % len(words)] for k in range(60)), i % 2])
    common = {"training": {"micro_batch_size": "auto", "gradient_accumulation": None,
                           "effective_batch_size": EFFECTIVE, "max_steps": 2, "logging_steps": 1,
                           "save_strategy": "no", "warmup": 0}}
    minilm = {"data": {"source": str(text), "format": "classification", "max_length": 24,
                       "eval_split": 0.0, "max_examples": None}, "output": {"report": False}, **common}
    llama = {"data": {"max_examples": 3000, "eval_split": 0.0, "max_length": 64},
             "output": {"report": False}, **common}
    out = []
    for name, recipe, extra in (("MiniLM + LoRA (classification)", "quickstart", minilm),
                                ("tiny Llama, full (causal LM)", "tiny-llama-shakespeare", llama)):
        overrides = [f"output.dir={tmp / recipe}"]
        raw = load_recipe(ROOT / "recipes" / f"{recipe}.yaml", overrides).model_dump(mode="json")
        cfg = load_recipe(_merge(raw, extra))
        tokenizer = load_tokenizer(cfg.model)
        out.append(Setup(name, recipe, cfg, tokenizer, prepare_data(cfg, tokenizer)))
        if quick:
            break
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def with_budget(cfg: RunConfig, limit: int, margin: float | str = "auto") -> RunConfig:
    memory = cfg.memory.model_copy(update={"simulate_budget": f"{limit}B", "margin": margin})
    return cfg.model_copy(update={"memory": memory})


def model_for(s: Setup) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(s.cfg, s.data.num_labels, s.tokenizer.pad_token_id, s.data.label_names)


def hf_args(s: Setup, out: Path, micro: int, accumulation: int, auto: bool) -> TrainingArguments:
    """What a user's own script would pass: the recipe's optimizer and schedule, 2 steps, on CPU."""
    t = s.cfg.training
    return TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        auto_find_batch_size=auto, max_steps=2, **optimizer_arguments(s.cfg),
        lr_scheduler_type=t.lr_scheduler,
        max_grad_norm=t.max_grad_norm or 0.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, seed=t.seed, remove_unused_columns=False, label_names=["labels"], disable_tqdm=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0)


def counted_peak(s: Setup, tmp: Path, micro: int, accumulation: int) -> int:
    """Truth: memprobe's count of step 2 of a real 2-step run at this fixed micro-batch, no budget."""
    model = model_for(s)
    args = hf_args(s, tmp / "truth", micro, accumulation, auto=False)
    judge = Judge()
    trainer = Trainer(model=model, args=args, train_dataset=s.data.train, data_collator=s.data.collator,
                      callbacks=[judge])
    try:
        trainer.train()
        return judge.step2()
    finally:
        del trainer, model
        gc.collect()


def largest(fits: Any, sizes: list[int]) -> int:
    """Largest size for which fits(size) holds, by binary search (fits is monotone)."""
    lo, hi, best = 0, len(sizes) - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


def run_hf(s: Setup, tmp: Path, limit: int) -> dict[str, Any]:
    model = model_for(s)
    args = hf_args(s, tmp / "hf", EFFECTIVE, 1, auto=True)
    budget = RestartingBudget(limit)
    judge = Judge()
    start = time.perf_counter()
    timer = Timer(start)
    trainer = Trainer(model=model, args=args, train_dataset=s.data.train, data_collator=s.data.collator,
                      callbacks=[judge, budget, timer])
    try:
        trainer.train()
    except RuntimeError as err:  # accelerate gives up: "No executable batch size found, reached zero."
        if "batch size" not in str(err):
            raise
        judge.on_train_end(None, None, None)
        return {"failed": timer.starts, "later": 0, "seconds": time.perf_counter() - start, "micro": 0,
                "micro_step1": 0, "effective": 0, "counted": None}
    finally:
        budget.close()
    micro = timer.micro_at_end
    return {"failed": timer.starts_before_first - 1, "later": timer.starts - timer.starts_before_first,
            "seconds": timer.first_step_s, "micro": micro, "micro_step1": timer.micro_at_first,
            "effective": _effective(judge), "counted": judge.step2()}


def _effective(judge: Judge) -> int | str:
    """Rows a step, as counted at the model's forward; every step of the last loop must agree."""
    return judge.rows[0] if len(set(judge.rows)) == 1 else "/".join(map(str, judge.rows))


def run_memtrain(s: Setup, tmp: Path, limit: int, margin: float | str) -> dict[str, Any]:
    cfg = with_budget(s.cfg, limit, margin)
    model = model_for(s)
    choices = valid_batches(cfg.training, cfg.distributed.processes)
    budget = SimulatedBudgetCallback(limit)
    judge = Judge()
    rows = s.data.rows(cfg)  # as `memtrain train` does: the longest batch of the data at hand
    start = time.perf_counter()
    timer = Timer(start)
    try:
        planned, batch, _ = autofit.predict(cfg, rows=rows)
    except MemtrainError:  # nothing fits the budget minus the margin: memtrain refuses, with numbers
        return {"failed": 0, "later": 0, "seconds": time.perf_counter() - start, "micro": 0,
                "predicted": 0, "effective": EFFECTIVE, "refused": True, "counted": None}
    trainer = build_trainer(planned, model, s.tokenizer, s.data, batch, str(tmp / "mt"),
                            [judge, budget, timer])
    trainer.args.train_sampling_strategy = "sequential"
    trainer.args.disable_tqdm = True
    probe = autofit.confirm(trainer, planned, batch, choices=choices, rows=rows)
    try:
        trainer.train()
    finally:
        budget.close()
    recovered = trainer.oom_recovery.events
    before = [e for e in recovered if e["step"] == 1]
    micro = min([e["micro_batch"] for e in recovered] or [probe.batch.micro])
    return {"failed": probe.failed + len(before), "later": len(recovered) - len(before),
            "seconds": timer.first_step_s, "micro": micro, "predicted": batch.micro,
            "effective": _effective(judge), "counted": judge.step2()}


def bench(s: Setup, tmp: Path, budgets_mib: tuple[int, ...], peaks: dict[int, int]) -> list[dict[str, Any]]:
    """Every budget for one model; ``peaks`` (micro-batch -> memprobe's count) fills as truth is
    searched, once per micro-batch for all budgets."""
    divisors = [m for m in range(1, EFFECTIVE + 1) if EFFECTIVE % m == 0]

    def peak(micro: int) -> int:
        # the peak is reached from the second micro-batch of step 2 on: 2 micro-batches show it
        if micro not in peaks:
            peaks[micro] = counted_peak(s, tmp, micro, min(EFFECTIVE // micro, 2))
        return peaks[micro]

    rows = []
    for mib in budgets_mib:
        limit = mib * MiB
        valid = largest(lambda m, lim=limit: peak(m) <= lim, divisors)
        row = {"model": s.name, "budget": limit, "valid": valid,
               "hf": run_hf(s, tmp, limit), "mt": run_memtrain(s, tmp, limit, "auto"),
               "mt1": run_memtrain(s, tmp, limit, 0.1)}
        rows.append(row)
        print(summary(row), flush=True)
    return rows


def summary(r: dict[str, Any]) -> str:
    return (f"{r['model']} {r['budget'] / MiB:.1f} MiB: truth {r['valid']}; "
            + "; ".join(f"{k} micro {r[k]['micro']} failed {r[k]['failed']} {r[k]['seconds']:.2f}s"
                        f"{' refused' if r[k].get('refused') else ''}"
                        for k in ("hf", "mt", "mt1")))


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | budget MiB | truth: largest valid micro-batch | method | micro-batch at the end "
             "| found / valid | step 2 counted MiB (memprobe) | fits | failed attempts before step 1 "
             "| later OOM restarts/recoveries | s to step 1 | effective batch (rows a step, counted) |",
             "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|"]
    names = {"hf": "HF auto_find_batch_size", "mt": f"memtrain auto ({LABELS['mt']})",
             "mt1": f"memtrain auto ({LABELS['mt1']})"}
    for r in rows:
        for key, label in names.items():
            m = r[key]
            kept = (f"kept ({EFFECTIVE})" if m["effective"] == EFFECTIVE
                    else f"**changed to {m['effective']}**")
            refused = "refused (nothing fits the budget minus the margin)"
            found: Any = refused if m.get("refused") else m["micro"]
            if m.get("micro_step1", m["micro"]) != m["micro"]:
                found = f"{m['micro']} (step 1 ran at {m['micro_step1']})"
            share = f"{m['micro'] / r['valid']:.0%}" if r["valid"] else "— (nothing fits)"
            counted = "—" if m["counted"] is None else f"{m['counted'] / MiB:.1f}"
            fits = "—" if m["counted"] is None else "yes" if m["counted"] <= r["budget"] else "**no**"
            if m["counted"] is None:
                kept = "— (did not train)"
            lines.append(f"| {r['model']} | {r['budget'] / MiB:.0f} | {r['valid']} | {label} | "
                         f"{found} | {share} | {counted} | {fits} | {m['failed']} | {m['later']} | "
                         f"{m['seconds']:.2f} | {kept} |")
    return lines


# The two memtrain columns: the margin each run keeps below the budget.
LABELS = {"mt": "margin 0: default `auto` with a simulated budget",
          "mt1": "margin 10%: `auto` on a real device"}


def targets(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"| target | memtrain, {LABELS['mt']} | memtrain, {LABELS['mt1']} | HF auto_find_batch_size |",
           "|---|---|---|---|"]
    cells: dict[str, list[str]] = {}
    sized = [r for r in rows if r["valid"]]  # budgets where some micro-batch fits
    for key in ("mt", "mt1", "hf"):
        runs = [r[key] for r in rows]
        no_fail = sum(1 for m in runs if m["failed"] == 0) / len(runs)
        ratios = [r["hf"]["seconds"] / r[key]["seconds"] for r in rows if not r[key].get("refused")]
        share = [r[key]["micro"] / r["valid"] for r in sized]
        trained = [m for m in runs if m["counted"] is not None]
        kept = all(m["effective"] == EFFECTIVE for m in trained)
        over = sum(1 for r in rows if r[key]["counted"] is not None and r[key]["counted"] > r["budget"])
        enough = sum(s >= 0.95 for s in share)
        refused = sum(1 for m in runs if m.get("refused"))
        speed = (f"median {harness.median(ratios):.2f}×, min {min(ratios):.2f}×"
                 if key != "hf" and ratios else "—")
        cells[key] = [f"{no_fail:.0%} of cases", speed,
                      f"min {min(share):.0%}, median {harness.median(share):.0%} ({enough}/{len(share)} "
                      "cases ≥ 95%)" if share else "—",
                      f"{'always' if kept else 'not always'} ({len(trained)} runs that trained)",
                      f"{len(trained) - over} of {len(trained)}",
                      f"{refused} of {len(runs)}" if key != "hf" else "—"]
    labels = ["no failed attempt (target ≥ 90% of cases)", "speed-up to step 1 vs HF (target ≥ 3×)",
              "micro-batch / largest valid (target ≥ 95%)",
              "effective batch preserved, rows counted at the forward (target: always)",
              "step 2 fits the budget, memprobe's count (target: every run that trained)",
              "refused (nothing fits the budget minus the margin)"]
    for i, label in enumerate(labels):
        out.append(f"| {label} | {cells['mt'][i]} | {cells['mt1'][i]} | {cells['hf'][i]} |")
    return out


QUICK = ["--quick"]  # CI-sized: one model, two budgets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one model, two budgets (smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hostmem.keep_freed_pages()  # as `memtrain train` on a CPU; process-wide, so both sides get it
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    rows, peaks = [], {}
    with tempfile.TemporaryDirectory(prefix="bench-autofit-") as tmp:
        for s in setups(Path(tmp), args.quick):
            peaks[s.name] = {}
            rows += bench(s, Path(tmp), BUDGETS_MIB[1::3] if args.quick else BUDGETS_MIB, peaks[s.name])
    lines = [
        *harness.header("Auto-fit micro-batch vs `auto_find_batch_size`"),
        f"Torch threads {args.threads}, the cores shared with other jobs; total run "
        f"{time.perf_counter() - start:.0f} s.", "",
        __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0], "",
        "Budgets are simulated on CPU (live tensor bytes, no allocator caching). *Failed attempts*: "
        "out-of-memory errors before optimizer step 1 completed (HF: loop restarts; memtrain: probe steps "
        "that ran out of memory plus recoveries in step 1). *Later*: out-of-memory restarts (HF) or "
        "recoveries (memtrain) in step 2; HF's batch at the end is after those restarts (its step 1 can "
        "fit a batch that step 2, which holds the optimizer state, does not). *Refused*: memtrain "
        "predicted that not even micro-batch 1 fits the budget minus `memory.margin` and stopped with that "
        "message instead of training (counted as 0% of "
        "the largest valid micro-batch, left out of the speed ratio). Budgets where not even micro-batch "
        "1 fits (truth 0) are left out of the micro-batch ratio.", "",
        "## Targets", "", *targets(rows), "",
        "## Every case", "", *table(rows), "",
        "## Truth: memprobe's count of each micro-batch", "",
        "Step 2 of a real 2-step Trainer run at accumulation min(12 / micro, 2), no budget (the "
        "micro-batches the truth search needed):", "",
        "| model | " + " | ".join(f"micro {m}" for m in sorted({m for p in peaks.values() for m in p}))
        + " |",
        "|---|" + "---:|" * len({m for p in peaks.values() for m in p}),
        *[f"| {name} | " + " | ".join(f"{p[m] / MiB:.1f}" if m in p else "—"
                                      for m in sorted({m for q in peaks.values() for m in q})) + " |"
          for name, p in peaks.items()], "",
    ]
    print("\n".join(lines))
    harness.write("autofit", lines, trial=args.quick)


if __name__ == "__main__":
    main()
