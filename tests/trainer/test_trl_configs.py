"""TRL's configs as memtrain builds them: transformers' own checkpointing off, without the names
transformers 5.24 deprecated."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from memtrain.config import load_recipe
from memtrain.config.batch import resolve_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_trl_configs_turn_transformers_checkpointing_off_quietly(kind: str, tmp_path: Path) -> None:
    """TRL's configs default ``gradient_checkpointing`` to True; memtrain turns it off (it
    checkpoints as ``memory.checkpointing`` says). From transformers 5.24 setting the old name alone
    warns (FutureWarning, "removed in v6") on every DPO and GRPO run. (Planted: the old name alone
    again -> the FutureWarning, an error here, fails on 5.24; 5.19-5.23 have only the old name.)"""
    if kind == "dpo":
        from memtrain.trainer.preference import dpo_arguments as arguments
        overrides = ["training.dpo_precompute_ref=false"]
    else:
        from memtrain.trainer.grpo import grpo_arguments as arguments
        overrides = []
    cfg = load_recipe(ROOT / "recipes" / f"tiny-llama-{kind}.yaml", overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = arguments(cfg, resolve_batch(cfg.training), str(tmp_path), False)
    assert args.gradient_checkpointing is False
    assert getattr(args, "activation_checkpointing", False) is False
