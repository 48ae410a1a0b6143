"""Where scaling is lost (``hvtrace scaling RUN...``): runs of one job at different world sizes.

Horovod's usual set-up keeps each rank's batch as it is and adds ranks (weak scaling): with
perfect scaling the step time stays the same and the throughput grows with the ranks. So the
**efficiency** of a run of ``n`` ranks against the smallest run (``n0`` ranks) is ``T(n0) /
T(n)``, the mean step per (rank, step) of each (:mod:`hvtrace.analysis.diff`'s parts), and its
throughput ``n / T(n)`` relative to ``n0 / T(n0)``. Runs whose per-rank batch differs are not weak
scaling: hvtrace cannot see the batch, and the report says what it assumed.

**Where the time went**: ``T(n) - T(n0)`` is split into parts that add up to it exactly, each
the change of a mean per (rank, step):

- ``exposed communication``: the wait of the rank that was last (it waited for nobody, so its
  wait in ``synchronize()`` and in collectives outside the optimizer is communication not hidden
  behind compute: :func:`hvtrace.analysis.steps.step_summary`'s ``exposed_ms``);
- ``waiting for the last rank``: the rest of every rank's wait (stragglers, and rank-to-rank
  spread);
- ``compute`` (forward, backward), split by cause where CPU time was measured: more CPU time
  (``work``: the same work costing more CPU, on a slower or shared core), waiting for a CPU
  (``contention``: more busy threads than cores, or neighbours) and ``blocked``;
- ``input``, ``update`` and ``other`` (everything else in the step).

**The next size**: the step at twice the largest world size ``n``, predicted from a fit of the
cost of one allreduce message, ``time = alpha(n) + 2(n-1)/n x bytes / busbw`` with ``alpha(n) =
2(n-1) x latency`` (a ring allreduce of ``n`` ranks has ``2(n-1)`` transfer steps, each paying a
latency, and moves ``2(n-1)/n`` of the bytes per rank; :func:`fit_message_cost`). A message is
what Horovod sent at once (:func:`messages`): the tensors of a step whose allreduces completed
together, as Horovod fuses them (up to ``HOROVOD_FUSION_THRESHOLD`` bytes, of one dtype, ready
within one ``HOROVOD_CYCLE_TIME``). The latency and bus bandwidth are fitted by least squares
over the messages of every run of two ranks or more (its distinct message sizes at each world
size), so with runs at two world sizes both the bytes and the transfer steps vary. The largest
run's steps are then replayed (:func:`_replay`) with every message taking its measured time plus
the model's growth from ``n`` to ``2n`` ranks, one message after another from when its tensors
were ready (as measured): growth that the backward hid stays hidden, the rest lengthens the step.
Where the fit cannot be trusted (fewer than :data:`FIT_POINTS_MIN` distinct (world size, bytes)
points, no growth with the bytes, R^2 under :data:`FIT_R2_MIN`) the prediction falls back to a
ring's bytes alone: the largest run's allreduce time grown by ``((2n-1)/(2n)) / ((n-1)/n)``, all
of it exposed (an upper bound), and says why. The assumptions are listed with it
(:attr:`Scaling.assumptions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pandas as pd

from hvtrace.analysis.bandwidth import bus_factor
from hvtrace.analysis.model import Analysis

#: The loss's parts, in report order.
LOSS_PARTS: Final[tuple[str, ...]] = (
    "exposed_comm",
    "waiting_for_last",
    "compute_work",
    "compute_contention",
    "compute_blocked",
    "compute",
    "input",
    "update",
    "other",
)
#: What each part is called in the report.
LOSS_LABELS: Final[dict[str, str]] = {
    "exposed_comm": "exposed communication",
    "waiting_for_last": "waiting for the last rank",
    "compute_work": "compute: more CPU time",
    "compute_contention": "compute: waiting for a CPU",
    "compute_blocked": "compute: blocked",
    "compute": "compute (cause not measured)",
    "input": "input",
    "update": "update",
    "other": "other",
}

#: Horovod 0.28.1's defaults where the header's ``horovod_env`` has no ``HOROVOD_FUSION_THRESHOLD``
#: / ``HOROVOD_CYCLE_TIME``: 128 MiB and 1 ms (``horovod/common/operations.cc``; its
#: docs/tensor-fusion.rst still says 64 MB).
FUSION_THRESHOLD_DEFAULT_BYTES: Final[int] = 128 * 1024 * 1024
CYCLE_TIME_DEFAULT_MS: Final[float] = 1.0
#: The message-cost fit needs this many distinct (world size, message bytes) points: two
#: unknowns, and one point more to check them against.
FIT_POINTS_MIN: Final[int] = 3
#: Below this R^2 (weighted, over the fit's points) the fit is not used for the prediction.
FIT_R2_MIN: Final[float] = 0.5
#: Tensors of one step observed complete within this of the one before them completed together
#: (one message, or several that the recorder cannot tell apart): hvtrace looks at the in-flight
#: allreduces at most every ``HVTRACE_POLL_US`` (200 µs by default) during the backward, and
#: ``synchronize()`` observes the handles of one message microseconds apart.
COMPLETION_GAP_NS: Final[int] = 200_000
#: Columns of :func:`messages`.
MESSAGE_COLUMNS: Final[tuple[str, ...]] = (
    "step",
    "end_ns",
    "ready_ns",
    "bytes",
    "tensors",
    "messages",
    "time_ns",
)


@dataclass
class Scaling:
    """Runs of one job at several world sizes (:func:`scaling`); times in ms.

    ``runs``: one row per run, smallest world size first: ``size``, ``run_id``, ``run_dir``,
    ``step_ms`` (mean per rank and step), ``median_step_ms``, ``efficiency``, ``speedup`` (the
    throughput against the smallest run), ``loss_ms`` (``step_ms`` less the smallest run's) and
    one column per :data:`LOSS_PARTS` (ms; they add up to ``loss_ms``), ``comm_ms`` (median
    allreduce time per step), ``busbw_gbps``. ``prediction`` (empty with one run or a largest
    run of one rank), for twice the largest world size: ``size``, ``step_ms``, ``efficiency``,
    ``comm_growth_ms`` (the growth of the allreduce time per step), ``exposed_growth_ms`` (the
    part of it that lengthens the step), ``step_ms_all_exposed`` (the step with all of it
    exposed: an upper bound), ``model`` (``latency``: the fitted message cost; ``bytes``: a
    ring's bytes alone, the fallback), the fit (:func:`fit_message_cost`: ``latency_us`` per
    ring transfer step, ``busbw_gbps`` net of the latency, each with its 95 % ``..._range``,
    ``r2``, ``fit_sizes``, ``fit_points``, ``fit_messages``, ``fit_notes``; None where not
    fitted), ``messages_per_step``, ``fusion_threshold_bytes`` and ``cycle_time_ms`` of the
    largest run. ``assumptions`` and ``notes``: what the reader must know.
    """

    runs: pd.DataFrame
    prediction: dict[str, Any]
    assumptions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _means(a: Analysis) -> dict[str, float]:
    """Run ``a``'s mean per (rank, step) of each loss part's ingredient, ms."""
    r = a.analyzed

    def mean(col: str) -> float:
        return float(r[col].mean() / 1e6) if col in r.columns and r[col].notna().any() else 0.0

    out = {
        "step": mean("step_ns"),
        "input": mean("input_ns"),
        "update": mean("update_ns"),
        "wait": mean("wait_ns") + mean("collective_wait_ns"),
        "compute": mean("forward_ns") + mean("backward_ns") + mean("compute_ns"),
    }
    ps = a.run_steps
    out["exposed"] = float(ps["exposed_ms"].mean()) if "exposed_ms" in ps and len(ps) else 0.0
    if not np.isfinite(out["exposed"]):
        out["exposed"] = 0.0
    cpu = runq = 0.0
    measured = True
    for p in ("forward", "backward", "compute"):
        col = f"{p}_ns"
        if col not in r.columns or r[col].sum() == 0:
            continue
        c, q = f"{p}_cpu_ns", f"{p}_runq_ns"
        if c not in r.columns or q not in r.columns or r[c].isna().all():
            measured = False
            break
        cpu += float(r[c].mean() / 1e6)
        runq += float(r[q].mean() / 1e6)
    out["cpu"], out["runq"], out["causes"] = cpu, runq, float(measured)
    out["other"] = out["step"] - out["input"] - out["update"] - out["wait"] - out["compute"]
    return out


def _loss(m: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``m``'s step less ``base``'s, in :data:`LOSS_PARTS` (they add up to it)."""
    out = dict.fromkeys(LOSS_PARTS, 0.0)
    out["exposed_comm"] = m["exposed"] - base["exposed"]
    out["waiting_for_last"] = (m["wait"] - m["exposed"]) - (base["wait"] - base["exposed"])
    d_compute = m["compute"] - base["compute"]
    if m["causes"] and base["causes"]:
        out["compute_work"] = m["cpu"] - base["cpu"]
        out["compute_contention"] = m["runq"] - base["runq"]
        out["compute_blocked"] = d_compute - out["compute_work"] - out["compute_contention"]
    else:
        out["compute"] = d_compute
    for p in ("input", "update", "other"):
        out[p] = m[p] - base[p]
    return out


def ring_factor(n: int) -> float:
    """The share of the bytes a ring allreduce moves per rank: ``2(n-1)/n`` (the bus-bandwidth
    factor, :func:`hvtrace.analysis.bandwidth.bus_factor`; 0 for one rank)."""
    return float(bus_factor(n))


def fusion_settings(env: dict[str, str] | None) -> tuple[int, float]:
    """``(HOROVOD_FUSION_THRESHOLD bytes, HOROVOD_CYCLE_TIME ms)`` from a run's ``horovod_env``,
    Horovod's defaults where unset or unreadable (:data:`FUSION_THRESHOLD_DEFAULT_BYTES`,
    :data:`CYCLE_TIME_DEFAULT_MS`). A threshold of 0 turns fusion off."""
    env = env or {}
    threshold, cycle = FUSION_THRESHOLD_DEFAULT_BYTES, CYCLE_TIME_DEFAULT_MS
    try:
        threshold = max(0, int(float(env["HOROVOD_FUSION_THRESHOLD"])))
    except (KeyError, TypeError, ValueError, OverflowError):
        pass
    try:
        v = float(env["HOROVOD_CYCLE_TIME"])
        cycle = v if math.isfinite(v) and v >= 0 else cycle
    except (KeyError, TypeError, ValueError):
        pass
    return threshold, cycle


def _empty_messages() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="float64") for c in MESSAGE_COLUMNS})


def messages(a: Analysis) -> pd.DataFrame:
    """The allreduce messages of run ``a``'s analyzed steps, from its per-tensor collectives
    (:attr:`Analysis.collectives`: per step and tensor, the last rank's enqueue and the first
    observed completion, on one clock), tensors every rank recorded.

    One row per group of tensors of one step that completed together: each observed within
    :data:`COMPLETION_GAP_NS` of the one before it (``synchronize()`` observes the handles of a
    fused message one after another, microseconds apart; looks during the backward are at least
    that far apart). Horovod fused them, or sent them one after another between two looks. So a
    group holds at least one message per ``HOROVOD_FUSION_THRESHOLD`` bytes (at most one per
    tensor; one per tensor with the threshold 0), one per dtype, and a new one where a tensor
    became ready more than ``HOROVOD_CYCLE_TIME`` after both the tensor before it and the
    previous group's completion (an idle background thread had sent the earlier ones already).

    Columns: ``step``, ``end_ns`` (its first observed completion), ``ready_ns`` (its last
    tensor's enqueue by the last rank), ``bytes``, ``tensors``, ``messages`` (the count above),
    ``time_ns`` (from when it could start, ``ready_ns`` or the previous group's completion, to
    ``end_ns``: what it took with the background thread free). Sorted by step and completion.
    """
    c = a.collectives
    if c is None or c.empty or a.size < 2:
        return _empty_messages()
    steps = a.analyzed["step"].unique()
    keep = c["step"].isin(steps) & (c["n_ranks"] >= a.size) & c["time_ns"].notna()
    c = c.loc[keep, ["step", "end_ns", "last_start_ns", "bytes", "dtype"]]
    if c.empty:
        return _empty_messages()
    c = c.sort_values(["step", "end_ns"], kind="stable")
    step = c["step"].to_numpy()
    end = c["end_ns"].to_numpy().astype("float64")
    first = np.ones(len(c), dtype=bool)
    first[1:] = (step[1:] != step[:-1]) | (end[1:] - end[:-1] > COMPLETION_GAP_NS)
    gid = np.cumsum(first) - 1
    g_end, g_step = end[first], step[first]
    g_prev = np.full(len(g_end), np.nan)  # the previous group's completion, in the same step
    g_prev[1:] = np.where(g_step[1:] == g_step[:-1], g_end[:-1], np.nan)
    # within a group, by readiness: a new message where a tensor was ready more than a cycle
    # after the tensor before it and after the previous group's completion
    c = c.assign(gid=gid).sort_values(["gid", "last_start_ns"], kind="stable")
    gid = c["gid"].to_numpy()
    ready = c["last_start_ns"].to_numpy().astype("float64")
    starts = np.ones(len(c), dtype=bool)
    starts[1:] = gid[1:] != gid[:-1]
    threshold, cycle_ms = fusion_settings(a.horovod_env)
    before = np.concatenate([[np.nan], ready[:-1]])
    since = ready - np.fmax(before, np.nan_to_num(g_prev[gid], nan=-np.inf))
    segment = np.cumsum(starts | (since > cycle_ms * 1e6))
    sub = pd.DataFrame(
        {"gid": gid, "segment": segment, "dtype": c["dtype"].astype(str).to_numpy(),
         "bytes": c["bytes"].to_numpy()}
    )  # fmt: skip
    per = sub.groupby(["gid", "segment", "dtype"], sort=False)["bytes"].agg(["sum", "size"])
    if threshold > 0:
        k = np.minimum(np.maximum(np.ceil(per["sum"] / threshold), 1), per["size"])
    else:
        k = per["size"].astype("float64")
    g = sub.groupby("gid", sort=True)
    out = pd.DataFrame(
        {
            "step": g_step.astype(np.int64),
            "end_ns": g_end,
            "ready_ns": pd.Series(ready).groupby(gid).max().to_numpy(),
            "bytes": g["bytes"].sum().to_numpy().astype("float64"),
            "tensors": g.size().to_numpy().astype(np.int64),
            "messages": k.groupby(level="gid").sum().sort_index().to_numpy().astype(np.int64),
        }
    )
    out["time_ns"] = g_end - np.fmax(out["ready_ns"].to_numpy(), g_prev)
    out = out[out["time_ns"] > 0]  # observed before its last tensor was enqueued: clocks off
    return out[list(MESSAGE_COLUMNS)].reset_index(drop=True)


#: Two-sided 95 % quantiles of Student's t by degrees of freedom (the next lower one is used).
_T975: Final[dict[int, float]] = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980,
}  # fmt: skip


def _t975(df: int) -> float:
    """Student's t quantile for a 95 % interval with ``df`` degrees of freedom (conservative:
    the table's next lower ``df``; 1.96 past 120)."""
    if df > 120:
        return 1.96
    return _T975[max(k for k in _T975 if k <= max(df, 1))]


def _no_fit(notes: list[str], **known: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "usable": False,
        "latency_us": None,
        "latency_us_range": None,
        "busbw_gbps": None,
        "busbw_gbps_range": None,
        "r2": None,
        "fit_sizes": [],
        "fit_points": 0,
        "fit_messages": 0,
        "fit_notes": notes,
    }
    out.update(known)
    return out


def fit_message_cost(runs: list[tuple[int, pd.DataFrame]]) -> dict[str, Any]:
    """Fit ``time = 2(n-1) x latency + 2(n-1)/n x bytes / busbw`` to allreduce messages.

    ``runs``: ``(world size, messages(a))`` of each run; those of two ranks or more are used,
    their single messages (``messages == 1``). Each distinct (world size, bytes) is one point,
    its time the median of those messages' ``time_ns`` (robust to a stalled step), weighted by
    its share of its run's messages (each run weighs the same). Weighted least squares without
    an intercept on the columns ``2(n-1)`` (transfer steps) and ``2(n-1)/n x bytes``; a
    negative latency is clamped to 0 (the bandwidth refitted alone). The 95 % ranges come from
    the fit's residuals (``t`` quantile, ``points - parameters`` degrees of freedom).

    Returns ``usable`` (False: the prediction must not use it, ``fit_notes`` say why),
    ``latency_us`` (per transfer step), ``latency_us_range``, ``busbw_gbps`` (net of the
    latency; GB/s = bytes per ns), ``busbw_gbps_range`` (the upper end None when unbounded),
    ``r2`` (weighted, over the points), ``fit_sizes``, ``fit_points`` (distinct points),
    ``fit_messages`` (messages behind them) and ``fit_notes``.
    """
    parts = []
    for n, m in runs:
        if n < 2 or m is None or m.empty:
            continue
        one = m[m["messages"] == 1]
        if one.empty:
            continue
        p = one.groupby("bytes")["time_ns"].agg(["median", "size"]).reset_index()
        p["n"] = n
        p["w"] = p["size"] / p["size"].sum()
        parts.append(p)
    if not parts:
        return _no_fit(["no single allreduce message was recorded at two ranks or more"])
    pts = pd.concat(parts, ignore_index=True)
    n = pts["n"].to_numpy(dtype="float64")
    x1 = 2.0 * (n - 1.0)
    x2 = np.asarray(bus_factor(n), dtype="float64") * pts["bytes"].to_numpy(dtype="float64")
    y = pts["median"].to_numpy(dtype="float64")
    w = pts["w"].to_numpy(dtype="float64")
    sizes = sorted({int(v) for v in pts["n"]})
    distinct = len({(a, b) for a, b in zip(x1, x2, strict=True)})
    known = {
        "fit_sizes": sizes,
        "fit_points": distinct,
        "fit_messages": int(pts["size"].sum()),
    }
    X = np.column_stack([x1, x2])
    if distinct < FIT_POINTS_MIN or np.linalg.matrix_rank(X) < 2:
        what = "world size" if len(sizes) == 1 else "world sizes"
        return _no_fit(
            [
                f"too few distinct message sizes to fit a latency and a bandwidth: {distinct} "
                f"(world size, bytes) point{'s' if distinct != 1 else ''} at {what} "
                f"{', '.join(map(str, sizes))} (at least {FIT_POINTS_MIN} needed)"
            ],
            **known,
        )
    sw = np.sqrt(w)
    scale = np.sqrt((X**2).mean(axis=0))  # columns of like size: ns and bytes differ by 1e6
    A = X / scale * sw[:, None]
    coef, *_ = np.linalg.lstsq(A, y * sw, rcond=None)
    coef = coef / scale
    notes: list[str] = []
    df = len(y) - 2
    resid = y - X @ coef
    s2 = float((w * resid**2).sum()) / max(df, 1)
    cov = s2 * np.linalg.inv(A.T @ A) / np.outer(scale, scale)
    t = _t975(df)
    lat, slope = float(coef[0]), float(coef[1])
    lat_se, slope_se = math.sqrt(max(cov[0, 0], 0.0)), math.sqrt(max(cov[1, 1], 0.0))
    if lat < 0:
        notes.append(
            f"the fitted latency was negative ({lat / 1e3:.1f} µs per transfer step): clamped "
            "to 0 and the bandwidth fitted alone (the message times do not show a per-message "
            "cost that grows with the ring)"
        )
        lat_hi = max(0.0, lat + t * lat_se)
        lat = 0.0
        slope = float((w * x2 * y).sum() / (w * x2 * x2).sum())
        df = len(y) - 1
        resid = y - slope * x2
        s2 = float((w * resid**2).sum()) / max(df, 1)
        slope_se = math.sqrt(s2 / float((w * x2 * x2).sum()))
        t = _t975(df)
        lat_range = [0.0, lat_hi / 1e3]
    else:
        lat_range = [max(0.0, lat - t * lat_se) / 1e3, (lat + t * lat_se) / 1e3]
    mean = float((w * y).sum() / w.sum())
    tot = float((w * (y - mean) ** 2).sum())
    r2 = 1.0 - float((w * resid**2).sum()) / tot if tot > 0 else 1.0
    lo, hi = slope - t * slope_se, slope + t * slope_se
    out = {
        "latency_us": lat / 1e3,
        "latency_us_range": lat_range,
        "busbw_gbps": 1.0 / slope if slope > 0 else None,
        "busbw_gbps_range": [1.0 / hi if hi > 0 else None, 1.0 / lo if lo > 0 else None],
        "r2": r2,
        **known,
        "fit_notes": notes,
    }
    if slope <= 0:
        notes.append("the message times do not grow with the bytes: no bandwidth to fit")
        return _no_fit(notes, **{**out, "busbw_gbps_range": None})
    if r2 < FIT_R2_MIN:
        notes.append(f"the fit explains little of the message times (R^2 {r2:.2f} < {FIT_R2_MIN})")
        return _no_fit(notes, **out)
    return {"usable": True, **out}


def _replay(m: pd.DataFrame, growth_ns: np.ndarray) -> tuple[pd.Series, pd.Series]:
    """Replay each step's messages ``m`` (:func:`messages`, of one run) with each message's
    time grown by ``growth_ns``: one after another, each from when its tensors were ready.
    Returns per step the growth of the allreduce time (the sum of ``growth_ns``) and of the
    step's last completion (what the step waits for; ns)."""
    m = m.assign(growth=growth_ns)
    step = m["step"]
    base = m.groupby("step")["ready_ns"].transform("min")
    ready = m["ready_ns"] - base
    d = m["time_ns"] + m["growth"]
    # end'_k = max(ready_k, end'_{k-1}) + d_k, as a scan: C_k + max_{j<=k}(ready_j - C_{j-1})
    C = d.groupby(step).cumsum()
    lead = (ready - (C - d)).groupby(step).cummax()
    new_end = C + lead
    last = m.assign(new_end=new_end + base).groupby("step")[["end_ns", "new_end"]].last()
    return m.groupby("step")["growth"].sum(), last["new_end"] - last["end_ns"]


def scaling(analyses: list[Analysis]) -> Scaling:
    """Compare runs of one job at several world sizes; see the module docstring. Raises
    ``ValueError`` with fewer than two runs."""
    if len(analyses) < 2:
        raise ValueError("scaling needs runs at two world sizes or more")
    runs = sorted(analyses, key=lambda a: a.size)
    notes: list[str] = []
    sizes = [a.size for a in runs]
    if len(set(sizes)) < len(sizes):
        notes.append(f"more than one run of the same world size ({sizes}): each is listed")
    means = [_means(a) for a in runs]
    base, n0 = means[0], runs[0].size
    rows = []
    for a, m in zip(runs, means, strict=True):
        row: dict[str, Any] = {
            "size": a.size,
            "run_id": a.run_id,
            "run_dir": str(a.run_dir or ""),
            "step_ms": m["step"],
            "median_step_ms": a.run_row.get("step_ms"),
            "efficiency": base["step"] / m["step"] if m["step"] > 0 else float("nan"),
        }
        row["speedup"] = row["efficiency"] * a.size / n0
        loss = _loss(m, base)
        row["loss_ms"] = m["step"] - base["step"]
        row.update(loss)
        row["comm_ms"] = _finite(a.comm.get("comm_ms"))
        row["busbw_gbps"] = _finite(a.comm.get("busbw_gbps"))
        rows.append(row)
    table = pd.DataFrame(rows)
    prediction, said = _predict(runs, table, base["step"])
    assumptions = [
        "weak scaling: every run has the same batch per rank (hvtrace does not record the "
        "batch; with a fixed global batch the efficiency is not this ratio)",
        f"efficiency against the smallest run ({n0} rank{'s' if n0 != 1 else ''}): its step "
        "time over each run's (mean per rank and step)",
        *said,
    ]
    if prediction and prediction["model"] == "bytes" and prediction["fit_notes"]:
        notes.append(
            "the next-size prediction uses a ring's bytes alone, not a fitted per-message "
            "latency: " + "; ".join(prediction["fit_notes"])
        )
    if n0 == 1:
        notes.append(
            "the 1-rank run allreduces nothing (Horovod's optimizer skips it at one rank): its "
            "step has no communication at all"
        )
    return Scaling(table, prediction, assumptions, notes)


def _predict(
    runs: list[Analysis], table: pd.DataFrame, base_step_ms: float
) -> tuple[dict[str, Any], list[str]]:
    """The step at twice the largest world size (see the module docstring) and the assumptions
    it rests on; ``({}, [])`` without a largest run of two ranks or more."""
    largest = runs[-1]
    n = largest.size
    comm_ms = float(table["comm_ms"].iloc[-1])
    step_ms = float(table["step_ms"].iloc[-1])
    if n < 2:
        return {}, []
    msgs = {id(a): messages(a) for a in runs if a.size >= 2}
    fit = fit_message_cost([(a.size, msgs[id(a)]) for a in runs if a.size >= 2])
    threshold, cycle_ms = fusion_settings(largest.horovod_env)
    m = msgs[id(largest)]
    out: dict[str, Any] = {"size": 2 * n}
    if fit["usable"] and not m.empty:
        lat_ns = fit["latency_us"] * 1e3
        grow = m["messages"].to_numpy() * (2.0 * (2 * n - 1) - 2.0 * (n - 1)) * lat_ns
        grow = (
            grow
            + (ring_factor(2 * n) - ring_factor(n)) * m["bytes"].to_numpy() / (fit["busbw_gbps"])
        )
        comm, exposed = _replay(m, grow)
        comm_growth = float(comm.mean() / 1e6)
        exposed_growth = float(exposed.mean() / 1e6)
        model = "latency"
    elif np.isfinite(comm_ms):
        comm_growth = exposed_growth = comm_ms * (ring_factor(2 * n) / ring_factor(n) - 1.0)
        model = "bytes"
        if fit["usable"]:  # fitted on the smaller runs, but the largest has no messages
            fit = {**fit, "fit_notes": [*fit["fit_notes"], f"the {n}-rank run has no messages"]}
    else:
        return {}, []
    step = step_ms + exposed_growth
    out.update(
        {
            "step_ms": step,
            "efficiency": base_step_ms / step if step > 0 else float("nan"),
            "comm_growth_ms": comm_growth,
            "exposed_growth_ms": exposed_growth,
            "step_ms_all_exposed": step_ms + comm_growth,
            "model": model,
            **{k: v for k, v in fit.items() if k != "usable"},
            "messages_per_step": (
                float(m.groupby("step")["messages"].sum().mean()) if len(m) else None
            ),
            "fusion_threshold_bytes": threshold,
            "cycle_time_ms": cycle_ms,
        }
    )
    same = (
        "the same bytes per step and the same messages as at "
        f"{n} ranks (weak scaling; messages fused as measured); compute, input and waiting for "
        "the last rank as measured; hosts like the ones seen (a slower link between new hosts, "
        "or hosts that stall each other, is not foreseen)"
    )
    if model == "bytes":
        return out, [
            f"the {2 * n}-rank step: the {n}-rank run's, plus the growth of its allreduce time "
            f"({comm_ms:.2f} ms per step) by a ring's bytes per rank, {ring_factor(2 * n):.3f}"
            f" / {ring_factor(n):.3f} of the bytes, at the same bus bandwidth, all of it "
            "exposed; compute, input and waiting as measured; hosts like the ones seen (a "
            "slower link between new hosts is not foreseen)"
        ]
    lat_lo, lat_hi = fit["latency_us_range"]
    bw_lo, bw_hi = fit["busbw_gbps_range"]
    fitted = (
        f"each allreduce message costs 2(n-1) x latency + 2(n-1)/n x bytes / busbw at n "
        f"ranks (a ring's transfer steps and bytes per rank), fitted by least squares on "
        f"{fit['fit_points']} message sizes ({fit['fit_messages']} messages) of the runs at "
        f"{', '.join(map(str, fit['fit_sizes']))} ranks: latency {fit['latency_us']:.1f} µs "
        f"per transfer step (95 %: {lat_lo:.1f} to {lat_hi:.1f}), bus bandwidth "
        f"{fit['busbw_gbps']:.3g} GB/s ({_g(bw_lo)} to {_g(bw_hi)}), R^2 {fit['r2']:.2f}; a "
        "cost per message that does not grow with the ring (Horovod's cycle wait and "
        "negotiation, observing the completion) is counted as latency, so it grows with the "
        "ring too"
    )
    if fit["fit_notes"]:
        fitted += " (" + "; ".join(fit["fit_notes"]) + ")"
    mib = f"{threshold / 2**20:g} MiB" if threshold else "off"
    replay = (
        f"the {2 * n}-rank step: the {n}-rank run's steps replayed with every message "
        f"(tensors observed complete together, as Horovod fuses them: HOROVOD_FUSION_THRESHOLD "
        f"{mib}, HOROVOD_CYCLE_TIME {cycle_ms:g} ms) taking its measured time plus the model's "
        f"growth from {n} to {2 * n} ranks ({comm_growth:+.2f} ms of allreduce per step), one "
        "after another from when its tensors were ready as measured: growth the backward hid "
        f"stays hidden, the rest lengthens the step ({exposed_growth:+.2f} ms; all of it "
        f"exposed: {step_ms + comm_growth:.2f} ms); {same}"
    )
    return out, [fitted, replay]


def _g(x: Any) -> str:
    """A bound of a range, or "unbounded"."""
    return "unbounded" if x is None else f"{x:.3g}"


def _finite(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v if np.isfinite(v) else float("nan")


__all__ = [
    "COMPLETION_GAP_NS",
    "CYCLE_TIME_DEFAULT_MS",
    "FIT_POINTS_MIN",
    "FIT_R2_MIN",
    "FUSION_THRESHOLD_DEFAULT_BYTES",
    "LOSS_LABELS",
    "LOSS_PARTS",
    "Scaling",
    "fit_message_cost",
    "fusion_settings",
    "messages",
    "ring_factor",
    "scaling",
]
