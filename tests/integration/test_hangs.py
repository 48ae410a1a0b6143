"""A hung job under real ``horovodrun --gloo``: one rank stops arriving, the others' writers note
the stall in their files, the job is killed, and ``hvtrace analyze`` says who they waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import horovodrun_path, job_env

from hvtrace.cli import main as cli_main
from hvtrace.format.read import read_rank_file
from hvtrace.load import TraceError

pytestmark = pytest.mark.horovod

STOP_STEP = 12
STALL_S = 2.0


def _start(trace: Path, *args: str) -> subprocess.Popen:
    hr = horovodrun_path()
    assert hr is not None
    cmd = [str(hr), "-np", "3", "-H", "localhost:3", "--gloo", sys.executable, "-m",
           "hvtrace.examples.train", "--trace-dir", str(trace), "--width", "64", "--layers", "2",
           "--batch-size", "16", *args]  # fmt: skip
    return subprocess.Popen(
        cmd,
        env=job_env({"HVTRACE_STALL_S": str(STALL_S)}),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _stalls(trace: Path, ranks: list[int]) -> dict[int, list]:
    out = {}
    for r in ranks:
        for p in trace.glob(f"rank{r:05d}-*.arrows"):
            try:
                out[r] = read_rank_file(p).stalls
            except TraceError:
                pass
    return out


def _kill(proc: subprocess.Popen, trace: Path) -> str:
    """Kill the job: horovodrun's process group, then any rank of this job left behind (ranks
    run in sessions of their own; hung ones spin in Horovod's wait and would eat the CPU)."""
    os.killpg(proc.pid, signal.SIGKILL)
    _out, err = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while True:
        procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        left = [int(p.name) for p in procs if _is_rank(p, trace)]
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not left, f"ranks {left} survived the kill"
    return err


def _hang_then_kill(proc: subprocess.Popen, trace: Path, timeout_s: float = 240) -> None:
    """Wait until each of the 3 ranks noted a stall in its file, then kill the job."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            st = _stalls(trace, [0, 1, 2])
            if len(st) == 3 and all(v for v in st.values()):
                return
            time.sleep(0.5)
        pytest.fail(f"no stall noted in {timeout_s:.0f} s: {_stalls(trace, [0, 1, 2])}")
    finally:
        _kill(proc, trace)


def _rank_pid(trace: Path, rank: int) -> int:
    """The pid of this job's rank ``rank`` (from /proc: its command line and environment)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _is_rank(p, trace):
            try:
                env = (p / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"HOROVOD_RANK={rank}".encode() in env and b"python" in (p / "cmdline").read_bytes():
                return int(p.name)
    raise AssertionError(f"rank {rank} of {trace} not found")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _is_rank(proc_dir: Path, trace: Path) -> bool:
    try:
        return str(trace) in (proc_dir / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_stopped_rank_is_named_by_the_hung_others(tmp_path: Path, capsys) -> None:
    """Rank 1 stops itself (SIGSTOP) at step 12: ranks 0 and 2 wait in synchronize; after
    HVTRACE_STALL_S their files say so (and each logs a warning), the job is then killed, and
    the analysis reports a hang at step 12 on the first line: rank 1 never arrived, ranks 0 and
    2 waited, with the tensor they waited for."""
    trace = tmp_path / "trace"
    proc = _start(trace, "--steps", "100000", "--stop-rank", "1", "--stop-step", str(STOP_STEP))
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            st = _stalls(trace, [0, 2])
            waited = [max((s["waited_s"] for s in v), default=0) for v in st.values()]
            if len(waited) == 2 and min(waited) >= 2 * STALL_S:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no stall noted in 240 s: {_stalls(trace, [0, 1, 2])}")
        # a rank hung in Horovod's wait still dies of SIGTERM (as without hvtrace), its file
        # closed: the signal is seen outside the main thread, which is stuck in C++
        pid = _rank_pid(trace, 2)
        os.kill(pid, signal.SIGTERM)
        gone = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < gone:
            time.sleep(0.2)
        assert not _alive(pid), "rank 2, hung in synchronize, survived SIGTERM"
    finally:
        err = _kill(proc, trace)
    assert "has waited" in err and "in synchronize at step 12" in err
    files2 = sorted(trace.glob("rank00002-*"))
    assert files2 and read_rank_file(files2[0]).complete  # closed cleanly by the SIGTERM

    out_json = tmp_path / "report.json"
    capsys.readouterr()
    assert cli_main(["analyze", str(trace), "--json", str(out_json)]) == 0
    report = capsys.readouterr().out
    top = report.split("\n\n")[0]  # the header block, before the first table
    assert "hang at step 12" in top and "rank 1 never arrived" in top, report
    d = json.loads(out_json.read_text())
    (h,) = [f for f in d["findings"] if f["kind"] == "hang"]
    assert d["findings"][0]["kind"] == "hang"
    assert h["data"]["ranks"] == [1] and h["data"]["waiting_ranks"] == [0, 2]
    assert h["data"]["step"] == STOP_STEP and h["data"]["hung"]
    assert h["data"]["waited_s"] >= 2 * STALL_S
    assert h["data"]["tensor"].startswith("net.")  # a gradient of the demo model


def test_a_collective_only_one_rank_issues_names_that_rank(tmp_path: Path) -> None:
    """Rank 2 alone averages a metric with hvd.allreduce after step 12 (the others never issue
    it): rank 2 waits there, outside the optimizer, and ranks 0 and 1 wait in step 13's
    synchronize for its gradients. The hang names rank 2 as the one that did not arrive."""
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    trace = tmp_path / "trace"
    proc = _start(
        trace, "--steps", "100000", "--lone-allreduce-rank", "2", "--stop-step", str(STOP_STEP)
    )
    _hang_then_kill(proc, trace)  # rank 2 notes its wait in the metric allreduce
    a = analyze(open_run(trace))
    (h,) = a.hangs
    assert h["hung"] and h["step"] == STOP_STEP + 1
    assert h["ranks"] == [2] and h["waiting_ranks"] == [0, 1]
    # where rank 2 is: the collective only it issued (after step 12: step 13's input)
    assert h["in_collective"] == {"2": "allreduce.average|input|metric.loss"}, h
    msg = a.findings[0].message
    assert a.findings[0].kind == "hang" and "rank 2 never arrived" in msg
    assert "rank 2 waits in hvd.allreduce (average) 'metric.loss'" in msg, msg


def test_a_rank_that_skips_a_collective_the_others_issue_is_named(tmp_path: Path) -> None:
    """Every rank averages a metric with hvd.allreduce after each step, but rank 1 skips it after
    step 12 (a bug on one rank): ranks 0 and 2 wait in that allreduce, rank 1 waits in step 13's
    synchronize for their gradients. The hang names rank 1 and the collective it skipped."""
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    trace = tmp_path / "trace"
    proc = _start(
        trace, "--steps", "100000", "--metric-allreduce", "--skip-allreduce-rank", "1",
        "--stop-step", str(STOP_STEP),
    )  # fmt: skip
    _hang_then_kill(proc, trace)
    a = analyze(open_run(trace))
    (h,) = a.hangs
    assert h["hung"] and h["skipped"] and h["step"] == STOP_STEP + 1, h
    assert h["ranks"] == [1] and h["waiting_ranks"] == [0, 2], h
    assert h["tensor"] == "allreduce.average|input|metric.loss", h
    assert h["skippers_wait_for"], h  # rank 1 waits for the others' gradients
    msg = a.findings[0].message
    assert a.findings[0].kind == "hang", msg
    assert "rank 1 skipped hvd.allreduce (average) 'metric.loss'" in msg, msg
    assert "ranks 0, 2 issued it and waited in it" in msg, msg


def test_a_run_that_did_not_hang_has_no_such_finding(tmp_path: Path) -> None:
    """The same job without the stop, with the same short stall time: no stall, no hang."""
    trace = tmp_path / "trace"
    proc = _start(trace, "--steps", "30")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    a = analyze(open_run(trace))
    assert a.hangs == [] and not [f for f in a.findings if f.kind in ("hang", "stall")]
