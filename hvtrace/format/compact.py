"""Compaction: a closed rank stream (``.arrows``) rewritten as the Parquet file of the same spans.

A rank's stream is appended batch by batch while it records; once closed it is compacted into a
Parquet file beside it (rows sorted by step and start, row groups with min/max statistics, the
header and the merged batch status in the footer; ``docs/format.md``) and the stream removed, in
steps that a crash at any point leaves readable and that a later run finishes
(:func:`compact_run`, ``hvtrace compact``): the Parquet file is written to a temporary name,
synced and renamed into place before the stream is unlinked, and a stream some process still
writes (it holds a lock on it) is left alone.

Part of the format (:mod:`hvtrace.format`): a rank compacts its own file when it closes it
(:func:`hvtrace.record.writer.compact_in_child`), and the CLI compacts a run's leftovers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    COLUMNS,
    FILE_SUFFIX,
    HEADER_KEY,
    PARQUET_ROW_GROUP_ROWS,
    PARQUET_SUFFIX,
)
from hvtrace.format.status import merge_connections, merge_live, merge_membership, merge_stalls

try:
    import fcntl
except ImportError:  # not on POSIX: no lock, compaction cannot tell a live stream
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("hvtrace")


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
                os.fchmod(tmp_fd, stat.S_IMODE(st.st_mode))  # the stream's (mkstemp makes 0600)
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
