"""A plain ``transformers.Trainer`` set-up for recovery, plugin and auto-fit tests: tiny models from
configs, token-id datasets where one batch is much longer than the rest, a padding collator, and a
callback that keeps the gradients each optimizer step is about to apply."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from conftest import TINY_CONFIGS
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 30522


def tiny_model(task: str = "causal-lm", seed: int = 0) -> torch.nn.Module:
    """Tiny Llama (causal LM) or tiny BERT (2-class classification), dropout off, fp32."""
    if task == "causal-lm":
        values = copy.deepcopy(TINY_CONFIGS["llama"])
        cls: Any = AutoModelForCausalLM
    else:
        values = {**copy.deepcopy(TINY_CONFIGS["bert"]), "hidden_dropout_prob": 0.0,
                  "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0, "num_labels": 2}
        cls = AutoModelForSequenceClassification
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    return cls.from_config(config)


def token_dataset(task: str, lengths: list[int], seed: int = 0) -> list[dict[str, Any]]:
    """One example per length: random token ids; labels are the ids (causal) or a class."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(5, VOCAB, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "label": i % 2} if task != "causal-lm" else {"input_ids": ids})
    return rows


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the longest row (right padding, id 0); causal labels are -100 on padding."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "label" in rows[0]:
        batch["labels"] = torch.tensor([r["label"] for r in rows])
    else:
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


def arguments(tmp_path: Path, micro: int, accumulation: int, steps: int, **extra: Any) -> TrainingArguments:
    """CPU TrainingArguments: no shuffling surprises (fixed seed), no saving, log every step."""
    extra.setdefault("logging_steps", 1)
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-3,
        save_strategy="no", report_to="none", use_cpu=True, seed=0,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
        train_sampling_strategy="sequential", **extra)


class GradCapture(TrainerCallback):
    """Keep a copy of every gradient right before each optimizer step, and the optimizer's state."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.optimizer: Any = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None,
                              optimizer: Any = None, **kwargs: Any) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None})
        self.optimizer = optimizer


def max_grad_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| relative to the largest |a| of each tensor (+ 1e-6, since some gradients are
    zero in exact arithmetic: attention key biases, where only rounding noise of ~1e-12 is left)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / (a[k].abs().max() + 1e-6)) for k in a)
