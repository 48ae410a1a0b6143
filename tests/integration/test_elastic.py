"""Elastic Horovod on real ``horovodrun`` jobs (Gloo, elastic mode, ``train_elastic`` example).

Horovod blocklists the whole host of a failed worker, so the discovery script names two hosts of
this machine (``localhost`` and ``127.0.0.1``, one slot each) over the loopback interface.

- One worker is killed (SIGKILL) at step 25 of 60, commits every 10 steps: the job goes on on one
  worker from the commit at step 20, every file loads, and the report names the reset with the
  lost worker (the one killed), the 5 replayed steps and the time training stood still.
- One worker runs, then the discovery script starts naming a second host (a marker file rank 0
  creates at step 10): a worker joins, and the report shows the size going from 1 to 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import horovodrun_path, run_job, tail

from hvtrace.analysis.summary import analyze
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.format.read import find_trace_files, read_rank_file
from hvtrace.load import open_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(200)]


def _discovery(tmp: Path, second_when: Path | None) -> Path:
    script = tmp / "discover.sh"
    second = (
        "echo 127.0.0.1:1" if second_when is None else f"[ -e {second_when} ] && echo 127.0.0.1:1"
    )
    script.write_text(f"#!/bin/sh\necho localhost:1\n{second}\nexit 0\n")
    script.chmod(0o755)
    return script


def _elastic(tmp: Path, np: int, script: Path, *train_args: str, env: dict | None = None):
    hr = horovodrun_path()
    if hr is None:
        pytest.skip("horovodrun not installed")
    cmd = [
        str(hr), "-np", str(np), "--min-np", "1", "--max-np", "2",
        "--host-discovery-script", str(script), "--network-interface", "lo",
        sys.executable, "-m", "hvtrace.examples.train_elastic",
        "--trace-dir", str(tmp / "trace"), *train_args,
    ]  # fmt: skip
    return run_job(cmd, env, tmp, 150, True, "horovodrun (elastic)")


def test_a_worker_killed_mid_run_is_reported_as_a_reset(tmp_path: Path) -> None:
    script = _discovery(tmp_path, None)
    proc = _elastic(
        tmp_path, 2, script, "--steps", "60", "--commit-every", "10",
        "--die-rank", "1", "--die-step", "25", "--step-sleep-ms", "10",
        env={"HVTRACE_FLUSH_S": "0.05"},  # the killed worker flushed its first steps
    )  # fmt: skip
    assert "rank 0 (worker 0): done 60 steps, size 1" in proc.stdout, tail(proc.stderr)
    paths = find_trace_files(tmp_path / "trace")
    assert len(paths) == 2
    for p in paths:  # every file loads, the killed worker's too (not closed, kept)
        assert read_rank_file(p).spans > 0
    run = open_run(tmp_path / "trace")
    a = analyze(run)
    assert [(e["size"], e["start_step"]) for e in a.membership] == [(2, 0), (1, 25)]
    killed = next(m for m in a.membership[0]["workers"] if m["rank"] == 1)
    (reset,) = [f for f in a.findings if f.kind == "reset"]
    d = reset.data
    assert (d["step"], d["size_before"], d["size_after"]) == (25, 2, 1)
    assert d["workers_left"] == [killed["worker"]] and d["ranks_left"] == [1]
    assert d["hosts_left"] == [killed["horovod_host"]]
    assert d["replayed_steps"] == 5 and d["restored"] is True
    assert 0 < d["stall_s"] < 60 and d["lost_s"] >= d["stall_s"]
    # the survivor goes on from the commit: 40 more steps, numbered on after the reset
    assert int(run.files[0].last_step) == 25 + 40
    report = format_report(a, width=200)
    assert "elastic reset at step 25 (a worker failed, " in report
    assert f"lost worker {killed['worker']} (rank 1, host {killed['horovod_host']})" in report
    assert "Membership epochs" in report
    js = analysis_to_dict(a)
    assert [e["size"] for e in js["membership"]] == [2, 1]
    assert any(f["kind"] == "reset" and f["data"]["stall_s"] > 0 for f in js["findings"])


def test_a_worker_that_joins_raises_the_size(tmp_path: Path) -> None:
    marker = tmp_path / "second-host"
    script = _discovery(tmp_path, marker)
    proc = _elastic(
        tmp_path, 1, script, "--steps", "150", "--commit-every", "10",
        "--step-sleep-ms", "40", "--marker", str(marker), "--marker-step", "10",
    )  # fmt: skip
    assert "rank 0 (worker 0): done 150 steps, size 2" in proc.stdout, tail(proc.stderr)
    assert "rank 1 (worker 1): done 150 steps, size 2" in proc.stdout, tail(proc.stderr)
    run = open_run(tmp_path / "trace")
    assert sorted(run.files) == [0, 1] and run.complete, run.problems
    a = analyze(run)
    assert [e["size"] for e in a.membership] == [1, 2]
    (reset,) = [f for f in a.findings if f.kind == "reset"]
    d = reset.data
    assert (d["size_before"], d["size_after"]) == (1, 2)
    assert d["workers_joined"] == [1] and d["hosts_joined"] == ["127.0.0.1"]
    assert d["workers_left"] == [] and d["replayed_steps"] == 0
    assert d["step"] == a.membership[1]["start_step"] >= 10
    # the joined worker's steps are numbered on from the survivor's
    assert int(run.files[1].header["membership"]["start_step"]) == d["step"]
    assert "size 1 -> 2; joined worker 1 (rank 1, host 127.0.0.1)" in format_report(a, width=200)
