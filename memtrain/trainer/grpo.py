"""``training.objective: grpo``: TRL's ``GRPOTrainer`` with what ``MemtrainTrainer`` adds.

Generation, the rewards' group normalisation, the old-policy and reference log-probabilities and
the loss are TRL's (``trl.GRPOTrainer``, a well-kept library: nothing of GRPO is re-implemented
here), built through its public constructor and ``GRPOConfig``. Completions are sampled with
Hugging Face generation (``use_vllm`` stays off: no vLLM on a CPU). :class:`MemtrainGRPOTrainer`
puts :class:`~memtrain.trainer.trainer.MemtrainTrainer` in front of it in the method order, so a
GRPO run has the same NaN guard, checkpoint writer, optimizer offload and memory callbacks as any
other run, and logs TRL's ``reward``, ``reward_std`` and ``rewards/<function>/mean`` every
``logging_steps``.

Two things differ from a stock ``GRPOTrainer`` call:

- with LoRA the model arrives as memtrain's ``PeftModel``. With ``beta > 0`` TRL then adds a second
  adapter, ``ref``, a copy of the (fresh, zero-effect) trained one; memtrain removes it, so the
  reference is the base model with the adapter disabled (TRL's ``use_adapter(model, None)``), as
  for DPO (:mod:`memtrain.trainer.preference`): no second copy of anything;
- out-of-memory recovery splits the micro-batch of completions TRL generated, never generating
  again: generation normalises rewards within each prompt's group before the generation batch is
  cut into micro-batches, so each completion carries its advantage and a split keeps the step's
  loss (:class:`memtrain.reliability.layouts.Completions`, :class:`memtrain._compat.trl.GenerationSteps`);
  a generation that runs out of memory is redone with fewer prompts per ``generate`` call, whole
  groups each (:mod:`memtrain.reliability.generation`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain._compat.transformers_trainer import own_checkpointing_off
from memtrain.config import RunConfig
from memtrain.config.batch import Batch
from memtrain.errors import MemtrainError
from memtrain.trainer import rewards
from memtrain.trainer.trainer import MemtrainTrainer, argument_values, trainer_options

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError:  # an optional dependency (memtrain[dpo])
    raise MemtrainError("`training.objective: grpo` runs TRL's GRPOTrainer, and TRL is not installed. "
                        "Fix: pip install 'trl>=1.16' (or memtrain[dpo]).") from None

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from memtrain.data.prepare import PreparedData


class MemtrainGRPOTrainer(MemtrainTrainer, GRPOTrainer):
    """TRL's GRPOTrainer behind memtrain's guards and checkpoints (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.completion_batches: list[tuple[int, int, int]] = []  # this step's, see compute_loss
        super().__init__(*args, **kwargs)
        model = self.model
        if hasattr(model, "peft_config") and "ref" in model.peft_config:
            model.delete_adapter("ref")  # the reference is the base model: adapter disabled

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """TRL's loss, noting the (rows, prompt tokens, completion tokens) of the generated batch it
        is handed: the memory meter reports a step's batch from them (the Trainer fetched prompts)."""
        prompt, completion = inputs.get("prompt_ids"), inputs.get("completion_ids")
        if isinstance(prompt, torch.Tensor) and isinstance(completion, torch.Tensor):
            self.completion_batches.append((int(prompt.shape[0]), int(prompt.shape[1]),
                                            int(completion.shape[1])))
        return super().compute_loss(model, inputs, *args, **kwargs)


def loss_types() -> tuple[str, ...]:
    """The ``loss_type`` values the installed TRL lists in ``GRPOConfig``'s own field help."""
    field = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type")
    help_text = field.metadata.get("help", "")
    listed = re.search(r"Supported values are (.*?)\.\s", help_text)
    return tuple(re.findall(r"'(\w+)'", listed.group(1))) if listed else ()


def check_loss(cfg: RunConfig) -> None:
    known = loss_types()
    if known and cfg.training.grpo_loss not in known:
        raise MemtrainError(f"`training.grpo_loss`: {cfg.training.grpo_loss!r} is not a loss type of the "
                            f"installed TRL's GRPOTrainer. Fix: use one of {', '.join(known)}.")


def grpo_settings(cfg: RunConfig) -> dict[str, Any]:
    """The GRPOConfig fields a recipe sets (the rest keep TRL's defaults)."""
    t = cfg.training
    return {
        "num_generations": t.grpo_num_generations,
        "max_completion_length": t.grpo_max_completion_length,
        "temperature": t.grpo_temperature,
        "top_p": t.grpo_top_p,
        "top_k": t.grpo_top_k,
        "min_p": t.grpo_min_p,
        "repetition_penalty": t.grpo_repetition_penalty,
        "beta": t.grpo_beta,
        "loss_type": t.grpo_loss,
        "reward_weights": t.grpo_reward_weights,
        # as for DPO: train in the weights' dtype, checkpoint as `memory.checkpointing` says
        "bf16": cfg.model.dtype == "bf16" and torch.cuda.is_available(),
        **own_checkpointing_off(),
        "use_vllm": False,
    }


def grpo_arguments(cfg: RunConfig, batch: Batch, output_dir: str, has_eval: bool) -> GRPOConfig:
    """TRL's GRPOConfig: memtrain's TrainingArguments plus the GRPO settings of the recipe.

    ``per_device_train_batch_size`` counts completions (TRL's meaning); an evaluation batch is one
    prompt's group (TRL's rule: the evaluation batch is a multiple of ``num_generations``).
    """
    check_loss(cfg)
    values = argument_values(cfg, batch, output_dir, has_eval)
    values["label_names"] = []
    values["per_device_eval_batch_size"] = cfg.training.grpo_num_generations
    try:
        return GRPOConfig(**values, **grpo_settings(cfg))
    except ValueError as err:  # TRL's own checks, should one of them go beyond memtrain's
        raise MemtrainError(f"`training`: TRL's GRPOConfig refused the GRPO settings: {err} Fix: change "
                            "the training.grpo_* field or batch size it names.") from None


def build_grpo_trainer(cfg: RunConfig, model: nn.Module, tokenizer: Any, data: PreparedData, batch: Batch,
                       output_dir: str, callbacks: list[TrainerCallback] | None = None
                       ) -> MemtrainGRPOTrainer:
    """A ready-to-train GRPO Trainer for a resolved recipe with ``training.objective: grpo``."""
    args = grpo_arguments(cfg, batch, output_dir, has_eval=data.eval is not None)
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        # generation stops at the end-of-sequence token; memtrain's other formats close examples with
        # the separator where a tokenizer has no end-of-sequence token (memtrain.data.chat)
        tokenizer.eos_token = tokenizer.sep_token
    return MemtrainGRPOTrainer(**trainer_options(cfg), model=model,
                               reward_funcs=rewards.resolve(cfg), args=args, train_dataset=data.train,
                               eval_dataset=data.eval, processing_class=tokenizer, callbacks=callbacks or [])
