"""The CUDA caching allocator's settings for memtrain's processes (a leaf: no torch import, so the
command line sets them before anything starts CUDA, at no start-up cost).

memtrain runs the allocator with expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` says
otherwise. On the first GPU session (H100, docs/bench/gpu.md) the default allocator reserved 8% to
59% (median 24%) of a step's transient bytes beyond what it allocated, row by row, against the 12%
calibration measured, so no single fraction predicted it. Expandable segments grow one mapped
segment instead of caching blocks of fixed sizes, so memory a step frees serves any later request
(PyTorch's "CUDA memory management" notes; torchtitan and Axolotl recommend it for the same
reason).
:func:`memtrain.device.configure_allocator` also applies it to a process already using CUDA.
"""

from __future__ import annotations

import os

ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def settings() -> str:
    """The settings memtrain's runs use: ``PYTORCH_CUDA_ALLOC_CONF`` when set, else :data:`DEFAULT`.
    Estimates use the overheads calibrated under these settings."""
    return os.environ.get(ENV) or DEFAULT


def expandable_segments(value: str | None = None) -> bool:
    """Whether ``value`` (default: :func:`settings`) turns expandable segments on."""
    parts = (value or settings()).replace(" ", "").split(",")
    options = dict(part.split(":", 1) for part in parts if ":" in part)
    return options.get("expandable_segments", "False").lower() == "true"


def set_default() -> str:
    """Give this process, and the processes it starts, :data:`DEFAULT` unless the user set the
    variable; returns the settings in effect. CUDA reads the variable when its allocator starts."""
    if not os.environ.get(ENV):
        os.environ[ENV] = DEFAULT
    return os.environ[ENV]
