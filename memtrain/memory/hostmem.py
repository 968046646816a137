"""Keep freed CPU memory in the process, so that large tensors stop page-faulting on every step.

PyTorch's CPU allocator asks the C library for every tensor. glibc serves blocks above its mmap
threshold (adaptive, at most 32 MiB on 64-bit systems: mallopt(3)) from fresh ``mmap`` pages and
unmaps them on free, and it trims the top of its heap back to the OS once more than twice that is
free. So a causal LM's logit-sized tensors (micro-batch × sequence × vocabulary × 4 bytes) are
mapped, faulted in one 4 KiB page at a time, zeroed by the kernel and unmapped again on every step.
Measured here (``scripts/bench/techniques/hostmem.py``, docs/bench/hostmem.md): 1.5 µs per page, four times
the cost of writing the page; up to 723 MiB faulted per step, and steps 1.00-1.54x slower than with
the pages kept. A Llama-shaped model at micro-batch 16 (four 62.5 MiB blocks per step) was slower
than at micro-batch 8 or 4, which a cost model that ranks micro-batches by their work cannot see.

PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu``) preloads tcmalloc or
jemalloc for speed, allocators that cache freed memory. memtrain gets the same effect from glibc in
process, without a new dependency or a relaunch: two ``mallopt`` calls, ``M_MMAP_MAX = 0`` (large
blocks come from the heap and are reused) and ``M_TRIM_THRESHOLD`` = 2 GiB (freed memory stays in
the heap). The price: the process keeps its peak memory until it exits, which a training process
reaches on its first step anyway. No library exposes ``mallopt``, hence this module.

``memtrain train`` applies it when it trains on the CPU; a plain Trainer script can call
:func:`keep_freed_pages` itself. Other C libraries (macOS, Windows, musl) are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
KEEP_BYTES = 2**31 - 1  # mallopt takes an int: trim only when 2 GiB of the heap top is free


@functools.cache
def keep_freed_pages() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS (once per process).

    Returns:
        True when the setting is in force; False on a C library other than glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols: glibc is loaded already
    # mallopt returns 1 on success
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
