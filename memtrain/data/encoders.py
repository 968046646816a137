"""Tokenize a dataset per format: one encoder per ``data.format`` (``_ENCODERS``; preference pairs
have their own, since all their splits render one way), then cut (:func:`encode_splits`).

Each encoder maps loaded rows to ``input_ids`` and ``labels`` (``IGNORE_INDEX`` where no loss is
taken); :mod:`memtrain.data.prepare` loads and checks the rows first and collates the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from datasets import ClassLabel, Dataset
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from memtrain.config import DataConfig, Problem, RecipeError
from memtrain.data.chat import (
    IGNORE_INDEX,
    TemplateRewritesTurns,
    chat_examples,
    encode_spans,
    pair_example,
    resolve_chat_template,
)
from memtrain.data.formats import (
    CONVERSATION_READERS,
    PAIR_READERS,
    PROBLEM,
    ROW,
    BadRows,
    RowError,
    column_text,
)

log = logging.getLogger("memtrain.data.prepare")  # the logger these messages always had


Encoder = Callable[[Dataset, DataConfig, PreTrainedTokenizerBase, list[str] | None], Dataset]


def _encode_classification(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                           names: list[str] | None) -> Dataset:
    assert names is not None
    index = {name: i for i, name in enumerate(names)}
    is_class = isinstance(ds.features[cfg.label_column], ClassLabel)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [str(t) for t in batch[cfg.text_column]]
        out = dict(tok(texts, truncation=False))
        long = [i for i, ids in enumerate(out["input_ids"]) if len(ids) > cfg.max_length]
        if long:  # re-encode only the long ones, so special tokens survive the cut
            cut = tok([texts[i] for i in long], truncation=True, max_length=cfg.max_length)
            for key in out:
                for j, i in enumerate(long):
                    out[key][i] = cut[key][j]
        long_set = set(long)
        if not any(any(types) for types in out.get("token_type_ids", [])):
            # One segment per row: all zeros, which BERT-style models use when none are given (a
            # zero buffer). Collated they are one more int64 per token in every batch, which
            # nothing needs and the estimate's batch does not have.
            out.pop("token_type_ids", None)
        out["truncated"] = [i in long_set for i in range(len(texts))]
        out["labels"] = [y if is_class else index[str(y)] for y in batch[cfg.label_column]]
        return out

    return ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")


def _rows(batch: dict[str, list]) -> list[dict[str, Any]]:
    return [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]


def _map_rows(ds: Dataset, encode: Callable[[dict[str, Any]], list[dict[str, list[int]]]]) -> Dataset:
    """Apply ``encode`` (one row -> zero or more examples) to every row; a bad row becomes an empty
    example carrying its problem (:data:`PROBLEM`), for :func:`without_bad_rows`."""

    def batch_encode(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "labels": [], PROBLEM: []}
        for row in _rows(batch):
            try:
                examples = encode(row)
            except RowError as err:
                examples = [{"input_ids": [], "labels": [], PROBLEM: err.record()}]
            for example in examples:
                out["input_ids"].append(example["input_ids"])
                out["labels"].append(example["labels"])
                out[PROBLEM].append(example.get(PROBLEM, ""))
        return out

    return ds.map(batch_encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")


def _encode_text(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                 names: list[str] | None) -> Dataset:
    """Plain text, every token trained, closed by the end-of-sequence token."""
    def encode(row: dict[str, Any]) -> list[dict[str, list[int]]]:
        text = column_text(cfg, row, "text_column")
        if not text.strip():  # a blank line of a .txt file: no example (dropped by _drop_blank)
            return [{"input_ids": [], "labels": []}]
        return [encode_spans(tok, text, [], special_tokens=True, close=True, train_all=True)]

    return _map_rows(ds, encode)


def _encode_pair(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                 names: list[str] | None) -> Dataset:
    """completion / alpaca: loss on the response (and the closing token)."""
    read = PAIR_READERS[cfg.kind]
    return _map_rows(ds, lambda row: [pair_example(tok, *read(cfg, row), cfg.train_on_inputs)])


def _encode_chat(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                 names: list[str] | None) -> Dataset:
    """sharegpt / messages: rendered with the chat template, loss on the assistant turns."""
    read = CONVERSATION_READERS[cfg.kind]
    template = resolve_chat_template(cfg, tok)
    field = "conversations_column" if cfg.kind == "sharegpt" else "messages_column"

    def encode(row: dict[str, Any]) -> list[dict[str, list[int]]]:
        messages = read(cfg, row)
        try:
            return chat_examples(tok, template, messages, cfg.split_turns, cfg.train_on_inputs)
        except TemplateError as err:
            raise RowError(cfg, row[ROW], field, f"the chat template failed on this conversation "
                           f"({err})", "check `data.chat_template` and the roles of the "
                           "messages.") from None
        except TemplateRewritesTurns as err:  # name the dataset and the row
            raise TemplateRewritesTurns([replace(p, path=cfg.key("chat_template"),
                                                 message=f"row {row[ROW]}: {p.message}")
                                         for p in err.problems], cfg.source) from None

    return _map_rows(ds, encode)


def _encode_tokenized(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                      names: list[str] | None) -> Dataset:
    """Token ids as given; ``labels`` where a row has them, else every token of the row is trained
    (a row without them in a file where others have them reads as null: the same as a file without)."""
    has_labels = "labels" in ds.column_names
    vocabulary = len(tok)

    def encode(row: dict[str, Any]) -> list[dict[str, list[int]]]:
        ids = row["input_ids"]
        labels = row["labels"] if has_labels and row["labels"] is not None else ids
        if not ids or not all(isinstance(t, int) for t in ids):
            raise RowError(cfg, row[ROW], "format", "`input_ids` must be a non-empty list of "
                           "integers", "store token ids as lists of integers.")
        if (bad := next((t for t in ids if not 0 <= t < vocabulary), None)) is not None:
            raise RowError(cfg, row[ROW], "format", f"`input_ids` holds {bad}, not a token of the "
                           f"tokenizer's {vocabulary:,} (0 to {vocabulary - 1:,})", "tokenize the "
                           "data with the model's tokenizer (`model.tokenizer`).")
        if labels is None or len(labels) != len(ids):
            raise RowError(cfg, row[ROW], "format", f"`labels` has {len(labels or [])} entries "
                           f"for {len(ids)} `input_ids`", "give one label per token (-100: not "
                           "trained), or drop the `labels` column.")
        return [{"input_ids": list(ids), "labels": list(labels)}]

    return _map_rows(ds, encode)


def without_bad_rows(cfg: DataConfig, splits: list[Dataset | None], read: int) -> list[Dataset | None]:
    """The encoded (train, eval) splits of ``read`` rows without the :data:`PROBLEM` column; if any
    row of either is bad, :class:`BadRows` names them all, in the order of the data."""
    named = cfg.eval_split if isinstance(cfg.eval_split, str) else None  # numbered on its own
    records: list[tuple[str | None, str]] = []
    for split, ds in zip((None, named), splits, strict=True):
        if ds is not None and PROBLEM in ds.column_names:
            records += [(split, r) for r in ds.unique(PROBLEM) if r]
    if records:
        raise BadRows(cfg, records, read)
    return [ds.remove_columns(PROBLEM) if ds is not None and PROBLEM in ds.column_names else ds
            for ds in splits]


def _cut(ds: Dataset, max_length: int) -> Dataset:
    """One example per row: cut at ``max_length``, add the attention mask."""

    def cut(row: dict[str, Any]) -> dict[str, Any]:
        ids = row["input_ids"][:max_length]
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": row["labels"][:max_length], "truncated": len(row["input_ids"]) > max_length}

    return ds.map(cut, desc="cutting")


def _encode_preference(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                       names: list[str] | None, *, conversational: bool) -> Dataset:
    """preference: prompt/chosen/rejected token ids (:mod:`memtrain.data.preference`), every split
    rendered one way (``conversational`` is decided over all of them). The tokenizer the run saves
    keeps a chat template only for conversational pairs (the one they were rendered with), so that
    ``memtrain generate`` writes prompts as the pairs were written."""
    from memtrain.data import preference

    template = resolve_chat_template(cfg, tok) if conversational else None
    tok.chat_template = template
    return preference.encode_preference(ds, cfg, tok, template)


_ENCODERS: dict[str, Encoder] = {
    "classification": _encode_classification,
    "text": _encode_text,
    "completion": _encode_pair,
    "alpaca": _encode_pair,
    "messages": _encode_chat,
    "sharegpt": _encode_chat,
    "tokenized": _encode_tokenized,
}


def _drop_unlabelled(ds: Dataset, cfg: DataConfig) -> Dataset:
    """Drop examples whose answer was cut away entirely; fail if that is all of them."""
    kept = ds.filter(lambda row: any(t != IGNORE_INDEX for t in row["labels"]), desc="checking")
    if len(kept) == 0:
        longest = max(len(ids) for ids in ds["input_ids"])
        raise RecipeError([Problem("data.max_length", cfg.max_length,
                                   "leaves no answer tokens in any example (prompts fill it)",
                                   f"raise `data.max_length` (examples reach {longest} tokens here "
                                   "before cutting).")], cfg.source)
    if len(kept) < len(ds):
        dropped = len(ds) - len(kept)
        cut = ds.filter(lambda row: len(row["input_ids"]) >= cfg.max_length, desc="checking")
        by_length = sum(1 for labels in cut["labels"] if all(t == IGNORE_INDEX for t in labels))
        why = [f"{by_length} cut at data.max_length={cfg.max_length}" if by_length else "",
               f"{dropped - by_length} with every label -100" if dropped > by_length else ""]
        log.warning("dropped %d examples with no answer tokens left: %s", dropped,
                    " and ".join(w for w in why if w))
    return kept


def _drop_blank(ds: Dataset, cfg: DataConfig) -> Dataset:
    """Drop the examples of blank text (a blank line, ``""``): an example of no tokens but the
    closing one would train on nothing and count as a step; fail if that is all of them."""
    kept = ds.filter(lambda row: len(row["input_ids"]) > 0, desc="checking")
    if len(kept) == 0:
        raise RecipeError([Problem(cfg.key("text_column"), cfg.text_column, "every row's text is blank",
                                   "point `data.source` at the data, or name the column that holds "
                                   "the text.")], cfg.source)
    if len(kept) < len(ds):
        log.warning("dropped %d blank rows (no text in column %r)", len(ds) - len(kept), cfg.text_column)
    return kept


def encode_splits(data: DataConfig, tokenizer: PreTrainedTokenizerBase, label_names: list[str] | None,
                  splits: list[Dataset | None], read: int) -> list[Dataset | None]:
    """The loaded (train, eval) splits of one dataset, ``read`` rows in all, tokenized by the encoder
    of its format: bad rows refused together (:func:`without_bad_rows`), causal examples cut at
    ``data.max_length`` (unless packed text) and those left with no answer token dropped."""
    if data.kind == "preference":
        from memtrain.data.preference import is_conversational

        encode = partial(_encode_preference, conversational=is_conversational(data, splits))
    else:
        encode = _ENCODERS[data.kind]
    splits = [encode(s, data, tokenizer, label_names) if s is not None else None for s in splits]
    splits = without_bad_rows(data, splits, read)
    if data.kind == "text":
        splits = [_drop_blank(s, data) if s is not None else None for s in splits]
    if data.kind not in ("classification", "preference") and not (data.packing and data.kind == "text"):
        splits = [_cut(s, data.max_length) if s is not None else None for s in splits]
    if data.kind not in ("text", "classification", "preference"):
        splits = [_drop_unlabelled(s, data) if s is not None else None for s in splits]
    return splits
