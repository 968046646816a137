"""Run independent fake-tensor traces side by side, in forked processes.

An estimate traces its step twice (2 and 3 layers), the planner four times per group of settings
(micro-batches 2 and 3 at both depths), a sweep once per sequence length. Each trace is pure Python
dispatch on fake tensors: one core, seconds each (a 70B QLoRA step: ~2.5 s per trace on this
project's 2-core CPU), and nothing a thread could overlap under the GIL. :func:`run_all` runs the
first share of the jobs in this process and hands the rest to worker processes forked from it
(``concurrent.futures.ProcessPoolExecutor`` with the ``fork`` start method): a fork inherits the
imported libraries, the recipe and the model configuration, so a worker starts tracing at once,
where a spawned one would first spend the ~8 s the imports take. Only the finished traces (numpy
arrays) travel back.

Forking is used only where it is safe and can help: Linux, more than one usable core, not inside
a daemonic worker, not in a process of a distributed run (its process group cannot be forked, and
the other processes use the other cores), and CUDA not yet initialised in this process (a forked
child cannot use CUDA, and fake CUDA tensors may ask it for the current device). Otherwise, and with
``MEMTRAIN_TRACE_PROCESSES=1``, the jobs run one after the other here, as before. A job that fails
in a worker, or a worker that dies, is run again in this process, so the error a user sees is the
job's own, raised where it would have been without workers. Results do not depend on where a job
ran: tests/test_trace_pool.py compares them.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import torch

ENV_VAR = "MEMTRAIN_TRACE_PROCESSES"

T = TypeVar("T")

_JOBS: Sequence[Callable[[], Any]] = ()  # what forked workers run, by index (inherited, never pickled)


def processes(jobs: int) -> int:
    """How many processes (this one included) :func:`run_all` would use for ``jobs`` jobs."""
    if jobs < 2 or sys.platform != "linux" or multiprocessing.current_process().daemon:
        return 1
    if torch.cuda.is_initialized():
        return 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 1  # one of several training processes: the cores are theirs, the group is not forkable
    cores = len(os.sched_getaffinity(0))
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted:
        try:
            cores = max(1, int(wanted))
        except ValueError:
            cores = 1
    return max(1, min(jobs, cores))


def run_all(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """``[job() for job in jobs]``, with the jobs spread over forked processes where that helps."""
    count = processes(len(jobs))
    if count == 1:
        return [job() for job in jobs]
    global _JOBS
    mine = math.ceil(len(jobs) / count)  # this process takes the first share, workers the rest
    _JOBS = jobs
    try:
        with ProcessPoolExecutor(count - 1, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {i: pool.submit(_run, i) for i in range(mine, len(jobs))}  # forks here
            results: list[Any] = [job() for job in jobs[:mine]]
            for i in range(mine, len(jobs)):
                try:
                    results.append(futures[i].result())
                except Exception:  # the job's own error: raised by running it here
                    results.append(jobs[i]())
    finally:
        _JOBS = ()
    return results


def _run(index: int) -> Any:
    return _JOBS[index]()
