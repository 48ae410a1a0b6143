"""Allreduce sizes, times and bandwidth, per tensor and per step.

What "time" means here, truthfully: an allreduce cannot start before the *last* rank enqueued its
tensor, and each rank only records when it *observed* the result (on the CPU, by polling: an upper
bound on completion). So one collective (same step, same tensor on every rank) takes

    time_ns = min over ranks of observed end - max over ranks of enqueue time

and its bandwidth follows the nccl-tests definitions: ``algbw = bytes / time`` and
``busbw = algbw * 2 (n - 1) / n`` for ``n`` ranks. Horovod also fuses several tensors into one
buffer, so a tensor's time includes its fusion partners': per-tensor bandwidth is a lower bound.

Bandwidths are in GB/s (10**9 bytes per second), which is the same number as bytes per ns.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from hvtrace.analysis.steps import analyzed_steps
from hvtrace.format.schema import COLLECTIVE_KEY

#: Printed with bandwidth numbers: what they are and why they are lower bounds.
BANDWIDTH_CAVEAT = (
    "allreduce end times are when each rank observed completion (upper bounds on the CPU), and "
    "Horovod fuses tensors, so per-tensor bandwidth is a lower bound"
)


#: Columns of :func:`hvtrace.analysis.engine.collective_table`.
COLLECTIVE_COLUMNS = [
    "step",
    "name",
    "n_ranks",
    "bytes",
    "dtype",
    "first_start_ns",
    "last_start_ns",
    "end_ns",
    "time_ns",
    "spread_ns",
    "algbw_gbps",
]


def bus_factor(n_ranks: int | np.ndarray) -> float | np.ndarray:
    """Return the nccl-tests allreduce bus-bandwidth factor ``2 (n - 1) / n`` (0 for n <= 1)."""
    n = np.asarray(n_ranks, dtype=np.float64)
    f = np.where(n > 1, 2.0 * (n - 1.0) / np.maximum(n, 1.0), 0.0)
    return float(f) if f.ndim == 0 else f


def _collective_times(out: pd.DataFrame) -> pd.DataFrame:
    """Add ``time_ns``, ``spread_ns`` and ``algbw_gbps`` to a collective table (in place)."""
    t = (out["end_ns"] - out["last_start_ns"]).astype("float64")
    out["time_ns"] = t.where(t > 0)
    out["spread_ns"] = out["last_start_ns"] - out["first_start_ns"]
    out["algbw_gbps"] = out["bytes"] / out["time_ns"]
    return out


def finish_collectives(partials: pd.DataFrame, grouped: bool = False) -> pd.DataFrame:
    """Return :func:`hvtrace.analysis.engine.collective_table` from per-group partial aggregates.

    ``partials``: one row per (step, name) per group of ranks, with ``n_spans`` (allreduce spans
    of that tensor in the group), ``bytes`` and ``dtype`` (max), ``first_start_ns`` /
    ``last_start_ns`` (earliest / latest enqueue) and ``end_ns`` (earliest observed completion),
    times on rank 0's clock. Partials of any grouping of ranks combine to the same table.
    ``grouped``: ``partials`` already holds one row per (step, name), sorted by them (what the
    engine's accumulator gives): the same table without grouping them again (a group of one row
    aggregates to that row), which on a run of millions of (step, tensor) rows saves a copy
    of the table and a sort of its names.
    """
    cols = COLLECTIVE_COLUMNS
    if partials.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    if grouped:
        keys = partials[list(COLLECTIVE_KEY)].isna().any(axis=1)
        if keys.any():  # as grouping would: a row without its key is left out
            partials = partials[~keys]
        out = partials.rename(columns={"n_spans": "n_ranks"}).reset_index(drop=True)
    else:
        g = partials.groupby(list(COLLECTIVE_KEY), sort=True, observed=True)
        out = g.agg(
            n_ranks=("n_spans", "sum"),
            bytes=("bytes", "max"),
            dtype=("dtype", "max"),
            first_start_ns=("first_start_ns", "min"),
            last_start_ns=("last_start_ns", "max"),
            end_ns=("end_ns", "min"),
        ).reset_index()
    out = out.astype(
        {
            "step": np.int64,
            "n_ranks": np.int64,
            "bytes": np.int64,
            "first_start_ns": np.int64,
            "last_start_ns": np.int64,
            "end_ns": np.int64,
        }
    )
    out["name"] = out["name"].astype(str)
    out["dtype"] = out["dtype"].fillna("").astype(str)
    return _collective_times(out)[cols]


def tensor_table(
    collectives: pd.DataFrame, size: int, skip_steps: int = 1, complete_only: bool = True
) -> pd.DataFrame:
    """Return one row per tensor name: size, median time and bandwidth over the analyzed steps.

    ``collectives``: :func:`collective_table` output; ``size``: ranks in the run (``n`` of the
    bus-bandwidth factor). Steps before ``skip_steps`` are left out (unless nothing would remain);
    with ``complete_only`` so are collectives that not every rank recorded.

    Columns: ``name``, ``dtype``, ``bytes`` (median), ``steps``, ``time_ms`` (median of
    :func:`collective_table`'s ``time_ns``), ``spread_ms`` (median arrival spread), ``algbw_gbps``
    = bytes / median time, ``busbw_gbps`` = algbw x 2(n-1)/n. Sorted by ``time_ms``, largest first.
    """
    cols = [
        "name",
        "dtype",
        "bytes",
        "steps",
        "time_ms",
        "spread_ms",
        "algbw_gbps",
        "busbw_gbps",
    ]
    c = collectives
    if c.empty:
        return pd.DataFrame({k: pd.Series(dtype=float) for k in cols})
    # the rows kept, and only the columns used, copied (a long run has millions of rows)
    keep = (c["step"] >= skip_steps).to_numpy()
    if not keep.any():
        keep = np.ones(len(c), dtype=bool)
    if complete_only:
        full = keep & (c["n_ranks"] >= size).to_numpy()
        keep = full if full.any() else keep
    need = ["name", "dtype", "bytes", "time_ns", "spread_ns"]
    c = c[need] if keep.all() else c.loc[keep, need]
    g = c.groupby("name", sort=False)
    out = pd.DataFrame(
        {
            "dtype": g["dtype"].first(),
            "bytes": g["bytes"].median(),
            "steps": g.size(),
            "time_ms": g["time_ns"].median() / 1e6,
            "spread_ms": g["spread_ns"].median() / 1e6,
        }
    )
    out["algbw_gbps"] = out["bytes"] / (out["time_ms"] * 1e6)
    out["busbw_gbps"] = out["algbw_gbps"] * bus_factor(size)
    out = out.reset_index().sort_values(["time_ms", "bytes"], ascending=False, na_position="last")
    return out[cols].reset_index(drop=True)


def step_comm_table(steps: pd.DataFrame, size: int) -> pd.DataFrame:
    """Return per step the aggregate communication: bytes, time and bandwidth.

    ``steps``: :func:`hvtrace.analysis.steps.step_table` output. Columns: ``step``, ``bytes``
    (median over ranks of the bytes allreduced in the step), ``comm_ns`` (the shortest allreduce
    union over ranks: the rank that waited least for the others, usually the last to arrive),
    ``algbw_gbps`` = bytes / comm_ns and ``busbw_gbps`` = algbw x 2(n-1)/n.
    """
    s = steps[steps["n_allreduce"] > 0]
    if s.empty:
        return pd.DataFrame(
            {k: pd.Series(dtype=float) for k in ("step", "bytes", "comm_ns", "algbw_gbps")}
            | {"busbw_gbps": pd.Series(dtype=float)}
        )
    g = s.groupby("step", sort=True)
    out = pd.DataFrame(
        {
            "bytes": g["allreduce_bytes"].median(),
            "comm_ns": g["allreduce_ns"].min().astype("float64"),
        }
    )
    out["algbw_gbps"] = out["bytes"] / out["comm_ns"].where(out["comm_ns"] > 0)
    out["busbw_gbps"] = out["algbw_gbps"] * bus_factor(size)
    return out.reset_index()


def comm_summary(
    steps: pd.DataFrame, step_comm: pd.DataFrame, collectives: pd.DataFrame, skip_steps: int = 1
) -> dict[str, float]:
    """Return run-level communication numbers (medians over the analyzed steps).

    Keys: ``tensors_per_step``, ``tensor_bytes_median``, ``bytes_per_step``, ``comm_ms``,
    ``algbw_gbps``, ``busbw_gbps`` (the per-step aggregates of :func:`step_comm_table`).
    """
    a = analyzed_steps(steps, skip_steps)
    kept = set(a["step"].unique())
    sc = step_comm[step_comm["step"].isin(kept)] if len(step_comm) else step_comm
    col = (
        collectives.loc[collectives["step"].isin(kept), "bytes"]
        if len(collectives)
        else collectives.get("bytes", pd.Series(dtype=float))
    )
    return {
        "tensors_per_step": float(a["n_allreduce"].median()) if len(a) else float("nan"),
        "tensor_bytes_median": float(col.median()) if len(col) else float("nan"),
        "bytes_per_step": float(sc["bytes"].median()) if len(sc) else float("nan"),
        "comm_ms": float(sc["comm_ns"].median() / 1e6) if len(sc) else float("nan"),
        "algbw_gbps": float(sc["algbw_gbps"].median()) if len(sc) else float("nan"),
        "busbw_gbps": float(sc["busbw_gbps"].median()) if len(sc) else float("nan"),
    }
