"""Data formats, masking, packing, and data mistakes reported before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import MINILM, causal_recipe

from memtrain.config import RecipeError, load_recipe
from memtrain.data import IGNORE_INDEX, prepare_data
from memtrain.model import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    cfg = load_recipe({"model": {"name": MINILM}, "data": {"source": "builtin:shakespeare-text"}})
    return load_tokenizer(cfg.model)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return path


def recipe(tmp_path: Path, data_file: Path, **data) -> object:
    return load_recipe(causal_recipe(tmp_path, data_file, data={"eval_split": 0.0, **data}))


def test_instruction_loss_only_on_the_response(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "What is two plus two?", "response": "four"}] * 4)
    data = prepare_data(recipe(tmp_path, f, format="instruction", max_length=64), tokenizer)
    row = data.train[0]
    answer = [t for t, y in zip(row["input_ids"], row["labels"], strict=True) if y != IGNORE_INDEX]
    assert tokenizer.decode(answer).startswith("four")
    assert row["labels"][0] == IGNORE_INDEX and len(row["labels"]) == len(row["input_ids"])


def test_chat_loss_on_assistant_turns_with_a_template(tmp_path: Path, tokenizer) -> None:
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
                               "{% endfor %}")
    messages = [{"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "good morrow"},
                {"role": "user", "content": "farewell"},
                {"role": "assistant", "content": "adieu"}]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}] * 3)
    try:
        data = prepare_data(recipe(tmp_path, f, format="chat", max_length=128), tokenizer)
    finally:
        tokenizer.chat_template = None
    row = data.train[0]
    trained = tokenizer.decode([t for t, y in zip(row["input_ids"], row["labels"], strict=True)
                                if y != IGNORE_INDEX])
    assert "good morrow" in trained and "adieu" in trained
    assert "hello" not in trained and "farewell" not in trained


def test_packing_makes_full_blocks(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": f"line {i} of a long poem"} for i in range(50)])
    data = prepare_data(recipe(tmp_path, f, format="text", packing=True, max_length=16), tokenizer)
    assert len(data.train) > 5
    assert all(len(ids) == 16 for ids in data.train["input_ids"])


def test_classification_maps_string_labels(tmp_path: Path, tokenizer, tiny_classification_file: Path) -> None:
    cfg = load_recipe({"model": {"name": MINILM, "task": "sequence-classification"},
                       "data": {"source": str(tiny_classification_file), "format": "classification",
                                "eval_split": 0.25}})
    data = prepare_data(cfg, tokenizer)
    assert data.label_names == ["cat", "dog"] and data.num_labels == 2
    assert set(data.train["labels"]) == {0, 1} and data.eval is not None and len(data.eval) == 16


def test_missing_column_lists_the_columns(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"sentence": "a b c"}])
    with pytest.raises(RecipeError, match=r"`data.text_column`.*columns the data has: sentence"):
        prepare_data(recipe(tmp_path, f, format="text"), tokenizer)


def test_empty_dataset(tmp_path: Path, tokenizer) -> None:
    f = tmp_path / "empty.csv"
    f.write_text("text\n")
    with pytest.raises(RecipeError, match=r"`data.source`.*has no examples"):
        prepare_data(recipe(tmp_path, f, format="text"), tokenizer)


def test_every_example_too_long(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "word " * 50, "response": "yes"}] * 3)
    with pytest.raises(RecipeError, match=r"`data.max_length`.*no answer tokens.*raise"):
        prepare_data(recipe(tmp_path, f, format="instruction", max_length=8), tokenizer)


def test_labels_out_of_range(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": f"t {i}", "label": i % 5} for i in range(10)])
    cfg = load_recipe({"model": {"name": MINILM, "task": "sequence-classification", "num_labels": 3},
                       "data": {"source": str(f), "format": "classification"}})
    with pytest.raises(RecipeError, match=r"`model.num_labels`.*smaller than the 5 labels"):
        prepare_data(cfg, tokenizer)


def test_data_errors_come_before_the_model_loads(tmp_path: Path, monkeypatch) -> None:
    from memtrain import runner

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load when the data is wrong")

    monkeypatch.setattr(runner, "build_model", no_model)
    f = write_jsonl(tmp_path / "t.jsonl", [{"sentence": "a"}])
    with pytest.raises(RecipeError, match="text_column"):
        runner.train(recipe(tmp_path, f, format="text"))
