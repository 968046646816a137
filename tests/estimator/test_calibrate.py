"""``memtrain calibrate``: speed rates anywhere, GPU overheads on a GPU, a profile the estimator reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.estimator import calibrate


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_calibration_measures_rates_and_explains_missing_gpu(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    profile = calibrate.calibrate(path, quick=True)
    saved = json.loads(path.read_text())
    assert saved["overheads"] is None
    assert any("no CUDA device" in note for note in saved["notes"])
    rates = saved["rates"]["cpu"]
    assert rates["matmul_flops"]["fp32"] > 1e8 and rates["matmul_flops"]["bf16"] > 0
    assert rates["memory_bandwidth"] > 1e8
    assert profile["path"] == str(path)
    # No GPU numbers were saved, so the estimator keeps its documented defaults.
    defaults = calibrate.overheads(path)
    assert defaults.cuda_context_bytes == calibrate.DEFAULT_CUDA_CONTEXT
    assert defaults.fragmentation == calibrate.DEFAULT_FRAGMENTATION
    assert "default" in defaults.cuda_context_source


def test_profile_location_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "elsewhere.json"
    monkeypatch.setenv(calibrate.ENV_VAR, str(target))
    assert calibrate.profile_path() == target
    measured_on_gpu = {"device": "GPU X", "cuda_context_bytes": 123, "fragmentation": 0.3}
    target.write_text(json.dumps({"overheads": measured_on_gpu}))
    measured = calibrate.overheads()
    assert (measured.cuda_context_bytes, measured.fragmentation) == (123, 0.3)
    assert "GPU X" in measured.fragmentation_source
    target.write_text("not json")
    assert calibrate.overheads().cuda_context_bytes == calibrate.DEFAULT_CUDA_CONTEXT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cli_calibrate_exits_cleanly_without_a_gpu(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from memtrain.cli.app import app

    result = CliRunner().invoke(app, ["calibrate", "--output", str(tmp_path / "p.json"), "--quick"])
    assert result.exit_code == 0, result.output
    assert "cannot be measured" in result.stdout and "matmul fp32" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_calibration_measures_overheads(tmp_path: Path) -> None:
    profile = calibrate.calibrate(tmp_path / "p.json", quick=True)
    assert 0 <= profile["overheads"]["fragmentation"] < 2
    assert profile["rates"]["cuda"]["host_to_device_bandwidth"] > 0


def test_optimizer_rate_is_seconds_per_updated_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    # One optimizer step "takes" 1 s: the rate must divide it by every parameter the step updated.
    counted = []

    def one_second(fn: Any, device: torch.device, repeats: int = 5) -> float:
        counted.append(sum(p.numel() for group in fn.__self__.param_groups for p in group["params"]))
        return 1.0

    monkeypatch.setattr(calibrate, "_best_time", one_second)
    rates = calibrate._optimizer_rates(torch.device("cpu"), quick=True)
    assert counted and rates["adamw"] == pytest.approx(1.0 / counted[0])
    assert counted[0] == 2 * 2**20 * 4  # four tensors of 2 Mi elements each


def test_profiles_saved_with_older_rates_are_measured_again(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.plan import costmodel

    path = tmp_path / "p.json"
    old = {"op_seconds": 1e-6, "threads": torch.get_num_threads(), "matmul_flops": {"fp32": 1.0}}
    path.write_text(json.dumps({"version": 1, "rates": {"cpu": old}}))
    monkeypatch.setenv(calibrate.ENV_VAR, str(path))
    monkeypatch.setattr(calibrate, "measure_rates", lambda device, quick=False: {
        "version": calibrate.RATES_VERSION, "threads": torch.get_num_threads(), "op_seconds": 2e-6})
    costmodel.rates.cache_clear()
    try:
        assert costmodel.rates("cpu").values["op_seconds"] == 2e-6  # re-measured, not the old profile
        assert json.loads(path.read_text())["rates"]["cpu"]["version"] == calibrate.RATES_VERSION
    finally:
        costmodel.rates.cache_clear()


@pytest.mark.parametrize("text", [
    '{"rates": "x"}', "[1, 2]", "{bad json", '{"rates": {"cpu": 3}}',
    '{"overheads": {"fragmentation": "lots"}}', '{"overheads": [1]}',
    "RATES",  # today's version and threads, a rate missing
    "BOOL",  # today's version and threads, a rate that is not a number
])
def test_a_profile_not_in_calibrates_shape_is_measured_again_not_a_crash(
        text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A hand-edited or truncated profile crashed the plan (`'str' object has no attribute 'get'`,
    a KeyError on a missing rate): it is said, ignored and measured again. Planted: either check off
    -> the shapes it guards fail."""
    import logging

    from memtrain.plan import costmodel

    assets = Path(__file__).parents[1] / "assets"
    committed = json.loads((assets / "calibration.json").read_text())["rates"]["cpu"]
    whole = {**committed, "version": calibrate.RATES_VERSION, "threads": torch.get_num_threads()}
    if text in ("RATES", "BOOL"):
        broken = {k: v for k, v in whole.items() if k != "memory_bandwidth"} if text == "RATES" else \
            {**whole, "op_seconds": True}
        text = json.dumps({"version": 1, "rates": {"cpu": broken}})
    path = tmp_path / "p.json"
    path.write_text(text)
    monkeypatch.setenv(calibrate.ENV_VAR, str(path))
    monkeypatch.setattr(calibrate, "measure_rates", lambda device, quick=False: whole)
    costmodel.rates.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            rates = costmodel.rates("cpu")
            overheads = calibrate.overheads()
        assert rates.source.startswith("measured now") and rates.values == whole
        assert overheads.cuda_context_bytes == calibrate.DEFAULT_CUDA_CONTEXT
        if "rates" not in text or '"cpu": {' not in text:  # unreadable as a whole: said, naming the file
            assert f"the calibration profile {path} cannot be used" in caplog.text
        assert json.loads(path.read_text())["rates"]["cpu"] == whole  # saved over it
    finally:
        costmodel.rates.cache_clear()


def test_the_suite_plans_with_the_committed_rates_never_the_users_profile(fixed_calibration: Path) -> None:
    """conftest's session fixture: no test depends on this machine's speed or a user's cache."""
    from memtrain.plan import costmodel

    assert calibrate.profile_path() == fixed_calibration
    assert Path.home() / ".cache" not in fixed_calibration.parents
    committed = json.loads((Path(__file__).parents[1] / "assets" / "calibration.json").read_text())
    costmodel.rates.cache_clear()
    assert costmodel.rates("cpu").values["op_seconds"] == committed["rates"]["cpu"]["op_seconds"]
    assert costmodel.rates("cpu").source == f"measured by `memtrain calibrate` ({fixed_calibration})"
