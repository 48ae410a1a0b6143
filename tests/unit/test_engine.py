"""The engine on a run's files against the engine on the same spans loaded as one frame.

A run's files are read by DuckDB (Parquet row groups, or IPC streams), reduced per rank on each
rank's own clock and moved onto rank 0's clock per (rank, step); ``load_run`` aligns every span
first and :func:`hvtrace.analysis.analyze_spans` runs the same passes on that frame. Both must
give the same answer on every sample trace and on synthetic runs: the same stragglers and phases,
per-rank medians within 0.1 ms, the same step table and collectives. (Until the frame path ran on
the engine too, this test checked the engine against the old whole-frame implementation.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from analysis_frames import synth_spans
from helpers import synth_module

from hvtrace.analysis import analyze, analyze_spans
from hvtrace.analysis.engine import parse_size, summarize
from hvtrace.analysis.stragglers import clock_uncertainty_ns
from hvtrace.load import RankSource, load_run, open_run
from hvtrace.selection import StepRange

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "sample_traces"


def _frame(run, steps=None):
    h0 = run.files[run.ranks[0]].header
    from hvtrace.analysis.stragglers import StragglerConfig

    return analyze_spans(
        run.spans,
        size=run.size,
        hosts=run.hosts,
        clock_uncertainty=clock_uncertainty_ns(run),
        steps=steps,
        config=StragglerConfig.for_timing(h0.get("timing")),
    )


def _close(a: pd.Series, b: pd.Series, tol: float) -> bool:
    a = a.astype("float64").to_numpy()
    b = b.astype("float64").to_numpy()
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (np.abs(a - b) <= tol)))


def assert_same(old, new) -> None:
    """The analysis of the files equals the frame's (within clock-interpolation noise)."""
    so, sn = old.steps, new.steps
    assert list(so.columns) == list(sn.columns)
    assert len(so) == len(sn)
    for c in so.columns:
        if so[c].dtype == bool or c in ("rank", "step"):
            assert (so[c].to_numpy() == sn[c].to_numpy()).all(), c
        else:
            assert _close(so[c], sn[c], 1_000 if c.endswith("_ns") else 1e-3), c
    po, pn = old.per_rank, new.per_rank
    for c in po.columns:
        if c.endswith("_ms"):
            assert _close(po[c], pn[c], 0.1), c
    co = old.collectives.sort_values(["step", "name"]).reset_index(drop=True)
    cn = new.collectives.sort_values(["step", "name"]).reset_index(drop=True)
    assert len(co) == len(cn)
    assert (co["name"].astype(str) == cn["name"].astype(str)).all()
    for c in ("n_ranks", "bytes", "first_start_ns", "last_start_ns", "end_ns"):
        assert _close(co[c], cn[c], 1_000), c
    assert list(old.stragglers["rank"]) == list(new.stragglers["rank"])
    assert list(old.stragglers["phase"]) == list(new.stragglers["phase"])
    assert [f.kind for f in old.findings if f.kind != "incomplete"] == [
        f.kind for f in new.findings if f.kind != "incomplete"
    ]


@pytest.mark.parametrize(
    "sample", ["balanced_2rank", "slow_rank1_forward_2rank", "slow_rank2_input_4rank"]
)
def test_files_equal_frame_on_sample_traces(sample: str) -> None:
    run = load_run(SAMPLES / sample)
    assert_same(_frame(run), analyze(run))


@pytest.mark.parametrize("phase", ["forward", "input", "backward"])
def test_files_equal_frame_on_compacted_synthetic_runs(tmp_path: Path, phase: str) -> None:
    synth = synth_module()
    synth.write_synth_run(tmp_path, ranks=6, steps=40, tensors=8, slow_rank=4, slow_phase=phase)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".parquet"] * 6
    run = open_run(tmp_path)
    new = analyze(run)
    assert_same(_frame(run), new)
    assert list(new.stragglers["rank"]) == [4]
    assert new.stragglers["phase"].iloc[0] == phase
    assert new.read["spans"] == new.read["spans_total"] - 6 * 40  # loss scalars not read


def test_engine_on_a_crashed_run_reads_the_streams(tmp_path: Path) -> None:
    synth = synth_module()
    synth.write_synth_run(tmp_path, ranks=4, steps=20, tensors=4, slow_rank=2, compact_files=False)
    run = open_run(tmp_path)
    assert {f.format for f in run.files.values()} == {"arrows"}
    new = analyze(run)
    assert_same(_frame(run), new)
    assert list(new.stragglers["rank"]) == [2]


def test_engine_on_a_span_frame_with_user_spans() -> None:
    """A frame (rank column, already on one clock) goes through the same per-rank pass."""
    spans = synth_spans(ranks=4, steps=25, tensors=5, slow_ranks=(3,), slow_phase="log")
    old = analyze_spans(spans)
    table = pa.Table.from_pandas(spans, preserve_index=False)
    summ = summarize([RankSource(None, len(spans), table=table)])
    st = old.steps
    assert len(summ.steps) == len(st)
    for c in ("step_ns", "allreduce_ns", "hidden_ns", "user_ns", "other_ns", "lateness_ns"):
        assert _close(st[c], summ.steps[c], 0), c
    ou = old.users.sort_values(["rank", "step", "name"]).reset_index(drop=True)
    nu = summ.users.sort_values(["rank", "step", "name"]).reset_index(drop=True)
    assert (ou["name"].astype(str) == nu["name"].astype(str)).all()
    assert (ou["dur_ns"].to_numpy() == nu["dur_ns"].to_numpy()).all()
    assert (ou["count"].to_numpy() == nu["count"].to_numpy()).all()


def test_step_window_reads_only_its_row_groups(tmp_path: Path) -> None:
    synth = synth_module()
    synth.write_synth_run(tmp_path, ranks=3, steps=120, tensors=8, slow_rank=1, row_group_rows=200)
    run = open_run(tmp_path)
    whole = analyze(run)
    window = analyze(run, steps=StepRange(20, 30))
    assert window.read["row_groups_total"] == whole.read["row_groups_total"] >= 3 * 4
    assert window.read["row_groups"] < whole.read["row_groups"] / 3
    assert window.read["spans"] < whole.read["spans"] / 8
    assert sorted(window.steps["step"].unique()) == list(range(20, 30))
    assert_same(_frame(run, StepRange(20, 30)), window)


def test_parse_size() -> None:
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5G") == int(1.5 * (1 << 30))
    assert parse_size("1000") == 1000
    for bad in ("", "lots", "-1G", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_rank_subset_keeps_rank0_clock_and_its_ranks_figures() -> None:
    """``--ranks`` without rank 0 still aligns on rank 0's kernel clock (boot id from its
    header) and gives the selected ranks the same figures as the whole run does."""
    whole = analyze(open_run(SAMPLES / "slow_rank2_input_4rank"))
    run = open_run(SAMPLES / "slow_rank2_input_4rank", ranks=frozenset({1, 2, 3}))
    assert sorted(run.files) == [1, 2, 3]
    assert all(f.same_clock for f in run.files.values())
    part = analyze(run)
    assert part.read["files"] == 3 and part.read["files_total"] == 4
    pw = whole.per_rank.set_index("rank").loc[[1, 2, 3]]
    pp = part.per_rank.set_index("rank")
    for c in ("step_ms", "input_ms", "forward_ms", "backward_ms", "update_ms", "allreduce_ms"):
        assert _close(pw[c], pp[c], 1e-9), c
    assert list(part.stragglers["rank"]) == [2]


def test_groups_and_merges_give_the_same_summaries(tmp_path: Path, monkeypatch) -> None:
    """Split into many groups, with the collectives accumulator merged after every group, the
    engine gives the same tables as in one group."""
    from hvtrace.analysis import engine
    from hvtrace.load import span_sources

    synth = synth_module()
    synth.write_synth_run(tmp_path, ranks=5, steps=30, tensors=6, slow_rank=2)
    sources = span_sources(open_run(tmp_path))
    one = summarize(sources)
    monkeypatch.setattr(engine.Engine, "MERGE_ROWS", 10)
    many = summarize(sources, max_group_spans=1)  # one rank per group
    pd.testing.assert_frame_equal(one.steps, many.steps)
    pd.testing.assert_frame_equal(one.collectives, many.collectives)
    assert (one.collectives["n_ranks"] == 5).all() and len(one.collectives) == 30 * 6


def test_cli_says_what_it_read_and_rejects_bad_limits(capsys) -> None:
    from hvtrace.cli import main

    sample = str(SAMPLES / "slow_rank2_input_4rank")
    assert main(["analyze", sample, "--ranks", "1-3", "--steps", "5:15"]) == 0
    out = capsys.readouterr().out
    assert "read: " in out and "3 of 4 ranks' files" in out and "selected steps 5..14" in out
    for bad in ("lots", "1MB"):
        assert main(["analyze", sample, "--memory-limit", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hvtrace: error: --memory-limit") and "\n" not in err
    assert main(["info", sample]) == 0
    out = capsys.readouterr().out
    assert "spans by kind: allreduce 1600" in out
