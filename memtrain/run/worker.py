"""One training process of a multi-process run: ``python -m memtrain.run.worker RECIPE EXCHANGE_DIR``.

Started by :func:`memtrain.run.launch.launch` (through torch's elastic agent, which sets
``RANK``/``WORLD_SIZE``/...). It trains the resolved recipe and leaves what ``train`` returned in
``EXCHANGE_DIR/rank<R>.pkl`` for the launcher, with every process's measured memory (gathered
from all machines). ``EXCHANGE_DIR/autofit_choices.json``, when there, holds the micro-batches an
auto-fit probe may choose among (the recipe said ``micro_batch_size: auto``). Rank 0 alone prints
the start-up table, the progress bar and the result. A user mistake is recorded in torch's error
file (the launcher shows its message) and ends the process with its exit status, without a
traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

# What gloo says in the processes left waiting in a collective when another process exits.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def main(argv: list[str]) -> int:
    """Train the recipe at ``argv[0]`` and write the result into the folder ``argv[1]``."""
    from rich.console import Console

    from memtrain.config import load_recipe
    from memtrain.errors import MemtrainError
    from memtrain.run.launch import CHOICES_FILE, RESULT_FILE, exit_with_parent
    from memtrain.run.train import train

    exit_with_parent()
    recipe, exchange = argv
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING if rank == 0 else logging.ERROR, format="%(message)s")
    choices_file = Path(exchange, CHOICES_FILE)
    choices = ([(m, a) for m, a in json.loads(choices_file.read_text(encoding="utf-8"))]
               if choices_file.is_file() else None)
    try:
        result = train(load_recipe(recipe), console=Console(quiet=rank != 0), autofit_choices=choices)
    except MemtrainError as err:
        _report(str(err))
        return err.exit_code
    except RuntimeError as err:
        if not any(text in str(err) for text in PEER_GONE):
            raise
        # Another process failed and closed its connections while this one waited on it: that
        # process's error is the one to show (the launcher picks it: this one leaves no error file).
        print(f"training process {rank}: stopped, another process failed", file=sys.stderr)
        return 1
    result.model = None  # sharded over the processes; the saved files hold it whole
    if rank != 0 and result.memory is not None:
        result.memory.timeline = []  # only rank 0's goes into reports
    result.process_memory = _every_process(result.memory)
    Path(exchange, RESULT_FILE.format(rank=rank)).write_bytes(pickle.dumps(result))
    _leave_group()
    return 0


def _leave_group() -> None:
    """End the process group before the interpreter exits: its gloo threads, still running at exit,
    aborted a finished process once ("terminate called without an active exception", exit -6,
    after the model was saved; tests/distributed/test_distributed.py's two-machine run, 1 in 3)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every process has written its result: no collective is left in flight
        dist.destroy_process_group()


def _every_process(memory: Any) -> list[Any]:
    """Every process's measured step, by rank (the machines of a run may not share a folder)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [memory]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, memory)
    return out


def _report(message: str) -> None:
    """Leave a user error where torch's launcher looks for it (it becomes the launcher's message)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    else:  # started by another launcher: the terminal is the only place
        print(f"error: {message}", file=sys.stderr)


if __name__ == "__main__":
    from memtrain import lazy_setup

    lazy_setup.install()  # before torch's and Hugging Face's libraries are imported
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)(sys.argv[1:]))
