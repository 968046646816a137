"""Preference pairs (``data.format: preference``): exact answer masks, mapped columns, clear errors.

The answer tokens are checked against the answer tokenized on its own (plain rows) or against the
chat template's text (conversations), through TRL's collator: ``completion_mask`` must mark exactly
those tokens, for the chosen and the rejected sequence, and nothing of the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import causal_recipe, merge

from memtrain.config import RecipeError, load_recipe
from memtrain.data.prepare import prepare_data

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _prepare(tmp_path: Path, rows: list[dict], tokenizer: Any, **data: Any) -> Any:
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    recipe = causal_recipe(tmp_path, path, **merge({"data": {"format": "preference", "max_length": 64},
                                                    "training": {"objective": "dpo"}}, {"data": data}))
    cfg = load_recipe(recipe)
    return cfg, prepare_data(cfg, tokenizer)


def _answers(batch: dict, row: int) -> list[int]:
    """The token ids ``completion_mask`` marks in one collated row."""
    ids, mask = batch["input_ids"][row], batch["completion_mask"][row]
    return [int(t) for t, m in zip(ids, mask, strict=True) if m]


def test_plain_pairs_mark_exactly_the_answers(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"question": "the cat sat on", "good": " the mat", "bad": " a red dog today"},
            {"question": "a dog", "good": " ran", "bad": " sat down"}]
    cfg, data = _prepare(tmp_path, rows, tokenizer, prompt_column="question", chosen_column="good",
                         rejected_column="bad", eval_split=0.0)
    by_prompt = {tokenizer.decode(r["prompt_ids"], skip_special_tokens=True): r for r in data.train}
    assert set(by_prompt) == {"the cat sat on", "a dog"}
    sep = tokenizer.sep_token_id
    for source in rows:
        pair = by_prompt[source["question"]]
        assert pair["prompt_ids"] == tokenizer(source["question"])["input_ids"][:-1]  # [CLS] + prompt
        batch = data.collator([pair])  # [chosen; rejected]
        for row, answer in ((0, source["good"]), (1, source["bad"])):
            assert _answers(batch, row) == tokenizer(answer, add_special_tokens=False)["input_ids"] + [sep]
    rows_seen = data.rows(cfg)  # the estimate's batch: the longest sequence, prompt + answer
    assert rows_seen.longest == 1 + 4 + 4 + 1 and not rows_seen.uniform


def test_conversations_mark_the_rendered_assistant_turn(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a pet"}],
             "chosen": [{"role": "assistant", "content": "a cat"}],
             "rejected": "a rock"}]  # a string answer is one assistant message
    _, data = _prepare(tmp_path, rows, tokenizer, chat_template=CHATML, eval_split=0.0)
    pair = data.train[0]
    prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nname a pet<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert pair["prompt_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    batch = data.collator([pair])
    for row, content in ((0, "a cat"), (1, "a rock")):
        expected = tokenizer(f"{content}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        assert _answers(batch, row) == expected
    assert tokenizer.chat_template == CHATML  # saved with the run, for `memtrain generate`


def test_pairs_of_both_shapes_all_render_as_conversations(tmp_path: Path, tokenizer: Any,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A message list anywhere makes every pair, in every split, a conversation (a string is one
    message), said once. It was decided by each split's first row after shuffling: a plain first
    row refused the others with "expected text, found list", and the two splits could render
    differently."""
    chat = {"prompt": [{"role": "user", "content": "name a pet"}], "chosen": "a cat", "rejected": "a rock"}
    rows = [{"prompt": f"line {i}", "chosen": " yes", "rejected": " no"} for i in range(9)] + [chat]
    with caplog.at_level("WARNING", logger="memtrain.data.prepare"):
        _, data = _prepare(tmp_path, rows, tokenizer, chat_template=CHATML, eval_split=0.5)
    start = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    pairs = list(data.train) + list(data.eval)
    assert len(pairs) == 10 and all(p["prompt_ids"][:len(start)] == start for p in pairs)
    said = [r.getMessage() for r in caplog.records if "preference pairs hold only strings" in r.getMessage()]
    assert said == ["9 of the 10 preference pairs hold only strings while the others hold message lists: "
                    "each of their strings is read as one message and rendered with the chat template"]


def test_pairs_whose_prompt_merges_into_the_answer_are_said_once_in_order(
        tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """"the ca" + "t sat" tokenizes "cat" across the prompt's end, and "car" differs from it: those
    tokens count as the answer's. One warning names the rows in the order of the data (it was one
    warning per row, in shuffled order)."""
    rows = [{"prompt": "the dog", "chosen": " sat", "rejected": " went"} for _ in range(6)]
    for i in (5, 1, 3):
        rows[i] = {"prompt": "the ca", "chosen": "t sat", "rejected": "r went"}
    with caplog.at_level("WARNING", logger="memtrain.data.prepare"):
        _, data = _prepare(tmp_path, rows, tokenizer, eval_split=0.0)
    said = [r.getMessage() for r in caplog.records if "merged" in r.getMessage()]
    assert said == ["rows 2, 4 and 6: the prompt's last tokens differ between the chosen and the rejected "
                    "sequence (tokens merged across the prompt's end); they count as answer tokens"]
    merged = [p for p in data.train if tokenizer.decode(p["chosen_ids"]).startswith("cat")]
    assert len(merged) == 3 and set(data.train.column_names) == {"prompt_ids", "chosen_ids", "rejected_ids"}


def test_a_missing_answer_names_its_column(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"prompt": "a", "chosen": "b", "rejected": None}, {"prompt": "c", "chosen": "d", "rejected": "e"}]
    with pytest.raises(RecipeError) as err:
        _prepare(tmp_path, rows, tokenizer, eval_split=0.0)
    assert "data.rejected_column" in str(err.value) and "row 1" in str(err.value)


@pytest.mark.parametrize("conversational", [False, True])
def test_an_empty_answer_is_a_bad_row_and_a_tie_is_dropped_with_a_count(
        conversational: bool, tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An empty answer trained the prompt and the end token as the answer; a pair whose rejected
    answer is the chosen one has no gradient and a constant loss. Planted: either check off -> fails."""
    import logging

    def pair(prompt: str, chosen: str, rejected: str) -> dict:
        if not conversational:
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        return {"prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}

    extra = {"chat_template": CHATML} if conversational else {}
    good = [pair(f"q{i}", f"good {i}", f"bad {i}") for i in range(4)]
    with pytest.raises(RecipeError) as err:
        _prepare(tmp_path, [*good, pair("q", " ", "bad")], tokenizer, eval_split=0.0, **extra)
    assert "data.chosen_column" in str(err.value) and "row 5: the answer is empty" in str(err.value)
    with caplog.at_level(logging.WARNING):
        _, data = _prepare(tmp_path, [*good, pair("q", "same", "same")], tokenizer, eval_split=0.0, **extra)
    assert len(data.train) == 4 and "dropped 1 pairs whose rejected answer is the chosen one" in caplog.text
    with pytest.raises(RecipeError, match="every pair's rejected answer is its chosen one"):
        _prepare(tmp_path, [pair("q", "same", "same")] * 3, tokenizer, eval_split=0.0, **extra)


@pytest.mark.parametrize(("sections", "field"), [
    ({"training": {"objective": "dpo"}, "data": {"format": "completion"}}, "training.objective"),
    ({"training": {"objective": "sft"}, "data": {"format": "preference"}}, "data.format"),
    ({"training": {"objective": "dpo"}, "data": {"format": "preference"}, "memory": {"loss": "chunked"}},
     "memory.loss"),
    ({"training": {"objective": "dpo", "dpo_loss": "aot"}, "data": {"format": "preference"}},
     "training.dpo_loss"),
    ({"training": {"objective": "dpo"}, "data": {"format": "preference"}, "adapter": {"method": "full"}},
     "adapter.method"),
])
def test_objective_and_format_must_agree(tmp_path: Path, sections: dict, field: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}))
    with pytest.raises(RecipeError) as err:
        load_recipe(causal_recipe(tmp_path, path, **sections))
    assert field in str(err.value)


def test_the_shakespeare_pairs_prefer_the_next_line_to_its_words_shuffled() -> None:
    from memtrain.builtin_data import BUILTINS

    ds = BUILTINS["shakespeare-preference"](0)
    assert len(ds) > 5000 and ds.column_names == ["prompt", "chosen", "rejected"]
    for row in ds.select(range(200)):
        assert row["prompt"].endswith("\n") and row["chosen"] != row["rejected"]
        assert sorted(row["chosen"].split()) == sorted(row["rejected"].split())  # same words, other order
    assert BUILTINS["shakespeare-preference"](0)[:5] == ds[:5]  # deterministic for a seed


def test_without_trl_a_dpo_recipe_says_how_to_install_it(tmp_path: Path, tokenizer: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    from memtrain.errors import MemtrainError

    for name in ("trl", "trl.trainer.dpo_trainer"):
        monkeypatch.setitem(sys.modules, name, None)  # `import trl` raises ImportError
    monkeypatch.delitem(sys.modules, "memtrain.trainer.preference", raising=False)
    with pytest.raises(MemtrainError, match=r"pip install 'trl>=1.16'"):
        _prepare(tmp_path, [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2, tokenizer, eval_split=0.0)
    with pytest.raises(MemtrainError, match=r"pip install 'trl>=1.16'"):
        importlib.import_module("memtrain.trainer.preference")


@pytest.mark.parametrize("conversational", [True, False])
def test_generate_writes_prompts_as_the_pairs_were(conversational: bool, tmp_path: Path,
                                                    tokenizer: Any) -> None:
    from memtrain.run.inference import Run, format_prompt

    rows = ([{"prompt": [{"role": "user", "content": "name a pet"}], "chosen": "a cat", "rejected": "a rock"}]
            if conversational else [{"prompt": "name a pet", "chosen": " a cat", "rejected": " a rock"}]) * 2
    cfg, _ = _prepare(tmp_path, rows, tokenizer, chat_template=CHATML, eval_split=0.0)
    run = Run(tmp_path, cfg, tokenizer, None, True)
    ids = format_prompt(run, "name a pet")
    if conversational:  # the chat template with the generation prompt, as the pairs were rendered
        chat = "<|im_start|>user\nname a pet<|im_end|>\n<|im_start|>assistant\n"
        assert ids == tokenizer(chat, add_special_tokens=False)["input_ids"], tokenizer.decode(ids)
    else:  # the text as it is ([CLS] + prompt, without the closing token)
        assert ids == tokenizer("name a pet")["input_ids"][:-1], tokenizer.decode(ids)
