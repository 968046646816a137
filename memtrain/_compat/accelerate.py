"""accelerate: its process-wide state, and the attribute its mixed-precision wrapper leaves on a model.

Checked on accelerate 1.15.0 and 1.16.0 (the whole suite, 2026-12-02); the tested range is
:data:`memtrain._compat.versions.TESTED` (1.10.1–1.16.0; issue 35's runs, then 1.16.0).
"""

from __future__ import annotations

from typing import Any

from memtrain._compat.versions import compat_error

_SHIM = "accelerate"


def set_shared_distributed_type(distributed_type: Any) -> None:
    """Set ``PartialState().distributed_type``, the process-wide state every later
    ``AcceleratorState()`` copies its ``distributed_type`` from. accelerate decides it once (on a
    CPU, DDP for several processes) and has no public way to change it afterwards; memtrain's
    FSDP2 runs on a CPU need FSDP there (:func:`memtrain.trainer.trainer.adopt_fsdp`)."""
    from accelerate import PartialState

    state = PartialState()
    if not hasattr(state, "distributed_type"):
        raise compat_error(f"{_SHIM}.set_shared_distributed_type", "accelerate",
                           "PartialState.distributed_type")
    state.distributed_type = distributed_type


def original_forward(model: Any) -> Any:
    """The model's forward before accelerate's mixed-precision wrapper (``model._original_forward``,
    which ``Accelerator.prepare`` sets when it wraps ``forward`` in autocast; None when it did not).
    accelerate keeps no public handle to it."""
    return getattr(model, "_original_forward", None)
