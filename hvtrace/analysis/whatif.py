"""What a straggler costs the job: every step replayed without it.

After "Understanding Stragglers in Large Model Training Using What-if Analysis" (OSDI 2025),
reduced to the dependencies of a data-parallel step. In step ``s`` each rank ``r`` works for

    W(r, s) = update(r, s-1) + (arrival(r, s) - start(r, s))

between seeing the previous step's allreduces done and having its last gradient ready (its
update, then its input gap, forward and backward; time blocked in a collective outside the
optimizer, such as a metric allreduce, is waiting, not work, and is left out). Both terms are
durations on the rank's own clock, so no clock alignment enters. The allreduces cannot finish
before the last rank arrives, so the job's step time is

    T(s) = max_r W(r, s) + tail(s)

where ``T(s)`` is measured (the median over ranks of the time between their leaving
``synchronize`` in steps ``s-1`` and ``s``) and ``tail(s) = T(s) - max_r W(r, s)`` is what
remains: the communication after the last arrival and seeing it done. The what-if sets a rank's
work (or one phase of it) to the median of the other ranks' and keeps the tail:

    T'(s) = max_r W'(r, s) + tail(s),    lost(s) = T(s) - T'(s) >= 0.

What it leaves out: a rank that arrived on time might have made the tail shorter (a collective
that started earlier overlaps more), and on a shared host a slow rank that sleeps frees a CPU
for its neighbours, who would be slower without it. ``bench/whatif.py`` checks the prediction
against the same job run without the straggler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis.steps import NET_PHASES, analyzed_steps

#: Phases whose duration the what-if can set to the other ranks' median (``update`` is the
#: previous step's, which precedes this step's work).
PHASES = (*NET_PHASES, "user", "other")


@dataclass
class StepModel:
    """The replay's inputs, steps x ranks (ms): see the module docstring."""

    steps: np.ndarray  #: step numbers (rows)
    ranks: list[int]  #: ranks (columns)
    work_ms: np.ndarray  #: W(r, s)
    phase_ms: dict[str, np.ndarray]  #: each of :data:`PHASES` present, as part of W
    step_ms: np.ndarray  #: T(s), measured
    tail_ms: np.ndarray  #: T(s) - max_r W(r, s)

    def replay(self, work_ms: np.ndarray) -> np.ndarray:
        """T'(s) for a changed work matrix (NaN cells: ranks missing from that step)."""
        return np.nanmax(work_ms, axis=1) + self.tail_ms


def step_model(steps: pd.DataFrame, skip_steps: int = 1) -> StepModel | None:
    """The replay's inputs from a step table (None with fewer than two ranks or no step whose
    previous step every rank completed)."""
    need = {"arrival_ns", "start_ns", "end_ns", "update_ns", "wait_ns", "step_ns"}
    if steps.empty or not need <= set(steps.columns):
        return None
    full = steps[steps["complete"]] if "complete" in steps.columns else steps
    full = full[full["arrival_ns"].notna()]
    ranks = sorted(int(r) for r in full["rank"].unique())
    if len(ranks) < 2:
        return None
    # dense steps x ranks grids (numpy indexing: no pivot of the whole table)
    all_steps = np.unique(full["step"].to_numpy(dtype=np.int64))
    ri = np.searchsorted(ranks, full["rank"].to_numpy(dtype=np.int64))
    si = np.searchsorted(all_steps, full["step"].to_numpy(dtype=np.int64))

    def grid(col: str) -> np.ndarray:
        g = np.full((len(all_steps), len(ranks)), np.nan)
        g[si, ri] = full[col].to_numpy(dtype=np.float64) / 1e6
        return g

    arrived = np.isfinite(grid("arrival_ns")).all(axis=1)
    prev = np.searchsorted(all_steps, all_steps - 1)
    prev_ok = (all_steps >= 1) & (all_steps[np.minimum(prev, len(all_steps) - 1)] == all_steps - 1)
    keep = arrived & prev_ok & np.isin(all_steps, analyzed_steps(full, skip_steps)["step"])
    keep &= arrived[np.where(prev_ok, prev, 0)]  # every rank arrived in the previous step too
    if not keep.any():
        return None
    rows, prev_rows = np.flatnonzero(keep), prev[keep]
    update = grid("update_ns")
    update_prev = update[prev_rows]
    before = (grid("arrival_ns") - grid("start_ns"))[rows]
    if "collective_wait_ns" in full.columns:  # blocked in a collective: waiting, not working
        before = np.maximum(before - grid("collective_wait_ns")[rows], 0)
    work = update_prev + before
    # T(s): per rank, leaving synchronize in s-1 to leaving it in s
    t_rank = grid("step_ns")[rows] - update[rows] + update_prev
    step_ms = np.nanmedian(t_rank, axis=1)
    phases = {"update": update_prev}
    for p in PHASES:
        if p != "update" and f"{p}_ns" in full.columns:
            phases[p] = np.clip(grid(f"{p}_ns")[rows], 0, before)
    s = all_steps
    return StepModel(
        steps=s[keep],
        ranks=ranks,
        work_ms=work,
        phase_ms=phases,
        step_ms=step_ms,
        tail_ms=step_ms - np.nanmax(work, axis=1),
    )


def without_ranks(model: StepModel, ranks: list[int], phase: str | None = None) -> np.ndarray:
    """T'(s) with ``ranks`` working like the others: their whole work (``phase`` None) or that
    phase set to the median of the ranks not in ``ranks`` (per step)."""
    cols = [model.ranks.index(r) for r in ranks if r in model.ranks]
    others = [i for i in range(len(model.ranks)) if i not in cols]
    w = model.work_ms.copy()
    if not cols or not others:
        return model.replay(w)
    if phase is None or phase not in model.phase_ms:
        typical = np.nanmedian(model.work_ms[:, others], axis=1)
        w[:, cols] = np.minimum(w[:, cols], typical[:, None])
    else:
        ph = model.phase_ms[phase]
        typical = np.nanmedian(ph[:, others], axis=1)
        w[:, cols] -= np.clip(ph[:, cols] - typical[:, None], 0, None)
    return model.replay(w)


def rank_costs(model: StepModel) -> pd.DataFrame:
    """Per rank, what the job would gain if that rank alone worked like the others' median
    (:func:`cost` of that rank): ``lost_ms_per_step`` and ``lost_share``."""
    rows = []
    for r in model.ranks:
        c = cost(model, [r])
        rows.append((r, c["lost_ms_per_step"], c["lost_share"]))
    return pd.DataFrame(rows, columns=["rank", "lost_ms_per_step", "lost_share"])


def cost(model: StepModel, ranks: list[int], phase: str | None = None) -> dict[str, float]:
    """What ``ranks`` (or their ``phase``) cost: ``lost_ms_per_step`` (mean), ``lost_share``
    (of the run's step time) and ``step_ms_without`` (median T')."""
    t2 = without_ranks(model, ranks, phase)
    lost = np.clip(model.step_ms - t2, 0, None)  # never negative (rounding)
    total = float(np.nansum(model.step_ms))
    return {
        "lost_ms_per_step": float(np.nanmean(lost)),
        "lost_share": float(np.nansum(lost)) / total if total else 0.0,
        "step_ms_without": float(np.nanmedian(t2)),
    }


def whatif_summary(
    model: StepModel | None, stragglers: pd.DataFrame, slow_hosts: pd.DataFrame
) -> dict[str, Any]:
    """The run's what-if: ``step_ms`` (median measured T), ``step_ms_without_stragglers``
    (median T' with every named straggler and slow host's rank working like the rest),
    ``lost_ms_per_step`` and ``lost_share`` of that, ``lost_bound`` ("upper" when a replaced
    rank's cost is only an upper bound, see :func:`add_costs`), ``steps`` (how many were
    replayed) and ``ranks`` (the ranks replaced). Empty without a model."""
    if model is None:
        return {}
    ranks = sorted(
        {int(r) for r in stragglers.get("rank", [])}
        | {int(r) for rs in slow_hosts.get("ranks", []) for r in rs}
    )
    c = cost(model, ranks)
    bounds = [*stragglers.get("lost_bound", []), *slow_hosts.get("lost_bound", [])]
    return {
        "lost_bound": "upper" if "upper" in bounds else "",
        "step_ms": float(np.nanmedian(model.step_ms)),
        "step_ms_without_stragglers": c["step_ms_without"],
        "lost_ms_per_step": c["lost_ms_per_step"],
        "lost_share": c["lost_share"],
        "steps": len(model.steps),
        "ranks": ranks,
    }


def add_costs(
    model: StepModel | None, named: pd.DataFrame, cpu_short_hosts: Any = ()
) -> pd.DataFrame:
    """``named`` (stragglers: a ``rank`` column; slow hosts: a ``ranks`` column) with what each
    costs: ``lost_ms_per_step`` and ``lost_share`` of its ranks' whole work replaced, and for a
    straggler with a phase, ``phase_lost_ms_per_step`` of that phase alone (NaN: no replay).
    ``lost_bound`` is ``"upper"`` where the figure is only an upper bound: the rank's host is in
    ``cpu_short_hosts`` (its ranks wait for a CPU) and its excess is not more work (blocked or
    contention), so the CPU it leaves idle speeds up its neighbours, which the replay cannot
    know; else ``""``. Sorted by ``lost_ms_per_step``, largest first."""
    out = named.copy()
    cols = ["lost_ms_per_step", "lost_share", "phase_lost_ms_per_step"]
    for c in cols:
        out[c] = np.nan
    short = set(cpu_short_hosts)
    causes = out["cause"].astype(str) if "cause" in out.columns else pd.Series("", out.index)
    hosts = out["host"].astype(str) if "host" in out.columns else pd.Series("", out.index)
    out["lost_bound"] = np.where(hosts.isin(short) & (causes != "work"), "upper", "")
    if model is None or out.empty:
        return out
    for i, row in out.iterrows():
        ranks = [int(r) for r in row["ranks"]] if "ranks" in out.columns else [int(row["rank"])]
        c = cost(model, ranks)
        out.at[i, "lost_ms_per_step"] = c["lost_ms_per_step"]
        out.at[i, "lost_share"] = c["lost_share"]
        phase = str(row.get("builtin_phase") or row.get("phase") or "")
        if phase in model.phase_ms:
            out.at[i, "phase_lost_ms_per_step"] = cost(model, ranks, phase)["lost_ms_per_step"]
    return out.sort_values("lost_ms_per_step", ascending=False, kind="stable").reset_index(
        drop=True
    )
