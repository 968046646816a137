"""Datasets: load (local files, hub ids, built-ins), check, tokenize per format, collate.

Everything here runs before the model is loaded, so that data mistakes (a missing column, an
empty dataset, labels out of range, examples that the maximum length cuts to nothing) are
reported in seconds, with the recipe field to change.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import ClassLabel, Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding, PreTrainedTokenizerBase

from memtrain import sources
from memtrain.builtin_data import BUILTINS
from memtrain.config import DataConfig, Problem, RecipeError, RunConfig
from memtrain.errors import MemtrainError

log = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
IGNORE_INDEX = -100


@dataclass
class PreparedData:
    """Tokenized splits and how to batch them."""

    train: Dataset
    eval: Dataset | None
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    label_names: list[str] | None = None  # classification only
    truncated: int = 0  # training examples cut at data.max_length

    @property
    def num_labels(self) -> int | None:
        return len(self.label_names) if self.label_names else None


def prepare_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Load, split, check and tokenize the recipe's data."""
    _check_max_length(cfg, tokenizer)
    train, evaluation = load_splits(cfg.data, cfg.training.seed)
    fmt = cfg.data.format
    _require_columns(train, cfg.data)
    label_names = None
    if fmt == "classification":
        label_names = _label_names(train, cfg)
    encode = _ENCODERS[fmt]
    tokenized = [encode(split, cfg.data, tokenizer, label_names) if split is not None else None
                 for split in (train, evaluation)]
    train_tok, eval_tok = tokenized
    assert train_tok is not None
    if fmt in ("instruction", "chat"):
        train_tok, eval_tok = (_drop_unlabelled(s, cfg.data) if s is not None else None
                               for s in (train_tok, eval_tok))
    if fmt == "text" and cfg.data.packing:
        train_tok, eval_tok = (_pack(s, cfg.data.max_length) if s is not None else None
                               for s in (train_tok, eval_tok))
    truncated = sum(train_tok["truncated"]) if "truncated" in train_tok.column_names else 0
    train_tok, eval_tok = (s.remove_columns([c for c in ("truncated",) if c in s.column_names])
                           if s is not None else None for s in (train_tok, eval_tok))
    if truncated:
        log.warning("%d of %d training examples were cut at data.max_length=%d",
                    truncated, len(train_tok), cfg.data.max_length)
    collator = (DataCollatorWithPadding(tokenizer) if fmt == "classification"
                else DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX))
    return PreparedData(train_tok, eval_tok, collator, label_names, truncated)


def _check_max_length(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """``data.max_length`` must leave room for one real token: a classifier's input keeps its
    special tokens whatever the limit (the tokenizer cannot cut them), and a causal LM needs two
    tokens to predict one. A shorter limit would also make the memory estimate (which uses it)
    wrong."""
    if cfg.data.format == "classification":
        shortest = tokenizer.num_special_tokens_to_add(pair=False) + 1
        why = f"the tokenizer adds {shortest - 1} special token(s) to every example"
    else:
        shortest, why = 2, "a causal LM needs two tokens to predict one"
    if cfg.data.max_length < shortest:
        raise RecipeError([Problem("data.max_length", cfg.data.max_length, f"is too short: {why}",
                                   f"set it to {shortest} or more (typical: 128 to 2048).")], cfg.data.source)


# ------------------------------------------------------------------------------------ loading


def load_raw(cfg: DataConfig, seed: int = 0) -> Dataset | DatasetDict:
    """The dataset as stored, before any split or tokenization."""
    source = cfg.source
    if source.startswith("builtin:"):
        return BUILTINS[source.removeprefix("builtin:")](seed)
    try:
        location = sources.resolve(source)
    except FileNotFoundError as err:
        raise RecipeError([Problem("data.source", source, str(err), "check the path.")]) from None
    path = Path(location)
    try:
        if path.is_file():
            builder = _BUILDERS.get(path.suffix)
            if builder is None:
                raise RecipeError([Problem("data.source", source, "has an unknown file type",
                                           f"use one of {', '.join(_BUILDERS)}.")])
            if path.suffix == ".jsonl":
                _check_json_lines(path, source)
            return load_dataset(builder, data_files=str(path))
        return load_dataset(location, cfg.subset)
    except (DatasetGenerationError, StopIteration) as err:  # a file the builder cannot parse
        cause = err.__cause__ or err
        raise RecipeError([Problem("data.source", source, f"cannot be read as {path.suffix or 'a dataset'} "
                                   f"({type(cause).__name__}: {str(cause).strip()[:200] or 'no rows'})",
                                   "check that the file is complete and in the format its name says.")]
                          ) from None
    except (FileNotFoundError, ValueError, OSError) as err:
        if "corresponds to no data" in str(err):
            raise RecipeError([Problem("data.source", source, "has no examples",
                                       "point it at a non-empty file or dataset.")]) from None
        raise MemtrainError(f"`data.source`: could not load {source!r}: {err}") from None


def _check_json_lines(path: Path, source: str) -> None:
    """A JSON Lines file: at least one line, each a JSON object (else the line that is not)."""
    rows = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise RecipeError([Problem("data.source", source, f"line {number} is not valid JSON ({err})",
                                           "fix that line: JSON Lines hold one JSON object per line.")]
                                  ) from None
            if not isinstance(row, dict):
                raise RecipeError([Problem("data.source", source, f"line {number} is not a JSON object",
                                           'write each example as an object, e.g. {"text": "..."}.')])
            rows += 1
    if rows == 0:
        raise RecipeError([Problem("data.source", source, "has no examples",
                                   "point it at a non-empty file or dataset.")])


def _check_nulls(ds: Dataset, cfg: DataConfig, split: str) -> None:
    """Empty values in the columns a format reads are mistakes: name the first rows that have them."""
    problems = []
    for key in _NEEDED[cfg.format]:
        column = getattr(cfg, key)
        if column not in ds.column_names:
            continue  # reported by _require_columns with the columns there are
        rows = [i + 1 for i, value in enumerate(ds[column]) if value is None]
        if rows:
            shown = ", ".join(map(str, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
            problems.append(Problem(f"data.{key}", column, f"is empty (null) in {split} row {shown} "
                                    "(counting from 1, in the order of the data)",
                                    "fill in or remove those rows."))
    if problems:
        raise RecipeError(problems, cfg.source)


def load_splits(cfg: DataConfig, seed: int = 0) -> tuple[Dataset, Dataset | None]:
    """(train, eval) after shuffling, ``max_examples`` and the evaluation split."""
    raw = load_raw(cfg, seed)
    if isinstance(raw, DatasetDict):
        if cfg.split not in raw:
            raise RecipeError([Problem("data.split", cfg.split, "is not a split of the data",
                                       f"use one of: {', '.join(raw)}.")])
        train = raw[cfg.split]
    else:
        train = raw
    if len(train) == 0:
        raise RecipeError([Problem("data.source", cfg.source, "has no examples",
                                   "point it at a non-empty file or dataset.")])
    _check_nulls(train, cfg, cfg.split)
    evaluation = None
    if isinstance(cfg.eval_split, str):
        if not isinstance(raw, DatasetDict) or cfg.eval_split not in raw:
            have = ", ".join(raw) if isinstance(raw, DatasetDict) else "none (a single split)"
            raise RecipeError([Problem("data.eval_split", cfg.eval_split, "is not a split of the data",
                                       f"use a fraction like 0.1 or one of the splits: {have}.")])
        evaluation = raw[cfg.eval_split]
        _check_nulls(evaluation, cfg, cfg.eval_split)
    train = train.shuffle(seed=seed)
    if cfg.max_examples is not None:
        train = train.select(range(min(cfg.max_examples, len(train))))
    if isinstance(cfg.eval_split, float) and cfg.eval_split > 0:
        if len(train) < 2:
            raise RecipeError([Problem("data.eval_split", cfg.eval_split,
                                       f"cannot split {len(train)} example(s)",
                                       "use more data or `data.eval_split: 0`.")])
        parts = train.train_test_split(test_size=cfg.eval_split, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation


_NEEDED = {  # the columns each format reads
    "text": ["text_column"],
    "classification": ["text_column", "label_column"],
    "instruction": ["prompt_column", "response_column"],
    "chat": ["messages_column"],
}


def _require_columns(ds: Dataset, cfg: DataConfig) -> None:
    needed = _NEEDED[cfg.format]
    problems = [
        Problem(f"data.{key}", getattr(cfg, key), "is not a column of the data",
                f"set it to one of the columns the data has: {', '.join(ds.column_names)}.")
        for key in needed if getattr(cfg, key) not in ds.column_names
    ]
    if problems:
        raise RecipeError(problems, cfg.source)


def _label_names(ds: Dataset, cfg: RunConfig) -> list[str]:
    """Class names: from a ClassLabel feature, else the sorted distinct values."""
    column = cfg.data.label_column
    feature = ds.features[column]
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
    else:
        values = sorted(set(ds[column]), key=lambda v: (str(type(v)), v))
        if all(isinstance(v, int) for v in values):
            if min(values) < 0:
                raise RecipeError([Problem(f"data.{column}", min(values), "labels must be 0 or more",
                                           "use labels 0..N-1 or class names.")])
            names = [str(i) for i in range(max(values) + 1)]
        else:
            names = [str(v) for v in values]
    wanted = cfg.model.num_labels
    if wanted is not None and wanted < len(names):
        raise RecipeError([Problem("model.num_labels", wanted,
                                   f"is smaller than the {len(names)} labels in the data "
                                   f"({', '.join(names[:8])})", f"set it to {len(names)} or more.")])
    if wanted is not None:
        names += [str(i) for i in range(len(names), wanted)]
    if len(names) < 2:
        raise RecipeError([Problem(f"data.{column}", names, "classification needs at least 2 labels",
                                   "check the label column.")])
    return names


# --------------------------------------------------------------------------------- tokenizing

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
        out["truncated"] = [i in long_set for i in range(len(texts))]
        out["labels"] = [y if is_class else index[str(y)] for y in batch[cfg.label_column]]
        return out

    return ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")


def _encode_text(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                 names: list[str] | None) -> Dataset:
    cut = not cfg.packing  # packing keeps everything and cuts into blocks afterwards

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = tok(batch[cfg.text_column], add_special_tokens=True)["input_ids"]
        if cfg.packing and tok.eos_token_id is not None:
            ids = [[*x, tok.eos_token_id] for x in ids]
        truncated = [cut and len(x) > cfg.max_length for x in ids]
        ids = [x[: cfg.max_length] if cut else x for x in ids]
        return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids],
                "labels": [list(x) for x in ids], "truncated": truncated}

    return ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenizing")


def _encode_instruction(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                        names: list[str] | None) -> Dataset:
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        prompt = bos + tok(str(row[cfg.prompt_column]) + "\n\n", add_special_tokens=False)["input_ids"]
        answer = tok(str(row[cfg.response_column]), add_special_tokens=False)["input_ids"] + eos
        return _masked(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, cfg.max_length)

    return ds.map(encode, remove_columns=ds.column_names, desc="tokenizing")


def _encode_chat(ds: Dataset, cfg: DataConfig, tok: PreTrainedTokenizerBase,
                 names: list[str] | None) -> Dataset:
    """Loss on assistant turns only: each turn's tokens are the growth of the rendered prefix."""
    if not getattr(tok, "chat_template", None):
        log.warning("the tokenizer has no chat template; rendering messages as 'role: content'")

    def render(messages: list[dict[str, str]]) -> list[int]:
        if getattr(tok, "chat_template", None):
            return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return tok(text, add_special_tokens=True)["input_ids"]

    def encode(row: dict[str, Any]) -> dict[str, Any]:
        messages = row[cfg.messages_column]
        ids: list[int] = []
        labels: list[int] = []
        for i, message in enumerate(messages):
            full = render(messages[: i + 1])
            new = full[len(ids):]
            ids = full
            labels += new if message.get("role") == "assistant" else [IGNORE_INDEX] * len(new)
        return _masked(ids, labels, cfg.max_length)

    return ds.map(encode, remove_columns=ds.column_names, desc="tokenizing")


def _masked(ids: list[int], labels: list[int], max_length: int) -> dict[str, Any]:
    return {"input_ids": ids[:max_length], "attention_mask": [1] * len(ids[:max_length]),
            "labels": labels[:max_length], "truncated": len(ids) > max_length}


_ENCODERS: dict[str, Encoder] = {
    "classification": _encode_classification,
    "text": _encode_text,
    "instruction": _encode_instruction,
    "chat": _encode_chat,
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
        log.warning("dropped %d examples with no answer tokens left after data.max_length=%d",
                    len(ds) - len(kept), cfg.max_length)
    return kept


def _pack(ds: Dataset, block: int) -> Dataset:
    """Concatenate all token ids and cut them into blocks of ``block`` tokens (last one dropped)."""

    def pack(batch: dict[str, list]) -> dict[str, list]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block * block
        blocks = [flat[i: i + block] for i in range(0, n, block)]
        return {"input_ids": blocks, "attention_mask": [[1] * block for _ in blocks],
                "labels": [list(b) for b in blocks]}

    packed = ds.map(pack, batched=True, batch_size=1000, remove_columns=ds.column_names,
                    desc="packing")
    if len(packed) == 0:
        raise RecipeError([Problem("data.max_length", block, "is longer than all the text together",
                                   "lower `data.max_length` or add data.")])
    return packed
