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


def drift_ppm(estimates: list[ClockEstimate]) -> float | None:
    """Return the drift between first and last estimate in parts per million, or None if < 2."""
    if len(estimates) < 2:
        return None
    ests = sorted(estimates, key=lambda e: e.at_ns)
    span = ests[-1].at_ns - ests[0].at_ns
    if span <= 0:
        return None
    return (ests[-1].offset_ns - ests[0].offset_ns) / span * 1e6
