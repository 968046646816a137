"""Bad rows are reported together, in the order of the data, with a count; a conversation format
that does not match the data names the format that does, and that fix works (issue 35)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import causal_recipe, write_jsonl

from memtrain.config import RecipeError, load_recipe
from memtrain.config.data_section import SHAREGPT_ROLES
from memtrain.data.prepare import prepare_data

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
SHAREGPT = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
DEFAULT_ROLES = ", ".join(f"{name}: {role}" for name, role in SHAREGPT_ROLES.items())


def prepare(tmp_path: Path, rows: list[dict], tokenizer, overrides: list[str] = (), **data):
    f = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = load_recipe(causal_recipe(tmp_path, f, data={"eval_split": 0.0, "max_length": 64, **data}),
                      list(overrides))
    return prepare_data(cfg, tokenizer)


def message(tmp_path: Path, rows: list[dict], tokenizer, overrides: list[str] = (), **data) -> str:
    with pytest.raises(RecipeError) as err:
        prepare(tmp_path, rows, tokenizer, overrides, **data)
    return str(err.value)


def test_every_bad_row_is_named_in_order_with_a_count(tmp_path: Path, tokenizer) -> None:
    """The issue's case: 30 bad rows gave "1 problem: row 5" (the first one met after shuffling)."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(30)]
    text = message(tmp_path, rows, tokenizer, format="messages", eval_split=0.1)
    assert "rows.jsonl: 30 of the 30 rows cannot be used" in text  # the eval part counts too
    assert ("`data.messages_column`: rows 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 20 more: the conversation "
            "has no assistant message") in text
    assert text.count("\n  - ") == 1  # one kind of problem, one line


def test_different_problems_each_list_their_rows_in_order(tmp_path: Path, tokenizer) -> None:
    rows = [{"messages": CHAT} for _ in range(20)]
    for i in (17, 3, 11):  # rows 18, 4, 12: no assistant message
        rows[i] = {"messages": CHAT[:1]}
    rows[6] = {"messages": [{"role": "robot", "content": "beep"}, *CHAT]}  # row 7
    rows[14] = {"messages": []}  # row 15
    text = message(tmp_path, rows, tokenizer, format="messages", eval_split=0.25)
    assert "5 of the 20 rows cannot be used" in text
    lines = [line for line in text.splitlines() if line.startswith("  - ")]
    assert [re.search(r"`: (rows? [\d, and]+):", line).group(1) for line in lines] == [
        "rows 4, 12 and 18", "row 7", "row 15"]
    assert "unknown role 'robot'" in lines[1] and "conversation is empty" in lines[2]


@pytest.mark.parametrize(("fmt", "column", "turns", "key"), [
    ("messages", "messages", CHAT, "content"), ("sharegpt", "conversations", SHAREGPT, "value")])
def test_a_conversation_whose_answers_are_all_empty_is_a_bad_row(tmp_path: Path, tokenizer, fmt: str,
                                                                column: str, turns: list, key: str) -> None:
    """Only the end of each assistant turn would be trained (it was, silently). One empty answer
    among others is kept. Planted: the check off -> no error."""
    empty = [turns[0], {**turns[1], key: "  "}]
    rows = [{column: turns}] * 6 + [{column: empty}] + [{column: [*turns, *empty]}]
    text = message(tmp_path, rows, tokenizer, format=fmt)
    assert ("1 of the 8 rows cannot be used" in text and f"`data.{column}_column`: row 7: every "
            "assistant message is empty") in text, text
    kept = [r for r in rows if r[column] is not empty]
    assert len(prepare(tmp_path, kept, tokenizer, format=fmt).train) == 7


def test_more_kinds_of_problem_than_listed_are_counted(tmp_path: Path, tokenizer) -> None:
    from memtrain.data.formats import LISTED

    rows = [{"messages": [{"role": f"r{i}", "content": "x"}, *CHAT]} for i in range(LISTED + 3)]
    text = message(tmp_path, rows, tokenizer, format="messages")
    assert f"{LISTED + 3} of the {LISTED + 3} rows" in text
    assert text.splitlines()[-1] == f"  - and 3 more kinds of problem, in rows {LISTED + 1}, " \
        f"{LISTED + 2} and {LISTED + 3}"


def test_bad_preference_pairs_are_reported_together(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"} for _ in range(6)]
    rows[1]["rejected"] = rows[4]["rejected"] = {"not": "text"}
    f = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = load_recipe(causal_recipe(tmp_path, f, data={"format": "preference", "max_length": 64},
                                    training={"objective": "dpo"}))
    with pytest.raises(RecipeError, match=r"2 of the 6 rows cannot be used.*\n  - `data.rejected_column`: "
                                          r"rows 2 and 5: expected text, found dict"):
        prepare_data(cfg, tokenizer)


def applied(fix: str) -> list[str]:
    """The recipe settings a fix names (`data.key: value`), as overrides."""
    return [f"{key}={value}" for key, value in re.findall(r"`(data[\w.\[\]]*): ([^`]+)`", fix)]


@pytest.mark.parametrize(("rows", "data", "names"), [
    # the issue's case: ShareGPT rows read as messages; the old fix (messages_column) led to another error
    ([{"conversations": SHAREGPT}], {"format": "messages"}, ["data.format=sharegpt"]),
    # ... under another column name: the format and the column
    ([{"dialog": SHAREGPT}], {"format": "messages"}, ["data.format=sharegpt",
                                                      "data.conversations_column=dialog"]),
    # the old fix taken: the column is found, its turns are ShareGPT's
    ([{"conversations": SHAREGPT}], {"format": "messages", "messages_column": "conversations"},
     ["data.format=sharegpt"]),
    # the other way round
    ([{"messages": CHAT}], {"format": "sharegpt"}, ["data.format=messages"]),
    ([{"conversations": CHAT}], {"format": "sharegpt"}, ["data.format=messages",
                                                         "data.messages_column=conversations"]),
    # the right format, another column: only the column
    ([{"dialog": CHAT}], {"format": "messages"}, ["data.messages_column=dialog"]),
    # an unknown ShareGPT name: `sharegpt_roles` replaces the default mapping, so the fix keeps all of
    # it (other rows use its names: `human` alone was kept, from this row, and the next row failed)
    ([{"conversations": [SHAREGPT[0], {"from": "robot", "value": "beep"}]}], {"format": "sharegpt"},
     [f"data.sharegpt_roles={{{DEFAULT_ROLES}, robot: assistant}}"]),
    # names of their own, each mapped by its place (USER was mapped to the assistant)
    ([{"conversations": [{"from": "USER", "value": "hi"}, {"from": "BOT", "value": "beep"}]}],
     {"format": "sharegpt"}, [f"data.sharegpt_roles={{{DEFAULT_ROLES}, USER: user, BOT: assistant}}"]),
])
def test_a_conversation_format_fix_names_what_works(tmp_path: Path, tokenizer, rows, data, names) -> None:
    text = message(tmp_path, rows * 3, tokenizer, **data)
    fix = text.split("Fix: ", 1)[1]
    assert applied(fix) == names, text
    assert len(prepare(tmp_path, rows * 3, tokenizer, applied(fix), **data).train) == 3  # it works


GRPO = ["training.objective=grpo", "training.grpo_rewards=[format]", "training.grpo_num_generations=2"]


def test_every_bad_grpo_prompt_is_named_at_once_in_the_order_of_the_data(tmp_path: Path, tokenizer) -> None:
    """Every kind of bad prompt, in both splits, in one message, each kind with its fix; the shape
    most prompts have is asked of all. It named one row per run (nulls first, then one shape
    problem, met in shuffled order) against the shape of whichever row came first."""
    rows = [{"prompt": f"line {i}", "answer": "x"} for i in range(20)]
    rows[0]["prompt"], rows[11]["prompt"] = CHAT[:1], CHAT  # another shape
    rows[2]["prompt"], rows[5]["prompt"], rows[8]["prompt"] = None, "  ", []  # empty
    text = " ".join(message(tmp_path, rows, tokenizer, GRPO, format="prompt", eval_split=0.25).split())
    assert ("`data.prompt_column`: rows 1 and 12 of 20: expected a string, as most prompts are (row 1 holds "
            "list") in text
    assert "Fix: store every prompt the same way: all strings, or all message lists." in text
    assert ("`data.prompt_column`: rows 3, 6 and 9 of 20: the prompt is empty (row 3 holds NoneType None), "
            "got 'prompt'. Fix: fill in or remove those rows.") in text, text


def test_conversational_prompts_name_messages_without_a_role(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": CHAT[:1], "answer": "x"} for _ in range(6)]
    rows[4]["prompt"] = [{"content": "hi"}]
    text = " ".join(message(tmp_path, rows, tokenizer, GRPO, format="prompt").split())
    assert ("`data.prompt_column`: row 5 of 6: a message has no `role` or no `content` (row 5 holds list "
            "[{'content': 'hi'}]), got 'prompt'. Fix: give every message both.") in text


@pytest.mark.parametrize(("column", "said"), [
    ("title", "`training.grpo_answer_column`: is not a column of the data (the `exact_answer` reward "
              "compares each completion with it), got 'title'. Fix: set it to the column holding the "
              "answers; the data has: answer."),
    ("answer", "`training.grpo_answer_column`: rows 3 and 7 (in the order of the data) hold no answer, got "
               "'answer'. Fix: fill in or remove those rows"),
])
def test_the_exact_answer_column_must_be_there_and_filled_in(tmp_path: Path, tokenizer, column: str,
                                                              said: str) -> None:
    """A wrong column got the fix for a user's own reward function ("take **kwargs"); empty answers
    were scored against "None"."""
    rows = [{"prompt": f"line {i}", "answer": "x"} for i in range(10)]
    rows[2]["answer"], rows[6]["answer"] = None, " "
    grpo = [GRPO[0], "training.grpo_rewards=[exact_answer]", GRPO[2], f"training.grpo_answer_column={column}"]
    text = message(tmp_path, rows, tokenizer, grpo, format="prompt", eval_split=0.2)
    assert said in " ".join(text.split()), text


def test_text_is_text_a_list_is_refused_and_content_parts_are_joined(tmp_path: Path, tokenizer) -> None:
    """A list where text belongs was trained as its Python repr (`['a', 'b']`), silently; it is a
    bad row now, in every format that reads text. OpenAI-style content parts of text are the
    message's text (`[{"type": "text", "text": "hello back"}]` trained as that list's repr)."""
    hi = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    parts = [{"role": "user", "content": hi},
             {"role": "assistant", "content": [{"type": "text", "text": "hello back"}]}]
    data = prepare(tmp_path, [{"messages": parts}], tokenizer, format="messages")
    text = tokenizer.decode(data.train[0]["input_ids"])
    assert "hi there" in text and "hello back" in text and "type" not in text, text
    listed = message(tmp_path, [{"text": ["a", "b"]}, {"text": "fine"}], tokenizer, format="text")
    assert "`data.text_column`: row 1: expected text, found list" in listed, listed
    turns = [SHAREGPT[0], {"from": "gpt", "value": ["x", "y"]}]
    listed = message(tmp_path, [{"conversations": turns}], tokenizer, format="sharegpt")
    assert "row 1: message 2's `value` is a list, not text" in listed, listed
    image = [CHAT[0], {"role": "assistant", "content": [{"type": "image", "url": "x.png"}]}]
    assert "message 2's `content` is a list" in message(tmp_path, [{"messages": image}], tokenizer,
                                                          format="messages")


def test_blank_text_rows_are_dropped_and_said_so(tmp_path: Path, tokenizer, caplog) -> None:
    """Blank lines of a .txt file (and `{"text": ""}`) were examples of the closing token alone:
    steps of loss 0 that diluted the reported loss. They are dropped, with a count; all blank is a
    recipe problem."""
    import logging

    with caplog.at_level(logging.WARNING):
        data = prepare(tmp_path, [{"text": "line one"}, {"text": ""}, {"text": "  "}, {"text": "line two"}],
                       tokenizer, format="text")
    assert len(data.train) == 2 and "dropped 2 blank rows" in caplog.text
    assert "`data.text_column`" in message(tmp_path, [{"text": ""}], tokenizer, format="text")


def test_a_conversation_that_starts_with_the_answer_is_a_bad_row(tmp_path: Path, tokenizer) -> None:
    """It crashed in the chat template ("Cannot apply chat template to an empty conversation",
    exit 1); a system message first is a prompt, and trains."""
    first = [{"from": "gpt", "value": "hello"}, *SHAREGPT]
    text = message(tmp_path, [{"conversations": first}, {"conversations": SHAREGPT}], tokenizer,
                   format="sharegpt")
    assert "`data.conversations_column`: row 1: the conversation starts with an assistant message" in text
    system = [{"from": "system", "value": "be brief"}, {"from": "gpt", "value": "hello"}, *SHAREGPT]
    assert len(prepare(tmp_path, [{"conversations": system}], tokenizer, format="sharegpt").train) == 1


def test_token_ids_outside_the_vocabulary_are_bad_rows(tmp_path: Path, tokenizer) -> None:
    """They passed `validate --data` and crashed the embedding lookup in training (IndexError)."""
    rows = [{"input_ids": [101, len(tokenizer), 102]}, {"input_ids": [101, 7, 102]}, {"input_ids": [-5, 102]}]
    text = message(tmp_path, rows, tokenizer, format="tokenized")
    assert "2 of the 3 rows cannot be used" in text, text
    assert f"row 1: `input_ids` holds {len(tokenizer)}, not a token" in text, text
    assert "row 3: `input_ids` holds -5" in text, text


def test_a_dropped_example_says_why(tmp_path: Path, tokenizer, caplog) -> None:
    """A tokenized row whose labels are all -100 was "dropped ... with no answer tokens left after
    data.max_length", though its length was not the cause."""
    import logging

    rows = [{"input_ids": [101, 7, 8, 102], "labels": [-100] * 4}, {"input_ids": [101, 9, 102]}]
    with caplog.at_level(logging.WARNING):
        data = prepare(tmp_path, rows, tokenizer, format="tokenized")
    assert len(data.train) == 1 and "1 with every label -100" in caplog.text, caplog.text
    assert "cut at data.max_length" not in caplog.text
