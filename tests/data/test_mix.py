"""Several datasets in one recipe (`data.mix`): weights, per-dataset formats, errors, a run."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MINILM, causal_recipe, write_jsonl
from transformers import AutoTokenizer

from memtrain.config import RecipeError, load_recipe
from memtrain.data.prepare import IGNORE_INDEX, prepare_data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def alpaca_file(tmp_path: Path, n: int, word: str = "number", **columns: str) -> Path:
    """``n`` alpaca rows about ``word``; ``columns`` renames instruction/input/output."""
    names = {"instruction": "instruction", "input": "input", "output": "output", **columns}
    rows = [{names["instruction"]: f"name the {word} {i}", names["input"]: "" if i % 2 else f"hint {i}",
             names["output"]: f"alpaca answer {i}"} for i in range(n)]
    return write_jsonl(tmp_path / "alpaca.jsonl", rows)


def sharegpt_file(tmp_path: Path, n: int) -> Path:
    rows = [{"conversations": [{"from": "human", "value": f"greet me {i}"},
                               {"from": "gpt", "value": f"sharegpt hello {i}"}]} for i in range(n)]
    return write_jsonl(tmp_path / "sharegpt.jsonl", rows)


def mixed(tmp_path: Path, first: Path, mix: list[dict], **data) -> object:
    return load_recipe(causal_recipe(tmp_path, first, data={
        "format": "alpaca", "max_length": 128, "chat_template": CHATML, "mix": mix, **data}))


def origin(tokenizer, ids: list[int]) -> str:
    """Which file an example came from, read from its text."""
    text = tokenizer.decode(ids)
    assert ("alpaca answer" in text) != ("sharegpt hello" in text), text
    return "alpaca" if "alpaca answer" in text else "sharegpt"


def test_weights_set_the_share_of_each_dataset(tmp_path: Path, tokenizer) -> None:
    """first_exhausted: draws stop when a dataset runs out; with weights 3:1 on 300 and 100 rows
    both run out together in expectation, so about 300 + 100 are drawn, 3/4 of them alpaca. Without
    the weights (1:1) the 100 sharegpt rows would run out after about 200 draws, half of them each."""
    a, s = alpaca_file(tmp_path, 300), sharegpt_file(tmp_path, 100)
    cfg = mixed(tmp_path, a, [{"source": str(s), "format": "sharegpt", "weight": 1.0}], weight=3.0)
    data = prepare_data(cfg, tokenizer)
    counts = {"alpaca": 0, "sharegpt": 0}
    for ids in data.train["input_ids"]:
        counts[origin(tokenizer, ids)] += 1
    assert [(m.path, m.examples) for m in data.mix] == [("data", counts["alpaca"]),
                                                         ("data.mix[0]", counts["sharegpt"])]
    assert 300 in counts.values() or 100 in counts.values()  # one dataset used whole, then stop
    share = counts["alpaca"] / len(data.train)
    assert 0.70 <= share <= 0.80, counts
    assert len(data.train) >= 340, counts  # unweighted: ~200

    even = prepare_data(mixed(tmp_path, a, [{"source": str(s), "format": "sharegpt"}]), tokenizer)
    assert abs(even.mix[0].examples / len(even.train) - 0.5) < 0.08 and even.mix[1].examples == 100

    over = prepare_data(mixed(tmp_path, a, [{"source": str(s), "format": "sharegpt"}],
                              mix_stopping="all_exhausted"), tokenizer)
    assert over.mix[0].examples >= 300 and over.mix[1].examples >= 300 * 0.8  # sharegpt repeats


def test_each_dataset_keeps_its_own_format_and_columns(tmp_path: Path, tokenizer) -> None:
    """Entries inherit what they do not set (templates, train_on_inputs) and override the rest;
    each mixed example has exactly the ids and labels its file gives when trained on alone."""
    (tmp_path / "b").mkdir()
    a = alpaca_file(tmp_path, 6)
    b = alpaca_file(tmp_path / "b", 6, "colour", instruction="task", output="answer")  # renamed columns
    s = sharegpt_file(tmp_path, 6)
    template = "Q: {instruction}\n{input}\nA: "
    cfg = mixed(tmp_path, a, [{"source": str(b), "instruction_column": "task", "output_column": "answer"},
                              {"source": str(s), "format": "sharegpt", "train_on_inputs": True}],
                alpaca_template=template, alpaca_template_no_input="Q: {instruction}\nA: ",
                mix_stopping="all_exhausted")
    first, second, third = cfg.data.datasets()
    assert (second.format, second.instruction_column, second.alpaca_template) == ("alpaca", "task", template)
    assert (third.format, third.train_on_inputs, third.alpaca_template) == ("sharegpt", True, template)
    assert not first.train_on_inputs and first.instruction_column == "instruction"

    def alone(**data) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
        one = load_recipe(causal_recipe(tmp_path, a, data={
            "format": "alpaca", "max_length": 128, "chat_template": CHATML,
            "alpaca_template": template, "alpaca_template_no_input": "Q: {instruction}\nA: ", **data}))
        ds = prepare_data(one, tokenizer).train
        return {(tuple(x), tuple(y)) for x, y in zip(ds["input_ids"], ds["labels"], strict=True)}

    expected = (alone() | alone(source=str(b), instruction_column="task", output_column="answer")
                | alone(source=str(s), format="sharegpt", train_on_inputs=True))
    data = prepare_data(cfg, tokenizer)
    got = {(tuple(x), tuple(y)) for x, y in zip(data.train["input_ids"], data.train["labels"], strict=True)}
    assert got == expected and len(expected) == 18
    chat = [(x, y) for x, y in got if origin(tokenizer, list(x)) == "sharegpt"]
    assert all(sum(t == IGNORE_INDEX for t in y) == 0 for _, y in chat)  # train_on_inputs: all trained
    assert tokenizer.chat_template == CHATML


def test_eval_takes_a_fraction_of_every_dataset(tmp_path: Path, tokenizer) -> None:
    a, s = alpaca_file(tmp_path, 40), sharegpt_file(tmp_path, 20)
    data = prepare_data(mixed(tmp_path, a, [{"source": str(s), "format": "sharegpt"}], eval_split=0.25),
                        tokenizer)
    kinds = [origin(tokenizer, ids) for ids in data.eval["input_ids"]]
    assert kinds.count("alpaca") == 10 and kinds.count("sharegpt") == 5


@pytest.mark.parametrize(("entry", "match"), [
    ({"formatt": "alpaca"}, r"`data.mix\[1\].formatt`: unknown key. Fix: did you mean `format`"),
    ({"weight": 0}, r"`data.mix\[1\].weight`: must be greater than 0"),
    ({"weight": -2.5}, r"`data.mix\[1\].weight`: must be greater than 0"),
    ({"format": "classification"}, r"`data.mix\[1\].format`: mixed datasets must be causal-LM data"),
    ({"max_length": 64}, r"`data.mix\[1\].max_length`: is common to all the datasets of a mix, got 64. "
                         r"Fix: set it once, as `data.max_length`"),
    ({"packing": True}, r"`data.mix\[1\].packing`: is common"),
    ({"completion_template": "no prompt"}, r"`data.mix\[1\].completion_template`: has no \{prompt\}"),
    ({"source": "./missing.jsonl"}, r"`data.mix\[1\].source`: cannot be found"),
])
def test_bad_entries_name_their_key(tmp_path: Path, entry: dict, match: str) -> None:
    a = alpaca_file(tmp_path, 4)
    recipe = causal_recipe(tmp_path, a, data={"format": "alpaca", "mix": [
        {"source": str(a)}, {"source": str(a), **entry}]})
    with pytest.raises(RecipeError, match=match) as err:
        load_recipe(recipe)
    assert err.value.exit_code == 2 and "data.mix[0]" not in str(err.value)


def test_a_classifier_cannot_mix(tmp_path: Path, tiny_classification_file: Path) -> None:
    recipe = {"model": {"name": MINILM, "task": "sequence-classification"},
              "data": {"source": str(tiny_classification_file), "format": "classification",
                       "mix": [{"source": str(tiny_classification_file)}]}}
    with pytest.raises(RecipeError, match=r"`data.mix`: mixing is for causal-LM data"):
        load_recipe(recipe)
    # a preference mix: the fix no longer says "train a classifier" (it did, whatever the format)
    recipe["data"] = {"source": str(tiny_classification_file), "format": "preference",
                      "mix": [{"source": str(tiny_classification_file)}]}
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    line = next(p for p in map(str, err.value.problems) if "mixing is for causal-LM data" in p)
    assert "train a classifier" not in line and "remove `data.mix`" in line, line


def test_bad_rows_name_the_dataset_and_the_row(tmp_path: Path, tokenizer) -> None:
    a = alpaca_file(tmp_path, 4)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                                  {"from": "gpt", "value": "yo"}]},
                                               {"conversations": [{"from": "martian", "value": "?"}]}])
    cfg = mixed(tmp_path, a, [{"source": str(bad), "format": "sharegpt"}])
    with pytest.raises(RecipeError, match=r"bad\.jsonl: 1 of the 2 rows cannot be used .*:\n  - "
                                          r"`data.mix\[0\].conversations_column`: row 2: message 1 has "
                                          r"the unknown role 'martian'"):
        prepare_data(cfg, tokenizer)
    missing = mixed(tmp_path, a, [{"source": str(bad), "format": "sharegpt", "conversations_column": "c"}])
    with pytest.raises(RecipeError, match=r"`data.mix\[0\].conversations_column`: is not a column"):
        prepare_data(missing, tokenizer)


def test_a_named_eval_split_needs_one_dataset_that_has_it(tmp_path: Path, tokenizer) -> None:
    a, s = alpaca_file(tmp_path, 4), sharegpt_file(tmp_path, 4)
    cfg = mixed(tmp_path, a, [{"source": str(s), "format": "sharegpt"}], eval_split="test")
    with pytest.raises(RecipeError, match=r"`data.eval_split`: is not a split of any of the mixed"):
        prepare_data(cfg, tokenizer)


@pytest.mark.slow
def test_training_on_mixed_packed_data(tmp_path: Path, tiny_text_file: Path) -> None:
    """text + sharegpt, packed: a short run, its startup table, the saved recipe and template."""
    from rich.console import Console

    from memtrain.run.train import train

    s = sharegpt_file(tmp_path, 40)
    recipe = causal_recipe(tmp_path, tiny_text_file, data={
        "format": "text", "packing": True, "max_length": 64, "chat_template": CHATML,
        "mix": [{"source": str(s), "format": "sharegpt", "weight": 2}]}, training={"max_steps": 2})
    cfg = load_recipe(recipe)
    console = Console(record=True, width=200)
    result = train(cfg, console=console)
    table = console.export_text()
    assert "2 datasets mixed (first_exhausted)" in table and "data.mix[0]" in table
    assert "weight 2 (66.7%)" in table and "real tokens fill" in table
    assert result.metrics["train_loss"] > 0 and result.output_dir.joinpath("adapter_config.json").is_file()
    saved = load_recipe(result.output_dir / "recipe.yaml")  # the resolved recipe reads back the same
    assert saved.data.datasets() == cfg.data.datasets()
    assert AutoTokenizer.from_pretrained(result.output_dir).chat_template == CHATML
