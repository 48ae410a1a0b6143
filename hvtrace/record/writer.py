"""Background writer: drains a rank's span buffer into its trace file.

The hot path only appends tuples to a deque. This thread wakes every ``flush_interval_s``, turns
what is there into one Arrow record batch, appends it to the rank's ``.arrows`` stream and flushes
the file to the OS, so after a SIGKILL everything older than about one interval is on disk and the
file stays readable (a stream has no footer to lose). Any error here disables recording with one
warning; nothing is ever raised into training. A cleanly closed stream is compacted into a Parquet
file beside it (:mod:`hvtrace.format.compact`), in a child process (:func:`compact_in_child`) so
that the rank's own memory does not grow by it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from hvtrace import settings
from hvtrace.format.compact import CompactResult, compact
from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    DTYPES,
    FILE_SCHEMA,
    HEADER_KEY,
    KINDS,
    PARQUET_SUFFIX,
)
from hvtrace.record import rows as rows_mod
from hvtrace.record.cpustat import deltas_columns
from hvtrace.record.native import hot_module
from hvtrace.record.threads import NamedThread

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, compaction cannot tell a live stream
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("hvtrace")

# Row layout in the buffer (positions in the tuple): see hvtrace.record.rows.
STEP, MICRO, KIND, NAME, START, END, BYTES, DTYPE, VALUE, FLAGS = range(10)
CPU_START, CPU_END, BASE_LEN = rows_mod.CPU_START, rows_mod.CPU_END, rows_mod.BASE_LEN
_K_ALLREDUCE, UNREAD = rows_mod._K_ALLREDUCE, rows_mod.UNREAD
#: The dtypes of a batch's row columns (:meth:`BatchEncoder._row_columns`): the ten fields, then
#: ``cpu_ns``, ``runq_ns`` and whether each was measured.
_ROW_DTYPES = (np.int32, np.int16, np.int8, np.int32, np.int64, np.int64, np.int64, np.int8,
               np.float64, np.uint8, np.int64, np.int64, np.bool_, np.bool_)  # fmt: skip
#: The tensor columns of no synchronize (:meth:`BatchEncoder._tensor_columns`' form).
_NO_TENSORS = (np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64),
               np.empty(0, np.int8))  # fmt: skip


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
        and unexpanded :class:`~hvtrace.record.rows.Allreduces` (their tokens resolved), whose rows
        are the ones :func:`~hvtrace.record.rows.expand` makes, in the same places, built as
        columns (no tuple per tensor: a 152-tensor model's step costs the writer about 3x less,
        bench/writer_cost.py). In one pass of C where the compiled hot path is built and on and
        every synchronize's tensors are the last one's (:meth:`_compiled_columns`), else in
        Python: the same columns and names."""
        n_names = len(self._names)
        parts = self._compiled_columns(entries)
        if parts is None:
            parts = self._python_columns(entries)
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

    def _compiled_columns(self, entries: list) -> list[np.ndarray] | None:
        """The batch's fourteen columns (as :meth:`_python_columns`) in one pass of C
        (``hvtrace.record._hot.entries_into``); None where that is not built or off, where a
        synchronize's tensors are not those whose columns this holds (the Python form then makes
        the batch and holds the new ones), or where an entry is not one it reads."""
        hot = hot_module()
        size = getattr(hot, "entries_len", None)
        if size is None or type(entries) is not list:
            return None
        counts, names, nbytes, dtypes = self._ar_cols or _NO_TENSORS
        n = size(entries, self._ar_meta, len(names))
        if n < 0:
            return None
        cols = [np.empty(n, t) for t in _ROW_DTYPES]
        if not hot.entries_into(
            entries, self._name_ids, self._names, counts, names, nbytes, dtypes, _K_ALLREDUCE,
            *cols,
        ):  # fmt: skip
            return None
        return cols

    def _python_columns(self, entries: list) -> list[np.ndarray]:
        """The batch's fourteen columns (the ten fields, ``cpu_ns``, ``runq_ns`` and whether each
        was measured) in Python, with the compiled parts :meth:`_row_columns` and
        :func:`_call_times` choose."""
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
        return parts

    def _row_columns(self, rows: list[tuple]) -> list[np.ndarray]:
        """The columns of rows (tuples): the ten of a row's fields, then ``cpu_ns``,
        ``runq_ns`` and whether each was measured (from the readings at start and end). In one
        pass of C (``hvtrace.record._hot.rows_into``) where the compiled hot path is built and
        on, else (or for rows it does not take) :meth:`_row_columns_py`: the same columns and
        names."""
        into = getattr(hot_module(), "rows_into", None)
        if into is not None and type(rows) is list:
            n = len(rows)
            cols = [np.empty(n, t) for t in _ROW_DTYPES]  # every cell written, counters too
            if into(rows, self._name_ids, self._names, *cols):
                return cols
        return self._row_columns_py(rows)

    def _row_columns_py(self, rows: list[tuple]) -> list[np.ndarray]:
        """:meth:`_row_columns`'s Python form."""
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
        start, stop = _call_times(syncs)
        if len(start) != total:  # grouped allreduces: several tensors per call
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


def _call_times(syncs: list[rows_mod.Allreduces]) -> tuple[np.ndarray, np.ndarray]:
    """The start and end tokens (int64) of every enqueued call of ``syncs``, one synchronize
    after another: each call ends at its handle's first observed completion, else at the
    synchronize's end (:func:`~hvtrace.record.rows.call_ends`). In one pass of C
    (``hvtrace.record._hot.syncs_into``) where the compiled hot path is built and on, else (or
    for entries it does not take) :func:`_call_times_py`: the same columns."""
    into = getattr(hot_module(), "syncs_into", None)
    if into is not None and type(syncs) is list:
        n_calls = sum(len(e.enqueued) for e in syncs)
        start, stop = np.empty(n_calls, np.int64), np.empty(n_calls, np.int64)
        if into(syncs, start, stop):
            return start, stop
    return _call_times_py(syncs)


def _call_times_py(syncs: list[rows_mod.Allreduces]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_call_times`'s Python form."""
    n_calls = sum(len(e.enqueued) for e in syncs)
    call_ends = rows_mod.call_ends
    start = np.fromiter((s for e in syncs for s, _, _ in e.enqueued), np.int64, n_calls)
    stop = np.fromiter((t for e in syncs for t in call_ends(e)), np.int64, n_calls)
    return start, stop


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


def _release_unheld(timer: Any, tokens: dict[int, Any]) -> None:
    """Give CUDA events back to ``timer``'s pool, except those something else still holds."""
    while tokens:
        tok = tokens.popitem()[1]
        if sys.getrefcount(tok) <= 2:  # ``tok`` and getrefcount's argument: no one else
            timer.release(tok)


def resolve_tokens(timer: Any, entries: list, final: bool) -> tuple[list, list, dict[int, Any]]:
    """Resolve the CUDA-event tokens of buffer ``entries`` (rows and
    :class:`~hvtrace.record.rows.Allreduces`) with ``timer``.

    Returns ``(ready, waiting, back)``: the entries whose every token has completed, with ns ints
    in their place (an ``Allreduces`` stays one entry, for the encoder's columns); the entries
    still waiting for an event (tried again at the next flush); and the resolved events by id,
    to give back to the pool. Each event is queried and resolved once, however many spans share
    it (a synchronize's end is every one of its tensors' end). ``final`` waits for every event
    (only at close, off the training loop)."""
    known: dict[int, Any] = {}  # id(event) -> its ns, or None while it has not completed
    events: dict[int, Any] = {}

    def ns(tok: Any) -> Any:
        if type(tok) is int:
            return tok
        k = id(tok)
        try:
            return known[k]
        except KeyError:
            pass
        if final:
            tok.synchronize()
        t = timer.resolve(tok) if timer.ready(tok) else None
        known[k], events[k] = t, tok
        return t

    ready: list = []
    waiting: list = []
    for e in entries:
        if type(e) is tuple:
            s, t = ns(e[START]), ns(e[END])
            if s is None or t is None:
                waiting.append(e)
            else:
                ready.append((*e[:START], s, t, *e[BYTES:]))
            continue
        # the end first: recorded after the starts, it has not completed when they have not
        end = ns(e.end)
        starts = [ns(c[0]) for c in e.enqueued] if end is not None else None
        done = None
        if starts is not None and None not in starts:
            done = [(h, ns(t)) for h, t in e.done]  # host-clock ints (wait returns)
        if done is None or any(t is None for _, t in done):
            waiting.append(e)
        else:
            enq = [(s, key, h) for s, (_, key, h) in zip(starts, e.enqueued)]
            ready.append(e._replace(enqueued=enq, done=done, end=end))
    held = {id(t) for e in waiting for t in _tokens(e)}
    back = {k: tok for k, tok in events.items() if known[k] is not None and k not in held}
    return ready, waiting, back


def _tokens(entry: Any) -> list:
    """The timer tokens an unresolved buffer entry holds."""
    if type(entry) is tuple:
        return [entry[START], entry[END]]
    return [c[0] for c in entry.enqueued] + [t for _, t in entry.done] + [entry.end]


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
        flush_interval_s: float = settings.FLUSH_S.default,
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
        self._thread = NamedThread(target=self._run, name="hvtrace-writer", daemon=True)
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
        if timer.is_cuda:  # the entries, their tokens resolved (allreduces kept unexpanded)
            timer.keep_tied()  # the device and host clocks re-tied about once a second
            entries = self._pending + entries
            ready, waiting, back = resolve_tokens(timer, entries, final)
            self._pending = waiting  # before the release: the old list held the tokens too
            entries = None  # drop this frame's references to the tokens
            # a token may still be held by the tracer (the next step starts where this one
            # ended): given back only when nothing else holds it (its reference count)
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
        helper = NamedThread(target=self._finish, name="hvtrace-close", daemon=True)
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
