"""Starting the processes of a multi-process run, and what happens when one fails or is stopped.

The launcher is torch's elastic agent (what ``torchrun`` runs), started inside the ``memtrain``
process instead of as a ``torchrun`` subprocess (on several machines, one per machine, meeting
through torch's c10d rendezvous: :mod:`memtrain.run.nodes`), so that memtrain sees which process failed and
with which message, gives its exit status back, and restores its own signal handlers. Each
process runs ``python -m memtrain.run.worker`` on the resolved recipe.

- A user mistake in a process (:class:`MemtrainError`) comes back as that message and exit
  status; a bug as its exception, its traceback being printed by the process itself.
- SIGINT/SIGTERM reach the processes once, through the agent (they run in their own sessions);
  they finish their step and save a checkpoint together (:class:`memtrain.reliability.guards.StopOnSignal`).
- No process outlives a killed launcher (:func:`exit_with_parent`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from memtrain.config import RunConfig, dump_recipe
from memtrain.errors import MemtrainError, first_line
from memtrain.run.nodes import Machines, machines

WORKER_MODULE = "memtrain.run.worker"
RESULT_FILE = "rank{rank}.pkl"
CHOICES_FILE = "autofit_choices.json"  # the micro-batches a probe may choose among
# On SIGINT/SIGTERM the agent passes the signal on, and the processes finish their step and
# save a checkpoint together; they are killed if that takes longer than this.
SHUTDOWN_TIMEOUT_S = 300


class LaunchError(MemtrainError):
    """A training process failed; carries that process's exit status."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launch_needed(cfg: RunConfig) -> bool:
    """True in the process the user started when the recipe asks for several processes.

    A process started by a launcher (memtrain's, ``torchrun``, ``accelerate launch``) has
    ``WORLD_SIZE`` set; it trains, and its world size must be the recipe's.
    """
    started_as = os.environ.get("WORLD_SIZE")
    if started_as is None:
        return cfg.distributed.processes > 1
    if int(started_as) != cfg.distributed.processes:
        raise MemtrainError(
            f"`distributed.processes`: the recipe says {cfg.distributed.processes}, but this process is "
            f"one of {started_as} started by a launcher (WORLD_SIZE={started_as}). Fix: set "
            f"`distributed.processes={started_as}`, or run `memtrain train` without a launcher.")
    return False


def forget_launch() -> None:
    """In a process a launched one starts (to trace, say): not one of the launched processes."""
    for name in [n for n in os.environ if n.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))] + [
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        os.environ.pop(name, None)


def bind_device() -> None:
    """In a launched process on a CUDA machine: take the GPU of this local rank, before the
    model (or a quantized model's weights, placed on the current device) lands on GPU 0."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and torch.cuda.is_available():
        torch.cuda.set_device(int(local_rank))


def launch(cfg: RunConfig, choices: list[tuple[int, int]] | None = None) -> list[Any]:
    """Run the recipe in this machine's share of ``cfg.distributed.processes`` and wait for them.

    Each process runs ``python -m memtrain.run.worker`` on the resolved recipe and inherits the
    environment, the working directory and the terminal. On CPU they talk over gloo; on CUDA
    each takes one GPU and they talk over NCCL. With several ``distributed.nodes`` this machine
    runs ``processes / nodes`` of them and meets the others at the rendezvous
    (:mod:`memtrain.run.nodes`).

    Args:
        cfg: the planned recipe (no ``auto`` left).
        choices: the (micro-batch, accumulation) pairs the auto-fit probe may choose among, when
            the recipe as written said ``micro_batch_size: auto`` (:func:`memtrain.plan.autofit.confirm`).

    Returns:
        What each process of this machine returned from ``memtrain.run.train.train``, by rank.

    Raises:
        LaunchError: a process failed; the message is its error, ``exit_code`` its exit status.
        MemtrainError: the machines did not meet (address, port, a machine that never started).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    m = machines(cfg.distributed)
    _check_devices(m.per_node)
    n = cfg.distributed.processes
    with tempfile.TemporaryDirectory(prefix="memtrain-launch-") as tmp:
        recipe = Path(tmp, "recipe.yaml")
        recipe.write_text(dump_recipe(cfg), encoding="utf-8")
        if choices is not None:
            Path(tmp, CHOICES_FILE).write_text(json.dumps(choices), encoding="utf-8")
        env_threads = {} if "OMP_NUM_THREADS" in os.environ else {
            # torchrun would pin every process to one thread; share the cores instead.
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // m.per_node))}
        with _environ(env_threads), _kept_signal_handlers():
            try:
                elastic_launch(_launch_config(m), sys.executable)("-m", WORKER_MODULE, str(recipe), tmp)
            except ChildFailedError as err:
                raise _launch_error(err, n) from None
            except SignalException as err:  # the agent passed the signal on and waited for them
                raise _interrupted(cfg, err.sigval) from None
            except RendezvousError as err:
                raise _not_met(m, err) from None
        files = sorted(Path(tmp).glob(RESULT_FILE.format(rank="*")), key=lambda p: int(p.stem[4:]))
        return [pickle.loads(p.read_bytes()) for p in files]


def _launch_config(m: Machines) -> Any:
    """What ``torchrun`` configures: ``--standalone --nproc-per-node N`` on one machine, else
    ``--nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint ADDR:PORT``."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    several = m.nodes > 1
    # torch without `LaunchConfig.shutdown_timeout` (2.11 has none): its agent waits 30 s, then kills
    wait = ({"shutdown_timeout": SHUTDOWN_TIMEOUT_S}
            if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
    return LaunchConfig(
        min_nodes=m.nodes, max_nodes=m.nodes, nproc_per_node=m.per_node,
        # every machine must name the same run; one machine's run is its own
        run_id=f"memtrain-{m.endpoint}" if several else str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint=m.endpoint,
        # machine 0 hosts the rendezvous store (without it, torch guesses from host names)
        rdzv_configs={"is_host": m.hosts_rendezvous} if several else {},
        max_restarts=0, monitor_interval=0.1, **wait)


def _not_met(m: Machines, err: BaseException) -> MemtrainError:
    first = first_line(err)
    where = "host the rendezvous" if m.hosts_rendezvous else "reach the rendezvous"
    return MemtrainError(
        f"`distributed.master_addr`/`master_port`: machine {m.node_rank} of {m.nodes} could not {where} "
        f"at {m.endpoint}, or not every machine joined ({type(err).__name__}: {first}). Fix: start "
        "memtrain on every machine with the same recipe, `distributed.nodes` machines in all, "
        "`master_addr` the address of machine 0 as the others reach it, and a free `master_port`.")


def _launch_error(err: Any, n: int) -> LaunchError:
    """The root cause among the failed processes, as memtrain reports it.

    The root cause is a process that reported an error (the others were stopped by the agent,
    maybe within the same second), else one that exited on its own, else one ended by a signal
    other than the SIGTERM the agent sends the survivors (SIGKILL: most often the kernel's
    out-of-memory killer).
    """
    rank, failure = min(err.failures.items(), key=lambda item: (
        not os.path.isfile(item[1].error_file), item[1].exitcode <= 0,
        item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0]))
    code = failure.exitcode if failure.exitcode > 0 else 1
    where = f"training process {rank} of {n}"
    if failure.exitcode == -signal.SIGKILL:
        return LaunchError(
            f"{where} was killed (SIGKILL), most often by the kernel's out-of-memory killer when host "
            "RAM runs out. Fix: free host memory or lower what the run keeps there "
            "(`training.micro_batch_size`, `memory.offload.*`, `memory.host_budget`).", code)
    if isinstance(failure.message, dict):  # an exception recorded by `record`: a bug
        return LaunchError(f"{where} failed: {failure.message.get('message')} (its traceback is "
                           "printed above)", code)
    if os.path.isfile(failure.error_file):  # a user mistake the worker reported
        return LaunchError(f"{failure.message} (in {where})", code)
    return LaunchError(f"{where} failed with exit status {failure.exitcode}: {failure.message}", code)


def _interrupted(cfg: RunConfig, signum: int) -> MemtrainError:
    from memtrain.reliability.checkpoints import last_complete_checkpoint
    from memtrain.reliability.guards import Interrupted

    last = last_complete_checkpoint(cfg.output.dir)
    saved = f"the last checkpoint is {last}" if last else "no checkpoint was saved"
    return Interrupted(f"Stopped by {signal.Signals(signum).name}; {saved}. Resume with the same command "
                       "plus `training.resume=true`.", signum)


def _check_devices(n: int) -> None:
    """``n`` processes on this machine need ``n`` GPUs when it has any."""
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise MemtrainError(
            f"`distributed.processes`: {n} processes on this machine need {n} GPUs (one each), it has "
            f"{torch.cuda.device_count()}. Fix: set `distributed.processes` to at most "
            f"{torch.cuda.device_count()} per machine (× `distributed.nodes`), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run on CPU.")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """The elastic agent turns SIGTERM/SIGINT/... into exceptions that stop the workers and
    never restores the handlers; restore them for a Python caller."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    sigs = [getattr(signal, n) for n in names if hasattr(signal, n)]
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def exit_with_parent() -> None:
    """Linux: have the kernel send this process SIGTERM when its parent (the launcher) dies, so
    that no training process outlives a killed launcher. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
