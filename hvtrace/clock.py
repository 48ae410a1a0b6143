"""Clock offset estimation and alignment across ranks and hosts.

Every rank stamps spans on its own monotonic clock. To put all ranks on rank 0's clock, the recorder
runs a few rounds of a barrier-like collective (at start, at scheduled steps, and at ``finish()``):
each rank notes its monotonic time just before entering (``enter_ns``) and just after leaving
(``exit_ns``) each round. A barrier cannot release before every rank entered, and no rank leaves
before it released, so for rank *i* and round *r* the offset ``theta_i - theta_0`` (local clock
minus rank 0's clock) lies in ``[enter_i - exit_0, exit_i - enter_0]``. Intersecting these intervals
over rounds bounds the offset; the estimate is the midpoint and the uncertainty half the width.

Collectives take milliseconds, so the recorder also times TCP round trips to rank 0
(:mod:`hvtrace.record.clocksync`): rank 0 answered between the request's ``t1`` and the answer's
``t3``, so the offset lies in ``[t1 - t2, t3 - t2]`` (``t2``: rank 0's clock in the answer), and
:func:`estimate_from_round_trips` intersects those intervals the same way. Each estimate says how
it was obtained (``method``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClockEstimate:
    """One rank's offset to rank 0: ``local_ns - offset_ns`` is rank 0's clock.

    ``at_ns`` is the local monotonic time of the estimate, ``uncertainty_ns`` the half width of the
    interval the offset is known to lie in, ``rounds`` the number of collective rounds used and
    ``bounded`` whether the interval intersection was non-empty (False: median fallback),
    ``method`` how the rounds were taken: ``barrier`` (collective rounds), ``round-trip`` (TCP
    round trips to rank 0) or ``same-clock`` (rank 0's very clock: offset 0 exactly).
    """

    at_ns: int
    offset_ns: int
    uncertainty_ns: int
    rounds: int
    bounded: bool = True
    method: str = "barrier"

    def to_dict(self) -> dict[str, int | bool]:
        """Return the estimate as a JSON-ready dict (all times in ns)."""
        return {
            "at_ns": self.at_ns,
            "offset_ns": self.offset_ns,
            "uncertainty_ns": self.uncertainty_ns,
            "rounds": self.rounds,
            "bounded": self.bounded,
            "method": self.method,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ClockEstimate:
        """Build an estimate from :meth:`to_dict` output."""
        return cls(
            int(d["at_ns"]),
            int(d["offset_ns"]),
            int(d["uncertainty_ns"]),
            int(d["rounds"]),
            bool(d.get("bounded", True)),
            str(d.get("method", "barrier")),
        )


def estimate_offsets(enter_ns: np.ndarray, exit_ns: np.ndarray) -> list[ClockEstimate]:
    """Estimate every rank's offset to rank 0 from barrier rounds.

    ``enter_ns`` and ``exit_ns`` have shape ``(size, rounds)``: each rank's monotonic time just
    before entering and just after leaving each round. Returns one :class:`ClockEstimate` per rank
    (rank 0's is exactly zero), with ``at_ns`` the rank's exit time of its last round.
    """
    enter = np.asarray(enter_ns, dtype=np.int64)
    exit_ = np.asarray(exit_ns, dtype=np.int64)
    if enter.shape != exit_.shape or enter.ndim != 2 or enter.shape[1] == 0:
        raise ValueError(f"enter/exit must have the same (size, rounds) shape, got {enter.shape}")
    size, rounds = enter.shape
    out = []
    for i in range(size):
        at_ns = int(exit_[i, -1])
        if i == 0:
            out.append(ClockEstimate(at_ns, 0, 0, rounds))
            continue
        out.append(_intersect(enter[i] - exit_[0], exit_[i] - enter[0], at_ns, "barrier"))
    return out


def estimate_from_round_trips(
    t1_ns: np.ndarray, t2_ns: np.ndarray, t3_ns: np.ndarray
) -> ClockEstimate:
    """Estimate a rank's offset to rank 0 from round trips: it sent at ``t1`` and got the answer
    at ``t3`` (its clock), rank 0 stamped the answer ``t2`` (rank 0's clock). ``at_ns``: the
    last ``t3``."""
    t1, t2, t3 = (np.asarray(x, dtype=np.int64) for x in (t1_ns, t2_ns, t3_ns))
    if not (t1.shape == t2.shape == t3.shape) or t1.ndim != 1 or len(t1) == 0:
        raise ValueError("t1, t2, t3 must be equal-length, non-empty 1-d arrays")
    return _intersect(t1 - t2, t3 - t2, int(t3[-1]), "round-trip")


def _intersect(lo: np.ndarray, hi: np.ndarray, at_ns: int, method: str) -> ClockEstimate:
    """The estimate from per-round bounds ``lo <= offset <= hi``: the intersection's midpoint
    and half width, or (rounds that contradict each other: a clock stepped?) the median
    midpoint with a spread that covers every round, marked not ``bounded``."""
    rounds = len(lo)
    lo_max, hi_min = int(lo.max()), int(hi.min())
    if lo_max <= hi_min:
        mid = (lo_max + hi_min) // 2
        return ClockEstimate(at_ns, mid, (hi_min - lo_max + 1) // 2, rounds, method=method)
    mids = (lo + hi) // 2
    med = int(np.median(mids))
    spread = int(np.max(np.abs(mids - med)) + np.max(hi - lo) // 2)
    return ClockEstimate(at_ns, med, spread, rounds, bounded=False, method=method)


def offset_at(estimates: list[ClockEstimate], local_ns: np.ndarray) -> np.ndarray:
    """Return the offset (ns, int64) to subtract from each local time in ``local_ns``.

    Offsets are interpolated linearly between estimates (so clock drift between the start and the
    end of a run is corrected) and held constant before the first and after the last.
    """
    local = np.asarray(local_ns, dtype=np.int64)
    if not estimates:
        return np.zeros_like(local)
    ests = sorted(estimates, key=lambda e: e.at_ns)
    if len(ests) == 1:
        return np.full_like(local, ests[0].offset_ns)
    xs = np.array([e.at_ns for e in ests], dtype=np.float64)
    ys = np.array([e.offset_ns for e in ests], dtype=np.float64)
    # interpolate relative to the first anchor to keep float64 precision on ns timestamps
    return np.rint(np.interp(local - xs[0], xs - xs[0], ys)).astype(np.int64)


def step_offsets(
    clocks: Mapping[int, list[ClockEstimate]],
    rank: np.ndarray,
    step: np.ndarray,
    start_ns: np.ndarray,
    anchors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """THE clock-alignment rule, which every reader of spans uses (the analysis' engine, the
    span frame, the timeline window, the Perfetto and Chrome exports, the Horovod timeline's
    merge): all the spans of one (rank, step) move by one offset, the rank's estimates
    (``clocks[rank]``, :func:`offset_at`) at the step's anchor: its earliest span start among
    ``anchors`` (a mask: the step's work, not its scalars or clock rows), or among all its
    spans where none is one. So a step keeps its shape (no span's duration changes, the order of
    its spans stays), and drift is corrected from step to step. A rank without estimates: 0.

    ``rank``, ``step``, ``start_ns``: one entry per span (any order; local times). Returns
    ``(per_span_offset_ns, table)``: the offset to subtract from each span's local times, and
    ``table`` the (rank, step, offset) of each cell as an int64 array of shape (cells, 3), sorted
    by rank then step.
    """
    rank = np.asarray(rank, dtype=np.int64)
    step = np.asarray(step, dtype=np.int64)
    start = np.asarray(start_ns, dtype=np.int64)
    n = len(start)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros((0, 3), np.int64)
    order = np.lexsort((step, rank))
    r, s = rank[order], step[order]
    new = np.ones(n, bool)
    new[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1])
    first = np.flatnonzero(new)
    cell = np.cumsum(new) - 1
    big = np.iinfo(np.int64).max
    st = start[order]
    anchor = np.minimum.reduceat(st, first)
    if anchors is not None:
        work = np.minimum.reduceat(np.where(np.asarray(anchors, bool)[order], st, big), first)
        anchor = np.where(work != big, work, anchor)
    cell_rank = r[first]
    cell_off = np.zeros(len(first), np.int64)
    for k, est in clocks.items():
        if not est:
            continue
        m = cell_rank == int(k)
        if m.any():
            cell_off[m] = offset_at(est, anchor[m])
    per_span = np.empty(n, np.int64)
    per_span[order] = cell_off[cell]
    return per_span, np.column_stack([cell_rank, s[first], cell_off])


def drift_ppm(estimates: list[ClockEstimate]) -> float | None:
    """Return the drift between first and last estimate in parts per million, or None if < 2."""
    if len(estimates) < 2:
        return None
    ests = sorted(estimates, key=lambda e: e.at_ns)
    span = ests[-1].at_ns - ests[0].at_ns
    if span <= 0:
        return None
    return (ests[-1].offset_ns - ests[0].offset_ns) / span * 1e6
