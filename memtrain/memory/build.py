"""Build what a training step holds — model, optimizer, batch — the one way training does it.

Training (:mod:`memtrain.runner`), measurement (the benchmarks) and estimation
(:mod:`memtrain.memory.estimate`) all build through this module, so they cannot drift apart:

- :func:`build_model` loads the real model (:func:`memtrain.model.load_model`) and applies the
  recipe's patches; :func:`build_fake_model` builds the same architecture on fake tensors, with
  the same load arguments, quantized the way loading quantizes, and the same patches.
- :func:`build_optimizer` is the Trainer's own ``create_optimizer`` (parameter groups, optimizer
  class from ``training.optimizer``, bitsandbytes embedding overrides), called without a Trainer.
- :func:`memtrain.step.training_step` (re-exported here) is the one optimizer step every
  estimate, measurement, probe and sharded trace runs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, TrainingArguments

from memtrain import patches
from memtrain.config import RunConfig
from memtrain.errors import MemtrainError
from memtrain.memory.fake import uninitialized_values
from memtrain.memory.meter import StepMemory
from memtrain.model import keep_4bit_trainable_on_cpu, load_model, model_class, model_kwargs
from memtrain.sharding import quant_storage
from memtrain.step import hold_gradients, training_step

__all__ = ["BuildError", "apply_patches", "build_fake_model", "build_model", "build_optimizer",
           "example_batch", "hold_gradients", "measure_recipe_step", "optimizer_arguments_for",
           "recipe_stage", "step_settings", "time_recipe_step", "training_step"]

# The recipe field each patch reads, for error messages.
PATCH_FIELDS = {"lora": "adapter", "chunked_loss": "memory.loss", "checkpointing": "memory.checkpointing",
                "offload": "memory.offload", "fewbit": "memory.activation_bits",
                "randomized_linear": "memory.randomized_linear", "tiled_mlp": "memory.tiled_mlp"}


class BuildError(MemtrainError):
    """Building what a recipe describes failed; the message names the recipe field involved."""


@contextmanager
def recipe_stage(field: str, what: str) -> Iterator[None]:
    """Turn a library exception raised while doing ``what`` into a :class:`BuildError` naming ``field``."""
    try:
        yield
    except MemtrainError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise BuildError(f"`{field}`: {what} failed: {type(err).__name__}: {first}. Fix: check `{field}` "
                         "(and that the model supports it).") from err


def apply_patches(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """:func:`memtrain.patches.apply_patches`, one patch at a time so a failure names its field.

    The model is first set up as the Trainer trains it: without a KV cache
    (``config.use_cache = TrainingArguments.use_cache``, False). With a cache, transformers builds
    one in every forward and then never reads packed rows' example boundaries from the position
    ids, so a step outside the Trainer (an estimate, a measurement) would attend across packed
    examples without a mask, holding less than the training step does.
    """
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    for name in patches.available():
        with recipe_stage(PATCH_FIELDS.get(name, f"patch {name}"), f"applying the {name} patch"):
            model = patches.apply_patches(model, cfg, only=[name])
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
    return apply_patches(model, cfg)


def build_fake_model(cfg: RunConfig, config: PretrainedConfig) -> nn.Module:
    """The same model on fake tensors; call inside :func:`memtrain.memory.fake.fake_tensor_mode`.

    Args:
        cfg: the recipe (model section for dtype/quantization, the rest for patches).
        config: the architecture (possibly with fewer layers than the real model).
    """
    source = "model.from_config" if cfg.model.from_config is not None else "model.name"
    with recipe_stage(source, f"building the {config.model_type} architecture"), uninitialized_values():
        model = model_class(cfg.model).from_config(config, **model_kwargs(cfg.model))
    if cfg.model.quantization not in ("none", "auto"):
        from memtrain.memory.quantized import quantize_fake

        with recipe_stage("model.quantization", f"quantizing to {cfg.model.quantization}"):
            model = quantize_fake(model, cfg.model, quant_storage(cfg))
        if cfg.model.quantization != "int8":
            keep_4bit_trainable_on_cpu(model)
    model.eval()  # as from_pretrained leaves it; the step switches to train mode
    return apply_patches(model, cfg)


def optimizer_arguments_for(cfg: RunConfig) -> TrainingArguments:
    """The ``TrainingArguments`` :func:`build_optimizer` reads: build them outside ``FakeTensorMode``."""
    from memtrain.trainer import optimizer_arguments

    with tempfile.TemporaryDirectory(prefix="memtrain-optim-") as tmp:
        return TrainingArguments(output_dir=tmp, use_cpu=not torch.cuda.is_available(),
                                 report_to="none", **optimizer_arguments(cfg))


def build_optimizer(cfg: RunConfig, model: nn.Module,
                    args: TrainingArguments | None = None) -> torch.optim.Optimizer:
    """The optimizer the Trainer would create for ``model`` under ``cfg``.

    Runs :meth:`memtrain.trainer.MemtrainTrainer.create_optimizer` (the stock Trainer's, unless
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
    from memtrain.trainer import MemtrainTrainer, trainer_options

    class OptimizerOnly(MemtrainTrainer):
        def __init__(self, args: TrainingArguments, model: nn.Module) -> None:  # no data, no accelerate
            self.args, self.model = args, model
            self.optimizer, self.optimizer_cls_and_kwargs = None, None
            # what MemtrainTrainer.__init__ sets before the stock constructor runs
            options = trainer_options(cfg)
            self.offload_optimizer = options["offload_optimizer"]
            self.optimizer_in_backward = options["optimizer_in_backward"]
            self.fsdp_plugin = None

    args = args or optimizer_arguments_for(cfg)
    with recipe_stage("training.optimizer", f"creating the {cfg.training.optimizer} optimizer"):
        return OptimizerOnly(args, model).create_optimizer()


def example_batch(cfg: RunConfig, config: PretrainedConfig, batch_size: int, seq_len: int,
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A worst-case batch: every row ``seq_len`` tokens long, laid out as memtrain's collators lay
    out real batches, so that attention takes the path a real step takes.

    Real batches reach transformers' masked attention: a padded batch carries an attention mask
    with zeros (``DataCollatorWithPadding``, ``DataCollatorForSeq2Seq``), and a packed row restarts
    its position ids (:mod:`memtrain.packing`), from which transformers builds a block-diagonal
    mask. A masked step holds more than an unmasked one of the same shape: the 4D mask (and, with
    SDPA, a float copy of it per layer) and, for grouped-query attention, keys and values repeated
    for every head (transformers' ``repeat_kv``), both kept for backward. So the longest batch has
    one padded token (the last of the last row; a one-token row has none to spare), and a packed
    row holds two examples.
    """
    generator = torch.Generator().manual_seed(0) if torch.device(device).type == "cpu" else None
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
        mask[-1, -1] = 0
        batch["attention_mask"] = mask
        if labels.dim() == 2:
            labels[-1, -1] = -100
    return batch


@contextmanager
def _warm_recipe_step(cfg: RunConfig, config: PretrainedConfig, micro_batch: int | None = None,
                      seq_len: int | None = None) -> Iterator[tuple[Callable[[], None], nn.Module,
                                                                   torch.optim.Optimizer, dict]]:
    """The recipe's real model, optimizer and example batch after one warm-up step (so optimizer
    state exists); yields ``(step, model, optimizer, batch)`` where ``step()`` runs the next one."""
    from memtrain.device import place
    from memtrain.memory.fake import isolated_bnb_overrides

    settings = step_settings(cfg)
    with isolated_bnb_overrides():
        # on the device training uses, whatever the dtype or quantization (as the Trainer places it)
        model = place(build_model(cfg, config.num_labels, config.pad_token_id))
        optimizer = build_optimizer(cfg, model)
        batch = example_batch(cfg, config, micro_batch or settings["micro_batch_size"],
                              seq_len or cfg.data.max_length, next(model.parameters()).device)

        def step() -> None:
            training_step(model, batch, optimizer, settings["accumulation"], settings["max_grad_norm"])

        step()
        yield step, model, optimizer, batch


def measure_recipe_step(cfg: RunConfig, config: PretrainedConfig, micro_batch: int | None = None,
                        seq_len: int | None = None) -> StepMemory:
    """Measure a real training step of the recipe: what the estimator predicts, for real.

    Builds the real model (:func:`build_model`) and the Trainer's optimizer, runs a warm-up step
    so optimizer state exists, and measures the next step with the memory meter.

    Args:
        cfg: the recipe.
        config: its architecture (for the vocabulary and head of the example batch).
        micro_batch: examples per step (default: the recipe's micro-batch size).
        seq_len: tokens per example (default: ``data.max_length``).
    """
    from memtrain.memory.meter import MemoryMeter

    with (_warm_recipe_step(cfg, config, micro_batch, seq_len) as (step, model, optimizer, batch),
          MemoryMeter(model, optimizer, inputs=batch) as meter):
        step()
    return meter.result()


def time_recipe_step(cfg: RunConfig, steps: int = 2) -> float:
    """Seconds of a real optimizer step of the recipe: the best of ``steps`` after a warm-up step.

    Builds the real model and optimizer on this machine's device, with a worst-case batch
    (``data.max_length`` tokens per example); what the planner's tuning measures.
    """
    from memtrain.device import synchronize
    from memtrain.memory.trace_plan import resolve_config

    config, _ = resolve_config(cfg.model)
    torch.manual_seed(cfg.training.seed)
    with _warm_recipe_step(cfg, config) as (step, model, _optimizer, _batch):
        device = next(model.parameters()).device
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return min(times)


def step_settings(cfg: RunConfig) -> dict[str, Any]:
    """The recipe values :func:`training_step` needs: micro-batch, accumulation, clipping."""
    from memtrain.config.batch import resolve_batch

    batch = resolve_batch(cfg.training, cfg.distributed.processes)
    return {"micro_batch_size": batch.micro, "accumulation": batch.accumulation,
            "max_grad_norm": cfg.training.max_grad_norm}
