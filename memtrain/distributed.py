"""Several processes: launch them, shard the model with FSDP2, estimate one process's memory.

Saves: with N processes each holds 1/N of the parameters, gradients and optimizer state, plus the
full weights (and, in backward, full gradients) of the layer being computed (FSDP2: Zhao et al.,
2023, "PyTorch FSDP"; the ZeRO-3 partitioning of Rajbhandari et al., 2020). With
``memory.offload.parameters`` the shards live in host memory and only the layer in use is on the
device. Costs: an all-gather of every layer's weights in forward and again in backward, and a
reduce-scatter of its gradients, on every step; with offload, host<->device copies as well.

The Trainer runs it as accelerate's FSDP2 (``FullyShardedDataParallelPlugin``, ``fsdp_version=2``):
no-sync gradient accumulation, DTensor-aware gradient clipping, full-state-dict saving. Two
things are hand-written, and why:

- memtrain calls ``fully_shard`` itself (:func:`shard_model`; the units accelerate makes: each
  decoder layer, the input embedding, the output head, then the root) before the Trainer
  exists, so ``Accelerator.prepare`` finds an FSDP2 model and leaves it as it is. Accelerate
  only enables FSDP on accelerators: on CPU it silently trains replicas with DDP. One code path
  keeps the CPU tests meaningful for GPU runs, and the estimator traces the very same function
  under a fake process group (:func:`estimate_process_step`). On CPU, :func:`adopt_fsdp` then
  switches the accelerator's state from DDP to FSDP2 after creation.
- the launcher is torch's elastic agent (what ``torchrun`` runs), started in-process so that
  memtrain sees which worker failed and with which message, gives the exit status back, and
  restores its signal handlers; workers die with their launcher (:func:`exit_with_parent`). A
  SIGINT/SIGTERM reaches the workers once, through the agent (they run in their own sessions),
  and they stop together after a step with a checkpoint (:class:`memtrain.safety.StopOnSignal`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memtrain import patches
from memtrain.config import DistributedConfig, RunConfig, dump_recipe
from memtrain.errors import MemtrainError

if TYPE_CHECKING:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import DeviceMesh

    from memtrain.memory.meter import StepMemory

Config = DistributedConfig

WORKER_MODULE = "memtrain._worker"
# On SIGINT/SIGTERM the launcher passes the signal on, and the processes finish their step and
# save a checkpoint together (memtrain.safety); they are killed if that takes longer than this.
SHUTDOWN_TIMEOUT_S = 300
RESULT_FILE = "rank{rank}.pkl"


class LaunchError(MemtrainError):
    """A training process failed; carries that process's exit status."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ------------------------------------------------------------------------------------- launch


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


def launch(cfg: RunConfig) -> list[Any]:
    """Run the recipe in ``cfg.distributed.processes`` processes and wait for them.

    Each process runs ``python -m memtrain._worker`` on the resolved recipe and inherits the
    environment, the working directory and the terminal. On CPU they talk over gloo; on CUDA
    each takes one GPU and they talk over NCCL.

    Returns:
        What each process's ``memtrain.runner.train`` returned, by rank.

    Raises:
        LaunchError: a process failed; the message is its error, ``exit_code`` its exit status.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n = cfg.distributed.processes
    _check_devices(n)
    with tempfile.TemporaryDirectory(prefix="memtrain-launch-") as tmp:
        recipe = Path(tmp, "recipe.yaml")
        recipe.write_text(dump_recipe(cfg), encoding="utf-8")
        config = LaunchConfig(  # what `torchrun --standalone --nproc-per-node n` configures
            min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()),
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        env_threads = {} if "OMP_NUM_THREADS" in os.environ else {
            # torchrun would pin every process to one thread; share the cores instead.
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        with _environ(env_threads), _kept_signal_handlers():
            try:
                elastic_launch(config, sys.executable)("-m", WORKER_MODULE, str(recipe), tmp)
            except ChildFailedError as err:
                raise _launch_error(err, n) from None
            except SignalException as err:  # the agent passed the signal on and waited for them
                raise _interrupted(cfg, err.sigval) from None
        return [pickle.loads(Path(tmp, RESULT_FILE.format(rank=r)).read_bytes()) for r in range(n)]


def _launch_error(err: Any, n: int) -> LaunchError:
    """The root cause among the failed processes, as memtrain reports it.

    The root cause is a process that reported an error (the others were stopped by the agent,
    maybe within the same second), else one that exited on its own.
    """
    rank, failure = min(err.failures.items(), key=lambda item: (
        not os.path.isfile(item[1].error_file), item[1].exitcode <= 0, item[1].timestamp, item[0]))
    code = failure.exitcode if failure.exitcode > 0 else 1
    where = f"training process {rank} of {n}"
    if isinstance(failure.message, dict):  # an exception recorded by `record`: a bug
        return LaunchError(f"{where} failed: {failure.message.get('message')} (its traceback is "
                           "printed above)", code)
    if os.path.isfile(failure.error_file):  # a user mistake the worker reported
        return LaunchError(f"{failure.message} (in {where})", code)
    return LaunchError(f"{where} failed with exit status {failure.exitcode}: {failure.message}", code)


def _interrupted(cfg: RunConfig, signum: int) -> MemtrainError:
    from memtrain.safety import Interrupted, last_complete_checkpoint

    last = last_complete_checkpoint(cfg.output.dir)
    saved = f"the last checkpoint is {last}" if last else "no checkpoint was saved"
    return Interrupted(f"Stopped by {signal.Signals(signum).name}; {saved}. Resume with the same command "
                       "plus `training.resume=true`.", signum)


def _check_devices(n: int) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise MemtrainError(
            f"`distributed.processes`: {n} processes need {n} GPUs (one each), this machine has "
            f"{torch.cuda.device_count()}. Fix: set `distributed.processes` to at most "
            f"{torch.cuda.device_count()}, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU.")


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


# ------------------------------------------------------------------------------------ sharding


def layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated block classes of a transformers model (its ``_no_split_modules``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
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

    Units: every decoder layer (resharded after its forward), the input embedding, the output
    head (kept whole from the end of forward to its backward, which follows at once), then the
    root for the rest. Tied input/output embeddings stay in the root: one parameter may only
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
    for _, unit in units:
        fully_shard(unit, reshard_after_forward=True, **kwargs)
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = inp is not None and out is not None and inp.weight is out.weight
    names = {id(m): n for n, m in model.named_modules()}
    for module, reshard in ((inp, True), (out, False)):
        if module is not None and not tied and id(module) not in inside:
            fully_shard(module, reshard_after_forward=reshard, **kwargs)
            units.append((names[id(module)], module))
    fully_shard(model, **kwargs)
    local, total = _local_and_total_bytes(model)
    offload = ", shards offloaded to the CPU" if cfg.memory.offload.parameters else ""
    patches.add_records(model, [patches.PatchRecord(
        "fsdp", [n for n, _ in units] + ["(root)"],
        f"FSDP2 over {mesh.size()} processes, {len(units) + 1} units: {local / 2**20:.1f} of "
        f"{total / 2**20:.1f} MiB of weights per process{offload}")])
    return model


def _sharded(cfg: RunConfig) -> bool:
    if cfg.distributed.processes == 1:
        return False
    if cfg.distributed.sharding == "auto":
        raise MemtrainError("`distributed.sharding`: `auto` must be resolved by the planner before "
                            "training. Fix: set it to `full` (FSDP2) or `none` (replicas, DDP).")
    return cfg.distributed.sharding == "full"


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


def quant_storage(cfg: RunConfig) -> torch.dtype | None:
    """The dtype 4-bit weights are stored in: FSDP shards them like the other weights only when
    the packed bytes are viewed as a float dtype (bitsandbytes' FSDP guidance); None = default."""
    if not _sharded(cfg) or cfg.model.quantization not in ("nf4", "fp4"):
        return None
    from memtrain.model import DTYPES

    return DTYPES[cfg.model.compute_dtype or cfg.model.dtype]


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
        reshard_after_forward=True,
        # the model is wrapped already; accelerate would look for layer classes by name, which
        # FSDP2 renamed (FSDPLlamaDecoderLayer), and fail
        auto_wrap_policy="no_wrap",
        mixed_precision_policy=mixed_precision(model),
        cpu_offload=cfg.memory.offload.parameters,
        state_dict_type="FULL_STATE_DICT",  # saving gathers whole weights that from_pretrained reads
        activation_checkpointing=False,  # memtrain's checkpointing patch does it
        cpu_ram_efficient_loading=False,
    )


def adopt_fsdp(trainer: Any, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make a Trainer (right after it created its Accelerator) treat the model as FSDP2.

    On CUDA accelerate already chose FSDP from the plugin. On CPU it enables FSDP for no backend
    and picked DDP (``MULTI_CPU``), which would wrap the sharded model in DistributedDataParallel;
    switching the shared state to FSDP makes ``prepare`` keep the FSDP2 model and the Trainer use
    its FSDP paths (no-sync accumulation, DTensor clipping, full-state-dict saving). Both shared
    states change: every later ``AcceleratorState()`` copies ``distributed_type`` from
    ``PartialState``, which would quietly turn the run back into DDP.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        PartialState().distributed_type = DistributedType.FSDP
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True


# ----------------------------------------------------------------------------------- estimate


@contextlib.contextmanager
def fake_process_group(processes: int, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """This process as rank 0 of ``processes`` fake ones: collectives do nothing, so a step can
    be traced (under ``FakeTensorMode``) with one process's shapes and memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; trace in a process without one")
    dist.init_process_group("fake", rank=0, world_size=processes, store=FakeStore())
    try:
        yield init_device_mesh(device_type, (processes,))  # outside FakeTensorMode: it reads ranks
    finally:
        dist.destroy_process_group()


def estimate_process_step(build_model: Callable[[], nn.Module], cfg: RunConfig,
                          batch: dict[str, tuple[int, ...]], steps: int = 2,
                          device_type: str = "cpu") -> StepMemory:
    """Memory of one of ``cfg.distributed.processes`` processes for a training step, without weights.

    The model is built on the meta device, materialised as fake tensors, sharded by
    :func:`shard_model` in a fake process group and trained for ``steps`` steps under
    ``FakeTensorMode``; the last step is measured (the first creates the optimizer state). Same
    code, units and meter as a real run; only the values the tensors would hold are missing.

    Args:
        build_model: returns the patched model (called under ``torch.device("meta")``; it must not
            need real weights, so no bitsandbytes quantization).
        cfg: the recipe (sharding, offload, optimizer, learning rate, gradient clipping).
        batch: shapes of the integer tensors of one micro-batch, e.g.
            ``{"input_ids": (4, 512), "labels": (4, 512)}``.
        steps: training steps to run; the last is measured.
        device_type: the device the processes compute on.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtrain.memory.meter import MemoryMeter

    make_optimizer = _optimizer_factory(cfg)  # before faking: it builds TrainingArguments
    with torch.device("meta"):
        model = build_model()
    # allow_non_fake_inputs: to_empty turns the meta parameters into fake ones (building under
    # FakeTensorMode directly fails when peft moves its adapters with `.to`).
    with fake_process_group(cfg.distributed.processes, device_type) as mesh, \
            FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device=device_type)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # to_empty gave tied weights one tensor each
        model = shard_model(model, cfg, mesh)
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        inputs = {k: torch.zeros(shape, dtype=torch.long, device=device_type) for k, shape in batch.items()}
        for _ in range(steps - 1):
            _step(model, optimizer, inputs, cfg.training.max_grad_norm)
        with MemoryMeter(model, optimizer, inputs) as meter:
            _step(model, optimizer, inputs, cfg.training.max_grad_norm)
    return meter.result()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: dict[str, torch.Tensor],
          max_grad_norm: float | None) -> None:
    """One Trainer step without accumulation: forward, backward, clipping, update, zero_grad."""
    loss = model(**inputs).loss
    loss.backward()
    del loss
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _optimizer_factory(cfg: RunConfig) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer the Trainer builds for the recipe (same class and arguments)."""
    from transformers import Trainer

    from memtrain.config.batch import Batch
    from memtrain.trainer import training_arguments

    args = training_arguments(cfg, Batch(1, 1, cfg.distributed.processes), tempfile.gettempdir(), False)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return lambda params: cls(params, **kwargs)
