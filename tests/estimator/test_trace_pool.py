"""Traces side by side in forked processes: same results, the job's own errors, safe fallbacks."""

from __future__ import annotations

import os
import time

import pytest
import torch

from memtrain.errors import MemtrainError
from memtrain.estimator import pool as trace_pool
from memtrain.estimator.estimate import estimate

PARENT = os.getpid()


def _pid() -> int:
    return os.getpid()


def _fails_in_a_worker() -> str:
    if os.getpid() != PARENT:
        raise MemtrainError("`model.name`: the job's own error")
    return "ran here"


def _dies_in_a_worker() -> str:
    if os.getpid() != PARENT:
        os._exit(3)
    return "ran here"


def _hangs_in_a_worker() -> str:
    if os.getpid() != PARENT:
        time.sleep(3600)
    return "ran here"


def _parallel_op() -> tuple[int, float]:
    return os.getpid(), float(torch.nn.functional.gelu(torch.ones(512, 4096)).sum())


def _refuses() -> str:
    raise MemtrainError("`model.name`: the job's own error")


@pytest.fixture
def two_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(trace_pool.ENV_VAR, "2")
    if trace_pool.processes(2) < 2:
        pytest.skip("forked trace workers need Linux")


def test_jobs_run_in_forked_workers_and_come_back_in_order(two_processes: None) -> None:
    pids = trace_pool.run_all([_pid] * 4)
    assert pids[:2] == [PARENT, PARENT]  # this process takes the first share
    assert PARENT not in pids[2:] and len(set(pids[2:])) == 1  # one worker, forked, for the rest


def test_a_job_failing_or_dying_in_a_worker_is_run_here(two_processes: None) -> None:
    jobs = [_pid, _pid, _fails_in_a_worker, _dies_in_a_worker]  # the worker takes the last two
    assert trace_pool.run_all(jobs)[2:] == ["ran here"] * 2
    with pytest.raises(MemtrainError, match="the job's own error"):
        trace_pool.run_all([_pid, _refuses])


@pytest.mark.timeout(120)
def test_a_hung_worker_is_killed_and_its_jobs_run_here(two_processes: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_pool, "PATIENCE", (1.0, 2.0))  # 2 s after this process's own share
    start = time.perf_counter()
    assert trace_pool.run_all([_pid, _hangs_in_a_worker]) == [PARENT, "ran here"]
    assert time.perf_counter() - start < 30


@pytest.mark.timeout(120)
def test_a_worker_runs_real_ops_after_this_process_used_its_threads(two_processes: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU OpenMP's thread pool does not survive a fork: a worker's first parallel op hung until
    workers ran on one thread (found by a fresh-clone CI run, in the approximate-layer probe; now
    a hang would also end, after PATIENCE, with the job run here: the result would be the same,
    so the test also checks that it came from the worker)."""
    monkeypatch.setattr(trace_pool, "PATIENCE", (1.0, 10.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, expected = _parallel_op()  # this process's OpenMP pool now exists
        (_, here), (where, there) = trace_pool.run_all([_parallel_op, _parallel_op])
        assert where != PARENT and here == there == expected
    finally:
        torch.set_num_threads(before)


def _slow_here() -> float:
    if os.getpid() == PARENT:
        time.sleep(2.0)
    return time.monotonic()


def _large() -> bytes:
    return bytes(4 * 2**20)  # far more than a pipe holds


@pytest.mark.timeout(120)
def test_a_worker_goes_on_while_its_large_result_waits_to_be_read(two_processes: None) -> None:
    """This process reads a worker's results once its own share is done; a result larger than the
    pipe's buffer (a trace's rows) made the worker wait in `send` until then, idle (its next job
    started only when this process's share ended: the quickstart plan's second group of traces
    took 1.9 s where 1.3 s is the work)."""
    ended_here, _, _, started_there = trace_pool.run_all([_slow_here, _pid, _large, time.monotonic])
    assert started_there < ended_here - 1.0  # the worker's second job did not wait for this share


def _unpicklable() -> tuple[int, object]:
    return os.getpid(), lambda: None  # a lambda does not pickle


def test_a_result_that_does_not_pickle_is_run_here_and_the_worker_goes_on(two_processes: None) -> None:
    """A worker's result that does not pickle fails as its job (run again here); the worker's next
    result still comes from it. Planted: pickling in the worker's sending thread (it died of the
    error, and every later result of that worker was run again here)."""
    results = trace_pool.run_all([_pid, _pid, _unpicklable, _pid])
    assert results[2][0] == PARENT and results[3] != PARENT, results


def test_uneven_shares_get_a_process_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three traces on two cores: a share of two beside a share of one ends when the two have run
    one after the other; three processes sharing the cores end at about half the total."""
    monkeypatch.delenv(trace_pool.ENV_VAR, raising=False)
    monkeypatch.setattr(trace_pool.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    if trace_pool.processes(2) < 2:
        pytest.skip("forked trace workers need Linux")
    assert [trace_pool.processes(n) for n in (2, 3, 4, 5, 8)] == [2, 3, 2, 2, 2]
    pids = trace_pool.run_all([_pid] * 3)
    assert pids[0] == PARENT and len(set(pids)) == 3
    monkeypatch.setenv(trace_pool.ENV_VAR, "2")  # a number set is a cap
    assert trace_pool.processes(3) == 2


def test_one_process_when_forking_is_unsafe_or_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trace_pool.processes(1) == 1
    monkeypatch.setenv(trace_pool.ENV_VAR, "1")
    assert trace_pool.run_all([_pid] * 3) == [PARENT] * 3
    monkeypatch.setenv(trace_pool.ENV_VAR, "4")
    assert trace_pool.processes(4, cuda=True) == 1  # fake CUDA tensors: a forked child cannot use CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert trace_pool.processes(4) == 1
    monkeypatch.setenv(trace_pool.ENV_VAR, "two")
    with pytest.raises(MemtrainError, match=r"`MEMTRAIN_TRACE_PROCESSES`: .* got 'two'\. Fix: set it"):
        trace_pool.run_all([_pid] * 2)


def test_an_estimate_is_the_same_traced_side_by_side(monkeypatch: pytest.MonkeyPatch,
                                                     two_processes: None) -> None:
    overrides = ["model.from_config.num_hidden_layers=8", "data.max_length=64", "training.micro_batch_size=2"]
    pooled = estimate("recipes/tiny-llama-shakespeare.yaml", overrides, device="cpu")
    monkeypatch.setenv(trace_pool.ENV_VAR, "1")
    alone = estimate("recipes/tiny-llama-shakespeare.yaml", overrides, device="cpu")
    assert pooled.method == alone.method == "traced 2 and 3 of 8 layers, extrapolated"
    assert (pooled.peak_bytes, pooled.by_category, pooled.by_phase, pooled.parameters) == (
        alone.peak_bytes, alone.by_category, alone.by_phase, alone.parameters)


# ------------------------------------------------------------------- kept workers (a planner's search)


def test_kept_workers_take_the_next_calls_and_end_with_the_block(two_processes: None) -> None:
    """Inside the block the worker a call forked runs the next calls' shares (its fake-tensor cache
    and copied pages kept); it ends, by itself, with the block. Outside, each call forks anew."""
    with trace_pool.kept_workers():
        first, second = trace_pool.run_all([_pid] * 4), trace_pool.run_all([_pid] * 4)
        with trace_pool.kept_workers():  # a nested block shares the outer one's
            third = trace_pool.run_all([_pid] * 2)
        kept = list(trace_pool._KEPT or ())
    assert first[:2] == second[:2] == [PARENT] * 2
    assert first[2] == second[2] == third[1] != PARENT and len(kept) == 1
    assert trace_pool._KEPT is None and [w.process.exitcode for w in kept] == [0]  # asked to stop
    outside = [trace_pool.run_all([_pid] * 2)[1] for _ in range(2)]
    assert outside[0] != outside[1]


@pytest.mark.timeout(60)
def test_kept_workers_end_at_once_when_one_was_forked_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three processes: the second worker is forked while the first is kept, and inherits the end
    of the first one's job pipe. Each worker closes what it inherited, so closing this process's
    end stops every worker (planted: either closing left out -> a worker waits for jobs until
    killed, exit code -9, after 5 s)."""
    monkeypatch.setenv(trace_pool.ENV_VAR, "3")
    if trace_pool.processes(3) < 3:
        pytest.skip("forked trace workers need Linux")
    with trace_pool.kept_workers():
        pids = trace_pool.run_all([_pid] * 3)
        assert trace_pool.run_all([_pid] * 3) == pids and len(set(pids)) == 3
        kept = list(trace_pool._KEPT or ())
        start = time.perf_counter()
    assert [w.process.exitcode for w in kept] == [0, 0]
    assert time.perf_counter() - start < 4


def test_a_kept_worker_that_dies_is_dropped_and_its_jobs_run_here(two_processes: None) -> None:
    with trace_pool.kept_workers():
        worker = trace_pool.run_all([_pid, _pid])[1]
        assert trace_pool.run_all([_pid, _fails_in_a_worker])[1] == "ran here"  # a job's error
        assert trace_pool.run_all([_pid, _pid])[1] == worker  # ... leaves its worker kept
        assert trace_pool.run_all([_pid, _dies_in_a_worker]) == [PARENT, "ran here"]
        assert trace_pool._KEPT == []
        again = trace_pool.run_all([_pid, _pid])[1]
    assert again not in (PARENT, worker)


@pytest.mark.timeout(120)
def test_a_kept_worker_that_hangs_is_killed_and_dropped(two_processes: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_pool, "PATIENCE", (1.0, 2.0))
    with trace_pool.kept_workers():
        worker = trace_pool.run_all([_pid, _pid])[1]
        assert trace_pool.run_all([_pid, _hangs_in_a_worker]) == [PARENT, "ran here"]
        assert trace_pool._KEPT == [] and trace_pool.run_all([_pid, _pid])[1] not in (PARENT, worker)


def test_jobs_that_do_not_pickle_get_fresh_workers_inside_the_block(two_processes: None) -> None:
    def local() -> int:  # a closure: inherited by a fork, never pickled
        return os.getpid()

    with trace_pool.kept_workers():
        kept = trace_pool.run_all([_pid, _pid])[1]
        fresh = trace_pool.run_all([_pid, local])[1]
        again = trace_pool.run_all([_pid, _pid])[1]
    assert fresh not in (PARENT, kept) and again == kept


def test_a_plan_is_the_same_with_kept_workers(monkeypatch: pytest.MonkeyPatch, two_processes: None) -> None:
    """The planner's groups of traces, run by kept workers (their jobs pickled), plan as one process
    does; and they were kept (a later group's shares were handed over, not forked)."""
    from memtrain.config import load_recipe
    from memtrain.plan.planner import plan

    handed: list[bool] = []
    real = trace_pool._handed

    def spied(jobs: list, shares: list) -> list:
        found = real(jobs, shares)
        handed.append(any(payload is not None for payload in found))
        return found

    monkeypatch.setattr(trace_pool, "_handed", spied)
    cfg = load_recipe("recipes/tiny-llama-shakespeare.yaml", [
        "model.from_config.num_hidden_layers=6", "data.max_length=64", "training.micro_batch_size=auto",
        "memory.checkpointing=auto"])
    pooled = plan(cfg, "160MiB", device="cpu")
    monkeypatch.setenv(trace_pool.ENV_VAR, "1")
    alone = plan(cfg, "160MiB", device="cpu")
    assert True in handed  # a group after the first went to the kept worker
    assert [(c.label(), c.peak, c.seconds) for c in (pooled.chosen, *pooled.alternatives)] == [
        (c.label(), c.peak, c.seconds) for c in (alone.chosen, *alone.alternatives)]
