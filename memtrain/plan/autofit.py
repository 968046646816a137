"""Auto-fit micro-batch (``training.micro_batch_size: auto``): predicted, then confirmed for real.

The planner predicts the largest micro-batch whose step fits the budget, among those that keep
effective = micro × accumulation × processes exact (:func:`predict`). Before training starts,
:func:`confirm` runs one real probe step at that size on the data's longest batch
(:mod:`memtrain.data.rows`; without data, every example ``data.max_length`` tokens) on the real
model with the Trainer's own optimizer, under the
real or simulated budget. If it runs out of memory, the probe steps down to the next valid
micro-batch (a divisor of the per-process effective batch) and tries again; the Trainer's batch
arguments are then set to what fitted.

With several processes every process probes its own shard of the model under its own budget, and
they decide each step together (:mod:`memtrain.distributed.together`): they start from the smallest predicted
micro-batch, and after each probe step one all-reduce says whether it fitted in *every* process,
so all keep the same micro-batch: the largest that fits in each, i.e. the minimum over the
processes of what each alone would keep. The budget defers its out-of-memory error to the end of
the probe step (:mod:`memtrain.reliability.budget`), since a process that stopped half-way would leave
the others in a collective; a real allocation failure in one process stops the run with its error.

Why a probe at all when the estimate is exact on CPU: on a GPU the caching allocator, the CUDA
context and kernels' workspaces are modelled, not traced, and data can differ from the recipe's
model of it. A probe costs one step; a step that fails at step 1000 costs much more (that case is
handled by :mod:`memtrain.reliability.recovery`).

What the probe leaves behind: nothing. Its optimizer is a separate instance of the one training
will create (made by the Trainer's own ``create_optimizer``), run with learning rate 0 (parameters
do not change: updates are ``0 × finite``), and dropped afterwards; gradients are set to None.
Optimizer state exists during the probe, created by a one-example warm-up step of a few tokens,
because a training step from step 2 on holds it. With gradient accumulation the probe runs one
micro-batch on zero gradients held for every trainable parameter, the state every micro-batch after
the first runs in (the step's peak), at the cost of one forward and backward.

Compared with ``TrainingArguments(auto_find_batch_size=True)`` (accelerate's
``find_executable_batch_size``): that halves the batch after each out-of-memory error, restarts
the training loop, and changes the effective batch; ``scripts/bench/planner/autofit.py`` measures both.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memtrain._compat.transformers_trainer import set_train_batch_size
from memtrain.config import RunConfig
from memtrain.config.batch import Batch, valid_batches
from memtrain.data.rows import Rows, worst_case
from memtrain.device import model_device
from memtrain.distributed.together import drop_gradients, flagged_ranks, largest, smallest, world
from memtrain.errors import MemtrainError, first_line
from memtrain.reliability.budget import budget_guard, resolve_budget, usable_bytes
from memtrain.reliability.oom import free_memory
from memtrain.reliability.recovery import reset_module_tracking
from memtrain.trainer.step import hold_gradients, training_step
from memtrain.units import format_bytes

log = logging.getLogger(__name__)


@dataclass
class Probe:
    """What :func:`confirm` did: the batch it chose and each micro-batch it tried."""

    batch: Batch
    tried: list[tuple[int, bool]] = field(default_factory=list)  # (micro-batch, fitted)
    peak_bytes: int | None = None  # live tensor bytes of the step that fitted (when tracked)
    limit_bytes: int | None = None
    seconds: float = 0.0
    over_budget: dict[int, list[int]] = field(default_factory=dict)  # several processes: who did not fit
    step: str = ""  # what the probe step ran, where it is not the model's own loss on the longest rows

    @property
    def failed(self) -> int:
        """Out-of-memory attempts before the probe that fitted."""
        return sum(1 for _, ok in self.tried if not ok)


def budget_limit(cfg: RunConfig) -> int | None:
    """The bytes a probe step must stay under: the budget's usable part (``memory.budget_setting``,
    less ``memory.margin``), as the planner plans for it; None without a budget."""
    budget = resolve_budget(cfg.memory.budget_setting)
    return None if budget is None else usable_bytes(budget, cfg.memory.margin_fraction)


def predict(cfg: RunConfig, usable: int | None = None,
            rows: Rows | None = None) -> tuple[RunConfig, Batch, int]:
    """The predicted largest micro-batch: the recipe with it filled in, the batch, the predicted peak.

    Uses the planner (:func:`memtrain.plan.planner.fit_micro_batch`: the estimator's traces, exact in
    the micro-batch). ``usable`` defaults to the budget (or simulated budget) minus ``memory.margin``;
    ``rows`` is the data's longest batch (default: the recipe's worst case, :mod:`memtrain.data.rows`).

    Raises:
        MemtrainError: no budget to fit into, or not even the smallest micro-batch fits.
    """
    if usable is None:
        total = resolve_budget(cfg.memory.budget_setting)
        if total is None:
            raise MemtrainError("`training.micro_batch_size: auto` needs a budget to fit into. Fix: set "
                                "`memory.budget` (e.g. `24GiB` or `auto`), or a number of examples.")
        usable = usable_bytes(total, cfg.memory.margin_fraction)
    from memtrain.plan.planner import fit_micro_batch

    pairs = valid_batches(cfg.training, cfg.distributed.processes)
    micro, _accum, peak = fit_micro_batch(cfg, usable, rows=rows)
    accum = dict(pairs)[micro]
    return with_batch(cfg, micro, accum), Batch(micro, accum, cfg.distributed.processes), peak


def for_estimate(cfg: RunConfig, device: str | None = None,
                 rows: Rows | None = None) -> tuple[RunConfig, str | None]:
    """``memtrain estimate`` of ``training.micro_batch_size: auto``: the recipe with a micro-batch
    to estimate, and a sentence saying which and why (None when the recipe gives a number).

    With ``memory.budget`` (or a simulated budget): the largest micro-batch predicted to fit it,
    as training would plan it (:func:`memtrain.plan.planner.fit_micro_batch`); when not even the
    smallest fits, the smallest, said so. Without a budget: the smallest micro-batch.
    """
    if cfg.training.micro_batch_size != "auto":
        return cfg, None
    from memtrain.plan.planner import NothingFits, budget_bytes, fit_micro_batch

    pairs = valid_batches(cfg.training, cfg.distributed.processes)
    micro, accum = pairs[0]
    setting = cfg.memory.budget_setting
    if setting is None:
        return with_batch(cfg, micro, accum), (
            f"training.micro_batch_size is auto and no memory.budget is set: estimated the smallest "
            f"micro-batch, {micro}. Set memory.budget (e.g. memory.budget=24GiB) to estimate the largest "
            "that fits it, as `memtrain train` would choose.")
    usable = usable_bytes(budget_bytes(cfg, setting, device), cfg.memory.margin_fraction)
    try:
        micro, accum, _peak = fit_micro_batch(cfg, usable, device=device, rows=rows)
    except NothingFits as err:
        return with_batch(cfg, micro, accum), (
            f"training.micro_batch_size is auto: estimated the smallest micro-batch, {micro}, which does "
            f"not fit memory.budget {setting} either ({err}).")
    return with_batch(cfg, micro, accum), (
        f"training.micro_batch_size is auto: estimated {micro}, the largest micro-batch predicted to fit "
        f"memory.budget {setting} ({format_bytes(usable)} usable after the {cfg.memory.margin_fraction:.0%} "
        "margin), as `memtrain train` would choose it before its probe step.")


def with_batch(cfg: RunConfig, micro: int, accumulation: int) -> RunConfig:
    """``cfg`` with the micro-batch and accumulation set (the effective batch is unchanged)."""
    training = cfg.training.model_copy(update={"micro_batch_size": micro,
                                               "gradient_accumulation": accumulation})
    return cfg.model_copy(update={"training": training})


def confirm(trainer: Any, cfg: RunConfig, batch: Batch, *, choices: list[tuple[int, int]] | None = None,
            limit: int | None = None, rows: Rows | None = None) -> Probe:
    """Confirm ``batch`` with one real probe step, stepping down until a step fits; set the Trainer.

    Args:
        trainer: the Trainer about to train (``memtrain.trainer.trainer.build_trainer``); its model is
            probed, and its batch arguments are set to the batch that fits.
        cfg: the recipe (optimizer, clipping, task); ``training.micro_batch_size`` may be ``auto``.
        batch: the predicted batch (:func:`predict`).
        choices: the (micro, accumulation) pairs the recipe allows, :func:`valid_batches` of the
            recipe as written (before ``auto`` was filled in); default: every micro-batch that
            divides ``batch``'s per-process effective batch.
        limit: bytes the step must stay under (default: :func:`budget_limit`); ``None`` runs the
            probe without a tracker, so only a real out-of-memory error stops it.
        rows: the data's longest batch, which the probe steps on (default: the recipe's worst
            case, every row ``data.max_length`` tokens; :mod:`memtrain.data.rows`).

    Raises:
        MemtrainError: not even the smallest valid micro-batch fits (the message has the numbers).
    """
    start = time.perf_counter()
    limit = budget_limit(cfg) if limit is None else limit
    rows = rows or worst_case(cfg)
    per_process = batch.micro * batch.accumulation
    if choices is None:
        choices = [(m, per_process // m) for m in range(1, per_process + 1) if per_process % m == 0]
    model = trainer.model
    device = _device(model)
    # With several processes (machines may have planned apart: `memory.budget: auto`) all start
    # from the smallest prediction and take each decision together, so they try the same
    # micro-batches in the same order: the one they keep is the largest that fits in every process.
    micro = smallest([batch.micro], device)[0]
    top = batch.accumulation if micro == batch.micro else dict(choices).get(micro, per_process // micro)
    pairs = [p for p in choices if p[0] < micro] + [(micro, top)]
    probe = Probe(batch, limit_bytes=limit)
    loss_fn = _trainer_loss(trainer, cfg)
    if cfg.training.objective == "grpo":
        probe.step = (f"TRL's GRPO training step on {rows.longest}-token prompts + "
                      f"{cfg.training.grpo_max_completion_length}-token completions (the generation "
                      "phase is predicted, not probed)")
    with _probe_optimizer(trainer, cfg, model, loss_fn) as optimizer:
        for micro, accum in sorted(pairs, reverse=True):
            fits, peak = _try_step(cfg, model, optimizer, micro, min(accum, 2), rows, limit, loss_fn)
            over = flagged_ranks(not fits, device)
            peak = largest([peak or 0], device)[0] or None  # the highest process's
            probe.tried.append((micro, not over))
            if over and world()[1] > 1:
                probe.over_budget[micro] = over
            if not over:
                probe.batch, probe.peak_bytes = Batch(micro, accum, batch.processes), peak
                break
    probe.seconds = time.perf_counter() - start
    if not probe.tried[-1][1]:
        raise MemtrainError(
            f"`training.micro_batch_size: auto`: not even micro-batch {probe.tried[-1][0]} of "
            f"{rows.longest} tokens fits {_limit_text(limit)} (probe step on the real model"
            f"{_where(probe, probe.tried[-1][0])}). Fix: raise `{cfg.memory.budget_field}`, shorten "
            "`data.max_length`, or save memory (`memtrain plan`).")
    set_batch(trainer, probe.batch)
    _forget_probe_metrics(trainer)
    # debug: memtrain.run.train prints the same line (every process, any caller), and the command
    # line shows memtrain's INFO records (it printed the line twice)
    log.debug(describe(probe, rows.longest))
    return probe


def _trainer_loss(trainer: Any, cfg: RunConfig) -> Any:
    """The probe's loss, as the training step computes it: the model's own; for DPO the Trainer's
    ``compute_loss`` (TRL's: 2B rows and the reference forward); for GRPO TRL's ``compute_loss`` on
    what generation hands it, the worst case (:func:`memtrain.estimator.grpo.step_batch`: every
    completion full length after the longest prompt), in place of the example batch's rows."""
    if cfg.training.objective == "dpo":
        return lambda model, batch: trainer.compute_loss(model, batch)
    if cfg.training.objective != "grpo":
        return None
    from memtrain.estimator.grpo import step_batch

    def grpo_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, prompt = batch["input_ids"].shape
        device = batch["input_ids"].device
        inputs = {k: v.to(device) for k, v in step_batch(trainer, rows, prompt=prompt).items()}
        if not hasattr(trainer, "current_gradient_accumulation_steps"):  # the training loop sets it
            trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        return trainer.compute_loss(model, inputs)

    return grpo_loss


def _forget_probe_metrics(trainer: Any) -> None:
    """TRL's trainers collect metrics in ``compute_loss`` (the token count among them): the probe's
    steps are not training steps, so what they added is dropped."""
    from memtrain._compat.trl import forget_metrics

    forget_metrics(trainer)


def set_batch(trainer: Any, batch: Batch) -> None:
    """Point a Trainer that has not started training at another micro-batch and accumulation."""
    trainer.args.per_device_train_batch_size = batch.micro
    trainer.args.per_device_eval_batch_size = batch.micro
    trainer.args.gradient_accumulation_steps = batch.accumulation
    set_train_batch_size(trainer, trainer.args.train_batch_size)


# ------------------------------------------------------------------------------ the probe


@contextlib.contextmanager
def _probe_optimizer(trainer: Any, cfg: RunConfig, model: nn.Module,
                     loss_fn: Any = None) -> Iterator[torch.optim.Optimizer]:
    """The optimizer training will create, at learning rate 0, with its state; gone afterwards."""
    from memtrain.errors import recipe_stage
    from memtrain.trainer.build import example_batch

    if trainer.optimizer is not None:
        raise ValueError("auto-fit probes before training: the Trainer must not have an optimizer yet")
    # The Trainer's own create_optimizer (memtrain.trainer.build.build_optimizer would make new
    # TrainingArguments, which resets accelerate's state under a live Trainer); training makes its own.
    optimizer = trainer.create_optimizer()
    trainer.optimizer = None
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    was_training = model.training
    try:
        # a one-example, few-token step creates the optimizer state a training step holds
        config = getattr(model, "config", None)
        tiny = example_batch(cfg, config, 1, min(8, cfg.data.max_length), _device(model))
        with recipe_stage("training.micro_batch_size", "the auto-fit probe's warm-up step"):
            training_step(model, tiny, optimizer, skip_non_finite=True, loss_fn=loss_fn)
        yield optimizer
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        # offload and in-backward optimizers step from gradient hooks that hold them: unregister
        # those, or the probe's optimizer and its host state would live on beside training's
        remove_hooks = getattr(optimizer, "remove_hooks", None)
        if remove_hooks is not None:
            remove_hooks()
        del optimizer
        free_memory()


def _try_step(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer, micro: int,
              micro_batches: int, rows: Rows, limit: int | None, loss_fn: Any = None
              ) -> tuple[bool, int | None]:
    """Run the probe step: whether it fitted in this process, and its peak (None when untracked).

    With several processes the budget defers (:mod:`memtrain.reliability.budget`): the step runs to
    its end in every process, whose collectives must all happen, and the caller compares notes.
    """
    from memtrain.trainer.build import example_batch

    several = world()[1] > 1
    # The earlier micro-batches' gradients: held ones, and one forward+backward shows the peak;
    # FSDP2 keeps them full and unsharded until the last micro-batch, so run two micro-batches.
    held = micro_batches > 1 and not hasattr(model, "set_requires_gradient_sync")
    if held:
        hold_gradients(model)
    simulated = cfg.memory.simulate_budget is not None
    budget = (budget_guard(limit, model, optimizer, device=_device(model), simulated=simulated,
                           defer=several) if limit is not None else contextlib.nullcontext())
    try:
        with budget:
            sequences = micro * (2 if cfg.training.objective == "dpo" else 1)  # DPO: [chosen; rejected]
            inputs = example_batch(cfg, model.config, micro, rows.longest, _device(model),
                                   padded=rows.padded(sequences))  # laid out as the real longest batch
            training_step(model, inputs if held or micro_batches == 1 else [inputs] * 2, optimizer,
                          micro_batches, cfg.training.max_grad_norm, held_gradients=held,
                          skip_non_finite=True, loss_fn=loss_fn)
            del inputs
    except torch.OutOfMemoryError as err:
        if several:  # a real allocation failure half-way: the others wait in a collective
            raise _in_one_process(err, micro) from None
        failed = True
    else:
        take = getattr(budget, "take_overrun", None)  # a deferring budget's note
        failed = take is not None and take() is not None
    drop_gradients(model)  # outside the except block: the failed step's tensors are gone
    free_memory()
    reset_module_tracking()
    if failed:
        log.info("auto-fit probe: micro-batch %d of %d tokens ran out of memory", micro, rows.longest)
        return False, None
    return True, getattr(budget, "peak_bytes", None)


def _in_one_process(err: BaseException, micro: int) -> MemtrainError:
    rank, size = world()
    first = first_line(err)
    return MemtrainError(
        f"`training.micro_batch_size: auto`: the probe step of micro-batch {micro} ran out of device "
        f"memory in process {rank} of {size} ({first}); the processes cannot go on together from a step "
        "one of them left half-way. Fix: set `memory.budget` below the device's memory (the probe then "
        "stops at the budget in every process), or give `training.micro_batch_size` a number.")


def _where(probe: Probe, micro: int) -> str:
    over = probe.over_budget.get(micro)
    return f" in process(es) {over}" if over else ""


def _device(model: nn.Module) -> torch.device:
    return model_device(model)


def _limit_text(limit: int | None) -> str:
    return f"the {format_bytes(limit)} limit" if limit is not None else "the device's memory"


def describe(probe: Probe, seq_len: int) -> str:
    """One line: the batch a probe confirmed, what it tried, its peak and time."""
    b = probe.batch
    steps = ", ".join(f"{m} {'fits' if ok else 'out of memory'}{_where(probe, m)}" for m, ok in probe.tried)
    peak = f", peak {format_bytes(probe.peak_bytes)}" if probe.peak_bytes is not None else ""
    return (f"auto-fit: micro-batch {b.micro} × {b.accumulation} accumulated (effective {b.effective}) "
            f"confirmed by a probe step of {probe.step or f'{seq_len} tokens per example'} under "
            f"{_limit_text(probe.limit_bytes)} ({steps}{peak}; {probe.seconds:.1f} s)")
