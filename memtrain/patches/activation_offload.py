"""Activation offload: move tensors saved for backward to host memory, bring them back for backward.

Saves: the device bytes of every activation the decoder layers save for backward (at least
``memory.offload.min_tensor_bytes`` large). With activation checkpointing only the checkpointed
layer inputs are saved, so only they move, and device activation memory stops growing with depth.
Costs: two copies per moved tensor (device→host in forward, host→device in backward) and host
RAM for one micro-batch of them. On CUDA the copies run on a side stream from pinned buffers and
overlap compute; backward prefetches the next tensors it will need. On CPU, device and host are
the same RAM: the "host" copy is a separate tensor that the memory meter files as host, which
makes the effect measurable and testable, but saves nothing real (and costs the copies).

The mechanism is ``torch.autograd.graph.saved_tensors_hooks`` installed around each decoder
layer's forward (not around the loss and head, whose tensors backward needs first). It follows
torchtune's ``OffloadActivations`` (side stream, pinned memory, minimum size, prefetch) and
torch's ``save_on_cpu``. It is written here because ``save_on_cpu`` has neither streams nor a
size threshold and torchtune is too large a dependency for one class; memtrain also needs the
moved bytes counted (:class:`HostLedger`) and a host-RAM check before training.

Host accounting: every host copy is registered in the model's :class:`HostLedger`
(:func:`host_ledger`) while it lives, and announced to an active memory meter through
``memtrain.memory.meter.mark_host``.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtrain._compat.torch_tools import FakeTensorMode, is_fake, tensor_base, tensor_version
from memtrain.config import OffloadConfig, RunConfig, decided
from memtrain.config.batch import resolve_batch
from memtrain.device import host_budget_bytes, host_free_bytes, model_device
from memtrain.errors import MemtrainError
from memtrain.memory.meter import mark_host, traced_for_cuda
from memtrain.memory.trackers import pinned_bytes
from memtrain.patches import OFFLOAD, Doc, Knob, PatchRecord, add_records, fixed, register, undo_records
from memtrain.patches.checkpointing import disable_kv_cache, find_layers, is_checkpointed, wrap_forward
from memtrain.units import format_bytes

Config = OffloadConfig
_LEDGER_ATTR = "_memtrain_host_ledger"
HOST_RAM_MARGIN = 0.9  # refuse when offloading would need more than this share of available RAM


class HostLedger:
    """Bytes that memtrain's offload code keeps in host memory, live and at peak."""

    def __init__(self) -> None:
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}  # id of a live host storage -> bytes

    def add(self, tensor: torch.Tensor, pinned: bool = False) -> None:
        """Count ``tensor`` (a fresh host copy) until :meth:`remove` is called for it; ``pinned``:
        at the power of two CUDA's pinned allocator holds for it (:func:`pinned_bytes`)."""
        nbytes = tensor.untyped_storage().nbytes()
        nbytes = pinned_bytes(nbytes) if pinned else nbytes
        self._live[id(tensor.untyped_storage())] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        mark_host(tensor, pinned)

    def remove(self, key: int) -> None:
        """Stop counting the host storage with id ``key`` (it is being freed)."""
        self.current_bytes -= self._live.pop(key, 0)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Is ``tensor``'s storage one of the live host copies?"""
        return id(tensor.untyped_storage()) in self._live

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current bytes."""
        self.peak_bytes = self.current_bytes


class _Handle:
    """What autograd keeps instead of a moved tensor; the host copy dies with it."""

    __slots__ = ("__weakref__", "device", "host", "index", "prefetched", "ready", "stand_in", "stored")

    def __init__(self, host: torch.Tensor, stored: Any, device: torch.device, index: int) -> None:
        self.host, self.device, self.index = host, device, index
        self.stored = stored  # CUDA event: the device→host copy has finished
        self.ready: Any = None  # CUDA event: the prefetched host→device copy has finished
        self.prefetched: torch.Tensor | None = None
        self.stand_in: torch.Tensor | None = None  # a trace for CUDA: the prefetch's bytes (unpack)


class ActivationOffloader:
    """Saved-tensor hooks that move large saved tensors to host memory and back.

    Args:
        min_tensor_bytes: smaller tensors stay where they are.
        ledger: where host bytes are counted.
        prefetch: how many tensors backward brings back ahead of need (CUDA only).
    """

    def __init__(self, min_tensor_bytes: int, ledger: HostLedger, prefetch: int = 2) -> None:
        self.min_tensor_bytes = min_tensor_bytes
        self.ledger = ledger
        self.prefetch = prefetch
        self.dry_run_bytes: int | None = None  # set: count what would move, move nothing
        self._counter = itertools.count()
        self._handles: weakref.WeakValueDictionary[int, _Handle] = weakref.WeakValueDictionary()
        self._seen: dict[tuple[Any, ...], tuple[weakref.ref[Any], int, Any]] = {}
        self._stream: Any = None
        self._stand_in_owner: weakref.ref[_Handle] | None = None

    # ------------------------------------------------------------------------------ packing

    def _worth_moving(self, t: torch.Tensor) -> bool:
        if t.numel() * t.element_size() < self.min_tensor_bytes or t.layout != torch.strided:
            return False
        base = tensor_base(t) if tensor_base(t) is not None else t
        if isinstance(base, nn.Parameter):
            return False  # weights stay on the device anyway: moving them frees nothing
        # Tensor subclasses (quantized weights, DTensor) may not survive a plain copy.
        return is_fake(t) or type(t) is torch.Tensor

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack hook: a handle for a moved tensor, else the tensor itself."""
        if not self._worth_moving(t):
            return t
        storage = t.untyped_storage()
        key = (id(storage), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is storage and seen[1] == tensor_version(t):
            # The same bytes were already moved (q, k and v projections share one input).
            earlier = seen[2]() if seen[2] is not None else t
            if earlier is not None:
                return earlier
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        if self.dry_run_bytes is not None:
            self.dry_run_bytes += t.numel() * t.element_size()
            self._seen[key] = (weakref.ref(storage), tensor_version(t), None)
            return t
        handle = _Handle(*self._copy_to_host(t), t.device, next(self._counter))
        ptr = id(handle.host.untyped_storage())
        # pinned on CUDA: in a trace for CUDA the CPU copy stands for a pinned one
        self.ledger.add(handle.host, pinned=t.device.type == "cuda" or traced_for_cuda())
        weakref.finalize(handle, self.ledger.remove, ptr)
        self._seen[key] = (weakref.ref(storage), tensor_version(t), weakref.ref(handle))
        self._handles[handle.index] = handle
        return handle

    def _copy_to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The host copy of ``t`` and, on CUDA, the event marking the copy's end."""
        if is_fake(t) or t.device.type != "cuda":
            # CPU (or a fake trace): a separate host tensor, counted apart from the device.
            return t.detach().to("cpu", copy=True), None
        stream = self._side_stream()
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        # The caching allocator must not reuse t's block before the side stream has read it.
        t.record_stream(stream)
        return host, stream.record_event()

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    # ---------------------------------------------------------------------------- unpacking

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor back on its device."""
        if not isinstance(packed, _Handle):
            return packed
        if packed.prefetched is not None:
            tensor, packed.prefetched = packed.prefetched, None
            torch.cuda.current_stream(tensor.device).wait_event(packed.ready)
            # Allocated on the side stream, used on this one: keep the block until use ends.
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        else:
            if packed.stored is not None:  # the device→host copy ran on the side stream
                torch.cuda.current_stream(packed.device).wait_event(packed.stored)
            tensor = packed.host.to(packed.device, copy=True, non_blocking=True)
        if packed.device.type == "cuda" and not is_fake(packed.host):
            self._prefetch_before(packed.index)
        elif is_fake(packed.host) and self.prefetch and traced_for_cuda():
            self._stand_in_for_prefetch(packed, tensor)
        return tensor

    def _stand_in_for_prefetch(self, packed: _Handle, tensor: torch.Tensor) -> None:
        """An estimate for CUDA traced on a CPU: what the GPU holds in flight while ``tensor`` is in
        use, ``prefetch`` tensors brought back ahead of need (the H200, 2026-12-04: two layer inputs,
        265 MB at 64,768 tokens of a 317M Llama, that a trace without them missed).

        One stand-in of ``prefetch`` times this tensor's bytes, kept with its handle (it goes when
        backward is done with the tensor) and replacing the one before: exact where consecutive
        packed tensors are alike (the layer inputs under full checkpointing), an upper bound at the
        bottom layers, where fewer are left to fetch. One allocation per unpack, wherever it is, so
        that every layer traces the same ops and the depth extrapolation still holds (the real
        prefetch starts at the top layer with two copies and fetches one per layer after).
        """
        earlier = self._stand_in_owner() if self._stand_in_owner is not None else None
        if earlier is not None:
            earlier.stand_in = None
        size = self.prefetch * tensor.numel() * tensor.element_size()
        packed.stand_in = torch.empty(size, dtype=torch.uint8, device=tensor.device)
        self._stand_in_owner = weakref.ref(packed)

    def _prefetch_before(self, index: int) -> None:
        """Start bringing back the tensors packed just before ``index`` (backward needs them next).

        The side stream orders these copies after the device→host copies it made in forward.
        """
        for earlier in range(index - 1, max(-1, index - 1 - self.prefetch), -1):
            handle = self._handles.get(earlier)
            if handle is None or handle.prefetched is not None:
                continue
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                handle.prefetched = handle.host.to(handle.device, non_blocking=True)
                handle.ready = stream.record_event()

    # ------------------------------------------------------------------------------ wrapping

    def wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` with these hooks active while it saves tensors for backward."""

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return forward(*args, **kwargs)

        return run


# ---------------------------------------------------------------------------------- applying


def host_ledger(model: nn.Module) -> HostLedger | None:
    """The ledger of host bytes that offload patches of ``model`` hold (None: no offload)."""
    return model.__dict__.get(_LEDGER_ATTR)


def offloader(model: nn.Module) -> ActivationOffloader | None:
    """The activation offloader applied to ``model``, if any."""
    return model.__dict__.get("_memtrain_offloader")


def apply(model: nn.Module, cfg: OffloadConfig) -> nn.Module:
    """Offload what the decoder layers save for backward (see the module docstring).

    Apply after checkpointing: a checkpointed layer then moves only its input.

    Args:
        model: a transformers model, possibly wrapped by peft and/or checkpointed.
        cfg: the ``memory.offload`` section; only ``activations`` and ``min_tensor_bytes`` matter.

    Returns:
        The same model, patched in place; :func:`undo` reverts it.
    """
    if cfg.activations is not True:
        return model
    if offloader(model) is not None:
        raise MemtrainError("`memory.offload.activations`: this model is already offloaded. "
                            "Fix: apply offload once (call `undo` first to change settings).")
    layers = find_layers(model)
    ledger = host_ledger(model) or HostLedger()
    hooks = ActivationOffloader(cfg.min_tensor_bytes, ledger)
    undos = [wrap_forward(layer, hooks.wrap) for _, layer in layers]
    undos.append(disable_kv_cache(model))
    model.__dict__[_LEDGER_ATTR] = ledger
    model.__dict__["_memtrain_offloader"] = hooks
    checkpointed = sum(is_checkpointed(layer) for _, layer in layers)

    def undo_all() -> None:
        for fn in reversed(undos):
            fn()
        model.__dict__.pop("_memtrain_offloader", None)

    what = (f"inputs of {checkpointed} checkpointed layers, all saved tensors of the other "
            f"{len(layers) - checkpointed}" if checkpointed
            else f"saved tensors of {len(layers)} layers")
    detail = f"activation offload to host: {what} (≥ {format_bytes(cfg.min_tensor_bytes)})"
    add_records(model, [PatchRecord("activation_offload", [n for n, _ in layers], detail, undo=undo_all)])
    return model


def undo(model: nn.Module) -> nn.Module:
    """Remove the activation offload this module applied to ``model``."""
    return undo_records(model, "activation_offload")


# ------------------------------------------------------------------------------- host RAM check


def estimate_offloaded_bytes(model: nn.Module, batch_size: int, seq_len: int) -> int:
    """Bytes one micro-batch would move to host, from a forward traced with fake inputs.

    Runs the model's forward in train mode under ``FakeTensorMode`` (the real weights are read,
    no compute happens) with the offload hooks counting instead of copying.
    """
    hooks = offloader(model)
    if hooks is None:
        return 0
    was_training = model.training
    hooks.dry_run_bytes = 0
    try:
        model.train()
        with FakeTensorMode(allow_non_fake_inputs=True):
            device = model_device(model)
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return hooks.dry_run_bytes
    except (TypeError, RuntimeError, NotImplementedError) as err:
        # torch 2.11's FakeTensorMode refuses bitsandbytes' Params4bit ("Multiple dispatch failed
        # for aten.view"), where torch 2.13 runs it: seen on an H100 building a QLoRA model
        why = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        return layer_input_bytes(model, batch_size, seq_len, why)
    finally:
        hooks.dry_run_bytes = None
        model.train(was_training)


def layer_input_bytes(model: nn.Module, batch_size: int, seq_len: int, why: str) -> int:
    """What the offload moves when the forward cannot be traced: each checkpointed layer's input
    hidden states (batch × length × hidden in the embeddings' dtype), with a warning that says so
    and what it leaves out (the saved tensors of layers that are not checkpointed)."""
    layers = find_layers(model)
    checkpointed = sum(is_checkpointed(layer) for _, layer in layers)
    embeddings = model.get_input_embeddings()
    hidden, dtype = embeddings.weight.shape[-1], embeddings.weight.dtype
    missing = (f"; the saved tensors of its {len(layers) - checkpointed} layers that are not checkpointed "
               "are not counted" if checkpointed < len(layers) else "")
    warnings.warn(f"`memory.offload.activations`: the host-RAM check could not trace the forward ({why}); "
                  f"it counts the inputs of the {checkpointed} checkpointed layers instead{missing}.",
                  stacklevel=2)
    return checkpointed * batch_size * seq_len * hidden * dtype.itemsize


def check_host_ram(model: nn.Module, batch_size: int, seq_len: int,
                   available: int | None = None, field: str = "host RAM") -> int:
    """Refuse to train when host RAM cannot hold one micro-batch of offloaded activations.

    Args:
        model: a model patched by :func:`apply`.
        batch_size, seq_len: the micro-batch shape (the longest sequences the data allows).
        available: host bytes the run may use (default: the free host RAM,
            :func:`memtrain.device.host_free_bytes`).
        field: what ``available`` is, named in the error (``memory.host_budget``).

    Returns:
        The estimated bytes moved to host per micro-batch.

    Raises:
        MemtrainError: the estimate exceeds 90% of the available host RAM.
    """
    needed = estimate_offloaded_bytes(model, batch_size, seq_len)
    available = host_free_bytes() if available is None else available
    if needed > HOST_RAM_MARGIN * available:
        raise MemtrainError(
            f"`memory.offload.activations`: one micro-batch ({batch_size} × {seq_len} tokens) "
            f"would move {format_bytes(needed)} of activations to host memory, but the {field} is "
            f"{format_bytes(available)} ({HOST_RAM_MARGIN:.0%} of it may be used). Fix: raise "
            "`memory.host_budget` if the machine has more, lower `training.micro_batch_size` (and raise "
            "`training.gradient_accumulation`), add `memory.checkpointing` (then only layer "
            "inputs move), or set `memory.offload.activations: false`."
        )
    return needed


# no cost hook: its transfers are the estimate's own host bytes (memtrain.plan.search.Search._cost)
KNOBS = (Knob("memory.offload.activations", fixed(False, True), False, order=50, plugin=True,
              patches_model=True, to_host=True, slower_when_leaner=True, holds_same=True),)
DOC = Doc("activation offload", "`memory.offload.activations: true`",
          "device memory for host memory and transfers; on a CPU-only machine both are the same RAM, "
          "so the bytes moved are measured, not a saving", "[memory_modes.md](docs/bench/memory_modes.md)")


@register("activation_offload", OFFLOAD, "memory.offload", config=Config, apply=apply, knobs=KNOBS, doc=DOC)
def _from_recipe(model: nn.Module, cfg: RunConfig) -> nn.Module | None:
    offload = cfg.memory.offload
    if decided(offload.activations, "memory.offload.activations", "true or false") is not True:
        return None
    model = apply(model, offload)
    first = next(model.parameters(), None)
    if first is not None and is_fake(first):
        return model  # an estimate: its host bytes are traced, and plans check them (HostBudget)
    batch = resolve_batch(cfg.training, cfg.distributed.processes)
    check_host_ram(model, batch.micro, cfg.data.max_length, host_budget_bytes(cfg.memory.host_budget),
                   f"`memory.host_budget` ({cfg.memory.host_budget})")
    return model
