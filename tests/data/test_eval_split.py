"""`data.eval_split`: what is trained on and what is evaluated are disjoint and together are the data.

Each row of the files below says which file and which row it is ("apple 7 ends"), so a tokenized
example is traced back to its row by its text, independently of how memtrain numbers rows.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from conftest import causal_recipe, write_jsonl

from memtrain.config import load_recipe
from memtrain.data.prepare import prepare_data

_ROW = re.compile(r"\b(apple|banana) (\d+) ends\b")


def text_file(path: Path, word: str, rows: range) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_jsonl(path, [{"text": f"{word} {i} ends"} for i in rows])


def row_ids(tokenizer, dataset) -> list[tuple[str, int]]:
    """The (file word, row) of every tokenized example, read from its text."""
    out = []
    for ids in dataset["input_ids"]:
        found = _ROW.findall(tokenizer.decode(ids))
        assert len(found) == 1, tokenizer.decode(ids)
        out.append((found[0][0], int(found[0][1])))
    return out


def split(tokenizer, tmp_path: Path, source: Path, **data) -> tuple[list, list]:
    cfg = load_recipe(causal_recipe(tmp_path, source, data={"max_length": 16, **data}))
    prepared = prepare_data(cfg, tokenizer)
    assert prepared.eval is not None
    return row_ids(tokenizer, prepared.train), row_ids(tokenizer, prepared.eval)


def assert_partition(train: list, evaluation: list, whole: set, eval_size: int) -> None:
    """Each row once, none in both, all rows in one of them, ``eval_size`` of them held out."""
    assert len(set(train)) == len(train) and len(set(evaluation)) == len(evaluation)
    assert not set(train) & set(evaluation), sorted(set(train) & set(evaluation))
    assert set(train) | set(evaluation) == whole
    assert len(evaluation) == eval_size


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_a_fraction_is_held_out_of_one_dataset(tmp_path: Path, tokenizer, fraction: float) -> None:
    source = text_file(tmp_path / "a.jsonl", "apple", range(20))
    train, evaluation = split(tokenizer, tmp_path, source, eval_split=fraction)
    assert_partition(train, evaluation, {("apple", i) for i in range(20)}, int(20 * fraction))


def test_max_examples_are_split_too(tmp_path: Path, tokenizer) -> None:
    """`max_examples` picks the data first; the split divides those rows, no others."""
    source = text_file(tmp_path / "a.jsonl", "apple", range(30))
    train, evaluation = split(tokenizer, tmp_path, source, eval_split=0.25, max_examples=12)
    rows = set(train) | set(evaluation)
    assert len(rows) == 12 and rows <= {("apple", i) for i in range(30)}
    assert_partition(train, evaluation, rows, 3)


def test_a_named_split_is_evaluated_and_not_trained_on(tmp_path: Path, tokenizer) -> None:
    folder = tmp_path / "splits"
    text_file(folder / "train.jsonl", "apple", range(12))
    text_file(folder / "test.jsonl", "apple", range(100, 104))
    train, evaluation = split(tokenizer, tmp_path, folder, eval_split="test")
    assert sorted(train) == [("apple", i) for i in range(12)]
    assert sorted(evaluation) == [("apple", i) for i in range(100, 104)]


def test_every_dataset_of_a_mix_is_split_on_its_own(tmp_path: Path, tokenizer) -> None:
    """Per dataset of a `data.mix`: its training rows and its evaluation rows are disjoint and
    together are its rows; `all_exhausted` draws every training row (the smaller one repeats)."""
    a = text_file(tmp_path / "a.jsonl", "apple", range(40))
    b = text_file(tmp_path / "b.jsonl", "banana", range(20))
    train, evaluation = split(tokenizer, tmp_path, a, eval_split=0.25, mix_stopping="all_exhausted",
                              mix=[{"source": str(b)}])
    for word, n in (("apple", 40), ("banana", 20)):
        mine_train = [r for r in train if r[0] == word]
        mine_eval = [r for r in evaluation if r[0] == word]
        assert_partition(sorted(set(mine_train)), mine_eval, {(word, i) for i in range(n)}, n // 4)
    assert max(Counter(r for r in train if r[0] == "apple").values()) == 1  # the larger one: once each


def test_a_mix_cut_at_the_first_exhausted_never_trains_on_an_eval_row(tmp_path: Path, tokenizer) -> None:
    """`first_exhausted` cuts the larger dataset short: still no evaluation row is trained on, and the
    dataset that ran out is trained on whole (all of its non-evaluation rows)."""
    a = text_file(tmp_path / "a.jsonl", "apple", range(40))
    b = text_file(tmp_path / "b.jsonl", "banana", range(20))
    train, evaluation = split(tokenizer, tmp_path, a, eval_split=0.25, mix=[{"source": str(b)}])
    assert not set(train) & set(evaluation)
    assert len(set(train)) == len(train)
    assert Counter(w for w, _ in evaluation) == {"apple": 10, "banana": 5}
    exhausted = [w for w in ("apple", "banana")
                 if {r for r in train if r[0] == w} | {r for r in evaluation if r[0] == w}
                 == {(w, i) for i in range(40 if w == "apple" else 20)}]
    assert exhausted, "no dataset was trained on whole"


def test_a_split_that_leaves_nothing_to_train_names_the_largest_that_does(tmp_path: Path, tokenizer) -> None:
    """4 rows with `eval_split: 0.9` ended in `datasets`' ValueError, a traceback (exit 1). The
    largest split the fix names leaves one example to train on."""
    from memtrain.config import RecipeError

    source = text_file(tmp_path / "a.jsonl", "apple", range(4))
    with pytest.raises(RecipeError) as err:
        prepare_data(load_recipe(causal_recipe(tmp_path, source, data={"eval_split": 0.9})), tokenizer)
    text = str(err.value)
    assert "`data.eval_split`: leaves nothing to train on" in text and "at most 0.75" in text, text
    trained, evaluated = split(tokenizer, tmp_path, source, eval_split=0.75)
    assert (len(trained), len(evaluated)) == (1, 3)
