"""PyTorch's CUDA caching allocator under expandable segments, replayed over a traced step.

What a CUDA step reserves is more than the most it has allocated: a block freed in the middle of
the allocator's address range can only be reused by a request no larger than it, so a later, larger
request maps new memory at the end while the hole stays mapped. On an H200 (docs/bench/gpu_h200.md)
that gap was 7% to 40% of a step's transient bytes, about one bf16 logits tensor on every row with
8,192 tokens or more per micro-batch, where a fixed fraction said 3%. This module replays the
allocations and frees a trace recorded (:attr:`memtrain.estimator.trace.Trace.allocations`) through
the allocator's rules as PyTorch documents and implements them (``c10/cuda/CUDACachingAllocator.cpp``,
checked against torch 2.11 and 2.13), with ``expandable_segments:True`` (what memtrain sets):

- a request is rounded up to a multiple of 512 bytes (512 at least); requests up to 1 MiB come from
  the small pool, larger ones from the large pool;
- each pool (one stream) is one expandable segment: a virtual range whose end is mapped in pages
  of 2 MiB (small pool) or 20 MiB (large pool) as it grows, and never unmapped during training;
- a request takes the smallest free block that holds it (best fit, lowest address among equals),
  split when what is left is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  with no free block large enough, the segment's end is mapped further (joining a free block at
  the end, if any) by whole pages;
- a freed block merges with free neighbours.

The reserved bytes are the mapped pages of both pools. Not modelled: several streams, the default
(non-expandable) allocator's separate segments, ``max_split_size_mb``, ``garbage_collection_threshold``
and ``empty_cache`` calls.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every request rounds up to a multiple of it
SMALL_SIZE = 2**20  # kSmallSize: requests up to it come from the small pool
SMALL_PAGE = 2 * 2**20  # kSmallBuffer: the small pool's segment grows by it
LARGE_PAGE = 20 * 2**20  # kLargeBuffer: the large pool's segment grows by it


def round_size(size: int) -> int:
    """The block size a request of ``size`` bytes asks for (``round_size``): a multiple of 512, at
    least 512; an empty tensor asks for nothing (0). The tracer's rounding line uses it too."""
    return -(-size // MIN_BLOCK) * MIN_BLOCK


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class Pool:
    """One expandable segment: blocks in address order, the free ones indexed by (size, address)."""

    page: int
    small: bool
    mapped: int = 0
    tail: _Block | None = None  # the block at the mapped end
    _free: list[tuple[int, int]] = field(default_factory=list)
    _by_addr: dict[int, _Block] = field(default_factory=dict)

    def malloc(self, size: int) -> _Block:
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):
            _, addr = self._free.pop(i)
            block = self._by_addr[addr]
        else:
            block = self._grow(size)
        block.free = False
        rest = block.size - size
        if rest >= MIN_BLOCK if self.small else rest > SMALL_SIZE:
            after = _Block(block.addr + size, rest, True, block, block.next)
            if block.next is not None:
                block.next.prev = after
            block.next, block.size = after, size
            if self.tail is block:
                self.tail = after
            self._index(after)
        return block

    def release(self, block: _Block) -> None:
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unindex(neighbour)
        if block.next is not None and block.next.free:
            block = self._join(block, block.next)
        if block.prev is not None and block.prev.free:
            block = self._join(block.prev, block)
        self._index(block)

    def _grow(self, size: int) -> _Block:
        """Map pages at the end until a free block there holds ``size`` bytes."""
        end = self.tail if self.tail is not None and self.tail.free else None
        have = end.size if end is not None else 0
        grow = -(-(size - have) // self.page) * self.page
        self.mapped += grow
        if end is not None:
            self._unindex(end)
            end.size += grow
            return end
        block = _Block(self.mapped - grow, grow, True, self.tail, None)
        if self.tail is not None:
            self.tail.next = block
        self.tail = block
        self._by_addr[block.addr] = block
        return block

    def _join(self, first: _Block, second: _Block) -> _Block:
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if self.tail is second:
            self.tail = first
        del self._by_addr[second.addr]
        return first

    def _index(self, block: _Block) -> None:
        self._by_addr[block.addr] = block
        bisect.insort(self._free, (block.size, block.addr))

    def _unindex(self, block: _Block) -> None:
        i = bisect.bisect_left(self._free, (block.size, block.addr))
        if i < len(self._free) and self._free[i] == (block.size, block.addr):
            self._free.pop(i)


@dataclass
class Replay:
    """The allocator's state over a replayed sequence: allocated and reserved now and at their peaks."""

    small: Pool = field(default_factory=lambda: Pool(SMALL_PAGE, True))
    large: Pool = field(default_factory=lambda: Pool(LARGE_PAGE, False))
    allocated: int = 0
    peak_allocated: int = 0
    _live: dict[object, tuple[Pool, _Block]] = field(default_factory=dict)

    @property
    def reserved(self) -> int:
        return self.small.mapped + self.large.mapped

    def malloc(self, key: object, size: int) -> None:
        rounded = round_size(size)
        if not rounded:  # an empty tensor: CUDA hands out no block
            return
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = pool.malloc(rounded)
        self._live[key] = (pool, block)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        found = self._live.pop(key, None)
        if found is None:  # allocated before the replay began
            return
        pool, block = found
        self.allocated -= block.size
        pool.release(block)

    def run(self, events: list[tuple[int, object, int]]) -> Replay:
        """Apply ``events``: ``(1, key, bytes)`` allocates, ``(0, key, _)`` frees."""
        for alloc, key, size in events:
            if alloc:
                self.malloc(key, size)
            else:
                self.free(key)
        return self


def steps(events: list[tuple[int, object, int]], count: int = 2) -> Replay:
    """``count`` training steps replayed from one traced step's ``events``: what the trace began
    with (weights, optimizer state: allocated first, never freed) once, the rest of the step each
    time, as in a run's steps after the first."""
    freed = {key for alloc, key, _ in events if not alloc}
    kept = {key for alloc, key, _ in events if alloc and key not in freed}
    replay = Replay().run(events)
    step = [(alloc, key, size) for alloc, key, size in events if key not in kept]
    for n in range(1, count):
        replay.run([(alloc, (n, key), size) for alloc, key, size in step])
    return replay


def reserved_gap(events: list[tuple[int, object, int]], count: int = 2) -> int:
    """What the allocator reserves beyond the most it allocates over ``count`` steps replayed from
    one traced step's ``events`` (:func:`steps`): the fragmentation it adds to the step's peak."""
    replay = steps(events, count)
    return max(0, replay.reserved - replay.peak_allocated)
