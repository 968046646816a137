"""Byte sizes: parse "24GiB"-style strings and format byte counts for people."""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size such as ``"24GiB"``, ``"1.5 GB"`` or ``1024`` into bytes.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000; a bare number is bytes.

    Raises:
        ValueError: the text is not a size; the message says what a size looks like.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size like '24GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or (unit not in _UNITS and unit != ""):
        raise ValueError(f"expected a size like '24GiB' or '512MiB', got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit or "b"])


def unitless_tiny(text: str | int) -> bool:
    """``text`` is a bare number (bytes, no unit) under 1 MiB: as a memory budget, surely a size
    whose unit was left out ("300" meant 300GiB or 300MiB, not 300 bytes)."""
    return isinstance(text, str) and text.strip().isdigit() and int(text) < 2**20


def budget_problem(text: str) -> str | None:
    """Why ``text`` is not a memory budget (a positive size with a unit, or ``auto``), in words that
    follow the field's name; None when it is one. The one rule for the recipe's budgets
    (``memory.budget``, ``host_budget``, ``simulate_budget``) and the CLI's ``--budget``."""
    if text == "auto":
        return None
    try:
        size = parse_size(text)
    except ValueError:
        return "must look like '24GiB', '512MiB' or 'auto'"
    if size <= 0:
        return "must be more than 0 bytes, like '24GiB', or 'auto'"
    if unitless_tiny(text):
        return (f"is {size} bytes (a number without a unit is bytes); write the unit, like '{text}GiB' or "
                f"'{text}MiB'")
    return None


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"
