"""The plugin for a plain ``transformers.Trainer`` script: MemoryBudgetCallback and prepare_for_budget."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from plain_trainer import arguments, collate, tiny_model, token_dataset
from transformers import Trainer

import memtrain
from memtrain.errors import MemtrainError
from memtrain.plugin.prepare import MemoryBudgetCallback, prepare_for_budget, recipe_for
from tests.reliability.test_recovery import LENGTHS

MiB = 2**20
LONG = [200 if n == 40 else n for n in LENGTHS]  # one micro-batch is much longer than the others


def plain_run(tmp_path: Path, callback: MemoryBudgetCallback, lengths: list[int] = LONG,
              micro: int = 4, accumulation: int = 2, model=None) -> Trainer:
    trainer = Trainer(model=model or tiny_model(), args=arguments(tmp_path, micro, accumulation, 2),
                      train_dataset=token_dataset("causal-lm", lengths), data_collator=collate)
    callback.attach(trainer)
    trainer.train()
    return trainer


def test_callback_logs_measured_and_predicted_memory_and_recovers(tmp_path: Path) -> None:
    assert memtrain.MemoryBudgetCallback is MemoryBudgetCallback  # the public two-line import
    measure = plain_run(tmp_path / "a", MemoryBudgetCallback())
    peaks = [e["memory/peak_mib"] for e in measure.state.log_history if "memory/peak_mib" in e]
    assert len(peaks) == 2 and max(peaks) > 2 * min(peaks)  # one step holds the long micro-batch
    budget = int((max(peaks) + min(peaks)) / 2 * MiB)  # the long micro-batch of 4 does not fit; of 2 it does
    callback = MemoryBudgetCallback(budget, simulate=True, predicted=f"{int(max(peaks) * MiB)}B")
    trainer = plain_run(tmp_path / "b", callback)
    assert trainer.state.global_step == 2
    history = trainer.state.log_history
    logged = [e for e in history if "loss" in e]
    assert all("memory/peak_mib" in e and "memory/predicted_peak_mib" in e for e in logged)
    assert all(e["memory/budget_usable_mib"] == pytest.approx(0.9 * budget / MiB) for e in logged)
    assert max(e["memory/peak_mib"] for e in logged) <= budget / MiB  # the simulated budget held
    assert [e["memory/recovered_micro_batch"] for e in history if "memory/recovered_micro_batch" in e] == [2]
    assert callback.recovery is not None and callback.recovery.parts == 2


def test_callback_warns_over_the_usable_budget(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    callback = MemoryBudgetCallback("1MiB", recover=False)
    with caplog.at_level(logging.WARNING, logger="memtrain.plugin.prepare"):
        plain_run(tmp_path, callback, lengths=[8] * 16)
    assert callback.over_budget == [1, 2]
    assert "exceeds the usable budget 921.60 KiB" in caplog.text
    with pytest.raises(MemtrainError, match="needs `budget` or `simulate_budget`"):
        MemoryBudgetCallback(simulate=True)


def test_every_measured_step_is_held_against_the_budget_logged_or_not(tmp_path: Path) -> None:
    """`every=1` measures each step; each is compared with the usable budget, not only the logged
    ones (an outside user's 3 steps over budget with the default logging interval reported one:
    the check ran when the Trainer logged). Planted: the check back in `on_log` -> [] here."""
    callback = MemoryBudgetCallback("1MiB", recover=False, every=1)
    trainer = Trainer(model=tiny_model(), args=arguments(tmp_path, 4, 1, 3, logging_steps=50),
                      train_dataset=token_dataset("causal-lm", [8] * 16), data_collator=collate)
    callback.attach(trainer)
    trainer.train()
    assert not [e for e in trainer.state.log_history if "loss" in e]  # no step was logged
    assert sorted(callback.steps) == [1, 2, 3] and callback.over_budget == [1, 2, 3]


def test_callback_measures_the_logged_steps_by_default(tmp_path: Path) -> None:
    """The meter costs 17-24% of a step (docs/bench/meter_cost.md): by default the callback
    measures the first two steps and then the steps the Trainer logs (the last one too), each log
    its own step."""
    lengths = [8] * 14
    default, every = MemoryBudgetCallback(recover=False), MemoryBudgetCallback(recover=False, every=1)
    logged = {}
    for name, callback in (("default", default), ("every", every)):
        trainer = Trainer(model=tiny_model(), args=arguments(tmp_path / name, 2, 1, 7, logging_steps=3),
                          train_dataset=token_dataset("causal-lm", lengths), data_collator=collate)
        callback.attach(trainer)
        trainer.train()
        logged[name] = [e["step"] for e in trainer.state.log_history if "memory/peak_mib" in e]
    assert sorted(default.steps) == [1, 2, 3, 6, 7] and sorted(every.steps) == list(range(1, 8))
    assert logged == {"default": [3, 6, 7], "every": [3, 6, 7]}  # the Trainer logs the last step too


@pytest.mark.slow
def test_prepare_for_budget_fits_a_plain_trainer_run(tmp_path: Path) -> None:
    from memtrain.estimator.estimate import estimate

    args = arguments(tmp_path, 16, 1, 2)
    model = tiny_model()
    cfg = recipe_for(model, args, max_length=32)
    assert cfg.model.task == "causal-lm" and cfg.adapter.method == "full"
    assert cfg.training.optimizer == "adamw" and cfg.training.effective_batch_size == 16
    from memtrain.plan.autofit import with_batch

    peak4 = estimate(with_batch(cfg, 4, 4)).total_bytes
    budget = int(peak4 / 0.9) + 2**16  # micro-batch 4 fits the usable part, 8 does not
    model, new_args = prepare_for_budget(model, args, budget, max_length=32)
    micro, accumulation = new_args.per_device_train_batch_size, new_args.gradient_accumulation_steps
    assert micro * accumulation == 16 and micro < 16  # the effective batch is kept; 16 does not fit
    assert micro >= 4  # at least what fits without any technique
    assert new_args.learning_rate == args.learning_rate and new_args.optim == args.optim
    trainer = Trainer(model=model, args=new_args, train_dataset=token_dataset("causal-lm", [32] * 32),
                      data_collator=collate)
    callback = memtrain.attach(trainer, budget, simulate=True)
    trainer.train()
    assert trainer.state.global_step == 2
    assert callback.recovery is not None and callback.recovery.events == []  # the prediction held
    assert not callback.over_budget
    few = {"offload.activations": False, "offload.embeddings": False, "tiled_mlp": False, "lean_norm": False}
    with pytest.raises(MemtrainError, match=r"(?i)nothing fits.*smallest reachable peak"):  # the message
        prepare_for_budget(tiny_model(), args, "1MiB", max_length=32, memory=few)  # (fewer searched: faster)


def test_on_a_cpu_an_activation_offload_is_measured_with_its_host_tensors(tmp_path: Path) -> None:
    """On a CPU the host is the same RAM: the plan counts the offloaded tensors, so the logged error
    compares with the device's and the host's tensors together (it read +59% for an exact prediction,
    against the device's alone)."""
    args = arguments(tmp_path, 4, 1, 2)
    model, new_args = prepare_for_budget(tiny_model(), args, "1GiB", max_length=128, quiet=True,
                                         memory={"offload": {"activations": True, "min_tensor_bytes": 1024}})
    trainer = Trainer(model=model, args=new_args, train_dataset=token_dataset("causal-lm", [128] * 8),
                      data_collator=collate)
    memtrain.attach(trainer)
    trainer.train()
    last = [h for h in trainer.state.log_history if "memory/predicted_error_pct" in h][-1]
    assert last["memory/host_peak_mib"] > 0.015 * last["memory/peak_mib"]  # the offload moved tensors
    assert abs(last["memory/predicted_error_pct"]) < 0.5, last


@pytest.mark.parametrize("longest", [32, 128])
def test_a_stated_length_shorter_than_the_data_is_said_at_attach(
        tmp_path: Path, longest: int, caplog: pytest.LogCaptureFixture) -> None:
    """Planned for max_length=32 while the data's rows reach 128 tokens: the steps hold more than
    planned, which was first seen as a step over the budget (on a GPU, out of memory)."""
    model, args = prepare_for_budget(tiny_model(), arguments(tmp_path, 4, 1, 1), "1GiB", max_length=32,
                                     quiet=True)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset("causal-lm", [16, longest, 24]),
                      data_collator=collate)
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        memtrain.attach(trainer)
    said = [n for n in model.memtrain_plan.notes if "the Trainer's longest batch has rows of" in n]
    if longest == 32:
        assert not said
        return
    assert said == ["the Trainer's longest batch has rows of 128 tokens, more than the max_length=32 planned "
                    "for, so its steps hold more than planned. Fix: cut the data at 32 tokens (the "
                    "tokenizer's truncation or your collator), or pass max_length=128 to prepare_for_budget"]
    assert any(said[0] in r.getMessage() for r in caplog.records)


def test_callback_keeps_accumulated_classifier_gradients_equal_to_one_big_batch(tmp_path: Path) -> None:
    # Transformers 5 alone would not divide a sequence classifier's loss by the accumulation.
    from plain_trainer import GradCapture, max_grad_difference

    data = token_dataset("classification", [12] * 8)
    grads = []
    for micro, accumulation in ((8, 1), (2, 4)):
        capture = GradCapture()
        trainer = Trainer(model=tiny_model("classification"), train_dataset=data, data_collator=collate,
                          args=arguments(tmp_path / f"{micro}", micro, accumulation, 1, max_grad_norm=0.0),
                          callbacks=[capture])
        MemoryBudgetCallback(recover=False).attach(trainer)
        trainer.train()
        grads.append(capture.grads[0])
    assert max_grad_difference(*grads) < 1e-4


def test_simulated_budget_is_off_in_evaluation_and_evaluation_recovers(tmp_path: Path) -> None:
    from tests.reliability.test_recovery import oom_when

    short, long_rows = [8] * 8, [64] * 8  # evaluation: 8 rows of 64 tokens, far above a training step
    measure = plain_run(tmp_path / "a", MemoryBudgetCallback(), lengths=short, micro=2, accumulation=1)
    peak = max(e["memory/peak_mib"] for e in measure.state.log_history if "memory/peak_mib" in e)
    limit = int(peak * MiB) + 2**20

    def run(name: str, model: Any, recover: bool) -> tuple[Trainer, MemoryBudgetCallback]:
        callback = MemoryBudgetCallback(simulate_budget=limit, recover=recover)
        args = arguments(tmp_path / name, 2, 1, 2, eval_strategy="steps", eval_steps=1,
                         per_device_eval_batch_size=8)
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset("causal-lm", short),
                          eval_dataset=token_dataset("causal-lm", long_rows), data_collator=collate)
        callback.attach(trainer)
        trainer.train()
        return trainer, callback

    trainer, _ = run("b", tiny_model(), recover=False)  # unlimited evaluation: no recovery needed
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [1, 2]
    peaks = [e["memory/peak_mib"] for e in trainer.state.log_history if "memory/peak_mib" in e]
    assert peaks and max(peaks) <= limit / MiB  # training steps stayed under the simulated budget
    model = tiny_model()
    raised = oom_when(model, "causal-lm", rows_over=4, forward=True)
    trainer, callback = run("c", model, recover=True)
    assert raised == [8]  # the first evaluation's batch of 8 failed once; pieces of 4 from then on
    assert callback.eval_recovery is not None and callback.eval_recovery.parts == 2
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [1, 2]


def test_callback_passed_in_the_list_measures_and_says_recovery_needs_attach(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):  # stands in for an integration (TensorBoard, W&B): listed first
        pass

    callback = MemoryBudgetCallback()
    trainer = Trainer(model=tiny_model(), args=arguments(tmp_path / "list", 4, 1, 1),
                      train_dataset=token_dataset("causal-lm", [8] * 4), data_collator=collate,
                      callbacks=[Reporter(), callback])
    with caplog.at_level(logging.WARNING, logger="memtrain.plugin.prepare"):
        trainer.train()
    assert callback.recovery is None and "memtrain.attach(trainer)" in caplog.text
    assert any("memory/peak_mib" in e for e in trainer.state.log_history)  # still measured
    handler = trainer.callback_handler.callbacks
    callback.attach(trainer)  # moved ahead of the integration, recovery installed, once
    callback.attach(trainer)
    assert handler.index(callback) == 1 and handler.count(callback) == 1
    assert callback.recovery is not None and trainer.training_step == callback.recovery.training_step


def test_the_traced_trainer_step_runs_under_the_autocast_train_adds(tmp_path: Path) -> None:
    """``attach(estimate=True)`` traces the Trainer's own step before ``train()`` wraps the model's
    forward in bf16 autocast (``bf16=True`` on fp32 weights); the trace adds that autocast itself.
    Equal rows, so every batch is the traced one; from the second step on, optimizer state exists
    as in the trace. Without the autocast the trace is 2.4% low (131.6 vs 134.8 MiB)."""
    trainer = Trainer(model=tiny_model(), args=arguments(tmp_path, 4, 1, 2, bf16=True),
                      train_dataset=token_dataset("causal-lm", [60] * 8), data_collator=collate)
    callback = memtrain.attach(trainer, estimate=True, every=1)
    assert callback.trainer_estimate.modelled and callback.trainer_estimate.batch["input_ids"] == (4, 60)
    trainer.train()
    assert callback.predicted == pytest.approx(callback.steps[2].peak_bytes, rel=0.005)
