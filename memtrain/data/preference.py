"""Preference pairs (``data.format: preference``): a prompt, a chosen and a rejected answer.

The rows are tokenized here, the way every other format is (:mod:`memtrain.data.chat`): each
sequence, prompt + answer, is rendered once as the text the model reads and tokenized once with
character offsets; the answer's tokens are those that start inside the answer's span of that text
(the whole rendered assistant turn for conversations, the answer and the end-of-sequence token for
plain strings). The result is what TRL's ``DataCollatorForPreference`` takes: ``prompt_ids`` (shared
by both sequences), ``chosen_ids`` and ``rejected_ids``; the collator stacks ``[chosen; rejected]``
and marks the answer tokens in ``completion_mask``, the only tokens DPO's log-probabilities sum
over. Tokenizing here rather than in TRL keeps one masking rule for every format, lets data
mistakes name their row and column before the model loads, and gives the token counts the
estimate needs (:func:`sequence_lengths`).

Two shapes of row, as in TRL:

- plain: the three columns are strings; the prompt is the text before each answer;
- conversational: the prompt is a list of ``{role, content}`` messages (or a string, read as one
  user message) and each answer a list of messages (or a string, read as one assistant message),
  rendered with ``data.chat_template``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from memtrain.config import DataConfig, Problem, RecipeError
from memtrain.data.chat import IGNORE_INDEX, encode_spans, render
from memtrain.data.formats import PROBLEM, ROW, Message, RowError, column_text, read_message, row_numbers

log = logging.getLogger("memtrain.data.prepare")

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
ANSWERS = ("chosen_column", "rejected_column")
MERGED = "_merged"  # hidden column: the row's number where the prompt's last tokens merged, else 0


def _messages(cfg: DataConfig, row: Mapping[str, Any], field: str, default_role: str) -> list[Message]:
    value = row.get(getattr(cfg, field))
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise RowError(cfg, row[ROW], field, "expected a list of messages or a string, found "
                       f"{'nothing' if not value else type(value).__name__}",
                       "store each as a string or a non-empty list of {role, content} objects.")
    return [read_message(cfg, row, field, i, turn, ("role", "content"), None)
            for i, turn in enumerate(value)]


def is_conversational(cfg: DataConfig, splits: list[Dataset | None]) -> bool:
    """Whether the pairs are conversational: a message list in any column of any row of any split,
    so that every split renders the same way. Plain strings among them are then read as one
    message each (said once, with their count)."""
    columns = [getattr(cfg, f) for f in ("prompt_column", *ANSWERS)]
    lists: list[bool] = []  # per pair: does it hold a message list?
    for ds in (s for s in splits if s is not None):
        present = [c for c in columns if c in ds.column_names]
        lists += [any(isinstance(v, list) for v in values)
                  for values in zip(*(ds[c] for c in present), strict=True)]
    if any(lists) and not all(lists):
        log.warning("%d of the %d preference pairs hold only strings while the others hold message "
                    "lists: each of their strings is read as one message and rendered with the chat "
                    "template", lists.count(False), len(lists))
    return any(lists)


def _sequence(cfg: DataConfig, tok: PreTrainedTokenizerBase, row: Mapping[str, Any], answer: str,
              template: str | None) -> dict[str, list[int]]:
    """prompt + one answer, tokenized once; ``labels`` mark the answer's tokens."""
    if template is None:
        prompt = column_text(cfg, row, "prompt_column")
        text = prompt + column_text(cfg, row, answer)
        return encode_spans(tok, text, [(len(prompt), len(text))], special_tokens=True, close=True)
    prompt_messages = _messages(cfg, row, "prompt_column", "user")
    before = render(tok, template, prompt_messages, True)
    text = render(tok, template, prompt_messages + _messages(cfg, row, answer, "assistant"), False)
    if not text.startswith(before):
        raise RowError(cfg, row[ROW], answer, "the chat template renders the prompt differently once "
                       "the answer follows it, so the answer's tokens cannot be located exactly",
                       "use a chat template that renders earlier turns the same whatever follows.")
    return encode_spans(tok, text, [(len(before), len(text))], special_tokens=False, close=False)


def _answer_text(cfg: DataConfig, row: Mapping[str, Any], answer: str, template: str | None) -> str:
    """The text of one answer: its column's string, or its messages' contents joined."""
    if template is None:
        return column_text(cfg, row, answer)
    return "".join(str(m["content"]) for m in _messages(cfg, row, answer, "assistant"))


def encode_pair(cfg: DataConfig, tok: PreTrainedTokenizerBase, row: Mapping[str, Any],
                template: str | None) -> dict[str, list[int]]:
    """``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` of one row (``template`` None: plain), and
    in :data:`MERGED` the row's number if tokens merged across the prompt's end (else 0)."""
    for answer in ANSWERS:  # an empty answer: its sequence is the prompt and the end token alone
        if not _answer_text(cfg, row, answer, template).strip():
            raise RowError(cfg, row[ROW], answer, "the answer is empty",
                           "give the pair a non-empty chosen and rejected answer, or remove the row.")
    chosen = _sequence(cfg, tok, row, "chosen_column", template)
    rejected = _sequence(cfg, tok, row, "rejected_column", template)
    starts = []
    for seq in (chosen, rejected):
        trained = [i for i, label in enumerate(seq["labels"]) if label != IGNORE_INDEX]
        starts.append(trained[0] if trained else len(seq["labels"]))
    shared = 0
    for a, b in zip(chosen["input_ids"], rejected["input_ids"], strict=False):
        if a != b:
            break
        shared += 1
    cut = min(*starts, shared)  # below an answer's start: the prompt's last tokens differ (merged)
    return {"prompt_ids": chosen["input_ids"][:cut], "chosen_ids": chosen["input_ids"][cut:],
            "rejected_ids": rejected["input_ids"][cut:], MERGED: row[ROW] if cut < max(starts) else 0}


def encode_preference(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                      template: str | None) -> Dataset:
    """Every row (conversational when ``template`` is given, else plain) as prompt/chosen/rejected
    token ids; rows whose prompt fills ``data.max_length`` (no answer token left) are dropped, as
    TRL drops them."""
    def encode(row: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return {**encode_pair(cfg, tok, row, template), PROBLEM: ""}
        except RowError as err:  # reported with every other bad row (encoders.without_bad_rows)
            return {**{key: [] for key in COLUMNS}, MERGED: 0, PROBLEM: err.record()}

    out = ds.map(encode, remove_columns=ds.column_names, desc="tokenizing pairs")
    merged = sorted(row for row in out[MERGED] if row)
    if merged:
        log.warning("%s: the prompt's last tokens differ between the chosen and the rejected sequence "
                    "(tokens merged across the prompt's end); they count as answer tokens",
                    row_numbers("", merged))
    out = out.remove_columns(MERGED)
    # a tie (the rejected answer is the chosen one) has equal log-ratios: no gradient, a constant
    # loss that dilutes the mean; dropped with a count, as blank rows are
    read = len(out)
    out = out.filter(lambda row: row[PROBLEM] or row["chosen_ids"] != row["rejected_ids"], desc="checking")
    if ties := read - len(out):
        if ties == read:
            raise RecipeError([Problem(cfg.key("rejected_column"), cfg.rejected_column, "every pair's "
                                       "rejected answer is its chosen one: nothing to prefer",
                                       "point `data.chosen_column` and `data.rejected_column` at "
                                       "different columns.")], cfg.source)
        log.warning("dropped %d pairs whose rejected answer is the chosen one (nothing to prefer)", ties)
    kept = out.filter(lambda row: len(row["prompt_ids"]) < cfg.max_length, desc="checking")
    if len(kept) == 0:
        raise RecipeError([Problem("data.max_length", cfg.max_length, "leaves no answer tokens in any "
                                   "pair (prompts fill it)", "raise `data.max_length`.")], cfg.source)
    if len(kept) < len(out):
        log.warning("dropped %d pairs whose prompt fills data.max_length=%d", len(out) - len(kept),
                    cfg.max_length)
    return kept


def sequence_lengths(ds: Dataset, max_length: int) -> list[int]:
    """Tokens of every sequence the collator builds (prompt + chosen, prompt + rejected), cut at
    ``max_length`` as TRL's collator cuts them."""
    out = []
    for prompt, chosen, rejected in zip(*(ds[c] for c in COLUMNS), strict=True):
        out += [min(len(prompt) + len(chosen), max_length), min(len(prompt) + len(rejected), max_length)]
    return out
