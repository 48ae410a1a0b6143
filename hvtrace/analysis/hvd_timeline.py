"""Horovod's own timeline (``HOROVOD_TIMELINE``), read and merged with hvtrace's analysis.

Horovod's coordinator (rank 0) writes a Chrome-trace JSON array: per tensor (a ``pid``, named
by a ``process_name`` metadata event such as ``allreduce.net.0.weight``) a ``NEGOTIATE_<OP>``
activity (from when the coordinator saw the first rank ready to when every rank was), with one
instant event per rank named by the rank when it became ready (only for negotiations outside
Horovod's response cache: the first time a tensor is reduced, or every time with
``HOROVOD_CACHE_CAPACITY=0``), then the operation (``ALLREDUCE``, ...) with nested activities:
the fusion-buffer copies (``MEMCPY_IN_FUSION_BUFFER``, ``MEMCPY_OUT_FUSION_BUFFER``) and the
transfer itself (``GLOO_ALLREDUCE``, ``NCCL_ALLREDUCE``, ``MPI_ALLREDUCE``, ...). Timestamps are
µs since the timeline started; the first metadata event holds that start as µs since the epoch.

:func:`read_timeline` reads such a file, also one cut off by a killed job (no closing bracket, a
half-written last event: everything before it is kept and the result says it is partial).
:func:`merge` puts it on rank 0's clock (the epoch start through rank 0's header anchors:
``CLOCK_REALTIME`` and ``CLOCK_MONOTONIC`` sampled together) and sums it per tensor: the
**negotiation** (waiting until the last rank was ready, and which rank that was) and the
**transfer**. It also compares the ranks' readiness order with hvtrace's own arrival (each rank's
enqueue of the same tensor, same occurrence).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

#: Most bytes of a timeline read (a larger file is read up to this much and marked partial).
MAX_BYTES: Final = 2 << 30
#: Activities that are the transfer itself (nested in the operation).
_TRANSFER = re.compile(r"^(GLOO|NCCL|MPI|CCL|DDL|ADASUM|ROCM|GPU)_")
#: Horovod notes a rank ready when its coordinator receives the rank's request, in cycles of
#: ``HOROVOD_CYCLE_TIME`` (a few ms): which rank was last is only comparable with hvtrace's
#: arrival when the ranks' enqueues are at least this far apart (``clear_*`` in the comparison).
CLEAR_SPREAD_NS: Final = 5_000_000
#: Longest tensor name kept.
MAX_NAME: Final = 300
#: Latest event time taken (µs since the timeline's start: about 31 years); a later, negative,
#: NaN or infinite ``ts`` (JSON allows ``NaN``, ``Infinity``, ``1e300``) is implausible.
MAX_TS_US: Final = 10**15


def _ts_us(value: Any) -> int | None:
    """An event's ``ts`` as whole µs, or None when it is not a plausible time."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return int(value) if 0 <= value <= MAX_TS_US else None


def _pid(value: Any) -> int | str | None:
    """An event's ``pid`` when it can name a track (an integer or a string), else None."""
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


class TimelineError(ValueError):
    """The file is not a Horovod timeline (the message names the file and what is wrong)."""


@dataclass
class Timeline:
    """A Horovod timeline, as read: ``activities`` (``tensor``, ``occ``: the k-th negotiation of
    that tensor, ``activity``, ``depth``: 0 for the negotiation and the operation, 1 for their
    parts, ``start_us``, ``end_us``) and ``ready`` (``tensor``, ``occ``, ``rank``, ``ts_us``: when
    each rank was ready, where Horovod recorded it). ``start_epoch_us``: the timeline's start.
    """

    path: Path
    start_epoch_us: int | None
    activities: pd.DataFrame
    ready: pd.DataFrame
    events: int
    partial: str = ""  # why the file was not read whole ("" when it was)
    problems: list[str] = field(default_factory=list)


def read_timeline(path: str | Path, max_bytes: int = MAX_BYTES) -> Timeline:
    """Read a Horovod timeline file; raise :class:`TimelineError` when it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise TimelineError(f"{path}: cannot read: {exc.strerror or exc}") from None
    partial = ""
    if len(raw) > max_bytes:
        raw, partial = raw[:max_bytes], f"read the first {max_bytes} bytes only"
    text = raw.decode("utf-8", errors="replace")
    events, cut = _decode_events(text)
    if cut and not partial:
        partial = "cut off (the job was killed?): " + cut
    if not events and not text.lstrip().startswith("["):
        raise TimelineError(f"{path}: not a Horovod timeline (no JSON array of events)")
    return _build(path, events, partial)


def _decode_events(text: str) -> tuple[list[dict], str]:
    """The events of a JSON array, as many as parse: ``(events, why it stopped early or "")``."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return [], "no opening bracket"
    i += 1
    n = len(text)
    out: list[dict] = []
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return out, "no closing bracket"
        if text[i] == "]":
            return out, ""
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out, f"an incomplete event after {len(out)} events"
        except (ValueError, RecursionError):  # an integer too long, nesting too deep
            return out, f"an event that cannot be decoded after {len(out)} events"
        if isinstance(obj, dict):
            out.append(obj)


def _build(path: Path, events: list[dict], partial: str) -> Timeline:
    """Pair each tensor's begin/end events into activities; collect the ranks' readiness."""
    names: dict[Any, str] = {}
    start_epoch = None
    problems: list[str] = []
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            if "name" in args and _pid(e.get("pid")) is not None:
                names[e.get("pid")] = str(args["name"])[:MAX_NAME]
            v = args.get("start_time_since_epoch_in_micros")
            if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 62:
                start_epoch = v
    stacks: dict[Any, list[tuple[str, int]]] = {}
    occ: dict[Any, int] = {}
    acts: list[tuple[str, int, str, int, int, int]] = []
    ready: list[tuple[str, int, int, int]] = []
    bad = implausible = backwards = 0
    for e in events:
        ph, pid = e.get("ph"), _pid(e.get("pid"))
        if not isinstance(ph, str) or ph not in ("B", "E", "X") or pid not in names:
            continue
        ts = _ts_us(e.get("ts"))
        if ts is None:  # NaN, Infinity, 1e300, negative, a string: left out, counted
            implausible += 1
            continue
        tensor = names[pid]
        stack = stacks.setdefault(pid, [])
        if ph == "B":
            name = str(e.get("name", "?"))[:64]
            if name.startswith("NEGOTIATE_") and not stack:
                occ[pid] = occ.get(pid, 0) + 1
            stack.append((name, ts))
        elif ph == "E":
            if not stack:
                bad += 1
                continue
            name, t0 = stack.pop()
            if ts < t0:  # an end before its begin: kept out of every figure
                backwards += 1
                continue
            acts.append((tensor, occ.get(pid, 0), name, len(stack), t0, ts))
        elif stack and stack[-1][0].startswith("NEGOTIATE_"):  # a rank's readiness
            try:
                rank = int(str(e.get("name")))
            except ValueError:
                continue
            if 0 <= rank < 1 << 20:
                ready.append((tensor, occ.get(pid, 0), rank, ts))
    open_ = sum(len(s) for s in stacks.values())
    if bad:
        problems.append(f"{bad} end events without a begin")
    if implausible:
        problems.append(
            f"{implausible} events with an implausible time (not a number from 0 to "
            f"{MAX_TS_US:.0e} µs: NaN, Infinity, negative?) left out"
        )
    if backwards:
        problems.append(f"{backwards} activities ending before they began left out")
    if open_ and not partial:
        problems.append(f"{open_} activities never ended")
    a = pd.DataFrame(acts, columns=["tensor", "occ", "activity", "depth", "start_us", "end_us"])
    r = pd.DataFrame(ready, columns=["tensor", "occ", "rank", "ts_us"])
    return Timeline(path, start_epoch, a, r, len(events), partial, problems)


def find_timeline(run_dir: Path, run_id: str) -> Path | None:
    """The Horovod timeline of a run: the one hvtrace started (``horovod-timeline-RUNID.json``),
    else a ``*.json`` file in the run directory that starts like one (a user's
    ``HOROVOD_TIMELINE`` pointed there). Symbolic links are not followed."""
    own = run_dir / f"horovod-timeline-{run_id}.json"
    if own.is_file() and not own.is_symlink():
        return own
    try:
        cands = sorted(p for p in run_dir.glob("*.json") if p.is_file() and not p.is_symlink())
    except OSError:
        return None
    for p in cands:
        try:
            with open(p, "rb") as f:
                head = f.read(512).decode("utf-8", errors="replace")
        except OSError:
            continue
        if head.lstrip().startswith("[") and "start_time_since_epoch_in_micros" in head:
            return p
    return None


def _tensor_key(horovod_name: str) -> str:
    """hvtrace's tensor name for Horovod's (``allreduce.net.0.weight`` -> ``net.0.weight``)."""
    for prefix in ("allreduce.", "grouped_allreduce.", "adasum."):
        if horovod_name.startswith(prefix):
            return horovod_name[len(prefix) :]
    return horovod_name


def merge(
    tl: Timeline,
    anchors: dict[str, int] | None,
    rank_starts: pd.DataFrame | Callable[[pd.DataFrame], pd.DataFrame] | None,
) -> dict:
    """Sum the timeline per tensor and compare its readiness with hvtrace's arrival.

    ``anchors``: rank 0's header ``mono_anchor_ns`` / ``wall_anchor_ns`` (None: the timeline
    stays on its own clock and is not compared); ``rank_starts``: hvtrace's gradient allreduce
    enqueues, columns ``rank``, ``name``, ``occ`` (k-th of that tensor on that rank),
    ``start_ns`` (rank 0's clock), or a function that returns them for the (``name``, ``occ``)
    pairs it is given (those whose last-ready rank Horovod noted). Returns the JSON-ready
    ``horovod_timeline`` section: ``merged``, ``file``, ``events``, ``partial``, ``clock``,
    ``offset_ns`` (add to a timeline µs × 1000 to get rank 0's monotonic ns), ``tensors`` (per
    tensor: ``name``, ``count``, ``negotiate_ms`` and ``transfer_ms`` medians, ``op_ms``,
    ``memcpy_ms``, ``last_rank`` and ``last_share`` where Horovod recorded readiness),
    ``arrival`` (``compared``, ``agree_share``: the share of negotiations whose last rank is
    hvtrace's last-arriving rank too; ``clear_compared`` and ``clear_agree_share``: the same
    over those whose enqueues were at least :data:`CLEAR_SPREAD_NS` apart; ``horovod_last`` and
    ``hvtrace_last``: rank -> count) and ``queue_ms`` (median time from rank 0's enqueue to
    Horovod's coordinator seeing it ready).
    """
    out: dict[str, Any] = {
        "merged": True,
        "file": tl.path.name,
        "events": tl.events,
        "partial": tl.partial,
        "problems": list(tl.problems),
    }
    offset = None
    if anchors and tl.start_epoch_us is not None:
        offset = (
            int(anchors["mono_anchor_ns"])
            - int(anchors["wall_anchor_ns"])
            + tl.start_epoch_us * 1000
        )
        out["clock"] = "aligned to rank 0 through its clock anchors (realtime and monotonic)"
    else:
        out["clock"] = "not aligned (no start time in the timeline, or no rank 0 header)"
    out["offset_ns"] = offset
    a = tl.activities.copy()
    a["dur_ms"] = (a["end_us"] - a["start_us"]) / 1e3
    a["name"] = a["tensor"].map(_tensor_key)
    neg = a[(a["depth"] == 0) & a["activity"].str.startswith("NEGOTIATE_")]
    ops = a[(a["depth"] == 0) & ~a["activity"].str.startswith("NEGOTIATE_")]
    xfer = a[(a["depth"] >= 1) & a["activity"].str.match(_TRANSFER.pattern)]
    mem = a[(a["depth"] >= 1) & a["activity"].str.startswith("MEMCPY_")]
    ready = tl.ready.copy()
    ready["name"] = ready["tensor"].map(_tensor_key)
    last = _last_ready(ready)
    if callable(rank_starts):
        wanted = last[["name", "occ"]].drop_duplicates()
        rank_starts = rank_starts(wanted) if len(wanted) else None
    rows = []
    for name, g in neg.groupby("name", sort=False):
        lr = last[last["name"] == name]
        top = lr["rank"].value_counts()
        rows.append(
            {
                "name": name,
                "op": str(g["activity"].iloc[0]).removeprefix("NEGOTIATE_").lower(),
                "count": len(g),
                "negotiate_ms": float(g["dur_ms"].median()),
                "transfer_ms": _median(xfer, name),
                "op_ms": _median(ops, name),
                "memcpy_ms": _median(
                    mem.groupby(["name", "occ"])["dur_ms"].sum().reset_index(), name
                ),
                "last_rank": int(top.index[0]) if len(top) else None,
                "last_share": float(top.iloc[0] / len(lr)) if len(top) else None,
            }
        )
    rows.sort(key=lambda r: -(r["negotiate_ms"] * r["count"]))
    out["tensors"] = rows
    out["arrival"], out["queue_ms"] = _compare(last, ready, rank_starts, offset)
    return out


def _median(df: pd.DataFrame, name: str) -> float | None:
    v = df.loc[df["name"] == name, "dur_ms"]
    return float(v.median()) if len(v) else None


def _last_ready(ready: pd.DataFrame) -> pd.DataFrame:
    """Per (tensor, occurrence) with 2 or more ranks' readiness: the last rank and its time."""
    if ready.empty:
        return pd.DataFrame(columns=["name", "occ", "rank", "ts_us"])
    g = ready.groupby(["name", "occ"])
    many = g["rank"].transform("size") >= 2
    r = ready[many]
    if r.empty:
        return pd.DataFrame(columns=["name", "occ", "rank", "ts_us"])
    idx = r.groupby(["name", "occ"])["ts_us"].idxmax()
    return r.loc[idx.to_numpy(), ["name", "occ", "rank", "ts_us"]].reset_index(drop=True)


def _compare(
    last: pd.DataFrame, ready: pd.DataFrame, starts: pd.DataFrame | None, offset: int | None
) -> tuple[dict, float | None]:
    """Horovod's last-ready rank against hvtrace's last enqueue, per (tensor, occurrence)."""
    if starts is None or starts.empty or last.empty:
        return {"compared": 0}, None
    hv = starts.sort_values("start_ns")
    g = hv.groupby(["name", "occ"])
    idx = g["start_ns"].idxmax()
    hv_last = hv.loc[idx.to_numpy(), ["name", "occ", "rank"]].rename(columns={"rank": "hv_rank"})
    n_ranks = g["rank"].nunique().rename("n").reset_index()
    spread = (g["start_ns"].max() - g["start_ns"].min()).rename("spread_ns").reset_index()
    m = last.merge(hv_last, on=["name", "occ"]).merge(n_ranks, on=["name", "occ"])
    m = m.merge(spread, on=["name", "occ"])
    m = m[m["n"] >= 2]
    queue = None
    if offset is not None:
        r0 = ready[ready["rank"] == 0].merge(
            starts[starts["rank"] == 0][["name", "occ", "start_ns"]], on=["name", "occ"]
        )
        if len(r0):
            lag = (r0["ts_us"].to_numpy(np.float64) * 1000 + offset - r0["start_ns"]) / 1e6
            queue = float(np.median(lag))
    if m.empty:
        return {"compared": 0}, queue
    agree = (m["rank"] == m["hv_rank"]).to_numpy()
    clear = m["spread_ns"].to_numpy(np.float64) >= CLEAR_SPREAD_NS
    return (
        {
            "compared": len(m),
            "agree_share": float(agree.mean()),
            "clear_compared": int(clear.sum()),
            "clear_agree_share": float(agree[clear].mean()) if clear.any() else None,
            "horovod_last": {str(k): int(v) for k, v in m["rank"].value_counts().items()},
            "hvtrace_last": {str(k): int(v) for k, v in m["hv_rank"].value_counts().items()},
        },
        queue,
    )


def run_section(run: Any, sources: list, explicit: str | Path | None = None) -> dict:
    """The ``horovod_timeline`` section of a run's analysis ({} when it has none).

    ``explicit``: a timeline file given by the user (``hvtrace analyze --horovod-timeline``),
    else the run's own (:func:`find_timeline`). Problems reading it are in the section's
    ``problems`` (an unreadable file: ``merged`` false and the reason)."""
    path = Path(explicit) if explicit is not None else find_timeline(run.run_dir, run.run_id)
    if path is None:
        return {}
    try:
        tl = read_timeline(path)
    except TimelineError as exc:
        return {"merged": False, "file": path.name, "problems": [str(exc)]}
    h0 = run.files[0].header if 0 in run.files else None
    anchors = (
        {"mono_anchor_ns": h0["mono_anchor_ns"], "wall_anchor_ns": h0["wall_anchor_ns"]}
        if h0
        else None
    )
    out = merge(tl, anchors, lambda wanted: _hvtrace_starts(sources, wanted))
    out["path"] = str(path)
    return out


def _hvtrace_starts(sources: list, wanted: pd.DataFrame) -> pd.DataFrame:
    """hvtrace's enqueue of the (tensor, occurrence) pairs ``wanted`` on every rank, on rank 0's
    clock (one DuckDB query over the rank files: only those pairs come back)."""
    from hvtrace.analysis.engine import KIND_CODE_SQL, Engine, span_offsets
    from hvtrace.load import span_relation

    with Engine(threads=1) as eng:
        src, params, registered = span_relation(eng.con, sources, eng._names)
        eng.con.register("hv_wanted", wanted.astype({"occ": np.int64}))
        try:
            df = eng.con.execute(
                f"""WITH a AS (SELECT rank, step, name::VARCHAR AS name, start_ns,
                        row_number() OVER (PARTITION BY rank, name ORDER BY start_ns) AS occ
                    FROM ({src}) WHERE kind = 'allreduce')
                SELECT a.rank, a.step, a.name, a.occ, a.start_ns FROM a
                JOIN hv_wanted w ON a.name = w.name AND a.occ = w.occ""",
                params,
            ).df()
            # the spans of those (rank, step) cells, for the one alignment rule's anchors
            eng.con.register("hv_cells", df[["rank", "step"]].drop_duplicates())
            cells = eng.con.execute(
                f"""SELECT s.rank, s.step, {KIND_CODE_SQL} AS k, s.start_ns FROM ({src}) s
                JOIN hv_cells c ON s.rank = c.rank AND s.step = c.step""",
                params,
            ).df()
        finally:
            eng.con.unregister("hv_wanted")
            eng.con.unregister("hv_cells")
            eng._unregister(registered)
    _, offsets = span_offsets(
        sources, cells["rank"], cells["step"], cells["start_ns"], cells["k"].to_numpy()
    )
    off = df[["rank", "step"]].astype(np.int64).merge(offsets, on=["rank", "step"], how="left")
    df["start_ns"] = df["start_ns"].to_numpy(np.int64) - off["off_ns"].fillna(0).to_numpy(np.int64)
    return df.drop(columns=["step"])


def aligned_activities(path: str | Path, offset_ns: int) -> pd.DataFrame:
    """The timeline's activities on rank 0's clock (``offset_ns`` from :func:`merge`): columns
    ``tensor``, ``depth``, ``activity``, ``start_ns``, ``end_ns`` (for the merged timeline)."""
    a = read_timeline(path).activities
    return pd.DataFrame(
        {
            "tensor": a["tensor"],
            "depth": a["depth"],
            "activity": a["activity"],
            "start_ns": a["start_us"].to_numpy(np.int64) * 1000 + int(offset_ns),
            "end_ns": a["end_us"].to_numpy(np.int64) * 1000 + int(offset_ns),
        }
    )


@dataclass
class HorovodTracks:
    """Horovod's activities laid out as timeline tracks (for the exports, which only draw them):
    per tensor, in order of its first activity, a track ``horovod <tensor>`` (depth 0: the
    negotiation and the operation) and a child track ``parts`` (depth 1: fusion copies, the
    transfer). ``tensors``: the tensor names in that order; per slice ``tensor_idx``, ``depth``,
    ``activity``, ``start_ns`` and ``end_ns``, sorted by track then time. On one track a slice
    starts at the previous one's end at the earliest, so none overlap (times before 0 are drawn
    at 0)."""

    tensors: list[str]
    tensor_idx: np.ndarray
    depth: np.ndarray
    activity: list[str]
    start_ns: np.ndarray
    end_ns: np.ndarray

    def __len__(self) -> int:
        return len(self.start_ns)


def horovod_tracks(acts: pd.DataFrame, origin_ns: int = 0) -> HorovodTracks:
    """Lay out :func:`aligned_activities` (times minus ``origin_ns``) as :class:`HorovodTracks`."""
    if acts is None or acts.empty:
        z = np.zeros(0, np.int64)
        return HorovodTracks([], z, z.copy(), [], z.copy(), z.copy())
    first = acts.groupby("tensor", sort=False)["start_ns"].min().sort_values(kind="stable")
    tensors = [str(t) for t in first.index]
    idx = pd.Series(np.arange(len(tensors)), index=first.index)
    t_idx = idx.loc[acts["tensor"]].to_numpy(np.int64)
    depth = np.minimum(acts["depth"].to_numpy(np.int64), 1)
    begin = np.maximum(acts["start_ns"].to_numpy(np.int64) - int(origin_ns), 0)
    end = np.maximum(acts["end_ns"].to_numpy(np.int64) - int(origin_ns), begin)
    order = np.lexsort((begin, depth, t_idx))
    t_idx, depth, begin, end = t_idx[order], depth[order], begin[order], end[order]
    activity = acts["activity"].astype(str).to_numpy()[order].tolist()
    # per track, each slice starts at the latest end before it at the earliest
    track = t_idx * 2 + depth
    new = np.ones(len(track), bool)
    new[1:] = track[1:] != track[:-1]
    prev_end = np.concatenate([[0], end[:-1]])
    prev_end[new] = 0
    starts = np.flatnonzero(new)
    run_max = np.empty_like(prev_end)
    for a, b in zip(starts.tolist(), np.append(starts[1:], len(track)).tolist()):
        run_max[a:b] = np.maximum.accumulate(prev_end[a:b])  # one track (a few per tensor)
    begin = np.maximum(begin, run_max)
    end = np.maximum(end, begin)
    return HorovodTracks(tensors, t_idx, depth, activity, begin, end)
