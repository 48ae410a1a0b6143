"""``hvtrace scaling`` (issue 36): runs of one job at several world sizes, the efficiency of each
and where the time went, in parts that add up."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_frames import MS, frame, synth_spans
from helpers import REPO_ROOT

from hvtrace.analysis import analyze_spans
from hvtrace.analysis.scaling import (
    CYCLE_TIME_DEFAULT_MS,
    FUSION_THRESHOLD_DEFAULT_BYTES,
    LOSS_PARTS,
    fit_message_cost,
    fusion_settings,
    messages,
    ring_factor,
    scaling,
)
from hvtrace.cli import main
from hvtrace.export.scaling import format_scaling, scaling_to_dict


def _runs(**slow):
    """The same job at 4, 1 and 2 ranks (in any order: sorted by world size), each allreduce
    taking a ring's share of the bytes per rank (none at one rank); ``slow`` at 4 ranks."""
    out = []
    for n in (4, 1, 2):
        kw = {"comm_ms": 4.0 * ring_factor(n) + 0.01, **(slow if n == 4 else {})}
        out.append(analyze_spans(synth_spans(ranks=n, steps=80, noise=0.02, seed=n, **kw)))
    return out


def test_efficiency_and_the_parts_of_the_loss_add_up() -> None:
    s = scaling(_runs())
    t = s.runs
    assert list(t["size"]) == [1, 2, 4]
    assert t["efficiency"].iloc[0] == pytest.approx(1.0)
    for r in t.itertuples():
        assert r.efficiency == pytest.approx(t["step_ms"].iloc[0] / r.step_ms)
        assert r.speedup == pytest.approx(r.efficiency * r.size)
        parts = sum(getattr(r, p) for p in LOSS_PARTS)
        assert parts == pytest.approx(r.loss_ms, abs=1e-6)
    # one rank allreduces nothing: the loss at 2 and 4 ranks is communication, growing
    assert t["exposed_comm"].iloc[2] > 0 and t["loss_ms"].iloc[2] > t["loss_ms"].iloc[1] > 0
    assert any("1-rank run allreduces nothing" in n for n in s.notes)


def test_a_straggler_at_four_ranks_is_time_spent_waiting_for_the_last_rank() -> None:
    clean = scaling(_runs()).runs.iloc[2]
    four = scaling(_runs(slow_ranks=(2,), slow_phase="forward", slow_ms=8.0)).runs.iloc[2]
    # rank 2's forward +8 ms: 2 ms per rank-step of compute, and the other three ranks wait
    # about 8 ms each for it: 6 ms per rank-step
    more_wait = four["waiting_for_last"] - clean["waiting_for_last"]
    assert more_wait == pytest.approx(6.0, abs=1.0), (four.to_dict(), clean.to_dict())
    assert four["compute"] - clean["compute"] == pytest.approx(2.0, abs=0.5)
    assert four["exposed_comm"] == pytest.approx(clean["exposed_comm"], abs=1.0)


def test_the_next_size_is_predicted_from_a_rings_bytes_with_its_assumptions() -> None:
    s = scaling(_runs())
    p = s.prediction
    assert p["size"] == 8
    # every tensor here is 4 MiB: one message size per world size, two points for two unknowns,
    # so no latency is fitted and the prediction is a ring's bytes alone, all of it exposed
    assert p["model"] == "bytes" and p["latency_us"] is None
    assert any("too few distinct message sizes" in n for n in p["fit_notes"])
    assert any("a ring's bytes alone" in n for n in s.notes)
    assert p["exposed_growth_ms"] == p["comm_growth_ms"]
    four = s.runs.iloc[2]
    growth = four["comm_ms"] * (ring_factor(8) / ring_factor(4) - 1.0)
    assert p["comm_growth_ms"] == pytest.approx(growth) and growth > 0
    assert p["step_ms"] == pytest.approx(four["step_ms"] + growth)
    assert any(a.startswith("weak scaling") for a in s.assumptions)
    text = format_scaling(s)
    assert "at 8 ranks (predicted)" in text and "Where the time went" in text
    js = json.loads(json.dumps(scaling_to_dict(s)))
    assert [r["size"] for r in js["runs"]] == [1, 2, 4] and js["prediction"]["size"] == 8


def test_ring_factor() -> None:
    assert ring_factor(1) == 0 and ring_factor(2) == 1 and ring_factor(4) == 1.5


def test_one_run_is_not_a_scaling_study(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError):
        scaling(_runs()[:1])
    run = REPO_ROOT / "sample_traces" / "balanced_2rank"
    assert main(["scaling", str(run)]) == 2
    assert "two runs or more" in capsys.readouterr().err


def test_the_cli_on_the_sample_runs(tmp_path: Path, capsys) -> None:
    samples = REPO_ROOT / "sample_traces"
    runs = [str(samples / "balanced_2rank"), str(samples / "slow_rank2_input_4rank")]
    out = tmp_path / "s.json"
    assert main(["scaling", *runs, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hvtrace scaling: 2 runs, 2, 4 ranks")
    js = json.loads(out.read_text())
    assert js["runs"][1]["waiting_for_last"] > 0  # the 4-rank sample's slow input


def test_run_ids_from_the_files_reach_the_terminal_escaped() -> None:
    """A run id is read from a trace file: a terminal escape in it is shown, not acted on, in
    both comparisons."""
    from hvtrace.analysis.diff import diff_runs
    from hvtrace.export.diff import format_diff

    evil = "run\x1b[2J\x07"
    runs = [analyze_spans(synth_spans(ranks=n, steps=30, seed=n), run_id=evil) for n in (1, 2)]
    for text in (format_scaling(scaling(runs)), format_diff(diff_runs(*runs))):
        assert "\x1b" not in text and "\x07" not in text
        assert "run\\x1b[2J\\x07" in text


#: A model's gradients: (tensor names, bytes of each, when they are ready as a share of the
#: backward). Tensors ready together are fused into one message.
LAYERS = (
    (("fc3.weight", "fc3.bias"), (60_000, 4_000), 0.15),
    (("fc2.weight",), (1 << 20,), 0.4),
    (("conv2.weight",), (4 << 20,), 0.65),
    (("conv1.weight",), (12 << 20,), 1.0),
)


def ring_spans(
    n: int,
    latency_us: float = 80.0,
    busbw_gbps: float = 1.5,
    steps: int = 40,
    seed: int = 0,
    layers: tuple = LAYERS,
) -> pd.DataFrame:
    """A run of ``n`` ranks whose allreduce messages each take ``2(n-1) x latency_us + 2(n-1)/n x
    bytes / busbw_gbps``, one after another (Horovod's background thread), each from when every
    rank enqueued its tensors; the tensors of one message are observed complete 3 µs apart (as
    ``synchronize()`` observes handles). Input 2 ms, forward 8, backward 16, update 1 (1 %
    jitter); at one rank no allreduce (Horovod's optimizer skips it)."""
    rng = np.random.default_rng(seed)
    rows: list[tuple] = []
    start = np.full(n, 1_000_000 * MS, np.int64)
    for s in range(steps):
        jit = rng.normal(1.0, 0.01, (n, 4))
        d_in, d_fw, d_bw, d_up = ((ms * MS * jit[:, k]).astype(np.int64)
                                  for k, ms in enumerate((2, 8, 16, 1)))  # fmt: skip
        fw0 = start + d_in
        bw0 = fw0 + d_fw
        bw1 = bw0 + d_bw
        done, sent = 0, []
        for names, sizes, share in layers:
            ready = bw0 + (d_bw * share).astype(np.int64)
            cost = 2 * (n - 1) * latency_us * 1e3 + ring_factor(n) * sum(sizes) / busbw_gbps
            done = max(done, int(ready.max())) + int(cost)
            sent.append((names, sizes, ready, done))
        sync_end = np.maximum(bw1, done + 3_000 * len(layers[-1][0]) if n > 1 else 0) + 30_000
        upd_end = sync_end + d_up
        for r in range(n):
            st = int(start[r])
            rows += [
                (r, s, "input", "input", st, int(fw0[r])),
                (r, s, "forward", "forward", int(fw0[r]), int(bw0[r])),
                (r, s, "backward", "backward", int(bw0[r]), int(bw1[r])),
            ]
            if n > 1:
                for names, sizes, ready, end in sent:
                    for k, (name, b) in enumerate(zip(names, sizes, strict=True)):
                        rows.append((r, s, "allreduce", name, int(ready[r]), end + 3_000 * k, b))
            rows += [
                (r, s, "wait", "synchronize", int(bw1[r]), int(sync_end[r])),
                (r, s, "update", "update", int(sync_end[r]), int(upd_end[r])),
                (r, s, "step", "step", st, int(upd_end[r])),
            ]
        start = upd_end
    return frame(rows)


def _ring_runs(sizes=(1, 2, 4), **kw) -> list:
    return [analyze_spans(ring_spans(n, seed=n, **kw), run_id=f"np{n}") for n in sizes]


def test_the_messages_are_the_tensors_horovod_fused() -> None:
    a = analyze_spans(ring_spans(4, steps=10))
    m = messages(a)
    assert (m.groupby("step").size() == 4).all()  # fc3's two tensors are one message
    first = m[m["step"] == m["step"].min()].reset_index(drop=True)
    assert list(first["tensors"]) == [2, 1, 1, 1] and list(first["messages"]) == [1, 1, 1, 1]
    assert list(first["bytes"]) == [64_000, 1 << 20, 4 << 20, 12 << 20]
    # each message's time: its cost with the background thread free (the queue removed)
    want = [2 * 3 * 80e3 + 1.5 * b / 1.5 for b in first["bytes"]]
    assert list(first["time_ns"]) == pytest.approx(want, rel=1e-3)
    # a fusion threshold below fc3's bytes: at least two messages there; 0: one per tensor
    for env in ({"HOROVOD_FUSION_THRESHOLD": "32000"}, {"HOROVOD_FUSION_THRESHOLD": "0"}):
        a2 = analyze_spans(ring_spans(4, steps=10), horovod_env=env)
        assert list(messages(a2)["messages"].iloc[:4]) == [2, 1, 1, 1]
    # Horovod 0.28.1's defaults, and what the header's horovod_env says
    assert fusion_settings({}) == (FUSION_THRESHOLD_DEFAULT_BYTES, CYCLE_TIME_DEFAULT_MS)
    assert FUSION_THRESHOLD_DEFAULT_BYTES == 128 << 20 and CYCLE_TIME_DEFAULT_MS == 1.0
    env = {"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "3.5"}
    assert fusion_settings(env) == (64 << 20, 3.5)
    assert fusion_settings({"HOROVOD_CYCLE_TIME": "x"}) == (128 << 20, 1.0)


def test_the_latency_and_bandwidth_are_fitted_and_predict_the_next_size() -> None:
    """Runs at 1, 2 and 4 ranks of a ring with 80 µs per transfer step and 1.5 GB/s: the fit
    recovers both, and the 8-rank step predicted from them is the one a run at 8 ranks takes."""
    s = scaling(_ring_runs())
    p = s.prediction
    assert p["model"] == "latency" and p["size"] == 8
    assert p["latency_us"] == pytest.approx(80.0, rel=0.02)
    assert p["busbw_gbps"] == pytest.approx(1.5, rel=0.02)
    lo, hi = p["latency_us_range"]
    assert lo <= p["latency_us"] <= hi and hi - lo < 5
    lo, hi = p["busbw_gbps_range"]
    assert lo <= p["busbw_gbps"] <= hi
    assert p["r2"] > 0.99 and p["fit_sizes"] == [2, 4] and p["fit_points"] == 8
    # the allreduce grows by 4 messages x 2n more transfer steps and a ring's bytes (4 -> 8)
    total = 64_000 + (1 << 20) + (4 << 20) + (12 << 20)
    growth = 4 * 8 * 80e-3 + (ring_factor(8) - ring_factor(4)) * total / 1.5 / 1e6
    assert p["comm_growth_ms"] == pytest.approx(growth, rel=0.02)
    # part of it hides behind the backward: the earlier messages had room before the next
    assert 0 < p["exposed_growth_ms"] < p["comm_growth_ms"]
    assert p["step_ms_all_exposed"] > p["step_ms"]
    eight = analyze_spans(ring_spans(8, seed=8))
    measured = scaling([_ring_runs((1,))[0], eight]).runs["step_ms"].iloc[-1]
    assert p["step_ms"] == pytest.approx(measured, rel=0.03)
    # bytes alone would miss by more: the latency term is x2.3 from 4 to 8 ranks
    bytes_only = s.runs["step_ms"].iloc[-1] + s.runs["comm_ms"].iloc[-1] * (
        ring_factor(8) / ring_factor(4) - 1
    )
    assert abs(bytes_only - measured) > 2 * abs(p["step_ms"] - measured)
    # stated, with the numbers, in the assumptions, the text and the JSON
    said = " ".join(s.assumptions)
    assert "80.0 µs per transfer step" in said and "1.5 GB/s" in said
    assert "HOROVOD_FUSION_THRESHOLD 128 MiB" in said and "exposed" in said
    text = format_scaling(s)
    assert "80.0 µs per ring transfer step" in text and "ms of it exposed" in text
    js = json.loads(json.dumps(scaling_to_dict(s)))
    assert js["prediction"]["latency_us"] == pytest.approx(80.0, rel=0.02)
    assert len(js["prediction"]["busbw_gbps_range"]) == 2


def test_one_multi_rank_run_is_fitted_over_its_message_sizes() -> None:
    s = scaling(_ring_runs((1, 4), latency_us=200.0, busbw_gbps=0.5))
    p = s.prediction
    assert p["model"] == "latency" and p["fit_sizes"] == [4] and p["fit_points"] == 4
    assert p["latency_us"] == pytest.approx(200.0, rel=0.03)
    assert p["busbw_gbps"] == pytest.approx(0.5, rel=0.03)
    measured = analyze_spans(ring_spans(8, seed=8, latency_us=200.0, busbw_gbps=0.5))
    want = scaling([_ring_runs((1,))[0], measured]).runs["step_ms"].iloc[-1]
    assert p["step_ms"] == pytest.approx(want, rel=0.03)


def test_too_few_message_sizes_fall_back_to_a_rings_bytes() -> None:
    """One tensor per step: one message size per world size. Two world sizes give two points
    for two unknowns: nothing to check the fit against, so the prediction is bytes alone."""
    one = ((("w",), (4 << 20,), 1.0),)
    s = scaling(_ring_runs((2, 4), layers=one))
    p = s.prediction
    assert p["model"] == "bytes" and p["fit_points"] == 2 and p["latency_us"] is None
    assert "too few distinct message sizes" in p["fit_notes"][0]
    four = s.runs.iloc[-1]
    growth = four["comm_ms"] * (ring_factor(8) / ring_factor(4) - 1.0)
    assert p["comm_growth_ms"] == pytest.approx(growth)
    assert p["step_ms"] == pytest.approx(four["step_ms"] + growth)
    assert "a ring's bytes alone" in format_scaling(s)
    # three world sizes: three points, enough
    assert scaling(_ring_runs((2, 4, 8), layers=one)).prediction["model"] == "latency"


def _points(n: int, nbytes: list[float], times_ns: list[float]) -> pd.DataFrame:
    k = len(nbytes)
    return pd.DataFrame(
        {"step": range(k), "end_ns": 0.0, "ready_ns": 0.0, "bytes": nbytes, "tensors": 1,
         "messages": 1, "time_ns": times_ns}
    )  # fmt: skip


def test_a_poor_fit_says_so() -> None:
    sizes = [1e5, 1e6, 4e6, 1.6e7]
    # times that shrink below a line through 0: a negative latency, clamped to 0
    times = [1.5 * b / 2.0 - 30e3 for b in sizes]
    fit = fit_message_cost([(4, _points(4, sizes, times))])
    assert fit["usable"] and fit["latency_us"] == 0.0
    assert fit["latency_us_range"][0] == 0.0
    assert fit["busbw_gbps"] == pytest.approx(2.0, rel=0.05)
    assert any("clamped to 0" in n for n in fit["fit_notes"])
    # times unrelated to the bytes: R^2 low, not used
    noise = [5e6, 1e6, 6e6, 0.5e6, 4e6, 3e6]
    fit = fit_message_cost([(4, _points(4, [1e5, 1e6, 2e6, 4e6, 8e6, 1.6e7], noise))])
    assert not fit["usable"] and fit["fit_notes"]
    # no message at two ranks or more
    fit = fit_message_cost([(1, _points(1, [], []))])
    assert not fit["usable"] and "no single allreduce message" in fit["fit_notes"][0]
