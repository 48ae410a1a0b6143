"""Whether a live window's counts can hold a lockstep verdict, decided on the matrix in numpy.

One test for two places: rank 0's judge (:mod:`hvtrace.analysis.live`) skips its pandas check
of a window where it holds (a quarter of its time a window), and rank 0's live thread
(:mod:`hvtrace.record.live`), which keeps every window's counts for the judge, drops first the
windows where it holds when too many wait (a judge that starts late must still see a break in
the first windows). The rules are the offline check's (:mod:`hvtrace.analysis.lockstep`, whose
compared counts are :data:`LOCKSTEP_COUNTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

from hvtrace.format.schema import LIVE_COUNT_COL, LIVE_COUNTS

#: The step table's counts compared across ranks at each step (:mod:`hvtrace.analysis.lockstep`):
#: gradient allreduces, collectives outside the optimizer.
LOCKSTEP_COUNTS: Final[tuple[str, ...]] = ("n_allreduce", "n_collective")
#: The columns of a window's counts (what rank 0 keeps of every window for the judge's lockstep
#: check: :data:`hvtrace.record.live.COUNTS_COLS` of the window matrix), in order.
COUNTS_FRAME_COLS: Final[tuple[str, ...]] = ("step", "backward_ns", "compute_ns", *LIVE_COUNTS)


def counts_agree(m: np.ndarray, size: int, cols: Sequence[str] | None = None) -> bool:
    """Whether a window's counts can hold no lockstep verdict: every rank's rows hold the same
    steps in the same places, with the same counts of gradient allreduces and of collectives
    outside the optimizer, and no rank ran more forward passes than backward ones at any step.
    Then :func:`~hvtrace.analysis.lockstep.sequence_break` finds no step whose counts differ and
    :func:`~hvtrace.analysis.lockstep.lone_forwards` no step, whichever rows the step table
    leaves out (exact: tests/unit/test_live_verdicts.py compares it with the check). ``m``:
    every rank's rows stacked in rank order, its columns ``cols`` (:data:`COUNTS_FRAME_COLS`),
    or a gathered window (None: the window matrix's columns)."""
    if cols is None:
        at = {"step": 0, **{c: LIVE_COUNT_COL + j for j, c in enumerate(LIVE_COUNTS)}}
    else:
        at = {c: j for j, c in enumerate(cols)}
    per = m.reshape(size, -1, m.shape[1])
    if size < 2 or not per.shape[1]:
        return True
    for c in ("step", *LOCKSTEP_COUNTS):
        col = per[:, :, at[c]]
        if not all(np.array_equal(col[0], col[r], equal_nan=True) for r in range(1, size)):
            return False
    fwd = np.nan_to_num(per[:, :, at["n_forward"]], nan=0.0)
    return not (fwd > np.nan_to_num(per[:, :, at["n_backward"]], nan=0.0)).any()
