"""Survival under real ``horovodrun --gloo``: a killed rank, a stopped job, a file-size limit and a
writer that falls behind. Each test launches real Horovod jobs of the demo trainer (the last
its two, in one launch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import describe, horovodrun_path, job_env, ran_steps, traced_scenario

from hvtrace.cli import main as cli_main
from hvtrace.format.read import read_rank_file
from hvtrace.load import TraceError, load_run

pytestmark = pytest.mark.horovod

SMALL = ["--width", "64", "--layers", "2", "--batch-size", "16"]
N_TENSORS = 6  # 2 * (layers + 1)


def _start(trace_dir: Path, *args: str, env: dict | None = None, preexec=None) -> subprocess.Popen:
    hr = horovodrun_path()
    assert hr is not None
    cmd = [
        str(hr),
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        "-m",
        "hvtrace.examples.train",
        "--trace-dir",
        str(trace_dir),
        *SMALL,
        *map(str, args),
    ]
    return subprocess.Popen(
        cmd,
        env=job_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec,
    )


def _limit_file_size(limit_b: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_b, limit_b))

    return apply


def _rank_file(trace_dir: Path, rank: int) -> Path | None:
    files = sorted(trace_dir.glob(f"rank{rank:05d}-*.arrows"))
    return files[0] if files else None


def _wait_for_step(trace_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 180):
    """Wait until both ranks' files show ``last_step >= step``; return rank -> RankFile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "job ended early\n" + describe(
            subprocess.CompletedProcess(proc.args, proc.returncode, *proc.communicate())
        )
        got = {}
        for r in (0, 1):
            p = _rank_file(trace_dir, r)
            if p is not None:
                try:
                    rf = read_rank_file(p)
                except TraceError:
                    continue
                if rf.last_step >= step:
                    got[r] = rf
        if len(got) == 2:
            return got
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the job did not reach step {step} in {timeout_s} s")


def _finish(proc: subprocess.Popen, timeout_s: float = 120) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("the job did not end after the signal\n" + err[-3000:])
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_rank_killed_with_sigkill_keeps_every_file_and_reports_where_it_stopped(tmp_path, capsys):
    trace = tmp_path / "trace"
    proc = _start(trace, "--steps", "100000")
    files = _wait_for_step(trace, 8, proc)
    pid1 = files[1].header["pid"]
    time.sleep(1.0)  # let it run past the last flush we saw
    kill_ns = time.monotonic_ns()  # CLOCK_MONOTONIC is shared by every process on this host
    os.kill(pid1, signal.SIGKILL)
    done = _finish(proc)
    assert done.returncode != 0  # Horovod's job fails when a rank dies

    run = load_run(trace)  # every rank's file still loads
    assert run.ranks == [0, 1]
    assert not run.complete
    rf1 = run.files[1]
    assert not rf1.complete and rf1.spans > 0
    last_end_ns = int(rf1.table.column("end_ns").to_numpy().max())  # rank 1's own clock
    lost_s = (kill_ns - last_end_ns) / 1e9
    # the writer flushes every 0.5 s: at most about one second of spans is lost
    assert 0 <= lost_s <= 1.5, f"{lost_s:.2f} s of spans lost before the SIGKILL"
    assert any("rank 1 stopped at step" in p for p in run.problems), run.problems

    out_json = tmp_path / "report.json"
    capsys.readouterr()
    rc = cli_main(["analyze", str(trace), "--json", str(out_json)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "rank 1 stopped at step" in out.out + out.err
    import json

    report = json.loads(out_json.read_text())
    assert report["problems"], "the report must say the run is incomplete"
    # only steps that every rank completed are analyzed
    last_common = min(
        int(run.spans[(run.spans["rank"] == r) & (run.spans["kind"] == "step")]["step"].max())
        for r in run.ranks
    )
    assert report["steps"]["last"] <= last_common


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_job_stopped_by_signal_ends_files_cleanly(tmp_path, sig):
    trace = tmp_path / "trace"
    proc = _start(trace, "--steps", "100000")
    _wait_for_step(trace, 5, proc)
    os.kill(proc.pid, sig)  # to horovodrun, as a terminal's Ctrl-C or a scheduler's SIGTERM
    _finish(proc)
    run = load_run(trace)
    assert run.ranks == [0, 1]
    for r, f in run.files.items():
        assert not f.truncated, f"rank {r}: file truncated"
        assert f.complete, f"rank {r}: no final flush ({f.path})"
        assert f.last_step >= 5


def test_file_size_limit_mid_run_training_finishes_with_one_warning(tmp_path):
    trace = tmp_path / "trace"
    limit_kb = 48
    # RLIMIT_FSIZE applies to every process of the job; hvtrace ignores SIGXFSZ so the write fails
    # with EFBIG instead of killing the rank.
    proc = _start(
        trace,
        "--steps",
        "400",
        "--step-times",
        tmp_path / "times.json",
        env={"HVTRACE_FLUSH_S": "0.1"},
        preexec=_limit_file_size(limit_kb * 1024),
    )
    done = _finish(proc, timeout_s=600)
    assert done.returncode == 0, describe(done)
    assert (tmp_path / "times.json").exists()  # the training loop ran to the end
    for r in (0, 1):
        warnings = [
            ln
            for ln in done.stderr.splitlines()
            if f"tracing disabled on rank {r}" in ln and "hvtrace" in ln
        ]
        assert warnings, f"no warning for rank {r}:\n{done.stderr[-3000:]}"
        assert len({w.split("]", 1)[-1] for w in warnings}) == 1, warnings
    run = load_run(trace)  # what was written before the limit stays readable
    for f in run.files.values():
        assert f.spans > 0
        assert f.path.stat().st_size <= limit_kb * 1024
        assert not f.complete


#: the same job recorded in full and with a writer that falls behind (one launch, one after the
#: other: ``tests/batch_train.py``)
FULL = traced_scenario("reliability_full", "--steps", "60", *SMALL)
LAGGING = traced_scenario(
    "reliability_lagging", "--steps", "60", *SMALL,
    env={"HVTRACE_BUFFER_SPANS": "40", "HVTRACE_FLUSH_S": "2"},
)  # fmt: skip


def test_writer_falling_behind_drops_and_counts_spans(batched):
    ref = load_run(ran_steps(batched(FULL), 60))
    got = load_run(batched(LAGGING).trace)
    for r in (0, 1):
        f = got.files[r]
        assert f.dropped > 0, "a 40-span buffer flushed every 2 s must overflow"
        # nothing vanishes silently: written + dropped == what the same run records in full
        assert f.spans + f.dropped == ref.files[r].spans
        assert any("dropped" in p and f.path.name in p for p in got.problems)
