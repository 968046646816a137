"""The recipe's real training step, built and run here: what the estimator predicts, for real.

The planner's ``--tune`` times real steps (:func:`time_recipe_step`), auto-fit and the tests
measure them (:func:`measure_recipe_step`). Both build the model, the Trainer's optimizer and the
worst-case batch through :mod:`memtrain.trainer.build`, as training does, and run one warm-up
step first so optimizer state exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig

from memtrain.config import RunConfig
from memtrain.device import model_device
from memtrain.memory.meter import StepMemory
from memtrain.trainer.build import build_model, build_optimizer, example_batch, step_loss, step_settings
from memtrain.trainer.step import training_step


@contextmanager
def warm_recipe_step(cfg: RunConfig, config: PretrainedConfig, micro_batch: int | None = None,
                      seq_len: int | None = None) -> Iterator[tuple[Callable[[], None], nn.Module,
                                                                   torch.optim.Optimizer, dict]]:
    """The recipe's real model, optimizer and example batch after one warm-up step (so optimizer
    state exists); yields ``(step, model, optimizer, batch)`` where ``step()`` runs the next one."""
    from memtrain.device import place
    from memtrain.estimator.fake import isolated_bnb_overrides

    settings = step_settings(cfg)
    with isolated_bnb_overrides():
        # on the device training uses, whatever the dtype or quantization (as the Trainer places it)
        model = place(build_model(cfg, config.num_labels, config.pad_token_id))
        optimizer = build_optimizer(cfg, model)
        batch = example_batch(cfg, config, micro_batch or settings["micro_batch_size"],
                              seq_len or cfg.data.max_length, model_device(model))
        loss_fn = step_loss(cfg, model)

        def step() -> None:
            training_step(model, batch, optimizer, settings["accumulation"], settings["max_grad_norm"],
                          loss_fn=loss_fn)

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

    with (warm_recipe_step(cfg, config, micro_batch, seq_len) as (step, model, optimizer, batch),
          MemoryMeter(model, optimizer, inputs=batch) as meter):
        step()
    return meter.result()


def time_recipe_step(cfg: RunConfig, steps: int = 2) -> float:
    """Seconds of a real optimizer step of the recipe: the best of ``steps`` after a warm-up step.

    Builds the real model and optimizer on this machine's device, with a worst-case batch
    (``data.max_length`` tokens per example); what the planner's tuning measures.
    """
    from memtrain.device import synchronize
    from memtrain.estimator.setup import resolve_config

    config, _ = resolve_config(cfg.model)
    torch.manual_seed(cfg.training.seed)
    with warm_recipe_step(cfg, config) as (step, model, _optimizer, _batch):
        device = model_device(model)
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
    return min(times)
