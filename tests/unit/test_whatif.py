"""What a straggler costs (hvtrace.analysis.whatif): the replay on step tables whose answer is
known, and on synthetic runs through the whole analysis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import synth_module

from hvtrace.analysis.summary import analyze
from hvtrace.analysis.whatif import cost, rank_costs, step_model, without_ranks
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.load import open_run

MS = 1_000_000


def lockstep(work_ms: np.ndarray, tail_ms: float = 5.0, update_ms: float = 1.0) -> pd.DataFrame:
    """A step table of ranks in lock step: in step s rank r works work_ms[s, r] (input, forward
    and backward) after the previous update, the allreduce ends ``tail_ms`` after the last
    arrival, every rank then updates for ``update_ms``."""
    steps, ranks = work_ms.shape
    rows = []
    exit_prev = np.zeros(ranks)  # when each rank left synchronize in the previous step
    for s in range(steps):
        start = exit_prev + update_ms  # the previous update, then this step
        pre = work_ms[s] - update_ms  # W includes the previous update
        arrival = start + pre
        done = arrival.max() + tail_ms
        for r in range(ranks):
            end = done + update_ms
            rows.append(
                {
                    "rank": r,
                    "step": s,
                    "complete": True,
                    "start_ns": int(start[r] * MS),
                    "end_ns": int(end * MS),
                    "step_ns": (end - start[r]) * MS,
                    "input_ns": 0.2 * pre[r] * MS,
                    "forward_ns": 0.3 * pre[r] * MS,
                    "backward_ns": 0.5 * pre[r] * MS,
                    "wait_ns": (done - arrival[r]) * MS,
                    "update_ns": update_ms * MS,
                    "arrival_ns": int(arrival[r] * MS),
                }
            )
        exit_prev = np.full(ranks, done)
    return pd.DataFrame(rows)


def test_the_replay_gives_back_what_a_slow_rank_added() -> None:
    rng = np.random.default_rng(0)
    work = 20 + rng.uniform(0, 2, size=(30, 4))
    work[:, 2] += 15  # rank 2: 15 ms more every step
    m = step_model(lockstep(work), skip_steps=1)
    assert m is not None and len(m.steps) == 29
    assert np.allclose(m.tail_ms, 5.0)
    c = cost(m, [2])
    # without rank 2, the step is the others' max: about 20 + max of 3 uniforms + tail
    expect = (work[1:, [0, 1, 3]].max(axis=1) + 5).mean()
    measured = (work[1:].max(axis=1) + 5).mean()
    assert c["lost_ms_per_step"] == pytest.approx(measured - expect, rel=0.15)
    assert 14 < c["lost_ms_per_step"] < 16.1
    assert c["lost_share"] == pytest.approx(c["lost_ms_per_step"] / measured, rel=0.01)
    per = rank_costs(m).set_index("rank")
    assert per["lost_ms_per_step"].idxmax() == 2
    assert (per.drop(index=2)["lost_ms_per_step"] < 1.0).all()


def test_a_phase_replay_removes_only_that_phase_excess() -> None:
    work = np.full((20, 3), 30.0)
    work[:, 1] += 10  # spread over input, forward, backward as 0.2 / 0.3 / 0.5
    m = step_model(lockstep(work), skip_steps=1)
    assert cost(m, [1], "backward")["lost_ms_per_step"] == pytest.approx(5.0, abs=0.1)
    assert cost(m, [1], "input")["lost_ms_per_step"] == pytest.approx(2.0, abs=0.1)
    assert cost(m, [1])["lost_ms_per_step"] == pytest.approx(10.0, abs=0.1)


def test_a_rank_slow_in_some_steps_costs_only_those() -> None:
    work = np.full((40, 2), 10.0)
    work[10:20, 0] += 30  # slow in 10 of 39 analyzed steps
    m = step_model(lockstep(work), skip_steps=1)
    assert cost(m, [0])["lost_ms_per_step"] == pytest.approx(30 * 10 / 39, rel=0.01)
    assert cost(m, [1])["lost_ms_per_step"] == pytest.approx(0.0, abs=1e-9)
    t2 = without_ranks(m, [0])
    assert np.allclose(t2, 10 + 5.0)


def test_no_replay_without_two_ranks_or_arrivals() -> None:
    one = lockstep(np.full((5, 1), 10.0))
    assert step_model(one) is None
    assert step_model(lockstep(np.full((5, 2), 10.0)).drop(columns="arrival_ns")) is None


@pytest.mark.parametrize("phase", ["input", "backward"])
def test_the_analysis_says_what_an_injected_straggler_costs(tmp_path: Path, phase: str) -> None:
    synth_module().write_synth_run(
        tmp_path, ranks=4, steps=40, tensors=4, slow_rank=1, slow_ms=12.0, slow_phase=phase
    )
    a = analyze(open_run(tmp_path))
    assert list(a.stragglers["rank"]) == [1]
    s = a.stragglers.iloc[0]
    assert 9.0 < s["lost_ms_per_step"] <= 12.5, a.stragglers
    assert s["phase_lost_ms_per_step"] == pytest.approx(s["lost_ms_per_step"], rel=0.2)
    wi = a.whatif
    assert wi["ranks"] == [1] and wi["step_ms"] - wi["step_ms_without_stragglers"] > 8
    d = analysis_to_dict(a)
    assert d["whatif"]["step_ms_without_stragglers"] == pytest.approx(
        wi["step_ms_without_stragglers"]
    )
    assert d["stragglers"][0]["lost_ms_per_step"] == pytest.approx(s["lost_ms_per_step"])
    (f,) = [f for f in a.findings if f.kind == "straggler"]
    assert f.severity == "warning" and "costs the job" in f.message
    lines = format_report(a).splitlines()
    gain = [i for i, x in enumerate(lines) if x.startswith("! what the stragglers cost")]
    tables = lines.index("Where each step's time goes (median ms per step, per rank)")
    assert len(gain) == 1 and gain[0] < tables  # among the report's first lines


def test_a_cheap_straggler_is_info_and_a_balanced_run_costs_nothing(tmp_path: Path) -> None:
    synth_module().write_synth_run(tmp_path / "b", ranks=4, steps=30, tensors=4, slow_rank=-1)
    b = analyze(open_run(tmp_path / "b"))
    assert b.stragglers.empty and b.whatif["lost_ms_per_step"] == 0.0
    assert "what the stragglers cost" not in format_report(b)


@pytest.mark.parametrize(("cause", "bound"), [("blocked", "upper"), ("work", "")])
def test_on_a_host_short_of_cpu_a_blocked_straggler_costs_at_most(tmp_path, cause, bound) -> None:
    """Every rank waits for a CPU 30 % of the step: a rank that sleeps leaves its neighbours a
    CPU, so the replay's figure is only an upper bound (not so for one that computes more)."""
    synth_module().write_synth_run(
        tmp_path, ranks=4, steps=30, tensors=4, slow_rank=1, slow_ms=12.0, slow_cause=cause,
        runq_frac=0.3, ranks_per_host=4,
    )  # fmt: skip
    a = analyze(open_run(tmp_path))
    s = a.stragglers.iloc[0]
    assert int(s["rank"]) == 1 and s["lost_bound"] == bound, a.stragglers
    (f,) = [f for f in a.findings if f.data.get("rank") == 1]
    assert ("costs the job up to" in f.message) == (bound == "upper"), f.message
