"""`data.max_length: auto` reads the data once (memtrain.data.prepare.read_data / cut_to): the rows
read uncut for the length search are the training data where the planned length cuts none of
them, exactly what tokenizing again at that length gives; else it tokenizes again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import MINILM, causal_recipe

from memtrain.config import load_recipe
from memtrain.data import prepare
from memtrain.model import load_tokenizer


def _cases(tmp_path: Path, text: Path, cls: Path) -> dict[str, dict]:
    return {
        "text": causal_recipe(tmp_path, text, data={"max_length": "auto", "eval_split": 0.25}),
        # an encoder's input ends in [SEP]: cut tokens are not tokens cut
        "classification": causal_recipe(tmp_path, cls, data={"max_length": "auto", "format": "classification",
                                                              "eval_split": 0.25},
                                        model={"from_config": None, "name": MINILM,
                                               "task": "sequence-classification", "tokenizer": None}),
    }


def _same(a: prepare.PreparedData, b: prepare.PreparedData) -> None:
    assert a.train.to_dict() == b.train.to_dict()
    assert a.eval is not None and b.eval is not None and a.eval.to_dict() == b.eval.to_dict()
    assert type(a.collator) is type(b.collator) and a.truncated == b.truncated
    assert a.label_names == b.label_names


@pytest.mark.parametrize("kind", ["text", "classification"])
def test_a_length_that_cuts_nothing_reuses_the_rows_read_and_one_that_cuts_tokenizes_again(
        tmp_path: Path, tiny_text_file: Path, tiny_classification_file: Path, kind: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_recipe(_cases(tmp_path, tiny_text_file, tiny_classification_file)[kind])
    tokenizer = load_tokenizer(cfg.model)
    rows, whole = prepare.read_data(cfg, tokenizer)
    longest = max(max(prepare.token_counts(s)) for s in (whole.train, whole.eval))
    assert rows.longest <= longest
    encoded = []
    real = prepare._encode_dataset
    monkeypatch.setattr(prepare, "_encode_dataset", lambda *a, **k: encoded.append(1) or real(*a, **k))

    fits = load_recipe(_cases(tmp_path, tiny_text_file, tiny_classification_file)[kind]
                       | {"data": {**cfg.data.model_dump(exclude_none=True), "max_length": longest}})
    reused = prepare.cut_to(whole, fits, tokenizer)
    assert encoded == [] and reused.train is whole.train  # read once
    _same(reused, prepare.prepare_data(fits, tokenizer))
    encoded.clear()

    cuts = load_recipe(_cases(tmp_path, tiny_text_file, tiny_classification_file)[kind]
                       | {"data": {**cfg.data.model_dump(exclude_none=True), "max_length": longest - 3}})
    again = prepare.cut_to(whole, cuts, tokenizer)
    assert encoded == [1] and again.truncated > 0
    _same(again, prepare.prepare_data(cuts, tokenizer))


def test_a_longer_evaluation_row_or_packing_tokenizes_again(tmp_path: Path, tiny_text_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = causal_recipe(tmp_path, tiny_text_file, data={"max_length": "auto", "eval_split": 0.25})
    cfg = load_recipe(recipe)
    tokenizer = load_tokenizer(cfg.model)
    _, whole = prepare.read_data(cfg, tokenizer)
    train_longest = max(prepare.token_counts(whole.train))
    again = []
    monkeypatch.setattr(prepare, "prepare_data", lambda cfg, tok: again.append(cfg.data.max_length) or whole)
    # the evaluation split holds a row longer than any training row
    longer = whole.eval.map(lambda row: {"input_ids": row["input_ids"] + [1], "labels": row["labels"] + [1],
                                         "attention_mask": row["attention_mask"] + [1]})
    assert max(prepare.token_counts(longer)) > train_longest
    fits_train = load_recipe(recipe | {"data": {**recipe["data"], "max_length": train_longest}})
    prepare.cut_to(dataclasses.replace(whole, eval=longer), fits_train, tokenizer)
    assert again == [train_longest]
    packed = load_recipe(recipe | {"data": {**recipe["data"], "max_length": 10_000, "packing": True}})
    prepare.cut_to(whole, packed, tokenizer)  # packing fills rows to the length: packed again
    assert again == [train_longest, 10_000]
