"""One checkpoint writer and one checkpoint reader: nothing memtrain calls good is broken.

Writing (:func:`write_checkpoint`, also used for the final save through :func:`disk_full_as_error`):

- free space is checked before every save against the larger of the estimated size and the size
  of the newest checkpoint already on disk;
- the Trainer writes into ``<output>/.staging/checkpoint-N``; a manifest (:data:`MANIFEST`)
  records every file's size and whether the trained weights were finite;
- every file and folder is fsync'ed, then the folder is renamed into place (atomic on one file
  system) and its parent synced, so a power loss cannot leave a checkpoint that only looks complete;
- a full disk ends in :class:`DiskFull` ("disk full", the checkpoint that is kept, the fix) with the
  staged files removed; earlier checkpoints are never touched;
- rotation (``training.save_total_limit``) never deletes the newest checkpoint with finite weights.

Reading (:func:`usable_checkpoint`): checkpoints newest first; each is verified (:func:`verify`:
complete against its manifest, every file readable, finite weights; no manifest, no resume) and
the first good one is used; the ones skipped are named, with the reason.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from memtrain.errors import MemtrainError, first_line
from memtrain.units import format_bytes

log = logging.getLogger(__name__)

STAGING = ".staging"
MANIFEST = "memtrain_manifest.json"
DISK_SLACK = 1.10  # 10% headroom over the expected checkpoint size
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_DISK_FULL_TEXT = ("no space left", "storagefull", "os error 28", "unexpected pos", "disk quota")


class DiskFull(MemtrainError):
    """A save did not fit on the disk; what was saved before is intact."""


# ------------------------------------------------------------------------------------- listing


def checkpoint_dirs(folder: str | Path) -> list[Path]:
    """Every ``checkpoint-N`` folder in ``folder``, newest (highest N) first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def last_complete_checkpoint(folder: str | Path) -> Path | None:
    """The highest ``checkpoint-N`` in ``folder`` that holds ``trainer_state.json``."""
    return next((p for p in checkpoint_dirs(folder) if (p / "trainer_state.json").is_file()), None)


def newest_finite(folder: str | Path) -> Path | None:
    """The newest complete checkpoint whose manifest says its weights were finite (no manifest: not
    a complete save, see :func:`verify`)."""
    for path in checkpoint_dirs(folder):
        manifest = read_manifest(path)
        if (path / "trainer_state.json").is_file() and manifest is not None and manifest.get("finite", True):
            return path
    return None


# ----------------------------------------------------------------------------------- verifying


def read_manifest(checkpoint: Path) -> dict[str, Any] | None:
    try:
        return json.loads((checkpoint / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def progress(checkpoint: str | Path) -> tuple[int, float]:
    """(optimizer steps done, training seconds so far) when ``checkpoint`` was saved."""
    checkpoint = Path(checkpoint)
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    manifest = read_manifest(checkpoint) or {}
    return int(state.get("global_step", 0)), float(manifest.get("train_runtime", 0.0))


def verify(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (complete, readable, finite), or None if it can.

    A folder without a manifest is refused: memtrain writes and syncs the manifest inside the
    staged folder before publishing it, so a checkpoint without one is not a complete memtrain
    save, and loading its files cannot tell whether one is missing.
    """
    try:
        json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "trainer_state.json is missing or unreadable (an incomplete save)"
    manifest = read_manifest(checkpoint)
    if manifest is None:
        return (f"{MANIFEST} is missing or unreadable (not a complete memtrain save: it is written "
                "before a checkpoint is published)")
    for name, size in manifest.get("files", {}).items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written (truncated or damaged)"
    if not manifest.get("finite", True):
        return "its trained weights are NaN or infinite"
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        problem = _unreadable(path)
        if problem:
            return f"{path.relative_to(checkpoint)} {problem}"
    return None


def _unreadable(path: Path) -> str | None:
    """Why a checkpoint file cannot be loaded, or None."""
    if path.stat().st_size == 0:
        return "is empty (0 bytes)"
    if path.suffix in (".pt", ".pth", ".bin"):  # torch.save's zip format, with CRCs
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile, EOFError):
            return "is not a complete torch file"
        return f"is damaged (member {bad} fails its checksum)" if bad else None
    if path.suffix == ".safetensors":
        return _unreadable_safetensors(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "is not valid JSON"
    return None


def _unreadable_safetensors(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()  # reads and checks the header (the manifest vouches for sizes and finiteness)
    except Exception as err:  # safetensors raises its own error types for every kind of damage
        return f"cannot be read ({err})"
    return None


def usable_checkpoint(folder: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer checkpoint skipped (why)."""
    skipped: list[str] = []
    for path in checkpoint_dirs(folder):
        if not (path / "trainer_state.json").exists() and not any(path.iterdir()):
            continue  # an empty stray folder, not a checkpoint
        problem = verify(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name}: {problem}")
    return None, skipped


# ------------------------------------------------------------------------------------- writing


def checkpoint_bytes(model: torch.nn.Module, optimizer: Any) -> int:
    """What a checkpoint will take on disk: trained weights (or all, for full) + optimizer state."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = trainable if len(trainable) < len(params) else params
    total = sum(p.numel() * p.element_size() for p in weights)
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def folder_bytes(folder: Path | None) -> int:
    """Bytes of the files under ``folder`` (0 for None)."""
    if folder is None:
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def expected_bytes(folder: Path, estimate: int) -> int:
    """What the next save needs: the estimate, or the newest checkpoint's size if larger."""
    return max(estimate, folder_bytes(last_complete_checkpoint(folder)))


def kept_sentence(folder: Path) -> str:
    last = newest_finite(folder)
    if last is None:
        return "No checkpoint had been saved yet."
    return f"The last complete checkpoint, {last}, is intact."


def check_disk_space(folder: Path, needed: int, what: str) -> None:
    """Raise :class:`DiskFull` if ``folder``'s file system has less than ``needed`` bytes (+ slack)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed * DISK_SLACK:
        raise DiskFull(
            f"Disk full: not enough space to save {what}: it needs about "
            f"{format_bytes(needed * DISK_SLACK)}, and {folder} has {format_bytes(free)} free. "
            f"{kept_sentence(folder)} Fix: free some space, lower `training.save_total_limit`, or "
            "point `output.dir` to a larger disk; then add `training.resume=true` to continue."
        )


def is_disk_full(err: BaseException) -> bool:
    """True when ``err`` (or what caused it) says the disk or quota is full."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen).lower() for text in _DISK_FULL_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@contextmanager
def disk_full_as_error(folder: Path, what: str, staged: Path) -> Iterator[None]:
    """Turn a full disk while writing ``staged`` into :class:`DiskFull`, removing the partial files."""
    try:
        yield
    except Exception as err:  # torch, safetensors and the OS each word a full disk differently
        if not is_disk_full(err):
            raise
        shutil.rmtree(staged, ignore_errors=True)
        first = first_line(err)
        raise DiskFull(
            f"Disk full while saving {what} into {folder} ({first}). The partial files were removed. "
            f"{kept_sentence(folder)} Fix: free some space or point `output.dir` to a larger disk, "
            "then run the same command with `training.resume=true`."
        ) from None


def weights_finite(model: torch.nn.Module) -> bool:
    """Whether every trained weight is finite (every process's shard, with several)."""
    bad = 0
    device = torch.device("cpu")
    for param in model.parameters():
        if param.requires_grad:
            local = param.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            device = local.device
            if local.is_floating_point() and not torch.isfinite(local).all():
                bad = 1
                break
    return not _largest_over_processes(bad, device)


def write_manifest(checkpoint: Path, finite: bool, step: int, train_runtime: float) -> None:
    files = {p.relative_to(checkpoint).as_posix(): p.stat().st_size
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != MANIFEST}
    text = json.dumps({"step": step, "finite": finite, "train_runtime": train_runtime, "files": files},
                      indent=1, sort_keys=True)
    (checkpoint / MANIFEST).write_text(text, encoding="utf-8")


def sync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder`` (and ``folder`` itself)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in [*(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staged: Path, final: Path) -> None:
    """Sync a fully written folder to disk, then move it into place (atomic on one file system)."""
    sync_tree(staged)
    if final.exists():  # re-saving the same step (resume at a saved step): replace it
        shutil.rmtree(final)
    staged.rename(final)
    _fsync_dir(final.parent)


def write_checkpoint(trainer: Any, save: Callable[[], None]) -> None:
    """Run the Trainer's own checkpoint save (``save``) the safe way (see the module docstring)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    root = Path(trainer.args.output_dir)
    staging = root / STAGING
    step = trainer.state.global_step
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    finite = weights_finite(trainer.model)  # every process takes part (a collective with several)
    if trainer.args.should_save:
        estimate = checkpoint_bytes(trainer.model, trainer.optimizer)
        check_disk_space(root, expected_bytes(root, estimate), name)
    with disk_full_as_error(root, name, staging / name):
        trainer.args.output_dir = str(staging)  # the Trainer writes into <output>/.staging/...
        try:
            save()
        finally:
            trainer.args.output_dir = str(root)
        trainer.accelerator.wait_for_everyone()
        if trainer.args.should_save:
            runtime = trainer.runtime_before + time.time() - trainer.started_at
            write_manifest(staging / name, finite, step, runtime)
            publish(staging / name, root / name)  # ...and only complete, synced ones appear
    if not trainer.args.should_save:
        return
    staging.rmdir()
    if not finite:
        log.warning("step %d: the trained weights hold NaN or infinite values; %s is kept but marked "
                    "as not finite (resume skips it)", step, name)
    keep = newest_finite(root)  # rotation must never delete the newest finite checkpoint
    rotate_checkpoints(output_dir=str(root), save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=str(keep) if keep else trainer.state.best_model_checkpoint)


def _largest_over_processes(value: int, device: torch.device) -> int:
    """``value``'s maximum over all processes (one tiny all-reduce per optimizer step)."""
    from memtrain.distributed.together import largest

    return largest([value], device)[0]
