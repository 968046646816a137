"""What a failed attempt leaves behind, and what a replayed step does twice: nothing.

Memory: after an out-of-memory error inside memtrain's trackers (the meter, the simulated budget),
the live tensor bytes return to what they were before the attempt, counted by an independent
counter (``scripts/probes/memprobe.py``'s ``LiveBytes``, which shares no code with ``memtrain.memory``).
Side effects: a trainer that counts tokens and appends metrics in ``compute_loss`` (as TRL's do)
counts each micro-batch of a recovered step once, and recovery's own log entry is stamped with
the step it redid.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from plain_trainer import arguments, collate, tiny_model, token_dataset
from transformers import Trainer

from memtrain.memory.meter import MemoryMeter
from memtrain.reliability.budget import SimulatedBudget
from memtrain.reliability.recovery import release_failed_attempt
from scripts.probes.memprobe import LiveBytes, resident
from tests.reliability.test_recovery import LENGTHS, oom_when


def _step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("where", ["forward", "backward", "simulated budget"])
def test_a_failed_attempt_leaves_no_live_bytes(where: str) -> None:
    model = tiny_model()
    ids = torch.randint(5, 30000, (8, 64), generator=torch.Generator().manual_seed(0))
    with LiveBytes() as probe:  # a clean step: what it adds at its peak
        _step(model, ids)
        model.zero_grad(set_to_none=True)
    extra = probe.device_peak
    limit = resident(model, None, {}) + extra // 2 if where == "simulated budget" else 2**40
    if where != "simulated budget":
        layer = model.model.layers[1].mlp

        def fail(*args: Any) -> None:
            raise torch.OutOfMemoryError(f"injected in {where}")

        if where == "forward":
            layer.register_forward_hook(fail)
        else:
            layer.register_full_backward_hook(fail)
    with LiveBytes() as probe:
        gc.collect()
        before = probe.current
        # both of memtrain's trackers are active in a plugin run with a simulated budget
        with SimulatedBudget(limit, model), MemoryMeter(model):
            with pytest.raises(torch.OutOfMemoryError):
                _step(model, ids)
            release_failed_attempt(model)
            after = probe.current
        gc.collect()
        after_exit = probe.current
    assert extra > 4 * 2**20  # the step is worth measuring
    assert after == before, f"{after - before} bytes of the failed attempt are still alive"
    assert after_exit == before


def test_a_retry_fits_only_when_the_failed_attempt_is_released(tmp_path: Path) -> None:
    """A budget between the peaks of micro-batches 4 and 8 (BERT, 500 tokens: activations dominate):
    the half batch fits next to what a step holds, not next to what the failed attempt left."""
    import memtrain

    def run(micro: int, budget: int | None = None) -> tuple[Trainer, Any]:
        trainer = Trainer(model=tiny_model("classification"),
                          args=arguments(tmp_path / str(micro), micro, 8 // micro, 2),
                          train_dataset=token_dataset("classification", [500] * 16), data_collator=collate)
        callback = memtrain.attach(trainer, simulate_budget=budget, every=1)
        trainer.train()
        return trainer, callback

    whole = run(8)[1].steps[2].peak_bytes  # step 2: the optimizer state exists
    half = run(4)[1].steps[2].peak_bytes
    assert whole > half + 2**20
    trainer, callback = run(8, (whole + half) // 2)
    assert trainer.state.global_step == 2
    assert [(e["micro_batch_before"], e["micro_batch"]) for e in callback.recovery.events] == [(8, 4)]
    assert max(m.peak_bytes for m in callback.steps.values()) <= (whole + half) // 2


class CountingTrainer(Trainer):
    """Side effects as TRL's trainers have them: tokens counted and metrics appended in
    ``compute_loss``, averaged and cleared in ``log``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._total_train_tokens = 0
        self._metrics: dict[str, dict[str, list[float]]] = {"train": {}, "eval": {}}

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if model.training else "eval"
        self._total_train_tokens += int(inputs["attention_mask"].sum())
        self._metrics[mode].setdefault("calls", []).append(1.0)
        self._metrics[mode]["num_tokens"] = [float(self._total_train_tokens)]
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        logs.update({k: sum(v) for k, v in self._metrics[mode].items()})
        super().log(logs, start_time)
        self._metrics[mode] = {}


def _counting_run(tmp_path: Path, rows_over: int | None) -> CountingTrainer:
    import memtrain

    model = tiny_model()
    if rows_over is not None:
        oom_when(model, "causal-lm", rows_over)
    trainer = CountingTrainer(model=model, args=arguments(tmp_path, 4, 2, 2),
                              train_dataset=token_dataset("causal-lm", LENGTHS), data_collator=collate)
    memtrain.attach(trainer)
    trainer.train()
    return trainer


def test_a_replayed_step_counts_its_side_effects_once_and_logs_at_its_step(tmp_path: Path) -> None:
    ref = _counting_run(tmp_path / "ref", None)
    rec = _counting_run(tmp_path / "rec", rows_over=2)  # step 1's second micro-batch fails at 4 rows
    assert rec._total_train_tokens == ref._total_train_tokens == sum(LENGTHS)
    entries = [e for e in rec.state.log_history if "loss" in e]
    ref_entries = [e for e in ref.state.log_history if "loss" in e]
    assert [e["num_tokens"] for e in entries] == [e["num_tokens"] for e in ref_entries]
    # step 1 ran its first micro-batch whole, failed in the second, then ran both again in halves:
    # 4 calls counted, not the failed attempt's nor the loss-kind check's; step 2 kept the halves
    assert [e["calls"] for e in entries] == [4.0, 4.0]
    assert [e["calls"] for e in ref_entries] == [2.0, 2.0]
    assert [e["loss"] for e in entries] == pytest.approx([e["loss"] for e in ref_entries], rel=1e-5)
    train_loss = [e["train_loss"] for e in rec.state.log_history if "train_loss" in e]
    assert train_loss == pytest.approx([e["train_loss"] for e in ref.state.log_history if "train_loss" in e],
                                       rel=1e-5)
    recovered = [e for e in rec.state.log_history if "memory/recovered_micro_batch" in e]
    assert [(e["step"], e["memory/recovered_micro_batch"]) for e in recovered] == [(1, 2.0)]
    assert "calls" not in recovered[0]  # the trainer's own log (which flushes its metrics) was not used
