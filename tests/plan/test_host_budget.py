"""`memory.host_budget`: plans keep what they put in host memory under it, and say so when not."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import causal_recipe
from typer.testing import CliRunner

from memtrain.cli.app import app
from memtrain.config import load_recipe
from memtrain.config.loader import RecipeError
from memtrain.device import _meminfo_available, host_budget_bytes
from memtrain.estimator.estimate import estimate
from memtrain.plan import planner

# Activation offload moves every saved tensor of 1 KiB or more (the tiny model's are small).
OFFLOAD = {"offload": {"min_tensor_bytes": 1024}}


def _cfg(tmp_path: Path, corpus: Path, host_budget: str, **auto: str) -> object:
    recipe = causal_recipe(tmp_path, corpus, data={"max_length": 64},
                           memory={**OFFLOAD, "host_budget": host_budget})
    cfg = load_recipe(recipe)
    return planner.with_values(cfg, auto) if auto else cfg


def _budget_for(cfg: object, **values: object) -> tuple[int, object]:
    """A device budget that the candidate ``values`` just fits (10% margin), and its estimate."""
    found = estimate(planner.with_values(cfg, values), device="cuda")
    return int(found.total_bytes / 0.9) + 1, found


@pytest.mark.slow
def test_offload_that_fits_the_device_but_not_the_host_budget_is_rejected(tmp_path: Path,
                                                                         tiny_text_file: Path) -> None:
    generous = _cfg(tmp_path, tiny_text_file, "1GiB", **{"memory.offload.activations": "auto"})
    budget, moved = _budget_for(generous, **{"memory.offload.activations": True})
    plain = estimate(planner.with_values(generous, {"memory.offload.activations": False}), device="cuda")
    assert plain.total_bytes > int(budget * 0.9) >= moved.total_bytes  # only offload fits the device
    decided = planner.plan(generous, budget, device="cuda")
    assert decided.chosen.values == {"memory.offload.activations": True}
    assert decided.chosen.host == moved.host_peak_bytes > 0
    described = planner.describe(decided)
    assert described["chosen"]["host_bytes"] == moved.host_peak_bytes
    assert described["host_usable_bytes"] == int(2**30 * 0.9)
    small = f"{moved.host_peak_bytes // 2}B"  # half of what the offload keeps there
    tight = _cfg(tmp_path, tiny_text_file, small, **{"memory.offload.activations": "auto"})
    said = rf"host RAM .* needed, `memory.host_budget` {small}"
    with pytest.raises(planner.NothingFits, match=said) as err:
        planner.plan(tight, budget, device="cuda")
    assert "Fix: raise `memory.host_budget`" in str(err.value)


@pytest.mark.slow
def test_a_small_host_budget_changes_the_choice(tmp_path: Path, tiny_text_file: Path) -> None:
    """Embedding offload keeps the table on the host (7.8 MB here), activation offload 2.4 MB:
    with 4 MiB of host RAM only the latter is left."""
    fields = {"memory.offload.activations": "auto", "memory.offload.embeddings": "auto"}
    roomy = _cfg(tmp_path, tiny_text_file, "1GiB", **fields)
    budget, act = _budget_for(roomy, **{"memory.offload.activations": True,
                                        "memory.offload.embeddings": False})
    emb = estimate(planner.with_values(roomy, {"memory.offload.activations": False,
                                               "memory.offload.embeddings": True}), device="cuda")
    assert emb.total_bytes < act.total_bytes and act.host_peak_bytes < 4 * 2**20 * 0.9 < emb.host_peak_bytes
    assert planner.plan(roomy, budget, device="cuda").chosen.values["memory.offload.embeddings"] is True
    tight = _cfg(tmp_path, tiny_text_file, "4MiB", **fields)
    decided = planner.plan(tight, budget, device="cuda")
    assert decided.chosen.values == {"memory.offload.activations": True, "memory.offload.embeddings": False}
    assert decided.chosen.host <= decided.host.usable
    assert any("does not fit the host" in c.reason for c in decided.rejected)


def test_host_budget_values(tmp_path: Path, tiny_text_file: Path) -> None:
    assert host_budget_bytes("32GiB") == 32 * 2**30
    assert host_budget_bytes("auto") > 0
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    1234 kB\n", encoding="ascii")
    assert _meminfo_available(str(meminfo)) == 1234 * 1024
    for bad in ("lots", "-1GiB", "0GiB"):
        with pytest.raises(RecipeError, match=rf"`memory.host_budget`.*{bad}"):
            load_recipe(causal_recipe(tmp_path, tiny_text_file, memory={"host_budget": bad}))


def test_the_cli_shows_host_bytes_against_the_host_budget_and_exits_2_on_a_bad_one(
        tmp_path: Path, tiny_text_file: Path) -> None:
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(causal_recipe(tmp_path, tiny_text_file)), encoding="utf-8")
    runner = CliRunner()
    shown = runner.invoke(app, ["estimate", str(path), "--device", "cuda", "memory.offload.embeddings=true",
                                "memory.host_budget=1MiB"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "host budget" in shown.output and "does not fit the host" in shown.output
    assert "memory.host_budget` 1MiB" in shown.output
    bad = runner.invoke(app, ["plan", str(path), "--device", "cuda", "memory.host_budget=lots"])
    assert bad.exit_code == 2 and "memory.host_budget" in bad.output
