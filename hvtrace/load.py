"""Find, validate and read a run's rank files into one span table on rank 0's clock.

A rank file is either the live form, an Arrow IPC stream (``.arrows``, also what a crashed rank
leaves), or the compacted form of a closed file, Parquet (``.parquet``); see ``docs/format.md``.
This module is the one that reads spans, in either form.

``open_run(run_dir)`` returns a :class:`Run` with per-rank metadata (headers, status, clocks)
without building the span table; ``load_run(run_dir)`` also reads every span into one pandas
DataFrame (``Run.spans``, with a ``rank`` column, times on rank 0's clock), which ``open_run``'s
Run builds on first access. Bad input raises :class:`TraceError` with a one-line message naming
the file and what is wrong; damaged but partly readable files are kept, and what was lost is
listed in ``Run.problems``.

Imports neither pandas nor ``pyarrow.parquet`` until they are needed: the recorder's compaction
reads streams with :class:`StreamScan` from a training rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import textwrap
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.clock import ClockEstimate, drift_ppm, offset_at
from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    COLUMNS,
    FILE_SCHEMA,
    FILE_SCHEMA_V1,
    FILE_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_KEY,
    PARQUET_SUFFIX,
    READ_VERSIONS,
    REQUIRED_HEADER_FIELDS,
    TRACE_SUFFIXES,
)
from hvtrace.format.status import merge_connections, merge_live, merge_membership, merge_stalls
from hvtrace.selection import StepRange, format_ranks

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow.parquet as pq

log = logging.getLogger("hvtrace.load")


from hvtrace.errors import TraceError  # noqa: E402  (re-exported; a rank imports it without pandas)

#: The first bytes of a Parquet file.
PARQUET_MAGIC = b"PAR1"
#: A file name that says which rank it holds (only a hint: the header inside is authoritative).
_NAME_RANK = re.compile(r"^rank(\d+)-")


@dataclass
class RankFile:
    """One rank's file as read: header, spans (local clock), and what its batches reported."""

    path: Path
    header: dict[str, Any]
    table: pa.Table
    complete: bool = False  # the writer closed it cleanly (final batch seen)
    truncated: bool = False  # the stream ended inside a batch (crash, or damage)
    #: Why reading stopped at an implausible batch (a decompression bomb); "" when it did not.
    refused: str = ""
    dropped: int = 0  # spans the recorder dropped because the writer fell behind
    #: Rows lacking a step, kind or time (null: hvtrace never writes one; damage or tampering),
    #: left out of every figure (a Parquet file not read: as its footer's statistics state).
    missing: int = 0
    last_step: int = -1  # the rank's step counter at its last flush
    writer_cpu_s: float = 0.0  # CPU time hvtrace's writer spent on this file (as last reported)
    clock: list[ClockEstimate] = field(default_factory=list)  # the estimates used to align
    #: The rank's TCP connections as last sampled (:mod:`hvtrace.record.netstat`), unchecked.
    tcp: list[dict[str, Any]] = field(default_factory=list)
    #: Waits in synchronize the rank's writer noted as stalls (:mod:`hvtrace.record.stall`).
    stalls: list[dict[str, Any]] = field(default_factory=list)
    #: Live straggler verdicts (rank 0's file; :mod:`hvtrace.record.live`).
    live: list[dict[str, Any]] = field(default_factory=list)
    #: Membership records of an Elastic Horovod job, after the header's first one
    #: (:mod:`hvtrace.record.elastic`), unchecked (:mod:`hvtrace.analysis.membership` checks).
    membership: list[dict[str, Any]] = field(default_factory=list)
    #: Barrier-round estimates as recorded (kept as a check when ``same_clock`` made them moot).
    clock_measured: list[ClockEstimate] = field(default_factory=list)
    #: True when this rank ran on rank 0's kernel (same boot id): one clock, offset exactly 0.
    same_clock: bool = False
    #: ``"arrows"`` (Arrow IPC stream: live, or left by a crash) or ``"parquet"`` (compacted).
    format: str = "arrows"
    #: Spans in the file: a Parquet file's row count (from its footer, even when not read), or
    #: the rows of every complete batch of a stream. 0 given: taken from ``table``.
    n_spans: int = 0
    #: True when ``table`` holds the file's spans; False for a Parquet file opened with
    #: ``read_spans=False`` (``table`` is empty; :meth:`read_table` reads from disk).
    spans_read: bool = True
    #: A Parquet file's row groups as ``(min step, max step, rows)`` from its footer (None for a
    #: bound without statistics); empty for a stream.
    row_group_steps: list[tuple[int | None, int | None, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.n_spans:
            self.n_spans = self.table.num_rows

    @property
    def rank(self) -> int:
        """The rank, as recorded inside the file."""
        return int(self.header["rank"])

    @property
    def spans(self) -> int:
        """Number of spans in the file (read or not: see :attr:`n_spans`)."""
        return self.n_spans

    def row_groups(self, steps: StepRange | tuple[int, int | None] | None = None) -> list[int]:
        """Return the Parquet row groups whose ``step`` statistics meet ``steps`` (all: None).

        A row group without statistics is always included. An ``.arrows`` file has none: [].
        """
        if self.format != "parquet":
            return []
        if self.row_group_steps:
            return _meeting(self.row_group_steps, StepRange.of(steps))
        with _open_parquet_file(self.path) as pf:
            return _row_groups(pf.metadata, StepRange.of(steps))

    def rows_in(self, steps: StepRange | tuple[int, int | None] | None = None) -> int:
        """Spans a reader of ``steps`` has to decode: the rows of the row groups that meet them
        (a Parquet file), or every span (a stream, filtered in memory)."""
        if self.format != "parquet" or not self.row_group_steps:
            return self.n_spans
        return sum(self.row_group_steps[g][2] for g in self.row_groups(steps))

    def read_table(
        self,
        steps: StepRange | tuple[int, int | None] | None = None,
        columns: Iterable[str] | None = None,
    ) -> pa.Table:
        """Return this file's spans (local clock) of ``steps`` with ``columns`` (default: all).

        For a Parquet file whose spans were not read, only the row groups whose ``step``
        statistics meet ``steps`` are read from disk; otherwise the in-memory table is filtered.
        Raises :class:`TraceError` when a needed row group cannot be read.
        """
        steps = StepRange.of(steps)
        cols = list(COLUMNS) if columns is None else list(columns)
        unknown = [c for c in cols if c not in COLUMNS]
        if unknown:
            raise ValueError(f"unknown span column(s) {unknown}; columns are {list(COLUMNS)}")
        if self.format == "parquet" and not self.spans_read:
            need = cols if steps is None or "step" in cols else [*cols, "step"]
            with _open_parquet_file(self.path) as pf:
                groups = _row_groups(pf.metadata, steps)
                table, err = _read_row_groups(pf, groups, need)
            if err is not None:
                raise TraceError(_problem(self.path, err))
            table = complete_rows(table)[0]
        else:
            table = self.table
        if steps is not None:
            table = table.filter(_step_mask(table.column("step"), steps))
        return table.select(cols)


def salvage(rf: RankFile) -> str | None:
    """Read a Parquet rank file's spans row group by row group, keeping what is readable.

    For when a faster reader (the DuckDB engine) failed on the file: the spans go into
    ``rf.table``. Returns None when every row group was read, else a one-line problem naming the
    file and the first unreadable row group (``rf`` is then marked truncated: the spans after it
    are lost, as for a stream cut by a crash).
    """
    if rf.format != "parquet":
        return None
    with _open_parquet_file(rf.path) as pf:
        n = len(rf.row_group_steps) if rf.refused else pf.num_row_groups  # never the bomb
        table, err = _read_row_groups(pf, range(n), list(COLUMNS))
    (rf.table, rf.missing), rf.spans_read = complete_rows(table), True
    table = rf.table
    if err is None:
        return None
    rf.truncated, rf.n_spans = True, table.num_rows
    return _problem(rf.path, f"{err}; {table.num_rows} spans kept")


@dataclass
class RankSource:
    """One rank's spans as a query engine reads them (:func:`span_relation`).

    ``parquet``: a compacted file's path (DuckDB reads it directly, skipping row groups);
    otherwise ``table``: an Arrow table (an IPC stream read by :mod:`hvtrace.load`, or a span
    frame). ``clock``: the estimates that move its times onto rank 0's clock (empty: already
    there). ``rank`` None: the table has its own ``rank`` column (a whole span frame).
    """

    rank: int | None
    n_spans: int
    parquet: str | None = None
    table: Any = None
    clock: list[Any] = field(default_factory=list)
    #: Row groups of a Parquet file that the step selection needs, and how many it has.
    row_groups_read: int = 0
    row_groups_total: int = 0
    #: The file's format version (a version 1 Parquet file has no ``cpu_ns``/``runq_ns``).
    version: int = FORMAT_VERSION


def span_sources(run: Run, steps: StepRange | None = None) -> list[RankSource]:
    """Return the sources a query engine reads a run's spans from (by rank).

    A compacted file is read by DuckDB from its path (``n_spans``: the rows of the row groups
    ``steps`` needs, which sizes the groups); a stream (live or crashed rank) from the table
    :mod:`hvtrace.load` read.
    """
    out = []
    for r, rf in sorted(run.files.items()):
        if rf.format == "parquet" and not rf.spans_read:
            out.append(
                RankSource(
                    int(r),
                    int(rf.rows_in(steps)),
                    parquet=str(rf.path),
                    clock=rf.clock,
                    row_groups_read=len(rf.row_groups(steps)),
                    row_groups_total=len(rf.row_group_steps),
                    version=int(rf.header["version"]),
                )
            )
        else:
            out.append(RankSource(int(r), int(rf.table.num_rows), table=rf.table, clock=rf.clock))
    return out


#: Columns every span needs; a row with a null in one is left out (:func:`complete_rows`).
REQUIRED_COLUMNS: Final = ("step", "kind", "start_ns", "end_ns")
#: The rows :func:`complete_rows` keeps, in SQL.
_COMPLETE_SQL: Final = " AND ".join(f"{c} IS NOT NULL" for c in REQUIRED_COLUMNS)


def span_relation(
    con: Any, sources: Sequence[RankSource], new_name: Callable[[], str]
) -> tuple[str, dict[str, Any], list[str]]:
    """Return ``(sql, params, registered)``: one DuckDB relation of ``sources`` with a ``rank``
    column and the columns ``step, kind, name, start_ns, end_ns, bytes, dtype, value, flags,
    cpu_ns, runq_ns`` (the last two NULL for a version 1 file, or a table without them; an
    in-memory table without ``value`` / ``flags`` reads NULL / 0).

    Parquet files are read by one ``read_parquet`` per format version (their paths are
    parameters, never spliced into SQL; the rank is looked up by file index); in-memory tables
    are registered on ``con`` under names from ``new_name()``, listed in ``registered`` for the
    caller to unregister.
    """
    parts: list[str] = []
    params: dict[str, Any] = {}
    registered: list[str] = []
    base = "step, kind, name, start_ns, end_ns, bytes, dtype"
    v2 = f"{base}, value, flags, cpu_ns, runq_ns"
    v1 = f"{base}, value, flags, NULL::BIGINT AS cpu_ns, NULL::BIGINT AS runq_ns"
    for version, cols in ((2, v2), (1, v1)):
        files = [s for s in sources if s.parquet is not None and (s.version == 1) == (version == 1)]
        if files:
            params[f"files{version}"] = [str(s.parquet) for s in files]
            params[f"ranks{version}"] = [int(s.rank if s.rank is not None else -1) for s in files]
            parts.append(
                f"SELECT list_extract($ranks{version}, file_index::INTEGER + 1)::INTEGER AS rank, "
                f"{cols} FROM read_parquet($files{version}) WHERE {_COMPLETE_SQL}"
            )
    for s in sources:
        if s.parquet is not None:
            continue
        raw = new_name()
        con.register(raw, s.table)
        registered.append(raw)
        rank = "rank::INTEGER AS rank" if s.rank is None else f"{int(s.rank)}::INTEGER AS rank"
        names = getattr(s.table, "column_names", None) or list(getattr(s.table, "columns", []))
        extra = [
            c if c in names else f"{null} AS {c}"
            for c, null in (
                ("value", "NULL::DOUBLE"),
                ("flags", "0::UTINYINT"),
                ("cpu_ns", "NULL::BIGINT"),
                ("runq_ns", "NULL::BIGINT"),
            )
        ]
        parts.append(f"SELECT {rank}, {base}, {', '.join(extra)} FROM {raw}")
    return " UNION ALL ".join(parts), params, registered


def _step_mask(col: Any, steps: StepRange) -> Any:
    m = pc.greater_equal(col, pa.scalar(steps.first, pa.int32()))
    if steps.stop is not None:
        m = pc.and_(m, pc.less(col, pa.scalar(steps.stop, pa.int64())))
    return m


class Run:
    """A run: per-rank metadata, and ``spans`` (DataFrame, times in ns on rank 0's clock).

    ``spans`` is built on first access (then cached) from the files' tables, reading the spans of
    Parquet files that :func:`open_run` left unread. ``selected_ranks`` is the rank filter the
    run was opened with (None: every rank); ``missing_ranks`` is relative to it.
    """

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        size: int,
        files: dict[int, RankFile],
        spans: pd.DataFrame | None = None,
        problems: list[str] | None = None,
        selected_ranks: frozenset[int] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.size = size
        self.files = files
        self.problems: list[str] = problems if problems is not None else []
        self.selected_ranks = selected_ranks
        #: True while the run is being written (opened with ``open_run(live=True)``, or a
        #: :class:`hvtrace.follow.RunFollower` saw its open files grow): a rank whose file is
        #: still open has not stopped.
        self.live = False
        if spans is not None:
            self.__dict__["spans"] = spans

    def __repr__(self) -> str:
        return (
            f"Run(run_dir={str(self.run_dir)!r}, run_id={self.run_id!r}, size={self.size}, "
            f"ranks={format_ranks(self.ranks) or '-'}, problems={len(self.problems)})"
        )

    @cached_property
    def spans(self) -> pd.DataFrame:
        """All ranks' spans, one DataFrame, times on rank 0's clock (built on first access)."""
        return _span_frame([self.files[r] for r in self.ranks], self.problems)

    @property
    def ranks(self) -> list[int]:
        """Ranks that have a file, sorted."""
        return sorted(self.files)

    @property
    def expected_ranks(self) -> list[int]:
        """Ranks of ``0..size-1`` that were asked for (all of them without a rank filter)."""
        sel = self.selected_ranks
        return [r for r in range(self.size) if sel is None or r in sel]

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks asked for (of ``0..size-1``) with no usable file."""
        return [r for r in self.expected_ranks if r not in self.files]

    @property
    def complete(self) -> bool:
        """True when every rank has a cleanly closed, untruncated file and nothing was dropped."""
        return not self.missing_ranks and all(
            f.complete and not f.truncated and not f.dropped for f in self.files.values()
        )

    def header(self, rank: int) -> dict[str, Any]:
        """Return the header of ``rank``'s file."""
        return self.files[rank].header

    @property
    def hosts(self) -> dict[int, str]:
        """Map rank -> host name."""
        return {r: str(f.header.get("host", "?")) for r, f in self.files.items()}

    def clock_uncertainty_ns(self, rank: int) -> int:
        """Worst uncertainty (ns) of ``rank``'s alignment to rank 0's clock (0: same clock)."""
        f = self.files[rank]
        return max((e.uncertainty_ns for e in f.clock), default=0)

    def clock_table(self) -> dict[int, dict[str, Any]]:
        """Per rank: ``offset_ns`` (its clock minus rank 0's, at its first estimate),
        ``uncertainty_ns`` (the worst of its estimates), ``method`` (``same-clock``,
        ``round-trip`` or ``barrier``; several joined by ``+``), ``estimates``, ``drift_ppm``
        and ``drift_uncertainty_ppm`` (None with fewer than two estimates)."""
        out: dict[int, dict[str, Any]] = {}
        for r, f in sorted(self.files.items()):
            ests = sorted(f.clock, key=lambda e: e.at_ns)
            methods = list(dict.fromkeys(e.method for e in ests)) or ["none"]
            out[int(r)] = {
                "offset_ns": int(ests[0].offset_ns) if ests else 0,
                "uncertainty_ns": self.clock_uncertainty_ns(r),
                "method": "same-clock" if f.same_clock or r == 0 else "+".join(methods),
                "estimates": len(ests),
                "drift_ppm": drift_ppm(ests),
                # the first and last estimates' uncertainties over the time between them
                "drift_uncertainty_ppm": (
                    (ests[0].uncertainty_ns + ests[-1].uncertainty_ns)
                    / (ests[-1].at_ns - ests[0].at_ns)
                    * 1e6
                    if len(ests) > 1 and ests[-1].at_ns > ests[0].at_ns
                    else None
                ),
            }
        return out

    def clock_summary(self) -> str:
        """One line saying how clocks were aligned and how well."""
        same = [r for r, f in self.files.items() if f.same_clock and r != 0]
        others = [r for r, f in self.files.items() if not f.same_clock and r != 0]
        parts = []
        if same:
            check = max(
                (abs(e.offset_ns) for r in same for e in self.files[r].clock_measured), default=0
            )
            parts.append(
                f"{len(same)} rank(s) share rank 0's clock (same kernel and time namespace): "
                "offset 0 exactly "
                f"(barrier estimate within {check / 1e3:.0f} µs of it)"
            )
        if others:
            n_est = sum(len(self.files[r].clock) for r in others)
            worst = max(self.clock_uncertainty_ns(r) for r in others)
            how = Counter(e.method for r in others for e in self.files[r].clock)
            by = " and ".join(
                {"round-trip": "TCP round trips", "barrier": "barrier rounds"}.get(m, m)
                for m in sorted(how)
            )
            parts.append(
                f"{len(others)} rank(s) aligned by {by or 'no estimate'} ({n_est} estimates, "
                f"worst uncertainty ±{worst / 1e3:.0f} µs, drift interpolated)"
            )
        if not parts:
            return "clocks: single rank, no alignment needed"
        return "clocks aligned to rank 0: " + "; ".join(parts)


def _problem(path: Path, msg: str) -> str:
    return f"{path}: {msg}"


def _short(exc: BaseException) -> str:
    """The first line of an exception's message, shortened at a word boundary (200 columns)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return textwrap.shorten(text.splitlines()[0], width=200, placeholder=" …")


def _stat_size(path: Path) -> int:
    """The file's size; a file that cannot be opened for reading (permissions, a directory, a
    vanished file) is "cannot read", not "not an hvtrace trace"."""
    try:
        size = path.stat().st_size
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TraceError(_problem(path, f"cannot read ({exc.strerror or _short(exc)})")) from None
    if size == 0:
        raise TraceError(_problem(path, "empty file (the rank wrote nothing)"))
    return size


def _is_parquet(path: Path) -> bool:
    """True for a ``.parquet`` file, or any file that starts with Parquet's magic bytes."""
    if path.suffix == PARQUET_SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """Return the validated header of one trace file (either form); raise TraceError if unusable."""
    path = Path(path)
    _stat_size(path)
    if _is_parquet(path):
        with _open_parquet(path) as (_, header, _):
            return header
    with StreamScan(path) as scan:
        return _validate_header(path, scan.schema)


def _parse_header(path: Path, raw: bytes | None, where: str) -> dict[str, Any]:
    if raw is None:
        raise TraceError(_problem(path, f"no hvtrace header in the file's {where}"))
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise TraceError(_problem(path, "hvtrace header is not valid JSON")) from None
    if not isinstance(header, dict):
        raise TraceError(_problem(path, "hvtrace header is not a JSON object"))
    if header.get("format") != FORMAT_NAME:
        raise TraceError(
            _problem(path, f"header format is {header.get('format')!r}, not 'hvtrace'")
        )
    missing = [k for k in REQUIRED_HEADER_FIELDS if k not in header]
    if missing:
        raise TraceError(_problem(path, f"header lacks {', '.join(missing)}"))
    if header["version"] not in READ_VERSIONS or isinstance(header["version"], bool):
        raise TraceError(
            _problem(
                path,
                f"format version {header['version']!r} is not supported "
                f"(this hvtrace reads versions {', '.join(map(str, READ_VERSIONS))})",
            )
        )
    for k in ("rank", "size"):
        if not isinstance(header[k], int) or header[k] < 0:
            raise TraceError(_problem(path, f"header {k} is {header[k]!r}, not an integer >= 0"))
    if header["size"] < 1 or header["rank"] >= header["size"]:
        raise TraceError(
            _problem(path, f"header rank {header['rank']} is outside size {header['size']}")
        )
    if header["size"] > MAX_RANKS:
        raise TraceError(
            _problem(path, f"header size {header['size']} is implausible (at most {MAX_RANKS:,})")
        )
    for k, types, what in _HEADER_TYPES:
        if k in header and not _is(header[k], types):
            shown = textwrap.shorten(repr(header[k]), 60, placeholder="…")
            raise TraceError(_problem(path, f"header {k} is {shown}, not {what}"))
    start = header["clock"].get("start")
    if start is not None and not isinstance(start, dict):
        raise TraceError(_problem(path, "header clock start is not a JSON object"))
    return header


#: More ranks than any job has: a header claiming more is not trusted (it would drive the work).
MAX_RANKS: Final = 1 << 20

#: Header fields hvtrace reads, with the JSON types they must have when present.
_HEADER_TYPES: Final = (
    ("run_id", (str,), "a string"),
    ("host", (str,), "a string"),
    ("pid", (int,), "an integer"),
    ("mono_anchor_ns", (int,), "an integer"),
    ("wall_anchor_ns", (int,), "an integer"),
    ("clock", (dict,), "a JSON object"),
    ("local_rank", (int, type(None)), "an integer"),
    ("local_size", (int, type(None)), "an integer"),
    ("cross_rank", (int, type(None)), "an integer"),
    ("cross_size", (int, type(None)), "an integer"),
    ("boot_id", (str, type(None)), "a string"),
    ("time_namespace", (str, type(None)), "a string"),
    ("device", (str, type(None)), "a string"),
    ("timing", (str, type(None)), "a string"),
    ("torch_version", (str, type(None)), "a string"),
    ("horovod_version", (str, type(None)), "a string"),
    ("model", (str, type(None)), "a string"),
    ("horovod_env", (dict, type(None)), "a JSON object"),
    ("optimizer", (dict, type(None)), "a JSON object"),
    ("framework", (dict, type(None)), "a JSON object"),
)


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """``isinstance`` where JSON's true/false do not count as integers."""
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _validate_header(path: Path, schema: pa.Schema) -> dict[str, Any]:
    header = _parse_header(path, (schema.metadata or {}).get(HEADER_KEY), "schema metadata")
    if not schema.equals(file_schema(header["version"]), check_metadata=False):
        raise TraceError(
            _problem(
                path, f"span columns do not match the hvtrace format version {header['version']}"
            )
        )
    return header


def file_schema(version: int) -> pa.Schema:
    """The columns of a file of format ``version`` (1: without ``cpu_ns`` and ``runq_ns``)."""
    return FILE_SCHEMA_V1 if version == 1 else FILE_SCHEMA


def with_all_columns(table: pa.Table, columns: Iterable[str] | None = None) -> pa.Table:
    """``table`` with every one of ``columns`` (default :data:`COLUMNS`), in that order: those a
    version 1 file lacks (``cpu_ns``, ``runq_ns``) are added as nulls."""
    cols = list(COLUMNS) if columns is None else list(columns)
    if table.column_names == cols:
        return table
    n = table.num_rows
    arrays = [
        table.column(c) if c in table.column_names else pa.nulls(n, FILE_SCHEMA.field(c).type)
        for c in cols
    ]
    return pa.Table.from_arrays(arrays, schema=pa.schema([FILE_SCHEMA.field(c) for c in cols]))


def _columns_match(schema: pa.Schema, version: int) -> bool:
    """True when ``schema`` has the columns of format ``version`` (dictionary index widths may
    differ)."""
    want_schema = file_schema(version)
    if schema.names != want_schema.names:
        return False
    for got, want in zip(schema.types, want_schema.types, strict=True):
        if pa.types.is_dictionary(want):
            if not (pa.types.is_dictionary(got) and got.value_type == want.value_type):
                return False
        elif got != want:
            return False
    return True


def _start_clock(rf: RankFile) -> None:
    start = rf.header.get("clock", {}).get("start")
    if isinstance(start, dict):
        try:
            rf.clock.append(ClockEstimate.from_dict(start))
        except (KeyError, ValueError, TypeError):
            raise TraceError(_problem(rf.path, "header clock estimate is malformed")) from None


#: A compressed IPC message may expand to at most this many times its size (hvtrace's own
#: batches expand 3-6x; a small batch that claims millions of rows is a decompression bomb) ...
MAX_EXPANSION: Final = 64
#: ... unless it expands to no more than this (small batches are never refused).
MIN_REFUSED_BYTES: Final = 64 << 20


def _fb_field(buf: bytes, table: int, i: int) -> int | None:
    """Position of field ``i`` of the flatbuffer table at ``table`` (None: absent)."""
    vt = table - int.from_bytes(buf[table : table + 4], "little", signed=True)
    if 4 + 2 * i + 2 > int.from_bytes(buf[vt : vt + 2], "little"):
        return None
    off = int.from_bytes(buf[vt + 4 + 2 * i : vt + 6 + 2 * i], "little")
    return table + off if off else None


def _fb_ref(buf: bytes, pos: int) -> int:
    return pos + int.from_bytes(buf[pos : pos + 4], "little")


def message_info(metadata: bytes) -> tuple[int, int]:
    """``(header type, body length)`` of an Arrow IPC message's flatbuffer metadata (Message:
    ``header_type``, ``bodyLength``; 1 schema, 2 dictionary batch, 3 record batch). Raises
    IndexError when the metadata is too short for what it claims."""
    root = _fb_ref(metadata, 0)
    pos = _fb_field(metadata, root, 1)
    kind = metadata[pos] if pos is not None else 0
    pos = _fb_field(metadata, root, 3)
    body = int.from_bytes(metadata[pos : pos + 8], "little", signed=True) if pos is not None else 0
    return kind, body


def message_claims(metadata: bytes, body: Any) -> tuple[int, int] | None:
    """``(rows, bytes)`` that an Arrow IPC record batch or dictionary message will expand to,
    read from its flatbuffer metadata and the uncompressed-length prefix of each compressed
    buffer, before anything is decompressed; None for other messages.

    Raises ValueError when the metadata cannot be parsed (Message -> RecordBatch: ``length``,
    ``buffers``, ``compression``; the layout of Arrow's Message.fbs)."""
    buf = bytes(metadata)
    try:
        header_type, _ = message_info(buf)
        root = _fb_ref(buf, 0)
        pos = _fb_field(buf, root, 2)
        if header_type not in (2, 3) or pos is None:  # 2: DictionaryBatch, 3: RecordBatch
            return None
        batch = _fb_ref(buf, pos)
        if header_type == 2:
            pos = _fb_field(buf, batch, 1)
            if pos is None:
                return None
            batch = _fb_ref(buf, pos)
        pos = _fb_field(buf, batch, 0)
        rows = int.from_bytes(buf[pos : pos + 8], "little", signed=True) if pos else 0
        compressed = _fb_field(buf, batch, 3) is not None
        pos = _fb_field(buf, batch, 2)
        total = 0
        data = memoryview(body) if body is not None else memoryview(b"")
        if pos is not None:
            vec = _fb_ref(buf, pos)
            for k in range(int.from_bytes(buf[vec : vec + 4], "little")):
                at = vec + 4 + 16 * k
                off = int.from_bytes(buf[at : at + 8], "little", signed=True)
                length = int.from_bytes(buf[at + 8 : at + 16], "little", signed=True)
                if off < 0 or length < 0 or off + length > len(data):
                    raise ValueError("a buffer lies outside the message body")
                if compressed and length >= 8:
                    raw = int.from_bytes(data[off : off + 8], "little", signed=True)
                    total += length - 8 if raw == -1 else raw
                else:
                    total += length
    except IndexError:
        raise ValueError("malformed message metadata") from None
    if rows < 0 or total < 0:
        raise ValueError("negative length in message metadata")
    return rows, total


def implausible(metadata: Any, body: Any, is_batch: bool, n: int) -> str:
    """Why IPC message ``n`` (counted after the schema) may not be expanded
    (:data:`MAX_EXPANSION`), or "" when it may."""
    size = body.size if body is not None else 0
    try:
        claims = message_claims(metadata, body)
    except ValueError as exc:
        return f"message {n} after the schema: {exc}"
    if claims is not None:
        rows, nbytes = claims
        if nbytes > max(MIN_REFUSED_BYTES, MAX_EXPANSION * size):
            what = "batch" if is_batch else "dictionary"
            return (
                f"a {what} of {size:,} bytes claims {rows:,} rows in {nbytes:,} bytes "
                f"(over {MAX_EXPANSION}x): not expanded"
            )
    return ""


def plausible_batches(path: str | os.PathLike) -> tuple[int | None, str]:
    """How many record batches of the stream at ``path`` may be expanded: ``(None, "")`` for all,
    or ``(n, why)`` when batch ``n`` (0-based) or a dictionary before it claims more than the
    format can plausibly hold (:data:`MAX_EXPANSION`). Reads message metadata only (memory
    mapped); a stream that ends early is left to the reader."""
    batches = 0
    try:
        mapped = pa.memory_map(str(path))
    except OSError:  # the reader reports what it cannot read
        return None, ""
    with mapped as src:
        try:
            reader = pa.ipc.MessageReader.open_stream(src)
        except (pa.ArrowException, OSError, ValueError):
            return None, ""
        while True:
            try:
                msg = reader.read_next_message()
            except StopIteration:
                return None, ""
            except (pa.ArrowException, OSError, ValueError):
                return None, ""
            why = implausible(msg.metadata, msg.body, msg.type == "record batch", batches + 1)
            if why:
                return batches, why
            if msg.type == "record batch":
                batches += 1


class StreamScan:
    """The complete record batches of an ``.arrows`` stream, one by one, with their status.

    ``with StreamScan(path) as scan:`` opens the stream (raising :class:`TraceError` when not even
    its schema is readable) and sets ``scan.schema``; iterating yields ``(batch, status)`` for
    every complete, valid batch (``status``: the batch's parsed ``hvtrace.status`` dict, or None
    when absent or malformed). After iteration, ``truncated`` says whether the stream ended inside
    a batch (a crash or damage) and ``final`` whether a batch said the file was closed cleanly.
    Memory stays bounded by one batch: a batch (or a dictionary) whose metadata claims more than
    it can plausibly expand to is not read, nor anything after it (``refused`` says why, and
    ``truncated`` is set), see :func:`plausible_batches`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.truncated = False
        self.final = False
        self.refused = ""
        try:
            self._src = pa.memory_map(str(self.path))
        except OSError as exc:
            raise TraceError(
                _problem(self.path, f"cannot read ({exc.strerror or _short(exc)})")
            ) from None
        try:
            self._reader = pa.ipc.open_stream(self._src)
        except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as exc:
            self._src.close()
            raise TraceError(
                _problem(
                    self.path,
                    f"not an hvtrace trace (no readable Arrow stream header: {_short(exc)})",
                )
            ) from None
        self.schema: pa.Schema = self._reader.schema

    def __enter__(self) -> StreamScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the file."""
        self._src.close()

    def __iter__(self) -> Iterator[tuple[pa.RecordBatch, dict[str, Any] | None]]:
        reader = self._reader
        messages = reader.stats.num_messages
        # checked here, not when opening: reading the header alone needs no pass over the batches
        limit, why = plausible_batches(self.path)
        n = 0
        while True:
            if limit is not None and n >= limit:
                self.truncated, self.refused = True, why
                return
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                # The writer emits a batch's new names as a delta dictionary message just before
                # the record batch: a stream ending after that message was cut inside a batch.
                if reader.stats.num_messages > messages:
                    self.truncated = True
                return
            except (pa.ArrowException, OSError, ValueError):
                # after the final batch only the end-of-stream marker can be cut: nothing lost
                self.truncated = not self.final
                return
            try:
                batch.validate(full=True)
            except (pa.ArrowException, ValueError):
                self.truncated = True
                return
            status = _parse_status(meta)
            if status is not None and status.get("final"):
                self.final = True
            messages = reader.stats.num_messages
            n += 1
            yield batch, status


def _parse_status(meta: Any) -> dict[str, Any] | None:
    if meta is None:
        return None
    raw = meta.get(BATCH_STATUS_KEY)
    if raw is None:
        return None
    try:
        st = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return st if isinstance(st, dict) else None


def read_rank_file(path: str | os.PathLike, read_spans: bool = True) -> RankFile:
    """Read one trace file (either form): header, spans, and the status the writer reported.

    A stream that ends inside a batch (a crash or a cut) keeps every batch before the cut and is
    marked ``truncated``; a stream is always read whole (its status is spread over its batches).
    A Parquet file's header and status come from its footer; with ``read_spans=False`` its spans
    are not read (``table`` stays empty, ``n_spans`` is the footer's row count). Raises
    :class:`TraceError` if not even the header is readable.
    """
    path = Path(path)
    _stat_size(path)
    if _is_parquet(path):
        return _read_parquet_rank_file(path, read_spans)
    with StreamScan(path) as scan:
        header = _validate_header(path, scan.schema)
        rf = RankFile(path, header, FILE_SCHEMA.empty_table())
        _start_clock(rf)
        schema = file_schema(header["version"])
        batches: list[pa.RecordBatch] = []
        for batch, status in scan:
            batches.append(batch)
            if status is not None:
                _apply_status(rf, status)
        rf.truncated, rf.refused = scan.truncated, scan.refused
        if batches:
            table = with_all_columns(pa.Table.from_batches(batches, schema=schema))
            rf.table, rf.missing = complete_rows(table)
    rf.n_spans = rf.table.num_rows
    return rf


def _apply_status(rf: RankFile, st: dict[str, Any]) -> None:
    try:
        rf.dropped = max(rf.dropped, int(st.get("dropped", 0)))
        rf.last_step = max(rf.last_step, int(st.get("last_step", -1)))
        rf.complete = rf.complete or bool(st.get("final"))
        rf.writer_cpu_s = max(rf.writer_cpu_s, float(st.get("writer_cpu_s", 0.0)))
        rf.clock.extend(ClockEstimate.from_dict(c) for c in st.get("clock", []))
        if "tcp" in st:
            rf.tcp = merge_connections(rf.tcp, st["tcp"])
        if "stall" in st:
            rf.stalls = merge_stalls(rf.stalls, st["stall"])
        if "live" in st:
            rf.live = merge_live(rf.live, st["live"])
        if "membership" in st:
            rf.membership = merge_membership(rf.membership, st["membership"])
    except (ValueError, TypeError, KeyError, AttributeError):
        pass  # a damaged status does not make the spans unusable


# -- Parquet ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _open_parquet_file(path: Path) -> Iterator[pq.ParquetFile]:
    """``with _open_parquet_file(path) as pf``: a ``pyarrow.parquet.ParquetFile``, closed after.

    Raises :class:`TraceError` when the file has no readable Parquet footer.
    """
    import pyarrow.parquet as pq  # only when a Parquet file is read

    try:
        pf = pq.ParquetFile(str(path), memory_map=True)
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise TraceError(
            _problem(path, f"not an hvtrace trace (no readable Parquet footer: {_short(exc)})")
        ) from None
    try:
        yield pf
    finally:
        pf.close()


@contextlib.contextmanager
def _open_parquet(
    path: Path,
) -> Iterator[tuple[pq.ParquetFile, dict[str, Any], dict[str, Any] | None]]:
    """``with _open_parquet(path) as (pf, header, status)``: a validated hvtrace Parquet file."""
    with _open_parquet_file(path) as pf:
        meta = pf.metadata.metadata or {}
        header = _parse_header(path, meta.get(HEADER_KEY), "Parquet key-value metadata")
        try:
            schema = pf.schema_arrow
        except (pa.ArrowException, ValueError, TypeError):
            schema = None
        if schema is None or not _columns_match(schema, header["version"]):
            raise TraceError(_problem(path, "span columns do not match the hvtrace format"))
        yield pf, header, _parse_status(meta)


#: Bytes a decoded span takes in memory (the fixed-width columns of FILE_SCHEMA).
ROW_BYTES: Final = 61


def plausible_row_groups(md: pq.FileMetaData) -> tuple[int | None, str]:
    """How many row groups of a Parquet file may be decoded: ``(None, "")`` for all, or
    ``(n, why)`` when row group ``n`` claims more rows than its compressed bytes can plausibly
    hold (decoded, over :data:`MAX_EXPANSION` times their size; hvtrace's expand about 5x), or
    whose columns the footer says decompress to that much (a dictionary holding one string of a
    gigabyte is a few kilobytes compressed: rows alone do not show it)."""
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        cols = [rg.column(i) for i in range(rg.num_columns)]
        size = sum(c.total_compressed_size for c in cols)
        limit = max(MIN_REFUSED_BYTES, MAX_EXPANSION * size)
        decoded = max(rg.num_rows, 0) * ROW_BYTES
        if decoded > limit:
            return g, (
                f"row group {g} of {size:,} bytes claims {rg.num_rows:,} rows "
                f"(over {MAX_EXPANSION}x decoded): not expanded"
            )
        for c in cols:
            if c.total_uncompressed_size > limit:
                return g, (
                    f"row group {g} of {size:,} bytes states {c.total_uncompressed_size:,} bytes "
                    f"uncompressed in column {c.path_in_schema!r} (over {MAX_EXPANSION}x): "
                    "not expanded"
                )
    return None, ""


def _read_parquet_rank_file(path: Path, read_spans: bool) -> RankFile:
    with _open_parquet(path) as (pf, header, status):
        rf = RankFile(
            path,
            header,
            FILE_SCHEMA.empty_table(),
            format="parquet",
            n_spans=pf.metadata.num_rows,
            spans_read=False,
            row_group_steps=_row_group_steps(pf.metadata),
            missing=_footer_nulls(pf.metadata),
        )
        _start_clock(rf)
        if status is not None:
            _apply_status(rf, status)
            rf.truncated = bool(status.get("truncated"))
        n_ok, why = plausible_row_groups(pf.metadata)
        if n_ok is not None:  # read what comes before (a query engine must not see the rest)
            rf.refused, rf.truncated = why, True
            rf.row_group_steps = rf.row_group_steps[:n_ok]
            table, err = _read_row_groups(pf, range(n_ok), list(COLUMNS))
            (rf.table, rf.missing), rf.spans_read = complete_rows(table), True
            rf.n_spans = rf.table.num_rows
            if err is not None:
                log.debug("%s", _problem(path, err))
        elif read_spans:
            table, err = _read_row_groups(pf, range(pf.num_row_groups), list(COLUMNS))
            (rf.table, rf.missing), rf.spans_read = complete_rows(table), True
            if err is not None:  # keep the row groups before the damage, as for a cut stream
                log.debug("%s", _problem(path, err))
                rf.truncated, rf.n_spans = True, table.num_rows
    return rf


def _row_groups(md: pq.FileMetaData, steps: StepRange | None) -> list[int]:
    """Row groups whose ``step`` min/max meet ``steps`` (those without statistics included)."""
    return _meeting(_row_group_steps(md), steps)


def _row_group_steps(md: pq.FileMetaData) -> list[tuple[int | None, int | None, int]]:
    """``(min step, max step, rows)`` of each row group (None bounds: no statistics)."""
    col = COLUMNS.index("step")
    out: list[tuple[int | None, int | None, int]] = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        st = rg.column(col).statistics
        if st is None or not st.has_min_max:
            out.append((None, None, rg.num_rows))
        else:
            out.append((int(st.min), int(st.max), rg.num_rows))
    return out


def _meeting(
    groups: list[tuple[int | None, int | None, int]], steps: StepRange | None
) -> list[int]:
    """Indices of ``groups`` whose step bounds meet ``steps`` (unknown bounds always do)."""
    if steps is None:
        return list(range(len(groups)))
    return [
        g
        for g, (lo, hi, _) in enumerate(groups)
        if lo is None or hi is None or steps.overlaps(lo, hi)
    ]


def _conform(table: pa.Table, columns: list[str]) -> pa.Table:
    """Return ``table`` with the format's exact column types (dictionary index widths)."""
    table = table.replace_schema_metadata(None)
    target = pa.schema([FILE_SCHEMA.field(c) for c in columns])
    return table if table.schema.equals(target) else table.cast(target)


def _read_row_groups(
    pf: pq.ParquetFile, groups: Iterable[int], columns: list[str]
) -> tuple[pa.Table, str | None]:
    """Read ``groups`` of ``columns``; return (table, None), or what was read before a damaged
    row group and a message saying what failed."""
    tables: list[pa.Table] = []
    err = None
    have = set(pf.schema_arrow.names)
    present = [c for c in columns if c in have]  # a version 1 file lacks cpu_ns and runq_ns
    for g in groups:
        try:
            t = pf.read_row_group(g, columns=present)
            t.validate(full=True)
            tables.append(with_all_columns(_conform(t, present), columns))
        except (pa.ArrowException, OSError, ValueError, TypeError, IndexError) as exc:
            err = f"row group {g} is unreadable ({_short(exc)}); later spans lost"
            break
    if not tables:
        return pa.schema([FILE_SCHEMA.field(c) for c in columns]).empty_table(), err
    return pa.concat_tables(tables).unify_dictionaries(), err


def complete_rows(table: pa.Table) -> tuple[pa.Table, int]:
    """``table`` without the rows that lack one of :data:`REQUIRED_COLUMNS` (of those it has),
    and how many those were."""
    cols = [c for c in REQUIRED_COLUMNS if c in table.column_names]
    if not any(table.column(c).null_count for c in cols):
        return table, 0
    ok = pc.is_valid(table.column(cols[0]))
    for c in cols[1:]:
        ok = pc.and_(ok, pc.is_valid(table.column(c)))
    kept = table.filter(ok)
    return kept, table.num_rows - kept.num_rows


def _footer_nulls(md: pq.FileMetaData) -> int:
    """Nulls in :data:`REQUIRED_COLUMNS` as a Parquet footer's statistics state them."""
    idx = [COLUMNS.index(c) for c in REQUIRED_COLUMNS]
    n = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for i in idx:
            st = rg.column(i).statistics if i < rg.num_columns else None
            if st is not None and st.has_null_count:
                n += max(int(st.null_count), 0)
    return n


#: Problems of one kind listed one by one at most; the rest are counted in one line.
MAX_LISTED_PROBLEMS: Final = 10


def summarize_problems(problems: list[str], what: str) -> list[str]:
    """``problems`` as they are when there are at most :data:`MAX_LISTED_PROBLEMS`, else the
    first of them and one line counting the rest (20,000 junk files in a run directory are a
    few lines, not 20,000)."""
    if len(problems) <= MAX_LISTED_PROBLEMS:
        return problems
    rest = len(problems) - MAX_LISTED_PROBLEMS
    return [*problems[:MAX_LISTED_PROBLEMS], f"... and {rest:,} more {what}s (not listed)"]


# -- a run directory ---------------------------------------------------------------------------
def find_trace_files(run_dir: str | os.PathLike) -> list[Path]:
    """Return the trace files (``*.arrows``, ``*.parquet``) in ``run_dir`` (sorted); raise
    TraceError if there are none."""
    d = Path(run_dir)
    if not d.exists():
        raise TraceError(f"{d}: no such directory")
    if not d.is_dir():
        if d.suffix in TRACE_SUFFIXES:
            return [d]
        raise TraceError(f"{d}: not a directory of hvtrace traces")
    try:
        files = sorted(
            p
            for p in d.iterdir()
            if p.suffix in TRACE_SUFFIXES and not p.name.startswith(".") and p.is_file()
        )
    except OSError as exc:
        raise TraceError(
            f"{d}: cannot read the directory ({exc.strerror or _short(exc)})"
        ) from None
    if not files:
        raise TraceError(
            f"{d}: no hvtrace trace files (*{FILE_SUFFIX} or *{PARQUET_SUFFIX}) in this directory"
        )
    return files


def rank_from_name(path: str | os.PathLike) -> int | None:
    """The rank a file's name claims (``rank{N:05d}-...``), or None. Only a hint: the header
    inside the file says which rank it holds."""
    m = _NAME_RANK.match(Path(path).name)
    return int(m.group(1)) if m else None


def open_run(
    run_dir: str | os.PathLike,
    run_id: str | None = None,
    ranks: frozenset[int] | None = None,
    progress: Callable[[Iterable[Path]], Iterable[Path]] | None = None,
    read_spans: bool = False,
    read_stream: Callable[[Path], RankFile] | None = None,
    live: bool = False,
) -> Run:
    """Open a run directory: every rank's header, status and clock alignment, no span table.

    Several runs in one directory: the newest is opened (or ``run_id``), and the others' files are
    listed in ``Run.problems``. A rank file that cannot be read at all is reported there and the
    other ranks are still opened. With ``ranks``, files whose name says another rank are not
    opened at all, a file whose header says another rank is dropped, and ``Run.missing_ranks`` /
    ``Run.problems`` say which selected ranks have no file. ``.arrows`` files are read whole;
    Parquet files' spans only with ``read_spans`` (else when ``Run.spans`` is first used).
    A rank with both a ``.parquet`` and an ``.arrows`` of the same name (an interrupted
    compaction) is read from the Parquet file. ``progress`` wraps the file iteration (for a
    progress bar). ``read_stream(path)`` reads an ``.arrows`` stream instead of
    :func:`read_rank_file` (:class:`hvtrace.follow.RunFollower` reads only what was appended since
    its last call); ``live``: the run is being written, so a stream not yet closed is no problem
    and problems are not logged (the caller shows them). Raises :class:`TraceError` when no
    usable rank file remains.
    """
    paths = find_trace_files(run_dir)
    selected = None if ranks is None else frozenset(int(r) for r in ranks)
    if selected is not None:
        if not selected:
            raise TraceError(f"{run_dir}: no rank selected")
        paths = [p for p in paths if (r := rank_from_name(p)) is None or r in selected]
        if not paths:
            raise TraceError(f"{run_dir}: no trace file of rank(s) {format_ranks(selected)}")
    problems: list[str] = []
    unreadable: list[str] = []
    headers: dict[Path, dict[str, Any]] = {}
    opened: dict[Path, RankFile] = {}  # Parquet: the footer read once gives header and status
    for p in paths:
        try:
            if _is_parquet(p):
                opened[p] = read_rank_file(p, read_spans=read_spans)
                h = opened[p].header
            else:
                h = read_header(p)
        except TraceError as exc:
            unreadable.append(str(exc))
            continue
        if selected is not None and h["rank"] not in selected:
            log.debug("%s holds rank %s, not selected; skipped", p, h["rank"])
            continue
        headers[p] = h
    problems += summarize_problems(unreadable, "unreadable file")
    if not headers:
        if not problems:
            raise TraceError(f"{run_dir}: no trace file of rank(s) {format_ranks(selected or [])}")
        if len(problems) == 1:
            raise TraceError(problems[0])
        raise TraceError(f"{run_dir}: none of {len(paths)} trace files is usable ({problems[0]})")
    runs: dict[str, list[Path]] = {}
    for p, h in headers.items():
        runs.setdefault(str(h["run_id"]), []).append(p)
    if run_id is None:
        run_id = max(runs, key=lambda r: max(headers[p]["wall_anchor_ns"] for p in runs[r]))
    elif run_id not in runs:
        raise TraceError(
            f"{run_dir}: no files of run {run_id} (runs here: {', '.join(sorted(runs))})"
        )
    for other, ps in sorted(runs.items()):
        if other != run_id:
            problems.append(
                f"{run_dir}: ignored {len(ps)} file(s) of another run {other} "
                f"({', '.join(p.name for p in ps[:3])}{', ...' if len(ps) > 3 else ''})"
            )
    chosen = _skip_compacted_streams(runs[run_id], headers, problems)
    # the size most files state (on a tie the smaller), never less than the ranks present:
    # one file's claim does not decide how many ranks are reported missing
    claims = Counter(int(headers[p]["size"]) for p in chosen)
    size = min(claims, key=lambda n: (-claims[n], n))
    size = max(size, 1 + max(int(headers[p]["rank"]) for p in chosen))
    # an elastic job's workers that joined later count every worker before them: the most
    if any(_membership_gen(headers[p]) > 0 for p in chosen):
        size = max(max(claims), size)
    elif len(claims) > 1:
        problems.append(
            f"{run_dir}: files of run {run_id} disagree on size {sorted(claims)}; using {size}"
        )
    files: dict[int, RankFile] = {}
    iterable = progress(chosen) if progress else chosen
    for p in iterable:
        try:
            if p in opened:
                rf = opened.pop(p)
            elif read_stream is not None:
                rf = read_stream(p)
            else:
                rf = read_rank_file(p, read_spans=read_spans)
        except TraceError as exc:
            problems.append(str(exc))
            continue
        if rf.refused:
            problems.append(_problem(p, f"{rf.refused}; {rf.spans} spans kept before it"))
        elif rf.truncated or (not rf.complete and not live):
            problems.append(unclosed_problem(rf))
        if rf.dropped:
            problems.append(
                _problem(p, f"the recorder dropped {rf.dropped} spans (the writer fell behind)")
            )
        if rf.missing:
            problems.append(
                _problem(
                    p,
                    f"{rf.missing} spans lack a step, kind or time (null; damage?): left out",
                )
            )
        prev = files.get(rf.rank)
        if prev is not None:
            keep, drop = (prev, rf) if prev.spans >= rf.spans else (rf, prev)
            problems.append(
                _problem(
                    drop.path,
                    f"also claims rank {rf.rank} (as {keep.path.name} "
                    f"does); ignored the one with fewer spans",
                )
            )
            rf = keep
        files[rf.rank] = rf
    if not files:
        raise TraceError(f"{run_dir}: no readable rank file for run {run_id} ({problems[-1]})")
    missing = [r for r in range(size) if r not in files and (selected is None or r in selected)]
    if missing:
        if selected is None:
            problems.append(
                f"{run_dir}: run {run_id} has {size} ranks but no usable file for rank(s) "
                f"{format_ranks(missing)}; analyzing the others"
            )
        else:
            problems.append(
                f"{run_dir}: run {run_id}: no usable file for selected rank(s) "
                f"{format_ranks(missing)}"
            )
    if selected is not None:
        outside = sorted(r for r in selected if r >= size)
        if outside:
            problems.append(
                f"{run_dir}: run {run_id} has {size} ranks; selected rank(s) "
                f"{format_ranks(outside)} do not exist"
            )
    problems += _choose_clocks(files, _reference_clock_id(run_dir, run_id, files))
    for msg in problems if not live else []:
        log.warning("%s", msg)
    run = Run(Path(run_dir), run_id, size, files, None, problems, selected)
    run.live = live
    return run


def _membership_gen(header: dict[str, Any]) -> int:
    """The elastic membership generation a file started in (0: at the start, or not elastic)."""
    m = header.get("membership")
    try:
        return int(m.get("gen", 0)) if isinstance(m, dict) else 0
    except (TypeError, ValueError):
        return 0


def unclosed_problem(rf: RankFile) -> str:
    """The problem reported for a stream its rank never closed (cut inside a batch, or not)."""
    if rf.truncated:
        return _problem(
            rf.path,
            f"truncated after {rf.spans} spans; the rest was lost (rank crashed or file damaged)",
        )
    return _problem(
        rf.path,
        f"not closed cleanly (rank {rf.rank} stopped at step {rf.last_step}); "
        f"{rf.spans} spans kept",
    )


def _clock_id(header: dict[str, Any]) -> tuple[Any, Any]:
    """What identifies a rank's CLOCK_MONOTONIC: its kernel's boot id and its time namespace
    (None in files written before hvtrace recorded it)."""
    return header.get("boot_id"), header.get("time_namespace")


def _reference_clock_id(
    run_dir: str | os.PathLike, run_id: str, files: dict[int, RankFile]
) -> tuple[Any, Any] | None:
    """Rank 0's :func:`_clock_id`: from its file when opened, else from its header alone
    (``--ranks`` without 0 still aligns ranks on rank 0's clock exactly). None when it cannot
    be read."""
    if 0 in files:
        return _clock_id(files[0].header)
    for p in find_trace_files(run_dir):
        if rank_from_name(p) != 0:
            continue
        try:
            h = read_header(p)
        except TraceError:
            continue
        if h.get("rank") == 0 and str(h.get("run_id")) == run_id:
            return _clock_id(h)
    return None


def _skip_compacted_streams(
    paths: list[Path], headers: dict[Path, dict[str, Any]], problems: list[str]
) -> list[Path]:
    """Drop an ``.arrows`` file whose ``.parquet`` twin (same name, run and rank) is here too.

    That is what an interrupted compaction leaves: the Parquet file was published, the stream not
    yet removed. The Parquet file holds the same spans.
    """
    by_name = {p.name: p for p in paths}
    out = []
    for p in paths:
        twin = by_name.get(p.with_suffix(PARQUET_SUFFIX).name) if p.suffix == FILE_SUFFIX else None
        if twin is not None and headers[twin]["rank"] == headers[p]["rank"]:
            problems.append(
                _problem(p, f"already compacted into {twin.name} (interrupted); read that one")
            )
            continue
        out.append(p)
    return out


def load_run(
    run_dir: str | os.PathLike,
    run_id: str | None = None,
    ranks: frozenset[int] | None = None,
    progress: Callable[[Iterable[Path]], Iterable[Path]] | None = None,
) -> Run:
    """Load a run directory into a :class:`Run` (spans on rank 0's clock, ns).

    :func:`open_run` with every file's spans read, then the span DataFrame built (``Run.spans``).
    Raises :class:`TraceError` when no usable rank file remains.
    """
    run = open_run(run_dir, run_id=run_id, ranks=ranks, progress=progress, read_spans=True)
    _ = run.spans
    return run


#: How far (beyond its stated uncertainty) a barrier estimate may be from 0 for a rank that
#: looks like it shares rank 0's clock before the claim is disbelieved.
SAME_CLOCK_SLACK_NS: Final = 1_000_000


def _choose_clocks(files: dict[int, RankFile], ref: tuple[Any, Any] | None = None) -> list[str]:
    """Use offset 0 exactly for ranks that read rank 0's very clock; barrier estimates for the
    others. Returns problems to report.

    Processes under one kernel (same ``boot_id``) and in one time namespace read the same
    CLOCK_MONOTONIC, so their true offset is zero; a time namespace offsets the clock under the
    same kernel, so both must match (files without the namespace: the boot id alone). The
    barrier estimates are kept in ``clock_measured`` as a check, and when they put such a rank
    further from 0 than their uncertainty (plus :data:`SAME_CLOCK_SLACK_NS`), the claim is
    disbelieved and the estimates are used. ``ref``: rank 0's ``(boot_id, time_namespace)``
    (default: from rank 0's file in ``files``).
    """
    problems: list[str] = []
    if ref is None and 0 in files:
        ref = _clock_id(files[0].header)
    ref_boot, ref_ns = ref if ref is not None else (None, None)
    for r, rf in sorted(files.items()):
        rf.clock_measured = list(rf.clock)
        boot, ns = _clock_id(rf.header)
        if not ref_boot or boot != ref_boot or ns != ref_ns:
            continue
        far = [e for e in rf.clock if abs(e.offset_ns) > e.uncertainty_ns + SAME_CLOCK_SLACK_NS]
        if far and r != 0:
            e = max(far, key=lambda e: abs(e.offset_ns))
            problems.append(
                _problem(
                    rf.path,
                    f"rank {r} reports rank 0's kernel clock, but its barrier estimate is "
                    f"{e.offset_ns / 1e6:+.3f} ms ±{e.uncertainty_ns / 1e6:.3f}: using the "
                    "estimate",
                )
            )
            continue
        at = rf.clock[0].at_ns if rf.clock else 0
        rf.clock = [ClockEstimate(at, 0, 0, 0, method="same-clock")]
        rf.same_clock = True
    return problems


def _file_table(rf: RankFile, problems: list[str] | None) -> pa.Table:
    """``rf``'s spans: its table, or (a Parquet file opened without them) read from disk now."""
    if rf.spans_read:
        return rf.table
    try:
        with _open_parquet_file(rf.path) as pf:
            table, err = _read_row_groups(pf, range(pf.num_row_groups), list(COLUMNS))
    except TraceError as exc:
        table, err = FILE_SCHEMA.empty_table(), str(exc).removeprefix(f"{rf.path}: ")
    if err is not None:
        rf.truncated = True
        msg = _problem(rf.path, err)
        log.warning("%s", msg)
        if problems is not None:
            problems.append(msg)
    return table


def align_times(
    clock: list[ClockEstimate], start_ns: np.ndarray, end_ns: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One rank's span times moved onto rank 0's clock with its estimates ``clock``: each end's
    offset interpolated at that end (one estimate: the same offset for both). The one rule every
    reader of spans uses (the span frame, the Perfetto export)."""
    off_s = offset_at(clock, start_ns)
    off_e = offset_at(clock, end_ns) if len(clock) > 1 else off_s
    return start_ns - off_s, end_ns - off_e


def _span_frame(files: list[RankFile], problems: list[str] | None = None) -> pd.DataFrame:
    """Concatenate rank tables, align times to rank 0's clock and return a DataFrame."""
    tables = []
    for rf in files:
        t = _file_table(rf, problems)
        start, end = align_times(
            rf.clock, t.column("start_ns").to_numpy(), t.column("end_ns").to_numpy()
        )
        t = t.set_column(t.schema.get_field_index("start_ns"), "start_ns", pa.array(start))
        t = t.set_column(t.schema.get_field_index("end_ns"), "end_ns", pa.array(end))
        t = t.add_column(0, "rank", pa.array(np.full(t.num_rows, rf.rank, np.int32)))
        tables.append(t)
    if not tables:
        t = FILE_SCHEMA.empty_table()
        tables.append(t.add_column(0, "rank", pa.array([], pa.int32())))
    table = pa.concat_tables(tables).unify_dictionaries()
    df = table.to_pandas()
    for col in ("kind", "name", "dtype"):
        df[col] = df[col].astype("category")
    return df
