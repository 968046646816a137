"""``memtrain validate --data``: read, render and tokenize a recipe's data as ``memtrain train``
does, so that every data mistake is reported (exit 2) before a run starts, and say what was read.

No model is loaded, only the tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrain.config import RunConfig

if TYPE_CHECKING:
    from memtrain.data.prepare import PreparedData

def check_data(cfg: RunConfig) -> tuple[str, PreparedData]:
    """Prepare the recipe's data (:func:`~memtrain.data.prepare.prepare_data`) and describe it in a
    line; a data mistake raises its :class:`~memtrain.errors.MemtrainError`. Returns the line and
    the prepared data, which is what `memtrain train` prepares (with ``data.max_length: auto``: the
    rows uncut and unpacked, as `train` reads them to plan the length).
    """
    from memtrain.data.prepare import prepare_data, uncut
    from memtrain.model import load_tokenizer

    auto = cfg.data.max_length == "auto"
    cfg = uncut(cfg)
    prepared = prepare_data(cfg, load_tokenizer(cfg.model))
    kind = ("pairs" if cfg.data.kind == "preference" else "packed rows" if cfg.data.packing
            else "examples")
    line = f"{len(prepared.train)} training {kind}"
    if prepared.eval is not None:
        line += f" and {len(prepared.eval)} for evaluation"
    line += f", the longest {prepared.rows(cfg).longest} tokens"
    if auto:
        return line + " (uncut: data.max_length is auto, the planner chooses it)", prepared
    if prepared.truncated:
        line += f"; {prepared.truncated} cut at data.max_length = {cfg.data.max_length}"
    return line, prepared
