"""``training.objective: dpo``: TRL's ``DPOTrainer`` with everything ``MemtrainTrainer`` adds.

The loss, the reference forward, the tiled log-probability head and the reward metrics are TRL's
(``trl.DPOTrainer``, a well-kept library: nothing of DPO is re-implemented here).
:class:`MemtrainDPOTrainer` puts :class:`~memtrain.trainer.trainer.MemtrainTrainer` in front of it
in the method order, so a DPO run has the same out-of-memory recovery (which splits
``[chosen; rejected]`` batches by pairs: :mod:`memtrain.reliability.layouts`), NaN guard,
checkpoint writer, optimizer offload and memory callbacks as any other run.

Two things differ from a stock ``DPOTrainer`` call:

- the data arrives tokenized by memtrain (:mod:`memtrain.data.preference`: one masking rule for
  every format), so TRL's own tokenization is skipped;
- with LoRA the model arrives as memtrain's ``PeftModel``. Given a ``PeftModel`` TRL adds a second
  adapter, ``ref``, a copy of the (fresh, zero-effect) trained one, and runs the reference through
  it; memtrain removes it again, so the reference is the base model with the adapter disabled
  (TRL's ``use_adapter(model, None)``), as TRL does for a ``peft_config``: no second copy of
  anything, and the reference forward is the base model's.

:func:`reference_step` is the same loss for the estimator's traced step
(:mod:`memtrain.trainer.step`): TRL's own loss method on a trainer that holds only what that
method reads, on fake tensors (:func:`memtrain._compat.trl.dpo_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain._compat.transformers_trainer import own_checkpointing_off
from memtrain._compat.trl import DPOTrainerHooks, add_fused_head, dpo_loss
from memtrain.config import RunConfig
from memtrain.config.batch import Batch
from memtrain.errors import TRL_MISSING, MemtrainError
from memtrain.patches import base_model
from memtrain.trainer.trainer import MemtrainTrainer, argument_values, trainer_inputs

try:
    from trl import DPOConfig, DPOTrainer
except ImportError:  # an optional dependency (memtrain[dpo])
    raise MemtrainError(TRL_MISSING) from None

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from memtrain.data.prepare import PreparedData

# What DPOTrainer asks its fused head for (DPOTrainer.__init__: the metrics' per-token fields)
HEAD_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


class MemtrainDPOTrainer(DPOTrainerHooks, MemtrainTrainer, DPOTrainer):
    """TRL's DPOTrainer behind memtrain's recovery, guards and checkpoints (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.model
        if hasattr(model, "peft_config") and "ref" in model.peft_config:
            model.delete_adapter("ref")  # the reference is the base model: adapter disabled

    def prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        if "chosen_ids" in getattr(dataset, "column_names", []):
            return dataset  # tokenized by memtrain.data.preference
        return super().prepare_dataset(dataset, processing_class, args, dataset_name)


def dpo_arguments(cfg: RunConfig, batch: Batch, output_dir: str, has_eval: bool) -> DPOConfig:
    """TRL's DPOConfig: memtrain's TrainingArguments plus the DPO settings of the recipe."""
    values = argument_values(cfg, batch, output_dir, has_eval)
    values["label_names"] = []  # pairs carry no labels; DPOTrainer's prediction_step computes the loss
    return DPOConfig(**values, **dpo_settings(cfg))


def dpo_settings(cfg: RunConfig) -> dict[str, Any]:
    """The DPOConfig fields a recipe sets (the rest keep TRL's defaults)."""
    return {
        "beta": cfg.training.dpo_beta,
        "loss_type": [cfg.training.dpo_loss],
        "max_length": cfg.data.max_length,
        # TRL's configs default to bf16 autocast and to transformers' gradient checkpointing;
        # memtrain trains in the weights' dtype and checkpoints as `memory.checkpointing` says
        "bf16": cfg.model.dtype == "bf16" and torch.cuda.is_available(),
        **own_checkpointing_off(),
        "precompute_ref_log_probs": precompute_ref(cfg),
        "pad_to_multiple_of": None,
    }


def precompute_ref(cfg: RunConfig) -> bool:
    """``training.dpo_precompute_ref``, decided (the planner fills `auto`)."""
    value = cfg.training.dpo_precompute_ref
    if value == "auto":
        raise MemtrainError("`training.dpo_precompute_ref` is `auto`: run the planner first (`memtrain "
                            "plan`, or set `memory.budget`), or set it to true or false.")
    return bool(value)


def build_dpo_trainer(cfg: RunConfig, model: nn.Module, tokenizer: Any, data: PreparedData, batch: Batch,
                      output_dir: str, callbacks: list[TrainerCallback] | None = None) -> MemtrainDPOTrainer:
    """A ready-to-train DPO Trainer for a resolved recipe with ``training.objective: dpo``."""
    args = dpo_arguments(cfg, batch, output_dir, has_eval=data.eval is not None)
    return MemtrainDPOTrainer(**trainer_inputs(cfg, model, tokenizer, data, callbacks), args=args)


# ------------------------------------------------------------------------ the estimator's step


def reference_step(cfg: RunConfig, model: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The loss of a DPO step as the Trainer computes it, for :func:`memtrain.trainer.step.training_step`.

    Adds TRL's fused log-probability head to ``model`` (as ``DPOTrainer.__init__`` does) and returns
    ``loss(model, batch)``: TRL's own loss method, bound to an object holding the attributes that
    method reads, set from the recipe as ``DPOTrainer.__init__`` sets them from ``DPOConfig``
    (:func:`memtrain._compat.trl.dpo_loss`). Its metrics read numbers (``.item()``): traced on fake
    tensors, the estimator's ``fake_tensor_mode(scalars=True)`` answers them.
    """
    base = base_model(model)
    add_fused_head(base, outputs=HEAD_OUTPUTS)
    settings = dpo_settings(cfg)
    return dpo_loss(model, beta=settings["beta"], loss_types=settings["loss_type"],
                    precompute_ref_logps=settings["precompute_ref_log_probs"])
