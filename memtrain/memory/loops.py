"""Loop marks: which iteration of a loop over token tiles or loss chunks is running now.

The patches that loop over the tokens (the tiled MLP's tiles, the lean norm's tiles, the chunked
loss's chunks) call :func:`iteration` at the start of every iteration, and :func:`done` after a
loop they run themselves. While :func:`recording` is on (the estimator's trace), the estimator's
meter files every op it records under the current mark, so that a trace can fold a loop's repeated
iterations and be extrapolated along the sequence (:mod:`memtrain.estimator.seqlen`). Outside a
recording a mark costs one test and does nothing.

A mark is sticky: the ops after an iteration's own code (autograd's backward of a checkpointed
loss chunk runs between two recomputes) belong to it until the next mark or :func:`done`. A new
loop *instance* starts when the kind changes or the index does not follow the last one by one (a
loop runs forward 0, 1, ... and autograd replays checkpointed chunks backward ..., 1, 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Loop:
    """One loop instance: its kind, the rows it covers and the rows per iteration (the last one
    may be shorter)."""

    kind: str
    rows: int
    size: int


class _State:
    on = False
    serial = -1
    kind = ""
    index = -1
    loops: dict[int, Loop] = {}  # noqa: RUF012 (replaced per recording)


def iteration(kind: str, index: int, rows: int, size: int) -> None:
    """Iteration ``index`` of a loop of ``kind`` over ``rows`` rows, ``size`` rows at a time."""
    if not _State.on:
        return
    loop = Loop(kind, int(rows), int(size))
    if (_State.serial < 0 or _State.kind != kind or abs(_State.index - index) != 1
            or _State.loops[_State.serial] != loop):
        _State.serial = len(_State.loops)
        _State.loops[_State.serial] = loop
    _State.kind, _State.index = kind, index


def done() -> None:
    """The loop that marked the last iteration has ended."""
    if _State.on:
        _State.serial, _State.kind, _State.index = -1, "", -1


def current() -> tuple[int, int]:
    """(loop instance, iteration index) of the running op; (-1, -1) outside every loop."""
    return (_State.serial, _State.index) if _State.serial >= 0 else (-1, -1)


def loops() -> dict[int, Loop]:
    """The loop instances marked since :func:`recording` began, by instance number."""
    return dict(_State.loops)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Turn marks on (from a clean slate) for the duration."""
    _State.on, _State.serial, _State.kind, _State.index, _State.loops = True, -1, "", -1, {}
    try:
        yield
    finally:
        _State.on, _State.serial, _State.kind, _State.index = False, -1, "", -1
