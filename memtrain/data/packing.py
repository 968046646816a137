"""Packing: several tokenized examples per row, with no cross-talk between them.

Each packed row holds whole examples one after the other (each already closed by its
end-of-sequence token). Three things keep them independent, so that the loss of a packed row is
exactly the token-weighted loss of its examples run one by one:

- ``position_ids`` restart at 0 for every example;
- attention stays within an example. The collator leaves out ``attention_mask``; transformers
  (``masking_utils.find_packed_sequence_indices``) then reads the example boundaries from the
  restarting ``position_ids`` and builds a block-diagonal causal mask for eager and SDPA attention,
  and passes them to varlen kernels for flash attention. Padding gets positions of its own, so it
  is one more block that no real token attends to. transformers reads the boundaries only when the
  forward builds no KV cache: the Trainer sets ``config.use_cache = TrainingArguments.use_cache``,
  which is False;
- the first token of every example carries no label, so nothing is trained to predict the next
  example from the end of the previous one.

Rows are filled greedily in data order (after shuffling). A ``text`` example longer than a row
continues in the next rows (each piece restarts its positions); other formats are cut, so that
an answer is never separated from its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset

from memtrain.config import Problem, RecipeError
from memtrain.data.chat import IGNORE_INDEX

_Doc = tuple[list[int], list[int]]


def _pieces(ids: list[int], labels: list[int], block: int, split_long: bool) -> list[_Doc]:
    if len(ids) <= block:
        return [(ids, labels)]
    if not split_long:
        return [(ids[:block], labels[:block])]
    return [(ids[i: i + block], labels[i: i + block]) for i in range(0, len(ids), block)]


def pack_examples(examples: Sequence[_Doc], block: int, split_long: bool) -> dict[str, list]:
    """Greedy packing of ``(input_ids, labels)`` pairs into rows of at most ``block`` tokens."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        nonlocal ids, labels, positions
        if ids:
            for key, value in (("input_ids", ids), ("labels", labels), ("position_ids", positions)):
                rows[key].append(value)
        ids, labels, positions = [], [], []

    for doc_ids, doc_labels in examples:
        for piece_ids, piece_labels in _pieces(doc_ids, doc_labels, block, split_long):
            if len(ids) + len(piece_ids) > block:
                flush()
            ids += piece_ids
            labels += [IGNORE_INDEX, *piece_labels[1:]]
            positions += range(len(piece_ids))
    flush()
    return rows


def pack(ds: Dataset, block: int, split_long: bool) -> Dataset:
    """A tokenized dataset (``input_ids``, ``labels``) packed into rows of at most ``block`` tokens."""

    def batch_pack(batch: dict[str, list]) -> dict[str, list]:
        return pack_examples(list(zip(batch["input_ids"], batch["labels"], strict=True)), block,
                             split_long)

    packed = ds.map(batch_pack, batched=True, batch_size=2000, remove_columns=ds.column_names,
                    desc="packing")
    if len(packed) == 0:
        raise RecipeError([Problem("data.max_length", block, "packing produced no rows",
                                   "add data or lower `data.max_length`.")])
    return packed


@dataclass
class PackedCollator:
    """Pads packed rows to the longest of the batch; padding is a block of its own, never trained."""

    pad_token_id: int

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
        for f in features:
            pad = width - len(f["input_ids"])
            out["input_ids"].append([*f["input_ids"], *[self.pad_token_id] * pad])
            out["labels"].append([*f["labels"], *[IGNORE_INDEX] * pad])
            out["position_ids"].append([*f["position_ids"], *range(pad)])
        return {key: torch.tensor(value, dtype=torch.long) for key, value in out.items()}


def fill(lengths: Sequence[int], block: int) -> float:
    """Share of a ``rows × block`` tensor that holds real tokens (1 - padding waste)."""
    return sum(lengths) / (len(lengths) * block) if lengths else 0.0
