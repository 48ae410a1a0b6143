"""Reading one rank file, in either form: its header, its batch statuses and its spans.

A rank file is the live form, an Arrow IPC stream (``.arrows``, also what a crashed rank leaves),
or the compacted form of a closed file, Parquet (``.parquet``); see ``docs/format.md``. This
module reads and checks one file (:func:`read_header`, :func:`read_rank_file`, a stream batch by
batch with :class:`StreamScan`, a Parquet file row group by row group) and finds a run's files
(:func:`find_trace_files`). Nothing in a file is trusted: sizes are checked against the bytes
that hold them before anything is expanded, and a damaged file keeps what is readable, with a
problem naming the file and what was lost.

Part of the format (:mod:`hvtrace.format`): the recorder's compaction reads streams back with it
from a training rank, so it imports neither pandas nor ``pyarrow.parquet`` until they are needed,
and nothing of the recorder, the run model (:mod:`hvtrace.load`) or the analysis.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.clock import ClockEstimate
from hvtrace.errors import TraceError
from hvtrace.format.footer import FooterError, column_stats, read_footer
from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    COLUMNS,
    FILE_SCHEMA,
    FILE_SCHEMA_V1,
    FILE_SUFFIX,
    FORMAT_NAME,
    HEADER_KEY,
    PARQUET_SUFFIX,
    READ_VERSIONS,
    REQUIRED_HEADER_FIELDS,
    TRACE_SUFFIXES,
)
from hvtrace.format.status import merge_connections, merge_live, merge_membership, merge_stalls
from hvtrace.selection import StepRange

if TYPE_CHECKING:
    import pyarrow.parquet as pq

log = logging.getLogger("hvtrace.load")

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
    #: Whether :meth:`check_step_statistics` compared the footer's step bounds with the rows.
    steps_checked: bool = False
    #: What a Parquet footer states wrongly that did not cost spans (its total row count); "".
    footer_problem: str = ""

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
        return _meeting(self.row_group_steps, StepRange.of(steps))

    def check_step_statistics(self, steps: StepRange | tuple[int, int | None] | None) -> str:
        """Before a reader skips row groups by their footer's ``step`` min/max (``steps``
        leaves some out), compare those bounds with the steps each row group holds (the
        ``step`` column of every row group is read, nothing else). Statistics that lie (a
        crafted footer would make a selection silently lose a rank) are not used: every span
        is read into ``table`` with the careful reader (no engine prunes the file by them),
        ``row_group_steps`` states the true bounds, and a one-line problem naming the file is
        returned; "" when they hold (or nothing is skipped), checked once per file."""
        steps = StepRange.of(steps)
        if (
            self.format != "parquet"
            or self.spans_read
            or self.steps_checked
            or steps is None
            or len(self.row_groups(steps)) == len(self.row_group_steps)
        ):
            return ""
        self.steps_checked = True
        lies = []
        true_steps: list[tuple[int | None, int | None, int]] = []
        groups = range(len(self.row_group_steps))
        with _open_parquet_file(self.path) as pf:
            try:  # the step column of every row group, at once (4 bytes a row, sorted)
                col = pf.read_row_groups(groups, columns=["step"]).column("step")
            except (pa.ArrowException, OSError, ValueError, TypeError, IndexError):
                col = None  # a damaged row group: the careful reader of the spans says so
            at = 0
            for g, (lo, hi, n) in enumerate(self.row_group_steps):
                part = col.slice(at, n) if col is not None and at + n <= len(col) else None
                at += n
                ok = part is not None and len(part) > part.null_count
                mm = pc.min_max(part).as_py() if ok else {"min": None, "max": None}
                t_lo, t_hi = mm["min"], mm["max"]
                true_steps.append((t_lo, t_hi, n))
                known = None not in (lo, hi, t_lo, t_hi)
                if known and (t_lo < lo or t_hi > hi):  # type: ignore[operator]
                    lies.append(f"row group {g} holds steps {t_lo}..{t_hi}, not {lo}..{hi}")
            if not lies:
                return ""
            table, err = _read_row_groups(pf, groups, list(COLUMNS))
        (self.table, self.missing), self.spans_read = complete_rows(table), True
        self.row_group_steps = true_steps
        if err is not None:
            self.truncated, self.n_spans = True, self.table.num_rows
        more = f" (and {len(lies) - 1} more)" if len(lies) > 1 else ""
        return _problem(
            self.path,
            f"the footer's step statistics are wrong: {lies[0]}{more}; every row group read",
        )

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
        lie = self.check_step_statistics(steps)
        if lie:
            log.warning("%s", lie)
        if self.format == "parquet" and not self.spans_read:
            need = cols if steps is None or "step" in cols else [*cols, "step"]
            with _open_parquet_file(self.path) as pf:
                groups = self.row_groups(steps)
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


#: Columns every span needs; a row with a null in one is left out (:func:`complete_rows`).
REQUIRED_COLUMNS: Final = ("step", "kind", "start_ns", "end_ns")
#: The rows :func:`complete_rows` keeps, in SQL.
_COMPLETE_SQL: Final = " AND ".join(f"{c} IS NOT NULL" for c in REQUIRED_COLUMNS)


def _step_mask(col: Any, steps: StepRange) -> Any:
    m = pc.greater_equal(col, pa.scalar(steps.first, pa.int32()))
    if steps.stop is not None:
        m = pc.and_(m, pc.less(col, pa.scalar(steps.stop, pa.int64())))
    return m


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
        if isinstance(header.get(k), int) and not 0 <= header[k] < MAX_HEADER_INT:
            shown = textwrap.shorten(repr(header[k]), 60, placeholder="…")
            raise TraceError(_problem(path, f"header {k} is {shown}, out of range (0 to 2**62)"))
    start = header["clock"].get("start")
    if start is not None and not isinstance(start, dict):
        raise TraceError(_problem(path, "header clock start is not a JSON object"))
    return header


#: More ranks than any job has: a header claiming more is not trusted (it would drive the work).
MAX_RANKS: Final = 1 << 20

#: Integers of the header (times in ns, ids, counts) are below this (about 146 years in ns):
#: a larger one is damage, and would overflow the int64 arithmetic of the times built on it.
MAX_HEADER_INT: Final = 1 << 62

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


def _footer_steps(
    path: Path, md: pq.FileMetaData
) -> tuple[list[tuple[int | None, int | None, int]], int, int | None, str]:
    """``(row_group_steps, nulls, n_ok, why)`` from a Parquet file's footer, read by
    :mod:`hvtrace.format.footer` (pyarrow aborts the process on a statistic of the wrong
    width): each row group's ``(min step, max step, rows)``, the nulls its statistics state in
    :data:`REQUIRED_COLUMNS`, and ``(None, "")``, or the first row group whose statistics are
    malformed (``n_ok``, never read: every reader would fail on it) and why."""
    rows = [max(md.row_group(g).num_rows, 0) for g in range(md.num_row_groups)]
    try:
        stats = column_stats(read_footer(path), list(REQUIRED_COLUMNS))
        n_ok, why = None, ""
    except (FooterError, OSError) as exc:
        g = getattr(exc, "group", None) or 0
        stats, n_ok = [], g
        why = f"the footer is malformed ({_short(exc)}): row groups from {g} on not read"
        try:  # the row groups before it are usable
            stats = column_stats(read_footer(path), list(REQUIRED_COLUMNS), upto=n_ok)
        except (FooterError, OSError):
            stats, n_ok = [], 0
    steps: list[tuple[int | None, int | None, int]] = []
    nulls = 0
    for g, st in enumerate(stats[: len(rows)]):
        step = st.get("step")
        lo, hi = (step.min, step.max) if step is not None else (None, None)
        steps.append((lo, hi, rows[g]))
        nulls += sum(max(c.null_count or 0, 0) for c in st.values())
    if n_ok is None and len(steps) < len(rows):  # the footer parsed has fewer row groups
        n_ok = len(steps)
        why = f"the footer is malformed: row groups from {n_ok} on not read"
    bad = [g for g in range(md.num_row_groups) if md.row_group(g).num_rows < 0]
    if bad and (n_ok is None or bad[0] < n_ok):
        n_ok = bad[0]
        why = (
            f"the footer states {md.row_group(n_ok).num_rows:,} rows in row group {n_ok}: "
            f"row groups from {n_ok} on not read"
        )
    return steps[: len(steps) if n_ok is None else n_ok], nulls, n_ok, why


def _read_parquet_rank_file(path: Path, read_spans: bool) -> RankFile:
    with _open_parquet(path) as (pf, header, status):
        steps, nulls, n_bad, bad = _footer_steps(path, pf.metadata)
        nrg = pf.metadata.num_row_groups
        rf = RankFile(
            path,
            header,
            FILE_SCHEMA.empty_table(),
            format="parquet",
            # the row groups' rows (never below 0), not the footer's total (-5 crashed info)
            n_spans=sum(max(pf.metadata.row_group(g).num_rows, 0) for g in range(nrg)),
            spans_read=False,
            row_group_steps=steps,
            missing=nulls,
        )
        _start_clock(rf)
        if status is not None:
            _apply_status(rf, status)
            rf.truncated = bool(status.get("truncated"))
        n_ok, why = plausible_row_groups(pf.metadata)
        if n_bad is not None and (n_ok is None or n_bad < n_ok):
            n_ok, why = n_bad, bad
        if n_ok is not None:  # read what comes before (a query engine must not see the rest)
            rf.refused, rf.truncated = why, True
            rf.row_group_steps = rf.row_group_steps[:n_ok]
            table, err = _read_row_groups(pf, range(n_ok), list(COLUMNS))
            (rf.table, rf.missing), rf.spans_read = complete_rows(table), True
            rf.n_spans = rf.table.num_rows
            if err is not None:
                log.debug("%s", _problem(path, err))
        elif read_spans or pf.metadata.num_rows != rf.n_spans:
            if pf.metadata.num_rows != rf.n_spans:  # DuckDB refuses the file: read it here
                rf.footer_problem = (
                    f"the footer states {pf.metadata.num_rows:,} rows, its row groups "
                    f"{rf.n_spans:,}: read row group by row group"
                )
            table, err = _read_row_groups(pf, range(pf.num_row_groups), list(COLUMNS))
            (rf.table, rf.missing), rf.spans_read = complete_rows(table), True
            if err is not None:  # keep the row groups before the damage, as for a cut stream
                log.debug("%s", _problem(path, err))
                rf.truncated, rf.n_spans = True, table.num_rows
    return rf


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
