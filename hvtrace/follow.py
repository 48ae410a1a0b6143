"""Following a run while its ranks write it: each look reads only what the files gained since.

A running job's ranks append record batches to their ``.arrows`` streams (and compact them to
Parquet when they finish). :class:`StreamTail` keeps one stream open and, on each
:meth:`~StreamTail.poll`, reads the bytes appended since the last one, cuts them into whole IPC
messages (an incomplete last message waits for the next poll) and decodes only those, through
one Arrow stream reader that lives as long as the tail (so the stream's dictionary deltas carry
over). Batches already read are never read again. A message that claims more than it can
plausibly expand to is refused, as :func:`hvtrace.format.read.read_rank_file` refuses it.

:class:`RunFollower` opens the run with :func:`hvtrace.load.open_run` on those tails (a Parquet
file, written once a rank finished, is read as usual: only its footer) and analyzes it with
:func:`hvtrace.analysis.analyze`, reusing the summaries of the steps every rank has left behind,
so a refresh costs the new steps, not the run. ``hvtrace dashboard`` follows a live run with it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from hvtrace.errors import TraceError
from hvtrace.format.read import (
    RankFile,
    _apply_status,
    _parse_status,
    _problem,
    _start_clock,
    _validate_header,
    file_schema,
    find_trace_files,
    implausible,
    message_info,
    with_all_columns,
)
from hvtrace.format.schema import FILE_SCHEMA, FILE_SUFFIX
from hvtrace.load import Run, open_run, unclosed_problem

log = logging.getLogger("hvtrace")

#: Bytes read from a stream at a time (a poll reads all it gained, chunk by chunk).
POLL_BYTES: Final = 256 << 20
#: A run whose streams have not grown for this long is no longer called live (a hung or killed
#: job leaves streams that are never closed).
STALE_S: Final = 120.0

#: Largest IPC message metadata and body accepted (hvtrace's batches are far smaller): a length
#: beyond is damage or a hostile file, and is not waited for (nor buffered).
MAX_METADATA_BYTES: Final = 16 << 20
MAX_BODY_BYTES: Final = 1 << 30

_CONTINUATION: Final = b"\xff\xff\xff\xff"
_SCHEMA, _DICTIONARY, _BATCH = 1, 2, 3  # Arrow's MessageHeader union


class _Feed:
    """The file-like object the Arrow reader pulls from: only whole messages are put in it."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n >= len(self.buf):
            out = bytes(self.buf)
            self.buf.clear()
            return out
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class StreamTail:
    """One rank's ``.arrows`` stream, read incrementally (see the module doc).

    Raises :class:`TraceError` when the file cannot be opened (never through a symbolic link).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise TraceError(_problem(self.path, f"cannot read ({exc.strerror})")) from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise TraceError(_problem(self.path, "not a regular file"))
        self.identity = (st.st_dev, st.st_ino)
        self.offset = 0  # bytes of the file consumed (whole messages)
        self._pending = b""  # bytes read after ``offset``, not yet a whole message
        self._feed = _Feed()
        self._reader: Any = None
        self._messages = 0
        self.batches: list[pa.RecordBatch] = []
        self.state: RankFile | None = None  # header and status so far (never handed out)
        self.ended = False  # end of stream, or a message that cannot be read: nothing more
        self.mtime = st.st_mtime  # when the file last grew (wall clock, as the file system says)

    def close(self) -> None:
        """Release the file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()

    def replaced(self) -> bool:
        """True when ``path`` no longer names the file this tail reads (compacted, removed)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def poll(self, chunk_bytes: int = POLL_BYTES) -> int:
        """Read what the file gained since the last poll, ``chunk_bytes`` at a time (what is held
        unparsed stays under a chunk plus one message); return the new record batches.

        Raises :class:`TraceError` when the stream's first message is not an hvtrace schema.
        """
        if self.ended or self._fd < 0:
            return 0
        st = os.fstat(self._fd)
        self.mtime = st.st_mtime
        before = len(self.batches)
        while not self.ended:
            start = self.offset + len(self._pending)
            if st.st_size <= start:
                break
            data = os.pread(self._fd, min(st.st_size - start, chunk_bytes), start)
            if not data:
                break
            self._pending += data
            self._consume()
        return len(self.batches) - before

    def _consume(self) -> None:
        buf, pos = self._pending, 0
        while not self.ended and len(buf) - pos >= 8:
            if buf[pos : pos + 4] != _CONTINUATION:
                self._stop("not an Arrow IPC message where one should start")
                break
            meta_len = int.from_bytes(buf[pos + 4 : pos + 8], "little", signed=True)
            if meta_len == 0:  # end of stream
                self.ended = True
                pos += 8
                break
            if meta_len < 0 or meta_len > MAX_METADATA_BYTES:
                self._stop(f"a message claims {meta_len:,} bytes of metadata")
                break
            if len(buf) - pos < 8 + meta_len:
                break
            meta = bytes(buf[pos + 8 : pos + 8 + meta_len])
            try:
                kind, body_len = message_info(meta)
            except IndexError:
                self._stop("malformed message metadata")
                break
            end = pos + 8 + meta_len + body_len
            if not 0 <= body_len <= MAX_BODY_BYTES:
                self._stop(f"a message claims a body of {body_len:,} bytes")
                break
            if len(buf) < end:
                break
            self._message(kind, buf[pos:end], meta, buf[pos + 8 + meta_len : end])
            pos = end
        self.offset += pos
        self._pending = buf[pos:]

    def _stop(self, why: str) -> None:
        if self.state is not None:
            self.state.truncated = True
            self.state.refused = self.state.refused or why
        self.ended = True

    def _message(self, kind: int, whole: bytes, meta: bytes, body: bytes) -> None:
        if self._reader is None:
            if kind != _SCHEMA:
                raise TraceError(_problem(self.path, "not an hvtrace trace (no schema first)"))
            self._feed.buf += whole
            try:
                self._reader = pa.ipc.open_stream(self._feed)
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise TraceError(
                    _problem(self.path, f"not an hvtrace trace ({str(exc)[:200]})")
                ) from None
            header = _validate_header(self.path, self._reader.schema)
            self.state = RankFile(self.path, header, FILE_SCHEMA.empty_table())
            _start_clock(self.state)
            return
        if kind not in (_DICTIONARY, _BATCH):
            return  # nothing else belongs in a stream after the schema; skipped
        self._messages += 1
        why = implausible(pa.py_buffer(meta), pa.py_buffer(body), kind == _BATCH, self._messages)
        if why:
            self._stop(why)
            return
        self._feed.buf += whole
        if kind == _DICTIONARY:
            return  # read with the batch that follows it
        try:
            batch, meta_kv = self._reader.read_next_batch_with_custom_metadata()
            batch.validate(full=True)
        except (pa.ArrowException, OSError, ValueError, StopIteration) as exc:
            self._stop(f"a batch cannot be read ({str(exc)[:200]})")
            return
        self.batches.append(batch)
        status = _parse_status(meta_kv)
        if status is not None and self.state is not None:
            _apply_status(self.state, status)

    def rank_file(self) -> RankFile:
        """The file as read so far (a new :class:`RankFile`; the batches are shared, not copied).

        Raises :class:`TraceError` when not even the schema has arrived yet."""
        if self.state is None:
            raise TraceError(_problem(self.path, "no header written yet"))
        st = self.state
        schema = file_schema(st.header["version"])
        table = (
            with_all_columns(pa.Table.from_batches(self.batches, schema=schema))
            if self.batches
            else FILE_SCHEMA.empty_table()
        )
        lists = {f.name: list(v) for f in fields(st) if isinstance(v := getattr(st, f.name), list)}
        return replace(st, table=table, n_spans=table.num_rows, **lists)


@dataclass
class Look:
    """What one look at a followed run found."""

    run: Run
    #: New bytes read from the streams in this look.
    new_bytes: int
    #: True while some rank's stream is open and grew within :data:`STALE_S`.
    live: bool
    #: Streams not closed yet (their ranks may still be writing).
    open_streams: int = 0
    #: Seconds since an open stream last grew (its modification time; 0 when none is open).
    quiet_s: float = 0.0
    problems: list[str] = field(default_factory=list)


class RunFollower:
    """A run directory followed while its job writes it (see the module doc)."""

    def __init__(self, run_dir: str | os.PathLike, run_id: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.tails: dict[Path, StreamTail] = {}
        self._prior: tuple[Any, int] | None = None
        self._new_bytes = 0

    def close(self) -> None:
        """Release every stream."""
        for t in self.tails.values():
            t.close()
        self.tails.clear()

    def _read(self, path: Path) -> RankFile:
        tail = self.tails.get(path)
        if tail is not None and tail.replaced():
            tail.close()
            tail = None
        if tail is None:
            tail = self.tails[path] = StreamTail(path)
        before = tail.offset + len(tail._pending)
        tail.poll()
        self._new_bytes += tail.offset + len(tail._pending) - before
        return tail.rank_file()

    def look(self) -> Look:
        """Open the run as it is now, reading only what the streams gained since the last look.

        Raises :class:`TraceError` as :func:`hvtrace.load.open_run` does."""
        self._new_bytes = 0
        run = open_run(self.run_dir, run_id=self.run_id, read_stream=self._read, live=True)
        self.run_id = run.run_id  # a newer run started in the same directory is not followed
        present = set(find_trace_files(self.run_dir))
        for p in [p for p in self.tails if p not in present]:
            self.tails.pop(p).close()
        open_paths = {
            rf.path
            for rf in run.files.values()
            if rf.path.suffix == FILE_SUFFIX and not rf.complete and not rf.truncated
        }
        newest = max((t.mtime for p, t in self.tails.items() if p in open_paths), default=0.0)
        quiet = max(0.0, time.time() - newest) if open_paths else 0.0
        live = bool(open_paths) and quiet < STALE_S
        run.live = live
        for rf in run.files.values() if not live else []:
            if rf.path in open_paths:  # nobody writes it any more: what open_run would report
                rf.truncated = bool(self.tails[rf.path]._pending)  # it ends inside a message
                run.problems.append(unclosed_problem(rf))
        return Look(
            run=run,
            new_bytes=self._new_bytes,
            live=live,
            open_streams=len(open_paths),
            quiet_s=quiet,
            problems=list(run.problems),
        )

    def analyze(self, look: Look, **analyze_kw: Any) -> Any:
        """Analyze the run of ``look`` (:func:`hvtrace.analysis.analyze`), reading again only
        the steps that may have changed since the last call: those some rank may still add
        spans to."""
        from hvtrace.analysis import analyze

        run = look.run
        a = analyze(run, prior=self._prior, **analyze_kw)
        # a rank's last status names the step it was in; spans of the step before may still
        # be on their way to the file: two steps of margin
        last = [int(rf.last_step) for rf in run.files.values()]
        settled = min(last) - 2 if last and not run.missing_ranks else 0
        if a.summaries is not None:
            self._prior = (a.summaries, max(0, settled))
        return a
