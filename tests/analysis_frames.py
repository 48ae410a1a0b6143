"""Span DataFrames for analysis tests: tiny hand-made frames and a self-consistent synthetic run.

:func:`frame` builds a span table (the columns of :func:`hvtrace.load_run`'s ``Run.spans``) from
short row tuples. :func:`synth_spans` simulates a synchronous data-parallel run: every rank runs
input (with a ``data`` user span inside), forward, backward (gradients ready evenly through it,
each enqueued for allreduce), wait, update; a tensor's allreduce completes only after every rank
enqueued it, and everyone's ``synchronize()`` returns when the last one completes, so a slow rank
makes the others wait exactly as Horovod does.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from hvtrace.format.schema import DTYPES, KINDS

MS = 1_000_000
COLUMNS = ["rank", "step", "micro", "kind", "name", "start_ns", "end_ns", "bytes", "dtype"]


def span_row(
    rank: int,
    step: int,
    kind: str,
    s_ms: float,
    e_ms: float,
    name: str | None = None,
    value: float = math.nan,
    *,
    nbytes: int = 4,
    flags: int = 0,
    cpu: float = math.nan,
    runq: float = math.nan,
) -> dict:
    """One span as a dict of the span table's columns (times in ms, from 0), for frames built
    row by row: ``name`` defaults to ``kind``; ``cpu`` / ``runq``: its counters (ns)."""
    return {
        "rank": rank,
        "step": step,
        "kind": kind,
        "name": name or kind,
        "start_ns": int(s_ms * MS),
        "end_ns": int(e_ms * MS),
        "bytes": nbytes,
        "value": value,
        "flags": flags,
        "cpu_ns": cpu,
        "runq_ns": runq,
    }


def frame(rows: list[tuple], *, extra: bool = True) -> pd.DataFrame:
    """Build a span table from ``(rank, step, kind, name, start_ns, end_ns[, bytes])`` tuples."""
    recs = []
    for r in rows:
        rank, step, kind, name, s, e, *rest = r
        nb = rest[0] if rest else 0
        recs.append(
            {
                "rank": rank,
                "step": step,
                "micro": 0,
                "kind": kind,
                "name": name,
                "start_ns": s,
                "end_ns": e,
                "bytes": nb,
                "dtype": "float32" if kind == "allreduce" else "",
            }
        )
    return _finish(pd.DataFrame(recs, columns=COLUMNS))


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    df["rank"] = df["rank"].astype(np.int32)
    df["step"] = df["step"].astype(np.int32)
    df["micro"] = df["micro"].astype(np.int16)
    df["kind"] = pd.Categorical(df["kind"], categories=list(KINDS))
    df["name"] = df["name"].astype("category")
    df["start_ns"] = df["start_ns"].astype(np.int64)
    df["end_ns"] = df["end_ns"].astype(np.int64)
    df["bytes"] = df["bytes"].astype(np.int64)
    df["dtype"] = pd.Categorical(df["dtype"], categories=list(DTYPES))
    df["value"] = math.nan
    df["flags"] = np.uint8(0)
    return df


def synth_spans(
    ranks: int = 4,
    steps: int = 30,
    tensors: int = 4,
    slow_ranks: tuple[int, ...] = (),
    slow_phase: str = "forward",
    slow_ms: float = 30.0,
    noise: float = 0.05,
    seed: int = 0,
    tensor_bytes: int = 4 << 20,
    comm_ms: float = 2.0,
    shift_ms: dict[int, float] | None = None,
    scale: float = 1.0,
    slow_from_step: int = 0,
) -> pd.DataFrame:
    """Return the spans of a simulated run (times in ns on one clock).

    Phases per rank and step (ms, each multiplied by a jitter ~ N(1, noise)): input 2 (the user
    span ``data`` covers most of it), forward 8, backward 16, update 1. ``slow_ranks`` get
    ``slow_ms`` more in ``slow_phase`` (``input`` lands inside ``data``; ``log`` adds a user
    span ``log`` of that length inside the input gap). ``shift_ms`` {rank: ms} delays only the
    recorded times of a rank (as a clock error or a late wake-up would), not its work. ``scale``
    multiplies the base durations (not the slowdown). ``slow_from_step``: the slowdown begins at
    this step (a fault that appears mid-run).
    """
    rng = np.random.default_rng(seed)
    slow = np.zeros(ranks)
    for r in slow_ranks:
        slow[r] = slow_ms * MS
    shift = np.zeros(ranks, np.int64)
    for r, ms in (shift_ms or {}).items():
        shift[r] = int(ms * MS)
    names = [f"layer{tensors - 1 - k}.weight" for k in range(tensors)]
    comm = int(comm_ms * scale * MS)
    start = np.full(ranks, 1_000_000 * MS, np.int64)
    rows: list[tuple] = []
    slow_all = slow
    for s in range(steps):
        slow = slow_all if s >= slow_from_step else np.zeros(ranks)
        jit = rng.normal(1.0, noise, (ranks, 4)).clip(0.5, 1.5)
        d_in = (2 * scale * MS * jit[:, 0]).astype(np.int64)
        d_log = np.zeros(ranks, np.int64)
        if slow_phase == "input":
            d_in += slow.astype(np.int64)
        if slow_phase == "log":
            d_log = slow.astype(np.int64)
            d_in += d_log
        d_fw = (8 * scale * MS * jit[:, 1]).astype(np.int64) + (
            slow.astype(np.int64) if slow_phase == "forward" else 0
        )
        d_bw = (16 * scale * MS * jit[:, 2]).astype(np.int64) + (
            slow.astype(np.int64) if slow_phase == "backward" else 0
        )
        d_up = (1 * scale * MS * jit[:, 3]).astype(np.int64) + (
            slow.astype(np.int64) if slow_phase == "update" else 0
        )
        fw0 = start + d_in
        bw0 = fw0 + d_fw
        bw1 = bw0 + d_bw
        ready = bw0[:, None] + (d_bw[:, None] * np.arange(1, tensors + 1)[None, :]) // tensors
        done = np.empty(tensors, np.int64)
        prev = 0
        for k in range(tensors):
            prev = max(prev, int(ready[:, k].max())) + comm
            done[k] = prev
        sync_end = np.maximum(bw1, done[-1]) + 30_000
        upd_end = sync_end + d_up
        for r in range(ranks):
            o = int(shift[r])
            st = int(start[r]) + o
            rows.append((r, s, "input", "input", st, int(fw0[r]) + o))
            data_end = int(fw0[r]) + o - 50_000
            data_start = st + 50_000 + int(d_log[r])
            rows.append((r, s, "user", "data", data_start, data_end))
            if d_log[r]:
                rows.append((r, s, "user", "log", st + 20_000, st + 20_000 + int(d_log[r])))
            rows.append((r, s, "forward", "forward", int(fw0[r]) + o, int(bw0[r]) + o))
            rows.append((r, s, "backward", "backward", int(bw0[r]) + o, int(bw1[r]) + o))
            for k in range(tensors):
                rows.append(
                    (r, s, "allreduce", names[k], int(ready[r, k]) + o, int(done[k]) + o,
                     tensor_bytes)
                )  # fmt: skip
            rows.append((r, s, "wait", "synchronize", int(bw1[r]) + o, int(sync_end[r]) + o))
            rows.append((r, s, "update", "update", int(sync_end[r]) + o, int(upd_end[r]) + o))
            rows.append((r, s, "step", "step", st, int(upd_end[r]) + o))
        start = upd_end
    return frame(rows)
