"""Allreduce time and bandwidth: time = first observed end - last enqueue; nccl-tests busbw."""

from __future__ import annotations

import math

import pytest
from analysis_frames import MS, frame, synth_spans

from hvtrace.analysis import bus_factor, collective_table, step_comm_table, step_table, tensor_table


def four_ranks(step: int = 1, shift: int = 0) -> list[tuple]:
    # 8 MB tensor; ranks enqueue at 0,1,2,3 ms and observe completion at 5,6,7,8 ms:
    # the collective can start only at 3 ms and is done by 5 ms (the earliest observed end)
    rows = []
    for r in range(4):
        s = shift + r * MS
        rows.append((r, step, "allreduce", "w", s, shift + (5 + r) * MS, 8_000_000))
        rows.append((r, step, "allreduce", "b", s, shift + (5 + r) * MS, 8_000))
    return rows


def test_bus_factor():
    assert bus_factor(4) == pytest.approx(1.5)
    assert bus_factor(2) == pytest.approx(1.0)
    assert bus_factor(1) == 0.0
    assert bus_factor(64) == pytest.approx(2 * 63 / 64)


def test_collective_time_is_first_end_minus_last_enqueue():
    c = collective_table(frame(four_ranks())).set_index("name")
    w = c.loc["w"]
    assert w["n_ranks"] == 4 and w["bytes"] == 8_000_000 and w["dtype"] == "float32"
    assert w["last_start_ns"] == 3 * MS and w["first_start_ns"] == 0
    assert w["end_ns"] == 5 * MS
    assert w["time_ns"] == 2 * MS
    assert w["spread_ns"] == 3 * MS
    assert w["algbw_gbps"] == pytest.approx(4.0)  # 8e6 B / 2e6 ns


def test_busbw_for_four_ranks():
    rows = four_ranks(step=0, shift=-100 * MS) + four_ranks(step=1) + four_ranks(step=2)
    rows[0] = (0, 0, "allreduce", "w", -100 * MS, 900 * MS, 8_000_000)  # slow warm-up step
    t = tensor_table(collective_table(frame(rows)), size=4, skip_steps=1).set_index("name")
    w = t.loc["w"]
    assert w["steps"] == 2  # step 0 (warm-up) left out
    assert w["time_ms"] == pytest.approx(2.0)
    assert w["algbw_gbps"] == pytest.approx(4.0)
    assert w["busbw_gbps"] == pytest.approx(6.0)  # 4 x 2 (4 - 1) / 4
    assert list(t.index) == ["w", "b"]  # largest time first (ties: larger bytes)


def test_non_positive_time_from_clock_error_is_nan():
    rows = [
        (0, 0, "allreduce", "w", 0, 1 * MS, 100),
        (1, 0, "allreduce", "w", 5 * MS, 9 * MS, 100),  # enqueued after rank 0 saw it done
    ]
    c = collective_table(frame(rows)).iloc[0]
    assert math.isnan(c["time_ns"]) and math.isnan(c["algbw_gbps"])


def test_incomplete_collectives_are_left_out_of_tensor_medians():
    rows = [*four_ranks(step=1), (0, 2, "allreduce", "w", 200 * MS, 300 * MS, 8000000)]
    t = tensor_table(collective_table(frame(rows)), size=4, skip_steps=0).set_index("name")
    assert t.loc["w", "steps"] == 1 and t.loc["w", "time_ms"] == pytest.approx(2.0)


def test_per_step_aggregate_uses_the_rank_that_waited_least():
    df = synth_spans(ranks=4, steps=5, tensors=4, noise=0.0, tensor_bytes=4 << 20, comm_ms=2.0)
    sc = step_comm_table(step_table(df), size=4)
    assert len(sc) == 5
    row = sc.iloc[1]
    assert row["bytes"] == 4 * (4 << 20)
    assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["comm_ns"])
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 1.5)


def test_no_allreduce_gives_empty_tables():
    df = frame([(0, 0, "step", "step", 0, 10)])
    assert collective_table(df).empty
    assert tensor_table(collective_table(df), size=1).empty
    assert step_comm_table(step_table(df), size=1).empty
