"""``hvtrace scaling`` (issue 36): runs of one job at several world sizes, the efficiency of each
and where the time went, in parts that add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from analysis_frames import synth_spans
from helpers import REPO_ROOT

from hvtrace.analysis import analyze_spans
from hvtrace.analysis.scaling import LOSS_PARTS, ring_factor, scaling
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
