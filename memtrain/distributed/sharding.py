"""What a recipe's ``distributed`` section asks for, as plain decisions on the config.

Kept apart from :mod:`memtrain.distributed.fsdp` (which shards real models and imports the builders)
so that the model builder can ask "is this run sharded?" without an import cycle.
"""

from __future__ import annotations

import torch

from memtrain.config import RunConfig
from memtrain.errors import MemtrainError

SHARDED = ("full", "grad_op")  # the `distributed.sharding` values that run FSDP2
# Optimizers whose update cannot run on FSDP2's sharded parameters (DTensors): bitsandbytes'
# kernels have no DTensor rule, transformers' Adafactor mixes DTensors with plain tensors.
NOT_ON_SHARDS = ("adamw_8bit", "paged_adamw_8bit", "adafactor")


def sharded(cfg: RunConfig) -> bool:
    """Does the recipe ask for FSDP2 (several processes, ``sharding: full`` or ``grad_op``)?"""
    if cfg.distributed.sharding == "auto" and cfg.distributed.processes > 1:
        raise MemtrainError("`distributed.sharding`: `auto` must be resolved by the planner before "
                            "training. Fix: set it to `full` (FSDP2), `grad_op` (FSDP2, ZeRO-2) or "
                            "`none` (replicas, DDP), or run `memtrain plan`.")
    sharded = cfg.distributed.processes > 1 and cfg.distributed.sharding in SHARDED
    # `memory.offload.parameters` without shards is a recipe problem (memtrain.config.schema)
    if sharded and cfg.training.optimizer in NOT_ON_SHARDS:
        raise MemtrainError(
            f"`training.optimizer`: {cfg.training.optimizer} cannot update FSDP2's sharded parameters "
            f"(`distributed.sharding: {cfg.distributed.sharding}`): its update step fails on DTensor "
            "shards. Fix: use `adamw` or `sgd`, or `distributed.sharding: none` (replicas).")
    return sharded


def reshard_after_forward(cfg: RunConfig) -> bool:
    """FSDP2's ``reshard_after_forward`` for the decoder layers: free a layer's gathered weights
    after its forward (``full``, ZeRO-3) or keep them until its backward (``grad_op``, ZeRO-2)."""
    return cfg.distributed.sharding != "grad_op"


def ddp_replicas(cfg: RunConfig) -> bool:
    """Several processes, each with the whole model (``sharding: none``): DDP."""
    return cfg.distributed.processes > 1 and cfg.distributed.sharding == "none"


def quant_storage(cfg: RunConfig) -> torch.dtype | None:
    """The dtype 4-bit weights are stored in: FSDP shards them like the other weights only when
    the packed bytes are viewed as a float dtype (bitsandbytes' FSDP guidance); None = default."""
    if not sharded(cfg) or cfg.model.quantization not in ("nf4", "fp4"):
        return None
    from memtrain.model import DTYPES

    return DTYPES[cfg.model.compute_dtype or cfg.model.dtype]
