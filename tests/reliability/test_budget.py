"""Budgets: parsing, detection, and the simulated budget that raises torch's own OOM error."""

from __future__ import annotations

import pytest
import torch

from memtrain.reliability.budget import SimulatedBudget, resolve_budget, usable_bytes
from memtrain.trainer.step import measure_step, training_step
from tests.memory.test_meter import batch, tiny_llama


def test_resolve_budget() -> None:
    assert resolve_budget(None) is None
    assert resolve_budget("2GiB") == 2 * 2**30
    assert resolve_budget("auto", "cpu") > 0
    assert usable_bytes(1000, 0.1) == 900


def test_simulated_budget_raises_torch_oom_exactly_at_the_limit() -> None:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    measure_step(model, batch(), opt)  # optimizer state exists from here on
    peak = measure_step(model, batch(), opt).peak_bytes
    with SimulatedBudget(peak, model, opt) as fits:  # exactly enough: runs
        training_step(model, batch(), opt)
    assert fits.peak_bytes == peak
    too_small = SimulatedBudget(peak - 1, model, opt)
    with pytest.raises(torch.OutOfMemoryError, match="simulated budget"), too_small:
        training_step(model, batch(), opt)
    opt.zero_grad(set_to_none=True)
    # after the failure nothing stays registered: a normal step runs and measures the same
    assert measure_step(model, batch(), opt).peak_bytes == peak


def test_a_deferring_budget_notes_the_first_crossing_and_lets_the_step_finish() -> None:
    """With several processes the error waits for the end of the micro-batch (module docstring);
    a launched CPU process's ``cpu:0`` device is the ``cpu`` its tensors are on."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters())
    measure_step(model, batch(), opt)
    peak = measure_step(model, batch(), opt).peak_bytes
    with SimulatedBudget(peak - 1, model, opt, device="cpu:0", defer=True) as deferred:
        training_step(model, batch(), opt)  # no error at the op
    assert deferred.peak_bytes == peak
    note = deferred.take_overrun()
    assert note is not None and "simulated budget" in note
    assert deferred.take_overrun() is None  # taken: the next micro-batch starts afresh


def test_simulated_budget_callback_is_paused_for_evaluation_and_resumes() -> None:
    from types import SimpleNamespace

    from memtrain.reliability.budget import SimulatedBudgetCallback

    model = tiny_llama()
    guard = SimulatedBudgetCallback(2**20)  # 1 MiB: far below what the model already holds
    guard.on_train_begin(SimpleNamespace(device=torch.device("cpu")), None, None, model=model)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**20, dtype=torch.uint8)
        with guard.paused(), torch.no_grad():  # evaluation: no limit, no per-op tracking
            model(**batch())
        with pytest.raises(torch.OutOfMemoryError):  # training resumes under the limit
            torch.empty(2**20, dtype=torch.uint8)
    finally:
        guard.close()
    torch.empty(2**20, dtype=torch.uint8)  # closed: nothing left tracking
