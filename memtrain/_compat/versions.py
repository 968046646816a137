"""The tested range of each dependency, the once-per-process warning outside it, and the error a
shim raises when a private name it relies on is gone.

:data:`TESTED` is the range the project runs, both ends (issue 35): the lowest set is the one the
issue's walk up from the declared floors found to pass (torch 2.10, transformers 5.19, peft 0.20,
accelerate 1.10.1, datasets 4.7, bitsandbytes 0.50, trl 1.16, torchao 0.18); the highest is the
newest run (torch 2.15.0 with the rest at today's pins, issue 35), else the installed pins
(accelerate 1.16.0: the whole suite on scripts/versions/pinned.txt, 2026-12-02; transformers
5.25.0: the newest leg's subset, then the whole suite, 2026-12-03). That list, which
scripts/setup.sh installs, holds the top of each range but torch's (tests/compat/test_shims.py).
A bound compares at its own precision: ``"1.16"`` as the highest admits every 1.16.x.

No torch import here: the command line calls :func:`check_versions` before anything heavy loads
(it reads installed versions from package metadata).
"""

from __future__ import annotations

import logging
import re
from importlib import metadata
from typing import Any

from memtrain.errors import MemtrainError

# package -> (lowest tested, highest tested)
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.10", "2.15"),
    "transformers": ("5.19", "5.25"),
    "peft": ("0.20", "0.21.2"),
    "accelerate": ("1.10.1", "1.16.0"),
    "datasets": ("4.7", "5.2.0"),
    "bitsandbytes": ("0.50", "0.50.2"),
    "trl": ("1.16", "1.16"),
    "torchao": ("0.18", "0.18.0"),
}
_log = logging.getLogger(__name__)
_warned: set[str] = set()  # packages already warned about in this process


def installed(package: str) -> str | None:
    """The installed version of ``package`` (its metadata; None when it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; pre-releases count as their release (``2.15.0rc1``)."""
    match = re.match(r"\d+(\.\d+)*", version.strip().lstrip("v"))
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def in_range(version: str, low: str, high: str) -> bool:
    """Whether ``version`` is within ``[low, high]``, each bound compared at its own precision."""
    have, lo, hi = _release(version), _release(low), _release(high)
    return have[:len(lo)] + (0,) * (len(lo) - len(have)) >= lo and have[:len(hi)] <= hi


def span(package: str) -> str:
    """The tested range as text, ``"5.19–5.25"``."""
    low, high = TESTED[package]
    return low if low == high else f"{low}–{high}"


def outside_range() -> dict[str, str]:
    """Installed packages of :data:`TESTED` whose version is outside the tested range -> version."""
    out = {}
    for package, (low, high) in TESTED.items():
        version = installed(package)
        if version is not None and not in_range(version, low, high):
            out[package] = version
    return out


def check_versions() -> list[str]:
    """Warn (``logging``, logger ``memtrain``, once per package per process) about each installed
    dependency outside its tested range, naming the package, the version and the range. Returns
    the warnings given by this call (empty when all is in range or already said)."""
    said = []
    for package, version in outside_range().items():
        if package in _warned:
            continue
        _warned.add(package)
        message = (f"memtrain was tested with {package} {span(package)}; {version} is installed. It may "
                   f"work; if something breaks, install a tested version (pip install "
                   f"'{package}>={TESTED[package][0]},<={TESTED[package][1]}') or report it to "
                   "memtrain's issues with this message.")
        _log.warning(message)
        said.append(message)
    return said


class CompatError(MemtrainError):
    """A private attribute a :mod:`memtrain._compat` shim relies on is missing in the installed
    library: the message names the shim, the version and the tested range."""


def compat_error(shim: str, package: str, what: str) -> CompatError:
    """The error for ``what`` (``"Trainer._save_checkpoint"``) missing from ``package``, raised by
    ``shim`` (``"transformers_trainer.save_checkpoint"``)."""
    version = installed(package) or "(not installed)"
    return CompatError(
        f"memtrain._compat.{shim}: {package} {version} has no {what} (checked on {package} "
        f"{span(package)}). Install a tested version (pip install '{package}>={TESTED[package][0]},"
        f"<={TESTED[package][1]}'), or please report it to memtrain's issues with this message.")


def private(obj: Any, name: str, shim: str, package: str) -> Any:
    """``getattr(obj, name)`` for a private ``name`` of ``package``, or :func:`compat_error`."""
    try:
        return getattr(obj, name)
    except AttributeError:
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise compat_error(shim, package, f"{owner}.{name}") from None


def require(cls: type, names: tuple[str, ...], shim: str, package: str) -> None:
    """Check that ``cls`` still has every private method a shim overrides (an override of a method
    that is gone would never run, silently): else :func:`compat_error`."""
    for name in names:
        if not hasattr(cls, name):
            raise compat_error(shim, package, f"{cls.__name__}.{name}")
