"""The analysis engine: a per-rank pass on DuckDB, then a small cross-rank pass.

A run of any size is analyzed without ever holding its spans in one frame:

1. **Per-rank pass** (:func:`rank_pass`): for a group of rank files, DuckDB reads only the row
   groups and columns asked for (a Parquet file's row groups are skipped by their step
   statistics) and reduces the spans to summaries about 100x smaller:

   - per (rank, step): :func:`hvtrace.analysis.steps.step_rows` (phases, allreduce union and
     overlap, arrival), computed on the group's numeric columns;
   - per (rank, step, user span name): time and count;
   - per (step, tensor), over the group's ranks: partial collective aggregates (earliest and
     latest enqueue, earliest completion, bytes, count), which combine across groups.

   Times are moved onto rank 0's clock here by the one rule every reader uses
   (:func:`hvtrace.clock.step_offsets`): per (rank, step), the offset interpolated at the step's
   first span of work (drift within one step is parts per million of it). Each group is independent:
   the local engine runs groups one after the other in one process; a cluster engine can run
   them as tasks.
2. **Cross-rank pass** (:func:`cross_rank`): joins the summaries: step completeness, arrival
   lateness, collective times and bandwidth. Stragglers, findings and the rest of
   :class:`hvtrace.analysis.model.Analysis` are computed from these tables by the same functions
   whatever made them.

DuckDB runs with a memory limit (default a quarter of the machine's memory) and spills to a
private directory under the system temp dir, never inside the run directory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.analysis.bandwidth import finish_collectives
from hvtrace.analysis.outside import merge_partials
from hvtrace.analysis.steps import INTERNAL_PREFIX, finish_steps, step_rows
from hvtrace.clock import step_offsets
from hvtrace.format.schema import COLLECTIVE_KEY, FILE_SCHEMA, FLAG_OWN, KINDS
from hvtrace.load import RankSource, span_relation
from hvtrace.selection import StepRange

#: Most spans in one group (ranks are grouped up to this; a rank with more is split by steps).
GROUP_SPANS = 4_000_000
#: Fewest spans a group is cut to, whatever the memory limit.
MIN_GROUP_SPANS = 100_000
#: Memory per span of a group while hvtrace's numpy stage reduces it (its fetched columns, sorted
#: copies and per-step work), and of the next group being fetched beside it: about 230 and 100
#: bytes, measured by ``bench/analyze_bench.py --memory-limits``. A group gets
#: ``memory limit / GROUP_BYTES_PER_SPAN`` spans, so the two in memory at once stay within about
#: two thirds of the limit, beside DuckDB's own (within the limit).
GROUP_BYTES_PER_SPAN = 512

#: The collective key (:data:`~hvtrace.format.schema.COLLECTIVE_KEY`) in SQL, plain and of the
#: span table ``s``.
_KEY = ", ".join(COLLECTIVE_KEY)
_KEY_S = ", ".join(f"s.{c}" for c in COLLECTIVE_KEY)
#: Kind code as in :data:`hvtrace.format.schema.KINDS`; -1 for hvtrace's own spans and unknown
#: kinds.
KIND_CODE_SQL = (
    "CASE kind "
    + " ".join(
        f"WHEN 'user' THEN (CASE WHEN starts_with(name, '{INTERNAL_PREFIX}') THEN -1 ELSE {i} END)"
        if k == "user"
        else f"WHEN 'collective' THEN (CASE WHEN (flags & {FLAG_OWN}) <> 0 THEN -1 ELSE {i} END)"
        if k == "collective"
        else f"WHEN '{k}' THEN {i}"
        for i, k in enumerate(KINDS)
    )
    + " ELSE -1 END::SMALLINT"
)


def default_memory_limit_bytes() -> int:
    """A quarter of the machine's physical memory (at least 256 MiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 << 30
    return max(total // 4, 256 << 20)


def group_spans(memory_limit_bytes: int | None = None) -> int:
    """Spans per group for a memory limit (default: :func:`default_memory_limit_bytes`): the
    limit / :data:`GROUP_BYTES_PER_SPAN`, from :data:`MIN_GROUP_SPANS` to :data:`GROUP_SPANS`."""
    limit = int(memory_limit_bytes or default_memory_limit_bytes())
    return int(min(GROUP_SPANS, max(MIN_GROUP_SPANS, limit // GROUP_BYTES_PER_SPAN)))


@dataclass(frozen=True)
class StepWindow:
    """Steps ``lo .. hi-1`` of one rank's spans (None: unbounded), read as one group when the
    rank alone holds more spans than a group may (:meth:`Engine.step_windows`). Within the
    selected steps; every step is in one window whole, so each (rank, step) is reduced once."""

    lo: int | None
    hi: int | None

    def sql(self, column: str = "step") -> str:
        """A SQL predicate selecting these steps from ``column``."""
        parts = [f"{column} >= {int(self.lo)}"] if self.lo is not None else []
        parts += [f"{column} < {int(self.hi)}"] if self.hi is not None else []
        return " AND ".join(parts) or "TRUE"


def parse_size(text: str) -> int:
    """Parse a memory size: ``2GB``, ``512MiB``, ``1.5G``, or a number of bytes."""
    t = text.strip().upper().replace(" ", "")
    units = {
        "TIB": 1 << 40, "GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10,
        "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3,
        "T": 1 << 40, "G": 1 << 30, "M": 1 << 20, "K": 1 << 10, "B": 1,
    }  # fmt: skip
    unit = next((u for u in units if t.endswith(u)), "")
    num, mult = (t[: -len(unit)], units[unit]) if unit else (t, 1)
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a memory size (e.g. 2GB, 512MiB)") from None
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a positive memory size")
    return int(value * mult)


@dataclass
class GroupSummary:
    """What :func:`rank_pass` returns for one group of ranks (all small)."""

    steps: pd.DataFrame  # step_rows, on rank 0's clock
    users: pd.DataFrame  # rank, step, name, dur_ns, count
    collectives: pd.DataFrame | None  # partial per (step, name) (None: kept in the engine)
    spans_read: int = 0
    row_groups_read: int = 0
    row_groups_total: int = 0
    worker: str = ""  # the Dask worker that made it ("" for the local engine)
    #: partial per (step, name, occurrence) of the collectives outside the optimizer (None: none)
    outside: pd.DataFrame | None = None
    #: per rank, the implausible spans :func:`plausible` left out or corrected
    implausible: dict[int, dict[str, int]] = field(default_factory=dict)


class Engine:
    """A DuckDB connection set up for the analysis: memory limit, spill directory, threads.

    Use as a context manager; the spill directory (under the system temp dir) is removed on exit.
    """

    def __init__(self, memory_limit_bytes: int | None = None, threads: int | None = None) -> None:
        import duckdb

        self.memory_limit_bytes = int(memory_limit_bytes or default_memory_limit_bytes())
        self.spill_dir = tempfile.mkdtemp(prefix="hvtrace-duckdb-")
        try:
            self.con = duckdb.connect(":memory:")
            self.con.execute(f"SET memory_limit = '{self.memory_limit_bytes // (1 << 20)}MiB'")
            self.con.execute("SET temp_directory = ?", [self.spill_dir])
            self.con.execute("SET preserve_insertion_order = true")
            self.con.execute("SET parquet_metadata_cache = true")
            if threads:
                self.con.execute(f"SET threads = {int(threads)}")
        except BaseException:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            raise
        self._names = _Names()
        self._acc_rows = 0  # rows in the collectives accumulator (see _accumulate)
        self._acc_merged = 0  # its size after the last merge

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and remove the spill directory."""
        try:
            self.con.close()
        finally:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    def rank_pass(self, sources: Sequence[RankSource], steps: StepRange | None) -> GroupSummary:
        """Run the per-rank pass over ``sources`` (one group); see the module docstring.

        The three stages (:meth:`fetch`, :func:`reduce_steps`, :meth:`group_tables`) run one
        after the other; :func:`summarize` overlaps them across groups.
        """
        cols = self.fetch(sources, steps)
        rows, offsets, n_read = reduce_steps(cols, sources)
        del cols
        return self.group_tables(sources, steps, rows, offsets, n_read)

    def step_windows(
        self, source: RankSource, steps: StepRange | None, max_spans: int
    ) -> list[StepWindow]:
        """Cut one rank's spans of ``steps`` into windows of whole steps of at most about
        ``max_spans`` spans of work each ([] when it fits in one). The counts come from one
        scan of the ``step`` and ``kind`` columns. A window read by the engine may skip Parquet
        row groups by their footer's step statistics: each window's count is checked against
        the scan's, and a rank whose statistics disagree is not cut ([]: read whole, as
        before; so is one the engine cannot count, as one whose statistics DuckDB's grouping
        trips on: reading it whole gives the usual error and the careful reader)."""
        import duckdb

        src, params, registered = span_relation(self.con, [source], self._names)
        work = "kind NOT IN ('scalar', 'clock')"
        where = steps.sql("step") if steps is not None else "TRUE"
        try:
            got = self.con.execute(
                f"SELECT step, count(*) AS n FROM ({src}) WHERE {where} AND {work} "
                "GROUP BY step ORDER BY step",
                params,
            ).fetchnumpy()
            step = np.asarray(got["step"], np.int64)
            n = np.asarray(got["n"], np.int64)
            if int(n.sum()) <= max_spans:
                return []
            cut = np.flatnonzero(np.diff((np.cumsum(n) - n) // max(1, max_spans))) + 1
            if not len(cut):
                return []
            edges = [
                steps.first if steps is not None else None,
                *step[cut].tolist(),
                steps.stop if steps is not None else None,
            ]
            windows = [StepWindow(a, b) for a, b in itertools.pairwise(edges)]
            want = np.add.reduceat(n, np.concatenate([[0], cut]))
            for w, k in zip(windows, want.tolist()):
                ((c,),) = self.con.execute(
                    f"SELECT count(*) FROM ({src}) WHERE {w.sql('step')} AND {work}", params
                ).fetchall()
                if int(c) != k:
                    return []
        except duckdb.Error:
            return []
        finally:
            self._unregister(registered)
        return windows

    def fetch(self, sources: Sequence[RankSource], steps: StepRange | None) -> dict[str, Any]:
        """Stage 1 (DuckDB): the group's spans of ``steps`` that are a step's work, as numpy
        columns ``rank``, ``step``, ``k`` (kind code), ``start_ns``, ``end_ns``, ``bytes``,
        ``cpu_ns``, ``runq_ns`` (float, NaN where not measured)."""
        src, params, registered = span_relation(self.con, sources, self._names)
        try:
            where = steps.sql("step") if steps is not None else "TRUE"
            table = self.con.sql(
                f"SELECT rank, step, {KIND_CODE_SQL} AS k, start_ns, end_ns, bytes, "
                "cpu_ns::DOUBLE AS cpu_ns, runq_ns::DOUBLE AS runq_ns, "
                "CASE WHEN kind = 'collective' THEN value END AS blocked_ns "
                f"FROM ({src}) WHERE {where} AND kind NOT IN ('scalar', 'clock')",
                params=params,
            ).to_arrow_table()
        finally:
            self._unregister(registered)
        return {c: table.column(c).to_numpy() for c in table.column_names}

    def group_tables(
        self,
        sources: Sequence[RankSource],
        steps: StepRange | None,
        rows: pd.DataFrame,
        offsets: pd.DataFrame,
        n_read: int,
        accumulate: bool = False,
    ) -> GroupSummary:
        """Stage 3 (DuckDB): partial collectives (times moved by ``offsets``) and user time.

        A second scan of the group's files, of the columns these need (cheaper than keeping
        the first scan's rows: the scans decode compressed columns faster than a table of them
        is built). With ``accumulate`` the partial collectives stay in the engine, merged with
        the other groups' (:meth:`collectives` returns them); else they are in the result."""
        con = self.con
        src, params, registered = span_relation(self.con, sources, self._names)
        where = steps.sql("s.step") if steps is not None else "TRUE"
        table = f"({src})"
        try:
            constant = _constant_offsets(offsets)
            if constant is not None:  # one offset per rank: join on rank alone
                off = pd.DataFrame(
                    {"rank": list(constant), "off_ns": list(constant.values())},
                    columns=["rank", "off_ns"],
                ).astype(np.int64)
                on = "s.rank = o.rank"
            else:  # clock drift: the offset of each (rank, step)
                off, on = offsets, "s.rank = o.rank AND s.step = o.step"
            con.register("hv_offsets", off)
            registered.append("hv_offsets")
            # a step recorded twice (plausible() found duplicates): count each rank once
            dupes = any("duplicates" in c for c in rows.attrs.get("implausible", {}).values())
            n_spans = "count(DISTINCT s.rank)" if dupes else "count(*)"
            partial = f"""SELECT {_KEY_S}, {n_spans} AS n_spans,
                       max(CASE WHEN s.bytes BETWEEN 0 AND {BYTES_LIMIT} THEN s.bytes ELSE 0 END)
                       AS bytes,
                       any_value(s.dtype) AS dtype,
                       min(s.start_ns - coalesce(o.off_ns, 0)) AS first_start_ns,
                       max(s.start_ns - coalesce(o.off_ns, 0)) AS last_start_ns,
                       min(s.end_ns - coalesce(o.off_ns, 0)) AS end_ns
                FROM {table} s LEFT JOIN hv_offsets o ON {on}
                WHERE s.kind = 'allreduce' AND s.end_ns >= s.start_ns AND {where}
                GROUP BY {_KEY_S}"""
            if accumulate:
                self._accumulate(partial, params)
                coll = None
            else:
                coll = con.execute(partial, params).df()
            user_sql = f"""SELECT rank, step, name,
                    sum(greatest(end_ns - start_ns, 0))::BIGINT AS dur_ns, count(*) AS count,
                    CASE WHEN count(cpu_ns) = count(*) THEN sum(cpu_ns) END::DOUBLE AS cpu_ns,
                    CASE WHEN count(runq_ns) = count(*) THEN sum(runq_ns) END::DOUBLE AS runq_ns
                FROM {table} s WHERE kind = 'user' AND end_ns >= start_ns
                AND NOT starts_with(name, '{INTERNAL_PREFIX}') AND {where}
                GROUP BY rank, step, name ORDER BY rank, step, name"""
            if rows.attrs.get("has_users", True):
                users = con.execute(user_sql, params).df()
            else:
                users = pd.DataFrame(
                    {
                        "rank": pd.Series(dtype=np.int64),
                        "step": pd.Series(dtype=np.int64),
                        "name": pd.Series(dtype=object),
                        "dur_ns": pd.Series(dtype=np.int64),
                        "count": pd.Series(dtype=np.int64),
                        "cpu_ns": pd.Series(dtype=np.float64),
                        "runq_ns": pd.Series(dtype=np.float64),
                    }
                )
            outside = None
            if rows.attrs.get("has_collectives", True):
                outside = con.execute(
                    OUTSIDE_PARTIAL_SQL.format(table=table, on=on, where=where), params
                ).df()
        finally:
            self._unregister(registered)
        rg_read = sum(s.row_groups_read for s in sources)
        rg_total = sum(s.row_groups_total for s in sources)
        return GroupSummary(
            rows,
            users,
            coll,
            n_read,
            rg_read,
            rg_total,
            outside=outside,
            implausible=dict(rows.attrs.get("implausible", {})),
        )

    #: The collectives accumulator is merged once it holds more rows than this (and twice its
    #: size after the last merge).
    MERGE_ROWS = 1_000_000
    #: Columns of the partial collectives, in order.
    _COLL = f"{_KEY}, n_spans, bytes, dtype, first_start_ns, last_start_ns, end_ns"
    _MERGE = f"""SELECT {_KEY}, sum(n_spans)::BIGINT AS n_spans, max(bytes) AS bytes,
        any_value(dtype) AS dtype, min(first_start_ns) AS first_start_ns,
        max(last_start_ns) AS last_start_ns, min(end_ns) AS end_ns"""

    def _accumulate(self, partial: str, params: dict[str, Any]) -> None:
        """Add a group's partial collectives to the engine's table, merging rows of the same
        (step, tensor) whenever it has grown past twice its merged size (bounded memory)."""
        con = self.con
        if not self._acc_rows and not self._acc_merged:
            self._run(f"CREATE OR REPLACE TEMP TABLE hv_coll AS {partial}", params)
        else:
            self._run(f"INSERT INTO hv_coll {partial}", params)
        self._acc_rows = int(con.execute("SELECT count(*) FROM hv_coll").fetchall()[0][0])
        if self._acc_rows > max(2 * self._acc_merged, self.MERGE_ROWS):
            self._run(
                f"CREATE OR REPLACE TEMP TABLE hv_coll AS {self._MERGE} FROM hv_coll "
                f"GROUP BY {_KEY}"
            )
            self._acc_rows = self._acc_merged = int(
                con.execute("SELECT count(*) FROM hv_coll").fetchall()[0][0]
            )

    def add_collectives(self, partials: pd.DataFrame | None) -> None:
        """Add partial collectives made elsewhere (a Dask task's) to the accumulator."""
        if partials is None or partials.empty:
            return
        self.con.register("hv_partials", partials[self._COLL.split(", ")])
        typed = (
            "SELECT step::INTEGER AS step, name::VARCHAR AS name, n_spans::BIGINT AS n_spans, "
            "bytes::BIGINT AS bytes, dtype::VARCHAR AS dtype, "
            "first_start_ns::BIGINT AS first_start_ns, last_start_ns::BIGINT AS last_start_ns, "
            "end_ns::BIGINT AS end_ns FROM hv_partials"
        )
        try:
            self._accumulate(typed, {})
        finally:
            self.con.unregister("hv_partials")

    def collectives(self) -> pd.DataFrame:
        """The accumulated partial collectives, one row per (step, tensor) (empty if none)."""
        if not self._acc_rows:
            return pd.DataFrame(columns=self._COLL.split(", "))
        # streamed in batches into Arrow, then converted column by column, each Arrow column let
        # go once converted: the table is held about once, not as DuckDB's whole result beside
        # its pandas copy (one row per step and tensor: millions on a long run)
        reader = self.con.sql(
            f"{self._MERGE} FROM hv_coll GROUP BY {_KEY} ORDER BY {_KEY}"
        ).to_arrow_reader(1 << 16)
        table = reader.read_all()
        del reader
        out = table.to_pandas(split_blocks=True, self_destruct=True)
        del table
        out.attrs["grouped"] = True  # one row per key, sorted: finish_collectives need not group
        self._run("DROP TABLE IF EXISTS hv_coll")
        self._acc_rows = self._acc_merged = 0
        return out

    def _run(self, sql: str, params: Any = None) -> None:
        """Execute a statement and consume its result (DuckDB 2 wants every result finished)."""
        self.con.execute(sql, params).fetchall()

    def _unregister(self, names: Iterable[str]) -> None:
        for name in names:
            self.con.unregister(name)


#: Stage 3's partial of the collectives issued outside the optimizer: one row per (step, name,
#: occurrence: the k-th call of that name in that step on each rank, which is how Horovod pairs
#: them across ranks), times on rank 0's clock. Partials of several groups combine with
#: :func:`hvtrace.analysis.outside.merge_partials`. hvtrace's own collectives are left out.
OUTSIDE_PARTIAL_SQL = f"""WITH c AS (
    SELECT s.rank, s.step, s.name, s.bytes,
        s.start_ns - coalesce(o.off_ns, 0) AS st, s.end_ns - coalesce(o.off_ns, 0) AS en,
        least(greatest(coalesce(s.value, s.end_ns - s.start_ns), 0), s.end_ns - s.start_ns)
            AS blocked,
        row_number() OVER (PARTITION BY s.rank, s.step, s.name ORDER BY s.start_ns) AS occ
    FROM {{table}} s LEFT JOIN hv_offsets o ON {{on}}
    WHERE s.kind = 'collective' AND (s.flags & {FLAG_OWN}) = 0 AND {{where}})
SELECT step::BIGINT AS step, name::VARCHAR AS name, occ::BIGINT AS occ,
    count(*)::BIGINT AS n_spans, max(bytes)::BIGINT AS bytes,
    min(st)::BIGINT AS first_start_ns, max(st)::BIGINT AS last_start_ns,
    arg_max(rank, st)::BIGINT AS last_rank, sum(st::DOUBLE) AS sum_start_ns,
    sum(greatest(en - st, 0)::DOUBLE) AS sum_flight_ns, sum(blocked::DOUBLE) AS sum_blocked_ns
FROM c GROUP BY step, name, occ"""


def on_own_engine(fn: Callable[[Any], Any], empty: Callable[[str], Any]) -> Any:
    """``fn(con)`` on a new one-thread :class:`Engine`'s connection; a DuckDB error (a damaged
    file: the rest of the analysis still stands) gives ``empty(error)``, ``error`` the first
    line of its message."""
    import duckdb

    try:
        with Engine(threads=1) as eng:
            return fn(eng.con)
    except duckdb.Error as exc:
        return empty((str(exc).strip().splitlines() or [type(exc).__name__])[0][:300])


@contextlib.contextmanager
def span_query(
    con: Any, sources: Sequence[RankSource], steps: StepRange | None
) -> Iterator[tuple[str, str, list[Any]]]:
    """``(src, where, params)``: the span relation of ``sources`` registered on ``con``, the
    SQL condition selecting ``steps`` on its ``step`` column (all: ``TRUE``), and the query's
    parameters; what was registered is unregistered on exit."""
    src, params, registered = span_relation(con, sources, _Names())
    try:
        yield src, steps.sql("step") if steps is not None else "TRUE", params
    finally:
        for name in registered:
            con.unregister(name)


class _Names:
    """Unique names for the tables an engine registers (``hv_table_1``, ...)."""

    def __init__(self) -> None:
        self._n = 0

    def __call__(self) -> str:
        self._n += 1
        return f"hv_table_{self._n}"


def reduce_steps(
    cols: dict[str, Any], sources: Sequence[RankSource]
) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """Stage 2 (numpy): :func:`~hvtrace.analysis.steps.step_rows` of the fetched columns, moved
    onto rank 0's clock. Returns ``(rows, offsets, spans_read)``; implausible spans are left
    out or corrected first (:func:`plausible`), their counts in ``rows.attrs["implausible"]``."""
    n_read = len(cols["k"])
    cols, implausible = plausible(cols)
    rows = step_rows(
        np.asarray(cols["rank"]),
        np.asarray(cols["step"]),
        np.asarray(cols["k"]),
        np.asarray(cols["start_ns"]),
        np.asarray(cols["end_ns"]),
        np.asarray(cols["bytes"]),
        _nan_floats(cols.get("cpu_ns")),
        _nan_floats(cols.get("runq_ns")),
        _nan_floats(cols.get("blocked_ns")),
    )
    offsets = _align(rows, cols, sources)
    # whether the group has user spans and collectives at all (else stage 3 skips their query)
    rows.attrs["has_users"] = bool((np.asarray(cols["k"]) == KINDS.index("user")).any())
    rows.attrs["has_collectives"] = bool((np.asarray(cols["k"]) == KINDS.index("collective")).any())
    rows.attrs["implausible"] = implausible
    return rows, offsets, n_read


#: No tensor is this big (1 PiB): a byte count past it (or below 0) is damage, counted unknown.
BYTES_LIMIT = 1 << 50
#: What :func:`plausible` counts, with the words a problem line uses.
IMPLAUSIBLE = {
    "end_before_start": "spans end before they start: left out of the figures",
    "duplicates": "duplicate spans (a step recorded twice: more than one step span): counted once",
    "bytes": "spans carry an impossible byte count (< 0 or > 1 PiB): counted as unknown (0)",
}


def plausible(cols: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, int]]]:
    """Fetched span columns without what a recorder cannot have written: spans that end before
    they start (left out), exact duplicates in a (rank, step) with more than one step span (a
    step written twice: one copy kept), byte counts below 0 or past :data:`BYTES_LIMIT` (0, as
    unknown). Returns the columns and, per rank, how many of each (:data:`IMPLAUSIBLE`; empty
    when none: the usual case costs two comparisons and one count per span)."""
    rank = np.asarray(cols["rank"])
    start = np.asarray(cols["start_ns"])
    end = np.asarray(cols["end_ns"])
    nbytes = np.asarray(cols["bytes"])
    k = np.asarray(cols["k"])
    counts: dict[int, dict[str, int]] = {}

    def count(what: str, where: np.ndarray) -> None:
        for r, n in zip(*np.unique(rank[where], return_counts=True), strict=True):
            counts.setdefault(int(r), {})[what] = int(n)

    drop = end < start
    if drop.any():
        count("end_before_start", drop)
    is_step = np.flatnonzero((k == KINDS.index("step")) & ~drop)
    if len(is_step):
        step = np.asarray(cols["step"])
        cell = rank[is_step].astype(np.int64) * (1 << 32) + step[is_step].astype(np.int64)
        uniq, n = np.unique(cell, return_counts=True)
        if (n > 1).any():
            twice = uniq[n > 1]
            all_cells = rank.astype(np.int64) * (1 << 32) + step.astype(np.int64)
            idx = np.flatnonzero(np.isin(all_cells, twice) & ~drop)
            key = np.column_stack([all_cells[idx], k[idx], start[idx], end[idx], nbytes[idx]])
            _, first = np.unique(key, axis=0, return_index=True)
            dup = np.ones(len(idx), bool)
            dup[first] = False
            if dup.any():
                extra = np.zeros(len(rank), bool)
                extra[idx[dup]] = True
                count("duplicates", extra)
                drop = drop | extra
    bad_bytes = ((nbytes < 0) | (nbytes > BYTES_LIMIT)) & ~drop
    if bad_bytes.any():
        count("bytes", bad_bytes)
        cols = dict(cols, bytes=np.where(bad_bytes, 0, nbytes))
    if drop.any():
        keep = ~drop
        cols = {c: (np.asarray(v)[keep] if v is not None else None) for c, v in cols.items()}
    return cols, counts


def _nan_floats(col: Any) -> np.ndarray | None:
    """A fetched column as float64 with NaN for NULL (None when absent)."""
    if col is None:
        return None
    return np.asarray(col, dtype=np.float64)


def clocks_of(sources: Sequence[RankSource]) -> dict[int, list[Any]]:
    """Each source rank's clock estimates (ranks without any left out)."""
    return {int(s.rank): s.clock for s in sources if s.rank is not None and s.clock}


def span_offsets(
    sources: Sequence[RankSource], rank: Any, step: Any, start_ns: Any, kind_code: Any = None
) -> tuple[np.ndarray, pd.DataFrame]:
    """:func:`hvtrace.clock.step_offsets` (the one alignment rule) of spans read from
    ``sources``: the offset of each span and the (rank, step, off_ns) table. ``kind_code``
    (codes of ``KINDS``) keeps scalars and clock rows from anchoring a step; None: every span
    given is a step's work."""
    work = None
    if kind_code is not None:
        k = np.asarray(kind_code)
        work = (k != KINDS.index("scalar")) & (k != KINDS.index("clock"))
    per_span, cells = step_offsets(clocks_of(sources), rank, step, start_ns, work)
    return per_span, pd.DataFrame(cells, columns=["rank", "step", "off_ns"])


def _align(rows: pd.DataFrame, cols: dict[str, Any], sources: Sequence[RankSource]) -> pd.DataFrame:
    """Move ``rows``' times onto rank 0's clock in place by the offsets of their spans ``cols``
    (:func:`span_offsets`); return the (rank, step, off_ns) used. Where every rank's offset is
    one constant (one estimate, or estimates that agree: the rule then gives that constant
    whatever the anchor), it is looked up by rank, without grouping the spans."""
    clocks = clocks_of(sources)
    constant = {r: {e.offset_ns for e in est} for r, est in clocks.items()}
    rk = rows["rank"].to_numpy(np.int64)
    if all(len(v) == 1 for v in constant.values()):
        by_rank = {r: next(iter(v)) for r, v in constant.items() if r >= 0}
        off = np.zeros(len(rk), np.int64)
        if any(by_rank.values()):
            lut = np.zeros(max(by_rank) + 1, np.int64)
            for r, o in by_rank.items():
                lut[r] = o
            known = (rk >= 0) & (rk < len(lut))
            off = np.where(known, lut[np.clip(rk, 0, len(lut) - 1)], 0)
        offsets = pd.DataFrame({"rank": rk, "step": rows["step"].to_numpy(np.int64), "off_ns": off})
    else:
        _, offsets = span_offsets(sources, cols["rank"], cols["step"], cols["start_ns"])
        off = (
            rows[["rank", "step"]]
            .astype(np.int64)
            .merge(offsets, on=["rank", "step"], how="left")["off_ns"]
            .fillna(0)
            .to_numpy(np.int64)
        )
    if off.any():
        rows["start_ns"] = rows["start_ns"].to_numpy(dtype=np.int64) - off
        rows["end_ns"] = rows["end_ns"].to_numpy(dtype=np.int64) - off
        rows["arrival_ns"] = rows["arrival_ns"] - off
        rows["coll_arrival_ns"] = rows["coll_arrival_ns"] - off
    return offsets


def _constant_offsets(offsets: pd.DataFrame) -> dict[int, int] | None:
    """Return rank -> offset when each rank's offset is the same in all its steps, else None."""
    if offsets.empty:
        return {}
    g = offsets.groupby("rank")["off_ns"]
    lo, hi = g.min(), g.max()
    if (lo != hi).any():
        return None
    return {int(r): int(v) for r, v in lo.items()}


def groups(
    sources: Sequence[RankSource], max_spans: int = GROUP_SPANS
) -> Iterator[list[RankSource]]:
    """Split ``sources`` into consecutive groups of at most ``max_spans`` spans (at least one)."""
    group: list[RankSource] = []
    n = 0
    for s in sources:
        if group and n + s.n_spans > max_spans:
            yield group
            group, n = [], 0
        group.append(s)
        n += s.n_spans
    if group:
        yield group


@dataclass
class Summaries:
    """The cross-rank tables every metric is computed from (see :func:`cross_rank`)."""

    steps: pd.DataFrame  # hvtrace.analysis.steps.finish_steps
    users: pd.DataFrame  # user_table's columns
    collectives: pd.DataFrame  # collective_table's columns
    spans_read: int = 0
    row_groups_read: int = 0
    row_groups_total: int = 0
    #: Which engine made them: ``{"name": "duckdb"}``, or for Dask also ``scheduler``,
    #: ``tasks`` and ``tasks_by_worker`` (worker address -> tasks it ran).
    engine: dict[str, Any] = field(default_factory=lambda: {"name": "duckdb"})
    #: Collectives outside the optimizer, per (step, name, occurrence), every rank's partials
    #: combined (:func:`hvtrace.analysis.outside.merge_partials`).
    outside: pd.DataFrame = field(default_factory=lambda: merge_partials([]))
    #: Per rank, the implausible spans left out or corrected (:func:`plausible`).
    implausible: dict[int, dict[str, int]] = field(default_factory=dict)

    def before(self, stop: int) -> Summaries:
        """The summaries of steps ``< stop`` only (every table is per step)."""
        return Summaries(
            self.steps[self.steps["step"] < stop].reset_index(drop=True),
            self.users[self.users["step"] < stop].reset_index(drop=True),
            self.collectives[self.collectives["step"] < stop].reset_index(drop=True),
            engine=dict(self.engine),
            outside=self.outside[self.outside["step"] < stop].reset_index(drop=True),
            implausible=_merge_counts([self.implausible]),
        )

    def then(self, later: Summaries) -> Summaries:
        """These summaries followed by ``later``'s (of later steps: no step in both)."""

        def cat(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
            if a.empty:
                return b
            return a if b.empty else pd.concat([a, b], ignore_index=True)

        return Summaries(
            cat(self.steps, later.steps),
            cat(self.users, later.users),
            cat(self.collectives, later.collectives),
            later.spans_read,
            later.row_groups_read,
            later.row_groups_total,
            engine=dict(later.engine),
            outside=cat(self.outside, later.outside),
            # a later pass reads again steps the earlier one had counted: at least the larger
            implausible=_max_counts(self.implausible, later.implausible),
        )


def _max_counts(
    a: dict[int, dict[str, int]], b: dict[int, dict[str, int]]
) -> dict[int, dict[str, int]]:
    """Per-rank counts, the larger of ``a``'s and ``b``'s."""
    out = _merge_counts([a])
    for r, c in b.items():
        mine = out.setdefault(int(r), {})
        for what, n in c.items():
            mine[what] = max(mine.get(what, 0), int(n))
    return out


def _merge_counts(parts: Iterable[dict[int, dict[str, int]]]) -> dict[int, dict[str, int]]:
    """Per-rank counts of several groups (or runs of steps), summed."""
    out: dict[int, dict[str, int]] = {}
    for part in parts:
        for r, c in part.items():
            mine = out.setdefault(int(r), {})
            for what, n in c.items():
                mine[what] = mine.get(what, 0) + int(n)
    return out


def cross_rank(
    parts: Sequence[GroupSummary],
    n_ranks: int | None = None,
    collectives: pd.DataFrame | None = None,
) -> Summaries:
    """Join the groups' summaries: complete steps, lateness, collectives (see module doc).

    ``collectives``: partial collectives merged elsewhere (the engine's accumulator), combined
    with those the parts carry."""
    steps = finish_steps(pd.concat([p.steps for p in parts], ignore_index=True), n_ranks)
    users = pd.concat([p.users for p in parts], ignore_index=True)
    users = users.astype(
        {"rank": np.int64, "step": np.int64, "dur_ns": np.int64, "count": np.int64}
    )
    partials = [p.collectives for p in parts if p.collectives is not None]
    if collectives is not None:
        partials.append(collectives)
    if len(partials) == 1 and partials[0].attrs.get("grouped"):  # the engine's, merged
        coll = finish_collectives(partials[0], grouped=True)
    else:
        coll = finish_collectives(pd.concat(partials, ignore_index=True))
    return Summaries(
        steps,
        users,
        coll,
        sum(p.spans_read for p in parts),
        sum(p.row_groups_read for p in parts),
        sum(p.row_groups_total for p in parts),
        outside=merge_partials([p.outside for p in parts]),
        implausible=_merge_counts(p.implausible for p in parts),
    )


def frame_summaries(spans: pd.DataFrame, steps: StepRange | None = None) -> Summaries:
    """Run the engine over a span frame: :func:`hvtrace.load_run`'s ``Run.spans`` or a hand-made
    table (a ``rank`` column; times on one clock). The same passes as for files."""
    n = len(spans)
    cols: dict[str, Any] = {c: spans[c] for c in ("rank", "step", "kind", "start_ns", "end_ns")}
    cols["name"] = spans["name"] if "name" in spans.columns else spans["kind"].astype(str)
    cols["bytes"] = spans["bytes"] if "bytes" in spans.columns else np.zeros(n, np.int64)
    cols["dtype"] = spans["dtype"] if "dtype" in spans.columns else np.full(n, "", object)
    for c in ("cpu_ns", "runq_ns", "value"):  # absent: read as NULL (a version 1 file's spans)
        if c in spans.columns:
            cols[c] = spans[c].astype("float64")
    if "flags" in spans.columns:
        cols["flags"] = spans["flags"].fillna(0).astype(np.uint8)
    frame = pd.DataFrame(cols).astype({"rank": np.int32, "step": np.int32})
    frame = frame.astype({"start_ns": np.int64, "end_ns": np.int64, "bytes": np.int64})
    import pyarrow as pa

    table = pa.Table.from_pandas(frame, preserve_index=False)
    return summarize([RankSource(None, n, table=table)], steps)


def user_table(spans: pd.DataFrame) -> pd.DataFrame:
    """Return user-span time per (rank, step, name): ``dur_ns`` (sum) and ``count``.

    hvtrace's own spans (``hvtrace.*``) are left out. Spans of one name that nest or overlap are
    summed, not merged. Computed by the engine's per-rank pass
    (:func:`frame_summaries`), as for a run's files.
    """
    return frame_summaries(spans).users


def collective_table(spans: pd.DataFrame) -> pd.DataFrame:
    """Return one row per allreduce collective (step, tensor name), over all ranks that did it.

    ``spans``: a span frame (see :func:`frame_summaries`, which runs the
    engine's passes; a run's files give the same table through :func:`hvtrace.analysis.analyze`).
    Columns: ``step``, ``name``, ``n_ranks`` (allreduce spans of that tensor in that step: one
    per rank), ``bytes`` (the largest of the ranks' byte counts), ``dtype``, ``first_start_ns`` /
    ``last_start_ns`` (earliest / latest enqueue over ranks), ``end_ns`` (earliest observed
    completion over ranks), ``time_ns`` = ``end_ns - last_start_ns`` (NaN when not positive,
    which only clock error can cause), ``spread_ns`` = ``last_start_ns - first_start_ns`` (how
    long the first rank waited for the last one), ``algbw_gbps`` = bytes / time_ns.
    """
    return frame_summaries(spans).collectives


def kind_counts(sources: Sequence[RankSource]) -> pd.DataFrame:
    """Spans per (rank, kind) in ``sources``, counted by DuckDB (only the ``kind`` column of a
    Parquet file is decoded). Columns ``rank``, ``kind``, ``spans``."""
    with Engine(threads=1) as eng:
        src, params, registered = span_relation(eng.con, sources, eng._names)
        try:
            return eng.con.execute(
                f"SELECT rank, kind, count(*) AS spans FROM ({src}) GROUP BY rank, kind "
                "ORDER BY rank, kind",
                params,
            ).df()
        finally:
            eng._unregister(registered)


def window_spans(sources: Sequence[RankSource], steps: StepRange, con: Any = None) -> pd.DataFrame:
    """The spans of ``steps`` in ``sources`` (a window of a run, for a timeline), on rank 0's
    clock by the one alignment rule the analysis uses (:func:`span_offsets`). Columns ``rank,
    step, kind, name, start_ns, end_ns, bytes, dtype``, sorted by (rank, step, start_ns); a
    Parquet file's row groups outside ``steps`` are not read. ``con``: a DuckDB connection (or
    cursor) used by this call alone; default: a new :class:`Engine`."""
    if con is None:
        with Engine(threads=1) as eng:
            return window_spans(sources, steps, eng.con)
    src, params, registered = span_relation(con, sources, _Names())
    try:
        table = con.sql(
            f"SELECT rank, step, {KIND_CODE_SQL} AS k, kind, name, start_ns, end_ns, bytes, "
            f"dtype FROM ({src}) WHERE {steps.sql('step')} ORDER BY rank, step, start_ns",
            params=params,
        ).to_arrow_table()
    finally:
        for name in registered:
            con.unregister(name)
    off, _ = span_offsets(
        sources,
        table.column("rank").to_numpy(),
        table.column("step").to_numpy(),
        table.column("start_ns").to_numpy(),
        table.column("k").to_numpy(),
    )
    out = table.drop_columns(["k"]).to_pandas()
    out["start_ns"] = out["start_ns"].to_numpy(np.int64) - off
    out["end_ns"] = out["end_ns"].to_numpy(np.int64) - off
    return out


#: The schema of :func:`span_tables`: a rank column, then the file's (text as plain strings).
SPAN_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32()),
        *(
            pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
            for f in FILE_SCHEMA
        ),
    ]
)
SPAN_COLUMNS: tuple[str, ...] = tuple(SPAN_SCHEMA.names)


def span_tables(
    sources: Sequence[RankSource], steps: StepRange | None = None, con: Any = None
) -> Iterator[pa.Table]:
    """Every span of ``sources`` (of ``steps``; None: all), one Arrow table per rank in the
    order of ``sources`` and of each file, times on rank 0's clock by the one alignment rule
    (:func:`span_offsets`), in :data:`SPAN_SCHEMA` (no sources: one empty table). For
    exports of a whole run (``--csv`` / ``--parquet``): one rank's spans in memory at a time,
    never the run's. ``con``: a DuckDB connection; default: a new :class:`Engine`."""
    if con is None:
        with Engine(threads=1) as eng:
            yield from span_tables(sources, steps, eng.con)
        return
    if not sources:
        yield SPAN_SCHEMA.empty_table()
        return
    where = steps.sql("step") if steps is not None else "TRUE"
    cols = ", ".join(SPAN_COLUMNS)
    for source in sources:
        src, params, registered = span_relation(con, [source], _Names())
        try:
            table = con.sql(
                f"SELECT {cols}, {KIND_CODE_SQL} AS k FROM ({src}) WHERE {where}", params=params
            ).to_arrow_table()
        finally:
            for name in registered:
                con.unregister(name)
        off, _ = span_offsets(
            [source],
            table.column("rank").to_numpy(),
            table.column("step").to_numpy(),
            table.column("start_ns").to_numpy(),
            table.column("k").to_numpy(),
        )
        out = []
        for name in SPAN_COLUMNS:
            col = table.column(name)
            if name in ("start_ns", "end_ns"):
                col = pa.array(col.to_numpy() - off, pa.int64())
            elif pa.types.is_dictionary(col.type):
                col = col.cast(col.type.value_type)
            elif pa.types.is_floating(col.type):  # a value not recorded: null, not NaN
                col = pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)
            out.append(col)
        yield pa.table(out, names=list(SPAN_COLUMNS)).cast(SPAN_SCHEMA)


class EngineError(Exception):
    """The engine could not read a group of files (``str()``: DuckDB's first line)."""


def summarize(
    sources: Sequence[RankSource],
    steps: StepRange | None = None,
    *,
    n_ranks: int | None = None,
    memory_limit_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_group_spans: int | None = None,
    repair: Callable[[list[RankSource]], list[RankSource]] | None = None,
) -> Summaries:
    """Run both passes locally over ``sources``: the local DuckDB engine.

    Groups run one after the other, pipelined: while numpy reduces one group's spans, DuckDB
    (on a worker thread that alone uses the connection) reads the next group and aggregates the
    previous one, so both cores work. At most two groups' spans are in memory at once. A group
    holds at most ``max_group_spans`` spans (default :func:`group_spans` of the memory limit);
    a rank with more is read a window of whole steps at a time (:meth:`Engine.step_windows`).
    ``progress(done, total)`` is called after each group with the ranks done so far.
    When DuckDB cannot read a group (a damaged file), ``repair(group)`` returns sources to use
    instead (say, what a careful reader salvaged) and the group is run again; without it, or if
    that fails too, :class:`EngineError` is raised.
    """
    from concurrent.futures import ThreadPoolExecutor

    import duckdb

    max_spans = group_spans(memory_limit_bytes) if max_group_spans is None else max_group_spans
    gs = list(groups(sources, max_spans))
    parts: list[Any] = []
    done = 0
    threads = max(1, (os.cpu_count() or 2) - 1)  # one core stays for numpy
    with (
        Engine(memory_limit_bytes, threads) as eng,
        ThreadPoolExecutor(1, "hvtrace-duckdb") as duck,
    ):
        # (group index, group, its steps or window, ranks done once it is)
        units: list[tuple[int, list[RankSource], Any, int]] = []
        for gi, g in enumerate(gs):
            done += len(g)
            windows = (
                duck.submit(eng.step_windows, g[0], steps, max_spans).result()
                if len(g) == 1 and g[0].n_spans > max_spans
                else []
            )
            for w, window in enumerate(windows):  # one rank's steps, a window at a time
                # its row groups counted once, with the first window
                first = g if w == 0 else [replace(g[0], row_groups_read=0, row_groups_total=0)]
                units.append((gi, first, window, done if w == len(windows) - 1 else done - 1))
            if not windows:
                units.append((gi, g, steps, done))
        repaired: dict[int, list[RankSource]] = {}

        def again(u: tuple[int, list[RankSource], Any, int], exc: Exception) -> GroupSummary:
            gi, g, sel, _ = u
            if repair is None:
                raise EngineError(_first_line(exc)) from None
            if gi not in repaired:  # the careful reader reads a group once, for all its windows
                repaired[gi] = repair(gs[gi])
            fixed = repaired[gi]
            if g is not gs[gi]:  # a later window: its row groups were counted with the first
                fixed = [replace(s, row_groups_read=0, row_groups_total=0) for s in fixed]
            try:
                return duck.submit(eng.rank_pass, fixed, sel).result()
            except duckdb.Error as exc2:
                raise EngineError(_first_line(exc2)) from None

        fetched = duck.submit(eng.fetch, units[0][1], units[0][2]) if units else None
        for i, u in enumerate(units):
            _, g, sel, ranks_done = u
            assert fetched is not None
            try:
                cols: dict[str, Any] | None = fetched.result()
            except duckdb.Error as exc:
                cols, failed = None, exc
            if i + 1 < len(units):
                fetched = duck.submit(eng.fetch, units[i + 1][1], units[i + 1][2])
            if cols is None:
                parts.append((u, again(u, failed)))
            else:
                rows, offsets, n_read = reduce_steps(cols, g)
                del cols
                job = duck.submit(eng.group_tables, g, sel, rows, offsets, n_read, True)
                del rows, offsets
                parts.append((u, job))
            if progress is not None and (i + 1 == len(units) or units[i + 1][3] != ranks_done):
                progress(ranks_done, len(sources))
        results = []
        for u, part in parts:
            if isinstance(part, GroupSummary):
                results.append(part)
                continue
            try:
                results.append(part.result())
            except duckdb.Error as exc:
                results.append(again(u, exc))
        merged = duck.submit(eng.collectives).result()
    return cross_rank(results, n_ranks, merged)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
