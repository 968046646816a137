"""transformers' import structure: one scan of its model folders per process, not two.

``import transformers`` builds its lazy module's import structure by reading every file under
``transformers/models`` (``create_import_structure_from_path``: some 570 folders and 1,700 files,
each read for its ``__all__``), and importing ``transformers.models`` (which loading any model
class does) builds it again from the same folder. The function is wrapped in ``functools.lru_cache``
to reuse the folders' scans, but at its default size (128 entries) the first scan's ~570 folders
have evicted each other by the second, which reads every file again: 0.24 s of a command's imports
on this project's 2-core CPU. :func:`cache_import_structure` gives the same function an unbounded
cache, so the second scan reuses the first's folders. Same result (the function is the same, and the
scans are microseconds apart); only the cache's size changes. No public setting does it.

Checked on transformers 5.19 and 5.25 (``@lru_cache def create_import_structure_from_path``, called
by ``define_import_structure`` through the module's global); another shape is left as it is (it
costs time only).
"""

from __future__ import annotations

import functools
from types import ModuleType

NAME = "create_import_structure_from_path"


def cache_import_structure(import_utils: ModuleType) -> bool:
    """Give ``transformers.utils.import_utils``'s folder scan an unbounded cache, before
    ``transformers`` uses it; whether it did (False: not the shape it was checked on)."""
    scan = getattr(import_utils, NAME, None)
    plain = getattr(scan, "__wrapped__", None)
    if plain is None or not hasattr(scan, "cache_info") or getattr(scan, "_memtrain_unbounded", False):
        return False
    unbounded = functools.lru_cache(maxsize=None)(plain)
    unbounded._memtrain_unbounded = True  # type: ignore[attr-defined]
    setattr(import_utils, NAME, unbounded)  # its recursion and define_import_structure call the global
    return True
