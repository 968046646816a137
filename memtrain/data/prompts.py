"""Prompts (``data.format: prompt``) for ``training.objective: grpo``: what TRL's GRPOTrainer samples from.

TRL's ``GRPOTrainer`` tokenizes the prompts itself when it generates (plain strings as they are,
message lists through the tokenizer's chat template), so the rows stay text here: the prompt column
becomes TRL's ``prompt`` and every other column is kept for the reward functions
(:mod:`memtrain.trainer.rewards`). What memtrain adds before the model loads: the rows are loaded,
split and checked like every other format (missing column, nulls: the field named), a
conversation's template is resolved as for ``messages`` data (the recipe's, the tokenizer's, else
ChatML), and each prompt is tokenized once to count it: prompts over ``data.max_length`` tokens are
dropped with a warning (TRL does not cut prompts), and the counts give the longest prompt, which
the position check and the memory estimate use (:func:`prompt_lengths`).
"""

from __future__ import annotations

import logging
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from memtrain.config import DataConfig, Problem, RecipeError
from memtrain.data.formats import row_numbers

log = logging.getLogger("memtrain.data.prepare")
LENGTH = "prompt_tokens"  # the column holding each prompt's token count (removed before training)


def is_conversational(ds: Dataset, cfg: DataConfig) -> bool:
    return len(ds) > 0 and isinstance(ds[0][cfg.prompt_column], list)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_prompts(splits: list[Dataset | None], cfg: DataConfig, row_key: str) -> None:
    """Every prompt of every split a non-empty string, or every prompt a non-empty list of {role,
    content} messages: the shape most rows have is the one asked of all (the earliest row's on a
    tie). Every bad row is named, in the order of the data, grouped by what is wrong."""
    rows = sorted((pair for ds in splits if ds is not None
                   for pair in zip(ds[row_key], ds[cfg.prompt_column], strict=True)), key=lambda r: r[0])
    lists = sum(isinstance(value, list) for _, value in rows)
    conversational = lists * 2 > len(rows) or (lists * 2 == len(rows) and isinstance(rows[0][1], list))
    want = "a list of {role, content} messages" if conversational else "a string"
    groups: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for row, value in rows:
        if value is None or value == [] or (isinstance(value, str) and not value.strip()):
            why = ("the prompt is empty", "fill in or remove those rows.")
        elif conversational != isinstance(value, list):
            why = (f"expected {want}, as most prompts are", "store every prompt the same way: all strings, "
                   "or all message lists.")
        elif conversational and not _is_messages(value):
            why = ("a message has no `role` or no `content`", "give every message both.")
        else:
            continue
        groups.setdefault(why, []).append((row, value))
    problems = []
    for (message, fix), bad in groups.items():
        (first, value), numbers = bad[0], row_numbers("", [r for r, _ in bad])
        held = f"row {first} holds {type(value).__name__} {repr(value)[:60]}"
        problems.append(Problem(cfg.key("prompt_column"), cfg.prompt_column,
                                f"{numbers} of {len(rows)}: {message} ({held})", fix))
    if problems:
        raise RecipeError(problems, cfg.source)


def encode_prompts(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase, row_key: str) -> Dataset:
    """The rows as TRL reads them (``prompt`` plus the other columns) with each prompt's token count
    (the prompts checked first: :func:`check_prompts`)."""
    if cfg.prompt_column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(cfg.prompt_column, "prompt")
    conversational = is_conversational(ds, cfg.model_copy(update={"prompt_column": "prompt"}))

    def count(row: dict[str, Any]) -> dict[str, int]:
        if conversational:
            ids = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok(row["prompt"])["input_ids"]
        return {LENGTH: len(ids)}

    ds = ds.map(count, desc="counting prompt tokens")
    kept = ds.filter(lambda row: row[LENGTH] <= cfg.max_length, desc="checking")
    if len(kept) == 0:
        raise RecipeError([Problem("data.max_length", cfg.max_length, "is shorter than every prompt "
                                   f"(the shortest has {min(ds[LENGTH])} tokens)", "raise `data.max_length` "
                                   "(for GRPO it bounds the prompt; completions get "
                                   "`training.grpo_max_completion_length` more).")], cfg.source)
    if len(kept) < len(ds):
        log.warning("dropped %d prompts longer than data.max_length=%d tokens", len(ds) - len(kept),
                    cfg.max_length)
    return kept.remove_columns([row_key]) if row_key in kept.column_names else kept


def prompt_lengths(ds: Dataset) -> list[int]:
    return list(ds[LENGTH]) if LENGTH in ds.column_names else []
