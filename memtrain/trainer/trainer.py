"""The recipe as a ``transformers.Trainer``: TrainingArguments, metrics, the Trainer subclass.

memtrain keeps the stock Trainer loop (progress bar, logging integrations, checkpoint format,
resume) and only adds what a memory-bounded run needs on top of it, in :class:`MemtrainTrainer`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import (
    EvalPrediction,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from memtrain._compat.transformers_trainer import TrainerHooks, set_loss_scaled_for_ga
from memtrain.config import RunConfig, decided
from memtrain.config.batch import Batch
from memtrain.device import cuda_available, host_budget_bytes
from memtrain.errors import MemtrainError
from memtrain.reliability import checkpoints
from memtrain.reliability.eval_recovery import EvalBatchRecovery
from memtrain.reliability.guards import NonFiniteLossGuard
from memtrain.reliability.recovery import Fixes, MicroBatchRecovery
from memtrain.units import parse_size

if TYPE_CHECKING:  # data preparation (and `datasets`) is not needed to build an optimizer
    from memtrain.data.prepare import PreparedData

# `adamw` is torch's fused AdamW (transformers' own default since torch 2.8): the same update as
# the multi-tensor (foreach) kernel, without its temporaries, which hold a copy of every trainable
# parameter during the step (6 GiB for Llama-3.2-3B in bf16; docs/bench/floor.md).
OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw": ("adamw_torch_fused", None),
    "adamw_8bit": ("adamw_bnb_8bit", None),
    "paged_adamw_8bit": ("paged_adamw_8bit", None),
    "adafactor": ("adafactor", None),
    "sgd": ("sgd", "momentum=0.9"),
}


def training_arguments(cfg: RunConfig, batch: Batch, output_dir: str, has_eval: bool) -> TrainingArguments:
    """TrainingArguments for a resolved recipe (no `auto` left)."""
    return TrainingArguments(**argument_values(cfg, batch, output_dir, has_eval))


def argument_values(cfg: RunConfig, batch: Batch, output_dir: str, has_eval: bool) -> dict[str, Any]:
    """The values of :func:`training_arguments` (also those of TRL's configs, which extend them)."""
    t = cfg.training
    cuda = cuda_available()
    if cfg.model.dtype == "fp16" and not cuda:
        raise MemtrainError("`model.dtype`: fp16 training needs a CUDA GPU. Fix: use `bf16` or `fp32` "
                            "on this machine.")
    eval_strategy = "no" if not has_eval else ("steps" if t.eval_steps else "epoch")
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch.micro,
        per_device_eval_batch_size=batch.micro,
        gradient_accumulation_steps=batch.accumulation,
        **optimizer_arguments(cfg),
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup if t.warmup < 1 else int(t.warmup),
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        max_grad_norm=t.max_grad_norm or 0.0,
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


def optimizer_arguments(cfg: RunConfig) -> dict[str, Any]:
    """The TrainingArguments that choose and configure the optimizer.

    Shared with :func:`memtrain.trainer.build.build_optimizer`, which builds the same optimizer
    outside a Trainer (estimates, benchmarks).
    """
    t = cfg.training
    optim, optim_args = OPTIMIZERS[decided(t.optimizer, "training.optimizer", "an optimizer's name")]
    return {"optim": optim, "optim_args": optim_args, "learning_rate": t.learning_rate,
            "weight_decay": t.weight_decay}


def compute_accuracy(pred: EvalPrediction) -> dict[str, float]:
    """Accuracy of the argmax class (classification)."""
    logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
    return {"accuracy": float((np.argmax(logits, axis=-1) == pred.label_ids).mean())}


def add_derived_metrics(metrics: dict[str, float], cfg: RunConfig, data: PreparedData) -> dict[str, float]:
    """Perplexity for causal LM, the majority-class baseline for classification."""
    out = dict(metrics)
    if cfg.model.task == "causal-lm" and cfg.training.objective == "sft" and "eval_loss" in out:
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
    if cfg.model.task == "sequence-classification" and data.eval is not None:
        labels = np.asarray(data.eval["labels"])
        out["eval_majority_baseline"] = float(np.bincount(labels).max() / len(labels))
    return out


class MemtrainTrainer(TrainerHooks, Trainer):
    """The stock Trainer plus what a run that must lose nothing needs.

    - a loss that is NaN/inf skips its optimizer step
      (:class:`~memtrain.reliability.guards.NonFiniteLossGuard`);
    - checkpoints are staged and renamed into place, after a free-disk-space check;
    - with ``offload_optimizer`` (``memory.offload.optimizer``), optimizer state and step live on
      the CPU (:mod:`memtrain.trainer.optimizer_offload`), and gradient clipping reaches the host copies;
    - with several processes, the FSDP2 sharding the model already has (``fsdp_plugin``,
      accelerate's description of it, see :mod:`memtrain.distributed.fsdp`) is what accelerate runs;
    - with ``optimizer_in_backward``, every parameter steps in backward as soon as its gradient is
      complete (:mod:`memtrain.trainer.optimizer_in_backward`);
    - a micro-batch that runs out of memory is split in two and its optimizer step redone
      (:mod:`memtrain.reliability.recovery`; with several processes by all of them together), unless
      ``recover_oom`` is False or the step is in backward; an evaluation batch that runs out of
      memory is split and predicted in pieces (:mod:`memtrain.reliability.eval_recovery`).
    """

    def __init__(self, *args: Any, max_nonfinite_steps: int = 5, offload_optimizer: bool = False,
                 fsdp_plugin: Any = None, recover_oom: bool = True, budget_bytes: int | None = None,
                 optimizer_in_backward: bool = False, host_budget: tuple[int, str] | None = None,
                 oom_fixes: Fixes | None = None, **kwargs: Any) -> None:
        self.offload_optimizer = offload_optimizer
        self.host_budget = host_budget  # (bytes, what they are): the offloaded optimizer's RAM check
        self.optimizer_in_backward = optimizer_in_backward
        self.runtime_before = 0.0  # training seconds of the run before the checkpoint it resumed from
        self.started_at = time.time()
        self.fsdp_plugin = fsdp_plugin  # read while Trainer.__init__ creates the Accelerator
        super().__init__(*args, **kwargs)
        self.nonfinite = NonFiniteLossGuard(max_nonfinite_steps)
        self.add_callback(self.nonfinite)
        # Recovery splits a micro-batch into accumulated halves, which the step inside backward
        # cannot do (it steps at the end of every backward).
        self.oom_recovery = (MicroBatchRecovery(self, super().training_step, budget_bytes, fixes=oom_fixes)
                             if recover_oom and not optimizer_in_backward else None)
        self.eval_recovery = EvalBatchRecovery(self, super().prediction_step) if recover_oom else None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self.started_at = time.time()  # checkpoints record the run's training time so far
        return super().train(*args, **kwargs)

    def run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # Resumed at `max_steps` (e.g. the final save failed): the stock loop would run one more step.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return
        super().run_epoch(*args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        if self.oom_recovery is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self.oom_recovery.training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        if self.eval_recovery is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return self.eval_recovery.prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def accelerator_arguments(self, **kwargs: Any) -> dict[str, Any]:
        args = super().accelerator_arguments(**kwargs)
        if self.fsdp_plugin is not None:
            args["fsdp_plugin"] = self.fsdp_plugin
        return args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.fsdp_plugin is not None:
            adopt_fsdp(self, self.fsdp_plugin)  # on CPU accelerate picked DDP: make it FSDP2

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        if model.training and torch.is_grad_enabled() and not torch.isfinite(loss.detach()).all():
            self.nonfinite.flag()
            # A leaf: its backward reaches no parameter, so the NaN cannot spread into gradients.
            dead = torch.full_like(loss.detach(), float("nan")).requires_grad_()
            out = (dead, out[1]) if return_outputs else dead
        return out

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The stock evaluation, with memory tracking paused: it measures and limits training steps."""
        with contextlib.ExitStack() as stack:
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "paused"):
                    stack.enter_context(callback.paused())
            return super().evaluate(*args, **kwargs)

    def save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The stock save, through memtrain's one checkpoint writer
        (:mod:`memtrain.reliability.checkpoints`)."""
        stock = super().save_checkpoint
        checkpoints.write_checkpoint(self, lambda: stock(model, trial))

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer; with offload the same optimizer run on host copies; in backward
        the same optimizer once per parameter."""
        if self.optimizer is not None or not (self.offload_optimizer or self.optimizer_in_backward):
            return super().create_optimizer(model)
        from memtrain.trainer import optimizer_in_backward as optim_backward
        from memtrain.trainer import optimizer_offload as optim_offload

        opt_model = self.model if model is None else model
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        if self.optimizer_in_backward:
            # The stock optimizer's groups carry the Trainer's settings (weight-decay exclusions,
            # bitsandbytes embedding overrides are registered by parameter); it holds no state yet.
            groups = super().create_optimizer(model).param_groups
            self.optimizer = optim_backward.build(groups, cls, kwargs)
            return self.optimizer
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = optim_offload.build([g for g in groups if g["params"]], cls, kwargs,
                                             *(self.host_budget or ()))
        return self.optimizer

    def clip_grad_norm(self, model: Any) -> torch.Tensor:
        # An offloaded optimizer steps on host copies of the gradients: clip those.
        from memtrain.trainer.optimizer_offload import OffloadOptimizer

        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if isinstance(inner, OffloadOptimizer):
            return inner.clip_grad_norm_(self.args.max_grad_norm)
        return super().clip_grad_norm(model)


def trainer_inputs(cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, data: PreparedData,
                   callbacks: list[TrainerCallback] | None = None) -> dict[str, Any]:
    """The constructor arguments every memtrain Trainer takes alike (the SFT one here, the DPO one
    in :mod:`memtrain.trainer.preference`): memtrain's options, the model, data and callbacks."""
    return {**trainer_options(cfg), "model": model, "train_dataset": data.train, "eval_dataset": data.eval,
            "data_collator": data.collator, "processing_class": tokenizer, "callbacks": callbacks or []}


def build_trainer(
    cfg: RunConfig,
    model: PreTrainedModel,
    tokenizer: Any,
    data: PreparedData,
    batch: Batch,
    output_dir: str,
    callbacks: list[TrainerCallback] | None = None,
    fsdp_plugin: Any = None,
) -> MemtrainTrainer:
    """A ready-to-train Trainer for a resolved recipe (``fsdp_plugin``: see MemtrainTrainer)."""
    args = training_arguments(cfg, batch, output_dir, has_eval=data.eval is not None)
    classification = cfg.model.task == "sequence-classification"
    trainer = MemtrainTrainer(
        **trainer_inputs(cfg, model, tokenizer, data, callbacks),
        args=args,
        compute_metrics=compute_accuracy if classification else None,
        fsdp_plugin=fsdp_plugin,
    )
    if classification:
        # Transformers 5 assumes a model whose forward takes **kwargs normalises its loss by
        # `num_items_in_batch`; sequence classifiers take **kwargs but return a plain mean, so
        # the Trainer would skip dividing by the accumulation steps and the gradient would grow
        # with the accumulation (tests/end_to_end/test_train.py checks the equivalence).
        set_loss_scaled_for_ga(trainer, False)
    return trainer


def trainer_options(cfg: RunConfig) -> dict[str, Any]:
    """MemtrainTrainer's own constructor options for a recipe (checked).

    Shared with :func:`memtrain.trainer.build.build_optimizer`, which runs the Trainer's
    ``create_optimizer`` without a Trainer (estimates, benchmarks).
    """
    offload = decided(cfg.memory.offload.optimizer, "memory.offload.optimizer", "true or false")
    if offload and cfg.distributed.processes > 1:
        raise MemtrainError(
            "`memory.offload.optimizer` is the single-process offload; with "
            f"`distributed.processes: {cfg.distributed.processes}` use "
            "`memory.offload.parameters: true` instead (FSDP2's CPU offload keeps the shards, "
            "their gradients and the optimizer state on the CPU and steps there).")
    if offload and cfg.model.dtype == "fp16":
        raise MemtrainError("`memory.offload.optimizer` does not work with fp16 loss scaling "
                            "(`model.dtype: fp16`). Fix: use bf16 or fp32, or turn offload off.")
    budget = cfg.memory.budget_setting if cfg.memory.budget_setting != "auto" else None
    decided(cfg.training.optimizer_in_backward, "training.optimizer_in_backward", "true or false")
    return {"max_nonfinite_steps": cfg.training.max_nonfinite_steps, "offload_optimizer": bool(offload),
            "budget_bytes": parse_size(budget) if budget else None,
            "host_budget": ((host_budget_bytes(cfg.memory.host_budget),
                             f"`memory.host_budget` ({cfg.memory.host_budget})") if offload else None),
            "optimizer_in_backward": cfg.training.optimizer_in_backward, "oom_fixes": Fixes.for_recipe(cfg)}


def adopt_fsdp(trainer: Any, plugin: Any) -> None:
    """Make a Trainer (right after it created its Accelerator) treat the model as FSDP2.

    On CUDA accelerate already chose FSDP from the plugin. On CPU it enables FSDP for no backend
    and picked DDP (``MULTI_CPU``), which would wrap the sharded model in DistributedDataParallel;
    switching the shared state to FSDP makes ``prepare`` keep the FSDP2 model and the Trainer use
    its FSDP paths (no-sync accumulation, DTensor clipping, full-state-dict saving). Both shared
    states change: every later ``AcceleratorState()`` copies ``distributed_type`` from
    ``PartialState``, which would quietly turn the run back into DDP.
    """
    from accelerate.utils import DistributedType

    from memtrain._compat.accelerate import set_shared_distributed_type

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        set_shared_distributed_type(DistributedType.FSDP)
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
