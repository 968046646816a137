"""`memtrain estimate` of `training.micro_batch_size: auto`, the setting the docs recommend: the
largest micro-batch that fits `memory.budget`, else the smallest, said plainly; never a dead end;
any refusal before the data is read (issue 35 part 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import causal_recipe
from typer.testing import CliRunner

from memtrain.config import load_recipe
from memtrain.estimator.estimate import estimate

runner = CliRunner()
AUTO = {"micro_batch_size": "auto", "gradient_accumulation": None, "effective_batch_size": 8}


def _file(tmp_path: Path, corpus: Path, **sections: Any) -> Path:
    path = tmp_path / "recipe.yaml"
    recipe = causal_recipe(tmp_path, corpus, training=AUTO, **sections)
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _estimate(path: Path, *args: str) -> dict[str, Any]:
    from memtrain.cli.app import app

    result = runner.invoke(app, ["estimate", str(path), "--device", "cpu", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stderr says what --data read


def _total(path: Path, micro: int) -> int:
    cfg = load_recipe(str(path), [f"training.micro_batch_size={micro}",
                                  f"training.gradient_accumulation={8 // micro}"])
    return estimate(cfg, device="cpu").total_bytes


def test_with_a_budget_it_estimates_the_largest_micro_batch_that_fits(tmp_path: Path,
                                                                      tiny_text_file: Path) -> None:
    path = _file(tmp_path, tiny_text_file)
    budget = int((_total(path, 2) + _total(path, 4)) / 2 / 0.9)  # 2 fits (10% margin), 4 does not
    found = _estimate(path, f"memory.budget={budget}B")
    assert found["settings"]["micro_batch_size"] == 2
    assert any(n.startswith(f"training.micro_batch_size is auto: estimated 2, the largest micro-batch "
                            f"predicted to fit memory.budget {budget}B") for n in found["notes"])
    small = _estimate(path, "memory.budget=1MiB")  # nothing fits: the smallest, said so
    assert small["settings"]["micro_batch_size"] == 1
    assert any("estimated the smallest micro-batch, 1, which does not fit memory.budget 1MiB" in n
               for n in small["notes"])


def test_without_a_budget_it_estimates_micro_batch_1_and_says_so(tmp_path: Path,
                                                                  tiny_text_file: Path) -> None:
    found = _estimate(_file(tmp_path, tiny_text_file))
    assert found["settings"]["micro_batch_size"] == 1
    assert any("no memory.budget is set: estimated the smallest micro-batch, 1. Set memory.budget" in n
               for n in found["notes"])


def test_another_auto_field_is_refused_before_the_data_is_read(
        tmp_path: Path, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.cli.app import app
    from memtrain.data import prepare

    def forbidden(*args: object) -> None:
        raise AssertionError("the data was read before the refusal")

    monkeypatch.setattr(prepare, "read_rows", forbidden)
    path = _file(tmp_path, tiny_text_file, memory={"checkpointing": "auto"})
    result = runner.invoke(app, ["estimate", str(path), "--device", "cpu", "--data"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "`memory.checkpointing` is `auto`" in said and "memtrain plan" in said and "Traceback" not in said
    length = runner.invoke(app, ["estimate", str(path), "--device", "cpu", "--data",
                                 "memory.checkpointing=full", "data.max_length=auto"])
    assert length.exit_code == 2 and "`data.max_length` is `auto`" in length.output, length.output


def test_with_data_the_auto_micro_batch_is_estimated_on_the_datas_longest_batch(
        tmp_path: Path, tiny_text_file: Path) -> None:
    found = _estimate(_file(tmp_path, tiny_text_file), "--data")
    assert found["settings"]["micro_batch_size"] == 1 and found["settings"]["seq_len"] < 32  # the data's rows
