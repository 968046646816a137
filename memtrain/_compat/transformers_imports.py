"""transformers' import-time costs a command does not need: its model folders scanned once per
installation, not twice per process; SciPy's optimizers imported when a detection loss first needs one.

**The import structure.**

``import transformers`` builds its lazy module's import structure by reading every file under
``transformers/models`` (``create_import_structure_from_path``: some 570 folders and 1,700 files,
each read for its ``__all__`` and ``@requires`` lines), and importing ``transformers.models`` (which
loading any model class does) builds it again from the same folder. The function is wrapped in
``functools.lru_cache`` to reuse the folders' scans, but at its default size (128 entries) the first
scan's ~570 folders have evicted each other by the second, which reads every file again.

:func:`cache_import_structure` puts :class:`Scans` in the function's place: an unbounded cache (the
second scan reuses the first's folders: 0.24 s of a command's imports on this project's 2-core
CPU), kept on disk between processes (the first scan too: another 0.24 s, for 0.01 s of checking
that the folder is as it was). A folder's scan is stored beside a fingerprint of everything under
it (every file's name, size and modification time, and the parsing function's own file) and used
only while the fingerprint is the same: an upgraded, edited or reinstalled transformers is scanned
again. The store is ``marshal`` data (dicts, sets and strings: it cannot run code when read), one
file per scanned folder and Python version; a store that cannot be read or written is ignored (the
folder is scanned, as without it). Same result: the function is the same; only where its results
are kept changes. No public setting does it.

Checked on transformers 5.19 and 5.25 (``@lru_cache def create_import_structure_from_path``,
recursing into subfolders through the module's global; its result a dict whose ``str`` keys are
subfolders, holding their own scans); another shape is left as it is (it costs time only).

**SciPy.** ``transformers.loss.loss_utils``, which every model's module imports, imports the object
detection losses, and each of them runs ``from scipy.optimize import linear_sum_assignment`` where
SciPy is installed (sentence-transformers and scikit-learn install it): ``scipy.optimize`` is 0.26 s
of every command's imports on this project's 2-core CPU, for a function only the Hungarian matching
of DETR-like models calls. While ``loss_utils`` runs, :func:`deferred_scipy` answers that one import
with :func:`linear_sum_assignment`, which imports SciPy's on its first call and calls it; transformers
still sees SciPy as installed (``is_scipy_available``). Checked on transformers 5.19 and 5.25
(six loss modules, the same line in each); a module that imports it another way gets SciPy's own.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import marshal
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

NAME = "create_import_structure_from_path"
FORMAT = 1  # of a stored scan: (FORMAT, fingerprint, structure)


class CacheInfo(NamedTuple):
    """As ``functools.lru_cache``'s ``cache_info()``; ``stored``: folders read from the disk store."""

    hits: int
    misses: int
    maxsize: None
    currsize: int
    stored: int


def cache_import_structure(import_utils: ModuleType, store: Path | None = None) -> bool:
    """Put :class:`Scans` in the place of ``transformers.utils.import_utils``'s folder scan, before
    ``transformers`` uses it (``store``: a folder for scans kept between processes; None: kept in
    this process only); whether it did (False: not the shape it was checked on)."""
    scan = getattr(import_utils, NAME, None)
    plain = getattr(scan, "__wrapped__", None)
    if plain is None or not hasattr(scan, "cache_info") or isinstance(scan, Scans):
        return False
    setattr(import_utils, NAME, Scans(plain, store, import_utils.__file__))  # its recursion calls the global
    return True


class Scans:
    """``create_import_structure_from_path`` with every folder's scan kept, in this process and, for a
    top-level call (a folder not inside one being scanned), on disk."""

    def __init__(self, plain: Callable[[Any], dict], store: Path | None, parser: str) -> None:
        self.__wrapped__ = plain
        self.store, self.parser = store, parser
        self.memo: dict[str, dict] = {}
        self.depth = 0  # calls under way: a call at depth 0 is a top-level one
        self.hits = self.misses = self.stored = 0
        functools.update_wrapper(self, plain)

    def __call__(self, module_path: Any) -> dict:
        folder = os.fspath(module_path)
        if os.path.isfile(folder):  # as the plain function: a file stands for its folder
            folder = os.path.dirname(folder)
        if folder not in self.memo and not (self.depth == 0 and self._load(folder)):
            self.misses += 1
            self.depth += 1
            try:
                self.memo[folder] = self.__wrapped__(module_path)
            finally:
                self.depth -= 1
            if self.depth == 0:
                self._save(folder)
            return self.memo[folder]
        self.hits += 1
        return self.memo[folder]

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, None, len(self.memo), self.stored)

    def cache_clear(self) -> None:
        """Forget this process's scans (the disk store is checked again on the next call)."""
        self.memo.clear()
        self.hits = self.misses = self.stored = 0

    # ------------------------------------------------------------------------------ disk store

    def _file(self, folder: str) -> Path | None:
        if self.store is None:
            return None
        key = hashlib.blake2b(os.path.abspath(folder).encode(), digest_size=10).hexdigest()
        return self.store / f"transformers-imports-{key}-py{sys.version_info[0]}{sys.version_info[1]}.marshal"

    def _load(self, folder: str) -> bool:
        """Whether ``folder``'s stored scan was still true and is now in :attr:`memo` (with those of
        its subfolders)."""
        file = self._file(folder)
        if file is None:
            return False
        try:
            found = marshal.loads(file.read_bytes())
            if (not isinstance(found, tuple) or len(found) != 3 or found[0] != FORMAT
                    or not isinstance(found[2], dict) or found[1] != fingerprint(folder, self.parser)):
                return False
        except (OSError, ValueError, EOFError, TypeError):
            return False
        self._remember(folder, found[2])
        return True

    def _remember(self, folder: str, structure: dict) -> None:
        self.memo[folder] = structure
        self.stored += 1
        for name, inner in structure.items():
            if isinstance(name, str):  # a subfolder's scan (a module's entries are keyed by backends)
                self._remember(os.path.join(folder, name), inner)

    def _save(self, folder: str) -> None:
        file = self._file(folder)
        if file is None:
            return
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            data = marshal.dumps((FORMAT, fingerprint(folder, self.parser), self.memo[folder]))
            part = file.with_suffix(f".{os.getpid()}.part")
            part.write_bytes(data)
            os.replace(part, file)  # whole or not at all, whoever else writes it
        except (OSError, ValueError):
            return


def fingerprint(folder: str, *files: str) -> str:
    """A digest of every entry under ``folder`` (relative name, size, modification time; not
    ``__pycache__``) and of ``files``: it changes when any file is added, removed or written."""
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        stat = os.stat(file)
        digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    folders = [folder]
    while folders:
        here = folders.pop()
        with os.scandir(here) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                name = os.path.relpath(entry.path, folder)
                if entry.is_dir():
                    folders.append(entry.path)
                    digest.update(f"{name}/\n".encode())
                else:
                    stat = entry.stat()
                    digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------- SciPy


def linear_sum_assignment(*args: Any, **kwargs: Any) -> Any:
    """``scipy.optimize.linear_sum_assignment``, imported on the first call."""
    from scipy.optimize import linear_sum_assignment as solve

    return solve(*args, **kwargs)


@contextlib.contextmanager
def deferred_scipy() -> Iterator[None]:
    """While the block runs, ``from scipy.optimize import linear_sum_assignment`` binds
    :func:`linear_sum_assignment` instead of importing ``scipy.optimize``; every other import is
    Python's own."""
    plain = builtins.__import__

    def importing(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
                  level: int = 0) -> Any:
        if name == "scipy.optimize" and level == 0 and tuple(fromlist or ()) == ("linear_sum_assignment",):
            return _DEFERRED
        return plain(name, globals, locals, fromlist, level)

    builtins.__import__ = importing
    try:
        yield
    finally:
        builtins.__import__ = plain


_DEFERRED = ModuleType("scipy.optimize", "stands for scipy.optimize in one from-import (deferred_scipy)")
_DEFERRED.linear_sum_assignment = linear_sum_assignment  # type: ignore[attr-defined]
