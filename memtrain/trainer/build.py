"""Build what a training step holds — model, optimizer, batch — the one way training does it.

Training (:mod:`memtrain.run.train`), measurement (the benchmarks) and estimation
(:mod:`memtrain.estimator.estimate`) all build through this module, so they cannot drift apart:

- :func:`build_model` loads the real model (:func:`memtrain.model.load_model`) and applies the
  recipe's patches (:func:`memtrain.estimator.fake.build_fake_model` builds the same architecture
  on fake tensors through the same :func:`memtrain.patches.apply_patches`).
- :func:`build_optimizer` is the Trainer's own ``create_optimizer`` (parameter groups, optimizer
  class from ``training.optimizer``, bitsandbytes embedding overrides), called without a Trainer.
- :func:`example_batch` is the worst-case batch every estimate, measurement and probe steps on,
  with :func:`memtrain.trainer.step.training_step`, the one optimizer step they all run.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, TrainingArguments

from memtrain import patches
from memtrain.config import RunConfig
from memtrain.distributed.sharding import quant_storage
from memtrain.errors import BuildError, recipe_stage
from memtrain.model import load_model

# BuildError stays importable from here (its home until issue 36: users' scripts catch it)
__all__ = ["BuildError", "build_model", "build_optimizer", "example_batch",
           "no_kv_cache", "optimizer_arguments_for", "step_loss", "step_settings"]



def no_kv_cache(model: nn.Module) -> nn.Module:
    """``model`` set up as the Trainer trains it: without a KV cache (``config.use_cache =
    TrainingArguments.use_cache``, False). With a cache, transformers builds one in every forward
    and then never reads packed rows' example boundaries from the position ids, so a step outside
    the Trainer (an estimate, a measurement) would attend across packed examples without a mask,
    holding less than the training step does."""
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    return model


def build_model(cfg: RunConfig, num_labels: int | None = None, pad_token_id: int | None = None,
                label_names: list[str] | None = None) -> nn.Module:
    """The model a run trains: loaded as the recipe says, with its patches applied.

    Args:
        cfg: the recipe.
        num_labels: classes (sequence classification).
        pad_token_id: the tokenizer's padding id.
        label_names: class names, stored in the model config for saved models.
    """
    model = load_model(cfg.model, num_labels, pad_token_id, cfg.training.seed,
                       quant_storage=quant_storage(cfg))
    if label_names:
        model.config.id2label = dict(enumerate(label_names))
        model.config.label2id = {n: i for i, n in enumerate(label_names)}
    return patches.apply_patches(no_kv_cache(model), cfg)


def optimizer_arguments_for(cfg: RunConfig) -> TrainingArguments:
    """The ``TrainingArguments`` :func:`build_optimizer` reads: build them outside ``FakeTensorMode``."""
    from memtrain.trainer.trainer import optimizer_arguments

    with tempfile.TemporaryDirectory(prefix="memtrain-optim-") as tmp:
        return TrainingArguments(output_dir=tmp, use_cpu=not torch.cuda.is_available(),
                                 report_to="none", **optimizer_arguments(cfg))


def build_optimizer(cfg: RunConfig, model: nn.Module,
                    args: TrainingArguments | None = None) -> torch.optim.Optimizer:
    """The optimizer the Trainer would create for ``model`` under ``cfg``.

    Runs :meth:`memtrain.trainer.trainer.MemtrainTrainer.create_optimizer` (the stock Trainer's, unless
    memtrain overrides it) on a subclass that skips the Trainer's constructor, so parameter groups,
    weight-decay exclusions, the optimizer class and its arguments, and the bitsandbytes
    embedding overrides are the Trainer's own. Training, estimation (also of one FSDP process)
    and measurement all create their optimizer here.

    Args:
        cfg: the recipe.
        model: the patched (possibly sharded) model.
        args: from :func:`optimizer_arguments_for` (default: built here, which must then happen
            outside ``FakeTensorMode``).
    """
    from memtrain.trainer.trainer import MemtrainTrainer, trainer_options

    class OptimizerOnly(MemtrainTrainer):
        def __init__(self, args: TrainingArguments, model: nn.Module) -> None:  # no data, no accelerate
            self.args, self.model = args, model
            self.optimizer, self.optimizer_cls_and_kwargs = None, None
            # what MemtrainTrainer.__init__ sets before the stock constructor runs
            options = trainer_options(cfg)
            self.offload_optimizer = options["offload_optimizer"]
            self.optimizer_in_backward = options["optimizer_in_backward"]
            self.host_budget = options["host_budget"]
            self.fsdp_plugin = None

    args = args or optimizer_arguments_for(cfg)
    with recipe_stage("training.optimizer", f"creating the {cfg.training.optimizer} optimizer"):
        return OptimizerOnly(args, model).create_optimizer()


def example_batch(cfg: RunConfig, config: PretrainedConfig, batch_size: int, seq_len: int,
                  device: torch.device | str = "cpu", padded: bool = True) -> dict[str, torch.Tensor]:
    """A worst-case batch: every row ``seq_len`` tokens long, laid out as memtrain's collators lay
    out real batches, so that attention takes the path a real step takes.

    Real batches reach transformers' masked attention: a padded batch carries an attention mask
    with zeros (``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq``), and a packed row restarts
    its position ids (:mod:`memtrain.data.packing`), from which transformers builds a block-diagonal
    mask. A masked step holds more than an unmasked one of the same shape: the 4D mask (and, with
    SDPA, a float copy of it per layer) and, for grouped-query attention, keys and values repeated
    for every head (transformers' ``repeat_kv``), both kept for backward. So the longest batch has
    one padded token (the last of the last row; a one-token row has none to spare), and a packed
    row holds two examples.

    ``padded=False`` is a batch whose rows all have ``seq_len`` tokens (:mod:`memtrain.data.rows`:
    a batch of one row, or data whose rows are all as long): the collator's attention mask is all
    ones, and transformers takes the unmasked (causal-only) attention path.
    """
    generator = torch.Generator().manual_seed(0) if torch.device(device).type == "cpu" else None
    if cfg.training.objective == "dpo":
        batch = _pairs_batch(config, batch_size, seq_len, device, padded, generator)
        if cfg.training.dpo_precompute_ref is True:  # the reference log-probs, one per sequence
            for key in ("ref_chosen_logps", "ref_rejected_logps"):
                batch[key] = torch.zeros(batch_size, device=device)
        return batch
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator,
                        device=device)
    if cfg.model.task == "sequence-classification":
        labels = torch.randint(0, max(2, config.num_labels), (batch_size,), generator=generator,
                               device=device)
    else:
        labels = ids.clone()
    batch = {"input_ids": ids, "labels": labels}
    if cfg.data.packing and seq_len > 1:
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).to(device)
        batch["position_ids"] = positions.expand(batch_size, -1).clone()
        labels[:, half] = -100  # no example is trained to predict the next one's first token
    elif seq_len > 1:
        mask = torch.ones_like(ids)
        if padded:
            mask[-1, -1] = 0
            if labels.dim() == 2:
                labels[-1, -1] = -100
        batch["attention_mask"] = mask
    return batch


def _pairs_batch(config: PretrainedConfig, pairs: int, seq_len: int, device: torch.device | str,
                 padded: bool, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """TRL's ``DataCollatorForPreference`` layout: ``[chosen; rejected]``, 2 x ``pairs`` rows of
    ``seq_len`` tokens, answers marked in ``completion_mask`` (all but the first token: the most
    positions TRL's log-probability head can score), one padded token when ``padded``."""
    ids = torch.randint(0, config.vocab_size, (2 * pairs, seq_len), generator=generator, device=device)
    mask = torch.ones_like(ids)
    completion = torch.ones_like(ids)
    completion[:, :1] = 0
    if padded and seq_len > 1:
        mask[-1, -1] = 0
        completion[-1, -1] = 0
    return {"input_ids": ids, "attention_mask": mask, "completion_mask": completion}


def step_loss(cfg: RunConfig, model: nn.Module) -> Any:
    """The ``loss_fn`` of :func:`memtrain.trainer.step.training_step` for this recipe: None (the
    model's own loss) or, for ``training.objective: dpo``, TRL's DPO loss
    (:func:`memtrain.trainer.preference.reference_step`; it adds TRL's head to ``model``)."""
    if cfg.training.objective != "dpo":
        return None
    from memtrain.trainer.preference import reference_step

    return reference_step(cfg, model)


def step_settings(cfg: RunConfig) -> dict[str, Any]:
    """The recipe values :func:`memtrain.trainer.step.training_step` needs: micro-batch,
    accumulation, clipping."""
    from memtrain.config.batch import resolve_batch

    batch = resolve_batch(cfg.training, cfg.distributed.processes)
    return {"micro_batch_size": batch.micro, "accumulation": batch.accumulation,
            "max_grad_norm": cfg.training.max_grad_norm}
