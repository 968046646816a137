"""Estimates derived from a sibling's trace, where a technique's effect on it is exactly known.

**Embedding offload** (``memory.offload.embeddings``, :mod:`memtrain.patches.embedding_offload`) on
a CUDA device changes a traced step in three places and nowhere else: the input table's bytes
leave the device (its ``parameters``) for the host, where they stay all step; the token ids go to
the host, where the looked-up rows are gathered (one micro-batch's rows, in host memory at the start
of the forward, when the host holds only what it holds all step); and one op copies the rows to the
device, where the lookup would have put the same tensor. So the step with the offload is the step
without it, every op's device bytes less the table, its host bytes plus the table, one more moment
(the gather) holding the host's resident bytes, the table and the rows, and one more op writing
the rows. The planner traces one of the two and derives the other (``Search._traced``): the
long-context plan's search has both values of the field for most of its settings.

Derived where the tests compared it byte for byte with a trace (tests/plan/test_derive.py: Llama,
Qwen2, Gemma, GPT-2 with an untied head, a BERT classifier; with and without activation offload,
checkpointing, the tiled MLP, the lean norm and the chunked loss; micro-batches 1 to 4, with and
without held gradients): one process, ``sft`` (DPO's reference forward looks up again, GRPO
generates), a plain ``nn.Embedding`` without ``max_norm`` (a subclass may compute more on the host
in its forward). Anything else is traced.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from torch import nn

from memtrain.config import RunConfig
from memtrain.estimator.trace import HOST, PINNED, ROUNDED, Candidates, Work
from memtrain.estimator.trace_events import CATEGORY_NAMES
from memtrain.memory.trackers import pinned_bytes

PARAMETERS = CATEGORY_NAMES.index("parameters")
ROUNDING = 512  # the CUDA caching allocator's rounding of an allocation (as the trace rounds)


class Table(NamedTuple):
    """What the embedding offload moves: the table's bytes, a looked-up row's bytes per token, and
    its patch record (the text a trace lists, and how many records come before it: those of the
    patches applied first, the same with the offload or without)."""

    bytes: int
    row_bytes: int
    record: str
    before: int


def offloadable(cfg: RunConfig, device: str) -> bool:
    """Whether a step of ``cfg`` with the embedding offload can be derived from one without it
    (see the module docstring; the table itself is checked by :func:`table`)."""
    return (device == "cuda" and cfg.training.objective == "sft" and cfg.distributed.processes == 1
            and cfg.memory.offload.embeddings is True)


def table(model: nn.Module) -> Table | None:
    """The offloaded table of ``model`` (a fake model with the embedding offload applied), or None
    where the derivation does not hold for it (see the module docstring)."""
    from memtrain.patches import records
    from memtrain.patches.embedding_offload import NAME, input_embedding

    embedding = input_embedding(model)
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
        return None
    applied = records(model)
    names = [r.name for r in applied]
    if names.count(NAME) != 1:
        return None
    k = names.index(NAME)
    record = applied[k]
    weight = embedding.weight
    return Table(weight.numel() * weight.element_size(), embedding.embedding_dim * weight.element_size(),
                 record.detail or record.name, k)


def table_offloaded(cands: Candidates, moved: Table, tokens: int) -> Candidates:
    """``cands`` (a step without the offload) with the table on the host, ``tokens`` looked up."""
    values = cands.values.copy()
    values[:, PARAMETERS] -= moved.bytes
    values[:, ROUNDED] -= -(-moved.bytes // ROUNDING) * ROUNDING
    values[:, HOST] += moved.bytes
    values[:, PINNED] += pinned_bytes(moved.bytes) - moved.bytes  # derived for CUDA only: pinned
    gather = np.zeros((1, values.shape[1]), dtype=values.dtype)  # no device op holds a peak here
    gather[0, HOST] = values[:, HOST].min() + tokens * moved.row_bytes
    gather[0, PINNED] = values[:, PINNED].min()
    return Candidates([*cands.phases, "forward"], np.vstack([values, gather]))


def work_offloaded(work: Work | None, moved: Table, tokens: int) -> Work | None:
    """``work`` with the copy of the looked-up rows to the device."""
    if work is None:
        return None
    return dataclasses.replace(work, ops=work.ops + 1, written=work.written + tokens * moved.row_bytes)


def patches_offloaded(names: list[str], moved: Table) -> list[str]:
    """The patch records of a trace with the offload, from those of one without it."""
    return [*names[:moved.before], moved.record, *names[moved.before:]]
