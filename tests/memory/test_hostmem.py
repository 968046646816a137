"""``memtrain.memory.hostmem``: large CPU tensors stop page-faulting once freed memory is kept."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# A fresh process (the setting is process-wide and one-way): minor page faults per allocation of
# a 64 MiB tensor, written once, before and after keep_freed_pages().
CHILD = """
import json, resource, torch
from memtrain.memory import hostmem

def pages_faulted_per_tensor():
    for _ in range(10):  # warm-up: glibc settles (thresholds adapt, the heap grows) within 6 here
        torch.empty(2**24).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        torch.empty(2**24).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

default = pages_faulted_per_tensor()
kept = hostmem.keep_freed_pages()
print(json.dumps({"default": default, "kept": kept, "after": pages_faulted_per_tensor()}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="the setting is glibc's (other C libraries are left alone)")
def test_kept_pages_stop_large_tensors_from_faulting_on_every_allocation() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 2**26 // 4096  # a 64 MiB tensor spans 16,384 pages
    assert result["default"] >= 0.9 * pages  # glibc maps fresh pages for it every time
    assert result["kept"] is True
    assert result["after"] < 0.01 * pages  # the same memory is reused: no faults


def test_other_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.memory import hostmem

    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    hostmem.keep_freed_pages.cache_clear()
    try:
        assert hostmem.keep_freed_pages() is False
    finally:
        hostmem.keep_freed_pages.cache_clear()
