"""What one row of each causal data format means, before any tokenizer is involved.

Each reader turns a raw row into one of two shapes: a *prompt and response* pair of strings
(``completion``, ``alpaca``) or a *conversation*, a list of ``{"role", "content"}`` messages
(``sharegpt``, ``messages``). Tokenizing and masking are the same for every format of a shape
(:mod:`memtrain.data.chat`), so the formats differ only here.

A bad row raises :class:`RowError`, which names the row (counting from 1, as the lines of a JSONL
file), the recipe field of the column and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memtrain.config import DataConfig, Problem, RecipeError

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]
ROW = "_row"  # hidden column: the row's number in the split as loaded (before shuffling)


class RowError(RecipeError):
    """One row of the data cannot be used; the message names the row, the column and the fix."""

    def __init__(self, cfg: DataConfig, row: int, field: str, message: str, fix: str) -> None:
        column = getattr(cfg, field)
        super().__init__([Problem(cfg.key(field), column, f"row {row}: {message}", fix)], cfg.source)
        self.row = row


def _text(cfg: DataConfig, row: Mapping[str, Any], field: str, *, optional: bool = False) -> str:
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


def completion_pair(cfg: DataConfig, row: Mapping[str, Any]) -> tuple[str, str]:
    """``(prompt text, response text)`` of a completion row, the prompt in ``completion_template``."""
    prompt = _text(cfg, row, "prompt_column")
    return cfg.completion_template.replace("{prompt}", prompt), _text(cfg, row, "response_column")


def alpaca_pair(cfg: DataConfig, row: Mapping[str, Any]) -> tuple[str, str]:
    """``(prompt text, response text)`` of an alpaca row; the input appears only when non-empty."""
    instruction = _text(cfg, row, "instruction_column")
    extra = _text(cfg, row, "input_column", optional=True).strip()
    template = cfg.alpaca_template if extra else cfg.alpaca_template_no_input
    prompt = template.replace("{instruction}", instruction).replace("{input}", extra)
    return prompt, _text(cfg, row, "output_column")


def _turns(cfg: DataConfig, row: Mapping[str, Any], field: str) -> list[Any]:
    turns = row.get(getattr(cfg, field))
    if turns is None or (isinstance(turns, list) and not turns):
        raise RowError(cfg, row[ROW], field, "the conversation is empty",
                       "give every row at least one message, or remove the row.")
    if not isinstance(turns, list):
        raise RowError(cfg, row[ROW], field, f"expected a list of messages, found "
                       f"{type(turns).__name__}", "store each conversation as a list of objects.")
    return turns


def _message(cfg: DataConfig, row: Mapping[str, Any], field: str, index: int, turn: Any,
             keys: tuple[str, str], roles: Mapping[str, str] | None) -> Message:
    role_key, content_key = keys
    where = f"message {index + 1}"
    if not isinstance(turn, Mapping) or turn.get(role_key) is None:
        raise RowError(cfg, row[ROW], field, f"{where} has no `{role_key}`",
                       f"give every message a `{role_key}` and a `{content_key}`.")
    name = str(turn[role_key])
    role = roles.get(name) if roles is not None else (name if name in ROLES else None)
    if role is None:
        known = ", ".join(roles or ROLES)
        fix = ("add it to `data.sharegpt_roles`." if roles is not None else f"use one of {known}.")
        raise RowError(cfg, row[ROW], field, f"{where} has the unknown role {name!r} "
                       f"(known: {known})", fix)
    content = turn.get(content_key)
    if content is None:
        raise RowError(cfg, row[ROW], field, f"{where} has no `{content_key}`",
                       f"give every message a `{content_key}`.")
    return {"role": role, "content": str(content)}


def _conversation(cfg: DataConfig, row: Mapping[str, Any], field: str, keys: tuple[str, str],
                  roles: Mapping[str, str] | None) -> list[Message]:
    messages = [_message(cfg, row, field, i, t, keys, roles)
                for i, t in enumerate(_turns(cfg, row, field))]
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(cfg, row[ROW], field, "the conversation has no assistant message, so nothing "
                       "would be trained", "add the answer, or remove the row.")
    return messages


def messages_conversation(cfg: DataConfig, row: Mapping[str, Any]) -> list[Message]:
    """The OpenAI-style ``{role, content}`` messages of a row."""
    return _conversation(cfg, row, "messages_column", ("role", "content"), None)


def sharegpt_conversation(cfg: DataConfig, row: Mapping[str, Any]) -> list[Message]:
    """ShareGPT ``{from, value}`` turns as ``{role, content}`` messages (``data.sharegpt_roles``)."""
    return _conversation(cfg, row, "conversations_column", ("from", "value"), cfg.sharegpt_roles)


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
}
