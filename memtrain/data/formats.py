"""What one row of each causal data format means, before any tokenizer is involved.

Each reader turns a raw row into one of two shapes: a *prompt and response* pair of strings
(``completion``, ``alpaca``) or a *conversation*, a list of ``{"role", "content"}`` messages
(``sharegpt``, ``messages``). Tokenizing and masking are the same for every format of a shape
(:mod:`memtrain.data.chat`), so the formats differ only here.

A bad row raises :class:`RowError`, which names the row (counting from 1, as the lines of a JSONL
file), the recipe field of the column and what is wrong with it. The encoders catch it row by row
(:func:`RowError.record`) so that every bad row is reported at once, in the order of the data, by
one :class:`BadRows` error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from memtrain.config import DataConfig, Problem, RecipeError

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]
ROW = "_row"  # hidden column: the row's number in the split as loaded (before shuffling)
PROBLEM = "_problem"  # hidden column of encoded rows: a bad row's RowError.record(), "" for a good row
LISTED = 10  # rows named per kind of problem, and kinds of problem listed; the others are counted


class RowError(RecipeError):
    """One row of the data cannot be used; the message names the row, the column and the fix."""

    def __init__(self, cfg: DataConfig, row: int, field: str, message: str, fix: str) -> None:
        column = getattr(cfg, field)
        super().__init__([Problem(cfg.key(field), column, f"row {row}: {message}", fix)], cfg.source)
        self.row = row
        self._parts = {"row": row, "path": cfg.key(field), "value": column, "message": message,
                       "fix": fix}

    def record(self) -> str:
        """The problem as one JSON string, kept in the :data:`PROBLEM` column of the encoded rows."""
        return json.dumps(self._parts, default=str)


class BadRows(RecipeError):
    """Every row of a dataset that cannot be used, grouped by problem, each group in the order of
    the data with a count (at most :data:`LISTED` row numbers and groups are named)."""

    def __init__(self, cfg: DataConfig, records: Sequence[tuple[str | None, str]], used: int) -> None:
        """``records``: (the name of a named evaluation split or None, :meth:`RowError.record`);
        ``used``: how many rows were read."""
        found = sorted(((split or "", json.loads(r)) for split, r in records),
                       key=lambda f: (f[0], f[1]["row"]))
        groups: dict[tuple[Any, ...], list[int]] = {}
        for split, f in found:
            key = (split, f["path"], json.dumps(f["value"]), f["message"], f["fix"])
            groups.setdefault(key, []).append(f["row"])
        problems = [Problem(path, json.loads(value), f"{row_numbers(split, rows)}: {message}", fix)
                    for (split, path, value, message, fix), rows in groups.items()]
        super().__init__(problems[:LISTED], cfg.source)
        lines = [f"  - {p}" for p in problems[:LISTED]]
        if len(problems) > LISTED:
            rest = sorted(row for rows in list(groups.values())[LISTED:] for row in rows)
            more = len(problems) - LISTED
            lines.append(f"  - and {more} more kinds of problem, in {row_numbers('', rest)}")
        self.problems, self.count = problems, len(found)
        self.args = (f"{cfg.source}: {len(found)} of the {used} rows cannot be used (rows count from "
                     "1, in the order of the data):\n" + "\n".join(lines),)


def row_numbers(split: str, rows: Sequence[int]) -> str:
    """``row 5``, ``rows 1, 2 and 3`` or ``rows 1, ..., 10 and 20 more`` (of a named split)."""
    where = f"{split} " if split else ""
    if len(rows) == 1:
        return f"{where}row {rows[0]}"
    shown = ", ".join(map(str, rows[:LISTED]))
    if len(rows) <= LISTED:
        shown = shown.rsplit(", ", 1)[0] + f" and {rows[-1]}"
    else:
        shown += f" and {len(rows) - LISTED} more"
    return f"{where}rows {shown}"


def column_text(cfg: DataConfig, row: Mapping[str, Any], field: str, *, optional: bool = False) -> str:
    """The text in the column that the recipe field ``field`` names (numbers as text); an empty
    column is ``""`` when ``optional``, else a :class:`RowError`, as is anything but text."""
    value = row.get(getattr(cfg, field))
    if value is None:
        if optional:
            return ""
        raise RowError(cfg, row[ROW], field, "the column is empty (null)",
                       "fill it in or remove the row.")
    if not isinstance(value, str | int | float):
        raise RowError(cfg, row[ROW], field, f"expected text, found {type(value).__name__}",
                       "make the column hold strings.")
    return str(value)


def fill_template(template: str, **values: str) -> str:
    """``template`` with each ``{name}`` of ``values`` replaced by its value, in one pass: a value's
    own text is never filled in again (an instruction quoting ``print(f"{input}")`` keeps it, where
    chained ``str.replace`` calls put the row's input there)."""
    names = "|".join(re.escape(name) for name in values)
    return re.sub(r"\{(" + names + r")\}", lambda m: values[m.group(1)], template)


def completion_pair(cfg: DataConfig, row: Mapping[str, Any]) -> tuple[str, str]:
    """``(prompt text, response text)`` of a completion row, the prompt in ``completion_template``."""
    prompt = column_text(cfg, row, "prompt_column")
    return fill_template(cfg.completion_template, prompt=prompt), column_text(cfg, row, "response_column")


def alpaca_pair(cfg: DataConfig, row: Mapping[str, Any]) -> tuple[str, str]:
    """``(prompt text, response text)`` of an alpaca row; the input appears only when non-empty."""
    instruction = column_text(cfg, row, "instruction_column")
    extra = column_text(cfg, row, "input_column", optional=True).strip()
    template = cfg.alpaca_template if extra else cfg.alpaca_template_no_input
    prompt = fill_template(template, instruction=instruction, input=extra)
    return prompt, column_text(cfg, row, "output_column")


def _turns(cfg: DataConfig, row: Mapping[str, Any], field: str) -> list[Any]:
    turns = row.get(getattr(cfg, field))
    if turns is None or (isinstance(turns, list) and not turns):
        raise RowError(cfg, row[ROW], field, "the conversation is empty",
                       "give every row at least one message, or remove the row.")
    if not isinstance(turns, list):
        raise RowError(cfg, row[ROW], field, f"expected a list of messages, found "
                       f"{type(turns).__name__}", "store each conversation as a list of objects.")
    return turns


def read_message(cfg: DataConfig, row: Mapping[str, Any], field: str, index: int, turn: Any,
                 keys: tuple[str, str], roles: Mapping[str, str] | None) -> Message:
    """Message ``index`` of a row's conversation as ``{"role", "content"}``: ``keys`` name its role
    and content keys, ``roles`` maps the row's role names (None: they must be :data:`ROLES`). A
    message without them, or with an unknown role, is a :class:`RowError` with the fix."""
    role_key, content_key = keys
    where = f"message {index + 1}"
    if not isinstance(turn, Mapping) or turn.get(role_key) is None:
        other = turn_shape(turn) if cfg.kind in CONVERSATION_KEYS else None
        fix = (format_fix(cfg, other, getattr(cfg, field)) if other not in (None, cfg.kind) else
               f"give every message a `{role_key}` and a `{content_key}`.")
        raise RowError(cfg, row[ROW], field, f"{where} has no `{role_key}`", fix)
    name = str(turn[role_key])
    role = roles.get(name) if roles is not None else (name if name in ROLES else None)
    if role is None:
        known = ", ".join(roles or ROLES)
        fix = _roles_fix(cfg, row.get(getattr(cfg, field)), name, roles) if roles is not None else \
            f"use one of {known}."
        raise RowError(cfg, row[ROW], field, f"{where} has the unknown role {name!r} "
                       f"(known: {known})", fix)
    content = turn.get(content_key)
    if content is None:
        raise RowError(cfg, row[ROW], field, f"{where} has no `{content_key}`",
                       f"give every message a `{content_key}`.")
    if isinstance(content, list) and content and all(_text_part(p) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI's content parts, text only: joined
    if not isinstance(content, str | int | float) or isinstance(content, bool):
        raise RowError(cfg, row[ROW], field, f"{where}'s `{content_key}` is a {type(content).__name__}, "
                       "not text", f"write each message's `{content_key}` as a string (or a list of "
                       '`{"type": "text", "text": ...}` parts).')
    return {"role": role, "content": str(content)}


def _text_part(part: Any) -> bool:
    """``part`` is an OpenAI-style text content part, ``{"type": "text", "text": "..."}``."""
    return isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _roles_fix(cfg: DataConfig, turns: Any, name: str, roles: Mapping[str, str]) -> str:
    """A ``data.sharegpt_roles`` that reads this row: it replaces the mapping in use, so every name
    of that mapping is kept (other rows use them too), and each unknown name of the row is mapped by
    its place (turns alternate, user first: `USER`/`BOT` -> user/assistant)."""
    mapping, turn = dict(roles), 0
    for t in turns if isinstance(turns, list) else []:
        if isinstance(t, Mapping) and t.get("from") is not None:
            role = mapping.setdefault(str(t["from"]), "user" if turn % 2 == 0 else "assistant")
            turn += role != "system"
    key = cfg.key("sharegpt_roles")
    return (f"map {name!r} to user, assistant, system or tool in `{key}`; that mapping replaces the "
            "one in use, so keep the names the data uses, e.g. "
            f"`{key}: {{{', '.join(f'{n}: {r}' for n, r in mapping.items())}}}`.")


def _conversation(cfg: DataConfig, row: Mapping[str, Any], field: str, keys: tuple[str, str],
                  roles: Mapping[str, str] | None) -> list[Message]:
    messages = [read_message(cfg, row, field, i, t, keys, roles)
                for i, t in enumerate(_turns(cfg, row, field))]
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(cfg, row[ROW], field, "the conversation has no assistant message, so nothing "
                       "would be trained", "add the answer, or remove the row.")
    if not any(str(m["content"]).strip() for m in messages if m["role"] == "assistant"):
        raise RowError(cfg, row[ROW], field, "every assistant message is empty, so only the end of a "
                       "turn would be trained", "add the answer, or remove the row.")
    if messages[0]["role"] == "assistant":  # a chat template renders no prompt of nothing to answer
        raise RowError(cfg, row[ROW], field, "the conversation starts with an assistant message, "
                       "which answers nothing", "start it with a user (or system) message, or remove "
                       "the row.")
    return messages


def messages_conversation(cfg: DataConfig, row: Mapping[str, Any]) -> list[Message]:
    """The OpenAI-style ``{role, content}`` messages of a row."""
    return _conversation(cfg, row, "messages_column", ("role", "content"), None)


def sharegpt_conversation(cfg: DataConfig, row: Mapping[str, Any]) -> list[Message]:
    """ShareGPT ``{from, value}`` turns as ``{role, content}`` messages (``data.sharegpt_roles``)."""
    return _conversation(cfg, row, "conversations_column", ("from", "value"), cfg.sharegpt_roles)


# the keys of one turn, per conversation format
CONVERSATION_KEYS: dict[str, tuple[str, str]] = {"messages": ("role", "content"),
                                                 "sharegpt": ("from", "value")}
_COLUMN_FIELD = {"messages": "messages_column", "sharegpt": "conversations_column"}
_STYLE = {"messages": "OpenAI-style", "sharegpt": "ShareGPT"}


def turn_shape(turn: Any) -> str | None:
    """The conversation format one turn is written in (``messages``: role/content, ``sharegpt``:
    from/value), or None."""
    if isinstance(turn, Mapping):
        for kind, keys in CONVERSATION_KEYS.items():
            if all(k in turn for k in keys):
                return kind
    return None


def column_shape(value: Any) -> str | None:
    """The conversation format a column value is written in (a list of turns), or None."""
    if isinstance(value, list) and value:
        return turn_shape(value[0])
    return None


def format_fix(cfg: DataConfig, kind: str, column: str) -> str:
    """The fix for conversations of format ``kind`` stored in ``column`` but read as another
    format: the format, and the column when the format's default column is not it."""
    keys = CONVERSATION_KEYS[kind]
    field = _COLUMN_FIELD[kind]
    fix = (f"`{column}` holds {_STYLE[kind]} conversations (`{keys[0]}`/`{keys[1]}` turns): set "
           f"`{cfg.key('format')}: {kind}`")
    if getattr(cfg, field) != column:
        fix += f" and `{cfg.key(field)}: {column}`"
    return fix + "."


def missing_column_fix(cfg: DataConfig, field: str, row: Mapping[str, Any]) -> str | None:
    """When a conversation format's column is missing: the fix that reads the conversations the
    row does hold (another column, or another format), else None."""
    if cfg.kind not in CONVERSATION_KEYS or field != _COLUMN_FIELD[cfg.kind]:
        return None
    for column, value in row.items():
        kind = column_shape(value)
        if kind == cfg.kind:
            return f"the conversations are in `{column}`: set `{cfg.key(field)}: {column}`."
        if kind is not None:
            return format_fix(cfg, kind, column)
    return None


PAIR_READERS: dict[str, Callable[[DataConfig, Mapping[str, Any]], tuple[str, str]]] = {
    "completion": completion_pair,
    "alpaca": alpaca_pair,
}
CONVERSATION_READERS: dict[str, Callable[[DataConfig, Mapping[str, Any]], list[Message]]] = {
    "messages": messages_conversation,
    "sharegpt": sharegpt_conversation,
}
# columns that must exist, per format (the fields of DataConfig naming them)
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("text_column",),
    "classification": ("text_column", "label_column"),
    "completion": ("prompt_column", "response_column"),
    "alpaca": ("instruction_column", "output_column"),
    "messages": ("messages_column",),
    "sharegpt": ("conversations_column",),
    "tokenized": (),
    "preference": ("prompt_column", "chosen_column", "rejected_column"),
    "prompt": ("prompt_column",),
}
