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

**The next size**: the step at twice the largest world size, predicted from that run with a
ring allreduce's cost, which moves ``2(n-1)/n`` of the bytes per rank: with the same bytes per
step (weak scaling) and the same bus bandwidth, its communication time grows by ``((2n-1)/(2n)) /
((n-1)/n)``; the prediction adds that growth of the largest run's allreduce time to its step,
all of it exposed (an upper bound; compute, input and waiting as measured). The assumptions are
listed with it (:attr:`Scaling.assumptions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pandas as pd

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


@dataclass
class Scaling:
    """Runs of one job at several world sizes (:func:`scaling`); times in ms.

    ``runs``: one row per run, smallest world size first: ``size``, ``run_id``, ``run_dir``,
    ``step_ms`` (mean per rank and step), ``median_step_ms``, ``efficiency``, ``speedup`` (the
    throughput against the smallest run), ``loss_ms`` (``step_ms`` less the smallest run's) and
    one column per :data:`LOSS_PARTS` (ms; they add up to ``loss_ms``), ``comm_ms`` (median
    allreduce time per step), ``busbw_gbps``. ``prediction``: ``size``, ``step_ms``,
    ``efficiency``, ``comm_growth_ms`` for twice the largest world size (empty with one run or a
    largest run of one rank). ``assumptions`` and ``notes``: what the reader must know.
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
    """The share of the bytes a ring allreduce moves per rank: ``2(n-1)/n``."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


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
    largest = runs[-1]
    n = largest.size
    prediction: dict[str, Any] = {}
    if n >= 2 and np.isfinite(table["comm_ms"].iloc[-1]):
        growth = table["comm_ms"].iloc[-1] * (ring_factor(2 * n) / ring_factor(n) - 1.0)
        step = float(table["step_ms"].iloc[-1] + growth)
        prediction = {
            "size": 2 * n,
            "step_ms": step,
            "efficiency": base["step"] / step if step > 0 else float("nan"),
            "comm_growth_ms": float(growth),
        }
    assumptions = [
        "weak scaling: every run has the same batch per rank (hvtrace does not record the "
        "batch; with a fixed global batch the efficiency is not this ratio)",
        f"efficiency against the smallest run ({n0} rank{'s' if n0 != 1 else ''}): its step "
        "time over each run's (mean per rank and step)",
    ]
    if prediction:
        assumptions.append(
            f"the {2 * n}-rank step: the {n}-rank run's, plus the growth of its allreduce time "
            f"({table['comm_ms'].iloc[-1]:.2f} ms per step) by a ring's bytes per rank, "
            f"{ring_factor(2 * n):.3f} / {ring_factor(n):.3f} of the bytes, at the same bus "
            "bandwidth, all of it exposed; compute, input and waiting as measured; hosts like "
            "the ones seen (a slower link between new hosts is not foreseen)"
        )
    if n0 == 1:
        notes.append(
            "the 1-rank run allreduces nothing (Horovod's optimizer skips it at one rank): its "
            "step has no communication at all"
        )
    return Scaling(table, prediction, assumptions, notes)


def _finite(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v if np.isfinite(v) else float("nan")


__all__ = ["LOSS_LABELS", "LOSS_PARTS", "Scaling", "ring_factor", "scaling"]
