"""Datasets: load (local files, hub ids, built-ins), check, tokenize per format, collate.

The per-format encoders are in :mod:`memtrain.data.encoders`.

Everything here runs before the model is loaded, so that data mistakes (a missing column, an
empty dataset, labels out of range, examples that the maximum length cuts to nothing) are
reported in seconds, with the recipe field to change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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
from memtrain.data import mixing, packing
from memtrain.data.chat import IGNORE_INDEX, resolve_chat_template
from memtrain.data.encoders import encode_splits
from memtrain.data.formats import CONVERSATION_READERS, REQUIRED_COLUMNS, ROW, missing_column_fix, row_numbers
from memtrain.data.rows import Rows, rows_of
from memtrain.errors import TRL_MISSING, MemtrainError

log = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
__all__ = ["IGNORE_INDEX", "PreparedData", "class_names", "load_raw", "load_splits", "prepare_data",
           "read_rows"]


# the columns that hold token ids (a row, a preference pair's parts, a completion)
TOKEN_COLUMNS = ("input_ids", "prompt_ids", "chosen_ids", "rejected_ids", "completion_ids")


@dataclass
class PreparedData:
    """Tokenized splits and how to batch them."""

    train: Dataset
    eval: Dataset | None
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    label_names: list[str] | None = None  # classification only
    truncated: int = 0  # training examples cut at data.max_length
    fill: dict[str, float] | None = None  # packing: share of real tokens, packed vs one per row
    mix: list[mixing.MixShare] | None = None  # data.mix: what was drawn from each dataset

    @property
    def num_labels(self) -> int | None:
        return len(self.label_names) if self.label_names else None

    def rows(self, cfg: RunConfig) -> Rows:
        """The longest batch these training rows make (what the estimate and auto-fit use)."""
        if "chosen_ids" in self.train.column_names:  # preference pairs: two sequences each
            from memtrain.data.preference import sequence_lengths

            return rows_of(cfg, sequence_lengths(self.train, cfg.data.max_length))
        if "prompt_tokens" in self.train.column_names:  # GRPO prompts: the longest prompt
            return rows_of(cfg, self.train["prompt_tokens"])
        return rows_of(cfg, token_counts(self.train))

    def largest_token_id(self) -> int | None:
        """The largest token id in either split's :data:`TOKEN_COLUMNS` (not ``position_ids``,
        ``token_type_ids``), read from the Arrow columns; None where no split holds ids (GRPO's
        prompts are text until TRL tokenizes them)."""
        import pyarrow.compute as pc

        found = None
        for split in (self.train, self.eval):
            if split is None:
                continue
            table = split.with_format("arrow")
            for name in set(TOKEN_COLUMNS) & set(split.column_names):
                top = pc.max(pc.list_flatten(table[name])).as_py()
                if top is not None:
                    found = top if found is None else max(found, top)
        return found


UNCUT = 10**9  # data.max_length to read rows with when the planner has not chosen it yet


def uncut(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``data.max_length: auto`` replaced by no limit and packing off: how the data is
    read before the planner chooses the length (every row whole, one example per row)."""
    if cfg.data.max_length != "auto":
        return cfg
    whole = cfg.data.model_copy(update={"max_length": UNCUT, "packing": False})
    return cfg.model_copy(update={"data": whole})


def read_rows(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> Rows:
    """The longest batch of the recipe's data, read by tokenizing it as ``memtrain train`` does
    (``memtrain estimate --data``): what the estimate traces instead of rows of ``data.max_length``.
    With ``data.max_length: auto``, the rows read uncut (:func:`uncut`; ``packed`` as the recipe
    sets packing): what bounds the planner's length search."""
    from memtrain.model import load_tokenizer

    return read_data(cfg, tokenizer or load_tokenizer(cfg.model))[0]


def read_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[Rows, PreparedData]:
    """:func:`read_rows`, and the data it tokenized: with ``data.max_length: auto``, every row whole,
    which :func:`cut_to` reuses once the length is decided."""
    read = uncut(cfg)
    data = prepare_data(read, tokenizer)
    rows = data.rows(read)
    return (rows if read is cfg else dataclasses.replace(rows, packed=cfg.data.packing)), data


def cut_to(whole: PreparedData, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """The data of ``cfg``, whose ``data.max_length`` the planner decided, given ``whole``: the same
    data read uncut (:func:`read_data`). Where cutting at that length changes nothing it is
    ``whole`` itself with ``cfg``'s collator: one example per row (no packing), rows of tokens (not
    preference pairs or GRPO prompts, which are filtered by the length), and no row of the training
    or evaluation split longer than the length. Else the data is tokenized again at the length:
    cutting tokens is not tokenizing cut (a classifier's input keeps its closing token)."""
    limit = cfg.data.max_length
    splits = [s for s in (whole.train, whole.eval) if s is not None]
    plain = not cfg.data.packing and all(
        "input_ids" in s.column_names and not {"chosen_ids", "prompt_tokens"} & set(s.column_names)
        for s in splits)
    if plain and isinstance(limit, int) and all(max(token_counts(s), default=0) <= limit for s in splits):
        return dataclasses.replace(whole, collator=_collator(cfg.data, tokenizer))
    return prepare_data(cfg, tokenizer)


def token_counts(dataset: Dataset) -> list[int]:
    """The number of tokens of every row, read from the Arrow column without decoding the rows. Through
    the dataset's index mapping: a filtered, shuffled or selected dataset keeps its whole table
    beneath (``dataset.data``), the rows dropped included."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()


def prepare_data(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    """Load, split, check and tokenize the recipe's data (every dataset of a mix, then mixed).

    For sharegpt/messages data the chat template in use is set on ``tokenizer`` (so that it is
    saved with the run and used by ``memtrain generate``); in a mix, the first chat dataset's.
    """
    data = cfg.data
    if data.max_length == "auto":
        raise MemtrainError("`data.max_length` is `auto`: the planner decides it before the data is "
                            "tokenized. Fix: plan first (`memtrain plan`, or `memtrain train`, which "
                            "plans), or set `data.max_length` to a number.")
    _check_max_length(cfg, tokenizer)
    if data.kind == "prompt":  # GRPO: the rows stay text, TRL tokenizes them (memtrain.data.prompts)
        return _prompts(data, cfg, tokenizer)
    datasets = _with_chat_templates(data.datasets(), tokenizer)
    encoded = [_encode_dataset(d, cfg, tokenizer, need_eval_split=len(datasets) == 1) for d in datasets]
    label_names = encoded[0][2]
    shares = None
    if len(datasets) == 1:
        train_tok, eval_tok = encoded[0][:2]
    else:
        train_tok, eval_tok, shares = mixing.mix([e[:2] for e in encoded], datasets,
                                                 data.mix_stopping, cfg.training.seed)
        _check_named_eval_split(data, datasets, eval_tok)
        log.info("mixed %d datasets (%s): %s", len(datasets), data.mix_stopping,
                 ", ".join(f"{s.source} {s.examples}" for s in shares))
    truncated = sum(train_tok["truncated"]) if "truncated" in train_tok.column_names else 0
    if truncated:
        log.warning("%d of %d training examples were cut at data.max_length=%d",
                    truncated, len(train_tok), data.max_length)
    splits: list[Dataset | None] = [train_tok, eval_tok]
    fill = None
    if data.packing:
        fill = {"unpacked": packing.fill([min(len(x), data.max_length) for x in train_tok["input_ids"]],
                                         data.max_length)}
        split_long = any(d.kind == "text" for d in datasets)  # other formats are already cut
        splits = [packing.pack(s, data.max_length, split_long=split_long)
                  if s is not None else None for s in splits]
        fill["packed"] = packing.fill([len(x) for x in splits[0]["input_ids"]], data.max_length)
        log.info("packing: %d examples in %d rows; real tokens fill %.1f%% of the rows (%.1f%% "
                 "with one example per row)", len(train_tok), len(splits[0]), 100 * fill["packed"],
                 100 * fill["unpacked"])
    train_tok, eval_tok = (s.remove_columns([c for c in ("truncated",) if c in s.column_names])
                           if s is not None else None for s in splits)
    return PreparedData(train_tok, eval_tok, _collator(data, tokenizer), label_names, truncated, fill,
                        shares)


def _prompts(data: DataConfig, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreparedData:
    from memtrain.data.prompts import check_prompts, encode_prompts

    train, evaluation = load_splits(data, cfg.training.seed)
    _require_columns(train, data)
    check_prompts([train, evaluation], data, ROW)
    if "exact_answer" in cfg.training.grpo_rewards:
        _check_answers([train, evaluation], data, cfg.training.grpo_answer_column)
    if isinstance(train[0][data.prompt_column], list):  # conversations: the template TRL will apply
        tokenizer.chat_template = resolve_chat_template(data, tokenizer)
    splits = [encode_prompts(s, data, tokenizer, ROW) if s is not None else None for s in (train, evaluation)]
    return PreparedData(splits[0], splits[1], lambda rows: rows)


def _check_answers(splits: list[Dataset | None], data: DataConfig, column: str) -> None:
    """The column the ``exact_answer`` reward compares completions with: present, and filled in."""
    field = "training.grpo_answer_column"
    if column not in splits[0].column_names:
        others = ", ".join(c for c in splits[0].column_names if c not in (ROW, data.prompt_column))
        raise RecipeError([Problem(field, column, "is not a column of the data (the `exact_answer` reward "
                                   "compares each completion with it)", f"set it to the column holding the "
                                   f"answers; the data has: {others or 'no other column'}.")], data.source)
    empty = sorted(row for ds in splits if ds is not None
                   for row, answer in zip(ds[ROW], ds[column], strict=True)
                   if answer is None or not str(answer).strip())
    if empty:
        raise RecipeError([Problem(field, column, f"{row_numbers('', empty)} (in the order of the data) "
                                   "hold no answer", "fill in or remove those rows: `exact_answer` would "
                                   "score completions against nothing.")], data.source)


def _encode_dataset(data: DataConfig, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, *,
                    need_eval_split: bool) -> tuple[Dataset, Dataset | None, list[str] | None]:
    """One dataset's (train, eval) tokenized by its own format, cut, and its class names."""
    train, evaluation = load_splits(data, cfg.training.seed, need_eval_split=need_eval_split)
    _require_columns(train, data)
    label_names = _label_names(train, cfg) if data.kind == "classification" else None
    splits = encode_splits(data, tokenizer, label_names, [train, evaluation],
                           len(train) + len(evaluation or []))
    assert splits[0] is not None
    return splits[0], splits[1], label_names


def _with_chat_templates(datasets: list[DataConfig], tokenizer: PreTrainedTokenizerBase
                         ) -> list[DataConfig]:
    """Chat datasets with their template resolved (the recipe's, else the tokenizer's own, else
    ChatML); the tokenizer keeps the first one, which the run saves for ``memtrain generate``."""
    out = [d.model_copy(update={"chat_template": resolve_chat_template(d, tokenizer)})
           if d.kind in CONVERSATION_READERS else d for d in datasets]
    templates = [d.chat_template for d in out if d.kind in CONVERSATION_READERS]
    if templates:
        tokenizer.chat_template = templates[0]
    if len(set(templates)) > 1:
        log.warning("the mixed chat datasets use %d different chat templates; the run saves the "
                    "first one's, which `memtrain generate` will use", len(set(templates)))
    return out


def _check_named_eval_split(data: DataConfig, datasets: list[DataConfig], evaluation: Dataset | None
                            ) -> None:
    """A named evaluation split applies to the mixed datasets that have it: at least one must."""
    if isinstance(data.eval_split, str) and evaluation is None:
        raise RecipeError([Problem("data.eval_split", data.eval_split,
                                   "is not a split of any of the mixed datasets",
                                   "use a fraction like 0.1, or the name of a split one of them has.")],
                          ", ".join(d.source for d in datasets))


def _collator(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Callable[..., Any]:
    if cfg.kind == "classification":
        return DataCollatorWithPadding(tokenizer)
    if cfg.kind == "preference":  # [chosen; rejected] stacked, answers marked in completion_mask
        try:
            from trl.trainer.dpo_trainer import DataCollatorForPreference
        except ImportError:
            raise MemtrainError(TRL_MISSING) from None

        return DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=cfg.max_length)
    if cfg.packing:
        return packing.PackedCollator(tokenizer.pad_token_id)
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)


def _check_max_length(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """``data.max_length`` must leave room for one real token: a classifier's input keeps its
    special tokens whatever the limit (the tokenizer cannot cut them), and a causal LM needs two
    tokens to predict one. A shorter limit would also make the memory estimate (which uses it)
    wrong."""
    if cfg.data.kind == "classification":
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
        raise RecipeError([Problem(cfg.key("source"), source, str(err), "check the path.")]) from None
    path = Path(location)
    try:
        if path.is_file():
            builder = _BUILDERS.get(path.suffix)
            if builder is None:
                raise RecipeError([Problem(cfg.key("source"), source, "has an unknown file type",
                                           f"use one of {', '.join(_BUILDERS)}.")])
            if path.suffix == ".jsonl":
                _check_json_lines(path, cfg)
            return load_dataset(builder, data_files=str(path))
        return load_dataset(location, cfg.subset)
    except (DatasetGenerationError, StopIteration) as err:  # a file the builder cannot parse
        cause = err.__cause__ or err
        what = path.suffix or "a dataset"
        raise RecipeError([Problem(cfg.key("source"), source, f"cannot be read as {what} "
                                   f"({type(cause).__name__}: {str(cause).strip()[:200] or 'no rows'})",
                                   "check that the file is complete and in the format its name says.")]
                          ) from None
    except (FileNotFoundError, ValueError, OSError) as err:
        if "corresponds to no data" in str(err):
            raise RecipeError([Problem(cfg.key("source"), source, "has no examples",
                                       "point it at a non-empty file or dataset.")]) from None
        raise MemtrainError(f"`{cfg.key('source')}`: could not load {source!r}: {err}") from None


def _check_json_lines(path: Path, cfg: DataConfig) -> None:
    """A JSON Lines file: at least one line, each a JSON object (else the line that is not)."""
    rows, source, key = 0, cfg.source, cfg.key("source")
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise RecipeError([Problem(key, source, f"line {number} is not valid JSON ({err})",
                                           "fix that line: JSON Lines hold one JSON object per line.")]
                                  ) from None
            if not isinstance(row, dict):
                raise RecipeError([Problem(key, source, f"line {number} is not a JSON object",
                                           'write each example as an object, e.g. {"text": "..."}.')])
            rows += 1
    if rows == 0:
        raise RecipeError([Problem(key, source, "has no examples",
                                   "point it at a non-empty file or dataset.")])


def _check_nulls(ds: Dataset, cfg: DataConfig, split: str) -> None:
    """Empty values in the columns a format reads are mistakes: name the first rows that have them."""
    if cfg.kind == "prompt":  # reported with every other bad prompt (memtrain.data.prompts.check_prompts)
        return
    problems = []
    for key in REQUIRED_COLUMNS[cfg.kind]:
        column = getattr(cfg, key)
        if column not in ds.column_names:
            continue  # reported by _require_columns with the columns there are
        rows = [i + 1 for i, value in enumerate(ds[column]) if value is None]
        if rows:
            problems.append(Problem(cfg.key(key), column, f"is empty (null) in {row_numbers(split, rows)} "
                                    "(counting from 1, in the order of the data)",
                                    "fill in or remove those rows."))
    if problems:
        raise RecipeError(problems, cfg.source)


def load_splits(cfg: DataConfig, seed: int = 0, *, need_eval_split: bool = True
                ) -> tuple[Dataset, Dataset | None]:
    """(train, eval) after shuffling, ``max_examples`` and the evaluation split.

    Args:
        need_eval_split: a named ``eval_split`` the data lacks is an error; otherwise (a dataset
            of a mix) that dataset has no evaluation part.
    """
    raw = load_raw(cfg, seed)
    if isinstance(raw, DatasetDict):
        if cfg.split not in raw:
            raise RecipeError([Problem(cfg.key("split"), cfg.split, "is not a split of the data",
                                       f"use one of: {', '.join(raw)}.")], cfg.source)
        train = raw[cfg.split]
    else:
        train = raw
    train = _numbered(train)
    if len(train) == 0:
        raise RecipeError([Problem(cfg.key("source"), cfg.source, "has no examples",
                                   "point it at a non-empty file or dataset.")])
    _check_nulls(train, cfg, cfg.split)
    evaluation = None
    has_split = isinstance(raw, DatasetDict) and cfg.eval_split in raw
    if isinstance(cfg.eval_split, str) and (has_split or need_eval_split):
        if not has_split:
            have = ", ".join(raw) if isinstance(raw, DatasetDict) else "none (a single split)"
            raise RecipeError([Problem("data.eval_split", cfg.eval_split, "is not a split of the data",
                                       f"use a fraction like 0.1 or one of the splits: {have}.")])
        evaluation = _numbered(raw[cfg.eval_split])
        _check_nulls(evaluation, cfg, cfg.eval_split)
    train = train.shuffle(seed=seed)
    if cfg.max_examples is not None:
        train = train.select(range(min(cfg.max_examples, len(train))))
    if isinstance(cfg.eval_split, float) and cfg.eval_split > 0:
        if len(train) < 2:
            raise RecipeError([Problem("data.eval_split", cfg.eval_split,
                                       f"cannot split {len(train)} example(s)",
                                       "use more data or `data.eval_split: 0`.")], cfg.source)
        held = math.ceil(cfg.eval_split * len(train))  # as `datasets` rounds the evaluation part
        if held >= len(train):
            most = math.floor(100 * (len(train) - 1) / len(train)) / 100
            raise RecipeError([Problem("data.eval_split", cfg.eval_split,
                                       f"leaves nothing to train on: all {len(train)} examples would "
                                       "be held out for evaluation",
                                       f"lower it to at most {most:.2f} (or use "
                                       "more data, or `data.eval_split: 0`).")], cfg.source)
        parts = train.train_test_split(test_size=cfg.eval_split, seed=seed)
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation


def _numbered(ds: Dataset) -> Dataset:
    """Add the hidden row-number column (from 1, before shuffling) that data errors cite."""
    return ds.add_column(ROW, list(range(1, len(ds) + 1))) if ROW not in ds.column_names else ds


def _require_columns(ds: Dataset, cfg: DataConfig) -> None:
    columns = [c for c in ds.column_names if c != ROW]
    first = {c: v for c, v in ds[0].items() if c != ROW} if len(ds) else {}
    problems = [
        Problem(cfg.key(key), getattr(cfg, key), "is not a column of the data",
                missing_column_fix(cfg, key, first)
                or f"set it to one of the columns the data has: {', '.join(columns)}.")
        for key in REQUIRED_COLUMNS[cfg.kind] if getattr(cfg, key) not in columns
    ]
    if cfg.kind == "tokenized" and "input_ids" not in columns:
        problems.append(Problem(cfg.key("format"), "tokenized", "needs an `input_ids` column",
                                f"the data has: {', '.join(columns)}; tokenize it or pick the "
                                "format of its columns."))
    if problems:
        raise RecipeError(problems, cfg.source)


def class_names(cfg: RunConfig) -> list[str]:
    """The class names training used, in the same order, read again from the recipe's data."""
    train, _ = load_splits(cfg.data, cfg.training.seed)
    return _label_names(train, cfg)


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
                raise RecipeError([Problem(cfg.data.key("label_column"), column, f"holds the label "
                                           f"{min(values)}; number labels must be 0 or more",
                                           "use labels 0..N-1 or class names.")], cfg.data.source)
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
        raise RecipeError([Problem(cfg.data.key("label_column"), column, "classification needs at "
                                   f"least 2 labels; the column holds one: {names}", "check that it "
                                   "is the label column and that the data holds every class.")],
                          cfg.data.source)
    return names
