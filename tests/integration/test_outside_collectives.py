"""Every collective, not only the optimizer's, on real ``horovodrun`` jobs (2 ranks, Gloo).

- A job that averages its loss with ``hvd.allreduce`` after every step, and broadcasts an object
  with ``hvd.broadcast_object`` once mid-run, while rank 1 sleeps 30 ms after each update: rank 0
  waits for rank 1 in the metric allreduce. The analysis must list both collectives by source
  (op, phase, name, calls and time per step), name rank 1 as the rank the others wait for in the
  metric allreduce, and still name rank 1 the straggler.
- The same job without those calls: no collective outside the optimizer, and comm/compute is
  the allreduce union over the model time, as before. hvtrace's own clock collectives (at
  ``hvtrace.finish()``) are recorded, marked as its own, and left out of the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import analyze_cli, ran_steps, traced_scenario

from hvtrace.analysis.summary import analyze
from hvtrace.format.schema import FLAG_OWN
from hvtrace.load import load_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(900)]

COMMON = ["--steps", "40", "--width", "256", "--layers", "4", "--batch-size", "64"]


OUTSIDE = traced_scenario(
    "outside_metric_bcast", *COMMON, "--metric-allreduce", "--broadcast-object-at", "20",
    "--slow-rank", "1", "--slow-ms", "30", "--slow-phase", "update",
)  # fmt: skip
WITHOUT = traced_scenario("outside_none", *COMMON)


def test_metric_allreduce_and_broadcast_object_are_named_with_phase_and_cost(
    batched, tmp_path: Path
) -> None:
    trace = ran_steps(batched(OUTSIDE), 40)
    a = analyze(load_run(trace))
    out = a.outside.set_index("name")
    assert set(out.index) == {"metric.loss", "config"}, a.outside.to_dict("records")

    metric = out.loc["metric.loss"]
    # issued after opt.step(): before the next step's forward, in its input phase
    assert (metric["op"], metric["phase"]) == ("allreduce.average", "input"), metric
    assert metric["count_per_step"] == pytest.approx(1.0), metric
    assert metric["ranks"] == 2 and metric["bytes"] == 4, metric
    # rank 1 issues it ~30 ms after rank 0, which waits for it: about half that on average
    assert metric["late_rank"] == 1 and metric["late_share"] >= 0.9, metric
    assert 20.0 <= metric["wait_for_last_ms"] <= 60.0, metric
    assert metric["blocked_ms_per_step"] >= 10.0, metric
    assert metric["ms_per_step"] >= metric["blocked_ms_per_step"] - 1e-9, metric

    bcast = out.loc["config"]
    assert (bcast["op"], bcast["count"]) == ("broadcast_object", 1), bcast
    assert bcast["count_per_step"] == pytest.approx(1 / a.analyzed_step_numbers[2]), bcast

    waits = [f for f in a.findings if f.kind == "collective_wait"]
    assert len(waits) == 1 and waits[0].data["rank"] == 1, [f.message for f in a.findings]
    assert waits[0].data["name"] == "metric.loss" and waits[0].data["phase"] == "input"
    assert list(a.stragglers["rank"]) == [1], [f.message for f in a.findings]

    # rank 0's wait in the metric allreduce is communication, not input time
    st = a.analyzed
    r0, r1 = st[st["rank"] == 0], st[st["rank"] == 1]
    assert r0["collective_wait_ns"].median() >= 20e6
    assert r0["input_ns"].median() < 10e6 < r1["input_ns"].median()
    assert (st["comm_ns"] >= st["allreduce_ns"]).all()

    # the JSON a user reads
    js = tmp_path / "a.json"
    p = analyze_cli(trace, "--json", js)
    assert p.returncode == 0, p.stderr
    assert "Collectives outside the optimizer" in p.stdout
    rows = json.loads(js.read_text())["communication"]["outside_optimizer"]
    row = next(r for r in rows if r["name"] == "metric.loss")
    for key in ("op", "phase", "count_per_step", "ms_per_step"):
        assert key in row, row
    assert row["ms_per_step"] == pytest.approx(float(metric["ms_per_step"]))


def test_a_run_without_such_calls_is_counted_as_before(batched) -> None:
    trace = ran_steps(batched(WITHOUT), 40)
    run = load_run(trace)
    spans = run.spans
    coll = spans[spans["kind"] == "collective"]
    own = (coll["flags"].astype(int) & FLAG_OWN) != 0
    # hvtrace.finish() re-estimates the clocks with collectives of its own: marked, left out
    assert own.any() and coll.loc[own, "name"].astype(str).str.contains(r"\|hvtrace\.").all()
    # the trainer's own broadcasts before the first step: recorded, outside any step's work
    user = coll[~own]
    assert sorted(set(user["name"].astype(str))) == [
        "broadcast_optimizer_state|outside|",
        "broadcast_parameters|outside|",
    ]
    assert (user["step"] == 0).all() and (user["bytes"] > 0).any()
    a = analyze(run)
    assert a.outside.empty
    assert not {"collective_wait", "collective_cost"} & {f.kind for f in a.findings}
    st = a.analyzed
    assert (st["collective_ns"] == 0).all() and (st["collective_wait_ns"] == 0).all()
    assert (st["comm_ns"] == st["allreduce_ns"]).all()
    model = st["model_ns"].to_numpy(np.float64)
    expect = np.where(model > 0, st["allreduce_ns"].to_numpy(np.float64) / model, np.nan)
    np.testing.assert_allclose(st["comm_compute_ratio"].to_numpy(np.float64), expect)
