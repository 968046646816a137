"""Mid-training out-of-memory recovery: the same optimizer step redone with half micro-batches.

Equivalence: gradients, optimizer and scheduler state match an unsplit run. Effect: a run whose one
long batch exceeds a simulated budget finishes, and says so in its logs. Failure: one example that
does not fit raises with the budget in the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import causal_recipe
from plain_trainer import GradCapture, arguments, collate, max_grad_difference, tiny_model, token_dataset

from memtrain.config import load_recipe
from memtrain.reliability.layouts import Rows, batch_rows, count_items
from memtrain.reliability.recovery import MicroBatchRecovery, MicroBatchTooLarge, OutOfMemoryInOneProcess
from memtrain.trainer.trainer import MemtrainTrainer

# 16 examples, micro-batch 4, accumulation 2: optimizer step 1 = rows 0-7. Row 5 is long, so the
# *second* micro-batch of step 1 is the long one and the first must be replayed.
LENGTHS = [8, 7, 8, 6, 8, 40, 8, 5, 8, 6, 7, 8, 8, 8, 7, 6]


def oom_when(model: torch.nn.Module, task: str, rows_over: int, length_over: int = 32,
             cpu_allocation: bool = False, forward: bool = False) -> list[int]:
    """Raise torch's OOM in the middle of backward (after the later layers' gradients were added)
    for micro-batches with more than ``rows_over`` rows longer than ``length_over`` tokens.

    ``cpu_allocation``: a real failed CPU allocation instead (a ``RuntimeError`` from torch's
    DefaultCPUAllocator); ``forward``: in the forward instead (what evaluation runs)."""
    layer = model.model.layers[0].mlp if task == "causal-lm" else model.bert.encoder.layer[0].output
    raised: list[int] = []

    def fail(shape: torch.Size) -> None:
        if shape[0] > rows_over and shape[1] > length_over:
            raised.append(int(shape[0]))
            if cpu_allocation:
                torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the allocator refuses
            raise torch.OutOfMemoryError(f"injected: {shape[0]} rows of {shape[1]} tokens do not fit")

    if forward:
        layer.register_forward_hook(lambda module, args, out: fail(out.shape))
    else:
        layer.register_full_backward_hook(lambda module, grad_in, grad_out: fail(grad_out[0].shape))
    return raised


def run(tmp_path: Path, task: str, rows_over: int | None, steps: int = 2, cpu_allocation: bool = False
        ) -> tuple[MemtrainTrainer, GradCapture, list[int]]:
    model = tiny_model(task)
    raised = oom_when(model, task, rows_over, cpu_allocation=cpu_allocation) if rows_over is not None else []
    capture = GradCapture()
    # SGD with momentum: updates are linear in the gradients, so runs agree to float rounding
    # (Adam's first update is about lr × sign(gradient), which magnifies rounding in ~0 gradients)
    args = arguments(tmp_path, 4, 2, steps, optim="sgd", optim_args="momentum=0.9")
    trainer = MemtrainTrainer(model=model, args=args, train_dataset=token_dataset(task, LENGTHS),
                              data_collator=collate, callbacks=[capture])
    trainer.train()
    return trainer, capture, raised


@pytest.mark.parametrize(("task", "cpu_allocation"),
                         [("causal-lm", False), ("classification", False), ("causal-lm", True)],
                         ids=["causal-lm", "classification", "cpu-allocation"])
def test_recovered_step_equals_the_unsplit_step(tmp_path: Path, task: str, cpu_allocation: bool) -> None:
    ref, ref_grads, _ = run(tmp_path / "ref", task, rows_over=None)
    rec, rec_grads, raised = run(tmp_path / "rec", task, rows_over=2, cpu_allocation=cpu_allocation)
    assert raised == [4]  # the long micro-batch failed once, at 4 rows; halves of 2 fit
    assert rec.oom_recovery.events == [{"step": 1, "micro_batch_before": 4, "micro_batch": 2,
                                        "accumulation": 4, "unit": "example"}]
    # causal LM: loss normalized by the step's token count; BERT classification: a per-batch mean
    assert rec.oom_recovery._loss_is_mean is (task == "classification")
    assert len(rec_grads.grads) == len(ref_grads.grads) == 2  # no extra or lost optimizer step
    for ref_step, rec_step in zip(ref_grads.grads, rec_grads.grads, strict=True):
        assert max_grad_difference(ref_step, rec_step) < 1e-5
    # optimizer state and schedule went on as if nothing happened: same momentum, 2 scheduler steps
    ref_state, rec_state = ref_grads.optimizer.optimizer.state, rec_grads.optimizer.optimizer.state
    assert len(rec_state) == len(ref_state) > 0
    for a, b in zip(ref_state.values(), rec_state.values(), strict=True):
        torch.testing.assert_close(a["momentum_buffer"], b["momentum_buffer"], rtol=1e-4, atol=1e-7)
    assert rec.lr_scheduler.last_epoch == ref.lr_scheduler.last_epoch == 2
    for (name, p), q in zip(ref.model.named_parameters(), rec.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    logged = [e for e in rec.state.log_history if "memory/recovered_micro_batch" in e]
    assert logged and logged[0]["memory/recovered_micro_batch"] == 2
    assert logged[0]["memory/recovered_accumulation"] == 4
    assert rec.args.per_device_train_batch_size == 4 and rec.args.gradient_accumulation_steps == 2
    losses = [e["loss"] for e in rec.state.log_history if "loss" in e]
    ref_losses = [e["loss"] for e in ref.state.log_history if "loss" in e]
    assert losses == pytest.approx(ref_losses, rel=1e-5)  # each step's loss counted once


def test_repeated_oom_halves_to_one_then_raises_with_the_budget(tmp_path: Path) -> None:
    model = tiny_model()
    raised = oom_when(model, "causal-lm", rows_over=1)
    trainer = MemtrainTrainer(model=model, args=arguments(tmp_path, 4, 2, 2), budget_bytes=3 * 2**20,
                              train_dataset=token_dataset("causal-lm", LENGTHS), data_collator=collate)
    trainer.train()
    assert raised == [4, 2]
    assert [e["micro_batch"] for e in trainer.oom_recovery.events] == [2, 1]
    assert [e["accumulation"] for e in trainer.oom_recovery.events] == [4, 8]

    model = tiny_model()
    oom_when(model, "causal-lm", rows_over=0)
    trainer = MemtrainTrainer(model=model, args=arguments(tmp_path, 4, 2, 2), budget_bytes=3 * 2**20,
                              train_dataset=token_dataset("causal-lm", LENGTHS), data_collator=collate)
    message = r"micro-batch of 1 example of 40 tokens.*budget of 3\.00 MiB"
    with pytest.raises(MicroBatchTooLarge, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_only_allocation_failures_count_as_out_of_memory() -> None:
    from memtrain.reliability.recovery import is_out_of_memory

    with pytest.raises(RuntimeError) as real:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_out_of_memory(real.value) and not isinstance(real.value, torch.OutOfMemoryError)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)"))
    assert not is_out_of_memory(ValueError("out of memory"))


def eval_run(tmp_path: Path, task: str, rows_over: int | None, cpu_allocation: bool = False
             ) -> tuple[MemtrainTrainer, list[int]]:
    model = tiny_model(task)
    raised = [] if rows_over is None else oom_when(model, task, rows_over, cpu_allocation=cpu_allocation,
                                                   forward=True)
    args = arguments(tmp_path, 4, 1, 1, per_device_eval_batch_size=8)
    trainer = MemtrainTrainer(model=model, args=args, data_collator=collate,
                              eval_dataset=token_dataset(task, LENGTHS))
    return trainer, raised


@pytest.mark.parametrize(("task", "cpu_allocation"), [("causal-lm", True), ("classification", False)])
def test_an_evaluation_batch_out_of_memory_is_split_and_gives_the_same_results(
        tmp_path: Path, task: str, cpu_allocation: bool) -> None:
    ref, _ = eval_run(tmp_path / "ref", task, None)
    rec, raised = eval_run(tmp_path / "rec", task, 2, cpu_allocation)
    expected = ref.evaluate()
    got = rec.evaluate()
    assert raised == [8, 4]  # the batch holding the long example failed at 8 rows, then at 4
    assert rec.eval_recovery.events == [{"eval_batch_before": 8, "eval_batch": 4},
                                        {"eval_batch_before": 4, "eval_batch": 2}]
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    ref_out, rec_out = ref.predict(token_dataset(task, LENGTHS)), rec.predict(token_dataset(task, LENGTHS))
    assert rec_out.predictions.shape == ref_out.predictions.shape
    assert abs(rec_out.predictions - ref_out.predictions).max() < 1e-4
    assert (rec_out.label_ids == ref_out.label_ids).all()


def test_split_batch_and_item_counts() -> None:
    batch = collate(token_dataset("causal-lm", [5, 3, 4, 2, 6]))
    pieces = Rows({**batch, "flag": True}, 5).split(2)
    assert [p["input_ids"].shape for p in pieces] == [(2, 6), (3, 6)]
    assert all(p["flag"] is True for p in pieces)
    assert len(Rows(batch, 5).split(8)) == 5  # never more pieces than rows

    class Shifted:
        _loss_shifts_labels = True

    # causal labels are shifted: an example of n tokens has n - 1 targets
    assert count_items(Shifted(), batch) == 4 + 2 + 3 + 1 + 5
    assert sum(count_items(Shifted(), p) for p in pieces) == count_items(Shifted(), batch)
    assert count_items(object(), collate(token_dataset("cls", [5, 3]))) == 2


def test_unsplittable_loss_is_refused(tmp_path: Path) -> None:
    model = tiny_model()
    oom_when(model, "causal-lm", rows_over=2)
    trainer = MemtrainTrainer(model=model, args=arguments(tmp_path, 4, 2, 1),
                              train_dataset=token_dataset("causal-lm", LENGTHS), data_collator=collate)
    recovery: MicroBatchRecovery = trainer.oom_recovery

    def squared(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        loss = model(**inputs).loss  # a mean, squared: neither a mean nor normalized by the items
        return loss * (100.0 / float(num_items_in_batch)) ** 2

    trainer.compute_loss = squared
    with pytest.raises(Exception, match="cannot split this micro-batch exactly"):
        trainer.train()
    assert recovery.parts == 2


@pytest.mark.slow
@pytest.mark.long  # recovery, in the suite: test_recovered_step_equals_the_unsplit_step
def test_a_long_batch_over_a_simulated_budget_is_recovered_in_a_recipe_run(tmp_path: Path) -> None:
    from memtrain.run.train import train

    lines = [f"short line {i} about a cat" for i in range(15)]
    lines.insert(5, " ".join(f"word{i}" for i in range(400)))  # ~256 tokens after truncation
    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in lines), encoding="utf-8")
    base = {"data": {"max_length": 256}, "adapter": {"method": "full"},
            "training": {"micro_batch_size": 4, "gradient_accumulation": 2, "max_steps": 2}}
    reference = train(load_recipe(causal_recipe(tmp_path / "a", data, **base)))
    peaks = [e["memory/peak_mib"] for e in reference.log_history if "memory/peak_mib" in e]
    assert max(peaks) > 3 * min(peaks)  # one step holds the long micro-batch
    budget = f"{int(0.75 * max(peaks))}MiB"  # the long micro-batch of 4 does not fit, 2 does
    recipe = causal_recipe(tmp_path / "b", data, **base, memory={"simulate_budget": budget})
    result = train(load_recipe(recipe))
    assert result.batch.effective == 8
    logged = [e for e in result.log_history if "memory/recovered_micro_batch" in e]
    assert [e["memory/recovered_micro_batch"] for e in logged] == [2]
    final = {n: p for n, p in reference.model.named_parameters()}
    for name, p in result.model.named_parameters():
        torch.testing.assert_close(p, final[name], rtol=1e-3, atol=1e-5, msg=name)


# ------------------------------------------------------------------ several processes (the protocol)


class _Trainer:
    """What MicroBatchRecovery reads of a Trainer, for one of 2 processes simulated here."""

    def __init__(self, callbacks: list[Any]) -> None:
        from types import SimpleNamespace

        self.state = SimpleNamespace(global_step=0, epoch=None, log_history=[])
        self.args = SimpleNamespace(gradient_accumulation_steps=1)
        self.control = None
        self.callback_handler = SimpleNamespace(callbacks=callbacks, on_log=lambda *args: None)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:  # swapped for weighted pieces
        raise AssertionError("not called by the step functions here")


class _Budget:
    """A deferring budget that noted nothing in this process."""

    def take_overrun(self) -> str | None:
        return None


def test_process_0_redoes_the_step_split_when_process_1_went_over(monkeypatch: pytest.MonkeyPatch) -> None:
    import memtrain.reliability.recovery as recovery

    monkeypatch.setattr(recovery, "world", lambda: (0, 2))
    votes, flags = iter([[1], []]), []  # after the first attempt process 1 reports; then nobody

    def vote(flag: bool, device: Any = "cpu") -> list[int]:
        flags.append(flag)
        return next(votes)

    monkeypatch.setattr(recovery, "flagged_ranks", vote)
    rows: list[int] = []

    def step(model: Any, inputs: dict, num_items: Any) -> torch.Tensor:
        rows.append(batch_rows(inputs))
        return torch.tensor(1.0)

    rec = MicroBatchRecovery(_Trainer([_Budget()]), step)
    rec.training_step(torch.nn.Linear(1, 1), {"input_ids": torch.zeros(4, 3, dtype=torch.long)})
    assert rows == [4, 2, 2]  # whole, then both halves: the same collectives as process 1
    assert flags == [False, False]  # this process had nothing to report, after either attempt
    assert rec.events == [{"step": 1, "micro_batch_before": 4, "micro_batch": 2, "accumulation": 2,
                           "unit": "example", "processes_over_budget": [1]}]


def test_a_real_allocation_failure_in_one_of_several_processes_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import memtrain.reliability.recovery as recovery

    monkeypatch.setattr(recovery, "world", lambda: (1, 2))

    def step(model: Any, inputs: dict, num_items: Any) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 PiB")

    rec = MicroBatchRecovery(_Trainer([_Budget()]), step)
    expected = (r"process 1 of 2 in the middle of optimizer step 1: DefaultCPUAllocator.*cannot redo the "
                r"step together.*Fix: `training.micro_batch_size")
    with pytest.raises(OutOfMemoryInOneProcess, match=expected):
        rec.training_step(torch.nn.Linear(1, 1), {"input_ids": torch.zeros(4, 3, dtype=torch.long)})
    assert rec.events == []


@pytest.mark.parametrize(("overrides", "said", "not_said"), [
    ([], "QLoRA (`model.quantization: nf4`)", "LoRA (`adapter.method: lora`)"),
    (["adapter.method=full", "memory.simulate_budget=64MiB", "memory.checkpointing=full"],
     "LoRA (`adapter.method: lora`)", "`memory.checkpointing: full`"),
])
def test_a_recipe_run_s_recovery_suggests_what_the_recipe_does_not_do(
        tmp_path: Path, tiny_text_file: Path, overrides: list[str], said: str, not_said: str) -> None:
    """One example that does not fit: the fixes of `memtrain train`'s final out-of-memory message
    (reliability.recovery.memory_fixes), never a smaller micro-batch (it is 1 already) nor what the
    recipe does already; they were a fixed list ("LoRA or quantization" to a QLoRA run)."""
    from memtrain.trainer.trainer import trainer_options

    cfg = load_recipe(causal_recipe(tmp_path, tiny_text_file), overrides)
    fixes = trainer_options(cfg)["oom_fixes"]
    assert said in fixes.one_example and not_said not in fixes.one_example
    assert "micro_batch_size" not in fixes.one_example
    assert ("memory.simulate_budget" in fixes.one_example) == bool(overrides)
    trainer = MemtrainTrainer(model=tiny_model(), args=arguments(tmp_path, 2, 1, 1), oom_fixes=fixes)
    assert trainer.oom_recovery.fixes is fixes
