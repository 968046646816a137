"""``memtrain validate --data``: read, render and tokenize a recipe's data as ``memtrain train``
does, so that every data mistake is reported (exit 2) before a run starts, and say what was read.

No model is loaded, only the tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrain.config import RunConfig

if TYPE_CHECKING:
    from memtrain.data.prepare import PreparedData

UNCUT = 10**9  # data.max_length to check rows with when the planner has not chosen it yet


def check_data(cfg: RunConfig) -> tuple[str, PreparedData | None]:
    """Prepare the recipe's data (:func:`~memtrain.data.prepare.prepare_data`) and describe it in a
    line; a data mistake raises its :class:`~memtrain.errors.MemtrainError`. Returns the line and
    the prepared data, which is what `memtrain train` prepares (None where it is not: with
    ``data.max_length: auto``, the planner chooses the length, the rows are checked uncut and
    unpacked).
    """
    from memtrain.data.prepare import prepare_data
    from memtrain.model import load_tokenizer

    auto = cfg.data.max_length == "auto"
    if auto:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": UNCUT,
                                                                         "packing": False})})
    prepared = prepare_data(cfg, load_tokenizer(cfg.model))
    kind = ("pairs" if cfg.data.kind == "preference" else "packed rows" if cfg.data.packing
            else "examples")
    line = f"{len(prepared.train)} training {kind}"
    if prepared.eval is not None:
        line += f" and {len(prepared.eval)} for evaluation"
    line += f", the longest {prepared.rows(cfg).longest} tokens"
    if auto:
        return line + " (uncut: data.max_length is auto, the planner chooses it)", None
    if prepared.truncated:
        line += f"; {prepared.truncated} cut at data.max_length = {cfg.data.max_length}"
    return line, prepared
