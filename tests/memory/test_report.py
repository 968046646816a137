"""Memory reports: written by a run, re-rendered by `memtrain report`, summary against a prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import causal_recipe
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.memory.report import REPORT_JSON, REPORT_PNG, load_report, summary_rows
from memtrain.memory.trackers import CATEGORY_NAMES
from memtrain.run.train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    data = tmp / "t.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"shall I compare thee {i}"}) for i in range(32)))
    recipe = causal_recipe(tmp, data, training={"max_steps": 4, "logging_steps": 2},
                           output={"report": True})
    return train(load_recipe(recipe)).output_dir


def test_run_writes_json_and_png(run_dir: Path) -> None:
    report = load_report(run_dir)
    measured = report.measured
    assert measured["peak_bytes"] == sum(measured["peak_by_category"].values())
    assert measured["timeline"] and all(len(p[1]) == len(CATEGORY_NAMES) for p in measured["timeline"])
    # the timeline's highest point is the measured peak
    assert max(sum(p[1]) for p in measured["timeline"]) == measured["peak_bytes"]
    assert {p[0] for p in measured["timeline"]} == {"forward", "backward", "optimizer"}
    assert [s for s, _ in report.curves["loss"]] == [1, 2, 4]
    assert (run_dir / REPORT_PNG).stat().st_size > 10_000
    assert (run_dir / REPORT_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_compares_with_the_prediction(run_dir: Path) -> None:
    report = load_report(run_dir)
    report.predicted = {"peak_bytes": int(report.measured["peak_bytes"] * 1.01),
                        "by_category": dict(report.measured["peak_by_category"])}
    rows = summary_rows(report)
    assert rows[-1][0] == "peak (device)" and rows[-1][3] == "+1.0%"


def test_report_command_rerenders(run_dir: Path) -> None:
    (run_dir / REPORT_PNG).unlink()
    result = CliRunner().invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (run_dir / REPORT_PNG).is_file() and "peak (device)" in result.output


def test_report_of_a_folder_without_one(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and REPORT_JSON in result.output
