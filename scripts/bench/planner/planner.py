"""Does the planner's pick fit, and is it faster than a trivial rule? Judged on real runs.

    python -m scripts run planner      # a few minutes on 2 shared CPU cores

The model is the shipped tiny Llama (``recipes/tiny-llama-shakespeare.yaml``: 4 layers, hidden 128,
tied 30,522-token vocabulary, fp32), trained in full on packed 256-token rows of Shakespeare, effective
batch 4: the smallest setting that still gives every case below on 2 shared cores. The recipe
leaves ``training.optimizer`` (AdamW, 8-bit AdamW), ``memory.checkpointing`` (none, selective, 2 of
4 layers, full), ``memory.loss`` (standard, chunked) and the micro-batch to the planner; the two
LoRA cases leave ``adapter.method`` (full, LoRA) too. The logits (31 MB a row) dominate a step
above micro-batch 1; at micro-batch 1 the weights, gradients and optimizer state do.

Inputs are fixed here, not derived from memtrain: each case is a budget in MiB (``CASES``), the same
for every method, and the fields the recipe leaves ``auto``. The budgets are sizes placed against
the *measured* peaks of the no-technique runs (the last line of the output), to give: one
case where everything fits, one where only smaller micro-batches with accumulation fit, one where
only micro-batch 1 fits, and cases below the no-technique floor, where something must be given up.

Two methods per case, both judged the same way:

- **planner**: ``memtrain.plan.planner.plan`` at the budget (margin 0: the budget is the limit; CPU;
  the rows of the data at hand), as ``memtrain train`` plans a recipe with ``auto`` fields;
- **trivial**: no technique (the first value of every ``auto`` field: full AdamW, no checkpointing,
  the standard loss), and the micro-batch found by halving on out-of-memory from the whole effective
  batch: the largest of 4, 2, 1 whose real run fits. Each failed try is counted (on a GPU, a crash);
- for context, the planner's **runner-up** (the fastest-predicted setting it did not choose among
  those predicted to fit) and the **fastest that fits**: the fastest of every setting run (the
  picks, the runners-up and the no-technique runs) whose counted peak fits the budget. Neither is
  an exhaustive search of the candidates.

**Judge.** Each setting is run for real: ``memtrain train`` (the Trainer's own steps) with the
settings fixed, 7 optimizer steps. Step 2 (optimizer state exists) is counted by
``scripts/probes/memprobe.py``'s ``trainer_steps``: live tensor bytes, device plus host, of the real step,
with no memtrain code in the count; *fits* means that count is at most the budget. Steps 3-6 are
timed (wall clock between the ends of consecutive optimizer steps: loading, forward, backward,
optimizer; the fastest of the four, since other jobs on the cores only add time; steps 1, 2 and 7
carry memtrain's meter or the counter and are not timed). Each setting is run once and reused by
every case that needs it; the timing runs are repeated once at the end, in reverse order, and the
faster of the two runs is kept (a slow patch of the shared machine then hits one run, not the ratio).
Writes docs/bench/planner.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from rich.console import Console
from transformers import TrainerCallback

from memtrain.config import RunConfig, load_recipe
from memtrain.data.prepare import prepare_data
from memtrain.model import load_tokenizer
from memtrain.plan import planner
from memtrain.run.train import train
from scripts.probes.memprobe import trainer_steps

ROOT = harness.ROOT
MiB = 2**20
EFFECTIVE = 4
MAX_LENGTH = 256
STEPS = 7  # 1 warm-up, 2 counted, 3-6 timed, 7 (memtrain's meter measures the last step)
COUNTED, TIMED = 2, (3, 4, 5, 6)
# The fields a technique-free run leaves at their first value (the trivial rule's settings).
PLAIN = {"adapter.method": "full", "training.optimizer": "adamw", "memory.checkpointing": "none",
         "memory.loss": "standard", "memory.tiled_mlp": False}
AUTO = {"training.optimizer": "auto", "memory.checkpointing": "auto", "memory.loss": "auto",
        "training.micro_batch_size": "auto",
        "training.gradient_accumulation": "auto"}


@dataclass(frozen=True)
class Case:
    name: str
    budget_mib: int
    shows: str
    lora: bool = False  # adapter.method left `auto` too (LoRA allowed)


# CI-sized: one case (the runs without a technique and the roomy budget's pick).
QUICK = ["--cases", "roomy"]
CASES = [
    Case("roomy", 600, "everything fits: no technique is needed"),
    Case("accumulate", 330, "micro-batch 2 fits without a technique, 4 only with the chunked loss"),
    Case("micro 1", 200, "without a technique only micro-batch 1 fits"),
    Case("below the floor", 162, "not even micro-batch 1 fits without a technique"),
    Case("LoRA allowed, roomy", 330, "`adapter.method: auto` too, where full training fits", lora=True),
    Case("LoRA allowed, tight", 120, "`adapter.method: auto` too, below full training's floor", lora=True),
]


@dataclass
class Measured:
    peak: int  # memprobe: device + host live tensor bytes of step 2
    seconds: list[float] = field(default_factory=list)  # steps 3-6, every run of the setting

    @property
    def step(self) -> float:
        return min(self.seconds)


class Counted(TrainerCallback):
    """memprobe's count of one optimizer step, and the wall clock between the ends of steps."""

    def __init__(self) -> None:
        self.probe = trainer_steps()
        self.ends: dict[int, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == COUNTED:
            self.probe.on_step_begin(args, state, control, **kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == COUNTED:
            self.probe.on_step_end(args, state, control, **kwargs)
        self.ends[state.global_step] = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.on_train_end(args, state, control, **kwargs)

    def peak(self) -> int:
        (step,) = self.probe.steps
        return step["total_peak"]

    def times(self) -> list[float]:
        return [self.ends[s] - self.ends[s - 1] for s in TIMED]


def base_recipe(tmp: Path) -> RunConfig:
    raw = load_recipe(ROOT / "recipes" / "tiny-llama-shakespeare.yaml").model_dump(mode="json")
    raw["data"].update(max_examples=2000, eval_split=0.0, max_length=MAX_LENGTH)
    raw["training"].update(effective_batch_size=EFFECTIVE, max_steps=STEPS, logging_steps=1000,
                           warmup=0, save_strategy="no", **{k.split(".")[1]: v for k, v in AUTO.items()
                                                           if k.startswith("training.")})
    raw["memory"].update(margin=0.0, **{k.split(".")[1]: v for k, v in AUTO.items()
                                        if k.startswith("memory.")})
    raw["output"].update(dir=str(tmp / "run"), report=False)
    return load_recipe(raw)


class Bench:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cfg = base_recipe(tmp)
        self.rows = prepare_data(self.cfg, load_tokenizer(self.cfg.model)).rows(self.cfg)
        self.runs: dict[tuple, Measured] = {}
        self.order: list[tuple] = []
        self.count = 0  # runs so far (each writes its own output folder)

    def settings(self, values: dict[str, Any], micro: int) -> tuple:
        full = {**PLAIN, **values, "training.micro_batch_size": micro,
                "training.gradient_accumulation": EFFECTIVE // micro}
        return tuple(sorted(full.items(), key=lambda kv: kv[0]))

    def run(self, key: tuple) -> Measured:
        """The real run of fixed settings (once; later calls reuse it)."""
        if key not in self.runs:
            counted = self._train(key)
            self.runs[key] = Measured(counted.peak(), counted.times())
            self.order.append(key)
            print(f"  ran {label(key)}: {self.runs[key].peak / MiB:.1f} MiB, "
                  f"{self.runs[key].step:.3f} s/step", flush=True)
        return self.runs[key]

    def retime(self) -> None:
        """Run every setting again, in reverse order; keep all its timed steps."""
        for key in reversed(self.order):
            self.runs[key].seconds += self._train(key).times()

    def _train(self, key: tuple) -> Counted:
        self.count += 1
        cfg = planner.with_values(self.cfg, {**dict(key), "output.dir": str(self.tmp / f"run{self.count}")})
        counted = Counted()
        with contextlib.redirect_stdout(io.StringIO()):
            train(cfg, console=Console(quiet=True), callbacks=[counted])
        return counted

    def plan(self, case: Case) -> tuple[tuple | None, tuple | None, float]:
        cfg = planner.with_values(self.cfg, {"adapter.method": "auto"}) if case.lora else self.cfg
        start = time.perf_counter()
        try:
            decided = planner.plan(cfg, case.budget_mib * MiB, device="cpu", rows=self.rows)
        except planner.NothingFits:
            return None, None, time.perf_counter() - start
        seconds = time.perf_counter() - start
        runner_up = decided.alternatives[0] if decided.alternatives else None
        return (self.settings(decided.chosen.values, decided.chosen.micro),
                runner_up and self.settings(runner_up.values, runner_up.micro), seconds)

    def trivial(self, budget: int) -> tuple[tuple | None, int]:
        """Halving on out-of-memory from the whole effective batch, no technique: (pick, failed tries)."""
        micro, failed = EFFECTIVE, 0
        while micro >= 1:
            key = self.settings({}, micro)
            if self.run(key).peak <= budget:
                return key, failed
            failed += 1
            micro //= 2
        return None, failed


def label(key: tuple | None) -> str:
    if key is None:
        return "nothing fits"
    v = dict(key)
    used = [name for name, on in (
        ("LoRA", v["adapter.method"] == "lora"), ("8-bit AdamW", v["training.optimizer"] == "adamw_8bit"),
        (f"checkpointing {v['memory.checkpointing']}", v["memory.checkpointing"] != "none"),
        ("chunked loss", v["memory.loss"] == "chunked"), ("tiled MLP", v["memory.tiled_mlp"])) if on]
    micro, accum = v["training.micro_batch_size"], v["training.gradient_accumulation"]
    return f"{' + '.join(used) or 'no technique'}, micro {micro} x {accum}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(harness.BENCH / "planner.md"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    parser.add_argument("--cases", nargs="*", help="only these cases (by name); default: every one")
    args = parser.parse_args()
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-planner-") as tmp:
        bench = Bench(Path(tmp))
        plain = {m: bench.run(bench.settings({}, m)) for m in (4, 2, 1)}
        results = []
        for case in cases:
            budget = case.budget_mib * MiB
            picked, second, plan_s = bench.plan(case)
            for key in (picked, second):
                if key is not None:
                    bench.run(key)
            trivial, failed = bench.trivial(budget)
            results.append((case, picked, plan_s, trivial, failed, second))
            print(f"{case.name}: planner {label(picked)}; trivial {label(trivial)}", flush=True)
        bench.retime()
        text = report(bench, plain, results, args.threads, time.perf_counter() - began)
    print(text)
    harness.write("planner", text.splitlines(), out=args.out)


def report(bench: Bench, plain: dict[int, Measured], results: list, threads: int, seconds: float) -> str:
    runs = bench.runs
    rows, fits, beats, ties, loses = [], 0, [], [], []
    for case, picked, plan_s, trivial, failed, second in results:
        budget = case.budget_mib * MiB
        fitting = [k for k, m in runs.items() if m.peak <= budget
                   and (case.lora or dict(k)["adapter.method"] == "full")]
        fastest = min(fitting, key=lambda k: runs[k].step) if fitting else None
        p = runs[picked] if picked else None
        t = runs[trivial] if trivial else None
        ok = p is not None and p.peak <= budget
        fits += ok
        if p and t:
            ratio = t.step / p.step
            verdict = (f"{ratio:.2f}x faster" if ratio > 1.05 else f"{1 / ratio:.2f}x slower"
                       if ratio < 1 / 1.05 else f"tie ({ratio:.2f}x)")
            (beats if ratio > 1.05 else loses if ratio < 1 / 1.05 else ties).append(case.name)
        elif p and ok:
            verdict, _ = "fits; trivial finds nothing", beats.append(case.name)
        elif t:
            verdict, _ = "**trivial fits, planner does not**", loses.append(case.name)
        else:
            verdict, _ = "neither fits", ties.append(case.name)
        rows.append(
            f"| {case.name} | {case.budget_mib} | {label(picked)} | "
            f"{_mib(p.peak) if p else '—'} | {'yes' if ok else '**no**' if p else '—'} | "
            f"{f'{p.step:.3f}' if p else '—'} | {plan_s:.1f} | {label(trivial)} | "
            f"{_mib(t.peak) if t else '—'} | {failed} | {f'{t.step:.3f}' if t else '—'} | {verdict} | "
            f"{label(second)} | {f'{runs[second].step:.3f}' if second else '—'} | "
            f"{label(fastest)} | {f'{runs[fastest].step:.3f}' if fastest else '—'} |")
    lines = [
        *harness.header("Planner benchmark: the pick judged on real runs"),
        f"Torch threads {threads}; the machine shared with other jobs; total run {seconds:.0f} s.", "",
        __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0].replace("Writes docs/bench/planner.md.", ""), "",
        f"**The planner's pick fits the budget (memprobe's count of the real step) in {fits} of "
        f"{len(results)} cases. Against the trivial rule: better in {len(beats)} "
        f"({'; '.join(beats) or 'none'}), a tie in {len(ties)} ({'; '.join(ties) or 'none'}), worse in "
        f"{len(loses)} ({'; '.join(loses) or 'none'}).** A tie is a step time within 5% (the spread "
        "of repeated runs of one setting on this shared machine); *better* is a faster step or a fit "
        "where the trivial rule finds nothing.", "",
        "| case | budget MiB | planner's pick (micro x accumulation) | counted peak MiB | fits | s/step "
        "| plan s | trivial rule's pick | counted peak MiB | failed tries | s/step | planner vs trivial "
        "| planner's runner-up | s/step | fastest run that fits | s/step |",
        "|---|---:|---|---:|---|---:|---:|---|---:|---:|---:|---|---|---:|---|---:|",
        *rows, "",
        "Every run (memprobe's count of step 2, the fastest of its timed steps over both runs):", "",
        "| settings | counted peak MiB | s/step (fastest) | timed steps |",
        "|---|---:|---:|---|",
        *[f"| {label(k)} | {_mib(m.peak)} | {m.step:.3f} | {', '.join(f'{s:.3f}' for s in m.seconds)} |"
          for k, m in sorted(runs.items(), key=lambda kv: kv[1].peak)],
        "",
        "No-technique peaks by micro-batch (where the budgets were placed): "
        + ", ".join(f"micro {m}: {_mib(plain[m].peak)} MiB" for m in sorted(plain)) + ".",
    ]
    return "\n".join(lines) + "\n"


def _mib(n: int) -> str:
    return f"{n / MiB:.1f}"


if __name__ == "__main__":
    main()
