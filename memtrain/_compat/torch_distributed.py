"""torch.distributed internals: FSDP2's private state, the fake process group's store, DTensor's
sharding propagation.

Checked on torch 2.13.0 (this CPU) and 2.11 (the GPU image, docs/devices.md; its 2-process FSDP2
runs); the tested range is :data:`memtrain._compat.versions.TESTED` (2.10–2.15).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memtrain._compat.versions import private

_SHIM = "torch_distributed"


def _fsdp_state(module: nn.Module) -> Any:
    return private(module, "_get_fsdp_state", f"{_SHIM}.fsdp_state", "torch")()


def fsdp_device(model: nn.Module) -> torch.device:
    """The device an FSDP2 module computes on (its shards may be offloaded to the CPU). Touches
    ``FSDPModule._get_fsdp_state()._device``: FSDP2 has no public accessor."""
    return private(_fsdp_state(model), "_device", f"{_SHIM}.fsdp_device", "torch")


def fsdp_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of an FSDP2 module's parameter group (empty when it has none).
    Touches ``_get_fsdp_state()._fsdp_param_group.fsdp_params``: no public accessor."""
    group = private(_fsdp_state(module), "_fsdp_param_group", f"{_SHIM}.fsdp_params", "torch")
    return list(group.fsdp_params) if group is not None else []


def drop_unsharded_gradient(param: Any) -> None:
    """Forget the full gradient FSDP2 accumulates on an ``FSDPParam``'s unsharded parameter between
    micro-batches without gradient sync. Touches ``FSDPParam._unsharded_param`` (and the public-named
    ``unsharded_accumulated_grad``): nothing public clears them."""
    unsharded = getattr(param, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None
    param.unsharded_accumulated_grad = None


def fake_store() -> Any:
    """A ``FakeStore`` for ``init_process_group("fake", ...)``: a process group whose collectives do
    nothing. Lives in ``torch.testing._internal`` (torch ships it in the wheel; there is no public
    fake store)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextlib.contextmanager
def dtensor_propagation_without_fake_mode() -> Iterator[None]:
    """Inside: DTensor's sharding propagation does not see the active fake mode (its layout
    propagation creates tensors under a nested mode of its own). Patches
    ``torch.distributed.tensor._sharding_prop.detect_fake_mode``: no public switch."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original
