"""How hvtrace writes quantities for people: one formatter per unit, used by every renderer.

Imports nothing heavy (no numpy, no pandas): the report, the findings and the dashboard all call
these, so a byte count reads the same everywhere.
"""

from __future__ import annotations

import math
from typing import Any

#: IEC binary units, largest first, with their size in bytes.
_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: Any) -> str:
    """Return a byte count in IEC binary units: ``40 B``, ``2.0 KiB``, ``3.5 MiB``, ``1.2 GiB``.

    One decimal from KiB up; whole bytes below 1 KiB. ``n`` may be any number (numpy scalars
    included); ``-`` for missing values (None, NaN, NA, infinite or not a number).
    """
    try:
        b = float(n)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(b):
        return "-"
    sign = "-" if b < 0 else ""
    b = abs(b)
    for unit, div in _BYTE_UNITS:
        if b >= div:
            return f"{sign}{b / div:.1f} {unit}"
    return f"{sign}{b:.0f} B"


__all__ = ["format_bytes"]


def printable(text: object) -> str:
    """``text`` with every character a terminal would act on (control characters, escape
    sequences, newlines, tabs) written visibly as a Python escape (``\\x1b``, ``\\n``): names
    and hosts from trace files cannot clear a screen, set a title or forge a report line."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)
