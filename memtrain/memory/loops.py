"""Loop marks and elision: which iteration of a loop over token tiles or loss chunks is running.

The patches that loop over the tokens (the tiled MLP's tiles, the lean norm's tiles, LoRA's and
the few-bit layers' row chunks) iterate with :func:`chunks`; the chunked loss, whose chunks
autograd replays in backward, iterates over :func:`indices`, runs each chunk in :func:`step` and
calls :func:`done` after its loop. Outside an estimator's trace every iteration runs and a mark
costs a test or two. A loop that runs inside another loop's iteration (LoRA's chunks inside a
tiled MLP tile) is part of that iteration: it runs whole and marks nothing.

While :func:`recording` is on (the estimator's trace), the estimator's meter files every op it
records under the current mark. With ``elide=True`` a long loop also runs only some of its
iterations: the first ``KEEP`` and the last. Its interior iterations are the same ops on tensors of
the same shapes, and from the second or third on each frees what it allocates or keeps the same
bytes as the one before (a selective checkpoint's saved matmul of each LoRA chunk), so the
skipped ones would have recorded the rows of a kept steady one, shifted by what they keep: the
step's peak is unchanged, and the trace costs the same at any length (a 900k-token loop of
256-token tiles runs 5 of its 3,516 tiles). The kept iteration ``KEEP - 2`` stands for the
skipped ones (:func:`weight`): in the step's work, and in memory, where the estimator's meter
counts what it keeps once per iteration it stands for
(:mod:`memtrain.estimator.trace_events`). The estimator checks in every trace that the loop was
steady (``Trace.steady``, with :func:`elided`); where not, it traces again without elision.
``tests/estimator/test_loop_elision.py`` checks elided == whole byte for byte on several
families with every long-context technique.

A mark is sticky: the ops after an iteration's own code (autograd's backward of a checkpointed
loss chunk runs between two recomputes) belong to it until the next mark or :func:`done`. A new
loop *instance* starts when the kind changes or the index does not follow the last one by one
among the iterations run (a loop runs forward 0, 1, ... and autograd replays checkpointed chunks
backward ..., 1, 0).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

KEEP = 4  # with elision: the iterations kept at the start of a loop (and the last)


@dataclass(frozen=True)
class Loop:
    """One loop instance: its kind, the rows it covers and the rows per iteration (the last one
    may be shorter)."""

    kind: str
    rows: int
    size: int

    @property
    def count(self) -> int:
        """Iterations of the whole loop."""
        return math.ceil(self.rows / self.size)


class _State:
    on = False
    inside = 0  # loop bodies (steps) running now
    elide = False
    serial = -1
    kind = ""
    position = -1
    index = -1
    weight = 1
    loops: dict[int, Loop] = {}  # noqa: RUF012 (replaced per recording)
    elided: set[int] = set()  # noqa: RUF012 (replaced per recording)


def _elides(count: int) -> bool:
    return _State.on and _State.elide and _State.inside == 0 and count > KEEP + 1


def indices(count: int) -> range | list[int]:
    """The iterations of a loop of ``count`` iterations to run: all of them, or with elision on
    and a long loop, the first ``KEEP`` and the last."""
    return [*range(KEEP), count - 1] if _elides(count) else range(count)


def _position(index: int, count: int) -> int:
    """The place of iteration ``index`` among those :func:`indices` runs."""
    return min(index, KEEP) if _elides(count) else index


def iteration(kind: str, index: int, rows: int, size: int) -> None:
    """Iteration ``index`` of a loop of ``kind`` over ``rows`` rows, ``size`` rows at a time."""
    if not _State.on:
        return
    loop = Loop(kind, int(rows), int(size))
    position = _position(index, loop.count)
    if (_State.serial < 0 or _State.kind != kind or abs(_State.position - position) != 1
            or _State.loops[_State.serial] != loop):
        _State.serial = len(_State.loops)
        _State.loops[_State.serial] = loop
    if _elides(loop.count):
        _State.elided.add(_State.serial)
    _State.kind, _State.index, _State.position = kind, index, position
    _State.weight = loop.count - KEEP if _elides(loop.count) and index == KEEP - 2 else 1


@contextlib.contextmanager
def step(kind: str, index: int, rows: int, size: int) -> Iterator[None]:
    """The body of iteration ``index`` of a loop of ``kind`` over ``rows`` rows, ``size`` at a time
    (marked, unless it runs inside another loop's body)."""
    if _State.inside == 0:
        iteration(kind, index, rows, size)
    _State.inside += 1
    try:
        yield
    finally:
        _State.inside -= 1


def chunks(kind: str, rows: int, size: int) -> Iterator[tuple[int, int, int]]:
    """``(index, start, stop)`` of a loop over ``rows`` rows, ``size`` at a time, each yielded inside
    its :func:`step`: every chunk, or in an eliding trace the first ``KEEP`` and the last."""
    size = max(1, int(size))
    count = math.ceil(rows / size)
    nested = _State.inside > 0
    for k in range(count) if nested else indices(count):
        with step(kind, k, rows, size):
            yield k, k * size, min(rows, (k + 1) * size)
    if not nested:
        done()


def done() -> None:
    """The loop that marked the last iteration has ended."""
    if _State.on:
        _State.serial, _State.kind, _State.index, _State.position, _State.weight = -1, "", -1, -1, 1


def current() -> tuple[int, int]:
    """(loop instance, iteration index) of the running op; (-1, -1) outside every loop."""
    return (_State.serial, _State.index) if _State.serial >= 0 else (-1, -1)


def weight() -> int:
    """How many iterations the running op's iteration stands for: 1, or with elision, the kept
    iteration ``KEEP - 2`` and the skipped ones it stands for (the step's work counts it so)."""
    return _State.weight


def loops() -> dict[int, Loop]:
    """The loop instances marked since :func:`recording` began, by instance number."""
    return dict(_State.loops)


def elided() -> set[int]:
    """The loop instances that ran only some of their iterations."""
    return set(_State.elided)


@contextlib.contextmanager
def recording(elide: bool = False) -> Iterator[None]:
    """Turn marks on (from a clean slate) for the duration; ``elide``: long loops run only some of
    their iterations (see the module docstring)."""
    _State.on, _State.elide, _State.loops, _State.elided, _State.inside = True, elide, {}, set(), 0
    done()
    try:
        yield
    finally:
        done()
        _State.on, _State.elide = False, False
