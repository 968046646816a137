"""memtrain/_compat's shims on the installed versions, and the error a missing private name gives
(issue 35): it names the shim, the installed version and the tested range."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memtrain._compat import versions
from memtrain._compat.versions import CompatError

SHIMS = ("versions", "torch_trackers", "torch_tools", "torch_fake", "torch_distributed", "transformers_model",
         "transformers_trainer", "trl", "peft", "accelerate", "datasets")


@pytest.mark.parametrize("name", SHIMS)
def test_every_shim_imports_on_the_installed_versions(name: str) -> None:
    importlib.import_module(f"memtrain._compat.{name}")


def test_versions_compare_at_the_precision_of_each_bound() -> None:
    assert versions.in_range("2.13.0+cpu", "2.10", "2.15")
    assert versions.in_range("1.16.3", "1.16", "1.16")
    assert not versions.in_range("1.10.0", "1.10.1", "1.15.0")
    assert not versions.in_range("2.16.0", "2.10", "2.15")
    assert not versions.in_range("2.9.1", "2.10", "2.15")
    assert versions.in_range("2.15.0rc1", "2.10", "2.15")


def test_the_installed_set_is_inside_the_tested_range() -> None:
    assert versions.outside_range() == {}


def _pins(leg: str) -> dict[str, str]:
    path = Path(__file__).parents[2] / "scripts" / "versions" / f"{leg}.txt"
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


@pytest.mark.parametrize("leg", ["pinned", "floor", "newest"])
def test_each_pin_list_names_every_tested_library_inside_its_range(leg: str) -> None:
    pins = _pins(leg)
    assert sorted(pins) == sorted(versions.TESTED)
    outside = {p: v for p, v in pins.items() if not versions.in_range(v, *versions.TESTED[p])}
    assert outside == {}, f"scripts/versions/{leg}.txt pins outside TESTED: {outside}"


def test_the_set_up_installs_the_highest_tested_version_but_for_torch() -> None:
    """scripts/setup.sh holds CI to pinned.txt, so a later release cannot change what it runs; the
    pins are the tops of the tested range (torch: the CPU wheel, 2.13.0)."""
    pins = _pins("pinned")
    assert pins.pop("torch") == "2.13.0"
    top = {p: high for p, (_, high) in versions.TESTED.items()}
    below = {p: v for p, v in pins.items() if not versions.in_range(v, top[p], top[p])}
    assert below == {}, f"scripts/versions/pinned.txt below the top of TESTED: {below}"


def test_a_version_outside_the_range_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(versions, "installed", lambda p: {"transformers": "5.30.0"}.get(p, "0"))
    monkeypatch.setattr(versions, "TESTED", {"transformers": ("5.19", "5.24")})
    with caplog.at_level(logging.WARNING, logger="memtrain"):
        first = versions.check_versions()
        again = versions.check_versions()
    assert len(first) == 1 and again == []
    assert "transformers 5.19–5.24; 5.30.0 is installed" in first[0]
    assert [r.getMessage() for r in caplog.records] == first


def _expect_clear_error(err: pytest.ExceptionInfo[CompatError], shim: str, package: str, what: str) -> None:
    message = str(err.value)
    have = versions.installed(package)
    assert message.startswith(f"memtrain._compat.{shim}: {package} {have} has no {what}"), message
    assert f"(checked on {package} {versions.span(package)})" in message


def test_a_private_method_gone_from_the_trainer_names_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain._compat import transformers_trainer as shim

    trainer = SimpleNamespace()  # a Trainer whose transformers has no _prepare_inputs
    with pytest.raises(CompatError) as err:
        shim.prepare_inputs(trainer, {})
    _expect_clear_error(err, "transformers_trainer.prepare_inputs", "transformers",
                        "SimpleNamespace._prepare_inputs")
    with pytest.raises(CompatError) as err:
        shim.set_loss_scaled_for_ga(trainer, False)
    _expect_clear_error(err, "transformers_trainer.set_loss_scaled_for_ga", "transformers",
                        "Trainer.loss_is_scaled_for_ga")

    from transformers import Trainer

    monkeypatch.delattr(Trainer, "_save_checkpoint")
    shim._check_hooks.cache_clear()
    try:
        with pytest.raises(CompatError) as err:
            shim.TrainerHooks()
        _expect_clear_error(err, "transformers_trainer.TrainerHooks", "transformers",
                            "Trainer._save_checkpoint")
    finally:
        shim._check_hooks.cache_clear()


def test_a_tracker_hook_gone_from_torch_names_the_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from memtrain._compat import torch_trackers as shim

    monkeypatch.delattr(MemTracker, "_update_snap")
    shim._check.cache_clear()
    try:
        with pytest.raises(CompatError) as err:
            shim.MemTrackerBase()
        _expect_clear_error(err, "torch_trackers", "torch", "MemTracker._update_snap")
    finally:
        shim._check.cache_clear()


def test_the_trackers_public_names_reach_torchs_state() -> None:
    from memtrain._compat.torch_trackers import TOTAL_KEY, MemRefType, MemTrackerBase

    tracker = MemTrackerBase()
    with tracker:
        assert tracker.depth == 1
        x = torch.ones(256)
        tracker.track_tensor(x, MemRefType.OTH)
        assert tracker.current_snapshot[x.device][TOTAL_KEY] >= 1024
        assert tracker.storage_info(x.untyped_storage()).mem_consumed >= 1024
        assert not tracker.in_recompute and tracker.recompute_module is None
    assert tracker.depth == 0


def test_dpo_and_peft_shims_name_what_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import DPOTrainer

    from memtrain._compat import peft as peft_shim
    from memtrain._compat import trl as trl_shim

    monkeypatch.delattr(DPOTrainer, "_compute_loss")
    with pytest.raises(CompatError) as err:
        trl_shim.dpo_loss(torch.nn.Linear(2, 2), beta=0.1, loss_types=["sigmoid"], precompute_ref_logps=False)
    _expect_clear_error(err, "trl.dpo_loss", "trl", "DPOTrainer._compute_loss")
    with pytest.raises(CompatError) as err:
        peft_shim.check_forward_args(torch.nn.Linear(2, 2), torch.ones(2))
    _expect_clear_error(err, "peft.check_forward_args", "peft", "Linear._check_forward_args")


def test_torch_tools_work_on_the_installed_torch() -> None:
    from memtrain._compat import torch_tools

    assert torch_tools.overload_packet(torch.ops.aten.mm.default) is torch.ops.aten.mm
    x = torch.ones(4, requires_grad=True)
    view = x[:2]
    assert torch_tools.tensor_base(view) is x and torch_tools.tensor_version(x) == 0
    assert torch_tools.clear_cublas_workspaces() in (True, False)
    assert torch_tools.private_op("_local_scalar_dense") is torch.ops.aten._local_scalar_dense.default
    with pytest.raises(CompatError) as err:
        torch_tools.private_op("_no_such_op_in_torch")
    assert "memtrain._compat.torch_tools.private_op: torch" in str(err.value)
    linear = torch.nn.Linear(2, 2)
    params, buffers = torch_tools.module_tensor_tables(linear)
    assert set(params) == {"weight", "bias"} and buffers == {}


def test_a_module_run_inside_its_own_forward_asks_no_one_to_file_a_bug() -> None:
    """torch's ModTracker warns "Please file a bug to PyTorch" when a module runs again inside its own
    forward (19 of 28 training runs of newer families in one pass: SmolLM3, Qwen3.5, LFM2); the
    memory counted is right and the user can do nothing about it, so memtrain silences it."""
    import warnings

    import torch
    from torch import nn

    from memtrain._compat.torch_trackers import ReleasableModTracker

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, again: bool = True) -> torch.Tensor:
            return self(self.inner(x), again=False) if again else self.inner(x)

    with warnings.catch_warnings(record=True) as seen, ReleasableModTracker():
        Twice()(torch.ones(2, 4))
    assert not [w for w in seen if "file a bug" in str(w.message)], [str(w.message) for w in seen]


def test_the_set_up_also_holds_what_the_pinned_set_pulls_in() -> None:
    """A fresh set-up installs the huggingface_hub and kernels it was checked with (transformers 5.25
    needs hub 2.x and turns Hub kernels on through `kernels`): both installs of scripts/setup.sh are
    constrained by scripts/versions/pinned-indirect.txt, exact pins, none of a library TESTED holds."""
    root = Path(__file__).parents[2]
    setup = (root / "scripts" / "setup.sh").read_text()
    assert "indirect=scripts/versions/pinned-indirect.txt" in setup
    installs = [line for line in setup.splitlines() if "pip install -q -c" in line]
    assert len(installs) == 2 and all('-c "$indirect"' in line for line in installs)
    pins = _pins("pinned-indirect")
    assert set(pins) == {"huggingface_hub", "kernels"} and not set(pins) & set(versions.TESTED)
    assert all(re.fullmatch(r"\d+(\.\d+)+", v) for v in pins.values())
