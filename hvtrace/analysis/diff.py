"""What changed between two runs, and where it went (``hvtrace diff RUN_A RUN_B``).

Both runs are analyzed as ``hvtrace analyze`` does (:func:`hvtrace.analysis.analyze`, the same
engine at any size); this module compares the two :class:`~hvtrace.analysis.model.Analysis`
objects and computes nothing that the analysis defines elsewhere.

**Step time.** The headline is the change in the median step time (each step's time is the median
over its ranks, :attr:`Analysis.run_steps`), with a 95 % confidence interval from a *circular
block bootstrap* of the two runs' per-step series, resampled independently (:data:`RESAMPLES`
resamples; blocks of ``max(n^(1/3), n/10)`` steps, so that both the correlation of neighbouring
steps and slow drift within a run widen the interval, as they should: a run's first and second
half differ by more than its step-to-step noise suggests). A change is **significant** when the
interval excludes zero and the change is at least :data:`MIN_REL_CHANGE` of run A's median (below
that, two runs of the same job on a shared machine differ without any change).

**Where it went.** The mean step time over (rank, step) changes by the sum of the changes of its
parts, exactly: the phases of the step table (input, forward, backward, compute, wait, update,
time blocked in collectives outside the optimizer) and the rest (``other``: user spans outside
the phases and gaps), each a mean over the analyzed (rank, step) rows. Runs of different world
size are compared per (rank, step), and :attr:`RunDiff.notes` says so. Each part has the same
bootstrap interval (the same resampled steps). Where the recorder measured CPU time and run-queue
wait, each compute phase's change is split by cause: **work** (CPU time), **contention**
(waiting for a CPU) and **blocked** (the rest), as the straggler analysis splits an excess
(:func:`hvtrace.analysis.stragglers.split_cause`; the ``wait`` phase is Horovod's spinning wait
and is not split).

**Ranks, tensors, communication, configuration.** The stragglers each run names (a rank that
became one, or stopped being one), each tensor's allreduce (median time, bytes, bandwidth:
:func:`hvtrace.analysis.bandwidth.tensor_table`; tensors new in B, gone from A, resized), the
run-level communication figures (:attr:`Analysis.run_row`, :attr:`Analysis.comm`), and what each
run recorded of its configuration (world size, hosts, Horovod's controller and settings, the
optimizer's options, versions), side by side where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pandas as pd

from hvtrace.analysis.model import Analysis

#: Bootstrap resamples for every interval of :func:`diff_runs`.
RESAMPLES: Final = 2000
#: A change in the median step smaller than this share of run A's median is not significant,
#: whatever its interval: two runs of one job on a shared host differ by about that much.
MIN_REL_CHANGE: Final = 0.01
#: A change in the run-queue wait per (rank, step) of at least this share of A's mean step gets a
#: note: the host's load changed between the runs.
HOST_NOTE_SHARE: Final = 0.05
#: The parts of a step, in time order, as step-table columns (ns); what they leave is ``other``.
PART_COLUMNS: Final[tuple[tuple[str, str], ...]] = (
    ("input", "input_ns"),
    ("forward", "forward_ns"),
    ("backward", "backward_ns"),
    ("compute", "compute_ns"),
    ("wait", "wait_ns"),
    ("update", "update_ns"),
    ("collective", "collective_wait_ns"),
)
#: Phases whose change is split by cause (CPU time and run-queue wait measured in them).
CAUSE_SPLIT_PHASES: Final[tuple[str, ...]] = ("input", "forward", "backward", "compute", "update")


@dataclass
class RunDiff:
    """Two runs compared (:func:`diff_runs`); times in ms.

    ``step``: ``median_a_ms``, ``median_b_ms``, ``delta_ms``, ``ci_ms`` (low, high), ``rel``
    (delta / A's median), ``significant``, ``steps_a``, ``steps_b``, ``mean_a_ms``,
    ``mean_b_ms`` (per rank-step, what the parts add up to). ``parts``: one row per part
    (``part``, ``a_ms``, ``b_ms``, ``delta_ms``, ``ci_lo_ms``, ``ci_hi_ms``, ``share``: of the
    change in the mean; the rows' ``delta_ms`` add up to it). ``causes``: per compute phase and
    cause (``phase``, ``cause``, ``a_ms``, ``b_ms``, ``delta_ms``), empty where either run has no
    CPU measurements. ``ranks``: the stragglers of either run (``rank``, ``status``: new,
    gone or both; ``phase_a``/``phase_b``, ``cause_a``/``cause_b``, ``late_a_ms``/``late_b_ms``).
    ``tensors``: per allreduced tensor (``name``, ``status``: new, gone, resized or same size;
    ``bytes_a``/``bytes_b``, ``time_a_ms``/``time_b_ms``, ``delta_ms``, ``algbw_a_gbps``/
    ``algbw_b_gbps``), largest change first. ``comm``: run-level figure -> (A, B). ``config``:
    (what, A, B) for every recorded setting that differs; ``config_same``: how many agree.
    ``notes``: what the reader must know (world sizes differ, steps analyzed, ...).
    """

    a_id: str
    b_id: str
    step: dict[str, Any]
    parts: pd.DataFrame
    causes: pd.DataFrame
    ranks: pd.DataFrame
    tensors: pd.DataFrame
    comm: dict[str, tuple[float | None, float | None]]
    config: list[tuple[str, Any, Any]]
    config_same: int
    notes: list[str] = field(default_factory=list)
    a_dir: str = ""
    b_dir: str = ""


def block_length(n: int) -> int:
    """The bootstrap's block of steps for a series of ``n``: ``max(n^(1/3), n/10)``, at least
    1 (so a run is resampled in at most about ten blocks: drift within it widens the interval)."""
    return max(1, round(max(n ** (1 / 3), n / 10)))


def block_resample_index(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """``resamples`` x ``n`` indices into a series of ``n``: a circular block bootstrap."""
    if n == 0:
        return np.zeros((resamples, 0), np.int64)
    b = block_length(n)
    k = -(-n // b)
    starts = rng.integers(0, n, (resamples, k))
    idx = (starts[:, :, None] + np.arange(b)[None, None, :]) % n
    return idx.reshape(resamples, k * b)[:, :n]


def _series(a: Analysis) -> tuple[np.ndarray, pd.DataFrame]:
    """Run ``a``'s per-step step time (ms, median over ranks) and per-step part means (ms, mean
    over the step's analyzed ranks), both over the analyzed steps, in step order."""
    rows = a.analyzed
    steps = np.sort(rows["step"].unique())
    ps = a.run_steps.set_index("step")["step_ms"] if len(a.run_steps) else pd.Series(dtype=float)
    step_ms = ps.reindex(steps).to_numpy(np.float64)
    parts = pd.DataFrame(index=steps)
    g = rows.groupby("step")
    total = g["step_ns"].mean().reindex(steps) / 1e6
    known = pd.Series(0.0, index=steps)
    for name, col in PART_COLUMNS:
        v = (g[col].mean().reindex(steps) / 1e6).fillna(0.0) if col in rows else 0.0 * known
        parts[name] = v
        known = known + v
    parts["other"] = total - known
    parts["step"] = total
    return step_ms, parts


def _median_ci(
    xa: np.ndarray, xb: np.ndarray, rng: np.random.Generator
) -> tuple[float, float, float]:
    """Median(B) - median(A) and its 95 % block-bootstrap interval."""
    xa, xb = xa[np.isfinite(xa)], xb[np.isfinite(xb)]
    if not len(xa) or not len(xb):
        return float("nan"), float("nan"), float("nan")
    ia = block_resample_index(len(xa), RESAMPLES, rng)
    ib = block_resample_index(len(xb), RESAMPLES, rng)
    d = np.median(xb[ib], axis=1) - np.median(xa[ia], axis=1)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return float(np.median(xb) - np.median(xa)), float(lo), float(hi)


def _parts_table(pa: pd.DataFrame, pb: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    names = [n for n, _ in PART_COLUMNS] + ["other"]
    ma, mb = pa[names].mean(), pb[names].mean()
    ia = block_resample_index(len(pa), RESAMPLES, rng)
    ib = block_resample_index(len(pb), RESAMPLES, rng)
    va, vb = pa[names].to_numpy(np.float64), pb[names].to_numpy(np.float64)
    boot = vb[ib].mean(axis=1) - va[ia].mean(axis=1) if len(va) and len(vb) else None
    total = float(mb.sum() - ma.sum())
    rows = []
    for k, n in enumerate(names):
        d = float(mb[n] - ma[n])
        lo, hi = np.percentile(boot[:, k], [2.5, 97.5]) if boot is not None else (np.nan, np.nan)
        rows.append(
            {
                "part": n,
                "a_ms": float(ma[n]),
                "b_ms": float(mb[n]),
                "delta_ms": d,
                "ci_lo_ms": float(lo),
                "ci_hi_ms": float(hi),
                "share": d / total if total else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def _cause_table(a: Analysis, b: Analysis) -> pd.DataFrame:
    cols = ["phase", "cause", "a_ms", "b_ms", "delta_ms"]
    ra, rb = a.analyzed, b.analyzed
    rows = []
    for p in CAUSE_SPLIT_PHASES:
        need = [f"{p}_ns", f"{p}_cpu_ns", f"{p}_runq_ns"]
        if not all(c in ra.columns and c in rb.columns for c in need):
            continue
        parts = {}
        for key, r in (("a", ra), ("b", rb)):
            m = r[need].dropna()
            if m.empty or not m[f"{p}_ns"].any():
                break
            dur, cpu, runq = (m[c].mean() / 1e6 for c in need)
            parts[key] = {"work": cpu, "contention": runq, "blocked": dur - cpu - runq}
        else:
            for cause in ("work", "contention", "blocked"):
                va, vb = parts["a"][cause], parts["b"][cause]
                rows.append(
                    {"phase": p, "cause": cause, "a_ms": va, "b_ms": vb, "delta_ms": vb - va}
                )
    return pd.DataFrame(rows, columns=cols)


def _rank_table(a: Analysis, b: Analysis) -> pd.DataFrame:
    cols = ["rank", "status", "phase_a", "phase_b", "cause_a", "cause_b", "late_a_ms", "late_b_ms"]
    sa = a.stragglers.set_index("rank") if len(a.stragglers) else pd.DataFrame()
    sb = b.stragglers.set_index("rank") if len(b.stragglers) else pd.DataFrame()
    rows = []

    def get(s: pd.DataFrame, r: int, c: str) -> Any:
        return s.at[r, c] if r in s.index and c in s.columns else None

    for r in sorted(set(sa.index) | set(sb.index)):
        in_a, in_b = r in sa.index, r in sb.index
        rows.append(
            {
                "rank": int(r),
                "status": "both" if in_a and in_b else ("new" if in_b else "gone"),
                "phase_a": get(sa, r, "phase"),
                "phase_b": get(sb, r, "phase"),
                "cause_a": get(sa, r, "cause"),
                "cause_b": get(sb, r, "cause"),
                "late_a_ms": get(sa, r, "late_ms"),
                "late_b_ms": get(sb, r, "late_ms"),
            }
        )
    return pd.DataFrame(rows, columns=cols)


def _tensor_table(a: Analysis, b: Analysis) -> pd.DataFrame:
    cols = ["name", "status", "bytes_a", "bytes_b", "time_a_ms", "time_b_ms", "delta_ms"]
    cols += ["algbw_a_gbps", "algbw_b_gbps"]
    keep = ["name", "bytes", "time_ms", "algbw_gbps"]
    ta = a.tensors[keep] if len(a.tensors) else pd.DataFrame(columns=keep)
    tb = b.tensors[keep] if len(b.tensors) else pd.DataFrame(columns=keep)
    m = ta.merge(tb, on="name", how="outer", suffixes=("_a", "_b"))
    if m.empty:
        return pd.DataFrame(columns=cols)
    m = m.rename(
        columns={
            "time_ms_a": "time_a_ms",
            "time_ms_b": "time_b_ms",
            "algbw_gbps_a": "algbw_a_gbps",
            "algbw_gbps_b": "algbw_b_gbps",
        }
    )
    status = np.where(
        m["bytes_a"].isna(),
        "new",
        np.where(
            m["bytes_b"].isna(), "gone", np.where(m["bytes_a"] != m["bytes_b"], "resized", "")
        ),
    )
    m["status"] = status
    m["delta_ms"] = m["time_b_ms"].fillna(0.0) - m["time_a_ms"].fillna(0.0)
    m = m.reindex(m["delta_ms"].abs().sort_values(ascending=False, kind="stable").index)
    return m[cols].reset_index(drop=True)


#: Horovod variables that a launcher sets for each launch or worker (addresses, ports, this
#: worker's rank and host): they differ between any two runs and say nothing of the job's setup
#: (the world size is compared on its own).
PER_LAUNCH_ENV: Final = frozenset(
    {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "HOROVOD_GLOO_RENDEZVOUS_PORT",
        "HOROVOD_HOSTNAME",
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE",
        "HOROVOD_TIMELINE",
    }
)


def _flat(prefix: str, d: dict[str, Any] | None) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in (d or {}).items()}


def _config(a: Analysis) -> dict[str, Any]:
    """What run ``a`` recorded of its configuration, one flat dict."""
    out: dict[str, Any] = {
        "world size": a.size,
        "hosts": len(set(a.hosts.values())),
        "controller": a.controller or None,
        "timing": a.timing or None,
        "framework": (a.framework or {}).get("name"),
        "framework version": (a.framework or {}).get("version"),
    }
    out.update(_flat("version of ", a.versions))
    out.update(_flat("optimizer ", a.optimizer))
    out.update(_flat("", {k: v for k, v in a.horovod_env.items() if k not in PER_LAUNCH_ENV}))
    return out


def _config_diff(a: Analysis, b: Analysis) -> tuple[list[tuple[str, Any, Any]], int]:
    ca, cb = _config(a), _config(b)
    diff, same = [], 0
    for k in list(dict.fromkeys([*ca, *cb])):
        va, vb = ca.get(k), cb.get(k)
        if va == vb:
            same += 1
        else:
            diff.append((k, va, vb))
    return diff, same


def diff_runs(a: Analysis, b: Analysis, seed: int = 0) -> RunDiff:
    """Compare two analyses (run A, the baseline, and run B); see the module docstring."""
    rng = np.random.default_rng(seed)
    sa, pa = _series(a)
    sb, pb = _series(b)
    delta, lo, hi = _median_ci(sa, sb, rng)
    med_a = float(np.nanmedian(sa)) if np.isfinite(sa).any() else float("nan")
    med_b = float(np.nanmedian(sb)) if np.isfinite(sb).any() else float("nan")
    rel = delta / med_a if med_a else float("nan")
    significant = bool(np.isfinite(lo) and (lo > 0 or hi < 0) and abs(rel) >= MIN_REL_CHANGE)
    step = {
        "median_a_ms": med_a,
        "median_b_ms": med_b,
        "delta_ms": delta,
        "ci_ms": (lo, hi),
        "rel": rel,
        "significant": significant,
        "steps_a": len(sa),
        "steps_b": len(sb),
        "mean_a_ms": float(pa["step"].mean()) if len(pa) else float("nan"),
        "mean_b_ms": float(pb["step"].mean()) if len(pb) else float("nan"),
    }
    notes = []
    if a.size != b.size:
        notes.append(
            f"the runs have different world sizes ({a.size} and {b.size} ranks): they are "
            "compared per (rank, step); a rank number is not the same worker in both"
        )
    if a.timing and b.timing and a.timing != b.timing:
        notes.append(
            f"the runs were timed differently ({a.timing} and {b.timing}): durations on the "
            "host clock and on the device differ by more than any change"
        )
    causes = _cause_table(a, b)
    more_runq = float(causes.loc[causes["cause"] == "contention", "delta_ms"].sum())
    if abs(more_runq) >= HOST_NOTE_SHARE * step["mean_a_ms"]:
        notes.append(
            f"B's ranks waited {abs(more_runq):.1f} ms {'more' if more_runq > 0 else 'less'} per "
            "step for a CPU than A's (runnable, not running): the host was "
            f"{'busier' if more_runq > 0 else 'quieter'}, or the job runs "
            f"{'more' if more_runq > 0 else 'fewer'} busy threads; that part of the change is "
            "not the job's work"
        )
    rr_a, rr_b = a.run_row, b.run_row
    comm: dict[str, tuple[float | None, float | None]] = {
        k: (rr_a.get(k), rr_b.get(k))
        for k in ("exposed_ms", "exposed_share", "comm_compute_ratio", "overlap", "busbw_gbps")
    }
    for k in ("bytes_per_step", "tensors_per_step"):
        comm[k] = (_num(a.comm.get(k)), _num(b.comm.get(k)))
    config, same = _config_diff(a, b)
    return RunDiff(
        a_id=a.run_id,
        b_id=b.run_id,
        step=step,
        parts=_parts_table(pa, pb, rng),
        causes=causes,
        ranks=_rank_table(a, b),
        tensors=_tensor_table(a, b),
        comm=comm,
        config=config,
        config_same=same,
        notes=notes,
        a_dir=str(a.run_dir or ""),
        b_dir=str(b.run_dir or ""),
    )


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


__all__ = ["MIN_REL_CHANGE", "RESAMPLES", "RunDiff", "block_length", "diff_runs"]
