"""Where each step's time goes on each rank: the per (rank, step) table and per-rank medians.

A step on one rank (see ``docs/format.md``) runs from the end of the previous update to the end
of its own update, and is made of phases that follow each other: ``input`` (the gap before the
first forward), ``forward`` and ``backward`` (or one ``compute`` span without model hooks),
``wait`` (blocked in ``synchronize()``: communication not hidden behind compute) and ``update``.
Allreduces run *concurrently* with backward and wait, so their time is not added to the phases:
``allreduce_ns`` is the union of the step's allreduce intervals (time during which at least one
was in flight), and ``hidden_ns`` the part of it under backward/compute.

``other_ns`` is what the phases and user spans do not account for:
``step - (input + forward + backward + compute + wait + update) - user time outside those phases``
(gaps between micro-batches, work between backward and ``synchronize()``, ...).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pandas as pd

from hvtrace.analysis.overlap import intersection_merged, merge_intervals
from hvtrace.format.schema import FLAG_OWN, KIND_CODE, KINDS, PHASE_KINDS, STEP_PHASE_KINDS

#: The phases of a step, in time order (:data:`hvtrace.format.schema.PHASE_KINDS`).
PHASES: Final[tuple[str, ...]] = PHASE_KINDS
#: Phases (and the whole step) whose CPU time and run-queue wait the recorder measures: the step
#: table has ``X_cpu_ns`` and ``X_runq_ns`` for each that has measurements (see :func:`step_rows`).
CAUSE_PHASES: Final[tuple[str, ...]] = (
    *STEP_PHASE_KINDS,
    "collective",  # the blocked part of collectives outside the optimizer
)
#: Phases counted net of the time blocked in collectives outside the optimizer issued in them
#: (``wait`` is communication already).
NET_PHASES: Final[tuple[str, ...]] = tuple(p for p in PHASES if p != "wait")
#: User spans whose name starts with this are hvtrace's own (the clock collective), not user work.
INTERNAL_PREFIX: Final = "hvtrace."
#: Duration columns of :func:`step_table`, in report order (all in ns).
DURATION_COLUMNS: Final[tuple[str, ...]] = (
    "step_ns",
    "input_ns",
    "forward_ns",
    "backward_ns",
    "compute_ns",
    "model_ns",
    "allreduce_ns",
    "collective_ns",
    "collective_wait_ns",
    "comm_ns",
    "hidden_ns",
    "wait_ns",
    "update_ns",
    "user_ns",
    "other_ns",
    "lateness_ns",
)

_K = KIND_CODE
_NK = len(KINDS)


# -- input normalization ---------------------------------------------------------------------------
def kind_codes(spans: pd.DataFrame) -> np.ndarray:
    """Return each span's kind as its code in :data:`hvtrace.format.schema.KINDS` (-1 if unknown).

    Accepts a categorical ``kind`` column (as :func:`hvtrace.load_run` makes) or plain strings.
    """
    kind = spans["kind"]
    if isinstance(kind.dtype, pd.CategoricalDtype):
        lut = np.array([_K.get(str(c), -1) for c in kind.cat.categories] + [-1], dtype=np.int16)
        codes = kind.cat.codes.to_numpy()
        return lut[np.where(codes < 0, len(lut) - 1, codes)]
    cat = pd.Categorical(kind.astype(str), categories=list(KINDS))
    return cat.codes.astype(np.int16)


def name_codes(spans: pd.DataFrame) -> tuple[np.ndarray, pd.Index]:
    """Return ``(codes, names)``: each span's name as an index into ``names`` (-1 if missing)."""
    name = spans["name"]
    if not isinstance(name.dtype, pd.CategoricalDtype):
        name = name.astype("category")
    return name.cat.codes.to_numpy().astype(np.int64), pd.Index(name.cat.categories.astype(str))


def internal_mask(spans: pd.DataFrame, kinds: np.ndarray | None = None) -> np.ndarray:
    """True for hvtrace's own user spans (``hvtrace.clock_sync``) and collectives (flag
    ``FLAG_OWN``), which are not user work."""
    kinds = kind_codes(spans) if kinds is None else kinds
    codes, names = name_codes(spans)
    lut = np.append(np.asarray(names.str.startswith(INTERNAL_PREFIX), dtype=bool), False)
    own = (kinds == _K["user"]) & lut[np.where(codes < 0, len(lut) - 1, codes)]
    if "flags" in spans.columns:
        flags = spans["flags"].fillna(0).to_numpy(np.int64)
        own |= (kinds == _K["collective"]) & ((flags & FLAG_OWN) != 0)
    return own


def group_ids(rank: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(gid, ranks, steps)``: a dense id per (rank, step) pair and each id's pair.

    Ids are numbered in (rank, step) order.
    """
    rank = np.asarray(rank, dtype=np.int64)
    step = np.asarray(step, dtype=np.int64)
    if len(rank) == 0:
        e = np.zeros(0, np.int64)
        return e, e, e
    smin, smax = int(step.min()), int(step.max())
    width = smax - smin + 1
    key = rank * width + (step - smin)
    n_keys = (int(rank.max()) + 1) * width
    if len(key) > 1 and bool((key[1:] >= key[:-1]).all()):  # sorted (as files are): one pass
        change = key[1:] != key[:-1]
        first = np.concatenate([[0], np.flatnonzero(change) + 1])
        gid = np.cumsum(np.concatenate([[False], change]), dtype=np.int64)
        keys = key[first]
    elif n_keys <= 1 << 26:
        present = np.bincount(key, minlength=n_keys) > 0
        keys = np.flatnonzero(present)
        dense = np.cumsum(present) - 1
        gid = dense[key]
    else:
        keys, gid = np.unique(key, return_inverse=True)
    return gid.astype(np.int64), keys // width, keys % width + smin


# -- the per (rank, step) table --------------------------------------------------------------------
def step_table(spans: pd.DataFrame) -> pd.DataFrame:
    """Return one row per (rank, step) that has spans, sorted by (rank, step).

    ``spans``: the span table of :func:`hvtrace.load_run` (columns ``rank``, ``step``, ``kind``,
    ``name``, ``start_ns``, ``end_ns``, ``bytes``; times in ns on one clock). The same as
    :func:`step_rows` (per rank, columns documented there) followed by :func:`finish_steps`
    (across ranks); the engine in :mod:`hvtrace.analysis.engine` runs those two on summaries
    instead of one big frame.
    """
    kinds = kind_codes(spans)
    # rows that are not a step's work (scalars, clock estimates, hvtrace's own spans) get code -1
    ignore = internal_mask(spans, kinds)
    kinds = np.where(ignore, -1, kinds).astype(np.int16)
    rows = step_rows(
        spans["rank"].to_numpy(),
        spans["step"].to_numpy(),
        kinds,
        spans["start_ns"].to_numpy(dtype=np.int64),
        spans["end_ns"].to_numpy(dtype=np.int64),
        spans["bytes"].to_numpy(dtype=np.int64),
        *(
            spans[c].to_numpy(dtype=np.float64, na_value=np.nan) if c in spans.columns else None
            for c in ("cpu_ns", "runq_ns")
        ),
        spans["value"].to_numpy(dtype=np.float64, na_value=np.nan)
        if "value" in spans.columns
        else None,
    )
    return finish_steps(rows)


def step_rows(
    rank: np.ndarray,
    step: np.ndarray,
    kinds: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    nbytes: np.ndarray,
    cpu_ns: np.ndarray | None = None,
    runq_ns: np.ndarray | None = None,
    blocked_ns: np.ndarray | None = None,
) -> pd.DataFrame:
    """Reduce spans to one row per (rank, step): the per-rank half of :func:`step_table`.

    Inputs are flat arrays, one entry per span: ``kinds`` holds codes of
    :data:`hvtrace.format.schema.KINDS` (-1 for spans that are not a step's work: hvtrace's own user
    spans); scalars and clock rows are ignored too. Times in ns on one clock per rank (each
    rank's own clock is fine: nothing here compares ranks). Sorted input (by rank, step, start,
    as compacted files are) is fastest.

    Columns (durations in ns; a ``_ns`` suffix means nanoseconds, ``_gbps`` bytes per ns = GB/s):

    - ``rank``, ``step``; ``has_step``: the rank recorded this step's ``step`` span (its own
      partial step has NaN ``step_ns``/``other_ns``);
    - ``start_ns``, ``end_ns``: the step span (else the first/last span of the step);
    - ``step_ns``; the phases ``input_ns``, ``forward_ns``, ``backward_ns``, ``compute_ns``,
      ``wait_ns``, ``update_ns`` (sums of that kind's spans); ``model_ns`` = forward + backward +
      compute (time in the model);
    - ``allreduce_ns``: union of the allreduce intervals; ``hidden_ns``: the part of that union
      under backward or compute spans; ``overlap`` = hidden / allreduce (NaN without allreduce);
    - ``user_ns``: union of user spans (hvtrace's own excluded); ``other_ns``: step time no phase
      and no user span accounts for (clipped at 0);
    - collectives issued outside the optimizer (kind ``collective``; hvtrace's own have code -1),
      with ``blocked_ns`` (per span, the time the thread was blocked in it: the span's
      ``value``; NaN: all of it): ``collective_ns``, the union of their intervals in flight;
      ``collective_wait_ns``, the union of the intervals blocked in them (each the last
      ``blocked_ns`` of its span), which is communication: it is taken out of the phase it fell
      in (``input_ns`` ... ``update_ns`` and ``model_ns`` are net of it) and out of ``other_ns``;
      ``n_collective``, ``collective_bytes``;
    - ``comm_ns``: union of the allreduce and collective intervals (= ``allreduce_ns`` without
      collectives); ``hidden_ns`` and ``overlap`` are of ``comm_ns`` (the blocked time is never
      hidden);
    - ``n_allreduce``, ``allreduce_bytes``: tensors allreduced and their bytes (after compression);
      ``n_forward``, ``n_backward``: the step's forward and backward passes (micro-batches);
    - ``arrival_ns``: when the rank's last gradient became ready (latest allreduce enqueue; NA
      without allreduce); ``coll_arrival_ns``: when it issued its first collective outside the
      optimizer in the step (NA without), the step's other meeting point with the other ranks;
    - ``comm_compute_ratio`` = comm / model time; ``algbw_gbps`` = allreduce_bytes /
      allreduce_ns (a lower bound: the union includes waiting for other ranks);
    - with ``cpu_ns`` / ``runq_ns`` (per span, NaN where not measured), for each of
      :data:`CAUSE_PHASES` measured in the group: ``X_cpu_ns`` (the recording thread's CPU time
      in that phase) and ``X_runq_ns`` (its time runnable but waiting for a CPU), float32, NaN in
      a step where some span of that phase was not measured. The rest of the phase's time,
      ``X_ns - X_cpu_ns - X_runq_ns``, the thread was blocked (sleep, I/O, a lock, a queue).
    """
    kinds = np.asarray(kinds, dtype=np.int16)
    kinds = np.where((kinds == _K["scalar"]) | (kinds == _K["clock"]), -1, kinds).astype(np.int16)
    start = np.asarray(start_ns, dtype=np.int64)
    end = np.asarray(end_ns, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    # (rank, step) pairs made only of ignored rows are dropped at the end
    real_rows = kinds >= 0
    causes = {
        c: np.asarray(v, dtype=np.float64)
        for c, v in (("cpu", cpu_ns), ("runq", runq_ns))
        if v is not None and len(v) and not np.isnan(np.asarray(v, dtype=np.float64)).all()
    }
    blocked = None if blocked_ns is None else np.asarray(blocked_ns, dtype=np.float64)
    if not real_rows.all():
        keep = np.flatnonzero(real_rows)
        rank, step, kinds = np.asarray(rank)[keep], np.asarray(step)[keep], kinds[keep]
        start, end, nbytes = start[keep], end[keep], nbytes[keep]
        causes = {c: v[keep] for c, v in causes.items()}
        blocked = None if blocked is None else blocked[keep]
    gid, g_rank, g_step = group_ids(rank, step)
    n = len(g_rank)
    kk = kinds.astype(np.int64)
    cell = gid * _NK + kk
    sums = np.bincount(cell, weights=end - start, minlength=n * _NK)
    sums = sums.reshape(n, _NK).round().astype(np.int64)
    counts = np.bincount(cell, minlength=n * _NK).reshape(n, _NK)
    del cell, kk

    out = pd.DataFrame({"rank": g_rank, "step": g_step})
    is_step = kinds == _K["step"]
    has_step = counts[:, _K["step"]] > 0
    out["has_step"] = has_step
    st = np.zeros(n, np.int64)
    en = np.zeros(n, np.int64)
    st[gid[is_step]] = start[is_step]
    en[gid[is_step]] = end[is_step]
    if not has_step.all():
        loose = ~has_step[gid]
        lo = np.full(n, np.iinfo(np.int64).max, np.int64)
        hi = np.full(n, np.iinfo(np.int64).min, np.int64)
        np.minimum.at(lo, gid[loose], start[loose])
        np.maximum.at(hi, gid[loose], end[loose])
        st = np.where(has_step, st, lo)
        en = np.where(has_step, en, hi)
    out["start_ns"] = st
    out["end_ns"] = en
    step_ns = np.where(has_step, sums[:, _K["step"]], np.nan)
    out["step_ns"] = step_ns
    ar = np.flatnonzero(kinds == _K["allreduce"])
    coll = np.flatnonzero(kinds == _K["collective"])
    hide = np.flatnonzero((kinds == _K["backward"]) | (kinds == _K["compute"]))
    g_ar, s_ar = gid[ar], start[ar]
    m_ar = merge_intervals(g_ar, s_ar, end[ar])
    m_hide = merge_intervals(gid[hide], start[hide], end[hide])
    allreduce = _union(m_ar, n)
    hidden = intersection_merged(m_ar, m_hide, n)
    comm, coll_union, coll_wait = allreduce, np.zeros(n, np.int64), np.zeros(n, np.int64)
    m_block = None
    if len(coll):  # communication outside the optimizer: see the docstring
        both = np.concatenate([ar, coll])
        m_comm = merge_intervals(gid[both], start[both], end[both])
        comm = _union(m_comm, n)
        coll_union = _union(merge_intervals(gid[coll], start[coll], end[coll]), n)
        length = (end[coll] - start[coll]).astype(np.float64)
        b = length if blocked is None else blocked[coll]
        b = np.clip(np.where(np.isfinite(b), b, length), 0, length).astype(np.int64)
        m_block = merge_intervals(gid[coll], end[coll] - b, end[coll])
        coll_wait = _union(m_block, n)
        hidden = intersection_merged(m_comm, m_hide, n) - intersection_merged(m_block, m_hide, n)
        for k in NET_PHASES:
            rows_k = np.flatnonzero(kinds == _K[k])
            if len(rows_k):
                m_k = merge_intervals(gid[rows_k], start[rows_k], end[rows_k])
                sums[:, _K[k]] -= intersection_merged(m_block, m_k, n)
        if causes:  # the phase's counters net of the collective's too
            _net_counters(causes, gid, kinds, start, end, coll, end[coll] - b // 2)
    for k in PHASES:
        out[f"{k}_ns"] = sums[:, _K[k]]
    out["model_ns"] = sums[:, _K["forward"]] + sums[:, _K["backward"]] + sums[:, _K["compute"]]
    out["allreduce_ns"] = allreduce
    out["collective_ns"] = coll_union
    out["collective_wait_ns"] = coll_wait
    out["comm_ns"] = comm
    out["hidden_ns"] = hidden
    with np.errstate(invalid="ignore", divide="ignore"):
        out["overlap"] = np.where(comm > 0, hidden / np.maximum(comm, 1), np.nan)

    user = np.flatnonzero(kinds == _K["user"])
    user_union = np.zeros(n, np.int64)
    inside = np.zeros(n, np.int64)
    if len(user):
        m_user = merge_intervals(gid[user], start[user], end[user])
        user_union = _union(m_user, n)
        phase = np.flatnonzero(np.isin(kinds, [_K[k] for k in PHASES]))
        if m_block is None:
            m_phase = merge_intervals(gid[phase], start[phase], end[phase])
        else:  # blocked collective time is accounted for as well
            m_phase = merge_intervals(
                np.concatenate([gid[phase], m_block[0]]),
                np.concatenate([start[phase], m_block[1]]),
                np.concatenate([end[phase], m_block[2]]),
            )
        inside = intersection_merged(m_user, m_phase, n)
    out["user_ns"] = user_union
    phase_sum = sums[:, [_K[k] for k in PHASES]].sum(axis=1) + coll_wait
    out["other_ns"] = np.maximum(step_ns - phase_sum - (user_union - inside), 0)

    _add_causes(out, causes, gid, kinds, n)
    out["n_collective"] = counts[:, _K["collective"]]
    out["collective_bytes"] = np.bincount(gid[coll], weights=nbytes[coll], minlength=n).astype(
        np.int64
    )
    out["n_allreduce"] = counts[:, _K["allreduce"]]
    out["n_forward"] = counts[:, _K["forward"]]
    out["n_backward"] = counts[:, _K["backward"]]
    out["allreduce_bytes"] = np.bincount(g_ar, weights=nbytes[ar], minlength=n).astype(np.int64)
    arr = pd.array(np.zeros(n, np.int64), dtype="Int64")
    arr[:] = pd.NA
    if len(ar):
        # latest enqueue per group: the max of each group's starts
        has_ar = counts[:, _K["allreduce"]] > 0
        mx = np.full(n, np.iinfo(np.int64).min, np.int64)
        np.maximum.at(mx, g_ar, s_ar)
        arr[has_ar] = mx[has_ar]
    out["arrival_ns"] = arr
    first_coll = pd.array(np.zeros(n, np.int64), dtype="Int64")
    first_coll[:] = pd.NA
    if len(coll):  # the rank's first collective outside the optimizer: a meeting point too
        mn = np.full(n, np.iinfo(np.int64).max, np.int64)
        np.minimum.at(mn, gid[coll], start[coll])
        has_coll = counts[:, _K["collective"]] > 0
        first_coll[has_coll] = mn[has_coll]
    out["coll_arrival_ns"] = first_coll
    with np.errstate(invalid="ignore", divide="ignore"):
        model = out["model_ns"].to_numpy()
        out["comm_compute_ratio"] = np.where(model > 0, comm / np.maximum(model, 1), np.nan)
        nbytes = out["allreduce_bytes"].to_numpy()
        # no bytes known (0: unknown, as an impossible count is made): no bandwidth, not zero
        out["algbw_gbps"] = np.where(
            (allreduce > 0) & (nbytes > 0), nbytes / np.maximum(allreduce, 1), np.nan
        )
    return out


def _net_counters(
    causes: dict[str, np.ndarray],
    gid: np.ndarray,
    kinds: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    coll: np.ndarray,
    at: np.ndarray,
) -> None:
    """Subtract each collective's counters (``causes``' rows ``coll``) from those of the phase
    span (:data:`NET_PHASES`) containing time ``at`` of it, in place. A collective without
    counters makes that phase's unmeasured (NaN): its share of the phase is unknown."""
    ph = np.flatnonzero(np.isin(kinds, [_K[k] for k in NET_PHASES]))
    if not len(ph) or not len(coll):
        return
    # events sorted by (group, time); a phase start sorts before a collective at the same time
    g = np.concatenate([gid[ph], gid[coll]])
    t = np.concatenate([start[ph], at])
    is_ph = np.concatenate([np.ones(len(ph), bool), np.zeros(len(coll), bool)])
    order = np.lexsort((~is_ph, t, g))
    pos = np.where(is_ph[order], np.arange(len(order)), -1)
    last_ph = np.maximum.accumulate(pos)  # the latest phase start at or before each event
    ev_coll = np.flatnonzero(~is_ph[order])
    cand = last_ph[ev_coll]
    ok = cand >= 0
    which = np.where(ok, order[np.maximum(cand, 0)], 0)  # index into ph
    coll_i = order[ev_coll] - len(ph)  # index into coll
    phase_row = ph[which]
    ok &= (gid[phase_row] == gid[coll[coll_i]]) & (end[phase_row] >= at[coll_i])
    phase_row, coll_rows = phase_row[ok], coll[coll_i[ok]]
    for c, v in causes.items():
        causes[c] = v = v.copy()  # the caller's arrays stay as they were
        np.subtract.at(v, phase_row, v[coll_rows])


def _union(merged: tuple[np.ndarray, np.ndarray, np.ndarray], n: int) -> np.ndarray:
    """Per group, the total length of merged intervals (ns, int64)."""
    g, lo, hi = merged[0], merged[1], merged[2]
    return np.bincount(g, weights=hi - lo, minlength=n).round().astype(np.int64)


def _add_causes(
    out: pd.DataFrame, causes: dict[str, np.ndarray], gid: np.ndarray, kinds: np.ndarray, n: int
) -> None:
    """Add ``X_cpu_ns`` / ``X_runq_ns`` of each measured phase to a step table (in place)."""
    for k in CAUSE_PHASES:
        rows = np.flatnonzero(kinds == _K[k])
        for c, values in causes.items():
            v = values[rows]
            measured = np.isfinite(v)
            if not len(rows) or not measured.any():
                continue
            g = gid[rows]
            total = np.bincount(g[measured], weights=v[measured], minlength=n)
            missing = np.bincount(g[~measured], minlength=n) > 0
            present = np.bincount(g, minlength=n) > 0
            col = np.where(present & ~missing, total, np.nan).astype(np.float32)
            out[f"{k}_{c}_ns"] = col


def finish_steps(rows: pd.DataFrame, n_ranks: int | None = None) -> pd.DataFrame:
    """Return the step table from :func:`step_rows` of every rank (times on one clock).

    The cross-rank half of :func:`step_table`: sorts by (rank, step) and adds ``complete`` (every
    one of the ``n_ranks`` ranks, default the ranks present, recorded this step's ``step`` span; a
    rank that stopped mid-step, or lost its last unflushed spans in a crash, leaves the steps after
    its last one incomplete on all ranks), ``lateness_ns`` (arrival minus the earliest arrival of
    any rank in that step) and ``is_last`` (the rank arrived last; needs 2 ranks in the step).
    """
    out = rows.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)
    if n_ranks is None:
        n_ranks = int(out["rank"].nunique())
    has_step = out.pop("has_step").to_numpy(dtype=bool)
    steps, step_group = np.unique(out["step"].to_numpy(), return_inverse=True)
    ranks_done = np.bincount(step_group, weights=has_step)[step_group]
    out.insert(2, "complete", has_step & (ranks_done == n_ranks))
    _add_lateness(out, step_group, len(steps))
    cols = [c for c in out.columns if c not in ("lateness_ns", "is_last")]
    i = cols.index("arrival_ns") + 1
    return out[[*cols[:i], "lateness_ns", "is_last", *cols[i:]]]


def _add_lateness(out: pd.DataFrame, step_group: np.ndarray, n_groups: int) -> None:
    """Add ``lateness_ns`` and ``is_last`` to a step table (in place); ``step_group``: each row's
    step as a group number below ``n_groups`` (per-step reductions in numpy, not a pandas
    groupby per column).

    A rank's lateness is how long after the first rank it arrived at the step's meeting points
    with the others: its last gradient (``arrival_ns``) and, where the step has collectives
    outside the optimizer, the first of them (``coll_arrival_ns``): a rank late to a metric
    allreduce makes the others wait there, and they then reach their gradients together. The
    two add up (a delay before the collective and another after it both hold the others)."""
    late = _late(out, "arrival_ns", step_group, n_groups)
    if "coll_arrival_ns" in out.columns and out["coll_arrival_ns"].notna().any():
        coll = _late(out, "coll_arrival_ns", step_group, n_groups)
        both = ~np.isnan(late) | ~np.isnan(coll)
        late = np.where(both, np.nan_to_num(late, nan=0.0) + np.nan_to_num(coll, nan=0.0), np.nan)
    seen = ~np.isnan(late)
    n_ranks = np.bincount(step_group, weights=seen, minlength=n_groups)[step_group]
    last = np.full(n_groups, -np.inf)
    np.fmax.at(last, step_group, late)
    out["lateness_ns"] = late
    out["is_last"] = (late == last[step_group]) & (n_ranks >= 2) & seen


def _late(out: pd.DataFrame, col: str, step_group: np.ndarray, n_groups: int) -> np.ndarray:
    """Per row, ``col`` minus its step's earliest (float ns, NaN where ``col`` is NA)."""
    arr = out[col].astype("float64").to_numpy(na_value=np.nan)
    base = float(np.nanmin(arr)) if (~np.isnan(arr)).any() else 0.0
    # relative values keep ns precision (float64 of epoch ns does not)
    rel = (out[col].astype("Int64") - int(base)).to_numpy(np.float64, na_value=np.nan)
    first = np.full(n_groups, np.inf)
    np.fmin.at(first, step_group, rel)
    first[np.isinf(first)] = np.nan
    return rel - first[step_group]


# -- per-rank summary ------------------------------------------------------------------------------
def analyzed_steps(steps: pd.DataFrame, skip_steps: int = 1) -> pd.DataFrame:
    """Return the rows used for statistics: complete steps with ``step >= skip_steps``.

    Step 0 (warm-up) is skipped by default. If skipping would leave nothing, all complete steps
    are used.
    """
    done = steps[steps["complete"]]
    kept = done[done["step"] >= skip_steps]
    return kept if len(kept) else done


def rank_summary(steps: pd.DataFrame, skip_steps: int = 1) -> pd.DataFrame:
    """Return one row per rank: medians and 95th percentiles of the step table, in milliseconds.

    ``steps``: :func:`step_table` output. For every duration column ``X_ns`` there are ``X_ms``
    (median over the analyzed steps) and ``X_p95_ms``. Also ``steps`` (steps analyzed),
    ``comm_compute_ratio`` (median of the per-step ratio), ``overlap`` (share of the communication
    union hidden under backward/compute, over all analyzed steps), ``algbw_gbps`` (median),
    ``n_allreduce`` (median tensors per step), ``allreduce_bytes`` (median bytes per step) and
    ``last_share`` (share of the analyzed steps in which the rank arrived last). Where the
    recorder measured them, ``X_cpu_ms`` / ``X_runq_ms`` (and their p95) for the phases of
    :data:`CAUSE_PHASES`: the training thread's CPU time and run-queue wait.
    """
    a = analyzed_steps(steps, skip_steps)
    cols = [c for c in DURATION_COLUMNS if c in a.columns]
    cols += [c for c in a.columns if c.endswith(("_cpu_ns", "_runq_ns"))]
    ms = a[["rank", *cols]].copy()
    ms[cols] = ms[cols].astype("float64") / 1e6
    g = ms.groupby("rank", sort=True)
    med = g[cols].median()
    p95 = g[cols].quantile(0.95)
    out = pd.DataFrame(index=med.index)
    out["steps"] = a.groupby("rank").size()
    for c in cols:
        base = c.removesuffix("_ns")
        out[f"{base}_ms"] = med[c]
        out[f"{base}_p95_ms"] = p95[c]
    ga = a.groupby("rank", sort=True)
    out["comm_compute_ratio"] = ga["comm_compute_ratio"].median()
    sums = ga[["hidden_ns", "comm_ns"]].sum()
    out["overlap"] = sums["hidden_ns"] / sums["comm_ns"].where(sums["comm_ns"] > 0)
    out["algbw_gbps"] = ga["algbw_gbps"].median()
    out["n_allreduce"] = ga["n_allreduce"].median()
    out["allreduce_bytes"] = ga["allreduce_bytes"].median()
    out["last_share"] = ga["is_last"].mean()
    return out.reset_index()


# -- user spans ------------------------------------------------------------------------------------


def user_summary(
    users: pd.DataFrame, steps: pd.DataFrame, skip_steps: int = 1, max_names: int = 32
) -> pd.DataFrame:
    """Return per (rank, name): ``median_ms``, ``p95_ms`` and ``mean_ms`` per analyzed step.

    A step in which the span did not occur counts as 0 ms (so a span every 100 steps has median
    0 but a mean that shows its cost); ``steps_with`` counts the steps in which it occurred.
    Only the ``max_names`` names with the most total time are summarized.
    """
    cols = ["rank", "name", "median_ms", "p95_ms", "mean_ms", "steps_with"]
    a = analyzed_steps(steps, skip_steps)[["rank", "step"]]
    if users.empty or a.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    u = users.merge(a, on=["rank", "step"], how="inner")
    if u.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    top = u.groupby("name")["dur_ns"].sum().nlargest(max_names).index
    u = u[u["name"].isin(top)]
    wide = u.pivot_table(
        index=["rank", "step"], columns="name", values="dur_ns", aggfunc="sum", fill_value=0
    )
    full = pd.MultiIndex.from_frame(a)
    wide = wide.reindex(full, fill_value=0).astype("float64") / 1e6
    g = wide.groupby(level="rank")
    med = g.median().stack().rename("median_ms")
    p95 = g.quantile(0.95).stack().rename("p95_ms")
    mean = g.mean().stack().rename("mean_ms")
    cnt = (wide > 0).groupby(level="rank").sum().stack().rename("steps_with")
    out = pd.concat([med, p95, mean, cnt], axis=1).reset_index()
    out.columns = cols
    return out[out["steps_with"] > 0].reset_index(drop=True)


#: A step counts as communication-bound when the last rank to arrive (which waited for nobody)
#: still spends at least this share of the step blocked in ``synchronize()``.
COMM_BOUND_SHARE = 0.25


def step_summary(steps: pd.DataFrame, comm_bound_share: float = COMM_BOUND_SHARE) -> pd.DataFrame:
    """Return one row per step, across ranks (times in ms).

    Columns: ``step``, ``ranks`` (ranks with the complete step), ``step_ms`` (median over
    ranks), ``last_rank`` (the rank whose last gradient was ready last; -1 if unknown),
    ``spread_ms`` (its lateness: how long the first rank waited for it), and, for that last rank,
    which waited for nobody: ``exposed_ms`` (its ``synchronize()`` wait and its time blocked in
    collectives outside the optimizer: communication not hidden), ``comm_ms`` (its union of
    allreduces and collectives), ``model_ms``, ``comm_compute_ratio``, ``overlap``;
    ``exposed_share`` = exposed / step and ``comm_bound`` = exposed_share >= ``comm_bound_share``.
    """
    s = steps[steps["complete"]]
    cols = [
        "step",
        "ranks",
        "step_ms",
        "last_rank",
        "spread_ms",
        "exposed_ms",
        "comm_ms",
        "model_ms",
        "comm_compute_ratio",
        "overlap",
        "exposed_share",
        "comm_bound",
    ]
    if s.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    g = s.groupby("step", sort=True)
    out = pd.DataFrame({"ranks": g.size(), "step_ms": g["step_ns"].median() / 1e6})
    # the last rank of each step (largest lateness); steps without arrivals fall back to rank -1
    has = s[s["lateness_ns"].notna()]
    if len(has):
        idx = has.groupby("step")["lateness_ns"].idxmax()
        last = has.loc[idx.to_numpy()].set_index("step")
    else:
        last = pd.DataFrame(
            columns=[
                "rank",
                "lateness_ns",
                "wait_ns",
                "collective_wait_ns",
                "comm_ns",
                "model_ns",
                "overlap",
            ]
        )
    out["last_rank"] = last["rank"].reindex(out.index).fillna(-1).astype(np.int64)
    out["spread_ms"] = last["lateness_ns"].reindex(out.index) / 1e6
    ref = last.reindex(out.index)
    if len(has) < len(s):  # steps with no allreduce: use the rank medians
        med = g[["wait_ns", "collective_wait_ns", "comm_ns", "model_ns", "overlap"]].median()
        for c in med.columns:
            ref[c] = ref[c].astype("float64").fillna(med[c])
    exposed = ref["wait_ns"].astype("float64") + ref["collective_wait_ns"].astype("float64")
    out["exposed_ms"] = exposed / 1e6
    out["comm_ms"] = ref["comm_ns"].astype("float64") / 1e6
    out["model_ms"] = ref["model_ns"].astype("float64") / 1e6
    out["comm_compute_ratio"] = out["comm_ms"] / out["model_ms"].where(out["model_ms"] > 0)
    out["overlap"] = ref["overlap"].astype("float64")
    out["exposed_share"] = out["exposed_ms"] / out["step_ms"].where(out["step_ms"] > 0)
    out["comm_bound"] = out["exposed_share"] >= comm_bound_share
    return out.reset_index()[cols]
