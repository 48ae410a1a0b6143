"""Background writer: drains a rank's span buffer into its trace file.

The hot path only appends tuples to a deque. This thread wakes every ``flush_interval_s``, turns
what is there into one Arrow record batch, appends it to the rank's ``.arrows`` stream and flushes
the file to the OS, so after a SIGKILL everything older than about one interval is on disk and the
file stays readable (a stream has no footer to lose). Any error here disables recording with one
warning; nothing is ever raised into training. A cleanly closed stream is compacted into a Parquet
file beside it (:func:`compact`; :func:`compact_run` does it afterwards for a run's leftovers), in
a child process (:func:`compact_in_child`) so that the rank's own memory does not grow by it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    COLUMNS,
    DTYPES,
    FILE_SCHEMA,
    FILE_SUFFIX,
    HEADER_KEY,
    KINDS,
    PARQUET_ROW_GROUP_ROWS,
    PARQUET_SUFFIX,
)
from hvtrace.format.status import merge_connections, merge_live, merge_membership, merge_stalls
from hvtrace.record import rows as rows_mod
from hvtrace.record.cpustat import deltas_columns

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, compaction cannot tell a live stream
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("hvtrace")

# Row layout in the buffer (positions in the tuple): see hvtrace.record.rows.
STEP, MICRO, KIND, NAME, START, END, BYTES, DTYPE, VALUE, FLAGS = range(10)
CPU_START, CPU_END, BASE_LEN = rows_mod.CPU_START, rows_mod.CPU_END, rows_mod.BASE_LEN
_K_ALLREDUCE, UNREAD = rows_mod._K_ALLREDUCE, rows_mod.UNREAD


def _fixed(values: Any, np_dtype: Any, pa_type: pa.DataType) -> pa.Array:
    """A fixed-width Arrow array of ``values``, built from a numpy buffer.

    ``pa.array`` imports pandas (to check for pandas objects), which a training rank must not
    pay for; ``from_buffers`` does not.
    """
    a = np.ascontiguousarray(np.asarray(values, dtype=np_dtype))
    return pa.Array.from_buffers(pa_type, len(a), [None, pa.py_buffer(a)])


def _utf8(value: str) -> bytes:
    """``value`` as UTF-8; a string that has none (a lone surrogate, as ``os.fsdecode`` makes of
    a file name that is not UTF-8) is stored with that code point escaped (``\\udcff``, one
    warning), not as bytes that would make the whole batch unreadable."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        if "escaped" not in _warned:
            _warned.add("escaped")
            log.warning(
                "hvtrace: a span or scalar name is not valid Unicode (%r); stored with the "
                "invalid code points escaped",
                value[:200],
            )
        return value.encode("utf-8", "backslashreplace")


#: Warnings given once per process.
_warned: set[str] = set()


def _strings(values: list[str]) -> pa.Array:
    """A UTF-8 string array of ``values`` (offsets + data buffers; see :func:`_fixed`)."""
    encoded = [_utf8(v) for v in values]
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets), data])


_KIND_DICT = _strings(list(KINDS))
_DTYPE_DICT = _strings(list(DTYPES))


def write_options(codecs: tuple[str, ...] = ("zstd", "lz4")) -> pa.ipc.IpcWriteOptions:
    """Return the IPC options of trace files: compressed buffers, delta name dictionaries.

    The first available of ``codecs`` compresses each buffer. While recording, the writer uses lz4
    (half the CPU of zstd on a flush of a few dozen spans); compaction at close rewrites the file
    as zstd Parquet (smaller, see :func:`compact`). ``use_threads=False``: a flush compresses a
    few kB, which Arrow's CPU thread pool (one thread per core, in every rank) would only make
    costlier on a node whose cores train.
    """
    codec = next((c for c in codecs if pa.Codec.is_available(c)), None)
    return pa.ipc.IpcWriteOptions(compression=codec, emit_dictionary_deltas=True, use_threads=False)


#: Codecs tried, in order, for the batches flushed while recording.
LIVE_CODECS = ("lz4", "zstd")


class BatchEncoder:
    """Turns buffered row tuples into record batches of :data:`FILE_SCHEMA`.

    Names are interned across batches; each batch carries the full name dictionary so far, which
    the IPC writer emits as a delta (only new names are written).
    """

    def __init__(self) -> None:
        self._name_ids: dict[str, int] = {}
        self._names: list[str] = []
        self._name_dict = _strings([])
        # the last synchronize's tensors (their meta entries, by identity) and their columns:
        # a model's allreduces are the same from one step to the next
        self._ar_meta: list = []
        self._ar_cols: tuple[np.ndarray, ...] = ()

    def _name_id(self, name: str) -> int:
        i = self._name_ids.get(name)
        if i is None:
            i = self._name_ids[name] = len(self._names)
            self._names.append(name)
        return i

    def encode(self, entries: list) -> pa.RecordBatch:
        """Return one record batch holding ``entries``: rows (tuples of resolved ints, see
        :mod:`hvtrace.record.rows`; rows without readings get null ``cpu_ns`` and ``runq_ns``)
        and, with host timers, unexpanded :class:`~hvtrace.record.rows.Allreduces`, whose rows
        are the ones :func:`~hvtrace.record.rows.expand` makes, in the same places, built as
        columns (no tuple per tensor: a 152-tensor model's step costs the writer about 3x less,
        bench/writer_cost.py)."""
        n_names = len(self._names)
        rows: list[tuple] = []
        row_pos: list[int] = []  # where each row goes among the batch's rows
        syncs: list[rows_mod.Allreduces] = []
        tensors: list[tuple[np.ndarray, ...]] = []  # per synchronize: its tensors' columns
        sync_pos: list[int] = []  # where each synchronize's first row goes
        tensor_columns = self._tensor_columns
        n = 0
        for e in entries:
            if type(e) is tuple:
                rows.append(e)
                row_pos.append(n)
                n += 1
            else:
                cols = tensor_columns(e)
                syncs.append(e)
                tensors.append(cols)
                sync_pos.append(n)
                n += len(cols[1])
        parts = self._row_columns(rows)
        if syncs:
            sizes = np.fromiter((len(t[1]) for t in tensors), np.int64, len(tensors))
            parts = _interleave(
                parts,
                np.asarray(row_pos, np.int64),
                self._allreduce_block(syncs, tensors, sizes),
                np.asarray(sync_pos, np.int64),
                sizes,
                n,
            )
        if len(self._names) != n_names:
            self._name_dict = _strings(self._names)
        step, micro, kind, name, start, end, nbytes, dtype, value, flags = parts[:BASE_LEN]
        arrays = [
            _fixed(step, np.int32, pa.int32()),
            _fixed(micro, np.int16, pa.int16()),
            pa.DictionaryArray.from_arrays(_fixed(kind, np.int8, pa.int8()), _KIND_DICT),
            pa.DictionaryArray.from_arrays(_fixed(name, np.int32, pa.int32()), self._name_dict),
            _fixed(start, np.int64, pa.int64()),
            _fixed(end, np.int64, pa.int64()),
            _fixed(nbytes, np.int64, pa.int64()),
            pa.DictionaryArray.from_arrays(_fixed(dtype, np.int8, pa.int8()), _DTYPE_DICT),
            _fixed(value, np.float64, pa.float64()),
            _fixed(flags, np.uint8, pa.uint8()),
            _nullable_int64(parts[BASE_LEN], parts[BASE_LEN + 2]),  # cpu_ns
            _nullable_int64(parts[BASE_LEN + 1], parts[BASE_LEN + 3]),  # runq_ns
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=FILE_SCHEMA)

    def _row_columns(self, rows: list[tuple]) -> list[np.ndarray]:
        """The columns of rows (tuples): the ten of a row's fields, then ``cpu_ns``,
        ``runq_ns`` and whether each was measured (from the readings at start and end)."""
        name_id = self._name_id
        names = np.fromiter((name_id(r[NAME]) for r in rows), np.int32, len(rows))
        cols = list(zip(*(r[:BASE_LEN] for r in rows))) if rows else [()] * BASE_LEN
        readings = [(r[CPU_START], r[CPU_END]) if len(r) > CPU_START else UNREAD for r in rows]
        return [
            np.asarray(cols[STEP], np.int32),
            np.asarray(cols[MICRO], np.int16),
            np.asarray(cols[KIND], np.int8),
            names,
            np.asarray(cols[START], np.int64),
            np.asarray(cols[END], np.int64),
            np.asarray(cols[BYTES], np.int64),
            np.asarray(cols[DTYPE], np.int8),
            np.asarray(cols[VALUE], np.float64),
            np.asarray(cols[FLAGS], np.uint8),
            *deltas_columns(readings),
        ]

    def _tensor_columns(self, e: rows_mod.Allreduces) -> tuple[np.ndarray, ...]:
        """``(tensors per enqueued call, names, bytes, dtypes)`` of one synchronize's
        allreduces: the last synchronize's when its meta entries are the very same objects (a
        model's allreduces are the same from one step to the next)."""
        meta = e.meta
        infos = [meta[key] for _, key, _ in e.enqueued]
        if (
            not self._ar_cols  # nothing cached yet (a first synchronize may enqueue nothing)
            or len(infos) != len(self._ar_meta)
            or not all(map(operator.is_, infos, self._ar_meta))
        ):
            name_id = self._name_id
            self._ar_cols = (
                np.fromiter((len(i[0]) for i in infos), np.int64, len(infos)),
                np.fromiter((name_id(n) for i in infos for n in i[0]), np.int32),
                np.fromiter((b for i in infos for b in i[1]), np.int64),
                np.fromiter((d for i in infos for d in i[2]), np.int8),
            )
            self._ar_meta = infos
        return self._ar_cols

    @staticmethod
    def _allreduce_block(
        syncs: list[rows_mod.Allreduces], tensors: list[tuple[np.ndarray, ...]], sizes: np.ndarray
    ) -> list[np.ndarray]:
        """The batch columns of every synchronize's allreduces, one after another (as
        :func:`_interleave` takes them), a row per tensor: each enqueued call's tensors start at
        its enqueue and end at its handle's first observed completion, else at the
        synchronize's end (as :func:`~hvtrace.record.rows.expand`); no counters."""
        total = int(sizes.sum())

        n_calls = sum(len(e.enqueued) for e in syncs)
        call_ends = rows_mod.call_ends
        start = np.fromiter((s for e in syncs for s, _, _ in e.enqueued), np.int64, n_calls)
        stop = np.fromiter((t for e in syncs for t in call_ends(e)), np.int64, n_calls)
        if n_calls != total:  # grouped allreduces: several tensors per call
            counts = np.concatenate([t[0] for t in tensors])
            start, stop = np.repeat(start, counts), np.repeat(stop, counts)

        def per_sync(values: Any, dtype: Any) -> np.ndarray:
            return np.repeat(np.fromiter(values, dtype, len(syncs)), sizes)

        zeros = np.zeros(total, np.int64)
        unmeasured = np.zeros(total, np.bool_)
        return [
            per_sync((e.step for e in syncs), np.int32),
            per_sync((e.micro for e in syncs), np.int16),
            np.full(total, _K_ALLREDUCE, np.int8),
            np.concatenate([t[1] for t in tensors]),  # names
            start,
            stop,
            np.concatenate([t[2] for t in tensors]),  # bytes
            np.concatenate([t[3] for t in tensors]),  # dtypes
            np.full(total, np.nan, np.float64),
            per_sync((e.flags for e in syncs), np.uint8),
            zeros,  # cpu_ns
            zeros,  # runq_ns
            unmeasured,
            unmeasured,
        ]


def _interleave(
    row_cols: list[np.ndarray],
    row_pos: np.ndarray,
    ar_cols: list[np.ndarray],
    sync_pos: np.ndarray,
    sizes: np.ndarray,
    n: int,
) -> list[np.ndarray]:
    """The batch's ``n`` rows, column by column: the rows' at ``row_pos``, each synchronize's
    ``sizes`` allreduces (``ar_cols``, one synchronize after another) from its first row's
    place (``sync_pos``) on, one by one."""
    ar_pos = np.arange(int(sizes.sum()), dtype=np.int64)
    ar_pos += np.repeat(sync_pos - (np.cumsum(sizes) - sizes), sizes)
    out = []
    for rc, ac in zip(row_cols, ar_cols):
        col = np.empty(n, rc.dtype)
        col[row_pos] = rc
        col[ar_pos] = ac
        out.append(col)
    return out


def _nullable_int64(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """An int64 Arrow array of ``values``, null where not ``valid``."""
    n = len(values)
    bits = pa.py_buffer(np.packbits(valid, bitorder="little"))
    nulls = n - int(valid.sum())
    return pa.Array.from_buffers(pa.int64(), n, [bits, pa.py_buffer(values)], null_count=nulls)


class TraceFile:
    """An open trace file: header at open, then batches with a JSON status each. Not thread-safe."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]) -> None:
        self.path = Path(path)
        # a new file, never one that is there: a FIFO or link planted at the name fails here
        # (FileExistsError: tracing is disabled with a warning) instead of blocking or being
        # followed
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._sink: BinaryIO = os.fdopen(fd, "wb")
        if fcntl is not None:  # tells `hvtrace compact` that this stream is still being written
            with contextlib.suppress(OSError):
                fcntl.flock(self._sink.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        schema = FILE_SCHEMA.with_metadata({HEADER_KEY: json.dumps(header).encode()})
        self._writer = pa.ipc.new_stream(self._sink, schema, options=write_options(LIVE_CODECS))
        self._encoder = BatchEncoder()
        # Arrow writes the schema (our header) only with the first batch: write an empty one now,
        # so that a rank that dies before its first flush still leaves a readable file.
        self.append([], {"dropped": 0, "clock": [], "last_step": 0, "final": False, "spans": 0})

    def append(self, rows: list[tuple], status: dict[str, Any]) -> None:
        """Append one batch of resolved rows with its status, and flush it to the OS."""
        self.write_batch(self.encode(rows), status)

    def encode(self, entries: list) -> pa.RecordBatch:
        """The record batch of ``entries`` (see :meth:`BatchEncoder.encode`), names interned
        with this file's earlier batches."""
        return self._encoder.encode(entries)

    def write_batch(self, batch: pa.RecordBatch, status: dict[str, Any]) -> None:
        """Append a record batch of :data:`FILE_SCHEMA` already built (a benchmark's or a
        converter's; the recorder uses :meth:`append`), with its status, and flush it."""
        self._writer.write_batch(batch, custom_metadata={BATCH_STATUS_KEY: json.dumps(status)})
        self._sink.flush()

    def abandon(self) -> None:
        """Close the file without the end-of-stream marker, as a killed rank leaves it."""
        self._sink.close()

    def close(self) -> None:
        """Write the end-of-stream marker and close the file."""
        try:
            self._writer.close()
        finally:
            self._sink.close()


@dataclass
class CompactResult:
    """What :func:`compact` did with one ``.arrows`` file.

    ``action``: ``"compacted"`` (the Parquet file was written and the stream removed),
    ``"resumed"`` (a Parquet file of the same run, rank and span count was already there: an
    earlier compaction was interrupted after publishing it; the stream was removed), or ``"kept"``
    (nothing changed; ``reason`` says why).
    """

    source: Path
    target: Path
    action: str
    spans: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    row_groups: int = 0
    final: bool = False  # the stream's last batch said the file was closed cleanly
    truncated: bool = False  # the stream ended inside a batch (crash or damage)
    reason: str = ""
    #: Bytes of temporary files an interrupted compaction of this file left, removed now.
    stale_bytes: int = 0

    @property
    def done(self) -> bool:
        """True when the spans now live in ``target`` and the stream is gone."""
        return self.action in ("compacted", "resumed")


#: How long a rank waits at close for the child that compacts its file (it then goes on exiting;
#: the child finishes on its own).
COMPACT_CHILD_WAIT_S = 60.0


def compact_in_child(
    path: str | os.PathLike, wait_s: float = COMPACT_CHILD_WAIT_S
) -> CompactResult:
    """:func:`compact` a closed stream in a child Python process, and wait for it.

    Compacting in the rank itself grows the rank's peak memory by the Parquet writer, the sort
    and the allocator's arenas: 24-36 MB measured per rank (``bench/overhead.py``), more than the
    recording. The child (``python -m hvtrace.record.compact_child PATH``) prints its result as
    JSON.
    Where the child cannot be started or fails before publishing the Parquet file, the rank
    compacts in-process, as before; a child still running after ``wait_s`` is left to finish
    (the stream is complete either way, and ``hvtrace compact`` finishes what it leaves).
    """
    src = Path(path)
    cmd = [sys.executable, "-m", "hvtrace.record.compact_child", str(src)]
    try:
        child = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
    except OSError as exc:
        log.debug("hvtrace: cannot start a compaction process (%s); compacting here", exc)
        return compact(src, live_check=False)
    try:
        out, _ = child.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return CompactResult(
            src, src.with_suffix(PARQUET_SUFFIX), "kept", reason="still compacting"
        )
    try:
        res = json.loads(out)
        return CompactResult(src, Path(res.pop("target")), **res)
    except (ValueError, TypeError, KeyError):
        pass
    if src.exists():  # the child failed (no hvtrace importable there?): compact here
        log.debug(
            "hvtrace: the compaction process failed (exit %s); compacting here", child.returncode
        )
        return compact(src, live_check=False)
    return CompactResult(src, src.with_suffix(PARQUET_SUFFIX), "compacted")


def compact(
    path: str | os.PathLike,
    row_group_rows: int = PARQUET_ROW_GROUP_ROWS,
    live_check: bool = True,
) -> CompactResult:
    """Rewrite a rank's ``.arrows`` stream as ``.parquet`` beside it, then remove the stream.

    The writer flushes small lz4 batches so that a crash loses little; once a file is closed that
    no longer matters. The Parquet file holds the same spans sorted stably by (step, start_ns),
    zstd-compressed, in row groups of at most ``row_group_rows`` rows with min/max statistics;
    its key-value metadata holds the header exactly as in the stream (``hvtrace``) and the status
    merged over all batches (``hvtrace.status``: ``dropped`` max, ``clock`` every estimate in
    order, ``last_step`` max, ``spans`` total, ``writer_cpu_s`` max, ``final`` as the last batch
    said, ``truncated`` when the stream was cut inside a batch). The stream is read batch by batch
    (memory bounded by about one row group).

    Never follows or replaces a path hvtrace did not create: the file is written to a new
    temporary file (``mkstemp``: exclusive, unpredictable name), fsynced, and published with
    ``os.link``, which fails rather than replace an existing ``.parquet``. If the ``.parquet``
    exists, it is left untouched: when it is a valid hvtrace Parquet file of the same run and
    rank with the same span count (an interrupted compaction), the stream is removed; otherwise
    both are kept. With ``live_check``, a stream that a running writer still holds (its lock) is
    kept. A source that is not a regular file is kept. Raises :class:`~hvtrace.errors.TraceError`
    when the source is not a readable hvtrace stream, OSError on I/O errors; the source is then
    unchanged.
    """
    from hvtrace.format.read import StreamScan, read_header  # imports no pandas

    src = Path(path)
    target = src.with_suffix(PARQUET_SUFFIX)
    result = CompactResult(src, target, "kept")
    if src.suffix != FILE_SUFFIX:
        result.reason = f"not an {FILE_SUFFIX} file"
        return result
    lst = os.lstat(src)
    result.bytes_before = lst.st_size
    if not stat.S_ISREG(lst.st_mode):
        result.reason = "not a regular file (a link?); left as is"
        return result
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if _identity(st) != _identity(lst) or not stat.S_ISREG(st.st_mode):
            result.reason = "replaced while being compacted"
            return result
        if live_check and not _try_lock(fd):
            result.reason = "a running rank is still writing it (locked)"
            return result
        if live_check:  # the lock is ours: no compaction of this file runs but this one
            result.stale_bytes = _remove_stale_temps(src.parent, target.name)
        header = read_header(src)
        if os.path.lexists(target):
            return _resume(src, target, header, fd, result)
        with StreamScan(src) as scan:
            raw_header = (scan.schema.metadata or {})[HEADER_KEY]
            if _identity(os.lstat(src)) != _identity(st):
                result.reason = "replaced while being compacted"
                return result
            tmp_fd, tmp_name = tempfile.mkstemp(
                dir=src.parent, prefix="." + target.name, suffix=".tmp"
            )
            tmp = Path(tmp_name)
            try:
                with os.fdopen(tmp_fd, "wb") as sink:
                    merged = _write_parquet(scan, sink, raw_header, row_group_rows, result)
                    sink.flush()
                    os.fsync(sink.fileno())
                result.final, result.truncated = bool(merged["final"]), scan.truncated
                try:
                    os.link(tmp, target)  # publish; never replaces
                except FileExistsError:
                    result.reason = f"{target.name} appeared while compacting; left both"
                    return result
            finally:
                tmp.unlink(missing_ok=True)
        _fsync_dir(src.parent)
        result.bytes_after = os.stat(target).st_size
        _unlink_if_same(src, st)
        result.action = "compacted"
        return result
    finally:
        os.close(fd)


#: Columns stored with DELTA_BINARY_PACKED: sorted by (step, start_ns), their deltas are small
#: (6-6.5 bytes per span in all with zstd, against 9.5-11.5 with dictionary/plain encoding).
_DELTA_COLUMNS = ("step", "start_ns", "end_ns")


def _write_parquet(
    scan: Any, sink: BinaryIO, raw_header: bytes, row_group_rows: int, result: CompactResult
) -> dict[str, Any]:
    """Write ``scan``'s batches to ``sink`` as sorted row groups; return the merged status."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    kwargs: dict[str, Any] = {}
    if hasattr(pq, "SortingColumn"):  # each row group is sorted by (step, start_ns)
        kwargs["sorting_columns"] = [
            pq.SortingColumn(COLUMNS.index("step")),
            pq.SortingColumn(COLUMNS.index("start_ns")),
        ]
    merged: dict[str, Any] = {
        "dropped": 0,
        "clock": [],
        "last_step": -1,
        "spans": 0,
        "writer_cpu_s": 0.0,
        "final": False,
        "truncated": False,
    }
    sort_keys = [("step", "ascending"), ("start_ns", "ascending")]
    # The stream's own columns: a version 1 stream stays a version 1 file (its header says so)
    schema = pa.schema(list(scan.schema))
    # The header is the schema's metadata: written to the footer's key-value metadata and kept in
    # the stored Arrow schema, so that pyarrow puts it back on the schema it reads.
    with pq.ParquetWriter(
        sink,
        schema.with_metadata({HEADER_KEY: raw_header}),
        compression="zstd",
        write_statistics=True,
        use_dictionary=[c for c in schema.names if c not in _DELTA_COLUMNS],
        column_encoding=dict.fromkeys(_DELTA_COLUMNS, "DELTA_BINARY_PACKED"),
        **kwargs,
    ) as out:
        pending: list[pa.RecordBatch] = []
        rows = 0

        def write(final: bool) -> None:
            nonlocal pending, rows
            table = pa.Table.from_batches(pending, schema=schema)
            table = table.unify_dictionaries().combine_chunks()
            # a stable sort: rows with equal keys keep the stream's order
            table = table.take(pc.sort_indices(table, sort_keys=sort_keys))
            while table.num_rows >= row_group_rows or (final and table.num_rows):
                out.write_table(table.slice(0, row_group_rows), row_group_size=row_group_rows)
                result.row_groups += 1
                table = table.slice(row_group_rows)
            # the rest (the latest keys) goes first into the next row group
            pending, rows = table.to_batches(), table.num_rows

        for batch, st in scan:
            if st is not None:
                _merge_status(merged, st)
            if batch.num_rows:
                pending.append(batch)
                rows += batch.num_rows
                result.spans += batch.num_rows
                if rows >= row_group_rows:
                    write(False)
        if rows:
            write(True)
        merged["spans"] = result.spans
        merged["final"] = bool(merged["final"])
        merged["truncated"] = scan.truncated
        out.add_key_value_metadata({BATCH_STATUS_KEY: json.dumps(merged)})
    return merged


def _merge_status(merged: dict[str, Any], st: dict[str, Any]) -> None:
    try:
        merged["dropped"] = max(merged["dropped"], int(st.get("dropped", 0)))
        merged["last_step"] = max(merged["last_step"], int(st.get("last_step", -1)))
        merged["writer_cpu_s"] = max(merged["writer_cpu_s"], float(st.get("writer_cpu_s", 0.0)))
        clock = st.get("clock", [])
        if isinstance(clock, list):
            merged["clock"].extend(clock)
        if "tcp" in st:
            merged["tcp"] = merge_connections(merged.get("tcp"), st["tcp"])
        if "stall" in st:
            merged["stall"] = merge_stalls(merged.get("stall"), st["stall"])
        if "live" in st:
            merged["live"] = merge_live(merged.get("live"), st["live"])
        if "membership" in st:
            merged["membership"] = merge_membership(merged.get("membership"), st["membership"])
    except (ValueError, TypeError):
        pass  # a damaged status does not make the spans unusable
    merged["final"] = bool(st.get("final", False))  # what the last batch says


def _resume(
    src: Path, target: Path, header: dict[str, Any], fd: int, result: CompactResult
) -> CompactResult:
    """The ``.parquet`` exists: remove the stream only if it is the finished compaction of it."""
    from hvtrace.errors import TraceError
    from hvtrace.format.read import StreamScan, read_rank_file

    try:
        tst = os.lstat(target)
    except FileNotFoundError:
        result.reason = f"{target.name} vanished; try again"
        return result
    if not stat.S_ISREG(tst.st_mode):
        result.reason = f"{target.name} exists and is not a regular file; left both"
        return result
    try:
        done = read_rank_file(target, read_spans=False)
    except TraceError as exc:
        result.reason = f"{target.name} exists but is not usable ({exc}); left both"
        return result
    spans = 0
    with StreamScan(src) as scan:
        for batch, _ in scan:
            spans += batch.num_rows
    result.spans, result.truncated = spans, scan.truncated
    same = (
        done.header.get("run_id") == header.get("run_id")
        and done.rank == header.get("rank")
        and done.n_spans == spans
    )
    if not same:
        result.reason = (
            f"{target.name} exists and holds other spans (run {done.header.get('run_id')}, "
            f"rank {done.rank}, {done.n_spans} spans; this stream: {spans}); left both"
        )
        return result
    result.final, result.bytes_after = done.complete, tst.st_size
    result.row_groups = len(done.row_groups())
    _unlink_if_same(src, os.fstat(fd))
    result.action = "resumed"
    return result


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _unlink_if_same(path: Path, st: os.stat_result) -> None:
    """Remove ``path`` if it still is the file ``st`` describes (never a file put there since)."""
    try:
        if _identity(os.lstat(path)) == _identity(st):
            path.unlink()
    except FileNotFoundError:
        pass


def _fsync_dir(d: Path) -> None:
    try:
        dfd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


#: The temporary file a compaction writes (``mkstemp(prefix="." + target, suffix=".tmp")``).
_TEMP_RANDOM = re.compile(r"[a-z0-9_]{8}\.tmp")


def _remove_stale_temps(directory: Path, target_name: str) -> int:
    """Remove what an interrupted compaction of ``target_name`` left (a killed ``hvtrace
    compact``: its temporary file, up to the whole Parquet file's size); return the bytes.
    Only files of exactly that name's form (``.TARGET`` + ``mkstemp``'s 8 characters +
    ``.tmp``), regular (never a link), of this user: what compaction creates. Called holding
    the source stream's lock, so no other compaction of it can be writing one."""
    prefix = "." + target_name
    freed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return 0
    for n in names:
        if not _TEMP_RANDOM.fullmatch(n[len(prefix) :]):
            continue
        p = directory / n
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                p.unlink()
                freed += st.st_size
        except OSError:
            continue
    return freed


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock a live writer holds on its stream; False when someone holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no locks on this filesystem: nothing to learn
    return True


def compact_run(
    run_dir: str | os.PathLike,
    run_id: str | None = None,
    progress: Callable[[list[Path]], Any] | None = None,
) -> list[CompactResult]:
    """Compact every ``.arrows`` file of ``run_dir`` (of run ``run_id`` only, when given).

    For runs whose ranks were killed, or whose files were never compacted: a crashed or unclosed
    stream is compacted too, and its status keeps ``final: false`` / ``truncated: true`` so the
    analysis still reports it. Returns one result per stream (a file that cannot be read is kept,
    with the reason). Raises :class:`~hvtrace.errors.TraceError` when the directory has no trace
    files, ``run_id`` has none, or no stream is readable.
    """
    from hvtrace.errors import TraceError
    from hvtrace.format.read import find_trace_files, read_header

    paths = find_trace_files(run_dir)
    streams = [p for p in paths if p.suffix == FILE_SUFFIX]
    if run_id is not None:
        runs: set[str] = set()
        keep: list[Path] = []
        for p in paths:
            try:
                rid = str(read_header(p)["run_id"])
            except TraceError:
                continue
            runs.add(rid)
            if rid == run_id and p.suffix == FILE_SUFFIX:
                keep.append(p)
        if run_id not in runs:
            raise TraceError(
                f"{run_dir}: no files of run {run_id} (runs here: {', '.join(sorted(runs))})"
            )
        streams = keep
    results: list[CompactResult] = []
    unusable: list[str] = []
    for p in progress(streams) if progress else streams:
        try:
            results.append(compact(p))
        except (TraceError, OSError) as exc:
            msg = str(exc) if isinstance(exc, TraceError) else f"{p}: {exc.strerror or exc}"
            unusable.append(msg)
            kept = CompactResult(p, p.with_suffix(PARQUET_SUFFIX), "kept")
            kept.reason = msg.removeprefix(f"{p}: ")
            with contextlib.suppress(OSError):
                kept.bytes_before = p.lstat().st_size
            results.append(kept)
    if streams and len(unusable) == len(streams):
        if len(unusable) == 1:
            raise TraceError(unusable[0])
        raise TraceError(
            f"{run_dir}: none of {len(unusable)} trace streams is usable ({unusable[0]})"
        )
    return results


def _release_unheld(timer: Any, tokens: dict[int, Any]) -> None:
    """Give CUDA events back to ``timer``'s pool, except those something else still holds."""
    while tokens:
        tok = tokens.popitem()[1]
        if sys.getrefcount(tok) <= 2:  # ``tok`` and getrefcount's argument: no one else
            timer.release(tok)


class BackgroundWriter:
    """Owns a rank's trace file and the thread that fills it from ``buffer``.

    ``timer`` resolves span tokens (ints or CUDA events); rows whose events have not completed wait
    for a later flush. ``status()`` returns the JSON status attached to every batch (dropped
    counts, new clock estimates). ``on_error`` is called once, with the exception, if writing fails.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        header: dict[str, Any],
        buffer: deque,
        timer: Any,
        status: Callable[[bool], dict[str, Any]],
        on_error: Callable[[BaseException], None],
        flush_interval_s: float = 0.5,
    ) -> None:
        self._buffer = buffer
        self._timer = timer
        self._status = status
        self._on_error = on_error
        self._interval = flush_interval_s
        self._pending: list[tuple] = []
        self._stop = threading.Event()
        self._lock = threading.RLock()  # re-entrant: close() may run in a signal handler
        self._closed = False
        self.spans_written = 0
        #: CPU time (s) this writer has spent flushing, in whichever thread flushed: its own cost.
        self.cpu_s = 0.0
        #: Rewrite the file as Parquet once it is closed cleanly (see :func:`compact`).
        self.compact_on_close = True
        self._stream_closed = False  # the end-of-stream marker is written (see close)
        #: What the compaction at close did (None until then, or when it failed).
        self.compacted: CompactResult | None = None
        self.file: TraceFile | None = TraceFile(path, header)
        self._thread = threading.Thread(target=self._run, name="hvtrace-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush(final=False)

    def flush(self, final: bool) -> None:
        """Write what the buffer holds now (all of it, waiting for CUDA events, when ``final``)."""
        with self._lock:
            if self.file is None:
                return
            t0 = time.thread_time()
            try:
                self._flush_locked(final)
            except Exception as exc:  # noqa: BLE001 - never let the writer take training down
                self._fail(exc)
            self.cpu_s += time.thread_time() - t0

    def _flush_locked(self, final: bool) -> None:
        buf = self._buffer
        entries = [buf.popleft() for _ in range(len(buf))]
        timer = self._timer
        ready, waiting = [], []
        if timer.is_cuda:  # rows, their tokens resolved (the encoder takes allreduces as they are)
            rows = rows_mod.expand(entries, self._pending)
            done = []
            for r in rows:
                if final:
                    for tok in (r[START], r[END]):
                        if not isinstance(tok, int):
                            tok.synchronize()  # off the training loop: only at close
                if timer.ready(r[START]) and timer.ready(r[END]):
                    s, e = timer.resolve(r[START]), timer.resolve(r[END])
                    done.append(r)
                    ready.append((*r[:START], s, e, *r[BYTES:]))
                else:
                    waiting.append(r)
            # A token may be shared by several rows (a step boundary, a synchronize's end) and
            # still be held by the tracer (the next step starts where this one ended): give each
            # back to the pool once, and only when nothing else holds it (its reference count:
            # the dict below, the loop variable and getrefcount's argument), else let it go.
            held = {id(t) for r in waiting for t in (r[START], r[END])}
            back = {id(t): t for r in done for t in (r[START], r[END]) if id(t) not in held}
            self._pending = waiting
            rows = done = entries = r = tok = None  # drop this frame's references to tokens
            _release_unheld(timer, back)
        else:
            ready = entries
        self._pending = waiting
        status = self._status(final)
        if not ready and not final and not status.get("changed"):
            return
        batch = self.file.encode(ready)
        status.pop("changed", None)
        status["spans"] = self.spans_written + batch.num_rows
        status["writer_cpu_s"] = round(self.cpu_s, 6)
        self.file.write_batch(batch, status)
        self.spans_written += batch.num_rows

    def _fail(self, exc: BaseException) -> None:
        file, self.file = self.file, None
        self._stop.set()
        if file is not None:
            try:
                file.close()
            except Exception:  # noqa: BLE001 - the file is already failing
                pass
        self._on_error(exc)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, write the rest with a final status and close the file. Idempotent.

        Bounded whatever the file system does: the last flush, the close and the compaction
        run on a helper thread that is waited for ``timeout_s`` at most (once the stream is
        closed, compaction gets as long again); past that, a warning says the trace is
        incomplete and the rank goes on exiting (a stalled write stays in the daemon thread)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        owned = getattr(self._lock, "_is_owned", lambda: False)()  # a signal inside a flush
        if threading.current_thread() is self._thread or owned:
            self._finish()
            return
        deadline = time.monotonic() + timeout_s  # one bound for the thread and the last flush
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        path = self.file.path if self.file is not None else None
        helper = threading.Thread(target=self._finish, name="hvtrace-close", daemon=True)
        try:
            helper.start()
        except RuntimeError:  # no new threads (interpreter shutdown, newer Pythons): inline
            self._finish()
            return
        helper.join(max(deadline - time.monotonic(), 0.0))
        if helper.is_alive() and not self._stream_closed:
            log.warning(
                "hvtrace: writing %s did not finish within %.0f s (a stalled file system?); "
                "the trace is incomplete",
                path,
                timeout_s,
            )
            return
        helper.join(timeout_s)  # compacting a large file: the stream itself is complete
        if helper.is_alive():
            log.warning(
                "hvtrace: compacting %s did not finish within %.0f s; the stream is complete "
                "(hvtrace compact can finish it)",
                path,
                2 * timeout_s,
            )

    def _finish(self) -> None:
        """The last flush, the end-of-stream marker, then compaction (see :meth:`close`)."""
        self.flush(final=True)
        with self._lock:
            if self.file is not None:
                path = self.file.path
                try:
                    self.file.close()
                except Exception as exc:  # noqa: BLE001
                    self.file = None
                    self._on_error(exc)
                    return
                self.file = None
                self._stream_closed = True
                if self.compact_on_close:
                    try:
                        self.compacted = compact_in_child(path)
                        if not self.compacted.done:
                            log.debug(
                                "hvtrace: %s not compacted (%s); kept as written",
                                path,
                                self.compacted.reason,
                            )
                    except Exception as exc:  # noqa: BLE001 - the stream stays as written
                        log.debug("hvtrace: compacting %s failed (%s); kept as written", path, exc)
