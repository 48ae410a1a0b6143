"""One byte formatter for every renderer: the report, the findings and the dashboard."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from hvtrace.units import format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (40, "40 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (2048, "2.0 KiB"),
        (int(3.5 * 2**20), "3.5 MiB"),
        (5 * 2**30, "5.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (np.int64(4096), "4.0 KiB"),
        (np.float32(40.0), "40 B"),
        ("1024", "1.0 KiB"),
    ],
)
def test_format_bytes_iec(n: object, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [None, math.nan, np.nan, pd.NA, math.inf, "x", object()])
def test_format_bytes_missing_is_a_dash(n: object) -> None:
    assert format_bytes(n) == "-"


def test_one_formatter_left() -> None:
    import hvtrace.analysis.findings as findings
    import hvtrace.export.report as report

    assert not hasattr(report, "_bytes") and not hasattr(findings, "_bytes")
    figures = pytest.importorskip("hvtrace_dashboard.figures")
    assert not hasattr(figures, "_fmt_bytes")
