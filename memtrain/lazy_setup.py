"""Library set-up that memtrain's commands defer until it is used: seconds off every heavy command.

Two libraries do expensive work at import time that most commands never use:

- bitsandbytes wraps four of its CPU kernels in ``torch.compile`` when it is imported. Creating the
  wrappers imports TorchInductor and TorchDynamo's debugging tools (1.2-1.5 s on this project's
  2-core CPU), although ``torch.compile`` compiles nothing until a wrapper is first called, and an
  estimate or a CUDA run never calls them. While bitsandbytes is imported, ``torch.compile`` is
  replaced by :func:`_deferred_compile`, which makes the same ``torch.compile`` call on the first
  call of the function instead. bitsandbytes' own fallback (it calls the plain function when
  compiling fails) still catches a failure, which now happens at that first call.
- ``transformers.trainer`` imports ``datasets`` (and with it pandas and pyarrow, 0.5-0.7 s) at module
  level but uses it only inside its methods. ``datasets`` is loaded by Python's
  :class:`importlib.util.LazyLoader`: the module exists at once and runs when first used (any
  attribute: ``datasets.Dataset``, ``from datasets import ...``), which data preparation does
  and an estimate never does.

A third is transformers' own: it reads every file under ``transformers/models`` twice per process
(once for ``import transformers``, again for ``transformers.models``), its cache too small to keep
the first reading, 0.24 s each. Right after ``transformers.utils.import_utils`` runs, the scan is
given a cache that keeps every folder and keeps the scan on disk (in :func:`cache_dir`) while the
folder is unchanged (:mod:`memtrain._compat.transformers_imports`): after a command's first run,
none (0.48 s less, for 0.01 s of checking the folder). And its loss functions import SciPy's
optimizers (0.26 s) for the Hungarian matching of detection models: while
``transformers.loss.loss_utils`` runs, that import is answered with a function that makes it when
first called (:func:`memtrain._compat.transformers_imports.deferred_scipy`).

A fourth cost is Python's own: importing torch, transformers and peft makes some 700,000 objects
that live as long as the process, and the garbage collector, seeing the heap grow, makes full passes
over all of them while it grows, freeing nothing (six passes, 0.4-0.5 s of a plan's 3.5 s of imports
on this project's 2-core CPU). A command imports its libraries inside :func:`importing`: the
collector waits, and what was imported is then frozen (``gc.freeze``) so that later passes skip it.

:func:`install` is called by the ``memtrain`` command before it imports any of these libraries;
it changes nothing for a library already imported, and ``import memtrain`` alone installs nothing
(a user's own script keeps its libraries as they are). The start-up benchmark
(``scripts/bench/planner/startup.py``) measures the result; ``tests/cli/test_lazy_setup.py`` checks that the
libraries still work once used.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

COMPILE_DEFERRED = ("bitsandbytes",)  # packages whose import-time torch.compile calls are deferred
LAZY = ("datasets",)  # packages loaded on first use
# modules set up right after they run, before their package goes on (see _set_up)
AFTER = ("transformers.utils.import_utils",)
# modules run inside a context (see _within)
WITHIN = ("transformers.loss.loss_utils",)


def install() -> None:
    """Defer the set-up of :data:`COMPILE_DEFERRED` and :data:`LAZY` packages not yet imported, set
    up the :data:`AFTER` modules when they are, and run the :data:`WITHIN` ones in their context."""
    wanted = [name for name in (*COMPILE_DEFERRED, *LAZY, *AFTER, *WITHIN) if name not in sys.modules]
    if wanted and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(wanted))


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """A block of imports without garbage collection; what it imported is then frozen: kept out of
    the collector's later passes (``gc.freeze``: the modules, classes and functions of the libraries
    live until the process ends). The collector runs again after the block, as it did before it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the packages with the other finders and wraps their loaders."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)
        self.finding: set[str] = set()

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        # Asked again for every look-up (`importlib.util.find_spec` too) until the module is
        # imported; `finding` lets the other finders answer the look-up made here.
        if name not in self.names or name in self.finding:
            return None
        self.finding.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.finding.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if name in LAZY:
            spec.loader = importlib.util.LazyLoader(spec.loader)
        elif name in AFTER:
            spec.loader = _AroundLoader(spec.loader, then=_set_up)
        elif name in WITHIN:
            spec.loader = _AroundLoader(spec.loader, within=functools.partial(_within, name))
        else:
            spec.loader = _CompileDeferringLoader(spec.loader)
        return spec


class _AroundLoader(importlib.abc.Loader):
    """Runs a module inside the context ``within()`` makes, then ``then(module)``."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], object] | None = None,
                 within: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
                 ) -> None:
        self.loader, self.then, self.within = loader, then, within

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self.within():
            self.loader.exec_module(module)
        if self.then is not None:
            self.then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _within(name: str) -> contextlib.AbstractContextManager[object]:
    """The context a :data:`WITHIN` module runs in."""
    if name == "transformers.loss.loss_utils":
        from memtrain._compat.transformers_imports import deferred_scipy

        return deferred_scipy()  # its detection losses' SciPy import, made when first called
    return contextlib.nullcontext()


def _set_up(module: ModuleType) -> None:
    """The set-up of an :data:`AFTER` module, just run."""
    if module.__name__ == "transformers.utils.import_utils":
        from memtrain._compat.transformers_imports import cache_import_structure

        cache_import_structure(module, cache_dir())  # transformers' model folders scanned once


def cache_dir() -> Path | None:
    """Where what a command can reuse between processes is kept: ``$MEMTRAIN_CACHE_DIR``, else
    ``~/.cache/memtrain`` (None without a home folder)."""
    override = os.environ.get("MEMTRAIN_CACHE_DIR")
    if override:
        return Path(override)
    try:
        return Path.home() / ".cache" / "memtrain"
    except RuntimeError:  # no home folder to be found
        return None


class _CompileDeferringLoader(importlib.abc.Loader):
    """Runs a module with ``torch.compile`` deferred (:func:`_deferred_compile`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch

        real = torch.compile
        torch.compile = functools.partial(_deferred_compile, real)  # type: ignore[assignment]
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... as the real one
        return getattr(self.loader, name)


def _deferred_compile(compile: Callable[..., Any], model: Callable[..., Any] | None = None,
                      **options: Any) -> Any:
    """``compile(model, **options)``, made when ``model`` is first called; used as a decorator
    (``model`` None) it returns the decorator, as ``torch.compile`` does."""
    if model is None:
        return functools.partial(_deferred_compile, compile, **options)
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            try:
                compiled.append(compile(model, **options))
            except Exception:
                compiled.append(model)  # as when compiling at import failed: the plain function
                raise  # this once, to the caller's fallback (bitsandbytes calls `model` itself)
        return compiled[0](*args, **kwargs)

    return call
