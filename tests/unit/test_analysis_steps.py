"""The per (rank, step) table and per-rank medians, on hand-made spans with exact numbers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from analysis_frames import MS, frame, synth_spans

from hvtrace.analysis import rank_summary, step_summary, step_table, user_summary, user_table


def two_ranks() -> pd.DataFrame:
    """One step (step 1) on two ranks; times in ms (x MS)."""
    m = MS
    rows = [
        # rank 0: input 10, forward 20, backward 40, wait 15, update 10; step 100
        (0, 1, "step", "step", 100 * m, 200 * m),
        (0, 1, "input", "input", 100 * m, 110 * m),
        (0, 1, "user", "data", 101 * m, 109 * m),  # inside input
        (0, 1, "forward", "forward", 110 * m, 130 * m),
        (0, 1, "backward", "backward", 130 * m, 170 * m),
        (0, 1, "allreduce", "t1", 140 * m, 175 * m, 1000),
        (0, 1, "allreduce", "t2", 160 * m, 180 * m, 3000),
        (0, 1, "wait", "synchronize", 170 * m, 185 * m),
        (0, 1, "update", "update", 185 * m, 195 * m),
        (0, 1, "user", "log", 196 * m, 199 * m),  # outside every phase
        (0, 1, "scalar", "loss", 199 * m, 199 * m),
        (0, 1, "user", "hvtrace.clock_sync", 90 * m, 99 * m),  # hvtrace's own: not user work
        # rank 1: input 5, forward 20, backward 25, wait 35, update 10
        (1, 1, "step", "step", 100 * m, 200 * m),
        (1, 1, "input", "input", 100 * m, 105 * m),
        (1, 1, "forward", "forward", 105 * m, 125 * m),
        (1, 1, "backward", "backward", 125 * m, 150 * m),
        (1, 1, "allreduce", "t1", 130 * m, 175 * m, 1000),
        (1, 1, "allreduce", "t2", 150 * m, 178 * m, 3000),
        (1, 1, "wait", "synchronize", 150 * m, 185 * m),
        (1, 1, "update", "update", 185 * m, 195 * m),
    ]
    return frame(rows)


def test_step_table_exact_numbers():
    t = step_table(two_ranks()).set_index("rank")
    r0, r1 = t.loc[0], t.loc[1]
    assert (r0["step"], r1["step"]) == (1, 1)
    assert bool(r0["complete"]) and bool(r1["complete"])
    ms = {c: r0[c] / MS for c in t.columns if c.endswith("_ns") and c not in ("start_ns", "end_ns")}
    assert ms["step_ns"] == 100
    assert (ms["input_ns"], ms["forward_ns"], ms["backward_ns"]) == (10, 20, 40)
    assert (ms["wait_ns"], ms["update_ns"], ms["compute_ns"]) == (15, 10, 0)
    assert ms["model_ns"] == 60
    assert ms["allreduce_ns"] == 40  # [140,175] u [160,180] = [140,180]
    assert ms["hidden_ns"] == 30  # [140,180] n backward [130,170]
    assert r0["overlap"] == pytest.approx(0.75)
    assert ms["user_ns"] == 11  # data 8 + log 3 (the clock sync is not user work)
    assert ms["other_ns"] == 2  # 100 - 95 of phases - 3 of 'log' outside them
    assert r0["n_allreduce"] == 2 and r0["allreduce_bytes"] == 4000
    assert r0["comm_compute_ratio"] == pytest.approx(40 / 60)
    assert r0["algbw_gbps"] == pytest.approx(4000 / (40 * MS))
    # rank 1: union [130,178] = 48, hidden [130,150] = 20; other = 100 - 95 = 5
    assert r1["allreduce_ns"] == 48 * MS and r1["hidden_ns"] == 20 * MS
    assert r1["other_ns"] == 5 * MS
    # arrival: latest enqueue; rank 0 ready at 160, rank 1 at 150 -> rank 0 is 10 ms late
    assert r0["arrival_ns"] == 160 * MS and r1["arrival_ns"] == 150 * MS
    assert r0["lateness_ns"] == 10 * MS and r1["lateness_ns"] == 0
    assert bool(r0["is_last"]) and not bool(r1["is_last"])
    assert (r0["start_ns"], r0["end_ns"]) == (100 * MS, 200 * MS)


def test_plain_string_kinds_give_the_same_table():
    df = two_ranks()
    plain = df.assign(kind=df["kind"].astype(str), name=df["name"].astype(str))
    pd.testing.assert_frame_equal(step_table(plain), step_table(df))


def test_compute_kind_without_model_hooks_counts_as_model_time_and_hides_allreduce():
    m = MS
    df = frame(
        [
            (0, 0, "step", "step", 0, 50 * m),
            (0, 0, "compute", "compute", 0, 30 * m),
            (0, 0, "allreduce", "w", 20 * m, 40 * m, 8),
            (0, 0, "wait", "synchronize", 30 * m, 45 * m),
            (0, 0, "update", "update", 45 * m, 50 * m),
        ]
    )
    r = step_table(df).iloc[0]
    assert r["compute_ns"] == 30 * m and r["model_ns"] == 30 * m
    assert r["hidden_ns"] == 10 * m and r["overlap"] == pytest.approx(0.5)
    assert r["other_ns"] == 0
    assert not bool(r["is_last"])  # one rank: nobody is last


def test_incomplete_last_step_and_scalar_only_groups():
    m = MS
    df = frame(
        [
            (0, 0, "step", "step", 0, 10 * m),
            (0, 0, "input", "input", 0, 10 * m),
            (0, 1, "input", "input", 10 * m, 12 * m),  # the rank stopped inside step 1
            (0, 1, "forward", "forward", 12 * m, 15 * m),
            (0, 2, "scalar", "loss", 16 * m, 16 * m),  # a scalar alone makes no step
        ]
    )
    t = step_table(df)
    assert t["step"].tolist() == [0, 1]
    last = t.iloc[1]
    assert not bool(last["complete"]) and math.isnan(last["step_ns"])
    assert (last["start_ns"], last["end_ns"]) == (10 * m, 15 * m)
    assert pd.isna(last["arrival_ns"])


def test_rank_summary_skips_warmup_and_gives_medians_and_p95():
    df = synth_spans(ranks=2, steps=6, noise=0.0)
    t = step_table(df)
    # make step 0 (warm-up) absurdly long: it must not move the medians
    t.loc[t["step"] == 0, "step_ns"] = 10_000 * MS
    s = rank_summary(t, skip_steps=1).set_index("rank")
    assert s.loc[0, "steps"] == 5
    assert s.loc[0, "forward_ms"] == pytest.approx(8.0)
    assert s.loc[0, "backward_ms"] == pytest.approx(16.0)
    assert s.loc[0, "step_ms"] < 100
    assert "step_p95_ms" in s.columns and "lateness_ms" in s.columns
    assert 0.0 <= s.loc[0, "overlap"] <= 1.0
    # skip_steps larger than the run falls back to all complete steps
    assert rank_summary(t, skip_steps=99).set_index("rank").loc[0, "steps"] == 6


def test_user_spans_per_name_with_zero_filled_steps():
    m = MS
    rows = []
    for s in range(5):
        rows.append((0, s, "step", "step", s * 100 * m, (s + 1) * 100 * m))
        if s in (1, 3):  # 'ckpt' in two of the four analyzed steps
            rows.append((0, s, "user", "ckpt", s * 100 * m, s * 100 * m + 40 * m))
    rows.append((0, 2, "user", "hvtrace.clock_sync", 0, m))
    df = frame(rows)
    u = user_table(df)
    assert u["name"].tolist() == ["ckpt", "ckpt"] and u["dur_ns"].tolist() == [40 * m] * 2
    s = user_summary(u, step_table(df), skip_steps=1).set_index("name")
    assert s.loc["ckpt", "median_ms"] == pytest.approx(20.0)  # 0, 40, 0, 40 over steps 1..4
    assert s.loc["ckpt", "mean_ms"] == pytest.approx(20.0)
    assert s.loc["ckpt", "steps_with"] == 2


def test_step_summary_uses_the_last_rank_for_exposed_communication():
    t = step_table(two_ranks())
    ps = step_summary(t).iloc[0]
    assert ps["last_rank"] == 0 and ps["spread_ms"] == pytest.approx(10.0)
    assert ps["exposed_ms"] == pytest.approx(15.0)  # rank 0's wait
    assert ps["exposed_share"] == pytest.approx(0.15)
    assert not bool(ps["comm_bound"])
    assert ps["comm_compute_ratio"] == pytest.approx(40 / 60)


def test_large_run_is_vectorized_enough():
    df = synth_spans(ranks=16, steps=60, tensors=16)
    t = step_table(df)
    assert len(t) == 16 * 60
    assert np.isfinite(t["allreduce_ns"]).all()
