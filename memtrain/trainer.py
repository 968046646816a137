"""The recipe as a ``transformers.Trainer``: TrainingArguments, metrics, the Trainer subclass.

memtrain keeps the stock Trainer loop (progress bar, logging integrations, checkpoint format,
resume) and only adds what a memory-bounded run needs on top of it, in :class:`MemtrainTrainer`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from transformers import (
    EvalPrediction,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from memtrain.config import RunConfig
from memtrain.config.batch import Batch
from memtrain.data import PreparedData
from memtrain.errors import MemtrainError

OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw": ("adamw_torch", None),
    "adamw_8bit": ("adamw_bnb_8bit", None),
    "paged_adamw_8bit": ("paged_adamw_8bit", None),
    "adafactor": ("adafactor", None),
    "sgd": ("sgd", "momentum=0.9"),
}


def training_arguments(cfg: RunConfig, batch: Batch, output_dir: str, has_eval: bool) -> TrainingArguments:
    """TrainingArguments for a resolved recipe (no `auto` left)."""
    t = cfg.training
    if t.optimizer == "auto":
        raise ValueError("training.optimizer is `auto`: run the planner first")
    optim, optim_args = OPTIMIZERS[t.optimizer]
    cuda = torch.cuda.is_available()
    if cfg.model.dtype == "fp16" and not cuda:
        raise MemtrainError("`model.dtype`: fp16 training needs a CUDA GPU. Fix: use `bf16` or `fp32` "
                            "on this machine.")
    eval_strategy = "no" if not has_eval else ("steps" if t.eval_steps else "epoch")
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch.micro,
        per_device_eval_batch_size=batch.micro,
        gradient_accumulation_steps=batch.accumulation,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup if t.warmup < 1 else int(t.warmup),
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        max_grad_norm=t.max_grad_norm or 0.0,
        optim=optim,
        optim_args=optim_args,
        eval_strategy=eval_strategy,
        eval_steps=t.eval_steps,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy=t.save_strategy,
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        seed=t.seed,
        data_seed=t.seed,
        # bf16 weights train in pure bf16 (no autocast, no fp32 master copy); fp16 needs the
        # loss scaler, which the schema only allows with fp32 adapters on an fp16 base.
        fp16=cfg.model.dtype == "fp16",
        use_cpu=not cuda,
        report_to=cfg.output.report_to or "none",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        label_names=["labels"],
        disable_tqdm=False,
    )


def compute_accuracy(pred: EvalPrediction) -> dict[str, float]:
    """Accuracy of the argmax class (classification)."""
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    return {"accuracy": float((np.argmax(logits, axis=-1) == pred.label_ids).mean())}


def add_derived_metrics(metrics: dict[str, float], cfg: RunConfig, data: PreparedData) -> dict[str, float]:
    """Perplexity for causal LM, the majority-class baseline for classification."""
    out = dict(metrics)
    if cfg.model.task == "causal-lm" and "eval_loss" in out:
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
    if cfg.model.task == "sequence-classification" and data.eval is not None:
        labels = np.asarray(data.eval["labels"])
        out["eval_majority_baseline"] = float(np.bincount(labels).max() / len(labels))
    return out


class MemtrainTrainer(Trainer):
    """The stock Trainer plus the hooks memtrain's memory features attach to."""


def build_trainer(
    cfg: RunConfig,
    model: PreTrainedModel,
    tokenizer: Any,
    data: PreparedData,
    batch: Batch,
    output_dir: str,
    callbacks: list[TrainerCallback] | None = None,
) -> MemtrainTrainer:
    """A ready-to-train Trainer for a resolved recipe."""
    args = training_arguments(cfg, batch, output_dir, has_eval=data.eval is not None)
    classification = cfg.model.task == "sequence-classification"
    return MemtrainTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=data.collator,
        processing_class=tokenizer,
        compute_metrics=compute_accuracy if classification else None,
        callbacks=callbacks or [],
    )
