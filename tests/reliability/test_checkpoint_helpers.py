"""The checkpoint writer's and reader's helpers, one at a time, on folders made by hand (no training).

Written for the mutants of ``memtrain/reliability/checkpoints.py`` that
tests/reliability/test_reliability.py's end-to-end runs let survive (docs/bench/mutation.md): a
damaged file of each kind the reader knows, the manifest's contents, the stray folders resume passes
over, the size a save needs and the disk-full message, a full disk found through an exception chain,
the sync of subfolders.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memtrain.reliability import checkpoints
from memtrain.reliability.checkpoints import (
    DISK_SLACK,
    MANIFEST,
    DiskFull,
    check_disk_space,
    checkpoint_bytes,
    expected_bytes,
    folder_bytes,
    is_disk_full,
    newest_finite,
    sync_tree,
    usable_checkpoint,
    verify,
    weights_finite,
    write_manifest,
)
from memtrain.units import format_bytes

MARK = torch.full((64,), 7.0)  # its bytes (00 00 e0 40, repeated) are easy to find in a torch file


def _checkpoint(folder: Path, finite: bool = True, **files: bytes) -> Path:
    """A checkpoint folder as the writer leaves it: trainer state, ``files``, then the manifest."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text('{"global_step": 3}', encoding="utf-8")
    for name, data in files.items():
        (folder / name.replace("__", ".")).write_bytes(data)
    write_manifest(folder, finite, 3, 12.5)
    return folder


def _torch_bytes(tmp_path: Path) -> bytes:
    torch.save({"state": MARK}, tmp_path / "scratch.pt")
    return (tmp_path / "scratch.pt").read_bytes()


def _safetensors_bytes(tmp_path: Path) -> bytes:
    from safetensors.torch import save_file

    save_file({"w": MARK}, str(tmp_path / "scratch.safetensors"))
    return (tmp_path / "scratch.safetensors").read_bytes()


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize("suffix", ["pt", "pth", "bin"])
def test_a_torch_file_damaged_in_place_is_found_by_its_checksums(tmp_path: Path, suffix: str) -> None:
    """Same size, so the manifest cannot tell: a flipped data byte fails the zip's CRC, a broken
    directory makes it no zip at all (each of torch's three suffixes)."""
    data = _torch_bytes(tmp_path)
    in_data = data.index(b"\x00\x00\xe0\x40" * 4) + 9
    ckpt = _checkpoint(tmp_path / "a", **{f"optimizer__{suffix}": _flip(data, in_data)})
    assert verify(ckpt) == f"optimizer.{suffix} is damaged (member scratch/data/0 fails its checksum)"
    ckpt = _checkpoint(tmp_path / "b", **{f"optimizer__{suffix}": data[:-22] + bytes(22)})
    assert verify(ckpt) == f"optimizer.{suffix} is not a complete torch file"


def test_damaged_safetensors_json_and_empty_files_are_named(tmp_path: Path) -> None:
    weights = _safetensors_bytes(tmp_path)
    ckpt = _checkpoint(tmp_path / "a", adapter__safetensors=weights[:8] + b"x" + weights[9:])
    assert (verify(ckpt) or "").startswith("adapter.safetensors cannot be read (")
    ckpt = _checkpoint(tmp_path / "b", adapter_config__json=b'{"r": 8]')
    assert verify(ckpt) == "adapter_config.json is not valid JSON"
    ckpt = _checkpoint(tmp_path / "c", notes__txt=b"")
    assert verify(ckpt) == "notes.txt is empty (0 bytes)"
    assert verify(_checkpoint(tmp_path / "d", adapter__safetensors=weights, notes__txt=b"ok")) is None


def test_verify_names_what_is_missing_short_or_not_finite(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "a", optimizer__pt=_torch_bytes(tmp_path))
    (ckpt / "trainer_state.json").unlink()
    assert verify(ckpt) == "trainer_state.json is missing or unreadable (an incomplete save)"
    ckpt = _checkpoint(tmp_path / "b", optimizer__pt=_torch_bytes(tmp_path))
    (ckpt / "optimizer.pt").unlink()
    assert verify(ckpt) == "optimizer.pt is missing"
    ckpt = _checkpoint(tmp_path / "c", optimizer__pt=_torch_bytes(tmp_path))
    (ckpt / "optimizer.pt").write_bytes(b"short")
    size = len(_torch_bytes(tmp_path))
    assert verify(ckpt) == f"optimizer.pt has 5 bytes, {size} were written (truncated or damaged)"
    assert verify(_checkpoint(tmp_path / "d", finite=False)) == "its trained weights are NaN or infinite"


def test_progress_reads_the_step_and_the_training_seconds_saved(tmp_path: Path) -> None:
    """A resumed run's clock starts from the manifest's seconds (mutmut: its key was only caught
    when the resumed half of a real run happened to be shorter than the first)."""
    assert checkpoints.progress(_checkpoint(tmp_path / "checkpoint-3")) == (3, 12.5)


def test_the_manifest_lists_every_file_and_only_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "sub" / "x.json").write_text("{}", encoding="utf-8")
    (ckpt / "trainer_state.json").write_text("{}", encoding="utf-8")
    (ckpt / MANIFEST).write_text("{}", encoding="utf-8")  # a stale one is never listed
    write_manifest(ckpt, True, 3, 12.5)
    written = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
    assert written == {"step": 3, "finite": True, "train_runtime": 12.5,
                       "files": {"sub/x.json": 2, "trainer_state.json": 2}}


def test_resume_passes_over_empty_folders_and_names_incomplete_ones(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-2").mkdir()  # an empty stray folder: not a checkpoint, not named
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "optimizer.pt").write_bytes(b"x")  # a save cut short
    _checkpoint(tmp_path / "checkpoint-4", finite=False)
    unlisted = _checkpoint(tmp_path / "checkpoint-5")
    (unlisted / MANIFEST).unlink()
    assert usable_checkpoint(tmp_path) == (good, [
        f"checkpoint-5: {MANIFEST} is missing or unreadable (not a complete memtrain save: it is "
        "written before a checkpoint is published)",
        "checkpoint-4: its trained weights are NaN or infinite",
        "checkpoint-3: trainer_state.json is missing or unreadable (an incomplete save)"])
    assert newest_finite(tmp_path) == good


def test_the_size_a_save_needs(tmp_path: Path) -> None:
    """Trained weights only when some are frozen (all otherwise), plus the optimizer's state,
    also through a wrapper (accelerate's ``AcceleratedOptimizer`` keeps it in ``.optimizer``)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    assert checkpoint_bytes(model, optimizer) == 10 * 4  # no state before the first step
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = 2 * 10 * 4 + 2 * 4  # exp_avg and exp_avg_sq of 10 parameters, a step count per tensor
    assert checkpoint_bytes(model, optimizer) == 10 * 4 + state
    assert checkpoint_bytes(model, SimpleNamespace(optimizer=optimizer)) == 10 * 4 + state
    model[0].requires_grad_(True)
    assert checkpoint_bytes(model, None) == 30 * 4

    assert folder_bytes(None) == 0
    _checkpoint(tmp_path / "checkpoint-2", optimizer__pt=b"x" * 1000)
    on_disk = folder_bytes(tmp_path / "checkpoint-2")
    assert on_disk == sum(p.stat().st_size for p in (tmp_path / "checkpoint-2").iterdir())
    assert expected_bytes(tmp_path, 10) == on_disk
    assert expected_bytes(tmp_path, 10**6) == 10**6


def test_too_little_space_names_the_numbers_and_what_is_kept(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    usage = checkpoints.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    folder = tmp_path / "not" / "yet"  # created, parents too
    with pytest.raises(DiskFull) as err:
        check_disk_space(folder, 10**6, "checkpoint-1")
    assert str(err.value) == (
        f"Disk full: not enough space to save checkpoint-1: it needs about "
        f"{format_bytes(10**6 * DISK_SLACK)}, and {folder} has {format_bytes(1000)} free. No checkpoint "
        "had been saved yet. Fix: free some space, lower `training.save_total_limit`, or point "
        "`output.dir` to a larger disk; then add `training.resume=true` to continue.")
    check_disk_space(folder, 900, "checkpoint-1")  # 990 bytes with the slack: fits


def test_a_full_disk_is_found_behind_other_errors() -> None:
    def failing(explicit: bool) -> BaseException:
        try:
            try:
                raise OSError(errno.ENOSPC, "write failed")
            except OSError as inner:
                if explicit:
                    raise RuntimeError("saving the optimizer failed") from inner
                raise RuntimeError("saving the optimizer failed")  # noqa: B904 (implicit chain)
        except RuntimeError as err:
            return err
        raise AssertionError("unreachable")

    assert is_disk_full(failing(explicit=True)) and is_disk_full(failing(explicit=False))
    assert not is_disk_full(RuntimeError("saving the optimizer failed"))


def test_weights_finite_looks_at_trained_weights_only() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert weights_finite(model) is True
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert weights_finite(model) is False
    model[0].requires_grad_(False)  # a frozen base's values are not the run's to check
    assert weights_finite(model) is True


def test_sync_tree_syncs_subfolders_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    (tmp_path / "ckpt" / "sub" / "x.bin").write_bytes(b"x")
    synced: set[int] = set()
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.fstat(fd).st_ino), real(fd))[1])
    sync_tree(tmp_path / "ckpt")
    assert {p.stat().st_ino for p in (tmp_path / "ckpt", tmp_path / "ckpt" / "sub",
                                      tmp_path / "ckpt" / "sub" / "x.bin")} <= synced
