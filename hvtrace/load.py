"""Find, validate and read a run's rank files into one span table on rank 0's clock.

``load_run(run_dir)`` returns a :class:`Run`: per-rank metadata and one pandas DataFrame of spans
with a ``rank`` column. Bad input raises :class:`TraceError` with a one-line message naming the
file and what is wrong; damaged but partly readable files are kept, and what was lost is listed in
``Run.problems``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from hvtrace.clock import ClockEstimate, offset_at
from hvtrace.schema import (
    BATCH_STATUS_KEY,
    FILE_SCHEMA,
    FILE_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_KEY,
    REQUIRED_HEADER_FIELDS,
)

log = logging.getLogger("hvtrace.load")


class TraceError(Exception):
    """A run or trace file that cannot be used; ``str()`` is a one-line message for the user."""


@dataclass
class RankFile:
    """One rank's file as read: header, spans (local clock), and what its batches reported."""

    path: Path
    header: dict[str, Any]
    table: pa.Table
    complete: bool = False  # the writer closed it cleanly (final batch seen)
    truncated: bool = False  # the stream ended inside a batch (crash, or damage)
    dropped: int = 0  # spans the recorder dropped because the writer fell behind
    last_step: int = -1  # the rank's step counter at its last flush
    writer_cpu_s: float = 0.0  # CPU time hvtrace's writer spent on this file (as last reported)
    clock: list[ClockEstimate] = field(default_factory=list)  # the estimates used to align
    #: Barrier-round estimates as recorded (kept as a check when ``same_clock`` made them moot).
    clock_measured: list[ClockEstimate] = field(default_factory=list)
    #: True when this rank ran on rank 0's kernel (same boot id): one clock, offset exactly 0.
    same_clock: bool = False

    @property
    def rank(self) -> int:
        """The rank, as recorded inside the file."""
        return int(self.header["rank"])

    @property
    def spans(self) -> int:
        """Number of spans read."""
        return self.table.num_rows


@dataclass
class Run:
    """A loaded run: ``spans`` (DataFrame, times in ns on rank 0's clock) and per-rank metadata."""

    run_dir: Path
    run_id: str
    size: int
    files: dict[int, RankFile]
    spans: pd.DataFrame
    problems: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        """Ranks that have a file, sorted."""
        return sorted(self.files)

    @property
    def missing_ranks(self) -> list[int]:
        """Ranks of ``0..size-1`` with no usable file."""
        return [r for r in range(self.size) if r not in self.files]

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
                f"{len(same)} rank(s) share rank 0's kernel clock (same boot id): offset 0 exactly "
                f"(barrier estimate within {check / 1e3:.0f} µs of it)"
            )
        if others:
            n_est = sum(len(self.files[r].clock) for r in others)
            worst = max(self.clock_uncertainty_ns(r) for r in others)
            parts.append(
                f"{len(others)} rank(s) aligned by barrier rounds ({n_est} estimates, worst "
                f"uncertainty ±{worst / 1e3:.0f} µs, drift interpolated)"
            )
        if not parts:
            return "clocks: single rank, no alignment needed"
        return "clocks aligned to rank 0: " + "; ".join(parts)


def _problem(path: Path, msg: str) -> str:
    return f"{path}: {msg}"


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """Return the validated header of one trace file; raise :class:`TraceError` if unusable."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TraceError(_problem(path, f"cannot read ({exc.strerror})")) from None
    if size == 0:
        raise TraceError(_problem(path, "empty file (the rank wrote nothing)"))
    try:
        with pa.memory_map(str(path)) as src:
            schema = pa.ipc.open_stream(src).schema
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as exc:
        raise TraceError(
            _problem(path, f"not an hvtrace trace (no readable Arrow stream header: {_short(exc)})")
        ) from None
    return _validate_header(path, schema)


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__


def _validate_header(path: Path, schema: pa.Schema) -> dict[str, Any]:
    meta = schema.metadata or {}
    raw = meta.get(HEADER_KEY)
    if raw is None:
        raise TraceError(_problem(path, "no hvtrace header in the file's schema metadata"))
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
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
    if header["version"] != FORMAT_VERSION:
        raise TraceError(
            _problem(
                path,
                f"format version {header['version']!r} is not supported "
                f"(this hvtrace reads version {FORMAT_VERSION})",
            )
        )
    for k in ("rank", "size"):
        if not isinstance(header[k], int) or header[k] < 0:
            raise TraceError(_problem(path, f"header {k} is {header[k]!r}, not an integer >= 0"))
    if header["size"] < 1 or header["rank"] >= header["size"]:
        raise TraceError(
            _problem(path, f"header rank {header['rank']} is outside size {header['size']}")
        )
    if not schema.equals(FILE_SCHEMA, check_metadata=False):
        raise TraceError(_problem(path, "span columns do not match the hvtrace format"))
    return header


def read_rank_file(path: str | os.PathLike) -> RankFile:
    """Read one trace file: header, every complete batch, and the batches' status.

    A stream that ends inside a batch (a crash or a cut) keeps every batch before the cut and is
    marked ``truncated``. Raises :class:`TraceError` if not even the header is readable.
    """
    path = Path(path)
    header = read_header(path)
    batches: list[pa.RecordBatch] = []
    rf = RankFile(path, header, FILE_SCHEMA.empty_table())
    start = header.get("clock", {}).get("start")
    if isinstance(start, dict):
        try:
            rf.clock.append(ClockEstimate.from_dict(start))
        except (KeyError, ValueError, TypeError):
            raise TraceError(_problem(path, "header clock estimate is malformed")) from None
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_stream(src)
        messages = reader.stats.num_messages
        while True:
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                # The writer emits a batch's new names as a delta dictionary message just before
                # the record batch: a stream ending after that message was cut inside a batch.
                if reader.stats.num_messages > messages:
                    rf.truncated = True
                break
            except (pa.ArrowException, OSError, ValueError):
                # after the final batch only the end-of-stream marker can be cut: nothing lost
                rf.truncated = not rf.complete
                break
            try:
                batch.validate(full=True)
            except (pa.ArrowException, ValueError):
                rf.truncated = True
                break
            batches.append(batch)
            _apply_status(rf, meta)
            messages = reader.stats.num_messages
    if batches:
        rf.table = pa.Table.from_batches(batches, schema=FILE_SCHEMA)
    return rf


def _apply_status(rf: RankFile, meta: Any) -> None:
    if meta is None:
        return
    raw = meta.get(BATCH_STATUS_KEY)
    if raw is None:
        return
    try:
        st = json.loads(raw)
        rf.dropped = max(rf.dropped, int(st.get("dropped", 0)))
        rf.last_step = max(rf.last_step, int(st.get("last_step", -1)))
        rf.complete = rf.complete or bool(st.get("final"))
        rf.writer_cpu_s = max(rf.writer_cpu_s, float(st.get("writer_cpu_s", 0.0)))
        rf.clock.extend(ClockEstimate.from_dict(c) for c in st.get("clock", []))
    except (ValueError, TypeError, KeyError, AttributeError):
        pass  # a damaged status does not make the spans unusable


def find_trace_files(run_dir: str | os.PathLike) -> list[Path]:
    """Return the ``*.arrows`` files in ``run_dir`` (sorted); raise TraceError if there are none."""
    d = Path(run_dir)
    if not d.exists():
        raise TraceError(f"{d}: no such directory")
    if not d.is_dir():
        if d.suffix == FILE_SUFFIX:
            return [d]
        raise TraceError(f"{d}: not a directory of hvtrace traces")
    files = sorted(p for p in d.iterdir() if p.suffix == FILE_SUFFIX and p.is_file())
    if not files:
        raise TraceError(f"{d}: no hvtrace trace files (*{FILE_SUFFIX}) in this directory")
    return files


def load_run(
    run_dir: str | os.PathLike,
    run_id: str | None = None,
    progress: Callable[[Iterable[Path]], Iterable[Path]] | None = None,
) -> Run:
    """Load a run directory into a :class:`Run` (spans on rank 0's clock, ns).

    Several runs in one directory: the newest is loaded (or ``run_id``), and the others' files are
    listed in ``Run.problems``. A rank file that cannot be read at all is reported there and the
    other ranks are still loaded. Raises :class:`TraceError` when no usable rank file remains.
    ``progress`` wraps the file iteration (for a progress bar).
    """
    paths = find_trace_files(run_dir)
    problems: list[str] = []
    headers: dict[Path, dict[str, Any]] = {}
    for p in paths:
        try:
            headers[p] = read_header(p)
        except TraceError as exc:
            problems.append(str(exc))
    if not headers:
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
    chosen = runs[run_id]
    sizes = {headers[p]["size"] for p in chosen}
    size = max(sizes)
    if len(sizes) > 1:
        problems.append(f"{run_dir}: files of run {run_id} disagree on size {sorted(sizes)}")
    files: dict[int, RankFile] = {}
    iterable = progress(chosen) if progress else chosen
    for p in iterable:
        try:
            rf = read_rank_file(p)
        except TraceError as exc:
            problems.append(str(exc))
            continue
        if rf.truncated:
            problems.append(
                _problem(
                    p,
                    f"truncated after {rf.spans} spans; the rest was lost "
                    "(rank crashed or file damaged)",
                )
            )
        elif not rf.complete:
            problems.append(
                _problem(
                    p,
                    f"not closed cleanly (rank {rf.rank} stopped at step "
                    f"{rf.last_step}); {rf.spans} spans kept",
                )
            )
        if rf.dropped:
            problems.append(
                _problem(p, f"the recorder dropped {rf.dropped} spans (the writer fell behind)")
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
    missing = [r for r in range(size) if r not in files]
    if missing:
        problems.append(
            f"{run_dir}: run {run_id} has {size} ranks but no usable file for rank(s) "
            f"{', '.join(map(str, missing))}; analyzing the others"
        )
    _choose_clocks(files)
    spans = _span_frame([files[r] for r in sorted(files)])
    for msg in problems:
        log.warning("%s", msg)
    return Run(Path(run_dir), run_id, size, files, spans, problems)


def _choose_clocks(files: dict[int, RankFile]) -> None:
    """Use offset 0 exactly for ranks on rank 0's kernel; barrier estimates for the others.

    Processes under one kernel (same ``boot_id``) read the same CLOCK_MONOTONIC, so their true
    offset is zero; the barrier estimates are kept in ``clock_measured`` as a check.
    """
    ref = files.get(0)
    ref_boot = ref.header.get("boot_id") if ref is not None else None
    for rf in files.values():
        rf.clock_measured = list(rf.clock)
        if ref_boot and rf.header.get("boot_id") == ref_boot:
            at = rf.clock[0].at_ns if rf.clock else 0
            rf.clock = [ClockEstimate(at, 0, 0, 0)]
            rf.same_clock = True


def _span_frame(files: list[RankFile]) -> pd.DataFrame:
    """Concatenate rank tables, align times to rank 0's clock and return a DataFrame."""
    tables = []
    for rf in files:
        t = rf.table
        start = t.column("start_ns").to_numpy()
        end = t.column("end_ns").to_numpy()
        off_s = offset_at(rf.clock, start)
        off_e = offset_at(rf.clock, end) if len(rf.clock) > 1 else off_s
        t = t.set_column(t.schema.get_field_index("start_ns"), "start_ns", pa.array(start - off_s))
        t = t.set_column(t.schema.get_field_index("end_ns"), "end_ns", pa.array(end - off_e))
        t = t.add_column(0, "rank", pa.array(np.full(t.num_rows, rf.rank, np.int32)))
        tables.append(t)
    table = pa.concat_tables(tables).unify_dictionaries()
    df = table.to_pandas()
    for col in ("kind", "name", "dtype"):
        df[col] = df[col].astype("category")
    return df
