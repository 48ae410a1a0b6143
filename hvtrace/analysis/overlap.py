"""Interval arithmetic per group, vectorized: union length, intersection length, merging.

All functions take flat numpy arrays (one entry per interval) and an integer group id per interval
(``0 .. n_groups-1``, typically one id per (rank, step)), and return one value per group. Times
are integers in nanoseconds. Nothing loops over rows or groups in Python: intervals are sorted by
(group, start) (skipped when they already are, as trace files store them), and the running
maximum of the end times within each group tells where a new merged interval begins.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

_I64_MAX = np.iinfo(np.int64).max


def merge_intervals(
    group: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return each group's merged intervals as ``(group, start, end)``, sorted by (group, start).

    Intervals that overlap or touch become one; an end before its start counts as an empty
    interval at the start. The result's intervals are disjoint within each group.
    """
    g, s, e = _sorted(group, start_ns, end_ns)
    n = len(s)
    if n == 0:
        return g, s, e
    new_group = np.empty(n, dtype=bool)
    new_group[0] = True
    np.not_equal(g[1:], g[:-1], out=new_group[1:])
    run_max = _group_cummax(g, s, e, new_group)
    new_run = new_group
    new_run[1:] |= s[1:] > run_max[:-1]
    first = np.flatnonzero(new_run)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = n - 1
    return g[first], s[first], run_max[last]


def union_ns(
    group: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray, n_groups: int
) -> np.ndarray:
    """Return the length (ns, int64) of the union of each group's intervals.

    ``group`` holds integer ids in ``0 .. n_groups-1``. Overlapping and nested intervals count
    once; groups without intervals get 0.
    """
    g, s, e = merge_intervals(group, start_ns, end_ns)
    return np.bincount(g, weights=e - s, minlength=n_groups).round().astype(np.int64)


def intersection_ns(
    group_a: np.ndarray,
    start_a: np.ndarray,
    end_a: np.ndarray,
    group_b: np.ndarray,
    start_b: np.ndarray,
    end_b: np.ndarray,
    n_groups: int,
) -> np.ndarray:
    """Return, per group, the length (ns) of (union of A's intervals) ∩ (union of B's intervals).

    Uses |A ∩ B| = |A| + |B| - |A ∪ B|, each set merged first (so the final union sorts only the
    merged intervals).
    """
    ma = merge_intervals(group_a, start_a, end_a)
    mb = merge_intervals(group_b, start_b, end_b)
    return intersection_merged(ma, mb, n_groups)


def intersection_merged(
    ma: tuple[np.ndarray, np.ndarray, np.ndarray],
    mb: tuple[np.ndarray, np.ndarray, np.ndarray],
    n_groups: int,
) -> np.ndarray:
    """:func:`intersection_ns` for interval sets already merged by :func:`merge_intervals`."""
    ua = np.bincount(ma[0], weights=ma[2] - ma[1], minlength=n_groups)
    ub = np.bincount(mb[0], weights=mb[2] - mb[1], minlength=n_groups)
    uab = union_ns(
        np.concatenate([ma[0], mb[0]]),
        np.concatenate([ma[1], mb[1]]),
        np.concatenate([ma[2], mb[2]]),
        n_groups,
    )
    return (ua + ub).round().astype(np.int64) - uab


def _sorted(
    group: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (group, start, end) as int64 sorted by (group, start), end clipped to >= start."""
    g = np.asarray(group, dtype=np.int64)
    s = np.asarray(start, dtype=np.int64)
    e = np.maximum(np.asarray(end, dtype=np.int64), s)
    n = len(s)
    if n < 2:
        return g, s, e
    dg = np.diff(g)
    in_order = bool((dg >= 0).all()) and bool(((dg > 0) | (np.diff(s) >= 0)).all())
    if in_order:
        return g, s, e
    o = np.argsort(s, kind="stable")
    o = o[np.argsort(g[o], kind="stable")]
    return g[o], s[o], e[o]


def _group_cummax(g: np.ndarray, s: np.ndarray, e: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Running maximum of ``e`` restarting at each group (rows sorted by (group, start)).

    Each group's ends are taken relative to its first start (so they are >= 0 and bounded by the
    group's extent X) and offset by ``group index x (X + 1)``: the keys of a later group are then
    all larger than an earlier group's, and one global ``np.maximum.accumulate`` is the running
    maximum within every group. Falls back to pandas when the offsets would overflow int64.
    """
    if new.all():
        return e
    idx = np.cumsum(new) - 1  # 0-based group index along the sorted rows
    base = s[new][idx]
    rel = e - base
    extent = int(rel.max()) + 1
    if extent <= 0 or idx[-1] >= _I64_MAX // extent - 1:
        return pd.Series(e).groupby(g, sort=False).cummax().to_numpy(dtype=np.int64)
    off = idx * extent
    return np.maximum.accumulate(rel + off) - off + base
