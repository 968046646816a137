"""Shipped recipes validate; broken ones exit 2 with one line per error naming each field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe, shipped_recipes_dir

SHIPPED = sorted(shipped_recipes_dir().glob("*.yaml"))
BROKEN = sorted((Path(__file__).parents[1] / "assets" / "broken").glob("*.yaml"))
runner = CliRunner()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_validates_and_opens_with_its_command(path: Path) -> None:
    cfg = load_recipe(path)
    assert cfg.description, "every recipe has a one-line description"
    first = path.read_text().splitlines()[0]
    assert first == f"# memtrain train recipes/{path.name}"


def test_recipes_command_lists_them() -> None:
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0
    for path in SHIPPED:
        assert path.stem in result.output


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.stem)
def test_broken_recipe_exits_2_naming_each_field(path: Path) -> None:
    expected = re.search(r"# expect: (.*)", path.read_text()).group(1).split(", ")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert len(lines) == len(expected), result.output
    for field in expected:
        assert any(line.startswith(f"  - `{field}`") and "Fix:" in line for line in lines), field


def test_validate_show_prints_the_resolved_recipe() -> None:
    result = runner.invoke(app, ["validate", "quickstart", "training.epochs=2", "--show"])
    assert result.exit_code == 0
    assert "epochs: 2.0" in result.stdout and "max_nonfinite_steps: 5" in result.stdout


STATED = [p for p in SHIPPED if "estimated peak" in load_recipe(p).description]


@pytest.mark.slow
@pytest.mark.parametrize("path", STATED, ids=lambda p: p.stem)
def test_stated_peak_is_what_the_estimator_predicts(path: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU recipe's "estimated peak X GiB" is `memtrain estimate RECIPE --device cuda`'s total
    (with the default overhead lines, as on a machine without a calibration profile)."""
    from memtrain.estimator.estimate import estimate

    monkeypatch.setenv("MEMTRAIN_CALIBRATION", str(tmp_path / "none.json"))
    stated = float(re.search(r"estimated peak ([\d.]+) GiB", load_recipe(path).description).group(1))
    predicted = estimate(path, device="cuda").total_bytes / 2**30
    assert predicted == pytest.approx(stated, abs=0.01), f"{path.name}: estimate says {predicted:.2f} GiB"
