"""``memtrain train``: the whole run, from a validated recipe to a saved adapter and metrics.

Order matters for failing fast: the output folder and the length (against the model's positions)
are checked before anything else, the data before the model is loaded, so a user mistake costs
seconds, not a plan, a tokenized dataset or a model download.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import TrainerCallback, set_seed

from memtrain import patches
from memtrain.config import Problem, RecipeError, RunConfig, dump_recipe
from memtrain.config.batch import Batch, resolve_batch, valid_batches
from memtrain.data.prepare import PreparedData, cut_to, prepare_data, read_data
from memtrain.data.rows import Rows
from memtrain.device import cuda_available
from memtrain.distributed import fsdp as distributed
from memtrain.errors import MemtrainError, first_line
from memtrain.estimator.estimate import Estimate, estimate
from memtrain.estimator.setup import check_max_length, check_positions
from memtrain.memory import hostmem
from memtrain.memory.meter import StepMemory
from memtrain.memory.report import Report, build_report, comparison, save_report
from memtrain.model import count_parameters, load_tokenizer
from memtrain.plan import autofit, planner
from memtrain.reliability import checkpoints, rundir
from memtrain.reliability.budget import SimulatedBudgetCallback
from memtrain.reliability.guards import GracefulStop, Interrupted, StopOnSignal
from memtrain.reliability.recovery import memory_fixes
from memtrain.run import launch
from memtrain.trainer.build import build_model
from memtrain.trainer.callbacks import MemoryMeterCallback
from memtrain.trainer.trainer import add_derived_metrics, build_trainer
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

RECIPE_FILE, METRICS_FILE, LABELS_FILE = "recipe.yaml", rundir.METRICS_FILE, "labels.json"


@dataclass
class TrainResult:
    """What a finished run produced."""

    output_dir: Path
    metrics: dict[str, float]
    batch: Batch
    patches: list[str] = field(default_factory=list)
    memory: StepMemory | None = None  # the measured step with the highest peak
    log_history: list[dict[str, Any]] = field(default_factory=list)
    model: Any = field(default=None, repr=False)  # the trained (patched) model; None from a launch
    process_memory: list[StepMemory | None] = field(default_factory=list)  # by rank, several processes


def train(cfg: RunConfig, console: Console | None = None,
          callbacks: list[TrainerCallback] | None = None, *,
          autofit_choices: list[tuple[int, int]] | None = None) -> TrainResult:
    """Fine-tune as the recipe says and save the result in ``cfg.output.dir``.

    ``autofit_choices`` is set by memtrain's launcher in each process it starts: the (micro-batch,
    accumulation) pairs the recipe allowed before the launcher planned ``micro_batch_size: auto``,
    among which the processes confirm the planned one with a probe step.

    Raises:
        MemtrainError: a user-fixable problem (data, output folder, settings), before heavy work.
    """
    console = console or Console()
    out = Path(cfg.output.dir)
    resume_from = rundir.check_output_dir(cfg, out)  # first: before the plan and the data (seconds)
    check_max_length(cfg)
    # micro_batch_size: auto is predicted by the planner and confirmed by a probe step once the
    # Trainer exists, among the batches the recipe as written allows
    choices = valid_batches(cfg.training, cfg.distributed.processes) if (
        cfg.training.micro_batch_size == "auto") else autofit_choices
    if choices and cfg.memory.budget_setting is None:
        raise MemtrainError(
            "`training.micro_batch_size`: `auto` picks the largest micro-batch that fits "
            "`memory.budget`, and no budget is set (it would plan against all of this machine's "
            "memory). Fix: set `memory.budget` (e.g. `memory.budget=8GiB`, or `auto` for the free "
            "memory), or give `training.micro_batch_size` a number.")
    planning = planner.auto_fields(cfg) or (cfg.memory.budget is not None and "WORLD_SIZE" not in os.environ)
    planned_length = cfg.data.max_length == "auto"
    whole = None
    if planned_length:  # the longest length that fits (no longer than the data's longest row, read
        # uncut: the plan traces the data's own rows where nothing is cut); then the data is cut to it
        set_seed(cfg.training.seed)
        tokenizer = load_tokenizer(cfg.model)
        uncut_rows, whole = read_data(cfg, tokenizer)
        cfg, planning = _plan(cfg, console, uncut_rows), False
    if planning or not launch.launch_needed(cfg):
        # the data before the plan: the plan, the prediction and the auto-fit probe are for the
        # longest batch these rows make, not for rows of data.max_length (memtrain.data.rows)
        set_seed(cfg.training.seed)
        if whole is None:
            tokenizer = load_tokenizer(cfg.model)
            data = prepare_data(cfg, tokenizer)
        else:  # read once where the planned length cuts no row
            data = cut_to(whole, cfg, tokenizer)
        rows = data.rows(cfg)
        if cfg.training.objective == "grpo":  # loss type, rewards on a real row, prompt + completion length
            from memtrain.estimator.grpo import check_grpo

            check_grpo(cfg, data)
        if planned_length and data.truncated:
            console.print(f"{data.truncated:,} training examples were cut at the "
                          f"planned data.max_length={cfg.data.max_length:,}", style="yellow", highlight=False)
    if planning:
        cfg = _plan(cfg, console, rows)  # once, before any process starts: every process gets the decision
    if launch.launch_needed(cfg):  # start the processes; each comes back here as a worker
        return _launch(cfg, callbacks, choices)
    launch.bind_device()
    # on the CPU, tensors above 32 MiB would otherwise page-fault on every step
    kept_pages = not cuda_available() and hostmem.keep_freed_pages()
    set_seed(cfg.training.seed)
    batch = resolve_batch(cfg.training, cfg.distributed.processes)
    model = build_model(cfg, data.num_labels, tokenizer.pad_token_id, data.label_names)
    check_positions(model.config, rows.longest)  # the loaded config (a hub id the check above could not read)
    check_token_ids(cfg, data, model)
    # before the processes' group exists: the estimate traces sharding in a group of its own
    predicted = _predict(cfg, rows) if cfg.output.report else None
    model = distributed.shard_model(model, cfg)  # FSDP2 with several processes, else unchanged
    rundir.clear_old_run(cfg, out)  # only now: a data or model mistake leaves the old run whole
    rundir.claim(out)
    _startup_table(console, cfg, model, data, batch, kept_pages)
    meter = MemoryMeterCallback(every=cfg.training.logging_steps,
                                predicted_bytes=predicted.peak_bytes if predicted else None)
    guards: list[TrainerCallback] = [meter]
    if cfg.memory.simulate_budget is not None:
        guards.insert(0, SimulatedBudgetCallback(cfg.memory.simulate_budget))
    with GracefulStop() as stop:
        stopper = StopOnSignal(stop)
        every = [*guards, stopper, *(callbacks or [])]
        if cfg.training.objective == "dpo":  # TRL's DPOTrainer behind memtrain's (one process)
            from memtrain.trainer.preference import build_dpo_trainer

            trainer = build_dpo_trainer(cfg, model, tokenizer, data, batch, str(out), every)
        elif cfg.training.objective == "grpo":  # TRL's GRPOTrainer, HF generation (one process)
            from memtrain.trainer.grpo import build_grpo_trainer

            trainer = build_grpo_trainer(cfg, model, tokenizer, data, batch, str(out), every)
            _predict_grpo(trainer, meter, console)
        else:
            trainer = build_trainer(cfg, model, tokenizer, data, batch, str(out), every,
                                    fsdp_plugin=distributed.fsdp_plugin(model, cfg))
        meter.attach(trainer)  # ahead of the reporting integrations: they log its memory entries
        if choices:
            batch = _confirm_batch(trainer, cfg, batch, choices, console, rows)
            cfg = planner.with_values(cfg, {"training.micro_batch_size": batch.micro,
                                            "training.gradient_accumulation": batch.accumulation})
        resumed_at, trainer.runtime_before = checkpoints.progress(resume_from) if resume_from else (0, 0.0)
        try:
            train_output = trainer.train(resume_from_checkpoint=resume_from)
        except torch.OutOfMemoryError as err:  # what recovery could not fix (it raises MemtrainErrors)
            if isinstance(err, MemtrainError):
                raise
            raise _out_of_memory(err, trainer.state.global_step + 1, out, cfg) from None
        finally:  # leave the dispatch modes in reverse order, also when a step raised
            for guard in reversed(guards):
                guard.close()
    signum = stopper.signum or stop.signum  # stopper's: the same in every process
    if signum is not None:
        step = trainer.state.global_step
        raise Interrupted(
            f"Stopped by {signal.Signals(signum).name} after step {step}; the checkpoint is "
            f"{out / f'checkpoint-{step}'}. Resume with the same command plus `training.resume=true`.",
            signum,
        )
    if trainer.nonfinite.stopped_at is not None:
        raise trainer.nonfinite.error(out)
    metrics = _whole_run(dict(train_output.metrics), trainer.state, resumed_at, trainer.runtime_before)
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    metrics = add_derived_metrics(metrics, cfg, data)
    report = None
    if cfg.output.report and meter.worst is not None:
        report = _report(cfg, meter.worst, trainer.state.log_history, predicted, batch, rows, meter.largest)
    _save_final(trainer, tokenizer, cfg, metrics, out, report, data.label_names)
    print_summary(console, metrics, out, report)
    return TrainResult(out, metrics, batch, [r.detail for r in patches.records(model)],
                       meter.worst, list(trainer.state.log_history), model)


def _whole_run(metrics: dict[str, Any], state: Any, resumed_at: int, runtime_before: float) -> dict[str, Any]:
    """After a resume, ``train_loss`` and ``train_runtime`` over the whole run, not just its last part.

    The Trainer's own figures cover the steps of this call only. The steps before the resume come
    from the checkpoint's log (each logged loss is the mean over the steps since the previous log)
    and its manifest (training seconds so far); ``resumed_from_step`` says a resume happened.
    """
    if not resumed_at:
        return metrics
    done = state.global_step
    logged = sorted((h["step"], h["loss"]) for h in state.log_history
                    if "loss" in h and h.get("step", 0) <= resumed_at)
    weighted, previous = 0.0, 0
    for step, loss in logged:
        weighted += loss * (step - previous)
        previous = step
    if previous and done > 0 and "train_loss" in metrics:  # unlogged steps count at the logged mean
        before = weighted / previous * resumed_at
        metrics["train_loss"] = (before + metrics["train_loss"] * (done - resumed_at)) / done
    metrics["train_runtime"] = metrics.get("train_runtime", 0.0) + runtime_before
    metrics["resumed_from_step"] = resumed_at
    return metrics


def _out_of_memory(err: BaseException, step: int, out: Path, cfg: RunConfig) -> MemtrainError:
    resume = ("; then add `training.resume=true` to continue from the checkpoint"
              if checkpoints.newest_finite(out) is not None else "")
    return MemtrainError(f"Out of memory in optimizer step {step}: {first_line(err)} "
                         f"{checkpoints.kept_sentence(out)} Fix: {memory_fixes(cfg)}{resume}.")


def _confirm_batch(trainer: Any, cfg: RunConfig, batch: Batch, choices: list[tuple[int, int]],
                   console: Console, rows: Rows) -> Batch:
    """``micro_batch_size: auto``: one real probe step confirms (or steps down) the predicted batch."""
    probe = autofit.confirm(trainer, cfg, batch, choices=choices, rows=rows)
    console.print(autofit.describe(probe, rows.longest))
    return probe.batch


def check_token_ids(cfg: RunConfig, data: PreparedData, model: torch.nn.Module) -> None:
    """Every token id of the data must have a row in the model's input embedding: a tokenizer with
    more ids than the model (a `model.from_config` built with a smaller `vocab_size`) otherwise
    fails the first lookup with an IndexError deep in the model, after the plan and the load."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    top = data.largest_token_id()
    if not isinstance(rows, int) or top is None or top < rows:
        return
    if cfg.model.from_config is not None:
        raise RecipeError([Problem("model.from_config.vocab_size", rows,
                                   "too small for the data's token ids (the largest is "
                                   f"{top:,}, from `model.tokenizer`)",
                                   f"set `model.from_config.vocab_size` to at least {top + 1:,}, or "
                                   "use a tokenizer whose ids the model has.")])
    raise RecipeError([Problem("model.tokenizer", cfg.model.tokenizer or cfg.model.name,
                               "gives token ids the model has no embedding row for (the largest is "
                               f"{top:,}; the model has {rows:,} rows)",
                               "use the model's own tokenizer (leave `model.tokenizer` unset), or a "
                               "model whose vocabulary holds the tokenizer's ids.")])


def _plan(cfg: RunConfig, console: Console, rows: Rows | None) -> RunConfig:
    """Decide the recipe's `auto` fields (or check the fixed ones fit its budget) and say why."""
    from memtrain.plan.view import print_plan

    try:
        decided = planner.plan(cfg, rows=rows)
    except planner.NothingFits as err:
        raise MemtrainError(str(err)) from None
    print_plan(console, decided)
    return decided.apply(cfg)


def _predict(cfg: RunConfig, rows: Rows) -> Estimate | None:
    """The estimator's prediction of this run's longest step (for the report), or None if it cannot
    say; with several processes, the most one process holds. The estimate traces sharding in a
    process group of its own, so once the run's group exists it runs in a fresh process (rank 0's
    report only: the others' are not kept)."""
    import torch.distributed as dist

    if cfg.distributed.processes > 1 and dist.is_available() and dist.is_initialized():
        return _predict_apart(cfg, rows) if dist.get_rank() == 0 else None
    try:
        return estimate(cfg, rows=rows)
    except (MemtrainError, RuntimeError, ValueError, NotImplementedError) as err:
        log.warning("no memory prediction for the report: %s", err)
        return None


def _predict_apart(cfg: RunConfig, rows: Rows) -> Estimate | None:
    """:func:`_predict` in a new process, outside the launcher's environment and process group."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=launch.forget_launch) as pool:
        return pool.submit(_predict, cfg, rows).result()


def _report(cfg: RunConfig, measured: StepMemory, log_history: list[dict[str, Any]],
            predicted: Estimate | None, batch: Batch, rows: Rows,
            largest: tuple[int, int] | None = None) -> Report:
    """The memory report: the measured step beside the prediction for the run's longest batch and,
    when the measured step held a smaller batch (the run ended before the longest), beside a
    prediction for the batch it held."""
    if predicted is None:
        return build_report(measured, log_history, None, _run_info(cfg, batch))
    # the batch the estimate traced (auto-fit may have stepped the micro-batch down since)
    longest = [predicted.settings["micro_batch_size"], predicted.settings["seq_len"]]
    if cfg.training.objective == "grpo":  # completions of their longest length after the prompts
        longest.append(cfg.training.grpo_max_completion_length)
    worst = predicted.to_dict() | {"batch": longest, "rows": rows.describe(longest[0])}
    same = None
    # the accumulation the measured step ran with (an out-of-memory split accumulates its pieces),
    # which decides whether gradients were held during its forward
    accumulation = measured.accumulation or batch.accumulation
    if measured.batch and (list(measured.batch) != longest or (accumulation > 1) != (batch.accumulation > 1)):
        held, tokens, *completion = measured.batch
        like = Rows(longest=tokens, uniform=rows.uniform, packed=rows.packed, read=rows.read)
        values = {"training.micro_batch_size": held, "training.gradient_accumulation": accumulation,
                  "training.effective_batch_size": None}
        if completion:  # GRPO: completions as long as the measured step's
            values["training.grpo_max_completion_length"] = completion[0]
        again = _predict(planner.with_values(cfg, values), like)
        same = (again.to_dict() | {"batch": list(measured.batch), "rows": like.describe(held, measured=True)}
                if again else None)
    run = _run_info(cfg, batch) | ({"largest_batch": list(largest)} if largest else {})  # the run's largest
    return build_report(measured, log_history, worst, run, same)


def _run_info(cfg: RunConfig, batch: Batch) -> dict[str, Any]:
    return {"title": cfg.description or cfg.output.dir, "batch": str(batch)}


def _launch(cfg: RunConfig, callbacks: list[TrainerCallback] | None,
            choices: list[tuple[int, int]] | None) -> TrainResult:
    """Several processes (the output folder was checked before they start): run them, return the
    result of this machine's first process (rank 0's on machine 0), with every process's measured
    memory."""
    if callbacks:
        raise MemtrainError(f"`distributed.processes={cfg.distributed.processes}`: Trainer callbacks "
                            "cannot be handed to other processes. Fix: run with one process, or launch "
                            "your own script with torchrun and call `memtrain.run.train.train` in it.")
    results = launch.launch(cfg, choices)
    first = results[0]
    first.process_memory = first.process_memory or [r.memory for r in results]
    return first


def _save_final(trainer: Any, tokenizer: Any, cfg: RunConfig, metrics: dict[str, Any],
                out: Path, report: Report | None, label_names: list[str] | None) -> None:
    """Write adapter/model, tokenizer, resolved recipe, metrics, class names and report, then
    move them in.

    ``metrics.json`` (what marks the run finished) moves in last; a full disk removes the partial
    files and names the checkpoint that is kept.
    """
    staging = out / ".final-tmp"
    if not trainer.is_world_process_zero():  # several processes: rank 0 writes everything
        if cfg.output.save_model:
            trainer.save_model(str(staging))  # ... but every process helps gather sharded weights
        return
    shutil.rmtree(staging, ignore_errors=True)
    estimate = checkpoints.checkpoint_bytes(trainer.model, None) if cfg.output.save_model else 0
    checkpoints.check_disk_space(out, estimate, "the final model")
    with checkpoints.disk_full_as_error(out, "the final model", staging):
        staging.mkdir(parents=True)
        if cfg.output.save_model:
            trainer.save_model(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / RECIPE_FILE).write_text(dump_recipe(rundir.portable_recipe(cfg)), encoding="utf-8")
        (staging / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True), encoding="utf-8")
        if label_names:  # an adapter folder does not keep the base config's id2label
            (staging / LABELS_FILE).write_text(json.dumps(label_names), encoding="utf-8")
        if report is not None:
            save_report(report, staging)
        checkpoints.sync_tree(staging)
    for item in sorted(staging.iterdir(), key=lambda p: p.name == METRICS_FILE):
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        item.replace(target)
    staging.rmdir()


def _predict_grpo(trainer: Any, meter: MemoryMeterCallback, console: Console) -> None:
    """The logged prediction of a GRPO run: TRL's own training step traced on the built Trainer
    (:func:`memtrain.estimator.trainer_loss.trainer_step_estimate`: its ``compute_loss`` on the worst-case
    generation output, every completion at full length after the longest prompt), or the analytic
    generation phase where that is larger. The report's prediction is the recipe estimate, which traces
    the same TRL step on the model built on fake tensors (:mod:`memtrain.estimator.grpo_step`)."""
    from memtrain.estimator.grpo import generation_beside, phase_peaks
    from memtrain.estimator.trainer_loss import trainer_step_estimate

    found = trainer_step_estimate(trainer)
    if not found.modelled or found.peak_bytes is None:
        console.print(f"GRPO: {found.describe()}; the logged prediction is the recipe estimate's",
                      style="yellow", highlight=False)
        return
    generation = generation_beside(trainer, found)
    meter.predicted_phases = phase_peaks(trainer, found)
    meter.predicted_bytes = max(meter.predicted_phases.values())
    console.print(f"GRPO: TRL's training step traced: {format_bytes(found.peak_bytes)} "
                  f"({found.describe()}); {generation.describe()}", highlight=False)


def _startup_table(console: Console, cfg: RunConfig, model: Any, data: PreparedData,
                   batch: Batch, kept_pages: bool) -> None:
    total, trainable = count_parameters(model)
    table = Table(title="memtrain run", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    m = cfg.model
    table.add_row("model", f"{m.name or m.from_config.get('model_type')} ({m.task})")
    table.add_row("parameters", f"{total:,} total, {trainable:,} trainable ({trainable / total:.2%})")
    table.add_row("weights", f"{m.dtype}, quantization {m.quantization}")
    unit = "packed rows" if data.fill is not None else "examples"
    sizes = f"{len(data.train):,} train, {len(data.eval) if data.eval is not None else 0:,} eval {unit}"
    if data.mix is None:
        table.add_row("data", f"{cfg.data.source}: {sizes}")
    else:
        table.add_row("data", f"{len(data.mix)} datasets mixed ({cfg.data.mix_stopping}): {sizes}")
        drawn, weights = sum(s.examples for s in data.mix), sum(s.weight for s in data.mix)
        for share in data.mix:
            table.add_row(f"  {share.path}", f"{share.source}: weight {share.weight:g} "
                          f"({share.weight / weights:.1%}), {share.examples:,} training examples "
                          f"({share.examples / max(drawn, 1):.1%})")
    if data.fill is not None:
        table.add_row("packing", f"real tokens fill {data.fill['packed']:.1%} of the "
                      f"{cfg.data.max_length}-token rows ({data.fill['unpacked']:.1%} with one "
                      "example per row)")
    table.add_row("batch", str(batch))
    table.add_row("optimizer", optimizer_line(cfg))
    for record in patches.records(model):
        table.add_row(f"patch: {record.name}", record.detail)
    if kept_pages:
        table.add_row("host memory", "freed pages kept for reuse (glibc: no page faults for tensors "
                      "above 32 MiB; memtrain.memory.hostmem)")
    table.add_row("output", cfg.output.dir)
    console.print(table)


def optimizer_line(cfg: RunConfig) -> str:
    """The run table's optimizer row: the optimizer, its schedule, the run's length, and where its
    state and step are when a technique moves them."""
    t = cfg.training
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs:g} epoch(s)"
    where = [said for said, on in (("state and step on the host (memory.offload.optimizer)",
                                    cfg.memory.offload.optimizer is True),
                                   ("stepped inside backward (training.optimizer_in_backward)",
                                    t.optimizer_in_backward is True)) if on]
    return ", ".join([f"{t.optimizer}, lr {t.learning_rate:g} ({t.lr_scheduler})", length, *where])


def print_summary(console: Console, metrics: dict[str, Any], out: Path, report: Report | None) -> None:
    """The run's result table: its metrics, the measured and predicted peak memory, where it was saved."""
    keys = [k for k in ("train_loss", "eval_loss", "eval_accuracy", "eval_majority_baseline",
                        "eval_perplexity", "train_runtime") if k in metrics]
    table = Table(title="result", show_header=False, title_justify="left")
    table.add_column(style="bold green")
    table.add_column()
    for key in keys:
        table.add_row(key, f"{metrics[key]:.4f}")
    if report is not None:
        compared = report.compared()
        peak = f"measured {format_bytes(report.measured['peak_bytes'])}"
        if compared:
            peak += f", predicted {format_bytes(compared['peak_bytes'])}"
        host = report.measured.get("host_peak_bytes") or 0
        if host and report.measured.get("device") == "cpu":  # offloaded tensors: the same RAM here
            total = (compared or {}).get("total_bytes")
            peak += (f" on the device, and the offloaded tensors {format_bytes(host)} in the same RAM"
                     + (f" (predicted total {format_bytes(total)}: what `memory.simulate_budget` and a "
                        "plan's budget count on a CPU)" if total else ""))
        table.add_row("peak memory", f"{peak}: {comparison(report)}")
    table.add_row("saved to", str(out))
    console.print(table)
