"""datasets: a feature's type name.

Checked on datasets 5.2.0 (installed); tested range :data:`memtrain._compat.versions.TESTED`
(4.7–5.2.0).
"""

from __future__ import annotations

from typing import Any


def feature_type(feature: Any) -> str:
    """The type name of a ``datasets`` feature (``"Value"``, ``"List"``, ``"Array2D"``, ...): its
    ``_type`` field, which ``Features.to_dict`` writes; datasets has no public accessor (``""`` for
    an object without one)."""
    return str(getattr(feature, "_type", ""))
