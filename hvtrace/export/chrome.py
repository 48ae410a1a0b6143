"""Merged timeline export: every rank's spans as one Chrome trace event JSON file.

The output opens in the Perfetto UI (https://ui.perfetto.dev) and in ``chrome://tracing``. It is
the JSON object format ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``,
gzip-compressed when the file name ends in ``.gz``.

Layout
------
* One process per rank: ``pid`` = rank, named ``rank N (host)``, sorted by rank.
* One thread (lane) per kind of work, in this order: ``step``, ``compute`` (input, forward,
  backward, compute), ``wait`` (``synchronize()``), ``update``, ``user`` and ``allreduce 0``,
  ``allreduce 1``, ... Chrome's complete events (``"ph": "X"``) on one thread must nest, but
  the allreduces of a step overlap each other, so they are spread over as many ``allreduce k``
  lanes as needed by greedy first-fit (:func:`assign_lanes`; optimal for intervals). Any other
  group whose spans happen to overlap gets extra lanes the same way (``user 1``, ...). Thread ids
  are unique over the whole trace, as Perfetto expects of tids: ``tid = rank * stride + lane slot
  + 1`` (stride a power of ten, so rank 3's lanes are 301, 302, ...).
* ``ts``/``dur`` are microseconds from the start of the run (the earliest span of any rank,
  before any ``steps`` cut), written as exact decimals of the nanosecond times.
* Scalars (``hvtrace.scalar``) are counters (``"ph": "C"``) named after the scalar, with one
  series ``value``; the per-step communication/compute ratio is the counter ``comm/compute``
  (series ``ratio``) at each step's start.
* Each allreduce collective (same step and tensor on every rank) is linked by flow arrows
  (``"ph": "s"``/``"f"``, ``"bp": "e"``) from the rank that enqueued it first to every other
  rank's span, and every span of it carries the same ``args.collective`` id.
* Horovod's own timeline, when merged (``horovod``), is drawn under rank 0 as a thread per tensor
  ``horovod <tensor>`` (negotiation, operation) and ``horovod <tensor> parts`` (fusion copies,
  the transfer), laid out by :func:`hvtrace.analysis.hvd_timeline.horovod_tracks`, each slice in
  the part of the step of rank 0 in which it starts.

Large runs are split by step ranges into ``NAME.part000.json``, ``NAME.part001.json``, ... so that
no file exceeds ``max_events`` events or ``max_bytes`` bytes (uncompressed); every part repeats the
process and thread metadata, so each opens on its own.

A run is read through the engine, never as one table (:class:`_Chunks`): each rank's spans from
its file (:func:`hvtrace.analysis.engine.span_tables`: DuckDB, the one clock-alignment rule), its
lanes assigned as it is read (lanes are per rank), staged in a DuckDB table of the engine (spilled
to disk past its memory limit), then read back :data:`CHUNK_SPANS` spans of whole steps at a time
and turned into events; collective ids are numbered by (step, tensor name) over the whole trace.
A span table already in memory (a DataFrame, or a run whose frame was built) is one chunk.

Everything is vectorized: lanes, collectives and counters with numpy, the JSON text column-wise
with Arrow compute kernels (in a few threads; they release the GIL), written straight from the
Arrow buffers. About 5 s of CPU per million spans (2.6 million events with flows).
"""

from __future__ import annotations

import gzip
import heapq
import json
import logging
import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.errors import TraceError
from hvtrace.export.output import check_output, make_output_dir, output_mode
from hvtrace.format.schema import HASH_PREFIXES, KINDS, collective_keys
from hvtrace.load import Run, span_sources
from hvtrace.selection import SelectionError, StepRange

log = logging.getLogger("hvtrace")

#: Lane groups in display order, and the group of each span kind (-1: not a slice).
LANE_GROUPS: tuple[str, ...] = (
    "step",
    "compute",
    "wait",
    "update",
    "user",
    "collective",
    "allreduce",  # last: the Perfetto writer draws flows from the allreduce lanes at the end
)
_KIND_GROUP: dict[str, str] = {
    "step": "step",
    "input": "compute",
    "forward": "compute",
    "backward": "compute",
    "compute": "compute",
    "wait": "wait",
    "update": "update",
    "user": "user",
    "allreduce": "allreduce",
    "collective": "collective",  # outside the optimizer: hvd.allreduce, broadcast_object, ...
}
_G_STEP = LANE_GROUPS.index("step")
_G_ALLREDUCE = LANE_GROUPS.index("allreduce")
GROUP_OF_KIND = np.array(
    [LANE_GROUPS.index(_KIND_GROUP[k]) if k in _KIND_GROUP else -1 for k in KINDS], np.int64
)
_K = {k: i for i, k in enumerate(KINDS)}

#: Element types (an element is one event, or an s/f pair of flow events written together).
_T_X, _T_XAR, _T_SCALAR, _T_RATIO, _T_FLOW, _T_HVD = range(6)

#: Counter names.
RATIO_COUNTER = "comm/compute"

_BATCH = 1 << 18  # elements turned into strings at a time (a few in flight: bounded memory)
_VECTOR_LIMIT = 1024  # overlap chains up to this length use the vectorized first-fit
_GZIP_LEVEL = 3  # zlib level: ~3x faster than 6, files ~25% larger
_WORKERS = 4  # threads building batch text ahead of the writer


# --------------------------------------------------------------------------------------------
# Lane assignment


def assign_lanes(
    group: np.ndarray, start: np.ndarray, end: np.ndarray, vector_limit: int = _VECTOR_LIMIT
) -> np.ndarray:
    """Return a lane index per interval so that intervals of one group and lane never overlap.

    Greedy first-fit in start order (each interval takes the lowest lane that is free at its
    start; touching intervals share a lane), which uses exactly as many lanes as the most
    intervals open at once. Intervals are split into chains of overlapping intervals; chains up to
    ``vector_limit`` long are handled together with numpy (one step per position in the chain),
    longer ones with a heap (O(n log n)). ``end`` must be >= ``start``.
    """
    group = np.asarray(group, np.int64)
    start = np.asarray(start, np.int64)
    end = np.asarray(end, np.int64)
    n = len(start)
    lanes = np.zeros(n, np.int64)
    if n < 2:
        return lanes
    order = np.lexsort((-end, start, group))
    g, s, e = group[order], start[order], end[order]
    new_group = np.empty(n, bool)
    new_group[0] = True
    np.not_equal(g[1:], g[:-1], out=new_group[1:])
    gid = np.cumsum(new_group) - 1
    run_max = pd.Series(e).groupby(gid, sort=False).cummax().to_numpy()
    prev_max = np.empty(n, np.int64)
    prev_max[0] = 0
    prev_max[1:] = run_max[:-1]
    new_chain = new_group | (s >= prev_max)
    chain_start = np.flatnonzero(new_chain)
    chain_size = np.diff(np.append(chain_start, n))
    out = np.zeros(n, np.int64)

    big = np.flatnonzero(chain_size > vector_limit)
    for c in big:
        a, b = chain_start[c], chain_start[c] + chain_size[c]
        out[a:b] = _first_fit_heap(s[a:b], e[a:b])

    mid = (chain_size >= 2) & (chain_size <= vector_limit)
    if mid.any():
        cs, sz = chain_start[mid], chain_size[mid]
        k = np.floor(np.log2(sz)).astype(np.int64)
        for kk in np.unique(k):
            sel = k == kk
            by_size = np.argsort(-sz[sel], kind="stable")
            _first_fit_vector(cs[sel][by_size], sz[sel][by_size], s, e, out, 2 ** (int(kk) + 1))
    lanes[order] = out
    return lanes


def _first_fit_vector(
    cstart: np.ndarray, csize: np.ndarray, s: np.ndarray, e: np.ndarray, out: np.ndarray, width: int
) -> None:
    """First-fit for many chains at once; chains sorted by size, descending, all < ``width``."""
    m = len(cstart)
    state = np.full((m, width), np.iinfo(np.int64).min, np.int64)
    rows = np.arange(m)
    neg = -csize
    used = 0
    for p in range(int(csize[0])):
        na = int(np.searchsorted(neg, -p, side="left"))  # chains longer than p
        idx = cstart[:na] + p
        sp = s[idx]
        lane = (state[:na, : used + 1] <= sp[:, None]).argmax(axis=1)
        state[rows[:na], lane] = e[idx]
        out[idx] = lane
        used = max(used, int(lane.max()) + 1)


def _first_fit_heap(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """First-fit for one chain (sorted by start) with heaps of busy and free lanes."""
    busy: list[tuple[int, int]] = []
    free: list[int] = []
    lanes: list[int] = []
    n_lanes = 0
    for a, b in zip(s.tolist(), e.tolist()):
        while busy and busy[0][0] <= a:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = n_lanes
            n_lanes += 1
        heapq.heappush(busy, (b, lane))
        lanes.append(lane)
    return np.asarray(lanes, np.int64)


# --------------------------------------------------------------------------------------------
# Input normalization


def _normalize(spans: pd.DataFrame) -> pd.DataFrame:
    """Return ``spans`` with every column of the loaded span table; ``kind`` a KINDS category."""
    need = {"rank", "step", "kind", "start_ns", "end_ns"}
    missing = need - set(spans.columns)
    if missing:
        raise ValueError(f"span table lacks column(s) {', '.join(sorted(missing))}")
    s = spans
    kind = s["kind"]
    if not (isinstance(kind.dtype, pd.CategoricalDtype) and tuple(kind.cat.categories) == KINDS):
        s = s.assign(kind=pd.Categorical(kind, categories=KINDS))
    n = len(s)
    defaults: dict[str, Any] = {
        "micro": lambda: np.zeros(n, np.int16),
        "name": lambda: s["kind"].astype(str),
        "bytes": lambda: np.zeros(n, np.int64),
        "dtype": lambda: np.full(n, "", object),
        "value": lambda: np.full(n, np.nan),
        "flags": lambda: np.zeros(n, np.uint8),
    }
    add = {c: make() for c, make in defaults.items() if c not in s.columns}
    if add:
        s = s.assign(**add)
    for c in ("name", "dtype"):
        if not isinstance(s[c].dtype, pd.CategoricalDtype):
            s = s.assign(**{c: s[c].astype(str).astype("category")})
    return s


@dataclass
class _Source:
    """What the trace says of the run besides its spans (the metadata events and ``otherData``)."""

    hosts: dict[int, str]
    ranks: list[int]
    run_id: str = "?"
    size: int = 0
    headers: dict[int, dict[str, Any]] = field(default_factory=dict)
    clock: str = ""
    problems: list[str] = field(default_factory=list)


def _frame_source(spans: pd.DataFrame, hosts: dict[int, str] | None) -> _Source:
    ranks = sorted(int(r) for r in pd.unique(spans["rank"]))
    if hosts:
        ranks = sorted(set(ranks) | {int(r) for r in hosts})
    h = {r: str((hosts or {}).get(r, "?")) for r in ranks}
    return _Source(h, ranks, size=(max(ranks) + 1 if ranks else 0))


def _run_source(run: Run, hosts: dict[int, str] | None) -> _Source:
    ranks = sorted(run.ranks)
    h = {r: str(run.hosts.get(r, (hosts or {}).get(r, "?"))) for r in ranks}
    try:
        clock = run.clock_summary()
    except Exception:  # noqa: BLE001 - a summary line is optional
        clock = ""
    return _Source(
        h,
        ranks,
        run_id=str(run.run_id),
        size=int(run.size),
        headers={r: dict(f.header) for r, f in run.files.items()},
        clock=clock,
        problems=list(run.problems),
    )


@dataclass
class _Spans:
    """Spans of some steps of every rank, clock rows left out, in rank order then each rank's
    file order, as numpy columns: times on rank 0's clock (ns, ``end >= start``), ``kind`` a
    code of KINDS, text as codes into ``names`` / ``dtypes`` (sorted; a missing value's code is
    their length), ``lane`` each slice's lane in its (rank, lane group) (-1: not a slice)."""

    rank: np.ndarray
    step: np.ndarray
    kind: np.ndarray
    micro: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    value: np.ndarray
    name: np.ndarray
    dtype: np.ndarray
    lane: np.ndarray
    names: list[str]
    dtypes: list[str]

    def __len__(self) -> int:
        return len(self.start)


def _lanes(rank: np.ndarray, kind: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each slice's lane in its (rank, lane group) (:func:`assign_lanes`); -1 where not a slice.
    Lanes of one rank depend on that rank's spans alone, so a rank at a time gives the same."""
    group = np.where(kind >= 0, GROUP_OF_KIND[np.maximum(kind, 0)], -1)
    xs = np.flatnonzero(group >= 0)
    lane = np.full(len(kind), -1, np.int64)
    lane[xs] = assign_lanes(rank[xs] * len(LANE_GROUPS) + group[xs], start[xs], end[xs])
    return lane


def _encode(strings: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Codes of ``strings`` into their sorted distinct values (a null: the values' count)."""
    enc = pc.dictionary_encode(strings)
    if isinstance(enc, pa.ChunkedArray):
        if enc.num_chunks:
            enc = enc.combine_chunks()
        else:
            enc = pa.array([], pa.string()).dictionary_encode()
    values = [str(v) for v in enc.dictionary.to_pylist()]
    order = np.argsort(np.asarray(values, dtype=object), kind="stable") if values else np.zeros(0)
    rank_of = np.empty(len(values) + 1, np.int64)
    rank_of[order.astype(np.int64)] = np.arange(len(values))
    rank_of[len(values)] = len(values)
    idx = enc.indices.fill_null(len(values)).to_numpy(zero_copy_only=False).astype(np.int64)
    return rank_of[idx], [values[i] for i in order.astype(np.int64)]


def _spans_of(table: pa.Table, lane: np.ndarray | None = None) -> _Spans:
    """``table`` (columns of :data:`hvtrace.analysis.engine.SPAN_SCHEMA`, plus ``lane`` or not;
    times on rank 0's clock) without its clock rows, as :class:`_Spans`."""
    kind = pc.index_in(pc.cast(table.column("kind"), pa.string()), value_set=_KIND_STR)
    kind = kind.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = np.flatnonzero(kind != _K["clock"])

    def col(name: str, dtype: Any, fill: Any = 0) -> np.ndarray:
        c = table.column(name)
        if c.null_count:
            c = c.fill_null(fill)
        return c.to_numpy().astype(dtype)[keep]

    rank = col("rank", np.int64)
    start = col("start_ns", np.int64)
    end = np.maximum(col("end_ns", np.int64), start)
    kind = kind[keep]
    name, names = _encode(table.column("name").take(pa.array(keep)))
    dtype, dtypes = _encode(pc.cast(table.column("dtype"), pa.string()).take(pa.array(keep)))
    if lane is None:
        lane = _lanes(rank, kind, start, end)
    return _Spans(
        rank=rank,
        step=col("step", np.int64),
        kind=kind,
        micro=col("micro", np.int64),
        start=start,
        end=end,
        nbytes=col("bytes", np.int64),
        value=col("value", np.float64, np.nan),
        name=name,
        dtype=dtype,
        lane=lane,
        names=names,
        dtypes=dtypes,
    )


def _frame_table(spans: pd.DataFrame) -> pa.Table:
    """A span DataFrame (``Run.spans``, or hand-made) as a table of the engine's span schema."""
    from hvtrace.analysis.engine import SPAN_SCHEMA

    s = _normalize(spans)
    cols = []
    for f in SPAN_SCHEMA:
        v = s[f.name] if f.name in s.columns else pd.Series(np.nan, index=s.index)
        if f.name in ("kind", "name", "dtype"):
            arr = pa.array(v, from_pandas=True)
            if pa.types.is_dictionary(arr.type):
                arr = arr.dictionary_decode()
            cols.append(pc.cast(arr, f.type))
        else:
            cols.append(pa.array(v.to_numpy(), f.type, from_pandas=True))
    return pa.table(cols, schema=SPAN_SCHEMA)


@dataclass
class _Layout:
    """What every part of the trace shares: the time origin, the lanes (threads) of each rank,
    the metadata events, ``otherData``, the comm/compute counters and Horovod's slices."""

    t0: int
    nsub: np.ndarray
    slot_base: np.ndarray
    stride: int
    n_rank_ids: int
    meta: list[dict[str, Any]]
    other: dict[str, Any]
    ratio: pd.DataFrame
    hv: _HorovodSlices


def _layout(
    src: _Source,
    t0: int,
    used: np.ndarray,
    steps: StepRange | None,
    steps_df: pd.DataFrame,
    horovod: pd.DataFrame | None,
    step0: tuple[np.ndarray, np.ndarray],
) -> _Layout:
    """``used``: the distinct (rank, lane group, lane) triples of the slices, shape (n, 3);
    ``step0``: rank 0's step spans (start_ns, step)."""
    n_groups = len(LANE_GROUPS)
    nsub = np.zeros(n_groups, np.int64)
    if len(used):
        np.maximum.at(nsub, used[:, 1], used[:, 2] + 1)
    nsub[_G_STEP] = max(1, nsub[_G_STEP])
    slot_base = np.concatenate([[0], np.cumsum(nsub)[:-1]])
    stride = 10 ** max(2, len(str(int(nsub.sum()))))
    x_slot = slot_base[used[:, 1]] + used[:, 2] if len(used) else np.zeros(0, np.int64)
    x_rank = used[:, 0] if len(used) else np.zeros(0, np.int64)
    ratio = steps_table(steps_df)
    ratio = ratio[np.isfinite(ratio["comm_compute_ratio"].to_numpy(np.float64))]
    if steps is not None:
        ratio = ratio[steps.mask(ratio["step"].to_numpy(np.int64))]
    ratio = ratio[ratio["rank"].isin(src.ranks)].reset_index(drop=True)
    hv = _HorovodSlices.of(
        horovod if 0 in src.ranks else None,
        t0,
        tid_base=stride * (max(src.ranks, default=0) + 1),
        step_start=step0[0] - t0,
        step_no=step0[1],
    )
    other = _other_data(src, t0, steps, nsub)
    if len(hv.ts):
        other["horovod_timeline"] = {"tensors": len(hv.tensors) - 1, "slices": len(hv.ts)}
    return _Layout(
        t0=t0,
        nsub=nsub,
        slot_base=slot_base,
        stride=stride,
        n_rank_ids=max(src.ranks, default=0) + 1,
        meta=_metadata(src, stride, slot_base, nsub, x_rank, x_slot) + hv.meta,
        other=other,
        ratio=ratio,
        hv=hv,
    )


def _used_lanes(sp: _Spans) -> np.ndarray:
    """The distinct (rank, lane group, lane) triples of ``sp``'s slices, shape (n, 3)."""
    xs = sp.lane >= 0
    if not xs.any():
        return np.zeros((0, 3), np.int64)
    g = GROUP_OF_KIND[sp.kind[xs]]
    return np.unique(np.column_stack([sp.rank[xs], g, sp.lane[xs]]), axis=0)


def _no_steps(steps: StepRange, have: tuple[int, int]) -> TraceError:
    return TraceError(f"no spans in steps {steps.label()} (the run has steps {have[0]}..{have[1]})")


#: Spans per chunk of steps built into events at a time (a run is never one table).
CHUNK_SPANS = 1_000_000
#: DuckDB's memory for the staged spans (past it they spill to the engine's directory).
STAGE_MEMORY_BYTES = 256 << 20


class _Chunks:
    """The spans of a run (or of a span DataFrame) as :class:`_Spans` chunks of whole steps, in
    step order, and the :class:`_Layout` they share.

    A run is read through the engine (:func:`hvtrace.analysis.engine.span_tables`: DuckDB over
    the rank files, the one clock-alignment rule, one rank in memory at a time); each rank's
    lanes are assigned as it is read, and its spans staged in a DuckDB table of the engine
    (spilled to disk past its memory limit), then read back a chunk of steps at a time."""

    def __init__(
        self,
        run_or_spans: Run | pd.DataFrame,
        steps: StepRange | None,
        steps_df: pd.DataFrame | None,
        hosts: dict[int, str] | None,
        horovod: pd.DataFrame | None,
        chunk_spans: int = CHUNK_SPANS,
    ) -> None:
        self.steps = steps
        self.chunk_spans = max(1, int(chunk_spans))
        self._engine: Any = None
        self._frame: _Spans | None = None
        # a span table in memory (a frame, or a run whose frame was built or given) is
        # exported from it; else the run's files are read through the engine
        frame = run_or_spans if isinstance(run_or_spans, pd.DataFrame) else None
        if frame is None and "spans" in vars(run_or_spans):
            frame = run_or_spans.spans
        if frame is not None:
            if isinstance(run_or_spans, pd.DataFrame):
                src = _frame_source(frame, hosts)
            else:
                src = _run_source(run_or_spans, hosts)
                src.ranks = sorted(set(src.ranks) | {int(r) for r in pd.unique(frame["rank"])})
                src.hosts = {r: src.hosts.get(r, (hosts or {}).get(r, "?")) for r in src.ranks}
            t0, used, step0 = self._stage_frame(frame)
            if steps_df is None:  # the analysis's own step table: one definition of the ratio
                from hvtrace.analysis.steps import step_table

                steps_df = step_table(_normalize(frame))
        else:
            src = _run_source(run_or_spans, hosts)
            try:
                t0, used, step0 = self._stage_run(run_or_spans)
            except BaseException:
                self.close()
                raise
            if steps_df is None:
                from hvtrace.analysis import analyze

                steps_df = analyze(run_or_spans, steps=steps).steps
        self.layout = _layout(src, t0, used, steps, steps_df, horovod, step0)

    # -- staging
    def _stage_frame(self, spans: pd.DataFrame) -> tuple[int, np.ndarray, Any]:
        sp = _spans_of(_frame_table(spans))
        if not len(sp):
            raise TraceError("nothing to export: the run has no spans")
        t0 = int(sp.start.min())
        if self.steps is not None:
            m = self.steps.mask(sp.step)
            if not m.any():
                raise _no_steps(self.steps, (int(sp.step.min()), int(sp.step.max())))
            sp = _Spans(
                *(getattr(sp, f)[m] for f in _ARRAY_FIELDS), names=sp.names, dtypes=sp.dtypes
            )
        self._frame = sp
        is0 = (sp.kind == _K["step"]) & (sp.rank == 0)
        return t0, _used_lanes(sp), (sp.start[is0], sp.step[is0])

    def _stage_run(self, run: Run) -> tuple[int, np.ndarray, Any]:
        from hvtrace.analysis.engine import Engine, span_tables

        # the staged spans spill to disk past this: the export's memory does not grow with the run
        eng = self._engine = Engine(memory_limit_bytes=STAGE_MEMORY_BYTES)
        con = eng.con
        con.execute(
            "CREATE TEMP TABLE hv_x (rank INTEGER, idx BIGINT, step INTEGER, kind SMALLINT, "
            "micro SMALLINT, name VARCHAR, start_ns BIGINT, end_ns BIGINT, bytes BIGINT, "
            "dtype VARCHAR, value DOUBLE, lane SMALLINT)"
        )
        t0: int | None = None
        used: list[np.ndarray] = []
        step0: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        lo_step = hi_step = None
        for table in span_tables(span_sources(run, self.steps), self.steps, con):
            sp = _spans_of(table)
            if not len(sp):
                continue
            lo = int(sp.step.min())
            hi = int(sp.step.max())
            lo_step = lo if lo_step is None else min(lo_step, lo)
            hi_step = hi if hi_step is None else max(hi_step, hi)
            first = int(sp.start.min())
            t0 = first if t0 is None else min(t0, first)
            used.append(_used_lanes(sp))
            if int(sp.rank[0]) == 0:
                is_step = sp.kind == _K["step"]
                step0 = (sp.start[is_step], sp.step[is_step])
            part = pa.table(
                {
                    "rank": sp.rank.astype(np.int32),
                    "idx": np.arange(len(sp), dtype=np.int64),
                    "step": sp.step.astype(np.int32),
                    "kind": sp.kind.astype(np.int16),
                    "micro": sp.micro.astype(np.int16),
                    "name": pa.array([*sp.names, None], pa.string()).take(pa.array(sp.name)),
                    "start_ns": sp.start,
                    "end_ns": sp.end,
                    "bytes": sp.nbytes,
                    "dtype": pa.array([*sp.dtypes, None], pa.string()).take(pa.array(sp.dtype)),
                    "value": sp.value,
                    "lane": sp.lane.astype(np.int16),
                }
            )
            con.register("hv_part", part)
            try:
                con.execute("INSERT INTO hv_x SELECT * FROM hv_part")
            finally:
                con.unregister("hv_part")
        if self.steps is not None:  # the time origin is the run's, before the steps cut
            t_all, lo, hi = self._run_bounds(run, con)
            if t0 is None:
                if t_all is None:
                    raise TraceError("nothing to export: the run has no spans")
                raise _no_steps(self.steps, (lo, hi))
            t0 = t_all if t_all is not None else t0
        if t0 is None:
            raise TraceError("nothing to export: the run has no spans")
        u = np.unique(np.concatenate(used), axis=0) if used else np.zeros((0, 3), np.int64)
        return t0, u, step0

    @staticmethod
    def _run_bounds(run: Run, con: Any) -> tuple[int | None, int, int]:
        """The whole run's earliest span start (on rank 0's clock; None: no span) and its first
        and last step, clock rows left out: one pass over every rank."""
        from hvtrace.analysis.engine import span_tables

        t0 = lo = hi = None
        for table in span_tables(span_sources(run), None, con):
            keep = pc.not_equal(pc.cast(table.column("kind"), pa.string()), "clock")
            start = pc.filter(table.column("start_ns"), keep)
            if not len(start):
                continue
            step = pc.filter(table.column("step"), keep)
            first, a, b = (int(pc.min(start).as_py()), int(pc.min(step).as_py()),
                           int(pc.max(step).as_py()))  # fmt: skip
            t0 = first if t0 is None else min(t0, first)
            lo = a if lo is None else min(lo, a)
            hi = b if hi is None else max(hi, b)
        return t0, lo or 0, hi or 0

    # -- reading back
    def ranges(self) -> list[tuple[int | None, int | None]]:
        """Step ranges ``[lo, hi)`` of about ``chunk_spans`` spans each, covering every step
        (the first from the smallest, the last to the largest: None)."""
        if self._frame is not None:
            return [(None, None)]
        counts = self._engine.con.execute(
            "SELECT step, count(*) FROM hv_x GROUP BY step ORDER BY step"
        ).fetchall()
        out: list[tuple[int | None, int | None]] = []
        lo: int | None = None
        n = 0
        for step, c in counts:
            if n and n + c > self.chunk_spans:
                out.append((lo, int(step)))
                lo, n = int(step), 0
            n += int(c)
        out.append((lo, None))
        return out

    def spans(self, lo: int | None, hi: int | None) -> _Spans:
        """The staged spans of steps ``[lo, hi)`` (None: unbounded)."""
        if self._frame is not None:
            return self._frame
        conds = []
        if lo is not None:
            conds.append(f"step >= {int(lo)}")
        if hi is not None:
            conds.append(f"step < {int(hi)}")
        where = " AND ".join(conds)
        table = self._engine.con.sql(
            "SELECT rank, step, kind, micro, name, start_ns, end_ns, bytes, dtype, value, lane "
            f"FROM hv_x WHERE {where or 'TRUE'} ORDER BY rank, idx"
        ).to_arrow_table()
        kind = table.column("kind").to_numpy().astype(np.int64)
        name, names = _encode(table.column("name"))
        dtype, dtypes = _encode(table.column("dtype"))
        return _Spans(
            rank=table.column("rank").to_numpy().astype(np.int64),
            step=table.column("step").to_numpy().astype(np.int64),
            kind=kind,
            micro=table.column("micro").to_numpy().astype(np.int64),
            start=table.column("start_ns").to_numpy(),
            end=table.column("end_ns").to_numpy(),
            nbytes=table.column("bytes").to_numpy(),
            value=table.column("value").fill_null(np.nan).to_numpy(),
            name=name,
            dtype=dtype,
            lane=table.column("lane").to_numpy().astype(np.int64),
            names=names,
            dtypes=dtypes,
        )

    def tables(self) -> Iterator[_Table]:
        """The event table of each chunk, in step order (collective ids numbered on)."""
        cid_base = 0
        for lo, hi in self.ranges():
            t = _build(self.spans(lo, hi), self.layout, cid_base, lo, hi)
            cid_base += t.n_collectives
            yield t

    def close(self) -> None:
        """Drop the staged spans (the engine's database and spill directory)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None


_ARRAY_FIELDS = (
    "rank", "step", "kind", "micro", "start", "end", "nbytes", "value", "name", "dtype", "lane",
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Building the event table


def _strs(x: np.ndarray) -> pa.Array:
    return pc.cast(pa.array(x), pa.string())


_FRAC3 = pa.array([f".{i:03d}" for i in range(1000)])
_DIG3 = pa.array([f"{i:03d}" for i in range(1000)])


def _dec(x: np.ndarray, digits: int) -> list[pa.Array]:
    """Pieces of the exact decimal text of ``x / 10**digits`` (integers ``x >= 0``; 3 or 6)."""
    q, r = np.divmod(np.asarray(x, np.int64), 10**digits)
    if digits == 3:
        return [_strs(q), _FRAC3.take(pa.array(r))]
    hi, lo = np.divmod(r, 1000)
    return [_strs(q), _FRAC3.take(pa.array(hi)), _DIG3.take(pa.array(lo))]


def _join(*pieces: Any) -> pa.Array:
    return pc.binary_join_element_wise(*pieces, "")


def _json_strings(values: Sequence[Any]) -> pa.Array:
    """JSON string literals of ``values`` plus a final ``""`` (for missing codes)."""
    return pa.array([json.dumps(str(v), ensure_ascii=False) for v in values] + ['""'])


@dataclass
class _Table:
    """Everything needed to emit the events, as numpy columns; strings are made per batch."""

    n_collectives: int
    # slices
    x_pid: np.ndarray
    x_tid: np.ndarray
    x_ts: np.ndarray
    x_dur: np.ndarray
    x_step: np.ndarray
    x_micro: np.ndarray
    x_kind: np.ndarray
    x_name: np.ndarray
    x_bytes: np.ndarray
    x_dtype: np.ndarray
    x_coll: np.ndarray
    names: pa.Array
    dtypes: pa.Array
    # scalar counters
    c_pid: np.ndarray
    c_tid: np.ndarray
    c_ts: np.ndarray
    c_name: np.ndarray
    c_value: np.ndarray
    # ratio counters
    r_pid: np.ndarray
    r_tid: np.ndarray
    r_ts: np.ndarray
    r_value: np.ndarray
    # flows: element indices into the x_ arrays
    f_id: np.ndarray
    f_src: np.ndarray
    f_dst: np.ndarray
    # Horovod's timeline: slices under rank 0
    h_tid: np.ndarray
    h_ts: np.ndarray
    h_dur: np.ndarray
    h_name: np.ndarray
    h_tensor: np.ndarray
    h_names: pa.Array
    h_tensors: pa.Array
    # elements in output order
    e_type: np.ndarray
    e_idx: np.ndarray
    e_step: np.ndarray
    e_unit: np.ndarray

    @property
    def n_elements(self) -> int:
        return len(self.e_type)


def _build(sp: _Spans, lay: _Layout, cid_base: int, lo: int | None, hi: int | None) -> _Table:
    """The event table of the chunk ``sp`` (steps ``[lo, hi)``, None: unbounded): its slices,
    collectives and flows, counters, and the comm/compute counters and Horovod slices of those
    steps; collective ids from ``cid_base``."""
    t0 = lay.t0
    kind, rank, step = sp.kind, sp.rank, sp.step
    start = sp.start - t0
    end = np.maximum(sp.end - t0, start)
    name_code = sp.name
    names = _json_strings(sp.names)

    def in_chunk(s: np.ndarray) -> np.ndarray:
        m = np.ones(len(s), bool)
        if lo is not None:
            m &= s >= lo
        if hi is not None:
            m &= s < hi
        return m

    # ---- slices and lanes
    group = np.where(kind >= 0, GROUP_OF_KIND[np.maximum(kind, 0)], -1)
    xs = group >= 0
    x_rank, x_group = rank[xs], group[xs]
    x_start, x_end = start[xs], end[xs]
    x_slot = lay.slot_base[x_group] + sp.lane[xs]
    x_tid = x_rank * lay.stride + x_slot + 1

    # ---- collectives and flows
    x_kind = kind[xs]
    x_step = step[xs]
    x_name = name_code[xs]
    x_coll = np.full(len(x_kind), -1, np.int64)
    ar = np.flatnonzero(x_kind == _K["allreduce"])
    f_id = f_src = f_dst = np.zeros(0, np.int64)
    n_coll = 0
    if len(ar):
        a_rank, a_step, a_name, a_start = x_rank[ar], x_step[ar], x_name[ar], x_start[ar]
        # one collective per (step, tensor): the format's key, as the analysis pairs them
        _, cid = np.unique(collective_keys(a_step, a_name), return_inverse=True)
        cid = cid.astype(np.int64).reshape(-1)
        n_coll = int(cid.max()) + 1
        x_coll[ar] = cid + cid_base
        # the source of each collective: earliest start, then lowest rank
        o3 = np.lexsort((a_rank, a_start, cid))
        is_src = np.ones(len(o3), bool)
        is_src[1:] = cid[o3][1:] != cid[o3][:-1]
        src_of = np.empty(n_coll, np.int64)
        src_of[cid[o3][is_src]] = ar[o3][is_src]
        dst = ar[o3][~is_src]
        f_dst = dst
        f_src = src_of[x_coll[dst] - cid_base]
        f_id = x_coll[dst] * lay.n_rank_ids + x_rank[dst] + 1

    # ---- counters: scalars
    is_scalar = (kind == _K["scalar"]) & np.isfinite(sp.value)
    # a parameter or batch fingerprint (hvtrace.record.consistency) is a hash: nothing to draw
    fingerprint = np.append(
        np.asarray([n.startswith(HASH_PREFIXES) for n in sp.names], bool), False
    )
    is_scalar &= ~fingerprint[name_code]
    c_rank = rank[is_scalar]
    c_tid = c_rank * lay.stride + int(lay.slot_base[_G_STEP]) + 1
    c_value = sp.value[is_scalar]

    # ---- counters: comm/compute ratio per rank and step (the analysis's), of these steps
    ratio = lay.ratio[in_chunk(lay.ratio["step"].to_numpy(np.int64))]
    r_rank = ratio["rank"].to_numpy(np.int64)
    r_ts = np.maximum(ratio["start_ns"].to_numpy(np.int64) - t0, 0)
    r_tid = r_rank * lay.stride + int(lay.slot_base[_G_STEP]) + 1

    # ---- Horovod's timeline under rank 0, each slice in rank 0's step in which it starts
    hv = lay.hv
    h_sel = np.flatnonzero(in_chunk(hv.step))

    # ---- elements and their order: by step, then unit (a collective's slices and flows stay
    # together, so an oversized step can still be cut between units), then type
    n_x, n_c, n_r, n_f = len(x_kind), int(is_scalar.sum()), len(r_rank), len(f_id)
    n_h = len(h_sel)
    e_type = np.concatenate(
        [
            np.where(x_kind == _K["allreduce"], _T_XAR, _T_X),
            np.full(n_c, _T_SCALAR),
            np.full(n_r, _T_RATIO),
            np.full(n_f, _T_FLOW),
            np.full(n_h, _T_HVD),
        ]
    ).astype(np.int64)
    e_idx = np.concatenate(
        [np.arange(n_x), np.arange(n_c), np.arange(n_r), np.arange(n_f), h_sel]
    ).astype(np.int64)
    e_step = np.concatenate(
        [x_step, step[is_scalar], ratio["step"].to_numpy(np.int64), x_step[f_dst], hv.step[h_sel]]
    ).astype(np.int64)
    e_ts = np.concatenate([x_start, start[is_scalar], r_ts, x_start[f_src], hv.ts[h_sel]])
    # units: a collective's id; every other element a unit of its own, numbered after them
    own_unit = (cid_base + n_coll) + np.arange(len(e_type), dtype=np.int64)
    e_unit = np.concatenate(
        [
            np.where(x_coll >= 0, x_coll, own_unit[:n_x]),
            own_unit[n_x : n_x + n_c + n_r],
            x_coll[f_dst],
            own_unit[n_x + n_c + n_r + n_f :],
        ]
    ).astype(np.int64)
    unit_ts = e_ts.copy()
    if n_coll:
        coll_ts = np.full(n_coll, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(coll_ts, x_coll[ar] - cid_base, x_start[ar])
        in_coll = e_unit < cid_base + n_coll
        unit_ts[in_coll] = coll_ts[e_unit[in_coll] - cid_base]
    order = np.lexsort((e_ts, e_type, e_unit, unit_ts, e_step))

    return _Table(
        n_collectives=n_coll,
        x_pid=x_rank,
        x_tid=x_tid,
        x_ts=x_start,
        x_dur=x_end - x_start,
        x_step=x_step,
        x_micro=sp.micro[xs],
        x_kind=x_kind.astype(np.int64),
        x_name=x_name,
        x_bytes=sp.nbytes[xs],
        x_dtype=sp.dtype[xs],
        x_coll=x_coll,
        names=names,
        dtypes=_json_strings(sp.dtypes),
        c_pid=c_rank,
        c_tid=c_tid,
        c_ts=start[is_scalar],
        c_name=name_code[is_scalar],
        c_value=c_value,
        r_pid=r_rank,
        r_tid=r_tid,
        r_ts=r_ts,
        r_value=ratio["comm_compute_ratio"].to_numpy(np.float64),
        f_id=f_id,
        f_src=f_src,
        f_dst=f_dst,
        h_tid=hv.tid,
        h_ts=hv.ts,
        h_dur=hv.dur,
        h_name=hv.name,
        h_tensor=hv.tensor,
        h_names=hv.names,
        h_tensors=hv.tensors,
        e_type=e_type[order],
        e_idx=e_idx[order],
        e_step=e_step[order],
        e_unit=e_unit[order],
    )


@dataclass
class _HorovodSlices:
    """Horovod's timeline as Chrome slices under rank 0 (``pid`` 0), threads from ``tid_base``."""

    tid: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    step: np.ndarray
    name: np.ndarray  # codes into names
    tensor: np.ndarray  # codes into tensors
    names: pa.Array
    tensors: pa.Array
    meta: list[dict[str, Any]]

    @classmethod
    def of(
        cls,
        acts: pd.DataFrame | None,
        t0: int,
        tid_base: int,
        step_start: np.ndarray,
        step_no: np.ndarray,
    ) -> _HorovodSlices:
        """``acts``: :func:`~hvtrace.analysis.hvd_timeline.aligned_activities`; ``step_start``,
        ``step_no``: rank 0's steps (times from ``t0``), to put each slice in a step."""
        from hvtrace.analysis.hvd_timeline import horovod_tracks

        t = horovod_tracks(acts if acts is not None else pd.DataFrame(), t0)
        z = np.zeros(0, np.int64)
        if not len(t):
            empty = pa.array([], pa.string())
            return cls(z, z, z, z, z, z, empty, empty, [])
        tid = tid_base + t.tensor_idx * 2 + t.depth + 1
        o = np.argsort(step_start, kind="stable")
        st, no = step_start[o], step_no[o]
        if len(st):
            at = np.maximum(np.searchsorted(st, t.start_ns, side="right") - 1, 0)
            step = no[at].astype(np.int64)
        else:
            step = np.zeros(len(t), np.int64)
        names, name = np.unique(np.asarray(t.activity, object).astype(str), return_inverse=True)
        meta: list[dict[str, Any]] = []
        for k in np.unique(tid - tid_base - 1).tolist():
            label = f"horovod {t.tensors[k // 2]}" + (" parts" if k % 2 else "")
            meta.append(_m("thread_name", 0, tid_base + k + 1, {"name": label}))
            meta.append(_m("thread_sort_index", 0, tid_base + k + 1, {"sort_index": 10**6 + k}))
        return cls(
            tid=tid,
            ts=t.start_ns,
            dur=t.end_ns - t.start_ns,
            step=step,
            name=name.astype(np.int64),
            tensor=t.tensor_idx,
            names=_json_strings(names.tolist()),
            tensors=_json_strings(t.tensors),
            meta=meta,
        )


def check_steps(steps: StepRange | tuple[int, int | None] | None) -> StepRange | None:
    """Return ``steps`` as a StepRange (None: every step); raise ValueError when malformed."""
    try:
        return StepRange.of(steps)
    except SelectionError:
        raise
    except (TypeError, ValueError):
        raise ValueError(f"steps must be a StepRange or (first, stop), not {steps!r}") from None


def steps_table(steps_df: pd.DataFrame) -> pd.DataFrame:
    """The analysis's per-step columns the timelines draw (``rank``, ``step``, ``start_ns``,
    ``comm_compute_ratio``), typed, rows without a rank, step or start dropped; raise
    ValueError when a column is missing."""
    need = {"rank", "step", "start_ns", "comm_compute_ratio"}
    missing = need - set(steps_df.columns)
    if missing:
        raise ValueError(f"steps_df lacks column(s) {', '.join(sorted(missing))}")
    cols = {c: pd.to_numeric(steps_df[c], errors="coerce") for c in need}
    ok = np.ones(len(steps_df), bool)
    for c in ("rank", "step", "start_ns"):
        ok &= cols[c].notna().to_numpy()
    out = {c: cols[c][ok].round().astype(np.int64).to_numpy() for c in ("rank", "step")}
    out["start_ns"] = cols["start_ns"][ok].astype("Int64").to_numpy(np.int64)  # keeps all ns
    ratio = cols["comm_compute_ratio"][ok].astype("Float64")
    out["comm_compute_ratio"] = ratio.to_numpy(np.float64, na_value=np.nan)
    return pd.DataFrame(out)


def lane_name(g: int, lane: int) -> str:
    """The name of lane ``lane`` of lane group ``g`` (``compute``, ``allreduce 0``, ``user 1``)."""
    name = LANE_GROUPS[g]
    if g == _G_ALLREDUCE:
        return f"{name} {lane}"
    return name if lane == 0 else f"{name} {lane}"


def _metadata(
    src: _Source,
    stride: int,
    slot_base: np.ndarray,
    nsub: np.ndarray,
    x_rank: np.ndarray,
    x_slot: np.ndarray,
) -> list[dict[str, Any]]:
    slot_names = [lane_name(g, k) for g in range(len(LANE_GROUPS)) for k in range(nsub[g])]
    used = np.unique(x_rank * stride + x_slot)
    slots: dict[int, set[int]] = {r: {int(slot_base[_G_STEP])} for r in src.ranks}
    for r, slot in zip((used // stride).tolist(), (used % stride).tolist()):
        slots.setdefault(r, set()).add(slot)
    meta: list[dict[str, Any]] = []
    for r in src.ranks:
        step_tid = r * stride + int(slot_base[_G_STEP]) + 1
        h = src.headers.get(r, {})
        labels = ", ".join(
            f"{k} {h[k]}" for k in ("device", "pid", "local_rank") if h.get(k) is not None
        )
        meta.append(_m("process_name", r, step_tid, {"name": f"rank {r} ({src.hosts[r]})"}))
        meta.append(_m("process_sort_index", r, step_tid, {"sort_index": r}))
        if labels:
            meta.append(_m("process_labels", r, step_tid, {"labels": labels}))
        for slot in sorted(slots[r]):
            tid = r * stride + slot + 1
            meta.append(_m("thread_name", r, tid, {"name": slot_names[slot]}))
            meta.append(_m("thread_sort_index", r, tid, {"sort_index": slot}))
    return meta


def _m(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _other_data(src: _Source, t0: int, steps: StepRange | None, nsub: np.ndarray) -> dict[str, Any]:
    from hvtrace import __version__

    other: dict[str, Any] = {
        "producer": f"hvtrace {__version__}",
        "run_id": src.run_id,
        "size": src.size,
        "hosts": {str(r): h for r, h in src.hosts.items()},
        "t0_ns": t0,
        "time_origin": "ts 0 is the run's earliest span; times are on rank 0's monotonic clock",
        "lanes": {LANE_GROUPS[g]: int(nsub[g]) for g in range(len(LANE_GROUPS)) if nsub[g]},
    }
    h0 = src.headers.get(0)
    if h0 and "wall_anchor_ns" in h0 and "mono_anchor_ns" in h0:
        other["t0_wall_ns"] = int(h0["wall_anchor_ns"]) + t0 - int(h0["mono_anchor_ns"])
    if src.clock:
        other["clock"] = src.clock
    if steps is not None:
        other["steps_selected"] = steps.to_list()
    if src.problems:
        other["problems"] = src.problems[:50]
    return other


# --------------------------------------------------------------------------------------------
# Strings, one batch of elements at a time


def _batch_strings(t: _Table, lo: int, hi: int) -> pa.Array:
    """Return the JSON text of elements ``lo:hi`` (in output order), each prefixed ``,\\n``."""
    et = t.e_type[lo:hi]
    ei = t.e_idx[lo:hi]
    by_type = np.argsort(et, kind="stable")
    parts: list[pa.Array] = []
    for typ, fn in (
        (_T_X, _x_strings),
        (_T_XAR, _xar_strings),
        (_T_SCALAR, _scalar_strings),
        (_T_RATIO, _ratio_strings),
        (_T_FLOW, _flow_strings),
        (_T_HVD, _hvd_strings),
    ):
        idx = ei[et == typ]
        if len(idx):
            parts.append(fn(t, idx))
    if not parts:
        return pa.array([], pa.string())
    grouped = pa.concat_arrays(parts)
    inverse = np.empty(len(by_type), np.int64)
    inverse[by_type] = np.arange(len(by_type))
    return grouped.take(pa.array(inverse))


_KIND_STR = pa.array(list(KINDS))


def _x_common(t: _Table, i: np.ndarray) -> list[Any]:
    return [
        ',\n{"name":',
        t.names.take(pa.array(t.x_name[i])),
        ',"cat":"',
        _KIND_STR.take(pa.array(t.x_kind[i])),
        '","ph":"X","ts":',
        *_dec(t.x_ts[i], 3),
        ',"dur":',
        *_dec(t.x_dur[i], 3),
        ',"pid":',
        _strs(t.x_pid[i]),
        ',"tid":',
        _strs(t.x_tid[i]),
        ',"args":{"step":',
        _strs(t.x_step[i]),
        ',"micro":',
        _strs(t.x_micro[i]),
    ]


def _x_strings(t: _Table, i: np.ndarray) -> pa.Array:
    return _join(*_x_common(t, i), ',"dur_ms":', *_dec(t.x_dur[i], 6), "}}")


def _xar_strings(t: _Table, i: np.ndarray) -> pa.Array:
    return _join(
        *_x_common(t, i),
        ',"tensor":',
        t.names.take(pa.array(t.x_name[i])),
        ',"bytes":',
        _strs(t.x_bytes[i]),
        ',"dtype":',
        t.dtypes.take(pa.array(t.x_dtype[i])),
        ',"collective":',
        _strs(t.x_coll[i]),
        ',"dur_ms":',
        *_dec(t.x_dur[i], 6),
        "}}",
    )


def _scalar_strings(t: _Table, i: np.ndarray) -> pa.Array:
    return _join(
        ',\n{"name":',
        t.names.take(pa.array(t.c_name[i])),
        ',"cat":"scalar","ph":"C","ts":',
        *_dec(t.c_ts[i], 3),
        ',"pid":',
        _strs(t.c_pid[i]),
        ',"tid":',
        _strs(t.c_tid[i]),
        ',"args":{"value":',
        _strs(t.c_value[i]),
        "}}",
    )


def _ratio_strings(t: _Table, i: np.ndarray) -> pa.Array:
    return _join(
        f',\n{{"name":"{RATIO_COUNTER}","cat":"ratio","ph":"C","ts":',
        *_dec(t.r_ts[i], 3),
        ',"pid":',
        _strs(t.r_pid[i]),
        ',"tid":',
        _strs(t.r_tid[i]),
        ',"args":{"ratio":',
        _strs(t.r_value[i]),
        "}}",
    )


def _flow_strings(t: _Table, i: np.ndarray) -> pa.Array:
    s, d = t.f_src[i], t.f_dst[i]
    fid = _strs(t.f_id[i])
    return _join(
        ',\n{"name":"allreduce","cat":"collective","ph":"s","id":',
        fid,
        ',"ts":',
        *_dec(t.x_ts[s], 3),
        ',"pid":',
        _strs(t.x_pid[s]),
        ',"tid":',
        _strs(t.x_tid[s]),
        '},\n{"name":"allreduce","cat":"collective","ph":"f","bp":"e","id":',
        fid,
        ',"ts":',
        *_dec(t.x_ts[d], 3),
        ',"pid":',
        _strs(t.x_pid[d]),
        ',"tid":',
        _strs(t.x_tid[d]),
        "}",
    )


def _hvd_strings(t: _Table, i: np.ndarray) -> pa.Array:
    return _join(
        ',\n{"name":',
        t.h_names.take(pa.array(t.h_name[i])),
        ',"cat":"horovod","ph":"X","ts":',
        *_dec(t.h_ts[i], 3),
        ',"dur":',
        *_dec(t.h_dur[i], 3),
        ',"pid":0,"tid":',
        _strs(t.h_tid[i]),
        ',"args":{"tensor":',
        t.h_tensors.take(pa.array(t.h_tensor[i])),
        "}}",
    )


def _batches(t: _Table, batch: int = _BATCH) -> Iterator[tuple[int, int]]:
    """Yield element ranges of about ``batch`` elements that start and end at step boundaries.

    A step of more than ``4 * batch`` elements is cut between units (Arrow strings have 32-bit
    offsets, so one batch's text must stay under 2 GiB).
    """
    n = t.n_elements
    if n == 0:
        return
    bounds = np.flatnonzero(np.diff(t.e_step)) + 1  # first element of each new step
    units = np.flatnonzero(np.diff(t.e_unit)) + 1
    lo = 0
    while lo < n:
        j = int(np.searchsorted(bounds, lo + batch, side="left"))
        hi = int(bounds[j]) if j < len(bounds) else n
        if hi - lo > 4 * batch:
            k = int(np.searchsorted(units, lo + batch, side="left"))
            hi = int(units[k]) if k < len(units) and units[k] < hi else hi
        yield lo, hi
        lo = hi


def _strings_in_order(t: _Table) -> Iterator[tuple[tuple[int, int], pa.Array]]:
    """Yield ``((lo, hi), text)`` per batch, in order; later batches are built meanwhile.

    Arrow's kernels release the GIL, so a few threads build batches while the caller writes.
    """
    ranges = list(_batches(t))
    workers = max(1, min(_WORKERS, len(ranges), os.cpu_count() or 1))
    if workers == 1:
        for r in ranges:
            yield r, _batch_strings(t, *r)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[tuple[int, int], Future[pa.Array]]] = deque()
        it = iter(ranges)
        for r in it:
            pending.append((r, pool.submit(_batch_strings, t, *r)))
            if len(pending) > workers:
                break
        while pending:
            r, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(_batch_strings, t, *nxt)))
            yield r, fut.result()


# --------------------------------------------------------------------------------------------
# Public API


def chrome_events(
    run_or_spans: Run | pd.DataFrame,
    steps: StepRange | tuple[int, int | None] | None = None,
    steps_df: pd.DataFrame | None = None,
    hosts: dict[int, str] | None = None,
    horovod: pd.DataFrame | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the trace events of a run (or of a span DataFrame plus ``hosts``) as dicts.

    Metadata events first, then every event in file order. The events are parsed back from the
    exact text :func:`write_chrome_trace` writes, so what a test sees is what a viewer reads.
    ``steps``: a :class:`~hvtrace.selection.StepRange`, or ``(first, stop)``, keeps steps
    ``first..stop-1`` (``stop`` None: to the end);
    ``steps_df`` (columns ``rank``, ``step``, ``start_ns``, ``comm_compute_ratio``) replaces the
    built-in :func:`comm_compute_ratio`; ``horovod``: Horovod's timeline on rank 0's clock
    (:func:`hvtrace.analysis.hvd_timeline.aligned_activities`), drawn under rank 0.
    """
    chunks = _Chunks(run_or_spans, check_steps(steps), steps_df, hosts, horovod)
    try:
        yield from (dict(m) for m in chunks.layout.meta)
        for t in chunks.tables():
            for lo, hi in _batches(t):
                arr = _batch_strings(t, lo, hi)
                for s in arr.to_pylist():
                    yield from json.loads("[" + s[2:] + "]")
    finally:
        chunks.close()


def write_chrome_trace(
    run: Run | pd.DataFrame,
    out_path: str | os.PathLike,
    steps: StepRange | tuple[int, int | None] | None = None,
    steps_df: pd.DataFrame | None = None,
    max_events: int = 1_000_000,
    max_bytes: int = 256 * 2**20,
    hosts: dict[int, str] | None = None,
    inputs: Iterable[str | os.PathLike] = (),
    horovod: pd.DataFrame | None = None,
) -> list[Path]:
    """Write the merged timeline of ``run`` as Chrome trace JSON; return the files written.

    ``out_path`` ending in ``.gz`` is gzip-compressed. When the events do not fit in one file of
    at most ``max_events`` events and ``max_bytes`` bytes (uncompressed JSON), the run is split
    by step ranges into ``NAME.part000.json``, ``NAME.part001.json``, ... (``out_path`` itself is
    then not written), each with all process and thread metadata. A single step larger than one
    file is cut between collectives. ``steps``, ``steps_df`` and ``horovod``: see
    :func:`chrome_events`.
    Raises :class:`~hvtrace.load.TraceError` when there is nothing to export.

    Files are written as :func:`hvtrace.export.output.open_output` writes: each part to an
    exclusive temporary file renamed when complete; a device or FIFO (``/dev/null``) written
    through (one part only); never over one of ``inputs`` (the run's trace files).
    """
    out = Path(out_path)
    inputs = list(inputs)
    kind = check_output(out, inputs)
    if kind != "stream":
        make_output_dir(out.parent)
    chunks = _Chunks(run, check_steps(steps), steps_df, hosts, horovod)
    try:
        lay = chunks.layout
        writer = _PartWriter(
            out, lay.meta, lay.other, max_events, max_bytes, stream=kind == "stream", inputs=inputs
        )
        try:
            for t in chunks.tables():
                for (lo, hi), arr in _strings_in_order(t):
                    writer.add_batch(arr, t.e_type[lo:hi], t.e_step[lo:hi], t.e_unit[lo:hi])
            return writer.finish()
        except BaseException:
            writer.abort()
            raise
    finally:
        chunks.close()


# --------------------------------------------------------------------------------------------
# Writing parts


def _part_paths(out: Path, n: int) -> list[Path]:
    if n == 1:
        return [out]
    name = out.name
    for suffix in (".json.gz", ".json"):
        if name.endswith(suffix):
            stem, suf = name[: -len(suffix)], suffix
            break
    else:
        stem, suf = (name[:-3], ".gz") if name.endswith(".gz") else (name, "")
    return [out.with_name(f"{stem}.part{i:03d}{suf}") for i in range(n)]


class _PartWriter:
    """Greedily fills parts with whole steps (or, for a step too big for one part, whole units)."""

    def __init__(
        self,
        out: Path,
        meta: list[dict[str, Any]],
        other: dict[str, Any],
        max_events: int,
        max_bytes: int,
        stream: bool = False,
        inputs: list[Any] | None = None,
    ) -> None:
        self.out = out
        self.stream = stream  # a device or FIFO: written through, one part only
        self.inputs = inputs or []
        self.gz = out.name.endswith(".gz")
        sep = (",\n").join(json.dumps(m, separators=(",", ":")) for m in meta)
        self.head = ('{"traceEvents":[\n' + sep).encode()
        self.other = other
        worst = dict(other, part=10**6, steps=[-(2**31), -(2**31)])
        self.budget_e = max_events - len(meta)
        self.budget_b = max_bytes - len(self.head) - len(self._tail(worst)) - 16
        if self.budget_e < 2:
            raise ValueError(
                f"max_events={max_events} leaves no room: each part repeats {len(meta)} "
                "metadata events"
            )
        if self.budget_b < 1024:
            raise ValueError(
                f"max_bytes={max_bytes} leaves no room: each part repeats "
                f"{max_bytes - self.budget_b} bytes of metadata"
            )
        self.tmp: list[Path] = []
        self.f: BinaryIO | None = None
        self.cur_e = self.cur_b = 0
        self.step_lo: int | None = None
        self.step_hi: int | None = None
        self.pending: tuple[int, int] | None = None
        self.arr: pa.Array | None = None
        self.data: memoryview | None = None
        self.offsets: np.ndarray | None = None
        self.oversized_elements = 0

    @staticmethod
    def _tail(other: dict[str, Any]) -> bytes:
        return (
            '\n],\n"displayTimeUnit":"ms",\n"otherData":'
            + json.dumps(other, separators=(",", ":"), ensure_ascii=False)
            + "}\n"
        ).encode()

    # -- files
    def _open(self) -> None:
        if self.stream:
            if self.tmp:
                raise TraceError(
                    f"{self.out}: the timeline needs more than one part, which a device or FIFO "
                    "cannot hold; write it to a file, or cut it with --steps"
                )
            self.tmp.append(self.out)
            raw = open(self.out, "wb")  # noqa: SIM115 - closed in _close
        else:
            # exclusive, unpredictable name beside the output: a planted link is never followed
            fd, name = tempfile.mkstemp(prefix=f".{self.out.name}.", suffix=".tmp",
                                        dir=self.out.parent)  # fmt: skip
            self.tmp.append(Path(name))
            os.fchmod(fd, output_mode(self.out))  # mkstemp makes 0600
            raw = os.fdopen(fd, "wb")
        self.f = (
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=_GZIP_LEVEL, mtime=0)
            if self.gz
            else raw
        )
        self._raw = raw
        self.f.write(self.head)
        self.cur_e = self.cur_b = 0
        self.step_lo = self.step_hi = None

    def _close(self) -> None:
        if self.f is None:
            return
        self._flush()
        other = dict(self.other, part=len(self.tmp) - 1, steps=[self.step_lo, self.step_hi])
        self.f.write(self._tail(other))
        if self.f is not self._raw:
            self.f.close()  # the gzip trailer, into the file below
        self._raw.flush()
        if not self.stream:  # synced before it is renamed into place, as open_output does
            os.fsync(self._raw.fileno())
        self._raw.close()
        self.f = None

    def _flush(self) -> None:
        if self.pending is None or self.f is None:
            return
        i, j = self.pending
        self.f.write(self.data[int(self.offsets[i]) : int(self.offsets[j])])
        self.pending = None

    def _write(self, i: int, j: int, n_events: int, n_bytes: int, s_lo: int, s_hi: int) -> None:
        if self.f is None:
            self._open()
        if self.pending is not None and self.pending[1] == i:
            self.pending = (self.pending[0], j)
        else:
            self._flush()
            self.pending = (i, j)
        self.cur_e += n_events
        self.cur_b += n_bytes
        self.step_lo = s_lo if self.step_lo is None else min(self.step_lo, s_lo)
        self.step_hi = s_hi if self.step_hi is None else max(self.step_hi, s_hi)

    def _place(self, i: int, j: int, e: int, b: int, s_lo: int, s_hi: int) -> bool:
        """Put elements i:j in the current part, or a new one; False if they fit in none."""
        if (
            self.f is not None
            and self.cur_e + e <= self.budget_e
            and self.cur_b + b <= self.budget_b
        ):
            self._write(i, j, e, b, s_lo, s_hi)
            return True
        if e <= self.budget_e and b <= self.budget_b:
            self._close()
            self._write(i, j, e, b, s_lo, s_hi)
            return True
        return False

    # -- input
    def add_batch(
        self, arr: pa.Array, e_type: np.ndarray, e_step: np.ndarray, e_unit: np.ndarray
    ) -> None:
        self._flush()
        n = len(arr)
        if n == 0:
            return
        self.arr = arr
        bufs = arr.buffers()
        self.offsets = np.frombuffer(bufs[1], np.int32, count=arr.offset + n + 1)[arr.offset :]
        self.data = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
        nbytes = np.diff(self.offsets).astype(np.int64)
        weight = np.where(e_type == _T_FLOW, 2, 1).astype(np.int64)
        cuts = np.flatnonzero(np.diff(e_step)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [n]])
        ev = np.add.reduceat(weight, starts)
        by = np.add.reduceat(nbytes, starts)
        steps = e_step[starts]
        for a, b, e, bb, st in zip(
            starts.tolist(), ends.tolist(), ev.tolist(), by.tolist(), steps.tolist()
        ):
            if not self._place(a, b, e, bb, st, st):
                self._split_step(a, b, weight, nbytes, e_unit, st)
        self._flush()

    def _split_step(
        self, a: int, b: int, weight: np.ndarray, nbytes: np.ndarray, unit: np.ndarray, st: int
    ) -> None:
        u = unit[a:b]
        cuts = np.flatnonzero(np.diff(u)) + 1 + a
        starts = np.concatenate([[a], cuts])
        ends = np.concatenate([cuts, [b]])
        ev = np.add.reduceat(weight, starts)
        by = np.add.reduceat(nbytes, starts)
        for ua, ub, e, bb in zip(starts.tolist(), ends.tolist(), ev.tolist(), by.tolist()):
            if self._place(ua, ub, e, bb, st, st):
                continue
            for k in range(ua, ub):  # a unit larger than a part: element by element
                e1, b1 = int(weight[k]), int(nbytes[k])
                if not self._place(k, k + 1, e1, b1, st, st):
                    self.oversized_elements += 1
                    self._close()
                    self._write(k, k + 1, e1, b1, st, st)

    def finish(self) -> list[Path]:
        if self.f is None and not self.tmp:
            self._open()  # no events at all: metadata only
        self._close()
        if self.oversized_elements:
            log.warning(
                "%d event(s) are larger than max_bytes allows; written alone in their part",
                self.oversized_elements,
            )
        if self.stream:
            self.tmp = []
            return [self.out]
        paths = _part_paths(self.out, len(self.tmp))
        for final in paths:
            if check_output(final, self.inputs) == "stream":
                raise TraceError(f"{final}: is a device or FIFO, not a file for a part")
        for tmp, final in zip(self.tmp, paths):
            os.replace(tmp, final)
        self.tmp = []
        n = len(paths)
        more = _part_paths(self.out, max(n + 1, 2))
        stale = [p for p in (more[0], more[n], self.out) if p not in paths and p.exists()]
        if stale:
            log.warning("%s is left from an earlier export, not part of this one", stale[0])
        return paths

    def abort(self) -> None:
        try:
            if self.f is not None:
                self.f.close()
                if self.f is not self._raw:
                    self._raw.close()
        finally:
            self.f = None
            for p in self.tmp if not self.stream else []:
                try:
                    p.unlink()
                except OSError:
                    pass
