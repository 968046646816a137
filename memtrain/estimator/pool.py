"""Run independent fake-tensor traces side by side, in forked processes.

An estimate traces its step twice (2 and 3 layers), the planner four times per group of settings
(micro-batches 2 and 3 at both depths), a sweep once per sequence length. Each trace is pure Python
dispatch on fake tensors: one core, seconds each (a 70B QLoRA step: ~2.5 s per trace on this
project's 2-core CPU), and nothing a thread could overlap under the GIL. :func:`run_all` runs the
first share of the jobs in this process and hands the other shares to worker processes forked from
it (``multiprocessing`` with the ``fork`` start method): a fork inherits the imported libraries, the
recipe and the model configuration, so a worker starts tracing at once, where a spawned one would
first spend the ~8 s the imports take. Only the finished traces (numpy arrays) travel back, through
a pipe per worker, sent from a thread of the worker so that its next job runs while a result waits
to be read. Written with ``multiprocessing.Process`` rather than a process pool because a
pool cannot be told to give up on a worker that hangs: here a worker that has not answered long
after this process finished its own share (:data:`PATIENCE`) is killed and its jobs run here.

Forking is used only where it is safe and can help: Linux, more than one usable core, not inside
a daemonic worker, not in a process of a distributed run (its process group cannot be forked, and
the other processes use the other cores), and jobs that do not use CUDA, in a process that has not
initialised it: a child forked after its parent asked CUDA anything (even
``torch.cuda.is_available()``) cannot use it, and fake CUDA tensors ask it for the current device.
So on a machine with a GPU, the estimator's traces for a CUDA run (on fake CUDA tensors) run one
after the other, as before; the side-by-side traces serve CPU machines and CPU-traced runs.
Otherwise, and with ``MEMTRAIN_TRACE_PROCESSES=1``, the jobs run one after the other here.
A few more jobs than cores that do not split evenly (an estimate of ``checkpointing: n`` traces
three shapes, n other than half the depth; this CPU has two cores) get a process each and the
kernel shares the cores among them: a share of two traces beside a share of one ends when the two
have run one after the other, three processes on two cores end at about half their total (the
n-of-L estimate of the 8B recipe at 131,072 tokens: 6.3 s in two processes, 5.3-5.5 s in three).
``MEMTRAIN_TRACE_PROCESSES=N`` caps the processes at N. A job that fails
in a worker, or whose worker dies or hangs, is run again in this process, so the error a user sees
is the job's own, raised where it would have been without workers. Workers run torch on one
thread: GNU OpenMP's thread pool does not survive a fork, and a child's first parallel op (traces
run a few real ones: a probe, a quantization map) would wait forever for threads it does not have,
which is why torch's own DataLoader workers do the same. The garbage collector is frozen while
workers run (``gc.freeze``, as the Python documentation advises before a fork): a full collection
in either process would otherwise write to every object of the shared heap and copy its pages.
Results do not depend on where a job ran: tests/estimator/test_trace_pool.py compares them.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

import torch

from memtrain.errors import MemtrainError

ENV_VAR = "MEMTRAIN_TRACE_PROCESSES"
# How long to wait for a worker after this process finished its own share: that many times as
# long as the share took (the shares are alike), and at least a minute.
PATIENCE = (5.0, 60.0)

T = TypeVar("T")

_JOBS: Sequence[Callable[[], Any]] = ()  # what forked workers run, by index (inherited, never pickled)


def processes(jobs: int, cuda: bool = False) -> int:
    """How many processes (this one included) :func:`run_all` would use for ``jobs`` jobs."""
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted and (not wanted.isdigit() or int(wanted) < 1):
        raise MemtrainError(f"`{ENV_VAR}`: a number of processes to trace in, got {wanted!r}. "
                            "Fix: set it to a whole number from 1 (1: one trace after the other) "
                            "or unset it (all usable cores).")
    if jobs < 2 or sys.platform != "linux" or multiprocessing.current_process().daemon:
        return 1
    if cuda or torch.cuda.is_initialized():
        return 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 1  # one of several training processes: the cores are theirs, the group is not forkable
    if wanted:
        return max(1, min(jobs, int(wanted)))
    cores = len(os.sched_getaffinity(0))
    if cores < jobs < 2 * cores and jobs % cores:
        return jobs  # uneven shares: one process per job, the cores shared among them (see above)
    return max(1, min(jobs, cores))


def run_all(jobs: Sequence[Callable[[], T]], cuda: bool = False) -> list[T]:
    """``[job() for job in jobs]``, with the jobs spread over forked processes where that helps.

    ``cuda``: the jobs use CUDA (fake CUDA tensors ask it for the current device); they then run
    here, one after the other.
    """
    count = processes(len(jobs), cuda)
    if count == 1:
        return [job() for job in jobs]
    size = math.ceil(len(jobs) / count)
    shares = [range(k, min(k + size, len(jobs))) for k in range(0, len(jobs), size)]
    global _JOBS
    _JOBS = jobs
    context = multiprocessing.get_context("fork")
    workers: list[tuple[range, Any, Connection]] = []
    gc.freeze()  # see the module docstring: no garbage-collector pass over the shared heap
    try:
        for share in shares[1:]:
            receive, send = context.Pipe(duplex=False)
            worker = context.Process(target=_work, args=(share, send), daemon=True)
            worker.start()  # forks here
            send.close()
            workers.append((share, worker, receive))
        start = time.perf_counter()
        results: dict[int, Any] = {i: jobs[i]() for i in shares[0]}
        patience = max(PATIENCE[1], PATIENCE[0] * (time.perf_counter() - start))
        deadline = time.monotonic() + patience
        for share, _, receive in workers:
            done = _receive(receive, len(share), deadline)
            for i in share:  # failed, lost with a dead worker, or late: run here
                results[i] = done[i] if i in done else jobs[i]()
    finally:
        _JOBS = ()
        gc.unfreeze()
        for _, worker, receive in workers:
            if worker.is_alive():
                worker.kill()
            worker.join()
            receive.close()
    return [results[i] for i in range(len(jobs))]


def _work(share: range, send: Connection) -> None:
    torch.set_num_threads(1)  # see the module docstring: OpenMP's pool is not the child's
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    # A result larger than the pipe's buffer (64 KiB; a trace's rows are hundreds of KiB) waits in
    # `send` until this process's parent reads it, which it does once its own share is done: sent
    # from a thread, the next job runs meanwhile (in the job's loop it would wait, idle). Pickled
    # here, as `Connection.send` would, so that a result that does not pickle fails as its job.
    sender = threading.Thread(target=_send_all, args=(outbox, send))
    sender.start()
    try:
        for i in share:
            try:
                message = ForkingPickler.dumps((i, True, _JOBS[i]()))
            except Exception:  # the job's own error is raised where it is run again
                message = ForkingPickler.dumps((i, False, None))
            outbox.put(bytes(message))
    finally:
        outbox.put(None)
        sender.join()


def _send_all(outbox: queue.SimpleQueue[bytes | None], send: Connection) -> None:
    while (message := outbox.get()) is not None:
        try:
            send.send_bytes(message)
        except OSError:  # the parent stopped listening (it gave up on this process, or ended)
            return


def _receive(receive: Connection, jobs: int, deadline: float) -> dict[int, Any]:
    """The results a worker sent, until it sent them all, died, or the deadline passed."""
    done: dict[int, Any] = {}
    for _ in range(jobs):
        if not receive.poll(max(0.0, deadline - time.monotonic())):
            break  # hung: the caller kills it
        try:
            i, ok, value = receive.recv()
        except (EOFError, OSError):
            break  # died
        if ok:
            done[i] = value
    return done
