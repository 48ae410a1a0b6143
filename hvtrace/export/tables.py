"""``hvtrace analyze --csv / --parquet``: an analysis's tables (and the run's spans) as files.

:func:`write_tables` writes the span table (a run of any size: Arrow tables one after the other,
:func:`hvtrace.analysis.engine.span_tables`) and the per-step, per-rank, per-tensor, collective,
user-span and straggler tables of an :class:`hvtrace.analysis.Analysis`; CSV cells a spreadsheet
would run are neutralized (:func:`csv_safe`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis import Analysis
from hvtrace.export.output import make_output_dir, open_output


def export_tables(a: Analysis, spans: pd.DataFrame | None = None) -> dict[str, pd.DataFrame]:
    """Return the tables written by :func:`write_tables`, by file stem.

    ``spans`` (the run's span table, times in ns on rank 0's clock), ``steps`` (per rank and
    step), ``per_rank``, ``per_step``, ``tensors``, ``collectives``, ``user_spans``, ``stragglers``
    (every rank's evidence and verdict).
    """
    out = {}
    if spans is not None:
        out["spans"] = spans
    out["steps"] = a.steps
    out["per_rank"] = a.per_rank
    out["per_step"] = a.per_step
    out["tensors"] = a.tensors
    out["collectives"] = a.collectives
    out["user_spans"] = a.users
    out["stragglers"] = a.verdicts
    return out


def _to_arrow(df: pd.DataFrame) -> Any:
    import pyarrow as pa

    t = pa.Table.from_pandas(df, preserve_index=False)
    cols = []
    for i, f in enumerate(t.schema):
        c = t.column(i)
        if pa.types.is_dictionary(f.type):
            c = c.cast(f.type.value_type)
        cols.append(c)
    return pa.table(cols, names=t.schema.names)


#: A cell a spreadsheet would run as a formula begins with one of these (OWASP, "CSV Injection").
_FORMULA_START = r"^[=+\-@\t\r]"


def csv_safe(table: Any) -> Any:
    """``table`` with every text cell a spreadsheet would run as a formula (``=HYPERLINK(...)``,
    ``+1``, ``-1+2``, ``@SUM(...)``, or a leading tab or carriage return) prefixed with ``'``, as
    OWASP advises: names in a trace are the user's or anyone's (a tensor, a span, a host) and a
    CSV is opened in spreadsheets. Numbers are numeric columns and are left alone."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = []
    for i, f in enumerate(table.schema):
        c = table.column(i)
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            risky = pc.match_substring_regex(c, _FORMULA_START)
            quote, empty = pa.scalar("'", f.type), pa.scalar("", f.type)
            c = pc.if_else(risky, pc.binary_join_element_wise(quote, c, empty), c)
        cols.append(c)
    return pa.table(cols, names=table.schema.names)


def write_tables(
    a: Analysis,
    out_dir: str | os.PathLike,
    fmt: str = "csv",
    spans: pd.DataFrame | Iterable[Any] | None = None,
    inputs: Iterable[str | os.PathLike] = (),
) -> list[Path]:
    """Write :func:`export_tables` into ``out_dir`` as ``NAME.csv`` or ``NAME.parquet``.

    ``spans``: the span table, as one DataFrame or as Arrow tables of one schema written one
    after the other (:func:`hvtrace.analysis.engine.span_tables`: a run of any size, one rank
    in memory at a time). Each file is written whole or not at all, never over one of
    ``inputs``; CSV cells that a spreadsheet would run are neutralized (:func:`csv_safe`).
    Returns the files written. Raises :class:`TraceError` when the directory cannot be written.
    """
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"fmt must be 'csv' or 'parquet', not {fmt!r}")
    d = make_output_dir(out_dir)
    inputs = list(inputs)
    written = []
    tables: dict[str, Any] = {}
    if spans is not None:
        tables["spans"] = [_to_arrow(spans)] if isinstance(spans, pd.DataFrame) else spans
    tables |= {k: [_to_arrow(df)] for k, df in export_tables(a).items()}
    for name, parts in tables.items():
        p = d / f"{name}.{fmt}"
        with open_output(p, inputs) as f:
            _write_parts(f, parts, fmt)
        written.append(p)
    return written


def _write_parts(f: Any, parts: Iterable[Any], fmt: str) -> None:
    """Write the Arrow tables ``parts`` (one schema) to ``f`` as one CSV or Parquet file."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    writer: Any = None
    try:
        for table in parts:
            if writer is None:
                if fmt == "csv":
                    writer = pacsv.CSVWriter(f, table.schema)
                else:
                    writer = pq.ParquetWriter(f, table.schema)
            writer.write_table(csv_safe(table) if fmt == "csv" else table)
    finally:
        if writer is not None:
            writer.close()
