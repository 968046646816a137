"""Several datasets in one run (``data.mix``): tokenized datasets combined by weight.

Each dataset is read and tokenized on its own, with its own format, columns and templates
(:func:`memtrain.data.prepare.prepare_data`); what reaches this module is already ``input_ids`` and
``labels``, so datasets of different formats mix freely.

Training examples are drawn with Hugging Face ``datasets.interleave_datasets``: at each draw a
dataset is picked with probability weight / sum of weights (seeded by ``training.seed``), and its
next example is taken. ``data.mix_stopping`` says when drawing ends:

- ``first_exhausted`` (default, under-sampling): when the picked dataset has no example left. No
  example repeats, the dataset that ran out is used whole, and each weight is the expected share
  of the drawn examples; the others are cut short.
- ``all_exhausted`` (over-sampling): when every dataset has been used whole; one that runs out
  starts again, so its examples repeat.

Evaluation is not weighted: it is every dataset's held-out part, one after the other, so its loss
covers each dataset in proportion to its size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from datasets import Dataset, concatenate_datasets, interleave_datasets

from memtrain.config import DataConfig

_SOURCE = "_dataset"  # hidden column: the index of the dataset an example came from


@dataclass(frozen=True)
class MixShare:
    """One dataset of a mix and what the training set took from it."""

    path: str  # its place in the recipe: `data` or `data.mix[i]`
    source: str
    weight: float
    examples: int  # training examples drawn from it (before packing)


def mix(parts: list[tuple[Dataset, Dataset | None]], datasets: list[DataConfig], stopping: str,
        seed: int) -> tuple[Dataset, Dataset | None, list[MixShare]]:
    """Combine tokenized ``(train, eval)`` pairs, one per dataset, into one pair.

    Args:
        parts: each dataset's tokenized training and evaluation examples (eval may be None).
        datasets: the datasets' settings, in the same order (their ``weight`` is used).
        stopping: ``first_exhausted`` or ``all_exhausted`` (see the module docstring).
        seed: seeds the draws.

    Returns:
        The mixed training set, the concatenated evaluation sets (None when no dataset has one)
        and what was drawn from each dataset.
    """
    trains = _uniform([train.add_column(_SOURCE, [i] * len(train))
                       for i, (train, _) in enumerate(parts)])
    total = sum(d.weight for d in datasets)
    mixed = interleave_datasets(trains, probabilities=[d.weight / total for d in datasets],
                                seed=seed, stopping_strategy=stopping)
    drawn = Counter(mixed[_SOURCE])
    shares = [MixShare(d.key(), d.source, d.weight, drawn[i])
              for i, d in enumerate(datasets)]
    evals = [evaluation for _, evaluation in parts if evaluation is not None]
    evaluation = concatenate_datasets(_uniform(evals)) if evals else None
    return mixed.remove_columns(_SOURCE), evaluation, shares


def _uniform(parts: list[Dataset]) -> list[Dataset]:
    """The same columns with the same types in every part (as interleaving requires).

    A ``text`` dataset with packing is not cut to rows, so it has no ``truncated`` flag (nothing
    of it is truncated) and no attention mask (packing drops it anyway).
    """
    parts = [p if "truncated" in p.column_names else p.add_column("truncated", [False] * len(p))
             for p in parts]
    common = [c for c in parts[0].column_names if all(c in p.column_names for p in parts)]
    parts = [p.select_columns(common) for p in parts]
    return [p if p.features == parts[0].features else p.cast(parts[0].features) for p in parts]
