"""Real ``horovodrun`` jobs that several integration test modules read (session-scoped: each is
launched once, by the first test that needs it, and kept for the session).

A launch costs about 7 s before its first step on the 2-core CI machine (horovodrun itself, then
each rank importing torch and Horovod), more than most jobs' steps: a job on which several
modules make their assertions is recorded here once (issue 39). Each module still says which job
it reads and what was injected into it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import (
    CLEAN_LIVE_JOB,
    COMPARE_JOB,
    LIVE_EVERY_5,
    LIVE_OFF,
    PLAIN_JOB,
    PLAIN_STEPS,
    SLOW_RANK1_JOB,
    SLOW_SLEEP25_JOB,
    run_train,
    tail,
)


@dataclass
class RecordedJob:
    """A finished, traced job: its trace directory, the finished horovodrun, its directory."""

    trace: Path
    proc: subprocess.CompletedProcess
    base: Path

    @property
    def stdout(self) -> str:
        return self.proc.stdout

    @property
    def stderr(self) -> str:
        return self.proc.stderr


@pytest.fixture(scope="session")
def slow_rank1_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``SLOW_RANK1_JOB`` under ``horovodrun -np 2 --gloo``, traced; its trace directory.

    Read by ``test_analyze_cli.py`` (the analysis and the ``analyze`` command name rank 1 and
    its forward) and ``test_dashboard_browser.py`` (the dashboard of a real run in Chromium).
    """
    d = tmp_path_factory.mktemp("slow_rank1")
    run_train(*SLOW_RANK1_JOB, "--trace-dir", d / "trace", cwd=d)
    return d / "trace"


@pytest.fixture(scope="session")
def clean_live_run(tmp_path_factory: pytest.TempPathFactory) -> RecordedJob:
    """``CLEAN_LIVE_JOB`` (``--stop-step 12``, no fault) with live detection every 5 steps.

    Read by ``test_lockstep.py`` (the job without the fault: no break, offline or live) and
    ``test_analyze_cli.py`` (a balanced run: no rank named a straggler).
    """
    d = tmp_path_factory.mktemp("clean_live")
    trace = d / "trace"
    proc = run_train(
        *CLEAN_LIVE_JOB, "--trace-dir", trace, "--stop-step", "12", cwd=d, env=LIVE_EVERY_5
    )
    assert "rank 0: 30 steps" in proc.stdout, tail(proc.stderr)
    return RecordedJob(trace, proc, d)


@pytest.fixture(scope="session")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> RecordedJob:
    """``PLAIN_JOB``, traced with hvtrace's defaults (the compiled hot path where it is built),
    rank 0 saving the final parameters to ``base / "params.pt"``.

    Read by ``test_record_horovod.py`` (what a plain traced run records) and
    ``test_hot_path_horovod.py`` (the compiled form's records, against the pure-Python one's).
    """
    d = tmp_path_factory.mktemp("plain")
    trace = d / "trace"
    proc = run_train(*PLAIN_JOB, "--trace-dir", trace, "--save-params", d / "params.pt", cwd=d)
    assert f"rank 0: {PLAIN_STEPS} steps" in proc.stdout, tail(proc.stderr)
    return RecordedJob(trace, proc, d)


@pytest.fixture(scope="session")
def slow_sleep25_run(compare_runs: tuple[RecordedJob, RecordedJob]) -> RecordedJob:
    """``SLOW_SLEEP25_JOB``: rank 1 sleeps 25 ms in each forward, live detection off.

    Read by ``test_compare_runs.py`` (against its base run: a new straggler) and
    ``test_causes.py`` (rank 1 named, blocked: the cause of a sleep). Recorded right after the
    base run of ``test_compare_runs.py`` (``compare_runs``).
    """
    return compare_runs[1]


@pytest.fixture(scope="session")
def compare_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[RecordedJob, RecordedJob]:
    """``COMPARE_JOB`` as is (the base run of ``test_compare_runs.py``), then at once
    ``slow_sleep25_run``: the two runs that module's slowed-rank test diffs, recorded back to
    back whichever module asks first, so that a change of the machine's load between them
    cannot pass for (or hide) the 25 ms injected."""
    runs = []
    for name, job in (("compare_base", COMPARE_JOB), ("slow_sleep25", SLOW_SLEEP25_JOB)):
        d = tmp_path_factory.mktemp(name)
        proc = run_train(*job, "--trace-dir", d / "trace", cwd=d, env=LIVE_OFF)
        assert "rank 0: 60 steps" in proc.stdout, tail(proc.stderr)
        runs.append(RecordedJob(d / "trace", proc, d))
    return runs[0], runs[1]
