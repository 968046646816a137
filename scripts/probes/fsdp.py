"""Measure each process of a real multi-process ``memtrain train`` run with an independent counter.

Private to ``scripts/bench/accuracy/fsdp.py`` and ``tests/distributed/test_distributed.py``. Shares no code
with
``memtrain.memory``: :class:`LiveStorages` is ``scripts/probes/memprobe.py``'s dispatch-mode storage counter
(copied here so that scripts do not import from tests, as the brief of issue 14 allowed), extended
for what a multi-process run does that a single process does not:

- **storage resizes**: FSDP2 frees and re-allocates a layer's full (unsharded) weights by resizing
  their storage (``UntypedStorage.resize_``), which no dispatch mode sees; the counter wraps
  ``resize_`` while it runs (as torch's own ``MemTracker`` does) and follows the new size;
- **tensor subclasses**: an op on FSDP2's DTensor parameters is handed back (``NotImplemented``) so
  that DTensor runs it as ops on local tensors, which the counter then sees and counts;
- **the whole run is counted**: the counter is entered before the model is built, so weights,
  optimizer state, and what the backend allocates in C++ through ATen (DDP's gradient buckets) are
  all counted from their creation. Weights ``from_pretrained`` reads from a checkpoint (a
  quantized model built from a config is saved and reloaded) come from file buffers, not from an
  op: at ``on_train_begin`` every parameter and buffer not counted yet is added. Per optimizer
  step the peak restarts at ``on_step_begin`` (the batch is already loaded) and is read at
  ``on_step_end`` (after ``zero_grad``).

:func:`launch` starts ``processes`` processes with torch's elastic agent (what ``torchrun`` runs),
and each trains a list of resolved recipes one after the other in the same process group, calling
``memtrain.run.train.train`` exactly as a ``memtrain train`` worker does (``WORLD_SIZE`` is set, so it
trains instead of launching). Returns, per recipe, each rank's peak of every optimizer step.
"""

from __future__ import annotations

import gc
import os
import sys
import uuid
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from scripts import harness

ROOT = harness.ROOT


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of every storage created (or resized) while it is active; ``peak`` since
    the last :meth:`reset_peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: Any = WeakIdKeyDictionary()  # storage -> [bytes] (a cell the finalizer reads)
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self) -> LiveStorages:
        original = self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            cell = self._sizes.get(storage)
            if cell is not None:
                self.current += storage.nbytes() - cell[0]
                cell[0] = storage.nbytes()
                self.peak = max(self.peak, self.current)
            else:
                self._track(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current

    def adopt(self, tensors: Any) -> None:
        """Count tensors that exist without an op having made them (weights read from a
        checkpoint file by ``from_pretrained`` come from file buffers, not from an op)."""
        from torch.distributed.tensor import DTensor

        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            self._track(local.untyped_storage())
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run it as ops on local tensors, counted then
        out = func(*args, **(kwargs or {}))
        if any(issubclass(t, FakeTensor) for t in types):
            return out  # DTensor's sharding propagation, on fake tensors: no memory
        # Views and in-place results share an input's storage: only new storages are counted.
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and id(leaf.untyped_storage()) not in inputs:
                self._track(leaf.untyped_storage())
        self.peak = max(self.peak, self.current)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        if storage in self._sizes or storage.device.type == "meta":
            return
        cell = [storage.nbytes()]
        self._sizes[storage] = cell
        self.current += cell[0]
        weakref.finalize(storage, self._free, cell)

    def _free(self, cell: list[int]) -> None:
        self.current -= cell[0]


def _callback(probe: LiveStorages, peaks: list[int]) -> Any:
    from transformers import TrainerCallback

    class StepPeaks(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           **kwargs: Any) -> None:
            probe.adopt([*model.parameters(), *model.buffers()])

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            probe.reset_peak()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            peaks.append(probe.peak)

    return StepPeaks()


def worker(recipes: list[str]) -> list[list[int]]:
    """In one launched process: train each recipe (YAML text) under the counter; per recipe, the
    peak of every optimizer step."""
    import yaml
    from rich.console import Console

    from memtrain.config import load_recipe
    from memtrain.run.train import train

    _save_on_every_rank()
    out = []
    for text in recipes:
        cfg = load_recipe(yaml.safe_load(text))
        gc.collect()
        peaks: list[int] = []
        with LiveStorages() as probe:
            train(cfg, console=Console(quiet=True), callbacks=[_callback(probe, peaks)])
        _forget_accelerator()
        out.append(peaks)
    return out


def _forget_accelerator() -> None:
    """What one run leaves in accelerate's process-wide state, undone for the next run: an FSDP
    run switched it from DDP (:func:`memtrain.trainer.trainer.adopt_fsdp`) and keeps its plugin."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state()
    if PartialState._shared_state and PartialState().distributed_type == DistributedType.FSDP:
        PartialState().distributed_type = DistributedType.MULTI_CPU


def _save_on_every_rank() -> None:
    """A quantized model built from a config is saved and reloaded (``memtrain.model.load_model``);
    once a process group exists transformers saves on rank 0 only. A real run loads its model
    before the group exists; here one process trains several recipes, so every rank saves (each
    into its own temporary folder)."""
    from transformers.distributed.mixin import DistributedMixin  # type: ignore[import-not-found]

    DistributedMixin.should_save_on_this_rank = lambda self, is_main_process: is_main_process


def launch(processes: int, recipes: list[str]) -> list[list[list[int]]]:
    """Train every recipe in ``processes`` processes; ``[recipe][rank] -> step peaks``."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if processes == 1:
        return [[peaks] for peaks in _single(recipes)]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads
    sys.path.insert(0, str(ROOT))  # spawned workers import this module by its package name
    try:
        by_rank = elastic_launch(config, worker)(recipes)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [[by_rank[r][i] for r in range(processes)] for i in range(len(recipes))]


def _single(recipes: list[str]) -> list[list[int]]:
    return worker(recipes)  # in this process: no launcher, as `memtrain train` with one process
