"""Extrapolate a traced step along the sequence: a long context from a few short traces.

Why it is exact. For a fixed kernel choice and fixed loop sizes, every op of a step allocates and
frees tensors whose sizes are affine in the number of tokens ``L``: activations and their
gradients (``L x hidden``), the attention's output and log-sum-exp (flash kernels, no ``L x L``
matrix), offloaded copies, the batch. The ops that are not affine in ``L`` come from loops over
the tokens, each marked by its patch (:mod:`memtrain.memory.loops`):

- the tiled MLP's tiles, the lean norm's tiles (a fixed number of rows per iteration), the
  chunked loss's chunks (``memory.loss_chunk_tokens``, or the rule's size at the target length,
  :func:`memtrain.patches.chunked_loss.chunk_tokens`, which the traces are given as a fixed size).
  The number of iterations grows with ``L``; every iteration but the first and the last is the same
  op sequence with the same bytes (what it allocates is freed, or was allocated before the loop),
  so a loop *folds* to its first, second and last iterations (:func:`fold`), checked in every trace:
  interior iterations that differ make the trace not foldable. The last iteration may be short: its
  size is the loop's rows modulo its size. The traces are taken at lengths congruent to the target
  modulo every tile size, so the tiles' last iteration is the target's; the loss chunk's is not (its
  period, a chunk of a 128k vocabulary, is a prime number of tokens such as 523), so the last
  chunk's size ``s`` is a second variable: each folded op's bytes are ``a + b·L + c·s``.
- anything else (an eager ``L x L`` attention matrix, a padded batch's 4D mask, a kernel chosen by
  length) is caught: with ``k`` unknowns per op the estimator traces ``k + 1`` lengths, solves
  from ``k`` and requires the last to agree byte for byte, in every column of every op. Where it does
  not (or a loop does not fold, or the folded traces do not align op by op), the caller traces the
  target length itself.

Layers are extrapolated in depth afterwards (:mod:`memtrain.estimator.trace`), from the depth-2
and depth-3 steps this module builds at the target length. ``tests/estimator/test_seq_extrapolation.py``
checks extrapolated == traced at the target, byte for byte, on several families with every
long-context technique on and off.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from memtrain.config import RunConfig
from memtrain.estimator.trace import Trace, Work
from memtrain.memory.loops import Loop
from memtrain.patches.chunked_loss import chunk_tokens

LOSS = "chunked_loss"
# Extrapolate only when the longest traced length is at most this fraction of the target.
MAX_FRACTION = 0.5
ROUNDING = 512
SHORTEST = 256  # traced lengths are at least this many tokens (below ~200, tiny models take other paths)


@dataclass(frozen=True)
class SeqPlan:
    """The lengths to trace for a target length, and the loss chunk they are traced with."""

    target: int
    lengths: tuple[int, ...]
    chunk: int | None  # tokens per loss chunk given to the traces (None: no chunked loss)
    forced: bool  # the recipe leaves the chunk to the rule: the traces get the target's size
    rows: int  # batch rows per token position (micro-batch, doubled for DPO)
    offload_min: int | None = None  # memory.offload.min_tensor_bytes, with activation offload

    def settings(self, length: int) -> dict[str, int]:
        """The memory settings a trace at ``length`` tokens runs with: the target's loss chunk, and
        activation offload's size threshold scaled by ``length / target``, so that every tensor
        whose bytes are proportional to the length moves to the host at the trace's length exactly
        when it moves at the target's (``b·L >= ceil(m·L/T)`` iff ``b·T >= m``)."""
        out = {} if self.chunk is None else {"loss_chunk_tokens": self.chunk}
        if self.offload_min is not None:
            out["offload.min_tensor_bytes"] = -(-self.offload_min * length // self.target)
        return out


def _text(config: object) -> object:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def plan(cfg: RunConfig, config: object, micro_batch: int, target: int) -> SeqPlan | None:
    """Lengths whose traces determine the step at ``target`` tokens, or None when the target is too
    short for that to save time, or the recipe sizes a loop by the length (``memory.tiled_mlp_tiles``:
    equal tiles, whose size grows with the length)."""
    mem, text = cfg.memory, _text(config)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    if hidden <= 0 or target < 4 * SHORTEST:
        return None
    rows = micro_batch * (2 if cfg.training.objective == "dpo" else 1)
    sizes: list[int] = []
    if mem.tiled_mlp is True:
        if mem.tiled_mlp_tiles is not None or not isinstance(mem.tiled_mlp_tile_tokens, (int, type(None))):
            return None
        sizes.append(mem.tiled_mlp_tile_tokens or hidden)
    if mem.lean_norm is True:
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else hidden)
        sizes += [hidden, int(head_dim)]
    # tokens congruent modulo 512 also keep the CUDA allocator's rounding (each allocation up to a
    # multiple of 512 bytes) affine in the length
    period = math.lcm(ROUNDING, *sizes)
    chunk, forced = None, False
    if mem.loss == "chunked":
        if mem.loss_chunk_tokens is None:
            vocab = int(getattr(text, "vocab_size", 0) or 0)
            if vocab <= 0:
                return None
            chunk, forced = chunk_tokens(rows * target, hidden, vocab), True
        elif isinstance(mem.loss_chunk_tokens, int):
            chunk = mem.loss_chunk_tokens
        else:
            return None
    # every loop runs at least 3 iterations (first, interior, last) in every trace; the tiled MLP
    # and the loss at least 5: their backward settles after two iterations (see fold)
    settles = [sizes[0] if mem.tiled_mlp is True else 0, chunk or 0]
    shortest = max(SHORTEST, 2 * max(sizes, default=0) + 1, 4 * max(settles) + 1)
    step = period * math.ceil(SHORTEST / period)
    first = shortest + (target - shortest) % period  # congruent to the target modulo every tile
    if chunk is None:
        lengths = [first + k * step for k in range(3)]
    else:
        lengths = _with_chunks(first, step, chunk, rows)
        if lengths is None:
            return None
    if max(lengths) > MAX_FRACTION * target:
        return None
    offload_min = mem.offload.min_tensor_bytes if mem.offload.activations is True else None
    return SeqPlan(target, tuple(lengths), chunk, forced, rows, offload_min)


def _last(rows: int, size: int) -> int:
    """Rows in a loop's last iteration."""
    return rows - (math.ceil(rows / size) - 1) * size


def _with_chunks(first: int, step: int, chunk: int, rows: int) -> list[int] | None:
    """The four shortest lengths from ``first`` by ``step`` of which three (put first) determine
    (1, L, last chunk); the fourth checks them. (Lengths a step apart shift the last chunk by the
    same amount until it wraps: three of them are collinear, so one length past a wrap is needed.)"""
    candidates = [first + k * step for k in range(64)]
    for top in range(3, len(candidates)):
        for rest in itertools.combinations(candidates[:top], 3):
            four = [*rest, candidates[top]]
            for check in range(4):
                solve = [n for k, n in enumerate(four) if k != check]
                if abs(np.linalg.det(_design(solve, chunk, rows))) >= 0.5:
                    return [*solve, four[check]]
    return None


def _design(lengths: list[int], chunk: int | None, rows: int) -> np.ndarray:
    cols = [[1.0, float(n)] + ([] if chunk is None else [float(_last(rows * n, chunk))]) for n in lengths]
    return np.array(cols, dtype=np.float64)


# ------------------------------------------------------------------------------------ folding


@dataclass
class Folded:
    """A trace with every loop's interior iterations but one removed."""

    keep: np.ndarray  # indices of the trace's rows kept
    roles: np.ndarray  # (kept, 2): loop kind code (-1: none) and iteration kept (-2: the last)


def fold(trace: Trace) -> Folded | None:
    """Keep each loop instance's iterations up to the first of its steady interior, and its last.

    A loop settles after an iteration or two (the tiled MLP's backward allocates its parameter
    gradients' sums in its first iterations, then adds in place): from then on, every iteration but
    the last repeats the same ops with the same bytes. Those repeats are dropped but one. (Never
    None today; the caller's alignment check rejects traces whose loops settle differently.)"""
    marks, info = trace.marks, trace.loop_info or {}
    n = len(trace.values)
    if marks is None or len(marks) != n:
        return None
    kinds = sorted({loop.kind for loop in info.values()})
    keep = np.ones(n, dtype=bool)
    roles = np.full((n, 2), -1, dtype=np.int64)
    serial = marks[:, 0]
    i = 0
    while i < n:
        if serial[i] < 0:
            i += 1
            continue
        j = i
        while j < n and serial[j] == serial[i]:
            j += 1
        index = marks[i:j, 1]
        cuts = [i, *(i + 1 + np.flatnonzero(np.diff(index))), j]
        groups = list(itertools.pairwise(cuts))
        roles[i:j, 0] = kinds.index(info[int(serial[i])].kind)
        for g, (a, b) in enumerate(groups):
            roles[a:b, 1] = -2 if g == len(groups) - 1 else g
        steady = len(groups) - 2  # the first of the identical interior iterations
        while steady > 1 and _same(trace.values, groups[steady - 1], groups[steady]):
            steady -= 1
        for a, b in groups[steady + 1:-1]:
            keep[a:b] = False
        i = j
    return Folded(np.flatnonzero(keep), roles[keep])


def _same(values: np.ndarray, one: tuple[int, int], other: tuple[int, int]) -> bool:
    return one[1] - one[0] == other[1] - other[0] and np.array_equal(values[one[0]:one[1]],
                                                                     values[other[0]:other[1]])


# ------------------------------------------------------------------------------ extrapolation


def along(traces: list[Trace], seq: SeqPlan) -> Trace | None:
    """The step at ``seq.target`` tokens from traces at ``seq.lengths`` (one depth), or None when
    they do not determine it exactly (see the module docstring)."""
    folded = [fold(t) for t in traces]
    if any(f is None for f in folded):
        return None
    first, base = traces[0], folded[0]
    assert base is not None
    for t, f in zip(traces[1:], folded[1:], strict=True):
        assert f is not None
        if (t.phases != first.phases or len(f.keep) != len(base.keep)
                or not np.array_equal(f.roles, base.roles)
                or not np.array_equal(t.occurrence[f.keep], first.occurrence[base.keep])
                or not np.array_equal(t.layer[f.keep], first.layer[base.keep])
                or (t.parameters, t.trainable) != (first.parameters, first.trainable)):
            return None
    if not all(_loops_follow(t, n, seq) for t, n in zip(traces, seq.lengths, strict=True)):
        return None
    design = _design(list(seq.lengths), seq.chunk, seq.rows)
    unknowns = design.shape[1]
    values = np.stack([t.values[f.keep] for t, f in zip(traces, folded, strict=True)]).astype(np.float64)
    flat = values.reshape(len(traces), -1)
    coef = np.linalg.solve(design[:unknowns], flat[:unknowns])
    if not np.array_equal(np.rint(design @ coef), flat):  # the extra length checks the model
        return None
    at = _design([seq.target], seq.chunk, seq.rows)
    out = np.rint(at @ coef).reshape(values.shape[1:]).astype(np.int64)
    patches = list(first.patches)
    if seq.forced:
        patches = [p.replace(f"({seq.chunk} tokens per chunk)", "(auto tokens per chunk)") for p in patches]
    return Trace(first.phases, first.occurrence[base.keep], first.layer[base.keep], out,
                 first.parameters, first.trainable, patches, _work(traces, seq))


def _loops_follow(trace: Trace, length: int, seq: SeqPlan) -> bool:
    """Every loop's rows are proportional to the length, its size the expected one, and every loop
    but the loss's ends on an iteration as long as the target's (the lengths were chosen so)."""
    for loop in (trace.loop_info or {}).values():
        if loop.rows % length:
            return False
        at_target = loop.rows // length * seq.target
        if loop.kind == LOSS:
            if loop.size != seq.chunk:
                return False
        elif _last(loop.rows, loop.size) != _last(at_target, loop.size):
            return False
        if math.ceil(at_target / loop.size) < 3:
            return False
    return True


def _work(traces: list[Trace], seq: SeqPlan) -> Work | None:
    """What the step at the target computes: FLOPs quadratic in the length (attention), the rest
    affine in the length and the last chunk (a least-squares fit; the cost model's, not memory's)."""
    works = [t.work for t in traces]
    if any(w is None for w in works):
        return None
    lengths = np.array(seq.lengths, dtype=np.float64)
    flops = np.polyval(np.polyfit(lengths, [w.flops for w in works], 2), seq.target)  # type: ignore[union-attr]
    design, at = _design(list(seq.lengths), seq.chunk, seq.rows), _design([seq.target], seq.chunk, seq.rows)

    def fit(values: list[int]) -> int:
        coef = np.linalg.lstsq(design, np.array(values, dtype=np.float64), rcond=None)[0]
        return max(0, round(float((at @ coef)[0])))

    w0 = works[0]
    assert w0 is not None
    return replace(w0, flops=max(0.0, float(flops)), ops=fit([w.ops for w in works]),  # type: ignore[union-attr]
                   written=fit([w.written for w in works]),  # type: ignore[union-attr]
                   optimizer_ops=fit([w.optimizer_ops for w in works]))  # type: ignore[union-attr]


__all__ = ["Folded", "Loop", "SeqPlan", "along", "fold", "plan"]
