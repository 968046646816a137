"""Data formats, masking, packing, and data mistakes reported before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINILM, causal_recipe, tiny_model, write_jsonl

from memtrain.config import RecipeError, load_recipe
from memtrain.data.prepare import IGNORE_INDEX, prepare_data


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
    assert all(len(ids) <= 16 for ids in data.train["input_ids"])
    assert data.fill == {"unpacked": 0.5, "packed": 1.0}  # two 8-token lines per 16-token row


def test_one_class_names_the_label_column(tmp_path: Path, tokenizer) -> None:
    """It named `data.label`, which is no key."""
    f = write_jsonl(tmp_path / "one.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}])
    cfg = load_recipe({"model": {"name": MINILM, "task": "sequence-classification"},
                       "data": {"source": str(f), "format": "classification", "eval_split": 0.0}})
    with pytest.raises(RecipeError, match=r"`data.label_column`: classification needs at least 2 labels"):
        prepare_data(cfg, tokenizer)


def test_classification_maps_string_labels(tmp_path: Path, tokenizer, tiny_classification_file: Path) -> None:
    cfg = load_recipe({"model": {"name": MINILM, "task": "sequence-classification"},
                       "data": {"source": str(tiny_classification_file), "format": "classification",
                                "eval_split": 0.25}})
    data = prepare_data(cfg, tokenizer)
    assert data.label_names == ["cat", "dog"] and data.num_labels == 2
    assert set(data.train["labels"]) == {0, 1} and data.eval is not None and len(data.eval) == 16
    # one segment a row: no all-zero token types in the batches (the model's own zeros stand in)
    assert "token_type_ids" not in data.train.column_names
    assert tokenizer(["a b"])["token_type_ids"] == [[0, 0, 0, 0]]


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


def test_a_negative_label_names_the_label_column(tmp_path: Path, tokenizer) -> None:
    """It named `data.label`, which is not a recipe field, and not the label it found."""
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": f"t {i}", "y": i % 3 - 1} for i in range(6)])
    cfg = load_recipe({"model": {"name": MINILM, "task": "sequence-classification"},
                       "data": {"source": str(f), "format": "classification", "label_column": "y"}})
    with pytest.raises(RecipeError, match=r"`data.label_column`: holds the label -1; number labels must be "
                                          r"0 or more, got 'y'. Fix: use labels 0..N-1 or class names."):
        prepare_data(cfg, tokenizer)


def test_data_errors_come_before_the_model_loads(tmp_path: Path, monkeypatch) -> None:
    from memtrain.run import train as runner

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load when the data is wrong")

    monkeypatch.setattr(runner, "build_model", no_model)
    f = write_jsonl(tmp_path / "t.jsonl", [{"sentence": "a"}])
    with pytest.raises(RecipeError, match="text_column"):
        runner.train(recipe(tmp_path, f, format="text"))


# ------------------------------------------------------------------------- formats (issue 16)

def trained_text(tokenizer, row: dict) -> str:
    return tokenizer.decode([t for t, y in zip(row["input_ids"], row["labels"], strict=True)
                             if y != IGNORE_INDEX])


def test_alpaca_uses_the_template_and_the_input_when_present(tmp_path: Path, tokenizer) -> None:
    rows = [{"instruction": "Translate to French", "input": "good morning", "output": "bonjour"},
            {"instruction": "Name a colour", "input": "", "output": "blue"}]
    f = write_jsonl(tmp_path / "a.jsonl", rows)
    data = prepare_data(recipe(tmp_path, f, format="alpaca", max_length=128), tokenizer)
    by_answer = {trained_text(tokenizer, r): tokenizer.decode(r["input_ids"]) for r in data.train}
    assert set(by_answer) == {"bonjour [SEP]", "blue [SEP]"}  # MiniLM's SEP closes the answer
    assert "# # # input : good morning # # # response" in by_answer["bonjour [SEP]"]
    assert "# # # input" not in by_answer["blue [SEP]"] and "# # # instruction : name a colour" in \
        by_answer["blue [SEP]"]


def test_a_placeholder_in_the_data_is_text_not_a_template_field(tmp_path: Path, tokenizer) -> None:
    """Code in an instruction may read `{input}`: the template is filled in one pass, so the row's
    input goes where the template has it and nowhere else (chained replaces put it in the code too:
    an outside user's `print(f"{input}")` trained as `print(f"secret")`). The completion template
    and `memtrain generate`'s prompts are filled the same way."""
    from memtrain.data.formats import fill_template

    rows = [{"instruction": 'Explain print(f"{input}") and {prompt}', "input": "secret", "output": "ok"}]
    f = write_jsonl(tmp_path / "a.jsonl", rows)
    data = prepare_data(recipe(tmp_path, f, format="alpaca", max_length=128), tokenizer)
    text = tokenizer.decode(data.train[0]["input_ids"])
    assert text.count("secret") == 1 and "{ input }" in text, text
    assert fill_template("<{prompt}>", prompt="{prompt}") == "<{prompt}>"


def test_train_on_inputs_trains_the_prompt_too(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "two plus two", "response": "four"}] * 2)
    data = prepare_data(recipe(tmp_path, f, format="completion", train_on_inputs=True), tokenizer)
    assert trained_text(tokenizer, data.train[0]) == "two plus two four [SEP]"


def test_sharegpt_roles_are_mapped_and_rendered(tmp_path: Path, tokenizer) -> None:
    conv = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hello there"},
            {"from": "gpt", "value": "good morrow"}]
    f = write_jsonl(tmp_path / "s.jsonl", [{"conversations": conv}] * 2)
    tokenizer.chat_template = None
    data = prepare_data(recipe(tmp_path, f, format="sharegpt", max_length=128), tokenizer)
    try:
        row = data.train[0]
        assert "im _ start | > user hello there" in tokenizer.decode(row["input_ids"])  # ChatML fallback
        assert trained_text(tokenizer, row) == "good morrow < | im _ end | >"
    finally:
        tokenizer.chat_template = None


def test_chat_template_from_a_file_and_saved_on_the_tokenizer(tmp_path: Path, tokenizer) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hail"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}] * 2)
    try:
        data = prepare_data(recipe(tmp_path, f, format="messages", chat_template=str(template)),
                            tokenizer)
        assert tokenizer.chat_template == template.read_text()
        assert trained_text(tokenizer, data.train[0]) == "[ assistant ] hail"
    finally:
        tokenizer.chat_template = None


def test_chat_template_that_is_neither_jinja_nor_a_file(tmp_path: Path, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hail"}]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}])
    with pytest.raises(RecipeError, match=r"`data.chat_template`.*neither a Jinja template"):
        prepare_data(recipe(tmp_path, f, format="messages", chat_template="nope.jinja"), tokenizer)


def test_tokenized_rows_pass_through(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                           {"input_ids": [8, 9], "labels": [-100, 9]}])
    data = prepare_data(recipe(tmp_path, f, format="tokenized"), tokenizer)
    assert sorted(data.train["input_ids"]) == [[5, 6, 7], [8, 9]]
    assert sorted(data.train["labels"]) == [[-100, 6, 7], [-100, 9]]


def test_a_tokenized_row_without_labels_trains_every_token(tmp_path: Path, tokenizer) -> None:
    """`labels` is optional per row too (docs/DATA.md): a row without them, in a file where others
    have them, trains every token (it was refused: "`labels` has 0 entries", an outside user's file).
    A row whose labels do not match its ids is still refused. Planted: the null read as 0 labels ->
    fails."""
    f = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                           {"input_ids": [8, 9]}, {"input_ids": [4, 3], "labels": None}])
    data = prepare_data(recipe(tmp_path, f, format="tokenized"), tokenizer)
    assert sorted(data.train["labels"]) == [[-100, 6, 7], [4, 3], [8, 9]]
    f = write_jsonl(tmp_path / "u.jsonl", [{"input_ids": [5, 6, 7], "labels": [6, 7]}])
    with pytest.raises(RecipeError, match=r"row 1: `labels` has 2 entries for 3 `input_ids`"):
        prepare_data(recipe(tmp_path, f, format="tokenized"), tokenizer)


def test_plain_text_ends_with_an_end_token(tmp_path: Path, tokenizer) -> None:
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "to be or not"}] * 2)
    row = prepare_data(recipe(tmp_path, f, format="text"), tokenizer).train[0]
    assert row["input_ids"][-1] == tokenizer.sep_token_id == row["labels"][-1]


@pytest.mark.parametrize(("fmt", "rows", "match"), [
    ("messages", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                  {"messages": [{"content": "x"}, {"role": "assistant", "content": "b"}]}],
     r"`data.messages_column`: row 2: message 1 has no `role`"),
    ("messages", [{"messages": []}], r"`data.messages_column`: row 1: the conversation is empty"),
    ("sharegpt", [{"conversations": [{"from": "robot", "value": "a"}]}],
     r"`data.conversations_column`: row 1: message 1 has the unknown role 'robot'.*sharegpt_roles"),
    ("alpaca", [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}],
     r"`data.output_column`: is empty \(null\) in train row 2"),
    ("alpaca", [{"instruction": "a", "answer": "b"}],
     r"`data.output_column`.*not a column of the data.*instruction, answer"),
    ("tokenized", [{"input_ids": [1, 2], "labels": [1]}], r"row 1: `labels` has 1 entries for 2"),
])
def test_bad_rows_name_the_row_and_the_column(tmp_path: Path, tokenizer, fmt, rows, match) -> None:
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(RecipeError, match=match):
        prepare_data(recipe(tmp_path, f, format=fmt), tokenizer)


def test_bad_row_exits_2_without_traceback(tmp_path: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    f = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path, f, data={"format": "messages"})))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "row 1: message 1 has no `content`" in result.output
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_old_format_names_are_aliases(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "x.jsonl", [{"text": "a"}])
    assert recipe(tmp_path, f, format="chat").data.kind == "messages"
    assert recipe(tmp_path, f, format="instruction").data.kind == "completion"


def test_which_play_builtin_is_balanced_alpaca() -> None:
    from collections import Counter

    from memtrain.builtin_data import BUILTINS, PLAYS, WHICH_PLAY

    ds = BUILTINS["shakespeare-which-play"](0)
    counts = Counter(ds["output"])
    assert set(counts) == set(PLAYS.values()) and len(set(counts.values())) == 1
    assert set(ds["instruction"]) == {WHICH_PLAY} and all(len(t.split()) >= 5 for t in ds["input"])


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_a_classifier_without_token_types_computes_what_zeros_give(arch: str) -> None:
    """Why classification rows drop all-zero ``token_type_ids``: the model's own zeros stand in."""
    import torch

    model = tiny_model(arch).eval()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        given = model(input_ids=ids, token_type_ids=torch.zeros_like(ids)).logits
        left_out = model(input_ids=ids).logits
    assert torch.equal(given, left_out)


def test_the_longest_row_is_of_the_rows_kept(tmp_path: Path, tokenizer) -> None:
    """A row dropped for its length (its answer cut off) is not the data's longest row: the plan and
    the estimate size the batch from the rows that train (an outside user's `validate --data` said
    "1 training examples, the longest 128 tokens" of one 33-token example)."""
    rows = [{"prompt": "What is two plus two?", "response": "four"},
            {"prompt": "x " * 300, "response": "gone"}]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = recipe(tmp_path, f, format="completion", max_length=64)
    data = prepare_data(cfg, tokenizer)
    assert len(data.train) == 1 and data.rows(cfg).longest == len(data.train[0]["input_ids"]) < 64
