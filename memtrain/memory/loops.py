"""Loop marks and elision: which iteration of a loop over token tiles or loss chunks is running.

The patches that loop over the tokens (the tiled MLP's tiles, the lean norm's tiles, LoRA's and
the few-bit layers' row chunks) iterate with :func:`chunks`; the chunked loss, whose chunks
autograd replays in backward, iterates over :func:`indices`, runs each chunk in :func:`step` and
calls :func:`done` after its loop. Outside an estimator's trace every iteration runs and a mark
costs a test or two.

While :func:`recording` is on (the estimator's trace), the estimator's meter files every op it
records under the current mark. With ``elide=True`` a long loop also runs only some of its
iterations: the first ``keep`` (:data:`KEEP`, or :data:`LEAN_KEEP` where the loop says so) and the
last. Its interior iterations are the same ops on tensors of the same shapes, and from the second
or third on each frees what it allocates or keeps the same bytes as the one before (a selective
checkpoint's saved matmul of each LoRA chunk), so the skipped ones would have recorded the rows of
a kept steady one, shifted by what they keep: the step's peak is unchanged, and the trace costs the
same at any length (a 900k-token loop of 256-token tiles runs 4 or 5 of its 3,516 tiles). The kept
iteration ``keep - 2`` stands for the skipped ones (:func:`weight`): in the step's work, and in
memory, where the estimator's meter counts what it keeps once per iteration it stands for
(:mod:`memtrain.estimator.trace_events`). The estimator checks in every trace that the loop was
steady (``Trace.steady``, with :func:`elided`); where not, it traces again without elision.
``tests/estimator/test_loop_elision.py`` checks elided == whole byte for byte on several
families with every long-context technique.

A loop that runs inside another loop's iteration (LoRA's row chunks inside a tiled MLP tile) is
*nested*: it has marks of its own (:func:`inner`), beside its outer iteration's (:func:`current`),
and with ``nested=True`` it is elided too; its stand-in then counts for the skipped iterations of
both loops (:func:`weight` is the product). A nested loop's stand-in keeps nothing that the meter
multiplies: it must record the same rows as the iteration after it (each iteration frees what it
allocates, as LoRA's chunks do, or replaces the last one's), which ``Trace.steady`` checks; where
not, the estimator traces again with only the outer loops elided. A loop inside a nested loop's
iteration runs whole and is part of that iteration.

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

KEEP = 4  # with elision: the iterations kept at the start of a loop (and the last), by default
# A loop that passes ``keep=LEAN_KEEP`` runs one fewer: it is steady from its second iteration (each
# frees what it allocates or keeps what the one before kept: LoRA's row chunks, the lean norm's
# tiles, the tiled MLP's forward). A loop that needs a third to settle keeps the default (the tiled
# MLP's backward, whose first tile allocates the weight gradients; the chunked loss, replayed by
# autograd); a trace checks every loop either way (``Trace.steady``).
LEAN_KEEP = 3


@dataclass(frozen=True)
class Loop:
    """One loop instance: its kind, the rows it covers and the rows per iteration (the last one
    may be shorter); ``nested``: it ran inside another loop's iteration."""

    kind: str
    rows: int
    size: int
    nested: bool = False
    keep: int = KEEP  # with elision: the iterations run at its start (and the last)

    @property
    def count(self) -> int:
        """Iterations of the whole loop."""
        return math.ceil(self.rows / self.size)


@dataclass
class _Level:
    """The running iteration of the loops at one level: top (0) or nested (1)."""

    serial: int = -1  # loop instance
    kind: str = ""
    position: int = -1  # among the iterations run
    index: int = -1
    weight: int = 1  # iterations it stands for

    def clear(self) -> None:
        self.serial, self.kind, self.position, self.index, self.weight = -1, "", -1, -1, 1


class _State:
    on = False
    inside = 0  # loop bodies (steps) running now
    elide = False
    nested = False  # elide nested loops too
    lean = False  # loops that ask for LEAN_KEEP get it
    levels = (_Level(), _Level())  # the running iteration at the top level and nested in it
    loops: dict[int, Loop] = {}  # noqa: RUF012 (replaced per recording)
    elided: set[int] = set()  # noqa: RUF012 (replaced per recording)


def _elides(count: int, keep: int = KEEP) -> bool:
    """Whether a loop of ``count`` iterations starting at the current depth runs only some."""
    return (_State.on and _State.elide and count > keep + 1
            and (_State.inside == 0 or (_State.inside == 1 and _State.nested)))


def indices(count: int, keep: int = KEEP) -> range | list[int]:
    """The iterations of a loop of ``count`` iterations to run: all of them, or with elision on
    and a long loop, the first ``keep`` and the last."""
    return [*range(keep), count - 1] if _elides(count, keep) else range(count)


def _position(index: int, count: int, keep: int) -> int:
    """The place of iteration ``index`` among those :func:`indices` runs."""
    return min(index, keep) if _elides(count, keep) else index


def iteration(kind: str, index: int, rows: int, size: int, keep: int = KEEP) -> None:
    """Iteration ``index`` of a loop of ``kind`` over ``rows`` rows, ``size`` rows at a time (at
    the top level, or nested inside the running iteration of a top-level loop)."""
    if not _State.on or _State.inside > 1:
        return
    depth = _State.inside
    level = _State.levels[depth]
    loop = Loop(kind, int(rows), int(size), nested=depth == 1, keep=keep)
    position = _position(index, loop.count, keep)
    if (level.serial < 0 or level.kind != kind or abs(level.position - position) != 1
            or _State.loops[level.serial] != loop):
        level.serial = len(_State.loops)
        _State.loops[level.serial] = loop
    if _elides(loop.count, keep):
        _State.elided.add(level.serial)
    level.kind, level.index, level.position = kind, index, position
    level.weight = loop.count - keep if _elides(loop.count, keep) and index == keep - 2 else 1
    if depth == 0:
        _State.levels[1].clear()  # a new top-level iteration: no nested loop runs yet


@contextlib.contextmanager
def step(kind: str, index: int, rows: int, size: int, keep: int = KEEP) -> Iterator[None]:
    """The body of iteration ``index`` of a loop of ``kind`` over ``rows`` rows, ``size`` at a time
    (marked, unless it runs inside a nested loop's body)."""
    iteration(kind, index, rows, size, keep)
    _State.inside += 1
    try:
        yield
    finally:
        _State.inside -= 1


def chunks(kind: str, rows: int, size: int, keep: int = KEEP) -> Iterator[tuple[int, int, int]]:
    """``(index, start, stop)`` of a loop over ``rows`` rows, ``size`` at a time, each yielded inside
    its :func:`step`: every chunk, or in an eliding trace the first ``keep`` and the last."""
    size = max(1, int(size))
    count = math.ceil(rows / size)
    depth = _State.inside
    keep = keep if _State.lean else KEEP
    for k in indices(count, keep):
        with step(kind, k, rows, size, keep):
            yield k, k * size, min(rows, (k + 1) * size)
    if depth == 0:
        done()
    elif depth == 1 and _State.on:
        _State.levels[1].clear()


def done() -> None:
    """The top-level loop that marked the last iteration has ended."""
    if _State.on:
        for level in _State.levels:
            level.clear()


def current() -> tuple[int, int]:
    """(loop instance, iteration index) of the running op at the top level; (-1, -1) outside
    every loop."""
    top = _State.levels[0]
    return (top.serial, top.index) if top.serial >= 0 else (-1, -1)


def inner() -> tuple[int, int]:
    """(loop instance, iteration index) of the running op's nested loop; (-1, -1) outside one."""
    nested = _State.levels[1]
    return (nested.serial, nested.index) if nested.serial >= 0 else (-1, -1)


def weight() -> int:
    """How many iterations the running op's iteration stands for: 1, or with elision, the kept
    iteration ``keep - 2`` and the skipped ones it stands for, of the top-level loop times those of
    the nested one (the step's work counts it so)."""
    return _State.levels[0].weight * _State.levels[1].weight


def top_weight() -> int:
    """:func:`weight` of the top-level loop alone: what the meter multiplies a stand-in's kept
    storages by (a nested loop's stand-in keeps none)."""
    return _State.levels[0].weight


def loops() -> dict[int, Loop]:
    """The loop instances marked since :func:`recording` began, by instance number."""
    return dict(_State.loops)


def elided() -> set[int]:
    """The loop instances that ran only some of their iterations."""
    return set(_State.elided)


@contextlib.contextmanager
def recording(elide: bool = False, nested: bool = True, lean: bool = True) -> Iterator[None]:
    """Turn marks on (from a clean slate) for the duration; ``elide``: long loops run only some of
    their iterations, ``nested``: loops nested in another loop's iteration too, ``lean``: a loop
    that asks for :data:`LEAN_KEEP` runs one fewer (see the module docstring)."""
    _State.on, _State.elide, _State.nested, _State.lean = True, elide, elide and nested, elide and lean
    _State.loops, _State.elided, _State.inside = {}, set(), 0
    done()
    try:
        yield
    finally:
        done()
        _State.on, _State.elide, _State.nested, _State.lean = False, False, False, False
