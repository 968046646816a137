"""What the longest batch of a run looks like: the rows the estimator traces and auto-fit probes.

A training step's memory grows with the longest row of its batch (every row is padded to it) and
with how attention is masked. memtrain's collators (``DataCollatorWithPadding``,
``DataCollatorForSeq2Seq``, the packed collator) pad a batch to its own longest row, never to
``data.max_length``, so:

- the rows of the largest batch are as long as the longest tokenized row of the data (at most
  ``data.max_length``), not ``data.max_length`` itself when the data is shorter;
- a batch is *padded* (its attention mask has zeros, and transformers builds a 4D mask: the masked
  attention path, which holds more than the unmasked one) only when its rows differ in length.
  A batch of one row never is, nor a batch of rows that all have the same length (long documents
  cut at ``data.max_length``);
- packed rows restart their position ids, from which transformers builds a block-diagonal mask.

:class:`Rows` holds those facts. Read from the tokenized data (:func:`rows_of`) they describe the
data at hand; without data (``memtrain estimate``, the plugin before a dataset is known)
:func:`worst_case` takes every row ``data.max_length`` tokens long and of varying lengths, which no
batch of the run can exceed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memtrain.config import RunConfig


@dataclass(frozen=True)
class Rows:
    """The longest row of a run's batches and whether rows differ in length."""

    longest: int  # tokens of the longest row a batch can hold
    uniform: bool  # every row has exactly ``longest`` tokens: no batch is ever padded
    packed: bool  # rows hold several examples (position ids restart)
    read: bool  # True: from the tokenized data; False: the recipe's worst case

    def padded(self, micro_batch: int) -> bool:
        """Whether the longest batch of ``micro_batch`` rows carries padding (a mask with zeros)."""
        return not self.packed and not self.uniform and micro_batch > 1 and self.longest > 1

    def describe(self, micro_batch: int, measured: bool = False) -> str:
        """One line for the estimate's notes: what the traced batch is and where it comes from
        (``measured``: the batch a training step held, not the data's longest)."""
        layout = ("packed rows (block-diagonal attention)" if self.packed else
                  "padded to the longest row (masked attention)" if self.padded(micro_batch) else
                  "no padding (unmasked attention)")
        if measured:
            return f"the measured batch's longest row, {self.longest} tokens; batches {layout}"
        if self.read:
            return f"the data's longest row, {self.longest} tokens; batches {layout} (read from the data)"
        return (f"every row data.max_length = {self.longest} tokens; batches {layout} (the worst case; "
                "data is not read)")


def worst_case(cfg: RunConfig) -> Rows:
    """The largest batch the recipe allows, without reading its data."""
    return Rows(longest=cfg.data.max_length, uniform=False, packed=cfg.data.packing, read=False)


def rows_of(cfg: RunConfig, lengths: Sequence[int]) -> Rows:
    """The largest batch of data whose training rows have these token counts (after cutting or
    packing). An empty sequence is the worst case."""
    if not lengths:
        return worst_case(cfg)
    longest = min(max(lengths), cfg.data.max_length)
    uniform = min(lengths) == max(lengths)
    return Rows(longest=longest, uniform=uniform, packed=cfg.data.packing, read=True)
