"""Collectives outside the optimizer in the analysis: counted as communication, net of the phase
they fell in (time and counters), a meeting point for lateness, matched across ranks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_frames import MS
from analysis_frames import span_row as _span

from hvtrace.analysis import analyze_spans
from hvtrace.analysis.outside import merge_partials, outside_table, split_name
from hvtrace.analysis.steps import step_table
from hvtrace.format.schema import FLAG_OWN
from hvtrace.record.collectives import _clean


def _job(slow_ms: float = 30.0, steps: int = 12, blocked_known: bool = True) -> pd.DataFrame:
    """Two ranks; each step: input, forward, a blocking metric allreduce, backward, wait, update.

    Rank 1's forward is ``slow_ms`` longer; rank 0 waits for it in the metric allreduce."""
    rows = []
    for r in (0, 1):
        for st in range(steps):
            t0 = st * 100
            slow = slow_ms if r == 1 else 0
            rows.append(_span(r, st, "step", t0, t0 + 100, cpu=60 * MS, runq=0))
            rows.append(_span(r, st, "input", t0, t0 + 5, cpu=5 * MS, runq=0))
            rows.append(_span(r, st, "forward", t0 + 5, t0 + 45, cpu=40 * MS, runq=0))
            cs, ce = t0 + 15 + slow, t0 + 45  # inside forward (SyncBatchNorm-like)
            blocked = (ce - cs) * MS if blocked_known else np.nan
            name = "allreduce.sum|forward|bn"
            rows.append(_span(r, st, "collective", cs, ce, name, blocked, cpu=(ce - cs) * MS))
            rows.append(_span(r, st, "backward", t0 + 45, t0 + 80, cpu=35 * MS, runq=0))
            rows.append(_span(r, st, "allreduce", t0 + 50, t0 + 85, "w"))
            rows.append(_span(r, st, "wait", t0 + 80, t0 + 85, cpu=0, runq=0))
            rows.append(_span(r, st, "update", t0 + 85, t0 + 100, cpu=15 * MS, runq=0))
            # hvtrace's own collective: never counted
            own = "allreduce.sum|update|hvtrace.clock.1"
            rows.append(_span(r, st, "collective", t0 + 90, t0 + 99, own, 9 * MS, flags=FLAG_OWN))
    return pd.DataFrame(rows)


def test_blocked_collective_time_is_communication_not_the_phase() -> None:
    st = step_table(_job()).set_index(["rank", "step"])
    r0, r1 = st.loc[(0, 3)], st.loc[(1, 3)]
    # rank 0 blocked 30 ms in the forward's allreduce: its net forward is 10 ms
    assert r0["collective_wait_ns"] == 30 * MS and r1["collective_wait_ns"] == 0
    assert r0["forward_ns"] == 10 * MS and r1["forward_ns"] == 40 * MS  # rank 1's work: 30 more
    assert r0["model_ns"] == (10 + 35) * MS
    assert r0["collective_ns"] == 30 * MS and r0["comm_ns"] == (30 + 35) * MS
    # the forward's counters are net of the collective's too (CPU: 40 - 30 ms)
    assert r0["forward_cpu_ns"] == pytest.approx(10 * MS)
    assert r0["other_ns"] == 0 and r1["other_ns"] == 0
    # the own collective (in update) changes nothing
    assert r0["update_ns"] == 15 * MS
    # the blocked time is not hidden: comm under backward only
    assert r0["hidden_ns"] == 30 * MS  # allreduce 50..80 under backward 45..80


def test_without_blocked_time_the_whole_span_counts_as_blocked() -> None:
    a = step_table(_job(blocked_known=False)).set_index(["rank", "step"])
    b = step_table(_job()).set_index(["rank", "step"])
    for c in ("forward_ns", "collective_wait_ns", "other_ns", "model_ns"):
        assert (a[c] == b[c]).all(), c


def test_lateness_adds_the_first_collective_meeting_point() -> None:
    st = step_table(_job())
    late = st[st["step"] >= 1].groupby("rank")["lateness_ns"].median()
    # both ranks enqueue their gradients together; rank 1 reached the metric allreduce 30 ms late
    assert late[1] == 30 * MS and late[0] == 0
    assert st.loc[st["step"] >= 1].groupby("rank")["is_last"].mean()[1] == 1.0


def test_the_rank_waited_for_is_named_and_the_straggler_found() -> None:
    a = analyze_spans(_job())
    t = a.outside
    assert list(t["name"]) == ["bn"], t  # hvtrace's own collective left out
    row = t.iloc[0]
    assert (row["op"], row["phase"], row["count_per_step"]) == ("allreduce.sum", "forward", 1.0)
    assert row["late_rank"] == 1 and row["late_share"] == 1.0
    assert row["wait_for_last_ms"] == pytest.approx(30.0)  # rank 0 waits 30 ms for rank 1
    assert row["blocked_ms_per_step"] == pytest.approx(15.0)  # 30 ms and 0 ms: mean over ranks
    assert list(a.stragglers["rank"]) == [1] and a.stragglers.iloc[0]["phase"] == "forward"
    kinds = [f.kind for f in a.findings]
    assert "collective_wait" in kinds, [f.message for f in a.findings]
    f = next(f for f in a.findings if f.kind == "collective_wait")
    assert f.data["rank"] == 1 and f.data["name"] == "bn"


def test_a_balanced_job_names_nobody_in_the_collective() -> None:
    a = analyze_spans(_job(slow_ms=0.0))
    row = a.outside.iloc[0]
    assert row["blocked_ms_per_step"] == pytest.approx(30.0)  # both blocked 30 ms: costly
    assert not a.stragglers.size
    kinds = {f.kind for f in a.findings}
    assert "collective_cost" in kinds and "collective_wait" not in kinds


def test_partials_of_two_groups_merge_as_one() -> None:
    cols = dict(step=3, name="x|input|m", occ=1, bytes=4)
    g0 = pd.DataFrame([
        dict(cols, n_spans=2, first_start_ns=10, last_start_ns=50, last_rank=1,
             sum_start_ns=60.0, sum_flight_ns=90.0, sum_blocked_ns=70.0)
    ])  # fmt: skip
    g1 = pd.DataFrame([
        dict(cols, n_spans=1, first_start_ns=70, last_start_ns=70, last_rank=2,
             sum_start_ns=70.0, sum_flight_ns=5.0, sum_blocked_ns=5.0)
    ])  # fmt: skip
    m = merge_partials([g0, None, g1])
    assert len(m) == 1
    r = m.iloc[0]
    assert (r["n_spans"], r["first_start_ns"], r["last_start_ns"], r["last_rank"]) == (3, 10, 70, 2)
    assert r["sum_start_ns"] == 130.0 and r["sum_blocked_ns"] == 75.0
    steps = pd.DataFrame({"rank": [0, 1, 2], "step": [3, 3, 3], "step_ns": [100 * MS] * 3})
    t = outside_table(m, steps, 3)
    # the others waited (70-10) and (70-50) ns: 40 ns on average
    assert t.iloc[0]["wait_for_last_ms"] == pytest.approx(40 / 1e6)
    assert t.iloc[0]["late_rank"] == 2


def test_names_are_split_and_cleaned() -> None:
    assert split_name("allreduce.sum|backward|a|b") == ("allreduce.sum", "backward", "a|b")
    assert split_name("junk") == ("?", "?", "junk")
    assert _clean("a|b\x1b[2J" + "x" * 500) == "a?b?[2J" + "x" * 193
