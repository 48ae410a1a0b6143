"""Background writer: drains a rank's span buffer into its trace file.

The hot path only appends tuples to a deque. This thread wakes every ``flush_interval_s``, turns
what is there into one Arrow record batch, appends it to the rank's ``.arrows`` stream and flushes
the file to the OS, so after a SIGKILL everything older than about one interval is on disk and the
file stays readable (a stream has no footer to lose). Any error here disables recording with one
warning; nothing is ever raised into training.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from hvtrace.schema import BATCH_STATUS_KEY, DTYPES, FILE_SCHEMA, HEADER_KEY, KINDS

log = logging.getLogger("hvtrace")

# Row layout in the buffer (positions in the tuple).
STEP, MICRO, KIND, NAME, START, END, BYTES, DTYPE, VALUE, FLAGS = range(10)

_KIND_DICT = pa.array(KINDS, pa.string())
_DTYPE_DICT = pa.array(DTYPES, pa.string())


def write_options(codecs: tuple[str, ...] = ("zstd", "lz4")) -> pa.ipc.IpcWriteOptions:
    """Return the IPC options of trace files: compressed buffers, delta name dictionaries.

    The first available of ``codecs`` compresses each buffer. While recording, the writer uses lz4
    (half the CPU of zstd on a flush of a few dozen spans); compaction at close rewrites the file
    with zstd (smaller). ``use_threads=False``: a flush compresses a few kB, which Arrow's CPU
    thread pool (one thread per core, in every rank) would only make costlier on a node whose
    cores train.
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

    def encode(self, rows: list[tuple]) -> pa.RecordBatch:
        """Return one record batch holding ``rows`` (tuples of resolved ints, see module layout)."""
        ids = self._name_ids
        name_idx = []
        for r in rows:
            n = r[NAME]
            i = ids.get(n)
            if i is None:
                i = ids[n] = len(self._names)
                self._names.append(n)
            name_idx.append(i)
        cols = list(zip(*rows)) if rows else [()] * 10
        arrays = [
            pa.array(cols[STEP], pa.int32()),
            pa.array(cols[MICRO], pa.int16()),
            pa.DictionaryArray.from_arrays(pa.array(cols[KIND], pa.int8()), _KIND_DICT),
            pa.DictionaryArray.from_arrays(
                pa.array(name_idx, pa.int32()), pa.array(self._names, pa.string())
            ),
            pa.array(cols[START], pa.int64()),
            pa.array(cols[END], pa.int64()),
            pa.array(cols[BYTES], pa.int64()),
            pa.DictionaryArray.from_arrays(pa.array(cols[DTYPE], pa.int8()), _DTYPE_DICT),
            pa.array(cols[VALUE], pa.float64()),
            pa.array(cols[FLAGS], pa.uint8()),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=FILE_SCHEMA)


class TraceFile:
    """An open trace file: header at open, then batches with a JSON status each. Not thread-safe."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._sink: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        schema = FILE_SCHEMA.with_metadata({HEADER_KEY: json.dumps(header).encode()})
        self._writer = pa.ipc.new_stream(self._sink, schema, options=write_options(LIVE_CODECS))
        self._encoder = BatchEncoder()
        # Arrow writes the schema (our header) only with the first batch: write an empty one now,
        # so that a rank that dies before its first flush still leaves a readable file.
        self.append([], {"dropped": 0, "clock": [], "last_step": 0, "final": False, "spans": 0})

    def append(self, rows: list[tuple], status: dict[str, Any]) -> None:
        """Append one batch of resolved rows with its status, and flush it to the OS."""
        batch = self._encoder.encode(rows)
        self._writer.write_batch(batch, custom_metadata={BATCH_STATUS_KEY: json.dumps(status)})
        self._sink.flush()

    def close(self) -> None:
        """Write the end-of-stream marker and close the file."""
        try:
            self._writer.close()
        finally:
            self._sink.close()


#: Rows per record batch when a cleanly closed file is compacted.
COMPACT_ROWS = 65536


def compact(path: str | os.PathLike, rows_per_batch: int = COMPACT_ROWS) -> int:
    """Rewrite a trace file with its batches merged into batches of ``rows_per_batch`` rows.

    The writer flushes small batches so that a crash loses little; once a file is closed cleanly
    that no longer matters, and reading costs about 150 µs per batch (one decompression per
    column buffer) and ~1 kB of framing. Streams batch by batch (bounded memory), keeps the header
    and merges the batches' status (clock estimates, dropped count, final flag), writes a new file
    beside the old one and replaces it atomically. Returns the number of batches written.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".compact")
    written = 0
    try:
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_stream(src)
            with (
                open(tmp, "wb") as sink,
                pa.ipc.new_stream(sink, reader.schema, options=write_options()) as out,
            ):
                group: list[pa.RecordBatch] = []
                rows = 0
                merged: dict[str, Any] = {"dropped": 0, "clock": [], "last_step": 0}
                total = 0
                while True:
                    try:
                        batch, meta = reader.read_next_batch_with_custom_metadata()
                    except StopIteration:
                        break
                    st = json.loads(meta[BATCH_STATUS_KEY]) if meta else {}
                    merged["dropped"] = max(merged["dropped"], int(st.get("dropped", 0)))
                    merged["clock"].extend(st.get("clock", []))
                    merged["last_step"] = max(merged["last_step"], int(st.get("last_step", 0)))
                    merged["final"] = bool(st.get("final", False))
                    cpu = float(st.get("writer_cpu_s", 0.0))
                    merged["writer_cpu_s"] = max(merged.get("writer_cpu_s", 0.0), cpu)
                    if batch.num_rows:
                        group.append(batch)
                        rows += batch.num_rows
                    if rows >= rows_per_batch:
                        total += rows
                        _write_group(out, group, {**merged, "final": False, "spans": total})
                        written += 1
                        merged["clock"], group, rows = [], [], 0
                total += rows
                _write_group(out, group, {**merged, "spans": total}, reader.schema)
                written += 1
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return written


def _write_group(
    out: Any, group: list[pa.RecordBatch], status: dict[str, Any], schema: Any = None
) -> None:
    if group:
        table = pa.Table.from_batches(group).unify_dictionaries().combine_chunks()
        batch = table.to_batches()[0]
    else:
        batch = pa.RecordBatch.from_pylist([], schema=schema)
    out.write_batch(batch, custom_metadata={BATCH_STATUS_KEY: json.dumps(status)})


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
        #: Rewrite the file in large batches once it is closed cleanly (see :func:`compact`).
        self.compact_on_close = True
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
        rows = self._pending
        for _ in range(len(buf)):
            rows.append(buf.popleft())
        timer = self._timer
        ready, waiting = [], []
        if timer.is_cuda:
            for r in rows:
                if final:
                    for tok in (r[START], r[END]):
                        if not isinstance(tok, int):
                            tok.synchronize()  # off the training loop: only at close
                if timer.ready(r[START]) and timer.ready(r[END]):
                    s, e = timer.resolve(r[START]), timer.resolve(r[END])
                    timer.release(r[START])
                    if r[END] is not r[START]:
                        timer.release(r[END])
                    ready.append((*r[:START], s, e, *r[BYTES:]))
                else:
                    waiting.append(r)
        else:
            ready = rows
        self._pending = waiting
        status = self._status(final)
        if not ready and not final and not status.get("changed"):
            return
        status.pop("changed", None)
        status["spans"] = self.spans_written + len(ready)
        status["writer_cpu_s"] = round(self.cpu_s, 6)
        self.file.append(ready, status)
        self.spans_written += len(ready)

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
        """Stop the thread, write the rest with a final status and close the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
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
                if self.compact_on_close:
                    try:
                        compact(path)
                    except Exception as exc:  # noqa: BLE001 - the small-batch file stays
                        log.debug("hvtrace: compacting %s failed (%s); kept as written", path, exc)
