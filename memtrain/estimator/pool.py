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

Inside :func:`kept_workers` (a planner's search: a trace group after another), the workers a call
forked stay, and the next call hands them their shares as pickled jobs (a trace's job is a few KiB)
instead of forking new ones. A worker keeps what it learnt: torch's fake-tensor dispatch cache holds
the shapes of its own share (a forked worker starts with its parent's only), which the next group,
tracing the same micro-batches, meets again; and it does not copy its parent's pages again. The
quickstart's plan (2 groups of 4 traces): its second group 1.17-1.27 s with a forked worker,
0.97-1.00 s with the kept one. A job that does not pickle makes that call fork fresh workers, as
outside a block; a kept worker that dies, hangs or is left unread is dropped (killed) and its jobs
run here, as above (a job's own error leaves its worker kept).
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
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


@dataclass(eq=False)
class _Worker:
    """A forked worker: its process, the pipe its results come back on, and (kept workers) the pipe
    later calls' jobs go out on."""

    process: Any
    results: Connection
    jobs: Connection | None = None

    def end(self, ask: bool = True) -> None:
        """Stop it: a kept worker is asked to (its job pipe closed) where ``ask``, else killed."""
        if self.jobs is not None:
            self.jobs.close()  # the worker reads the end of its jobs and returns
            if ask:
                self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.results.close()


_KEPT: list[_Worker] | None = None  # inside kept_workers(): the workers kept for the next call


@contextlib.contextmanager
def kept_workers() -> Iterator[None]:
    """Within the block, :func:`run_all` keeps the workers it forks and hands later calls' shares to
    them (see the module docstring); they end with the block. Nested blocks share the outer one's."""
    global _KEPT
    if _KEPT is not None:
        yield
        return
    _KEPT = []
    try:
        yield
    finally:
        kept, _KEPT = _KEPT, None
        for worker in kept:
            worker.end()


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
    kept = _handed(jobs, shares[1:])  # the shares a kept worker takes, pickled
    global _JOBS
    _JOBS = jobs
    context = multiprocessing.get_context("fork")
    workers: list[_Worker] = []
    answered: set[int] = set()  # the workers whose results were all read
    gc.freeze()  # see the module docstring: no garbage-collector pass over the shared heap
    try:
        for k, share in enumerate(shares[1:]):
            handed = kept[k] if k < len(kept) else None
            if handed is not None:
                assert _KEPT is not None and _KEPT[k].jobs is not None
                with contextlib.suppress(OSError):  # died since: nothing comes back, its share runs here
                    _KEPT[k].jobs.send_bytes(handed)
                workers.append(_KEPT[k])
                continue
            receive, send = context.Pipe(duplex=False)
            inbox, outbox = context.Pipe(duplex=False) if kept else (None, None)
            process = context.Process(target=_work, args=(share, send, inbox, outbox), daemon=True)
            process.start()  # forks here
            send.close()
            if inbox is not None:
                inbox.close()
            workers.append(_Worker(process, receive, outbox))
            if outbox is not None:
                _KEPT.append(workers[-1])  # type: ignore[union-attr]  # kept: `kept` is only set then
        start = time.perf_counter()
        results: dict[int, Any] = {i: jobs[i]() for i in shares[0]}
        patience = max(PATIENCE[1], PATIENCE[0] * (time.perf_counter() - start))
        deadline = time.monotonic() + patience
        for k, (share, worker) in enumerate(zip(shares[1:], workers, strict=True)):
            done = _receive(worker.results, len(share), deadline)
            if len(done) == len(share):
                answered.add(k)
            for i in share:  # failed, lost with a dead worker, or late: run here
                ok, value = done.get(i, (False, None))
                results[i] = value if ok else jobs[i]()
    finally:
        _JOBS = ()
        gc.unfreeze()
        for k, worker in enumerate(workers):
            if worker.jobs is not None and k in answered:
                continue  # kept for the next call
            if _KEPT is not None:  # dead, hung or left unread: not to be trusted again
                _KEPT[:] = [w for w in _KEPT if w is not worker]
            worker.end(ask=False)
    return [results[i] for i in range(len(jobs))]


def _handed(jobs: Sequence[Callable[[], Any]], shares: Sequence[range]) -> list[bytes | None]:
    """Inside :func:`kept_workers`, each share's jobs pickled for a kept worker (None where a new
    one is forked: past the workers kept so far); outside, or where a job does not pickle, []."""
    if _KEPT is None:
        return []
    try:
        return [ForkingPickler.dumps([(i, jobs[i]) for i in share]).tobytes() if k < len(_KEPT) else None
                for k, share in enumerate(shares)]
    except Exception:  # a job that does not pickle (a closure): fresh workers inherit them all
        return []


def _work(share: range, send: Connection, inbox: Connection | None = None,
          inbox_writer: Connection | None = None) -> None:
    """A worker: its share of the jobs it was forked with, then (``inbox``: kept) the shares later
    calls send, pickled, until the parent closes the pipe (``inbox_writer``: this process's copy
    of its other end, closed here so that the parent's closing ends it)."""
    torch.set_num_threads(1)  # see the module docstring: OpenMP's pool is not the child's
    if inbox_writer is not None:
        inbox_writer.close()
    for other in _KEPT or ():  # this process's copies of the pipes to workers forked before it:
        other.results.close()  # held here, a closed job pipe would not end its worker
        if other.jobs is not None:
            other.jobs.close()
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    # A result larger than the pipe's buffer (64 KiB; a trace's rows are hundreds of KiB) waits in
    # `send` until this process's parent reads it, which it does once its own share is done: sent
    # from a thread, the next job runs meanwhile (in the job's loop it would wait, idle). Pickled
    # here, as `Connection.send` would, so that a result that does not pickle fails as its job.
    sender = threading.Thread(target=_send_all, args=(outbox, send))
    sender.start()
    try:
        _run_share([(i, _JOBS[i]) for i in share], outbox)
        while inbox is not None:
            try:
                handed = ForkingPickler.loads(inbox.recv_bytes())
            except (EOFError, OSError):
                break  # the block ended
            _run_share(handed, outbox)
    finally:
        outbox.put(None)
        sender.join()


def _run_share(share: Sequence[tuple[int, Callable[[], Any]]],
               outbox: queue.SimpleQueue[bytes | None]) -> None:
    for i, job in share:
        try:
            message = ForkingPickler.dumps((i, True, job()))
        except Exception:  # the job's own error is raised where it is run again
            message = ForkingPickler.dumps((i, False, None))
        outbox.put(bytes(message))


def _send_all(outbox: queue.SimpleQueue[bytes | None], send: Connection) -> None:
    while (message := outbox.get()) is not None:
        try:
            send.send_bytes(message)
        except OSError:  # the parent stopped listening (it gave up on this process, or ended)
            return


def _receive(receive: Connection, jobs: int, deadline: float) -> dict[int, tuple[bool, Any]]:
    """What a worker sent for each job (whether it ran, its result), until it sent them all, died,
    or the deadline passed."""
    done: dict[int, tuple[bool, Any]] = {}
    for _ in range(jobs):
        if not receive.poll(max(0.0, deadline - time.monotonic())):
            break  # hung: the caller kills it
        try:
            i, ok, value = receive.recv()
        except (EOFError, OSError):
            break  # died
        done[i] = (ok, value)
    return done
