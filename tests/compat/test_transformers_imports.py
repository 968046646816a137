"""memtrain/_compat/transformers_imports.py: transformers' folder scan kept on disk while the folder
is unchanged, and SciPy's optimizers imported when a detection loss first calls one."""

from __future__ import annotations

import builtins
import functools
import os
import types
from pathlib import Path

from memtrain._compat import transformers_imports as ti


def _library(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder tree like transformers/models and the calls a scan made."""
    root = tmp_path / "models"
    for folder, files in {"albert": {"modeling_albert.py": "AlbertModel"},
                          "bert": {"modeling_bert.py": "BertModel", "configuration_bert.py": "BertConfig"},
                          "bert/sub": {"x.py": "X"}}.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / folder / name).write_text(text)
    (tmp_path / "import_utils.py").write_text("# the parser")
    return root, []


def _module(tmp_path: Path, calls: list[str]) -> types.ModuleType:
    """A fresh ``import_utils`` (a new process): its scan recurses through the module's global,
    as transformers' does."""
    module = types.ModuleType("import_utils")
    module.__file__ = str(tmp_path / "import_utils.py")

    @functools.lru_cache
    def create_import_structure_from_path(module_path):
        path = os.fspath(module_path)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        calls.append(path)
        structure: dict = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_dir():
                structure[entry.name] = module.create_import_structure_from_path(entry.path)
            else:
                structure.setdefault(frozenset({"torch"}), {})[entry.name[:-3]] = set(
                    Path(entry.path).read_text().split())
        return structure

    module.create_import_structure_from_path = create_import_structure_from_path
    return module


def test_a_scan_is_kept_between_processes_while_its_folder_is_unchanged(tmp_path: Path) -> None:
    root, calls = _library(tmp_path)
    store = tmp_path / "store"

    def process() -> tuple[dict, int, ti.CacheInfo]:
        module = _module(tmp_path, calls)
        assert ti.cache_import_structure(module, store)
        assert not ti.cache_import_structure(module, store)  # once
        before = len(calls)
        found = module.create_import_structure_from_path(root)
        sub = module.create_import_structure_from_path(str(root / "bert" / "modeling_bert.py"))  # its folder
        assert sub == found["bert"]
        return found, len(calls) - before, module.create_import_structure_from_path.cache_info()

    plain = _module(tmp_path, []).create_import_structure_from_path(root)
    first, scanned, info = process()
    assert first == plain and scanned == 4 and info.stored == 0 and info.hits == 1
    later, scanned, info = process()
    assert later == plain and scanned == 0 and info.stored == 4  # from the store, subfolders too

    (root / "bert" / "sub" / "x.py").write_text("X Y")  # a file written: scanned again
    changed, scanned, _ = process()
    assert scanned == 4 and changed["bert"]["sub"][frozenset({"torch"})]["x"] == {"X", "Y"}
    assert process()[1] == 0
    (root / "bert" / "new.py").write_text("New")  # a file added
    assert process()[1] == 4
    stat = os.stat(tmp_path / "import_utils.py")  # the parser itself changed (same size)
    os.utime(tmp_path / "import_utils.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert process()[1] == 4 and process()[1] == 0
    for file in store.iterdir():
        file.write_bytes(b"not a scan")  # unreadable: scanned, as without a store
    assert process()[0] == _module(tmp_path, []).create_import_structure_from_path(root)


def test_no_store_or_one_that_cannot_be_written_still_scans(tmp_path: Path) -> None:
    root, calls = _library(tmp_path)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for store in (None, blocked / "store"):
        module = _module(tmp_path, calls)
        assert ti.cache_import_structure(module, store)
        assert module.create_import_structure_from_path(root)["albert"]
        assert module.create_import_structure_from_path.cache_info().misses == 4


def test_another_shape_is_left_as_it_is(tmp_path: Path) -> None:
    module = types.ModuleType("import_utils")
    module.create_import_structure_from_path = lambda path: {}  # no lru_cache: not the checked shape
    assert not ti.cache_import_structure(module, tmp_path)


def test_deferred_scipy_binds_a_function_that_imports_it_when_called() -> None:
    plain = builtins.__import__
    with ti.deferred_scipy():
        from json import dumps

        import scipy.optimize as optimize  # any other import is Python's own
        from scipy.optimize import linear_sum_assignment
    assert builtins.__import__ is plain and dumps.__module__ == "json"
    assert linear_sum_assignment is ti.linear_sum_assignment
    rows, cols = linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    expected = optimize.linear_sum_assignment([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    assert (list(rows), list(cols)) == (list(expected[0]), list(expected[1])) == ([0, 1, 2], [1, 0, 2])
