"""The output folder of a run: what may be written where, what to resume from, when to clear.

Rules (docs/reliability.md):

- a folder that holds anything but memtrain's own run is refused unless ``output.overwrite=true``
  (a run is marked by :data:`MARKER`; folders of older memtrain versions are recognised by their
  ``metrics.json`` or checkpoints);
- a finished run (``metrics.json``) is never resumed: nothing is left to train, and training again
  would replace its adapter and metrics;
- ``output.overwrite=true`` deletes nothing here: :func:`clear_old_run` runs only once the new run
  has loaded its data and model;
- resume verifies the newest checkpoint and falls back to the newest one that verifies, saying so.

Every check here runs before anything is written, so a mistake exits with nothing touched.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from memtrain import sources
from memtrain.config import RunConfig
from memtrain.errors import MemtrainError
from memtrain.reliability.checkpoints import STAGING, checkpoint_dirs, usable_checkpoint, verify

log = logging.getLogger(__name__)

MARKER = ".memtrain-run"  # written into every output folder memtrain trains into
METRICS_FILE = "metrics.json"


def check_output_dir(cfg: RunConfig, out: Path) -> str | None:
    """Refuse to clobber earlier or foreign work; return the checkpoint to resume from, if any.

    Raises:
        MemtrainError: the folder cannot be written, holds other files, or the resume is impossible.
    """
    _check_writable(out)
    resume = cfg.training.resume
    if isinstance(resume, str):
        return _explicit_checkpoint(resume)
    if out.is_dir() and not is_run(out) and any(out.iterdir()) and not cfg.output.overwrite:
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise MemtrainError(
            f"`output.dir`: {str(out)!r} holds files that are not a memtrain run ({shown}); training "
            "would write recipe.yaml, metrics.json and the adapter over files of the same names. Fix: "
            "choose a new or empty `output.dir`, or set `output.overwrite=true` to write into it anyway.")
    finished = (out / METRICS_FILE).exists()
    if resume and finished:
        raise MemtrainError(
            f"`training.resume`: {str(out)!r} holds a finished run ({METRICS_FILE}): there is nothing "
            "to resume, and training again would replace its adapter and metrics. Fix: choose another "
            "`output.dir`, or set `output.overwrite=true` (and `training.resume=false`) to train it "
            "again from the start.")
    shutil.rmtree(out / STAGING, ignore_errors=True)  # a save that crashed half-way
    if resume:
        return _newest_usable(out)
    last = next(iter(checkpoint_dirs(out)), None)
    if (last or finished) and not cfg.output.overwrite:
        what = "a finished run" if finished else f"checkpoint {last.name}" if last else ""
        fix = "" if finished else "continue it with `training.resume=true`, "
        raise MemtrainError(
            f"`output.dir`: {str(out)!r} already holds {what}. Fix: {fix}choose another "
            "`output.dir`, or set `output.overwrite=true` to replace it.")
    return None


def is_run(folder: Path) -> bool:
    """Whether ``folder`` is (or was) a memtrain run's output folder."""
    return ((folder / MARKER).exists() or (folder / METRICS_FILE).exists()
            or (folder / STAGING).exists() or bool(checkpoint_dirs(folder)))


def claim(out: Path) -> None:
    """Create the output folder (if needed) and mark it as a memtrain run."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("This folder holds a memtrain run.\n", encoding="utf-8")


def clear_old_run(cfg: RunConfig, out: Path) -> None:
    """``output.overwrite=true``: delete the old run's checkpoints and metrics. Called only after the
    new run has loaded its data and model, so a mistake there leaves the old run whole."""
    if not cfg.output.overwrite or cfg.training.resume or not out.is_dir():
        return
    if os.environ.get("RANK", "0") != "0":  # several processes: the first one clears
        return
    for old in checkpoint_dirs(out):
        shutil.rmtree(old)
    (out / METRICS_FILE).unlink(missing_ok=True)


def _check_writable(out: Path) -> None:
    """The folder (or the nearest folder above it that exists) must be a writable folder."""
    if out.exists() and not out.is_dir():
        raise MemtrainError(f"`output.dir`: {str(out)!r} is a file, not a folder. Fix: choose a folder "
                            "path for `output.dir`.")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise MemtrainError(f"`output.dir`: {str(out)!r} cannot be created: {str(parent)!r} is a file. "
                            "Fix: choose a path under a folder.")
    if not os.access(parent, os.W_OK | os.X_OK) or _read_only_mount(parent):
        raise MemtrainError(f"`output.dir`: {str(parent)!r} is not writable. Fix: choose a folder you "
                            "can write to, or change its permissions.")


def _read_only_mount(folder: Path) -> bool:
    """True on a read-only file system, or a folder whose permissions forbid writing (checked by
    mode bits too: the root user passes ``os.access`` everywhere)."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False
    return not folder.stat().st_mode & 0o222


def _explicit_checkpoint(resume: str) -> str:
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise MemtrainError(f"`training.resume`: {resume!r} is not a checkpoint folder (no "
                            "trainer_state.json). Fix: point it at a `checkpoint-N` folder "
                            "or use `training.resume=true`.")
    problem = verify(path)
    if problem:
        raise MemtrainError(f"`training.resume`: {resume!r} cannot be resumed from: {problem}. Fix: point "
                            "it at another `checkpoint-N` folder, or use `training.resume=true` to take "
                            "the newest one that is complete.")
    return str(path)


def _newest_usable(out: Path) -> str | None:
    found, skipped = usable_checkpoint(out)
    if found is None and skipped:
        raise MemtrainError(
            f"`training.resume`: no checkpoint in {str(out)!r} can be resumed from: {'; '.join(skipped)}. "
            "Fix: set `output.overwrite=true` and `training.resume=false` to start again.")
    if found is None:
        log.warning("training.resume=true but %s holds no checkpoint: starting fresh", out)
        return None
    if skipped:
        log.warning("not resuming from %s; resuming from %s, the newest complete checkpoint",
                    "; ".join(skipped), found.name)
    return str(found)


def portable_recipe(cfg: RunConfig) -> RunConfig:
    """The recipe with its local files (model, tokenizer, data, chat template file) as absolute
    paths, so that the copy a run saves works from any directory; hub ids, ``pkg:`` and
    ``builtin:`` names stay as they are."""
    def absolute(value: str | None) -> str | None:
        if value is None or value.startswith(("builtin:", sources.PKG_PREFIX)) or "{{" in value \
                or "{%" in value or not sources.looks_local(value):
            return value
        path = sources.expanded(value)
        return str(path.resolve()) if path.exists() else value

    data = cfg.data.model_copy(update={
        "source": absolute(cfg.data.source), "chat_template": absolute(cfg.data.chat_template),
        "mix": [m.model_copy(update={"source": absolute(m.source),
                                     "chat_template": absolute(m.chat_template)}) for m in cfg.data.mix]})
    model = cfg.model.model_copy(update={"name": absolute(cfg.model.name),
                                         "tokenizer": absolute(cfg.model.tokenizer)})
    return cfg.model_copy(update={"model": model, "data": data})
