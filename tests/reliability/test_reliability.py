"""Nothing lost: finished runs, foreign folders, overwrite, full disks, damaged and NaN checkpoints.

Each test builds its own fault; docs/reliability.md lists what each one proves.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import causal_recipe
from transformers import Trainer, TrainerCallback

from memtrain.config import load_recipe
from memtrain.errors import MemtrainError
from memtrain.reliability import checkpoints
from memtrain.reliability.checkpoints import MANIFEST, STAGING, DiskFull, publish, verify
from memtrain.run.train import train


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": f"now is the winter of our discontent {i}"}) for i in range(64))
    )
    return path


class Steps(TrainerCallback):
    """Records the optimizer steps that ran."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ran.append(state.global_step)


SAVING = {"training": {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}}


def test_resume_on_a_finished_run_refuses_and_keeps_it(tmp_path: Path, corpus: Path) -> None:
    recipe = causal_recipe(tmp_path, corpus, training={"max_steps": 2})
    train(load_recipe(recipe))
    out = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(
        MemtrainError, match=r"`training.resume`: .* holds a finished run .*nothing to resume"
    ):
        train(load_recipe(recipe, ["training.resume=true"]))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    with pytest.raises(MemtrainError, match="already holds a finished run") as err:
        train(load_recipe(recipe))
    assert "training.resume=true" not in str(err.value)  # the old advice retrained from scratch


def test_a_folder_with_user_files_is_refused_unless_told(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    (out / "recipe.yaml").write_text("my recipe")
    recipe = causal_recipe(tmp_path, corpus, output={"dir": str(out)})
    with pytest.raises(
        MemtrainError, match=r"`output.dir`: .* not a memtrain run \(README.md, recipe.yaml\)"
    ):
        train(load_recipe(recipe))
    assert (out / "recipe.yaml").read_text() == "my recipe"
    result = train(load_recipe(recipe, ["output.overwrite=true", "training.max_steps=1"]))
    assert (result.output_dir / "metrics.json").exists() and (out / "README.md").exists()


def test_overwrite_deletes_nothing_before_the_data_is_valid(tmp_path: Path, corpus: Path) -> None:
    train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING)))
    out = tmp_path / "run"
    kept = sorted(p.name for p in out.iterdir())
    assert "checkpoint-4" in kept and "metrics.json" in kept
    with pytest.raises(MemtrainError, match=r"data\.text_column"):
        train(
            load_recipe(
                causal_recipe(tmp_path, corpus, **SAVING), ["output.overwrite=true", "data.text_column=body"]
            )
        )
    assert sorted(p.name for p in out.iterdir()) == kept
    steps = Steps()
    train(
        load_recipe(causal_recipe(tmp_path, corpus, **SAVING), ["output.overwrite=true"]), callbacks=[steps]
    )
    assert steps.ran == [1, 2, 3, 4]  # a fresh run, once it got going


def test_micro_batch_auto_without_a_budget_is_refused(tmp_path: Path, corpus: Path) -> None:
    cfg = load_recipe(
        causal_recipe(tmp_path, corpus),
        [
            "training.micro_batch_size=auto",
            "training.gradient_accumulation=null",
            "training.effective_batch_size=32",
        ],
    )
    with pytest.raises(MemtrainError, match=r"`training.micro_batch_size`: `auto` .* no budget is set"):
        train(cfg)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------- the disk


def _enospc_on_second_save(monkeypatch: pytest.MonkeyPatch) -> None:
    saves = {"n": 0}
    real = Trainer._save_rng_state

    def fill_the_disk(self, output_dir):
        saves["n"] += 1
        if saves["n"] == 2:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 31835136 vs 31835024"
            )
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", fill_the_disk)


def test_disk_full_in_a_checkpoint_says_so_and_keeps_the_previous(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _enospc_on_second_save(monkeypatch)
    with pytest.raises(DiskFull, match=r"Disk full while saving checkpoint-4 .*checkpoint-2, is intact"):
        train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING)))
    out = tmp_path / "run"
    assert verify(out / "checkpoint-2") is None
    assert not (out / "checkpoint-4").exists() and not (out / STAGING / "checkpoint-4").exists()


def test_disk_full_at_the_final_save_keeps_the_checkpoint_and_resume_finishes(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Trainer.save_model

    def full(self, output_dir=None, _internal_call=False):
        if str(output_dir).endswith(".final-tmp"):
            raise OSError(28, "No space left on device")
        return real(self, output_dir, _internal_call)

    monkeypatch.setattr(Trainer, "save_model", full)
    with pytest.raises(DiskFull, match=r"Disk full while saving the final model.*checkpoint-4, is intact"):
        train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING)))
    out = tmp_path / "run"
    assert not (out / "metrics.json").exists() and not (out / ".final-tmp").exists()
    monkeypatch.setattr(Trainer, "save_model", real)
    steps = Steps()
    train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING), ["training.resume=true"]), callbacks=[steps])
    assert (
        steps.ran == [] and (out / "metrics.json").exists() and (out / "adapter_model.safetensors").exists()
    )


def test_the_free_space_check_uses_the_last_checkpoint_size(
    tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Estimates can be low; the check before every save also asks for the newest one's size."""
    monkeypatch.setattr(checkpoints, "checkpoint_bytes", lambda model, optimizer: 1)
    usage = shutil.disk_usage(tmp_path)
    free = {"bytes": usage.free}

    class Fill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            size = checkpoints.folder_bytes(tmp_path / "run" / f"checkpoint-{state.global_step}")
            free["bytes"] = size  # now less than a checkpoint + 10%

    monkeypatch.setattr(
        "memtrain.reliability.checkpoints.shutil.disk_usage", lambda path: usage._replace(free=free["bytes"])
    )
    with pytest.raises(
        DiskFull, match=r"Disk full: not enough space to save checkpoint-4.*checkpoint-2, is intact"
    ):
        train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING)), callbacks=[Fill()])
    assert verify(tmp_path / "run" / "checkpoint-2") is None


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("checked", [True, False], ids=["checked-before", "write-fails"])
def test_fill_a_real_disk(
    tmp_path: Path, corpus: Path, small_tmpfs: Path, checked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real full file system: a 'disk full' message, the previous checkpoint intact."""
    if not checked:  # the write itself hits ENOSPC
        monkeypatch.setattr(checkpoints, "check_disk_space", lambda *args: None)

    class Fill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                left = shutil.disk_usage(small_tmpfs).free
                size = checkpoints.folder_bytes(small_tmpfs / "run" / "checkpoint-2")
                (small_tmpfs / "filler").write_bytes(b"\0" * max(left - size // 2, 0))

    recipe = causal_recipe(
        tmp_path, corpus, output={"dir": str(small_tmpfs / "run"), "report": False}, **SAVING
    )
    with pytest.raises(DiskFull, match="Disk full"):
        train(load_recipe(recipe), callbacks=[Fill()])
    assert verify(small_tmpfs / "run" / "checkpoint-2") is None
    assert not (small_tmpfs / "run" / "checkpoint-4").exists()


def test_checkpoints_are_synced_before_they_are_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged = tmp_path / STAGING / "checkpoint-1"
    staged.mkdir(parents=True)
    for name in ("a.bin", "b.json"):
        (staged / name).write_bytes(b"x")
    events: list[str] = []
    real_fsync, real_rename = os.fsync, Path.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        Path, "rename", lambda self, target: (events.append("rename"), real_rename(self, target))[1]
    )
    publish(staged, tmp_path / "checkpoint-1")
    assert events.index("rename") >= 3  # two files and their folder synced first
    assert events[-1] == "fsync"  # then the parent folder, so the rename itself is durable


# --------------------------------------------------------------------------------- resume


def test_resume_skips_a_damaged_newest_checkpoint(
    tmp_path: Path, corpus: Path, caplog: pytest.LogCaptureFixture
) -> None:
    recipe = causal_recipe(tmp_path, corpus, **SAVING)
    train(load_recipe(recipe))
    out = tmp_path / "run"
    (out / "metrics.json").unlink()  # as if killed before the final save
    (out / "checkpoint-4" / "scheduler.pt").write_bytes(b"")  # a 0-byte file (the "Aborted!")
    assert "scheduler.pt" in (verify(out / "checkpoint-4") or "")
    steps = Steps()
    with caplog.at_level(logging.WARNING):
        train(load_recipe(recipe, ["training.resume=true"]), callbacks=[steps])
    assert steps.ran == [3, 4]
    assert "checkpoint-4: scheduler.pt" in caplog.text and "resuming from checkpoint-2" in caplog.text
    assert verify(out / "checkpoint-4") is None  # saved again, complete


def test_resume_with_no_usable_checkpoint_says_why(tmp_path: Path, corpus: Path) -> None:
    recipe = causal_recipe(tmp_path, corpus, **SAVING)
    train(load_recipe(recipe))
    out = tmp_path / "run"
    (out / "metrics.json").unlink()
    for name in ("checkpoint-2", "checkpoint-4"):
        weights = out / name / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(
        MemtrainError,
        match=r"no checkpoint .* can be resumed from: checkpoint-4: "
        r"adapter_model.safetensors has 100 bytes",
    ):
        train(load_recipe(recipe, ["training.resume=true"]))
    with pytest.raises(MemtrainError, match="cannot be resumed from"):
        train(load_recipe(recipe, [f"training.resume={out / 'checkpoint-2'}"]))


def test_a_damaged_file_is_found_by_loading_and_a_checkpoint_without_manifest_is_refused(
        tmp_path: Path, corpus: Path) -> None:
    train(load_recipe(causal_recipe(tmp_path, corpus, **SAVING)))
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert verify(ckpt) is None
    data = bytearray((ckpt / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, so the manifest cannot tell: the zip's checksums do
    (ckpt / "optimizer.pt").write_bytes(bytes(data))
    assert "optimizer.pt is damaged" in (verify(ckpt) or "")
    (ckpt / MANIFEST).unlink()  # published before its manifest was written (or not memtrain's)
    assert f"{MANIFEST} is missing" in (verify(ckpt) or "")


# ---------------------------------------------------------------------------------- NaN weights


class PoisonWeights(TrainerCallback):
    """Makes every LoRA weight NaN at the end of one step (losses stay NaN from then on)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.fill_(float("nan"))


def test_nan_weights_never_make_a_good_checkpoint(tmp_path: Path, corpus: Path) -> None:
    sections = {
        "training": {
            "max_steps": 12,
            "save_strategy": "steps",
            "save_steps": 2,
            "save_total_limit": 2,
            "max_nonfinite_steps": 2,
        }
    }
    with pytest.raises(MemtrainError, match=r"checkpoint with finite weights is \S*checkpoint-2\."):
        train(load_recipe(causal_recipe(tmp_path, corpus, **sections)), callbacks=[PoisonWeights(3)])
    out = tmp_path / "run"
    assert verify(out / "checkpoint-2") is None  # kept out of rotation
    assert verify(out / "checkpoint-6") == "its trained weights are NaN or infinite"
    assert not (out / "checkpoint-4").exists()  # a NaN one rotated out instead
    assert checkpoints.usable_checkpoint(out)[0] == out / "checkpoint-2"


# ------------------------------------------------------------------------------ resumed metrics


def test_a_resumed_run_reports_the_whole_run(tmp_path: Path, corpus: Path) -> None:
    sections = {"training": {"max_steps": 6, "save_strategy": "steps", "save_steps": 3, "logging_steps": 1}}
    whole = train(load_recipe(causal_recipe(tmp_path / "whole", corpus, **sections)))
    recipe = causal_recipe(
        tmp_path, corpus, output={"dir": str(tmp_path / "run"), "report": True}, **sections
    )

    with pytest.raises(KeyboardInterrupt):
        train(load_recipe(recipe), callbacks=[StopAtSave()])
    out = tmp_path / "run"
    assert (out / "checkpoint-3").is_dir() and not (out / "metrics.json").exists()
    resumed = train(load_recipe(recipe, ["training.resume=true"]))
    assert resumed.metrics["resumed_from_step"] == 3
    assert resumed.metrics["train_loss"] == pytest.approx(whole.metrics["train_loss"], rel=1e-4)
    assert (
        resumed.metrics["train_runtime"]
        > json.loads((out / "checkpoint-3" / MANIFEST).read_text())["train_runtime"]
    )
    assert (out / "memory_report.json").exists()


class StopAtSave(TrainerCallback):
    """A crash just after the first checkpoint is saved."""

    def on_save(self, args, state, control, **kwargs):
        raise KeyboardInterrupt
