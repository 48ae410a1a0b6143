"""A run: its rank files found, read and put on rank 0's clock, as one span table.

Reading one file (either form: the live Arrow IPC stream, or the compacted Parquet file, see
``docs/format.md``) is the format's (:mod:`hvtrace.format.read`); this module makes a run of the
files. ``open_run(run_dir)`` returns a :class:`Run` with per-rank metadata (headers, status,
clocks) without building the span table; ``load_run(run_dir)`` also reads every span into one
pandas DataFrame (``Run.spans``, with a ``rank`` column, times on rank 0's clock), which
``open_run``'s Run builds on first access. Bad input raises :class:`TraceError` with a one-line
message naming the file and what is wrong; damaged but partly readable files are kept, and what
was lost is listed in ``Run.problems``. ``read_rank_file``, ``read_header``,
``find_trace_files``, ``RankFile`` and ``StreamScan`` are re-exported from the format's reader.

Imports pandas only when a span table is built.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.clock import ClockEstimate, drift_ppm, step_offsets
from hvtrace.format.read import (  # re-exported: see the module doc
    _COMPLETE_SQL,
    RankFile,
    StreamScan,
    _is_parquet,
    _open_parquet_file,
    _problem,
    _read_row_groups,
    find_trace_files,
    rank_from_name,
    read_header,
    read_rank_file,
    summarize_problems,
)
from hvtrace.format.schema import (
    COLUMNS,
    FILE_SCHEMA,
    FILE_SUFFIX,
    FORMAT_VERSION,
    PARQUET_SUFFIX,
)
from hvtrace.selection import StepRange, format_ranks

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger("hvtrace.load")


from hvtrace.errors import TraceError  # noqa: E402  (re-exported; a rank imports it without pandas)


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


def span_sources(
    run: Run, steps: StepRange | None = None, ranks: Iterable[int] | None = None
) -> list[RankSource]:
    """Return the sources a query engine reads a run's spans from (by rank; ``ranks``: those
    only, None: every rank).

    A compacted file is read by DuckDB from its path (``n_spans``: the rows of the row groups
    ``steps`` needs, which sizes the groups); a stream (live or crashed rank) from the table
    :mod:`hvtrace.load` read.
    """
    out = []
    want = None if ranks is None else {int(r) for r in ranks}
    for r, rf in sorted(run.files.items()):
        if want is not None and int(r) not in want:
            continue
        lie = rf.check_step_statistics(steps)  # before any reader skips by them
        if lie:
            log.warning("%s", lie)
            run.problems.append(lie)
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


def span_relation(
    con: Any, sources: Sequence[RankSource], new_name: Callable[[], str]
) -> tuple[str, dict[str, Any], list[str]]:
    """Return ``(sql, params, registered)``: one DuckDB relation of ``sources`` with a ``rank``
    column and the columns ``step, kind, name, start_ns, end_ns, bytes, dtype, micro, value,
    flags, cpu_ns, runq_ns`` (the last two NULL for a version 1 file, or a table without them;
    an in-memory table without ``micro`` / ``value`` / ``flags`` reads 0 / NULL / 0).

    Parquet files are read by one ``read_parquet`` per format version (their paths are
    parameters, never spliced into SQL; the rank is looked up by file index); in-memory tables
    are registered on ``con`` under names from ``new_name()``, listed in ``registered`` for the
    caller to unregister.
    """
    parts: list[str] = []
    params: dict[str, Any] = {}
    registered: list[str] = []
    base = "step, kind, name, start_ns, end_ns, bytes, dtype"
    v2 = f"{base}, micro, value, flags, cpu_ns, runq_ns"
    v1 = f"{base}, micro, value, flags, NULL::BIGINT AS cpu_ns, NULL::BIGINT AS runq_ns"
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
                ("micro", "0::SMALLINT"),
                ("value", "NULL::DOUBLE"),
                ("flags", "0::UTINYINT"),
                ("cpu_ns", "NULL::BIGINT"),
                ("runq_ns", "NULL::BIGINT"),
            )
        ]
        parts.append(f"SELECT {rank}, {base}, {', '.join(extra)} FROM {raw}")
    return " UNION ALL ".join(parts), params, registered


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
        if rf.footer_problem:
            problems.append(_problem(p, rf.footer_problem))
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
    clock: list[ClockEstimate],
    step: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    kind: pa.Array | pa.ChunkedArray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One rank's span times moved onto rank 0's clock with its estimates ``clock`` by the one
    rule (:func:`hvtrace.clock.step_offsets`: one offset per step, at its first span that is
    not a scalar or clock row, by ``kind``). Every reader of spans uses it (the span frame, the
    Perfetto export; the engine through the same rule)."""
    work = None
    if kind is not None:
        work = pc.invert(pc.is_in(pc.cast(kind, pa.string()), pa.array(["scalar", "clock"])))
        work = work.to_numpy(zero_copy_only=False)
    step = np.asarray(step)
    off, _ = step_offsets({0: clock}, np.zeros(len(step), np.int64), step, start_ns, work)
    return np.asarray(start_ns, np.int64) - off, np.asarray(end_ns, np.int64) - off


def _span_frame(files: list[RankFile], problems: list[str] | None = None) -> pd.DataFrame:
    """Concatenate rank tables, align times to rank 0's clock and return a DataFrame."""
    tables = []
    for rf in files:
        t = _file_table(rf, problems)
        start, end = align_times(
            rf.clock,
            t.column("step").to_numpy(),
            t.column("start_ns").to_numpy(),
            t.column("end_ns").to_numpy(),
            t.column("kind"),
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


__all__ = [
    "RankFile",
    "RankSource",
    "Run",
    "StreamScan",
    "TraceError",
    "align_times",
    "find_trace_files",
    "load_run",
    "open_run",
    "read_header",
    "read_rank_file",
    "span_relation",
    "span_sources",
]
