"""Using a finished run: merge its adapter, generate text, predict labels.

A run folder holds the resolved ``recipe.yaml``, the tokenizer (with the chat template the data was
rendered with) and either a LoRA adapter (``adapter_config.json``) or a whole model. For an
adapter, the base model is rebuilt as the recipe says (a model built from a config gets the same
seeded random weights as in training) and the adapter is loaded on top.

``merge`` folds the adapter into the base weights. A 4-bit or 8-bit base is first dequantized
into the compute dtype (``transformers``' ``dequantize``), so the merged weights are exactly the
ones the adapter was trained against, and the result is an ordinary Hugging Face model folder.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from memtrain._compat.peft import quiet_renamed_checkpointing
from memtrain.config import RunConfig, load_recipe
from memtrain.data.chat import end_token_id
from memtrain.data.formats import fill_template
from memtrain.errors import MemtrainError, first_line
from memtrain.model import DTYPES, PRETRAINED_KWARGS, load_model, model_class
from memtrain.run.train import LABELS_FILE, RECIPE_FILE

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_config.json"
CHAT_FORMATS = ("messages", "sharegpt")


@dataclass
class Run:
    """A finished run, loaded: its recipe, tokenizer and model (in eval mode)."""

    folder: Path
    cfg: RunConfig
    tokenizer: PreTrainedTokenizerBase
    model: Any
    adapter: bool


def load_run(run_dir: str | Path, dequantize: bool = False) -> Run:
    """Load a run folder written by ``memtrain train`` (adapter on its base, or a whole model).

    Args:
        dequantize: turn a quantized base into ordinary linear layers before the adapter loads.

    Raises:
        MemtrainError: not a finished run, or it saved no model.
    """
    folder = Path(run_dir)
    if not (folder / RECIPE_FILE).is_file():
        raise MemtrainError(f"`RUN_DIR`: {str(folder)!r} is not a finished run (no {RECIPE_FILE}). "
                            "Fix: give the `output.dir` of a run that completed.")
    # the run's own tokenizer is in the folder, and its data is not needed: only the base model
    cfg = load_recipe(folder / RECIPE_FILE, require=("model.name",))
    for name in READ_JSON:  # what the libraries read below, each a traceback of its own when cut short
        if (folder / name).is_file():
            try:
                json.loads((folder / name).read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as err:
                raise MemtrainError(f"`RUN_DIR`: {str(folder / name)!r} is not valid JSON ({err}): the "
                                    "file was cut short or edited. Fix: copy the run again, or train "
                                    "again.") from None
    tokenizer = AutoTokenizer.from_pretrained(folder)
    adapter = (folder / ADAPTER_FILE).is_file()
    if adapter or (folder / "config.json").is_file():
        _require_weights(folder, ADAPTER_WEIGHTS if adapter else MODEL_WEIGHTS)
        try:
            model = (_adapter_model(folder, cfg, tokenizer, dequantize) if adapter else
                     model_class(cfg.model).from_pretrained(folder, dtype=DTYPES[cfg.model.dtype],
                                                            **PRETRAINED_KWARGS))
        except SafetensorError as err:  # cut short (a full disk, a copy interrupted) or not weights
            raise MemtrainError(f"`RUN_DIR`: the weights in {str(folder)!r} cannot be read "
                                f"({first_line(err)}): the file was cut short or is not a safetensors file. "
                                "Fix: copy the run again, or train again.") from None
    else:
        raise MemtrainError(f"`RUN_DIR`: {str(folder)!r} holds no model (the run had "
                            "`output.save_model: false`). Fix: train again with it true.")
    model.eval()
    return Run(folder, cfg, tokenizer, model, adapter)


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
READ_JSON = ("adapter_config.json", "config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "labels.json")
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _require_weights(folder: Path, names: tuple[str, ...]) -> None:
    """The run's weights are in ``folder`` (one of ``names``): without them, transformers and peft
    go looking for ``folder`` on the Hugging Face Hub and fail with a repository-id error."""
    if not any((folder / name).is_file() for name in names):
        raise MemtrainError(f"`RUN_DIR`: {str(folder)!r} has no weights (none of {', '.join(names)}): "
                            "the run did not finish saving them, or they were moved. Fix: give the "
                            "folder that holds them, or train again.")


def _adapter_model(folder: Path, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase,
                   dequantize: bool) -> Any:
    from peft import PeftModel

    labels = label_names(folder, cfg) if cfg.model.task == "sequence-classification" else None
    # a classifier's base loads with a new head, which transformers reports as MISSING weights
    # "newly initialized": the adapter saved the trained head (peft's modules_to_save) and puts it back
    with _quiet_transformers() if labels else contextlib.nullcontext():
        base = load_model(cfg.model, len(labels) if labels else None, tokenizer.pad_token_id,
                          cfg.training.seed)
    if labels:
        base.config.id2label = dict(enumerate(labels))
        base.config.label2id = {n: i for i, n in enumerate(labels)}
    if dequantize and getattr(base, "hf_quantizer", None) is not None:
        base = base.dequantize(dtype=DTYPES[cfg.model.compute_dtype or cfg.model.dtype])
        for key in ("quantization_config", "_pre_quantization_dtype"):  # save as unquantized
            if hasattr(base.config, key):
                delattr(base.config, key)
    with quiet_renamed_checkpointing():  # peft reads a name transformers 5.24 renamed: nothing to act on
        return PeftModel.from_pretrained(base, folder)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def label_names(folder: Path, cfg: RunConfig) -> list[str]:
    """Class names of a classifier run: ``labels.json``, else read again from the recipe's data."""
    path = folder / LABELS_FILE
    if path.is_file():
        return list(json.loads(path.read_text(encoding="utf-8")))
    from memtrain.data.prepare import class_names

    return class_names(cfg)


def merge(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Fold a run's LoRA adapter into its base weights and save an ordinary model folder.

    Returns:
        The folder written (default: ``RUN_DIR/merged``).
    """
    run = load_run(run_dir, dequantize=True)
    if not run.adapter:
        raise MemtrainError(f"`RUN_DIR`: {str(run.folder)!r} holds a whole model (adapter.method: "
                            f"{run.cfg.adapter.method}), there is no adapter to merge. Fix: use the "
                            "run folder itself as the model.")
    out = Path(out_dir) if out_dir is not None else run.folder / "merged"
    if out.exists() and any(out.iterdir()):
        raise MemtrainError(f"`--out`: {str(out)!r} is not empty. Fix: remove it or choose another.")
    merged: PreTrainedModel = run.model.merge_and_unload()
    merged.save_pretrained(out)
    run.tokenizer.save_pretrained(out)
    return out


def format_prompt(run: Run, prompt: str | list[dict[str, str]], extra: str = "") -> list[int]:
    """Token ids of a prompt, written the way the run's training data was.

    Chat data (and conversational preference pairs): the chat template with the generation prompt
    (``prompt`` may be a whole message list); alpaca: ``alpaca_template`` with ``extra`` as the
    input (``alpaca_template_no_input`` without one); completion: ``completion_template``; text
    and plain preference pairs: the prompt as it is.
    """
    tok, data = run.tokenizer, run.cfg.data
    if extra.strip() and data.kind != "alpaca":  # the input of an alpaca instruction: nowhere else to go
        raise MemtrainError(f"`--input` is the input of an alpaca instruction; this run trained on "
                            f"`data.format: {data.format}`, whose prompts have none. Fix: put all of "
                            "it in PROMPT.")
    if data.kind in CHAT_FORMATS or (data.kind == "preference" and tok.chat_template):  # conversational pairs
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise MemtrainError(f"a conversation needs chat data; this run trained on "
                            f"`data.format: {data.format}`. Fix: give one prompt.")
    if data.kind == "alpaca":
        template = data.alpaca_template if extra.strip() else data.alpaca_template_no_input
        prompt = fill_template(template, instruction=prompt, input=extra.strip())
    elif data.kind == "completion":
        prompt = fill_template(data.completion_template, prompt=prompt)
    ids = list(tok(prompt, add_special_tokens=True)["input_ids"])
    end = end_token_id(tok)
    while ids and ids[-1] == end:  # the document's end token would tell the model to stop
        ids.pop()
    return ids


def generate(run: Run, prompt: str | list[dict[str, str]], max_new_tokens: int = 64,
             temperature: float = 0.0, extra: str = "") -> str:
    """The model's continuation of ``prompt`` (greedy when ``temperature`` is 0); ``extra`` is
    the input of an alpaca prompt."""
    return continuation(run, prompt, max_new_tokens, temperature, extra).text


@dataclass
class Continuation:
    """What :func:`continuation` generated: the text shown, and why it is empty when it is."""

    text: str
    tokens: list[int]  # the new token ids
    empty_because: str | None = None  # a sentence for the user when ``text`` is empty


def continuation(run: Run, prompt: str | list[dict[str, str]], max_new_tokens: int = 64,
                 temperature: float = 0.0, extra: str = "") -> Continuation:
    """:func:`generate` with the token ids, and a sentence saying what happened when the text is
    empty (only the end token, or only whitespace and special tokens)."""
    if run.cfg.model.task != "causal-lm":
        raise MemtrainError("`RUN_DIR`: generation needs a causal LM; this run is a classifier. "
                            "Fix: use `memtrain predict`.")
    ids = torch.tensor([format_prompt(run, prompt, extra)], device=run.model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
        {"do_sample": False}
    end = end_token_id(run.tokenizer)
    with torch.no_grad():
        out = run.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=max_new_tokens, eos_token_id=end,
                                 pad_token_id=run.tokenizer.pad_token_id, **sampling)
    new = out[0, ids.shape[1]:].tolist()
    text = run.tokenizer.decode(new, skip_special_tokens=True).strip()
    return Continuation(text, new, None if text else _why_empty(new, end, temperature))


def _why_empty(tokens: list[int], end: int | None, temperature: float) -> str:
    count = f"{len(tokens)} token{'s' if len(tokens) != 1 else ''}"
    if not tokens:
        what = "no token"
    elif tokens == [end]:
        what = "only the end token (1 token)"
    else:
        what = f"only whitespace and special tokens ({count})"
    fix = ("sample with `--temperature 0.7` (greedy decoding, the default, always takes the most likely "
           "token), or train longer" if temperature == 0 else
           "try again or with a higher `--temperature`, or train longer")
    return f"the model generated {what}: nothing to show. Fix: {fix} (more steps or data)."


def predict(run: Run, texts: list[str], batch_size: int = 32) -> list[dict[str, Any]]:
    """Label and class probabilities for each text (classifier runs)."""
    _require_classifier(run)
    config = run.model.config
    names = [config.id2label[i] for i in range(config.num_labels)]
    rows = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start: start + batch_size]
        enc = run.tokenizer(chunk, truncation=True, max_length=run.cfg.data.max_length,
                            padding=True, return_tensors="pt").to(run.model.device)
        with torch.no_grad():
            probs = run.model(**enc).logits.float().softmax(-1)
        for text, p in zip(chunk, probs.tolist(), strict=True):
            best = max(range(len(p)), key=p.__getitem__)
            rows.append({"text": text, "label": names[best], "score": round(p[best], 6),
                         **{f"score_{n}": round(v, 6) for n, v in zip(names, p, strict=True)}})
    return rows


def _require_classifier(run: Run) -> None:
    if run.cfg.model.task != "sequence-classification":
        raise MemtrainError("`RUN_DIR`: prediction needs a classifier run; this one is a causal LM. "
                            "Fix: use `memtrain generate`.")


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Predictions as CSV (``.csv``) or JSON lines (anything else)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["text", "label", "score"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def read_texts(run: Run, file: str | Path) -> list[str]:
    """The ``data.text_column`` of a data file (same file types as ``data.source``)."""
    from datasets import DatasetDict

    from memtrain.data.prepare import load_raw

    _require_classifier(run)
    data = run.cfg.data.model_copy(update={"source": str(file)})
    raw = load_raw(data)
    ds = raw[next(iter(raw))] if isinstance(raw, DatasetDict) else raw
    if data.text_column not in ds.column_names:
        raise MemtrainError(f"`FILE`: {str(file)!r} has no column {data.text_column!r} (the run's "
                            f"`data.text_column`); it has: {', '.join(ds.column_names)}. Fix: name "
                            "the column like the training data's.")
    texts = ds[data.text_column]
    # a null, an empty CSV cell, a blank line of a .txt file (each line a row) or only spaces
    empty = [i + 1 for i, t in enumerate(texts) if t is None or not str(t).strip()]
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        lines = "; a .txt file's rows are its lines" if Path(file).suffix == ".txt" else ""
        raise MemtrainError(f"`FILE`: {str(file)!r} has no text in column {data.text_column!r} in row "
                            f"{shown} (counting from 1{lines}). Fix: fill those rows in or remove them.")
    return [str(t) for t in texts]
