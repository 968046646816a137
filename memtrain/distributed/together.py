"""What the processes of a multi-process run decide together: one small all-reduce per decision.

Every helper is a no-op in one process (or without a process group), so single-process code calls
them unconditionally. Each is a collective with several: every process must call it, at the same
point of its work, or they wait for each other forever.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def world() -> tuple[int, int]:
    """(this process's rank, number of processes); (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def largest(values: Sequence[int], device: torch.device | str = "cpu") -> list[int]:
    """Each of ``values``' maximum over all processes."""
    return _reduce(values, "MAX", device)


def smallest(values: Sequence[int], device: torch.device | str = "cpu") -> list[int]:
    """Each of ``values``' minimum over all processes."""
    return _reduce(values, "MIN", device)


def flagged_ranks(flag: bool, device: torch.device | str = "cpu") -> list[int]:
    """The ranks of the processes that pass ``flag=True`` (every process learns all of them)."""
    rank, size = world()
    if size == 1:
        return [0] if flag else []
    mine = [0] * size
    mine[rank] = int(flag)
    return [r for r, f in enumerate(largest(mine, device)) if f]


def _reduce(values: Sequence[int], op: str, device: torch.device | str) -> list[int]:
    import torch.distributed as dist

    if world()[1] == 1:
        return list(values)
    # NCCL reduces only CUDA tensors; gloo CPU ones: the device of the process's model says which
    tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    return [int(v) for v in tensor.tolist()]


def drop_gradients(model: nn.Module) -> None:
    """Forget every gradient of the current optimizer step, FSDP2's unsharded ones included.

    ``zero_grad`` reaches the parameters the model shows, which under FSDP2 are the shards.
    Between the micro-batches of an accumulated step (no gradient sync) FSDP2 keeps the full
    gradients it has not yet reduce-scattered on its own unsharded parameters; a redone step
    must not add them in again. (torch 2.13's ``FSDPParam`` fields; nothing public clears them.)
    """
    model.zero_grad(set_to_none=True)
    from torch.distributed.fsdp import FSDPModule

    from memtrain._compat.torch_distributed import drop_unsharded_gradient, fsdp_params

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for param in fsdp_params(module):
            drop_unsharded_gradient(param)
