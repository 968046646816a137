"""A finished run works from any directory: the recipe it saves names its files by absolute paths,
and loading a run for inference checks only what inference needs (the base model), not the
training data or the tokenizer the run already saved. Tried on a DPO run trained with relative
paths, from another directory, after its data file is gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import MINILM, TINY_CONFIGS
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.run.train import train
from memtrain.sources import resolve

cli = CliRunner()


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DPO run trained in ``work/`` with relative paths for its data and tokenizer."""
    work = tmp_path_factory.mktemp("anywhere") / "work"
    (work / "data").mkdir(parents=True)
    shutil.copytree(resolve(MINILM), work / "assets" / "tok")
    rows = [{"prompt": f"line {i} of the play", "chosen": " the next line", "rejected": " line next the"}
            for i in range(8)]
    (work / "data" / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {"model": {"from_config": dict(TINY_CONFIGS["llama"]), "tokenizer": "./assets/tok"},
              "data": {"source": "./data/pairs.jsonl", "format": "preference", "max_length": 24,
                       "eval_split": 0.0},
              "adapter": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
              "training": {"objective": "dpo", "micro_batch_size": 4, "gradient_accumulation": 1,
                           "max_steps": 1, "save_strategy": "no"},
              "output": {"dir": "runs/dpo", "report": False}}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        train(load_recipe(recipe))
    return work


def test_the_saved_recipe_names_files_by_absolute_paths(dpo_run: Path) -> None:
    saved = yaml.safe_load((dpo_run / "runs" / "dpo" / "recipe.yaml").read_text())
    assert saved["model"]["tokenizer"] == str((dpo_run / "assets" / "tok").resolve())
    assert saved["data"]["source"] == str((dpo_run / "data" / "pairs.jsonl").resolve())


def test_generate_and_merge_from_another_directory(dpo_run: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = dpo_run / "runs" / "dpo"
    (dpo_run / "data" / "pairs.jsonl").unlink()  # inference does not need the training data
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, ["generate", str(run), "line 3 of the play", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    merged = cli.invoke(app, ["merge", str(run), "--out", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    assert (tmp_path / "merged" / "config.json").is_file()
