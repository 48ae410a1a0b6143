"""Which rank holds the others back, and why.

A synchronous allreduce makes every rank's step equally long, so step time cannot tell who is
slow. What differs is *arrival*: when each rank's last gradient became ready (its latest allreduce
enqueue), which :func:`hvtrace.analysis.steps.step_table` gives as ``arrival_ns`` and, relative to
the first rank ready in the same step, as ``lateness_ns``.

A rank is named a straggler when either

- **it arrives last** in a clear majority of steps (``min_last_share``: 75 % with 2 ranks, where a
  coin flip gives 50 %; 50 % with more ranks), its median lateness is above a noise floor (the two
  clocks' alignment uncertainty, and a fraction of the median step), and its own phases explain
  at least half of that lateness and at least the work margin (a rank that only *looks* late,
  because it observed the previous allreduce's completion later or because of clock error, does
  no extra work and is not named); or
- **its own work is consistently slower**: some phase takes longer than the other ranks' median
  in the same step by more than the work margin in at least 75 % of steps. This compares
  durations on one rank's clock, so clock error plays no part; where run-queue wait was
  measured, it compares the phase's own time (its duration less that wait), since on a host
  short of CPU the wait is the other ranks' doing and varies more from step to step than the
  slowdown being looked for; its margin is then ``own_floor_frac`` (5 %) of the median step
  (the own time of the same work differs across ranks by a fraction of that: the CPU time of a
  forward pass agreed within 1 % across 4 ranks on a 2-core host with a busy neighbour).

The work margin is 10 % of the median step, and at least 2 ms on CPU-timed runs (one scheduler
time slice: on an oversubscribed host, Horovod's coordinator thread alone makes rank 0 a
millisecond or two late in every step of a balanced run; see :meth:`StragglerConfig.for_timing`).

The phase named is the one whose excess over the other ranks explains the lateness, comparing
per-rank *medians* over steps (a slow update at the end of step k delays the rank's arrival in
step k+1: comparing medians finds it all the same). A user span is named instead of the built-in
phase that contains it when it accounts for most of that phase's excess. Where the run measured
run-queue wait, the phase is chosen by its excess *less its contention part*, when some phase is
slower by the work margin without it: on a host short of CPU, whichever rank is behind waits for
a CPU while its peers spin in their wait for it (Horovod's wait yields but stays runnable), so a
rank that sleeps 30 ms in its forward can show a larger, contended excess in its backward; the
forward is what made it late. A rank slow by contention alone (a neighbour pinned to its core)
is named for that.

When every rank of one host (with 2 or more ranks) is late and the run has more than one host,
the host is named too (:func:`slow_hosts`).

**Why** the rank is slow in that phase: where the recorder measured the training thread's CPU
time and run-queue wait per phase (format version 2), the phase's excess over the other ranks
(per-rank medians, as above) is split into **work** (more CPU time than the others' median),
**contention** (more time runnable but waiting for a CPU) and **blocked** (the rest: neither on a
CPU nor waiting for one: sleep, I/O, a lock, a queue such as DataLoader workers'). The largest
part is the ``cause`` (:func:`split_cause`). A rank named for its arrival whose own time over
the step (outside ``synchronize``, less its run-queue wait) does not explain its lateness, and
whose phase has no part of its own (blocked time or extra work at or above the own-time margin,
the work larger than the phase's wait or accounting for it as below), is late by
**contention** whichever of its small parts is the largest (named in the phase it waited in most
when its phase shows no extra wait, or had none measured): on a host short of CPU the rank that
is behind waits for one in every phase, and a fraction of a millisecond more CPU time in one of
them is within what the same work differs by there. Extra work at or above the margin is
the cause over a larger contention part only if it accounts for that wait, at the rank's own
rate of waiting over the step (:data:`INDUCED_WAIT_FACTOR`). The step's own time is used
because the phases' counter intervals tile the step differently from their spans (backward's
run from forward's end, so the gap before it, "other", has its counters in backward's).

A work or blocked cause becomes **speed** (the rank runs slower throughout: a slower, shared or
throttled processor, not more work) when every other phase of the rank long enough to compare,
the update among them, is at least 5 % slower than the others', and the named phase's excess is
no more than their median ratio accounts for, plus the own-time margin
(:func:`speed_explains`): more work or data on one rank leaves some phase, the update at least
(the same optimizer step on every rank), at the others' time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd

from hvtrace.analysis.steps import NET_PHASES, analyzed_steps

#: The smallest margin on host-timed (CPU) runs: about one scheduler time slice on a busy host.
#: On a 2-core host running 2 ranks, Horovod's coordinator thread alone makes rank 0 ~1-2 ms
#: later than the others in every step of a balanced run.
CPU_NOISE_FLOOR_NS: Final = 2_000_000

#: The causes a phase's excess is split into (see :func:`split_cause`).
CAUSES: Final[tuple[str, ...]] = ("work", "contention", "blocked")

#: Built-in phases a straggler can be slow in (rank-local work; wait is a consequence, not work).
WORK_PHASES: Final[tuple[str, ...]] = (*NET_PHASES, "other")


@dataclass(frozen=True)
class StragglerConfig:
    """Thresholds of the straggler decision (see the module docstring).

    ``min_last_share``: share of steps a rank must arrive last in (None: 0.75 with 2 ranks, else
    0.5). ``late_floor_frac``: the lateness floor's share of the median step time.
    ``work_floor_frac``: the work margin, as a share of the median step: a rank's extra work must
    exceed it (in the medians, and per step for the work criterion). ``own_floor_frac``: the
    per-step margin of the work criterion where run-queue wait was measured (own time).
    ``min_floor_ns``: the smallest floor and margin, ns (:meth:`for_timing`: 2 ms for host-timed
    CPU runs, about one scheduler time slice on a busy host; 0.1 ms for CUDA-timed runs).
    ``explain_frac``: share of the lateness the rank's phase excesses must explain.
    ``user_prefer_frac``: a user span is named instead of the built-in phase when its excess is
    at least this share of the phase's.
    ``min_steps``: fewer analyzed steps than this name nobody.
    """

    min_last_share: float | None = None
    late_floor_frac: float = 0.05
    work_floor_frac: float = 0.10
    own_floor_frac: float = 0.05
    min_floor_ns: int = 100_000
    explain_frac: float = 0.5
    user_prefer_frac: float = 0.7
    min_steps: int = 3

    @classmethod
    def for_timing(cls, timing: str | None, **kw: Any) -> StragglerConfig:
        """Return the defaults for a run's ``timing`` header field (``host_monotonic`` or
        ``cuda_events``): CPU-timed runs get a 2 ms noise floor (OS scheduling), others 0.1 ms."""
        floor = CPU_NOISE_FLOOR_NS if timing in (None, "host_monotonic") else 100_000
        return cls(**{"min_floor_ns": floor, **kw})

    def last_share_needed(self, n_ranks: int) -> float:
        """Return the share of steps a rank must arrive last in, for ``n_ranks`` ranks."""
        if self.min_last_share is not None:
            return self.min_last_share
        return 0.75 if n_ranks <= 2 else 0.5


def clock_uncertainty_ns(run: Any) -> dict[int, int]:
    """Return each rank's worst clock-alignment uncertainty (ns) from a :class:`hvtrace.Run`."""
    out = {}
    for r, f in run.files.items():
        out[r] = max((int(e.uncertainty_ns) for e in f.clock), default=0)
    return out


def median_of_others(m: np.ndarray) -> np.ndarray:
    """Return, for every cell of ``m`` (rows x ranks), the median of the *other* ranks' values.

    NaN cells are missing values (ignored); a cell whose row has no other value gets NaN.
    Vectorized: rows are sorted once and the cell's own value is skipped by index arithmetic.
    """
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError("median_of_others needs a 2-D array")
    rows, cols = m.shape
    if cols == 0 or rows == 0:
        return np.full_like(m, np.nan)
    order = np.argsort(m, axis=1, kind="stable")  # NaN sort last
    srt = np.take_along_axis(m, order, axis=1)
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(cols)[None, :].repeat(rows, axis=0), axis=1)
    valid = np.isfinite(m)
    n_valid = valid.sum(axis=1, keepdims=True)
    own = valid.astype(np.int64)
    c = n_valid - own  # how many others
    k = np.where(valid, pos, cols)  # own position in the sorted row (none: past the end)

    def pick(i: np.ndarray) -> np.ndarray:
        # i-th smallest of the others: skip the cell's own position
        j = np.where(i >= k, i + 1, i)
        j = np.clip(j, 0, cols - 1)
        return np.take_along_axis(srt, j, axis=1)

    c_b = np.broadcast_to(c, m.shape)
    lo = np.maximum((c_b - 1) // 2, 0)
    hi = np.maximum(c_b // 2, 0)
    out = (pick(lo) + pick(hi)) / 2.0
    return np.where(c_b > 0, out, np.nan)


def nanmedian(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """The median along ``axis`` of ``x``, NaN skipped (NaN where all are), as pandas' and
    numpy's (the mean of the two middle values): one sort, no per-column Python (numpy's
    ``nanmedian`` of small arrays with NaN goes through masked arrays, 100 times slower)."""
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, 0)
    if not x.shape[0]:
        return np.full(x.shape[1:], np.nan)
    srt = np.sort(x, axis=0)  # NaN last
    n = (~np.isnan(x)).sum(axis=0)
    lo = np.take_along_axis(srt, np.maximum((n - 1) // 2, 0)[None], axis=0)[0]
    hi = np.take_along_axis(srt, np.maximum(n // 2, 0)[None], axis=0)[0]
    return np.where(n > 0, (lo + hi) / 2.0, np.nan)


def _floats(col: pd.Series) -> np.ndarray:
    """A column as float64, NaN where it is missing (NA)."""
    return col.to_numpy(np.float64, na_value=np.nan)


class StepGrid:
    """The rows of a step table on a (step x rank) grid: a column of the table becomes an array
    with one row per step (sorted) and one column per rank of ``ranks``, NaN where the rank has
    no row for that step. Per-rank medians and per-step comparisons across ranks are then numpy
    reductions over one axis (the pandas index work of a groupby and an unstack per column was
    most of a live window's judging). A step table has one row per (rank, step); where one
    occurs twice, the grid keeps one of them."""

    def __init__(self, steps: pd.DataFrame, ranks: np.ndarray) -> None:
        step = steps["step"].to_numpy(np.int64)
        #: the steps of the grid's rows, sorted
        self.steps = np.unique(step)
        self.ranks = np.asarray(ranks)
        self._si = np.searchsorted(self.steps, step)
        self._ri = np.searchsorted(self.ranks, steps["rank"].to_numpy(np.int64))
        self.shape = (len(self.steps), len(self.ranks))
        #: where a rank has a row for a step
        self.present = np.zeros(self.shape, dtype=bool)
        self.present[self._si, self._ri] = True

    def place(self, values: Any) -> np.ndarray:
        """The grid of one column's ``values`` (in the table's row order), as float64."""
        out = np.full(self.shape, np.nan)
        out[self._si, self._ri] = np.asarray(values, dtype=np.float64)
        return out

    def cells(self, rank: Any, step: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where another table's rows (``rank``, ``step``) fall on the grid: their step and
        rank indices, and whether the grid has a row there (False: the indices mean nothing)."""
        rank = np.asarray(rank, dtype=np.int64)
        step = np.asarray(step, dtype=np.int64)
        if not (self.shape[0] and self.shape[1]):
            none = np.zeros(len(rank), dtype=np.int64)
            return none, none, np.zeros(len(rank), dtype=bool)
        si = np.minimum(np.searchsorted(self.steps, step), self.shape[0] - 1)
        ri = np.minimum(np.searchsorted(self.ranks, rank), self.shape[1] - 1)
        inside = (self.steps[si] == step) & (self.ranks[ri] == rank)
        return si, ri, inside & self.present[si, ri]

    def sums(self, rank: Any, step: Any, values: Any) -> np.ndarray:
        """The grid of ``values`` summed per (rank, step) of another table's rows: 0 where the
        grid has a row but the table none, NaN where the grid has no row (rows of the table
        outside the grid are left out)."""
        si, ri, inside = self.cells(rank, step)
        out = np.where(self.present, 0.0, np.nan)
        np.add.at(out, (si[inside], ri[inside]), np.asarray(values, dtype=np.float64)[inside])
        return out


@dataclass(frozen=True)
class PhaseGrids:
    """The candidate phases' evidence on a :class:`StepGrid`, each a (step x rank) array in ms.

    ``phases``: the built-in :data:`WORK_PHASES` present (phases zero everywhere dropped), then
    ``user:NAME`` for the user spans with the most total time. ``duration``: each phase's time
    (a user span: 0 in a step without it); ``cpu`` / ``runq``: the training thread's CPU time
    and run-queue wait in it, NaN where not measured (a user span measured somewhere: 0 in a step
    without it)."""

    phases: list[str]
    duration: dict[str, np.ndarray]
    cpu: dict[str, np.ndarray]
    runq: dict[str, np.ndarray]


def phase_grids(
    steps: pd.DataFrame,
    users: pd.DataFrame | None,
    grid: StepGrid,
    max_user_names: int = 16,
) -> PhaseGrids:
    """The :class:`PhaseGrids` of ``steps`` (the grid's table) and the user spans ``users``
    (:func:`hvtrace.analysis.engine.user_table`) of its steps: the ``max_user_names`` names with
    the most time in them."""
    phases: list[str] = []
    dur: dict[str, np.ndarray] = {}
    cause: dict[str, dict[str, np.ndarray]] = {"cpu": {}, "runq": {}}
    nan = np.full(grid.shape, np.nan)
    for p in WORK_PHASES:
        col = steps[f"{p}_ns"].to_numpy(dtype=np.float64) / 1e6
        if not np.nansum(np.abs(col)) > 0:
            continue
        phases.append(p)
        dur[p] = grid.place(col)
        for which, out in cause.items():
            c = f"{p}_{which}_ns"
            out[p] = grid.place(steps[c].to_numpy(np.float64) / 1e6) if c in steps.columns else nan
    if users is not None and len(users):
        u = users[grid.cells(users["rank"], users["step"])[2]]
        if len(u):
            top = u.groupby("name")["dur_ns"].sum().nlargest(max_user_names).index
            for name in sorted(top):
                mine = u[u["name"] == name]
                p = f"user:{name}"
                phases.append(p)
                dur[p] = grid.sums(mine["rank"], mine["step"], mine["dur_ns"]) / 1e6
                for which, out in cause.items():
                    c = f"{which}_ns"
                    got = mine[mine[c].notna()] if c in mine.columns else mine.iloc[:0]
                    # pandas sums NaN to 0: only measured spans; a span measured nowhere: NaN
                    out[p] = grid.sums(got["rank"], got["step"], got[c]) / 1e6 if len(got) else nan
    return PhaseGrids(phases, dur, cause["cpu"], cause["runq"])


def own_time(duration: Any, runq: Any) -> Any:
    """A phase's *own* time: its duration less its run-queue wait (missing or negative wait:
    none). On a host short of CPU the wait is largely the other ranks' doing (the rank that is
    behind waits for a CPU while its peers spin in Horovod's wait); what is left is the rank's
    CPU time and blocked time.

    For (step x rank) grids (:class:`StepGrid`; the last two axes): a rank whose wait was
    measured on some steps only (short steps read the CPU counters on one step in k,
    ``$HVTRACE_COUNTERS_MS``) has no own time (NaN) on its other steps, whose wait is unknown
    rather than none."""
    runq = np.asarray(runq, dtype=np.float64)
    seen = ~np.isnan(runq)
    own = np.asarray(duration, dtype=np.float64) - np.clip(np.where(seen, runq, 0.0), 0.0, None)
    if runq.ndim >= 2:
        own = np.where(seen | ~seen.any(axis=-2, keepdims=True), own, np.nan)
    return own


def split_cause(
    excess_ms: float,
    work_ms: float,
    contention_ms: float,
    margin_ms: float | None = None,
    runq_per_own: float | None = None,
) -> dict[str, Any]:
    """Split a phase's excess over the other ranks into its causes.

    ``work_ms``: the rank's extra CPU time in the phase; ``contention_ms``: its extra run-queue
    wait (both per-rank medians minus the other ranks' median, like ``excess_ms``). The rest is
    ``blocked``. Returns ``cause`` (the largest part, "" when the parts were not measured) and
    ``work_ms``, ``contention_ms``, ``blocked_ms``. With ``margin_ms``, contention is the cause
    only when neither work nor blocked time reaches the margin: on a host short of CPU, extra
    work waits for a CPU too (4 ranks on 2 cores: a ms of CPU takes about two), and a rank that
    is behind waits for one while its peers spin; the contention follows the cause.

    ``runq_per_own``: the rank's run-queue wait per ms of its own time over the step (outside
    ``synchronize``). With it, extra work must also account for the contention: it takes the
    cause from contention only when the contention is at most :data:`INDUCED_WAIT_FACTOR` times
    what that work would wait for at this rate. On a busy host the CPU time of the same work
    differs across ranks by a few ms; a rank that waited far longer than that would explain was
    late by waiting, not by its work (a correct 2-rank job on a busy 2-core host: backward +2.2
    ms of CPU time, +3.4 ms of run-queue wait at 0.37 ms a ms, was called slow by its work).
    """
    if not (np.isfinite(excess_ms) and np.isfinite(work_ms) and np.isfinite(contention_ms)):
        nan = float("nan")
        return {"cause": "", "work_ms": nan, "contention_ms": nan, "blocked_ms": nan}
    blocked = excess_ms - work_ms - contention_ms
    parts = {"work": work_ms, "contention": contention_ms, "blocked": blocked}
    cause = max(CAUSES, key=lambda c: parts[c])
    if cause == "contention" and margin_ms is not None:
        cause = _own_cause(parts, margin_ms, runq_per_own) or cause
    return {
        "cause": cause,
        "work_ms": float(work_ms),
        "contention_ms": float(contention_ms),
        "blocked_ms": float(blocked),
    }


def _own_cause(parts: dict[str, float], margin_ms: float, runq_per_own: float | None) -> str | None:
    """The rank's own part that the contention follows (:func:`split_cause`): ``work`` or
    ``blocked`` (the larger where both qualify) at or above ``margin_ms``, work only if it is
    larger than the contention or accounts for it at the rank's rate of waiting; None if
    neither."""
    rate = runq_per_own if runq_per_own is not None else float("nan")
    induced_ms = INDUCED_WAIT_FACTOR * parts["work"] * max(rate, 0.0)
    unexplained = parts["contention"] > max(parts["work"], induced_ms)
    ok = {
        "work": parts["work"] >= margin_ms and not (np.isfinite(rate) and unexplained),
        "blocked": parts["blocked"] >= margin_ms,
    }
    own = [c for c in ok if ok[c]]
    return max(own, key=lambda c: parts[c]) if own else None


def _own_part(split: dict[str, Any], margin_ms: float, runq_per_own: float) -> bool:
    """Whether the work or blocked part of a :func:`split_cause` result is the rank's own doing
    (:func:`_own_cause`); False where the parts were not measured."""
    if split["cause"] not in CAUSES:
        return False
    return _own_cause({c: split[f"{c}_ms"] for c in CAUSES}, margin_ms, runq_per_own) is not None


#: Extra work explains a rank's extra run-queue wait up to this many times what the work would
#: wait at the rank's rate over the step (:func:`split_cause`). On the verdict matrix's busy
#: hosts, ranks given 30 ms of extra work waited 0.07-1.4 times that (6 runs at 2 and 4 ranks,
#: 3 of them recorded after the factor was chosen); ranks of correct jobs named late by waiting
#: for a CPU, with 1.8-4 ms more CPU time in the phase, 4.1-6 times. 2.5 is about the geometric
#: middle of 1.4 and 4.1.
INDUCED_WAIT_FACTOR: Final = 2.5

#: A rank "runs slower throughout" (cause ``speed``, :func:`speed_explains`) when each of at
#: least :data:`SPEED_MIN_PHASES` of its other built-in phases, the update among them (each at
#: least :data:`SPEED_MIN_PHASE_MS` long on the other ranks), takes at least
#: :data:`SPEED_MIN_RATIO` times the other ranks' own time, and the named phase's own excess is
#: no more than their median ratio accounts for plus the work margin. A correct 2-rank job on
#: this VM's CI (a vCPU slower than the other): rank 1's CPU time 18-34 % above rank 0's in every
#: phase, the update too (the same optimizer step on the same parameters on every rank), was
#: called slow by its work; a correct CNN job's live window: rank 0 17-57 % slower in every phase
#: (backward 41 %, update 17 %), then rank 1 the next window.
SPEED_MIN_RATIO: Final = 1.05
SPEED_MIN_PHASES: Final = 2
SPEED_MIN_PHASE_MS: Final = 0.5


def speed_explains(
    own_ms: np.ndarray,
    others_ms: np.ndarray,
    k: int,
    candidates: np.ndarray,
    control: int | None,
    margin_ms: float,
) -> tuple[float, float]:
    """Whether a rank's excess in phase ``k`` is the slowdown it shows in every phase.

    ``own_ms`` / ``others_ms``: the rank's median own time per phase (duration less run-queue
    wait) and the other ranks' median of theirs; ``candidates``: the indices of the built-in
    phases; ``control``: the update's (the same optimizer step on every rank, whatever the
    data). The phases compared are the other candidates long enough on the other ranks
    (:data:`SPEED_MIN_PHASE_MS`); the update must be among them, and each must be at least
    :data:`SPEED_MIN_RATIO` times the others' (more work in one phase, or more data per step,
    leaves some phase, the update at least, at about the others' time). Returns ``(ratio,
    speed_ms)``: ``ratio`` the median of those phases' ratios (NaN where too few to compare);
    ``speed_ms`` what it accounts for in phase ``k`` (``others_ms[k] * (ratio - 1)``) when the
    gate holds and phase ``k``'s own excess is within it plus ``margin_ms``, else NaN. The
    median, not the smallest: the same slower processor slows phases unequally (a CNN's
    backward 41 %, its update 17 %)."""
    nan = float("nan")
    others = [int(j) for j in candidates if j != k]
    with np.errstate(all="ignore"):
        ratios = np.array([own_ms[j] / others_ms[j] for j in others], dtype=np.float64)
        base = np.array([others_ms[j] for j in others], dtype=np.float64)
    ok = np.isfinite(ratios) & (base >= SPEED_MIN_PHASE_MS)
    if ok.sum() < SPEED_MIN_PHASES:
        return nan, nan
    ratio = float(np.median(ratios[ok]))
    gated = control is not None and control in [j for j, o in zip(others, ok) if o]
    if not gated or ratios[ok].min() < SPEED_MIN_RATIO or not np.isfinite(others_ms[k]):
        return ratio, nan
    speed_ms = float(others_ms[k] * (ratio - 1.0))
    excess = float(own_ms[k] - others_ms[k])
    return ratio, (speed_ms if excess <= speed_ms + margin_ms else nan)


def straggler_table(
    steps: pd.DataFrame,
    users: pd.DataFrame | None = None,
    hosts: dict[int, str] | None = None,
    clock_uncertainty: dict[int, int] | None = None,
    skip_steps: int = 1,
    config: StragglerConfig | None = None,
) -> pd.DataFrame:
    """Return one row per rank with the straggler evidence and the verdict.

    ``steps``: :func:`hvtrace.analysis.steps.step_table`; ``users``:
    :func:`hvtrace.analysis.engine.user_table`; ``hosts``: rank -> host; ``clock_uncertainty``:
    rank -> ns (:func:`clock_uncertainty_ns`).

    Columns: ``rank``, ``host``, ``steps`` (analyzed), ``late_ms`` (median lateness),
    ``last_share`` (share of steps the rank arrived last), ``late_floor_ms``, ``explained_ms``
    (sum of the rank's positive built-in phase excesses over the other ranks' medians),
    ``phase`` (what it is slow in: a built-in phase or a user span name), ``phase_excess_ms``,
    ``builtin_phase`` / ``builtin_excess_ms`` (largest built-in excess), ``work_phase``,
    ``work_excess_ms`` (median per-step excess over the other ranks), ``work_share`` (share of
    steps where that excess beat ``work_floor_ms``), ``by_arrival`` / ``by_work`` (which
    criterion holds), ``named`` and ``reason`` (a short text, empty when not named); ``cause``,
    ``work_ms``, ``contention_ms``, ``blocked_ms``: ``phase_excess_ms`` split by
    :func:`split_cause` ("" and NaN where the run has no CPU measurements); ``speed_ratio``,
    ``speed_ms``: :func:`speed_explains` (the cause is then ``speed``; NaN where not looked at).
    """
    cfg = config or StragglerConfig()
    hosts = hosts or {}
    unc = clock_uncertainty or {}
    a = analyzed_steps(steps, skip_steps)
    ranks = np.sort(steps["rank"].unique())
    n_ranks = len(ranks)
    grid = StepGrid(a, ranks)
    n_steps = grid.present.sum(axis=0)
    base = pd.DataFrame({"rank": ranks})
    base["host"] = [hosts.get(int(r), "?") for r in ranks]
    base["steps"] = n_steps
    if a.empty:
        return _empty_verdicts(base)
    med_step_ns = float(a["step_ns"].median())
    if not np.isfinite(med_step_ns):
        med_step_ns = 0.0

    # arrival evidence
    late_ms = nanmedian(grid.place(_floats(a["lateness_ns"]))) / 1e6
    is_last = grid.place(_floats(a["is_last"]))
    with np.errstate(all="ignore"):
        last_share = np.nansum(is_last, axis=0) / np.isfinite(is_last).sum(axis=0)
    last_share = np.nan_to_num(last_share, nan=0.0)
    u = np.array([unc.get(int(r), 0) for r in ranks], dtype=np.float64)
    if n_ranks > 1:
        worst_other = np.array([np.max(np.delete(u, i)) for i in range(n_ranks)])
    else:
        worst_other = np.zeros(n_ranks)
    late_floor_ns = np.maximum.reduce(
        [
            u + worst_other,
            np.full(n_ranks, cfg.late_floor_frac * med_step_ns),
            np.full(n_ranks, float(cfg.min_floor_ns)),
        ]
    )
    work_floor_ns = max(cfg.work_floor_frac * med_step_ns, float(cfg.min_floor_ns))
    own_floor_ns = max(cfg.own_floor_frac * med_step_ns, float(cfg.min_floor_ns))

    # phase evidence: per-rank medians vs the other ranks' medians, and per-step excess, a
    # phase at a time (one (step x rank) array each: a large run's grids are not stacked)
    pg = phase_grids(a, users, grid)
    phases = pg.phases
    n_ph = len(phases)
    me = np.full((n_ranks, n_ph), np.nan)  # the rank's median less the others', ms
    se = np.full((n_ranks, n_ph), np.nan)  # the median per-step excess of its own time, ms
    ss = np.zeros((n_ranks, n_ph))  # the share of steps whose excess beats the line
    cause_excess = {w: np.full((n_ranks, n_ph), np.nan) for w in ("cpu", "runq")}
    own_med = np.full((n_ranks, n_ph), np.nan)  # the rank's median own time, ms
    own_others = np.full((n_ranks, n_ph), np.nan)  # the other ranks' median of theirs
    lines_ms = np.full(n_ph, work_floor_ns / 1e6)

    def excess_of_medians(g: np.ndarray) -> np.ndarray:
        med = nanmedian(g)
        return med - median_of_others(med[None, :])[0]

    for k, p in enumerate(phases):
        me[:, k] = excess_of_medians(pg.duration[p])
        cause_excess["cpu"][:, k] = excess_of_medians(pg.cpu[p])
        cause_excess["runq"][:, k] = excess_of_medians(pg.runq[p])
        # per step, the phase's own time: its duration less its run-queue wait where that was
        # measured (on a host short of CPU the wait is the others' doing, and its noise step to
        # step is larger than a sleep of a tenth of the step)
        rq = pg.runq[p]
        own = own_time(pg.duration[p], rq)
        ex = own - median_of_others(own)
        se[:, k] = nanmedian(ex)
        own_med[:, k] = nanmedian(own)
        own_others[:, k] = median_of_others(own_med[None, :, k])[0]
        if np.isfinite(rq).any():
            lines_ms[k] = own_floor_ns / 1e6
        valid = np.isfinite(ex).sum(axis=0)
        with np.errstate(all="ignore"):
            share = (ex > lines_ms[k]).sum(axis=0) / np.where(valid > 0, valid, np.nan)
        ss[:, k] = np.nan_to_num(share, nan=0.0)

    # the whole step's evidence outside synchronize (and outside collectives' blocked part):
    # the rank's own time (duration less run-queue wait) and its run-queue wait, each less the
    # other ranks' median; NaN without the counters. The phases' counter intervals tile the
    # step, but not as their spans do (backward's run from forward's end), so only the step's
    # sum is exact. And each rank's run-queue wait per ms of its own time there (split_cause)
    step_own_ms, step_runq_ms = np.full(n_ranks, np.nan), np.full(n_ranks, np.nan)
    runq_per_own = np.full(n_ranks, np.nan)
    if "step_runq_ns" in a.columns:
        out_ns, out_runq = _outside_synchronize(a)
        own_g, runq_g = own_time(grid.place(out_ns), grid.place(out_runq)), grid.place(out_runq)
        step_own_ms = excess_of_medians(own_g / 1e6)
        step_runq_ms = excess_of_medians(runq_g / 1e6)
        with np.errstate(all="ignore"):
            runq_per_own = nanmedian(runq_g) / nanmedian(own_g)
    margin = own_floor_ns / 1e6
    rows = []
    need_last = cfg.last_share_needed(n_ranks)
    b_idx = np.array([k for k, p in enumerate(phases) if not p.startswith("user:")], np.int64)
    u_idx = np.array([k for k, p in enumerate(phases) if p.startswith("user:")], np.int64)
    floor_ms = work_floor_ns / 1e6
    rq = cause_excess["runq"]
    upd = phases.index("update") if "update" in phases else None  # speed_explains' control
    for i in range(n_ranks):
        rec: dict[str, Any] = {}
        rec["late_ms"] = float(late_ms[i])
        rec["last_share"] = float(last_share[i])
        rec["late_floor_ms"] = float(late_floor_ns[i] / 1e6)
        bex = me[i, b_idx]
        rec["explained_ms"] = float(bex[bex > 0].sum())
        # the phase the rank is slow in of its own accord: its excess less the part spent
        # waiting for a CPU (on a host short of CPU the rank that is behind waits for one while
        # its peers spin in their wait for it: contention that follows lateness, whatever made
        # the rank late); by the whole excess when no phase is slow without it (contention alone)
        # (by the own-time margin, as the work criterion: where run-queue wait was measured,
        # the own time of the same work differs across ranks by a fraction of it)
        own = own_time(bex, rq[i, b_idx])
        ok_own = np.isfinite(own) & (own >= (lines_ms[b_idx] if len(b_idx) else floor_ms))
        bk = _nanargmax(np.where(ok_own, own, np.nan)) if ok_own.any() else _nanargmax(bex)
        if bk is not None:
            bp = phases[int(b_idx[bk])]
            rec["builtin_phase"], rec["builtin_excess_ms"] = bp, float(bex[bk])
        else:
            rec["builtin_phase"], rec["builtin_excess_ms"] = "", float("nan")
        phase, phase_ex = _specific_phase(me[i, u_idx], [phases[k] for k in u_idx], rec, cfg)
        # the work criterion: the phase most consistently slower than the others
        ok = (ss[i] >= 0.75) & (se[i] > lines_ms)
        n_cand = int(ok.sum())
        wk = _nanargmax(np.where(ok, se[i], np.nan)) if n_cand else _nanargmax(se[i])
        if wk is not None:
            rec["work_phase"] = phases[wk].removeprefix("user:")
            rec["work_excess_ms"] = float(se[i, wk])
            share = ss[i, wk]
            rec["work_share"] = float(share) if np.isfinite(share) else 0.0
        else:
            rec["work_phase"], rec["work_excess_ms"], rec["work_share"] = "", np.nan, 0.0
        rec["work_floor_ms"] = work_floor_ns / 1e6
        enough = n_ranks >= 2 and int(n_steps[i]) >= cfg.min_steps
        late_ok = np.isfinite(rec["late_ms"]) and rec["late_ms"] > rec["late_floor_ms"]
        need_ms = max(cfg.explain_frac * rec["late_ms"], rec["work_floor_ms"])
        explained = late_ok and rec["explained_ms"] >= need_ms
        rec["by_arrival"] = bool(
            enough and rec["last_share"] >= need_last and late_ok and explained
        )
        rec["by_work"] = bool(enough and n_cand > 0)
        if not rec["by_arrival"] and rec["by_work"]:
            # named for consistently slow work: name that phase (or the user span inside it)
            phase = rec["work_phase"]
            phase_ex = float(me[i, phases.index(_col(rec["work_phase"], phases))])
        rec["phase"], rec["phase_excess_ms"] = phase, phase_ex
        k = phases.index(_col(phase, phases)) if phase else None
        nan = float("nan")
        rec.update(
            split_cause(
                phase_ex if k is not None else nan,
                float(cause_excess["cpu"][i, k]) if k is not None else nan,
                float(cause_excess["runq"][i, k]) if k is not None else nan,
                margin,
                float(runq_per_own[i]),
            )
        )
        if (
            rec["by_arrival"]
            and not rec["by_work"]
            and step_own_ms[i] < need_ms
            and step_runq_ms[i] > 0
            and not _own_part(rec, margin, float(runq_per_own[i]))
        ):
            # late, but its own time over the step (outside synchronize, less its run-queue
            # wait) does not explain the lateness, and its phase has no part of its own (where
            # measured: _own_part, no work or blocked time beyond the margin the same work
            # differs by, unless the work does not account for a larger wait): it is late by
            # waiting for a CPU, whichever of its small parts is largest (a correct Lightning job
            # on a busy 2-core host: rank 0 6.6 ms late, its input +1.7 ms, 0.9 ms of it CPU
            # time, was called slow by its work; rank 1 16.7 ms late, "other" +3.1 ms, whose
            # counters are backward's, was called slow with no cause)
            late_by = {c: rec[c] for c in ("phase", "phase_excess_ms", *_CAUSE_PARTS)}
            k = None if rec["contention_ms"] > 0 else _nanargmax(rq[i, b_idx])
            if k is not None:  # no extra wait in its phase: name the phase it waited in most
                ki = int(b_idx[k])
                late_by = {"phase": phases[ki], "phase_excess_ms": float(bex[k])}
                late_by.update(
                    split_cause(
                        float(bex[k]),
                        float(cause_excess["cpu"][i, ki]),
                        float(rq[i, ki]),
                        margin,
                        float(runq_per_own[i]),
                    )
                )
            if late_by["contention_ms"] > 0 and not _own_part(
                late_by, margin, float(runq_per_own[i])
            ):
                rec.update(late_by, cause="contention")
        rec["speed_ratio"], rec["speed_ms"] = float("nan"), float("nan")
        kp = phases.index(_col(rec["phase"], phases)) if rec["phase"] else None
        if rec["cause"] in ("work", "blocked") and kp is not None and kp in b_idx:
            # its own part may be the slowdown it shows in every phase: a slower processor
            rec["speed_ratio"], rec["speed_ms"] = speed_explains(
                own_med[i], own_others[i], kp, b_idx, upd, margin
            )
            if np.isfinite(rec["speed_ms"]):
                rec["cause"] = "speed"
        rec["named"] = rec["by_arrival"] or rec["by_work"]
        rec["reason"] = _reason(rec) if rec["named"] else ""
        rows.append(rec)
    out = pd.concat([base, pd.DataFrame(rows)], axis=1)
    return out[_VERDICT_COLUMNS]


#: The parts of a phase's excess (:func:`split_cause`), with the cause they decide.
_CAUSE_PARTS: Final = ("cause", "work_ms", "contention_ms", "blocked_ms")

_VERDICT_COLUMNS = [
    "rank",
    "host",
    "steps",
    "late_ms",
    "last_share",
    "late_floor_ms",
    "explained_ms",
    "phase",
    "phase_excess_ms",
    "builtin_phase",
    "builtin_excess_ms",
    "work_phase",
    "work_excess_ms",
    "work_share",
    "work_floor_ms",
    "by_arrival",
    "by_work",
    "named",
    "reason",
    "cause",
    "work_ms",
    "contention_ms",
    "blocked_ms",
    "speed_ratio",
    "speed_ms",
]


def _col(phase: str, phases: list[str]) -> str:
    return phase if phase in phases else f"user:{phase}"


def _nanargmax(x: np.ndarray) -> int | None:
    """Index of the largest non-NaN value of ``x`` (first on ties), or None if there is none."""
    if x.size == 0 or not np.isfinite(x).any():
        return None
    return int(np.nanargmax(x))


def _specific_phase(
    users: np.ndarray, names: list[str], rec: dict[str, Any], cfg: StragglerConfig
) -> tuple[str, float]:
    """Return the built-in phase with the largest excess, or a user span explaining most of it.

    ``users``: the rank's excess (ms) of each user span ``names`` (``user:NAME``)."""
    bp, bx = rec["builtin_phase"], rec["builtin_excess_ms"]
    if not bp:
        return "", float("nan")
    k = _nanargmax(users)
    if k is not None and bx > 0 and users[k] >= cfg.user_prefer_frac * bx:
        return names[k].removeprefix("user:"), float(users[k])
    return bp, float(bx)


def _reason(rec: dict[str, Any]) -> str:
    parts = []
    if rec["by_arrival"]:
        parts.append(
            f"arrives last in {rec['last_share']:.0%} of steps, {rec['late_ms']:.1f} ms late"
        )
    if rec["by_work"]:
        parts.append(
            f"{rec['work_phase']} +{rec['work_excess_ms']:.1f} ms in {rec['work_share']:.0%} "
            "of steps"
        )
    return "; ".join(parts)


def _empty_verdicts(base: pd.DataFrame) -> pd.DataFrame:
    out = base.copy()
    for c in _VERDICT_COLUMNS:
        if c not in out.columns:
            out[c] = False if c in ("by_arrival", "by_work", "named") else np.nan
    for c in ("phase", "builtin_phase", "work_phase", "reason", "cause"):
        out[c] = ""
    return out[_VERDICT_COLUMNS]


#: Episodes (:func:`straggler_episodes`): the analyzed steps are cut into at most this many
#: windows, of at least :data:`EPISODE_MIN_STEPS` steps each.
EPISODE_WINDOWS: Final = 10
EPISODE_MIN_STEPS: Final = 20


def _windows(nums: np.ndarray) -> list[np.ndarray]:
    """Cut sorted step numbers into windows for :func:`straggler_episodes` (none when the run
    has fewer than two windows' worth)."""
    n = len(nums)
    w = max(EPISODE_MIN_STEPS, -(-n // EPISODE_WINDOWS))
    if n < 2 * w:
        return []
    wins = [nums[i : i + w] for i in range(0, n, w)]
    if len(wins) > 1 and len(wins[-1]) < w // 2:
        wins[-2:] = [np.concatenate(wins[-2:])]
    return wins


def _best_stretch(x: np.ndarray) -> tuple[int, int]:
    """The stretch ``[i, j]`` of ``x`` (scores, + where the fault shows, - where it does not)
    with the largest sum (Kadane)."""
    best, best_ij, cur, start = -np.inf, (0, len(x) - 1), 0.0, 0
    for k, v in enumerate(x):
        if cur <= 0:
            cur, start = 0.0, k
        cur += v
        if cur > best:
            best, best_ij = cur, (start, k)
    return best_ij


def straggler_episodes(
    steps: pd.DataFrame,
    users: pd.DataFrame | None = None,
    hosts: dict[int, str] | None = None,
    clock_uncertainty: dict[int, int] | None = None,
    skip_steps: int = 1,
    config: StragglerConfig | None = None,
) -> pd.DataFrame:
    """Ranks that are stragglers for a stretch of the run, with the steps it began and ended.

    A rank that becomes slow at step 80 of 200 is last in 60 % of the steps: the whole-run
    decision can miss it, and cannot say when it began. So the analyzed steps are also cut into
    windows (:data:`EPISODE_WINDOWS` of at least :data:`EPISODE_MIN_STEPS` steps), the same
    decision (:func:`straggler_table`) is taken in each, and a rank named in two windows in a
    row or more is decided again on those windows' steps together. A claim about part of the
    run rests on fewer steps, so there it must hold by the work criterion: one phase slower
    than the other ranks' by the margin in most of its steps (arrival alone is not enough: on a
    busy host a rank can be last in most steps of a stretch by the others' doing). The
    episode's first and last step are then found over the whole run: the stretch where the
    named phase's own time (less its run-queue wait) exceeds the other ranks' by more than half
    of its median excess in the episode's windows (the maximum-sum stretch of +1 for such a
    step, -1 for another).

    An episode whose cause is contention is not kept: on a host short of CPU, whichever rank is
    behind waits for a CPU while its peers spin in their wait for it (Horovod's wait yields but
    stays runnable), for a stretch, then another rank does; that is the host's contention
    (:func:`host_contention`), and a rank whose CPU is taken all along (a neighbour pinned to
    its core) is named by the whole-run decision.

    Returns one row per episode, the longest first: ``rank``, ``first_step``, ``last_step``,
    ``steps_in`` and the verdict columns of :func:`straggler_table` over the episode's steps.
    """
    cfg = config or StragglerConfig()
    cols = ["rank", "first_step", "last_step", "steps_in", *_VERDICT_COLUMNS[1:]]
    empty = pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    a = analyzed_steps(steps, skip_steps)
    if a.empty or a["rank"].nunique() < 2:
        return empty
    nums = np.sort(a["step"].unique())
    wins = _windows(nums)
    if not wins:
        return empty

    def decide(sel: np.ndarray) -> pd.DataFrame:
        sub = a[a["step"].isin(sel)]
        us = users[users["step"].isin(sel)] if users is not None and len(users) else users
        return straggler_table(sub, us, hosts, clock_uncertainty, 0, cfg)

    pg: list[tuple[StepGrid, PhaseGrids]] = []  # the run's phases, built once when needed

    def own_wide(phase: str) -> pd.DataFrame | None:
        """Per (step, rank), the own time of ``phase`` over the whole run (None: no column)."""
        if not pg:
            grid = StepGrid(a, np.sort(a["rank"].unique()))
            pg.append((grid, phase_grids(a, users, grid)))
        grid, g = pg[0]
        col = _col(phase, g.phases)
        if col not in g.phases:
            return None
        own = own_time(g.duration[col], g.runq[col])
        return pd.DataFrame(own, index=grid.steps, columns=grid.ranks)

    named = []
    for w in wins:
        v = decide(w)
        named.append(set(int(r) for r in v.loc[v["named"], "rank"]))
    rows = []
    for r in sorted({r for n in named for r in n}):
        k = 0
        while k < len(wins):
            if r not in named[k]:
                k += 1
                continue
            j = k
            while j + 1 < len(wins) and r in named[j + 1]:
                j += 1
            if j > k:
                row = _episode(r, wins, k, j, decide, own_wide)
                if row is not None:
                    rows.append(row)
            k = j + 1
    if not rows:
        return empty
    out = pd.DataFrame(rows)
    out = out.sort_values(["steps_in", "late_ms"], ascending=False, kind="stable")
    return out[cols].reset_index(drop=True)


def _episode(
    r: int,
    wins: list[np.ndarray],
    k: int,
    j: int,
    decide: Any,
    own_wide: Any,
) -> dict[str, Any] | None:
    """Rank ``r``'s episode over windows ``k..j``: decided again on their steps, then its
    first and last step found over the whole run (the stretch that overlaps the windows).
    ``own_wide(phase)``: that phase's own time per (step, rank) over the run."""
    v = decide(np.concatenate(wins[k : j + 1])).set_index("rank")
    if r not in v.index:
        return None
    rec = v.loc[r].to_dict()
    if not rec["by_work"]:
        return None  # a claim on part of the run needs one phase slower in most of its steps
    if rec["cause"] == "contention":
        return None  # contention for a stretch: the host's (host_contention), not the rank's
    first, last = int(wins[k][0]), int(wins[j][-1])
    wide = own_wide(str(rec["phase"])) if rec["phase"] else None
    if wide is not None and r in wide.columns:
        ex = wide.to_numpy() - median_of_others(wide.to_numpy())
        mine = ex[:, list(wide.columns).index(r)]
        inside = (wide.index >= first) & (wide.index <= last)
        typical = float(np.nanmedian(mine[inside])) if inside.any() else float("nan")
        line = 0.5 * max(typical if np.isfinite(typical) else 0.0, 0.0)
        # a step without an own time (its run-queue wait unread: short steps read the counters
        # on one step in k) is no evidence either way
        score = np.where(np.isfinite(mine), np.where(mine > line, 1.0, -1.0), 0.0)
        i0, i1 = _best_stretch(score)
        if int(wide.index[i0]) <= last and int(wide.index[i1]) >= first:
            first, last = int(wide.index[i0]), int(wide.index[i1])
    rec.update(rank=r, first_step=first, last_step=last, steps_in=last - first + 1)
    return rec


def merge_episodes(
    verdicts: pd.DataFrame, episodes: pd.DataFrame, steps: pd.DataFrame, skip_steps: int = 1
) -> pd.DataFrame:
    """Return ``verdicts`` with ``from_step`` / ``to_step`` (the steps a rank was slow in, NaN
    for the whole run) and the ranks named only in an episode named, with that episode's
    evidence (its longest episode; the reason says which steps)."""
    v = verdicts.copy()
    v["from_step"] = np.nan
    v["to_step"] = np.nan
    if episodes.empty or v.empty:
        return v
    a = analyzed_steps(steps, skip_steps)
    lo, hi = int(a["step"].min()), int(a["step"].max())
    slack = max(EPISODE_MIN_STEPS // 2, 1)
    for _, e in episodes.drop_duplicates("rank").iterrows():
        m = v["rank"] == e["rank"]
        if not m.any():
            continue
        whole = e["first_step"] - lo <= slack and hi - e["last_step"] <= slack
        i = v.index[m][0]
        if not bool(v.at[i, "named"]):
            for c in _VERDICT_COLUMNS[1:]:
                v.at[i, c] = e[c]
            v.at[i, "reason"] = f"steps {int(e['first_step'])}-{int(e['last_step'])}: {e['reason']}"
        elif whole:
            continue
        if not whole:
            v.at[i, "from_step"] = int(e["first_step"])
            v.at[i, "to_step"] = int(e["last_step"]) if hi - e["last_step"] > slack else np.nan
    return v


def find_stragglers(verdicts: pd.DataFrame) -> pd.DataFrame:
    """Return the named stragglers of :func:`straggler_table`, latest first.

    Columns: ``rank``, ``host``, ``late_ms``, ``last_share``, ``phase``, ``phase_excess_ms``,
    ``reason``, ``cause``, ``work_ms``, ``contention_ms``, ``blocked_ms``, ``speed_ratio``,
    ``speed_ms``.
    """
    cols = [
        "rank",
        "host",
        "late_ms",
        "last_share",
        "phase",
        "phase_excess_ms",
        "reason",
        "cause",
        "work_ms",
        "contention_ms",
        "blocked_ms",
        "speed_ratio",
        "speed_ms",
    ]
    cols += [c for c in ("from_step", "to_step") if c in verdicts.columns]
    named = verdicts[verdicts["named"]]
    return named.sort_values("late_ms", ascending=False)[cols].reset_index(drop=True)


def slow_hosts(
    verdicts: pd.DataFrame,
    steps: pd.DataFrame,
    skip_steps: int = 1,
    config: StragglerConfig | None = None,
) -> pd.DataFrame:
    """Return the hosts all of whose ranks (2 or more) are late, when the run has several hosts.

    A rank counts as late when its median lateness is above its floor and its phases explain it,
    or when it is named for consistently slow work. A host is named when all its ranks are late,
    some rank elsewhere is not, and the last rank of a step is on that host in a clear majority of
    steps (the same share as for ranks, counting hosts). Columns: ``host``, ``ranks`` (list),
    ``late_ms`` (median of its ranks'), ``last_share``, ``phase`` (its ranks' most common phase),
    ``cause`` (its ranks' most common cause, "" when not measured).
    """
    cols = ["host", "ranks", "late_ms", "last_share", "phase", "cause"]
    cfg = config or StragglerConfig()
    v = verdicts
    if v.empty or v["host"].nunique() < 2:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    late = (v["late_ms"] > v["late_floor_ms"]) & (
        v["explained_ms"] >= np.maximum(cfg.explain_frac * v["late_ms"], v["work_floor_ms"])
    )
    late |= v["by_work"]
    a = analyzed_steps(steps, skip_steps)
    last = a[a["is_last"]][["step", "rank"]]
    host_of = dict(zip(v["rank"], v["host"]))
    last_host = last["rank"].map(host_of)
    n_steps = max(a["step"].nunique(), 1)
    need = cfg.last_share_needed(v["host"].nunique())
    # steps in which some rank of each host was last
    host_steps = pd.DataFrame({"step": last["step"], "host": last_host}).drop_duplicates()
    last_steps = host_steps.groupby("host").size()
    n_late = int(late.sum())
    rows = []
    for host, grp in v.groupby("host", sort=True):
        if len(grp) < 2:
            continue
        late_here = int(late[grp.index].sum())
        all_late = late_here == len(grp)
        others_ok = (len(v) - len(grp)) - (n_late - late_here) > 0
        share = float(last_steps.get(host, 0) / n_steps)
        if all_late and others_ok and share >= need:
            phase = grp["phase"].replace("", np.nan).mode()
            cause = grp["cause"].replace("", np.nan).mode() if "cause" in grp else phase[:0]
            rows.append(
                {
                    "host": host,
                    "ranks": [int(r) for r in grp["rank"]],
                    "late_ms": float(grp["late_ms"].median()),
                    "last_share": share,
                    "phase": str(phase.iloc[0]) if len(phase) else "",
                    "cause": str(cause.iloc[0]) if len(cause) else "",
                }
            )
    return pd.DataFrame(rows, columns=cols)


def mark_host_stragglers(verdicts: pd.DataFrame, hosts_df: pd.DataFrame) -> pd.DataFrame:
    """Return ``verdicts`` with every rank of a slow host named (reason says so)."""
    if hosts_df.empty:
        return verdicts
    v = verdicts.copy()
    for _, h in hosts_df.iterrows():
        m = v["host"] == h["host"]
        note = f"all ranks of host {h['host']} are late"
        v.loc[m, "reason"] = [f"{r}; {note}" if r else note for r in v.loc[m, "reason"]]
        v.loc[m & (v["phase"] == ""), "phase"] = h["phase"]
        v.loc[m, "named"] = True
    return v


#: A host is short of CPU when its ranks wait for one at least this share of their time outside
#: ``synchronize`` (see :func:`host_contention`).
CONTENTION_STEP_SHARE: Final = 0.10


def _outside_synchronize(s: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Each step's time outside ``synchronize`` (and outside the blocked part of collectives
    outside the optimizer) and the run-queue wait in it, ns (``s`` has the cause counters): the
    wait there is left out, since Horovod 0.28's wait spins on ``sched_yield`` and counts
    run-queue wait whenever another thread takes the CPU, busy host or not."""
    wait_runq = s["wait_runq_ns"].fillna(0) if "wait_runq_ns" in s.columns else 0.0
    wait = s["wait_ns"].fillna(0) if "wait_ns" in s.columns else 0.0
    if "collective_runq_ns" in s.columns:  # blocked in a collective: the same spin
        wait_runq = wait_runq + s["collective_runq_ns"].fillna(0)
        wait = wait + s["collective_wait_ns"].fillna(0)
    return _floats(s["step_ns"] - wait), _floats(s["step_runq_ns"] - wait_runq)


def host_contention(steps: pd.DataFrame, skip_steps: int, hosts: dict[int, str]) -> pd.DataFrame:
    """Per host, how much of its ranks' own work is spent waiting for a CPU (runnable, without
    one): the run-queue wait outside ``synchronize`` (and outside the blocked part of collectives
    outside the optimizer) over the time outside it.

    ``steps``: :func:`hvtrace.analysis.steps.step_table` with the cause counters (empty result
    without them). The wait in ``synchronize`` is left out on both sides: Horovod 0.28's wait is
    a spin that calls ``sched_yield``, so a waiting rank is always runnable and counts run-queue
    wait whenever another thread takes the CPU, busy host or not. Columns: ``host``, ``ranks``
    (list), ``runq_ms`` and ``work_ms`` (per step, outside synchronize: medians over its ranks of
    their medians over the analyzed steps), ``work_share`` (``runq_ms / work_ms``),
    ``worst_rank`` and ``worst_runq_ms``, ``short`` (``work_share >= CONTENTION_STEP_SHARE``).
    Sorted by ``work_share``, largest first.
    """
    cols = ["host", "ranks", "runq_ms", "work_ms", "work_share", "worst_rank", "worst_runq_ms"]
    s = analyzed_steps(steps, skip_steps)
    if s.empty or "step_runq_ns" not in s.columns:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in [*cols, "short"]})
    # per rank, medians over its steps (a (step x rank) grid: no pandas groupby per window)
    ranks = np.sort(s["rank"].unique())
    grid = StepGrid(s, ranks)
    out_ns, out_runq = _outside_synchronize(s)
    work_runq = nanmedian(grid.place(out_runq))
    work = nanmedian(grid.place(out_ns))
    host_of = np.array([hosts.get(int(r), "?") for r in ranks], dtype=object)
    rows = []
    for host in sorted(set(host_of)):
        mine = np.flatnonzero(host_of == host)
        runq_ms = float(nanmedian(work_runq[mine])) / 1e6
        work_ms = float(nanmedian(work[mine])) / 1e6
        if not (np.isfinite(runq_ms) and work_ms > 0):
            continue
        worst = mine[int(np.nanargmax(work_runq[mine]))]
        rows.append(
            (host, [int(r) for r in ranks[mine]], runq_ms, work_ms, runq_ms / work_ms,
             int(ranks[worst]), float(work_runq[worst]) / 1e6)
        )  # fmt: skip
    out = pd.DataFrame(rows, columns=cols)
    out["short"] = out["work_share"] >= CONTENTION_STEP_SHARE
    return out.sort_values("work_share", ascending=False, kind="stable").reset_index(drop=True)


#: Why a rank 0 late by contention alone is left to its host (:func:`coordinator_contention`).
COORDINATOR_NOTE: Final = "late by contention on a host short of CPU, as Horovod's coordinator"


def coordinator_contention(verdicts: pd.DataFrame, contention: pd.DataFrame) -> pd.DataFrame:
    """Return ``verdicts`` with rank 0 no longer named when it is late by contention (its cause)
    on a host short of CPU (:func:`host_contention`): rank 0's process also runs Horovod's
    coordinator (the negotiation of every collective), one more busy thread than any other
    rank's, so on a host without a CPU to spare the contention gathers on rank 0 whatever the
    job does. That is the host's finding (it says so); ``reason`` keeps the evidence. A rank 0
    whose own core a neighbour takes is then reported with its host, not alone."""
    if verdicts.empty or contention.empty:
        return verdicts
    short = set(contention.loc[contention["short"].astype(bool), "host"])
    m = (
        (verdicts["rank"] == 0)
        & verdicts["named"].astype(bool)
        & (verdicts["cause"] == "contention")
        & verdicts["host"].isin(short)
    )
    if not m.any():
        return verdicts
    v = verdicts.copy()
    v.loc[m, "named"] = False
    v.loc[m, "reason"] = [f"{COORDINATOR_NOTE} ({r})" for r in v.loc[m, "reason"]]
    return v


def arrival_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Return per (rank, step): ``lateness_ms`` (how long after the first rank of that step the
    rank's last gradient was ready) and ``is_last``, from a step table (for plots)."""
    out = steps[["rank", "step", "lateness_ns", "is_last"]].copy()
    out["lateness_ms"] = out.pop("lateness_ns") / 1e6
    return out
