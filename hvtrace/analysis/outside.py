"""Collectives issued outside the optimizer: metric allreduces, broadcasts, SyncBatchNorm, join.

The recorder stores each as a span of kind ``collective`` named ``"<op>|<phase>|<tensor name>"``
(:mod:`hvtrace.record.collectives`). Per (rank, step) the step table counts their time as
communication (:func:`hvtrace.analysis.steps.step_rows`); here they are matched across ranks
and summed by source:

- the engine's per-rank pass reduces them to one row per (step, name, occurrence) (the k-th call
  of a name in a step on each rank: how Horovod pairs them), with the earliest and latest
  enqueue, the rank that enqueued last, and sums over ranks of enqueue time, time in flight and
  time blocked (:data:`hvtrace.analysis.engine.OUTSIDE_PARTIAL_SQL`); :func:`merge_partials`
  combines groups' partials;
- :func:`outside_table` sums them per source (op, phase, name) over the analyzed steps.

A rank that enqueues last in most occurrences of a collective holds the others in it: they wait
from their own enqueue until its: ``wait_for_last_ms``, the mean over the other ranks.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pandas as pd

#: Columns of a partial (and of the merged table).
PARTIAL_COLUMNS: Final[tuple[str, ...]] = (
    "step",
    "name",
    "occ",
    "n_spans",
    "bytes",
    "first_start_ns",
    "last_start_ns",
    "last_rank",
    "sum_start_ns",
    "sum_flight_ns",
    "sum_blocked_ns",
)
#: Columns of :func:`outside_table`, in order.
OUTSIDE_COLUMNS: Final[tuple[str, ...]] = (
    "op",
    "phase",
    "name",
    "count",
    "count_per_step",
    "ms_per_step",
    "blocked_ms_per_step",
    "step_share",
    "bytes",
    "ranks",
    "late_rank",
    "late_share",
    "wait_for_last_ms",
    "run_share",
    "wait_share",
)


def merge_partials(parts: list[pd.DataFrame | None]) -> pd.DataFrame:
    """Combine partials of several groups of ranks into one row per (step, name, occ)."""
    frames = [p for p in parts if p is not None and len(p)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_dtype(c)) for c in PARTIAL_COLUMNS})
    df = pd.concat(frames, ignore_index=True)
    if len(frames) == 1:
        return df[list(PARTIAL_COLUMNS)].reset_index(drop=True)
    keys = ["step", "name", "occ"]
    g = df.groupby(keys, sort=True)
    out = g.agg(
        n_spans=("n_spans", "sum"),
        bytes=("bytes", "max"),
        first_start_ns=("first_start_ns", "min"),
        last_start_ns=("last_start_ns", "max"),
        sum_start_ns=("sum_start_ns", "sum"),
        sum_flight_ns=("sum_flight_ns", "sum"),
        sum_blocked_ns=("sum_blocked_ns", "sum"),
    )
    last = df.loc[g["last_start_ns"].idxmax().to_numpy(), [*keys, "last_rank"]]
    out = out.join(last.set_index(keys))
    return out.reset_index()[list(PARTIAL_COLUMNS)]


def _dtype(col: str) -> str:
    return "object" if col == "name" else ("float64" if col.startswith("sum_") else "int64")


def split_name(name: str) -> tuple[str, str, str]:
    """``"<op>|<phase>|<tensor>"`` -> ``(op, phase, tensor)`` (a malformed name: op ``?``)."""
    parts = str(name).split("|", 2)
    if len(parts) < 3:
        return "?", "?", str(name)
    return parts[0], parts[1], parts[2]


def outside_table(
    outside: pd.DataFrame, analyzed_steps: pd.DataFrame, n_ranks: int
) -> pd.DataFrame:
    """Per source (op, phase, tensor name), over the analyzed steps (``analyzed_steps``: the
    step table's analyzed rows), most blocked time first:

    - ``count``: occurrences in the analyzed steps (each counted once, not once per rank);
      ``count_per_step``: per analyzed step;
    - ``ms_per_step``: time in flight per step, averaged over ranks (from enqueue to the result
      observed); ``blocked_ms_per_step``: the training thread's time blocked in it;
      ``step_share``: that per-step average's share of the median step (for a call made once
      every ten steps, a tenth of what one call blocks); ``run_share``: the blocked time's share
      of the run's time (the analyzed steps' total, averaged over ranks);
    - ``bytes``: the largest contribution of one rank; ``ranks``: the most ranks that issued one
      occurrence (fewer than the run's ranks: some rank never issued it);
    - ``late_rank``: the rank that enqueued last most often, ``late_share`` how often (needs 2
      ranks); ``wait_for_last_ms``: median over occurrences of how long the other ranks waited
      on average for the last one (its enqueue minus theirs); ``wait_share``: the share of a
      waiting rank's time in it that was waiting for the last rank to issue it, over the
      occurrences issued by 2 ranks or more: their waits over those waits plus the call itself
      (the mean blocked time less the wait's share of it, (n-1)/n of the wait: what the last
      rank was blocked); 0..1, NaN when none.
    """
    if outside.empty or analyzed_steps.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in OUTSIDE_COLUMNS})
    steps = np.unique(analyzed_steps["step"].to_numpy())
    o = outside[outside["step"].isin(steps)]
    if o.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in OUTSIDE_COLUMNS})
    n_steps = len(steps)
    step_ms = float(analyzed_steps["step_ns"].median()) / 1e6
    mean_step_ms = float(analyzed_steps["step_ns"].mean()) / 1e6
    n = o["n_spans"].to_numpy(np.float64)
    o = o.assign(
        flight_ms=o["sum_flight_ns"].to_numpy(np.float64) / n / 1e6,
        blocked_ms=o["sum_blocked_ns"].to_numpy(np.float64) / n / 1e6,
        # mean over the other ranks of (last enqueue - theirs): the last rank's own term is 0
        wait_ms=(o["last_start_ns"].to_numpy(np.float64) * n - o["sum_start_ns"].to_numpy())
        / np.maximum(n - 1, 1)
        / 1e6,
    )
    rows = []
    for name, g in o.groupby("name", sort=False):
        op, phase, tensor = split_name(str(name))
        multi = g[g["n_spans"] >= 2]
        late_rank, late_share, wait = -1, float("nan"), float("nan")
        wait_share = float("nan")
        if len(multi):
            counts = multi["last_rank"].value_counts()
            late_rank = int(counts.index[0])
            late_share = float(counts.iloc[0]) / len(multi)
            wait = float(multi["wait_ms"].median())
            # per occurrence: the others waited w on average, and all were blocked b on
            # average, so the call itself (the last rank's blocked time) took b - w (k-1)/k
            k = multi["n_spans"].to_numpy(np.float64)
            w = np.maximum(multi["wait_ms"].to_numpy(np.float64), 0.0)
            own = np.maximum(multi["blocked_ms"].to_numpy(np.float64) - w * (k - 1) / k, 0.0)
            if np.isfinite(w).all() and np.isfinite(own).all() and w.sum() + own.sum() > 0:
                wait_share = float(w.sum() / (w.sum() + own.sum()))
        blocked = float(g["blocked_ms"].sum()) / n_steps
        rows.append(
            {
                "op": op,
                "phase": phase,
                "name": tensor,
                "count": len(g),
                "count_per_step": len(g) / n_steps,
                "ms_per_step": float(g["flight_ms"].sum()) / n_steps,
                "blocked_ms_per_step": blocked,
                "step_share": blocked / step_ms if step_ms > 0 else float("nan"),
                "bytes": int(g["bytes"].max()),
                "ranks": int(min(g["n_spans"].max(), n_ranks)),
                "late_rank": late_rank,
                "late_share": late_share,
                "wait_for_last_ms": wait,
                "run_share": blocked / mean_step_ms if mean_step_ms > 0 else float("nan"),
                "wait_share": wait_share,
            }
        )
    out = pd.DataFrame(rows, columns=list(OUTSIDE_COLUMNS))
    return out.sort_values("blocked_ms_per_step", ascending=False, kind="stable").reset_index(
        drop=True
    )
