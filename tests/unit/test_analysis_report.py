"""Findings, the terminal report, JSON/CSV/Parquet outputs and the ``hvtrace analyze`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from analysis_frames import synth_spans
from helpers import make_header, row, status, write_rank_file

from hvtrace.analysis import analyze, analyze_spans
from hvtrace.cli import main
from hvtrace.export.jsondoc import analysis_to_dict, write_json
from hvtrace.export.report import format_report
from hvtrace.export.tables import write_tables
from hvtrace.load import load_run
from hvtrace.selection import StepRange

RUN_ID = "20240101-000000-abcdef"


def write_run(
    out: Path,
    df: pd.DataFrame,
    hosts: dict[int, str] | None = None,
    unclosed: dict[int, int] | None = None,
    dropped: dict[int, int] | None = None,
    **header,
) -> Path:
    """Write a span frame as rank files with the real writer (times are already rank 0's)."""
    out.mkdir(parents=True, exist_ok=True)
    size = int(df["rank"].max()) + 1
    unclosed = unclosed or {}
    for r, g in df.groupby("rank"):
        rows = [
            row(
                str(x.kind), str(x.name), int(x.start_ns), int(x.end_ns), step=int(x.step),
                nbytes=int(x.bytes), dtype="float32" if x.kind == "allreduce" else "",
            )
            for x in g.itertuples()
        ]  # fmt: skip
        clock = {"at_ns": 0, "offset_ns": 0, "uncertainty_ns": 20_000, "rounds": 8}
        h = make_header(
            rank=int(r), size=size, run_id=RUN_ID, clock_start=clock,
            host=(hosts or {}).get(int(r), "testhost"), **header,
        )  # fmt: skip
        if int(r) in unclosed:
            last = unclosed[int(r)]
            rows = [x for x in rows if x[0] <= last]
            st = [status(final=False, last_step=last)]
            write_rank_file(out / f"rank{int(r):05d}-{RUN_ID}.arrows", h, [rows], st, close=False)
        else:
            st = [status(final=True, dropped=(dropped or {}).get(int(r), 0), last_step=99)]
            write_rank_file(out / f"rank{int(r):05d}-{RUN_ID}.arrows", h, [rows], st)
    return out


def widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


# -- findings -------------------------------------------------------------------------------------
def test_comm_bound_finding_names_the_knobs_and_their_values():
    df = synth_spans(ranks=4, tensors=4, comm_ms=12.0)
    a = analyze_spans(
        df,
        horovod_env={"HOROVOD_FUSION_THRESHOLD": "67108864"},
        optimizer={"compression": "NoneCompressor"},
    )
    f = [f for f in a.findings if f.kind == "comm_bound"]
    assert len(f) == 1
    msg = f[0].message
    assert "HOROVOD_FUSION_THRESHOLD=67108864" in msg
    assert "HOROVOD_CYCLE_TIME (default)" in msg
    assert "hvd.Compression.fp16 (now: none)" in msg
    assert "batch" in msg and "comm/compute" in msg and "hidden under backward" in msg
    assert f[0].value > 0.25


def test_compute_bound_run_has_no_comm_finding():
    a = analyze_spans(synth_spans(ranks=4, comm_ms=0.2))
    assert not [f for f in a.findings if f.kind == "comm_bound"]
    assert [f.kind for f in a.findings] == ["balanced"]


def test_many_small_allreduces():
    a = analyze_spans(synth_spans(ranks=2, tensors=64, tensor_bytes=4096, comm_ms=0.05))
    f = [f for f in a.findings if f.kind == "small_allreduces"]
    assert len(f) == 1 and "64 tensors per step" in f[0].message
    assert "4.0 KiB" in f[0].message and "HOROVOD_FUSION_THRESHOLD" in f[0].message


def test_rank0_blocking_between_steps():
    a = analyze_spans(synth_spans(ranks=4, slow_ranks=(0,), slow_phase="log", slow_ms=25.0))
    kinds = [f.kind for f in a.findings]
    assert "rank0_blocking" in kinds
    assert "straggler" not in kinds  # said once, by the more specific line
    msg = next(f.message for f in a.findings if f.kind == "rank0_blocking")
    assert "user span 'log'" in msg and "last to be ready in 100%" in msg


def test_analyze_uses_the_cpu_noise_floor_for_host_timed_runs(tmp_path):
    df = synth_spans(
        ranks=2, scale=0.2, slow_ranks=(0,), slow_phase="backward", slow_ms=1.3, noise=0.02
    )
    a = analyze(load_run(write_run(tmp_path / "r", df)))  # headers say timing host_monotonic
    assert a.stragglers.empty
    assert a.verdicts["work_floor_ms"].iloc[0] == pytest.approx(2.0)


def test_incomplete_and_dropped_runs_are_reported(tmp_path):
    df = synth_spans(ranks=2, steps=12)
    run = load_run(write_run(tmp_path / "r", df, unclosed={1: 7}, dropped={0: 5}))
    a = analyze(run)
    inc = next(f for f in a.findings if f.kind == "incomplete")
    assert "rank 1 stopped at step 7" in inc.message
    assert next(f for f in a.findings if f.kind == "dropped").value == 5
    text = format_report(a)
    assert "! " in text and "not closed cleanly" in text
    assert widest(text) <= 80


# -- report and JSON ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"ranks": 2},
        {"ranks": 4, "slow_ranks": (3,)},
        {"ranks": 24, "steps": 12, "slow_ranks": (20, 21, 22, 23)},
        {"ranks": 2, "tensors": 64, "tensor_bytes": 512, "comm_ms": 0.05},
    ],
)
def test_report_fits_80_columns(kw):
    hosts = {r: f"a-rather-long-host-name-{r // 4}" for r in range(kw["ranks"])}
    a = analyze_spans(synth_spans(**kw), hosts=hosts)
    text = format_report(a)
    assert widest(text) <= 80, text
    assert "Where each step's time goes" in text and "Findings" in text
    if kw["ranks"] > 16:
        assert "showing" in text and " med " in text


def test_json_summary_keys_and_no_nan(tmp_path):
    df = synth_spans(ranks=4, slow_ranks=(2,))
    a = analyze(load_run(write_run(tmp_path / "r", df)))
    d = analysis_to_dict(a)
    for key in ("ranks", "steps", "per_rank", "stragglers", "findings", "clock", "problems"):
        assert key in d
    json.dumps(d, allow_nan=False)
    assert d["ranks"] == [0, 1, 2, 3]
    assert d["steps"]["first"] == 1 and d["steps"]["count"] == 29
    s = d["stragglers"][0]
    assert {k: s[k] for k in ("rank", "host", "phase")} == {
        "rank": 2,
        "host": "testhost",
        "phase": "forward",
    }
    assert set(s) >= {"late_ms", "last_share"}
    pr = d["per_rank"][0]
    for k in ("step_ms", "input_ms", "forward_ms", "backward_ms", "allreduce_ms", "wait_ms"):
        assert k in pr and f"{k[:-3]}_p95_ms" in pr
    assert pr["user_spans_ms"]["data"] > 0
    assert "aligned" in d["clock"]["summary"]
    out = write_json(a, tmp_path / "s.json")
    assert json.loads(out.read_text())["run_id"] == RUN_ID


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables(tmp_path, fmt):
    run = load_run(write_run(tmp_path / "r", synth_spans(ranks=2, steps=5)))
    a = analyze(run)
    files = write_tables(a, tmp_path / fmt, fmt, spans=run.spans)
    names = {p.stem for p in files}
    assert {"spans", "steps", "per_rank", "tensors", "stragglers"} <= names
    read = pd.read_csv if fmt == "csv" else pd.read_parquet
    spans = read(tmp_path / fmt / f"spans.{fmt}")
    assert len(spans) == len(run.spans) and set(spans["kind"]) >= {"step", "allreduce"}
    steps = read(tmp_path / fmt / f"steps.{fmt}")
    assert len(steps) == 10 and "allreduce_ns" in steps.columns


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_the_span_table_is_written_rank_by_rank_as_the_frame_holds_it(tmp_path, fmt):
    """``--csv`` / ``--parquet``: the spans come from the engine one rank at a time (the run's
    span frame is never built), with the frame's rows, order and times; ``--steps`` cuts them."""
    from hvtrace.analysis.engine import span_tables
    from hvtrace.load import open_run, span_sources

    d = write_run(tmp_path / "r", synth_spans(ranks=3, steps=12, slow_ranks=(2,)))
    run = open_run(d)
    steps = StepRange(3, 9)
    a = analyze(run, steps=steps)
    write_tables(a, tmp_path / fmt, fmt, spans=span_tables(span_sources(run, steps), steps))
    assert "spans" not in run.__dict__  # the frame was not built
    read = pd.read_csv if fmt == "csv" else pd.read_parquet
    got = read(tmp_path / fmt / f"spans.{fmt}")
    frame = load_run(d).spans
    want = frame[steps.mask(frame["step"])].reset_index(drop=True)
    assert list(got.columns) == list(want.columns)
    assert len(got) == len(want) > 0
    for c in ("rank", "step", "start_ns", "end_ns", "bytes"):
        assert (got[c].to_numpy() == want[c].to_numpy()).all(), c
    assert (got["name"].astype(str) == want["name"].astype(str)).all()
    assert set(got["step"]) == set(range(3, 9))


# -- the command ---------------------------------------------------------------------------------
def test_cli_end_to_end(tmp_path, capsys):
    d = write_run(tmp_path / "run", synth_spans(ranks=2, slow_ranks=(1,)))
    j, c, pq, tl = tmp_path / "s.json", tmp_path / "csv", tmp_path / "pq", tmp_path / "t.json.gz"
    rc = main(["analyze", str(d), "--json", str(j), "--csv", str(c), "--parquet", str(pq)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "Stragglers" in out.out and "forward" in out.out
    assert widest(out.out) <= 80
    assert json.loads(j.read_text())["stragglers"][0]["rank"] == 1
    assert (c / "spans.csv").is_file() and (pq / "steps.parquet").is_file()
    rc = main(["analyze", str(d), "-o", str(tl), "--steps", "5:10", "--json", "-"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    d2 = json.loads(out.out)
    assert (d2["steps"]["first"], d2["steps"]["last"]) == (5, 9)
    assert d2["steps"]["selected"] == [5, 10]
    assert any(tmp_path.glob("t*.json.gz")), out.err


def test_cli_skip_steps(tmp_path, capsys):
    d = write_run(tmp_path / "run", synth_spans(ranks=2, steps=8))
    assert main(["analyze", str(d), "--skip-steps", "3", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"]["first"] == 3


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "/nonexistent/hvtrace-run"],
        ["analyze", "{empty}"],
        ["analyze", "{run}", "--steps", "500:600"],
        ["analyze", "{run}", "--run-id", "nope"],
    ],
)
def test_cli_unusable_input_is_one_line_and_exit_2(tmp_path, capsys, args):
    (tmp_path / "empty").mkdir()
    d = write_run(tmp_path / "run", synth_spans(ranks=2, steps=4))
    args = [a.format(empty=tmp_path / "empty", run=d) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hvtrace: error:"), err


def test_cli_bad_step_range_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["analyze", "x", "--steps", "9:3"])
    assert e.value.code == 2
    assert "selects no step" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpu", "words"),
    [("nccl", "GPU tensors over NCCL"), ("host", "GPU tensors through host memory"), (None, None)],
)
def test_the_report_says_what_carried_gpu_tensors(tmp_path: Path, gpu, words) -> None:
    """A GPU job launched with Gloo sends its CUDA tensors over NCCL where Horovod was built
    with it: the head says so, not Gloo alone (and a CPU run says nothing of GPUs)."""
    extra = {"controller": "gloo"} | ({"gpu_operations": gpu} if gpu else {})
    run = write_run(tmp_path / "run", synth_spans(ranks=2, tensors=2), **extra)
    a = analyze(load_run(run))
    assert a.gpu_operations == (gpu or "")
    head = format_report(a).split("\n\n")[0]
    assert "Horovod over Gloo" in head
    assert (words in head) if words else "GPU tensors" not in head
    assert analysis_to_dict(a)["gpu_operations"] == (gpu or "")


def test_the_header_records_what_carries_gpu_tensors() -> None:
    from types import SimpleNamespace

    from hvtrace.record.header import _gpu_operations

    cuda, cpu = SimpleNamespace(type="cuda", index=0), SimpleNamespace(type="cpu")
    assert _gpu_operations(SimpleNamespace(nccl_built=lambda: 22809), cuda) == "nccl"
    assert _gpu_operations(SimpleNamespace(nccl_built=lambda: 0), cuda) == "host"
    assert _gpu_operations(SimpleNamespace(nccl_built=lambda: 22809), cpu) is None
    assert _gpu_operations(SimpleNamespace(), cuda) is None  # an older Horovod: not known
