"""Several processes: shard the model with FSDP2, run it in the Trainer, estimate one process.

Saves: with N processes each holds 1/N of the parameters, gradients and optimizer state, plus the
full weights (and, in backward, full gradients) of the layer being computed (FSDP2: Zhao et al.,
2023, "PyTorch FSDP"; the ZeRO-3 partitioning of Rajbhandari et al., 2020). ``sharding: grad_op``
keeps each layer's gathered weights from its forward to its backward (ZeRO-2): by the end of the
forward the process holds the whole model's weights, in exchange for one all-gather per step
instead of two. With ``memory.offload.parameters`` the shards (and their gradients and optimizer
state) live in host memory and only the layer in use is on the device. Costs: an all-gather of
every layer's weights in forward and again in backward (``full``), and a reduce-scatter of its
gradients, on every step; with offload, host<->device copies as well. With gradient accumulation
the micro-batches before the last do not reduce-scatter (accelerate's ``no_sync``): each process
accumulates the full gradients of the whole model until the last micro-batch.

The Trainer runs it as accelerate's FSDP2 (``FullyShardedDataParallelPlugin``, ``fsdp_version=2``):
no-sync gradient accumulation, DTensor-aware gradient clipping, full-state-dict saving. What is
hand-written, and why: memtrain calls ``fully_shard`` itself (:func:`shard_model`; the units
accelerate makes: each decoder layer, the input embedding, the output head, then the root)
before the Trainer exists, so ``Accelerator.prepare`` finds an FSDP2 model and keeps it.
Accelerate only enables FSDP on accelerators: on CPU it silently trains replicas with DDP. One
code path keeps the CPU tests meaningful for GPU runs, and the estimator traces the very same
function in a fake process group (:func:`fake_process_group`, used by
:func:`memtrain.estimator.trace.trace_step`). On CPU,
:func:`memtrain.trainer.trainer.adopt_fsdp` switches the accelerator's state from DDP to FSDP2 after creation.

Starting the processes: :mod:`memtrain.run.launch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain import patches
from memtrain.config import DistributedConfig, RunConfig
from memtrain.distributed.sharding import reshard_after_forward
from memtrain.distributed.sharding import sharded as _sharded

if TYPE_CHECKING:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import DeviceMesh

Config = DistributedConfig

# ------------------------------------------------------------------------------------ sharding


def layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated block classes of a transformers model (its ``_no_split_modules``)."""
    from memtrain._compat.transformers_model import no_split_modules

    base = patches.base_model(model)
    names = no_split_modules(base)
    # the MRO, because FSDP2 swaps a sharded module's class for a subclass named FSDP<Name>
    found = {c for m in base.modules() for c in type(m).__mro__ if c.__name__ in names}
    if not found:
        raise patches.NoMatchError(
            f"`distributed.sharding`: cannot find the layers of {type(base).__name__} to shard (its "
            f"`_no_split_modules` is {sorted(names) or 'empty'}). Fix: set `distributed.sharding: none` "
            "to replicate the model in every process instead.")
    return tuple(sorted(found, key=lambda c: c.__name__))


def mixed_precision(model: nn.Module) -> Any:
    """FSDP2's policy: weights stay in the dtype the recipe loaded them in (as with one process);
    low-precision gradients are averaged across processes in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters())
    return MixedPrecisionPolicy(reduce_dtype=torch.float32 if low else None)


def shard_model(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` over the processes with FSDP2, as ``distributed.*`` says.

    Units: every decoder layer (resharded after its forward with ``sharding: full``, kept whole
    until its backward with ``grad_op``), the input embedding (likewise), the output head (kept
    whole from the end of forward to its backward, which follows at once), then the root for the
    rest. Tied input/output embeddings stay in the root: one parameter may only
    belong to one unit. Returns the model unchanged for one process or ``sharding: none``.

    Args:
        model: the patched model, identical in every process (same seed or same weights).
        cfg: the recipe; reads ``distributed`` and ``memory.offload.parameters``.
        mesh: the process mesh; defaults to all processes of the default group on this device
            (initialised here on first use).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not _sharded(cfg):
        return model
    mesh = mesh or _default_mesh()
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision(model),
              "offload_policy": (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                                 if cfg.memory.offload.parameters else OffloadPolicy())}
    classes = layer_classes(model)
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]
    inside = {id(sub) for _, unit in units for sub in unit.modules()}
    reshard = reshard_after_forward(cfg)
    for _, unit in units:
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = inp is not None and out is not None and inp.weight is out.weight
    names = {id(m): n for n, m in model.named_modules()}
    for module, again in ((inp, reshard), (out, False)):
        if module is not None and not tied and id(module) not in inside:
            fully_shard(module, reshard_after_forward=again, **kwargs)
            units.append((names[id(module)], module))
    fully_shard(model, **kwargs)
    local, total = _local_and_total_bytes(model)
    offload = ", shards offloaded to the CPU" if cfg.memory.offload.parameters else ""
    patches.add_records(model, [patches.PatchRecord(
        "fsdp", [n for n, _ in units] + ["(root)"],
        f"FSDP2 over {mesh.size()} processes (sharding {cfg.distributed.sharding}), {len(units) + 1} "
        f"units: {local / 2**20:.1f} of "
        f"{total / 2**20:.1f} MiB of weights per process{offload}")])
    return model


def _default_mesh() -> DeviceMesh:
    from accelerate import PartialState
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    # The Trainer's own set-up (gloo on CPU, NCCL and one GPU per process on CUDA); it runs
    # after the model is loaded because transformers writes files only on rank 0 once a
    # process group exists (the quantized from-config load saves and reloads the model).
    state = PartialState(cpu=not cuda)
    return init_device_mesh(state.device.type, (state.num_processes,))


def _local_and_total_bytes(model: nn.Module) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        size = p.element_size()
        total += p.numel() * size
        local += (p.to_local().numel() if isinstance(p, DTensor) else p.numel()) * size
    return local, total


# ------------------------------------------------------------------------------------ Trainer


def fsdp_plugin(model: nn.Module, cfg: RunConfig) -> FullyShardedDataParallelPlugin | None:
    """accelerate's description of the sharding :func:`shard_model` applied (None: not sharded).

    Every field is given, so that accelerate reads none of its ``FSDP_*`` environment variables.
    """
    if not _sharded(cfg):
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=reshard_after_forward(cfg),
        # the model is wrapped already; accelerate would look for layer classes by name, which
        # FSDP2 renamed (FSDPLlamaDecoderLayer), and fail
        auto_wrap_policy="no_wrap",
        mixed_precision_policy=mixed_precision(model),
        cpu_offload=cfg.memory.offload.parameters,
        state_dict_type="FULL_STATE_DICT",  # saving gathers whole weights that from_pretrained reads
        activation_checkpointing=False,  # memtrain's checkpointing patch does it
        cpu_ram_efficient_loading=False,
    )


# ----------------------------------------------------------------------------------- estimate


@contextlib.contextmanager
def fake_process_group(processes: int, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """This process as rank 0 of ``processes`` fake ones: collectives do nothing, so a step can
    be traced (under ``FakeTensorMode``) with one process's shapes and memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memtrain._compat.torch_distributed import fake_store

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; trace in a process without one")
    dist.init_process_group("fake", rank=0, world_size=processes, store=fake_store())
    try:
        yield init_device_mesh(device_type, (processes,))  # outside FakeTensorMode: it reads ranks
    finally:
        dist.destroy_process_group()
