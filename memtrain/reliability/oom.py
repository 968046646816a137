"""What an out-of-memory error is, on any device, and freeing memory after one.

Shared by the recoveries: a training micro-batch (:mod:`memtrain.reliability.recovery`), an evaluation
batch (:mod:`memtrain.reliability.eval_recovery`), a generation (:mod:`memtrain.reliability.generation`)
and the auto-fit probe (:mod:`memtrain.plan.autofit`).
"""

from __future__ import annotations

import gc

import torch

from memtrain.device import cuda_available

# What allocators say when they run out: CUDA's caching allocator (torch.OutOfMemoryError), torch's
# CPU allocator (a plain RuntimeError: "DefaultCPUAllocator: can't allocate memory: you tried to
# allocate ..." or "... not enough memory ..."), and CUDA errors outside the caching allocator.
OOM_TEXTS = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (on any device) rather than a bug in the step."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in OOM_TEXTS)


def free_memory() -> None:
    """Collect garbage and return cached device blocks (after the failed attempt's tensors are gone)."""
    gc.collect()
    if cuda_available():
        torch.cuda.empty_cache()
