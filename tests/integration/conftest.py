"""Real ``horovodrun`` jobs that several integration test modules read (session-scoped: each is
launched once, by the first test that needs it, and kept for the session).

A launch costs about 6-7 s before its first step on the 2-core CI machine (horovodrun itself,
then each rank importing torch and Horovod), more than most jobs' steps (issue 39). So a job on
which several modules make their assertions is recorded here once, and the jobs that modules
declare as :func:`helpers.scenario` run several to a launch (``batched``, below;
``tests/batch_train.py``). Each module still says which job it reads and what was injected.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
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
    SCENARIOS,
    SLOW_RANK1_JOB,
    SLOW_SLEEP_JOB,
    Scenario,
    run_horovodrun,
    tail,
    traced_scenario,
)

#: The most jobs one launch runs (a launch that fails, or times out, takes at most these with it).
BATCH_MAX = 10
#: What a job in a launch may take, in seconds, on top of the launch's start.
BATCH_JOB_S = 150
BATCH_WORKER = Path(__file__).resolve().parents[1] / "batch_train.py"
_MARK = re.compile(r"^\[(\d+)\]<std(?:out|err)>:@@batch (begin|end) (\S+)(?: rc=(\S+))?$")


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


SLOW_RANK1 = traced_scenario("shared_slow_rank1", *SLOW_RANK1_JOB)
CLEAN_LIVE = traced_scenario(
    "shared_clean_live", *CLEAN_LIVE_JOB, "--stop-step", "12", env=LIVE_EVERY_5
)
PLAIN = traced_scenario("shared_plain", *PLAIN_JOB, "--save-params", "{base}/params.pt")


@pytest.fixture(scope="session")
def slow_rank1_run(batched: Callable[[Scenario], RecordedJob]) -> Path:
    """``SLOW_RANK1_JOB`` under ``horovodrun -np 2 --gloo``, traced; its trace directory.

    Read by ``test_analyze_cli.py`` (the analysis and the ``analyze`` command name rank 1 and
    its forward) and ``test_dashboard_browser.py`` (the dashboard of a real run in Chromium).
    """
    job = batched(SLOW_RANK1)
    assert "rank 0: 30 steps" in job.stdout, tail(job.stderr)
    return job.trace


@pytest.fixture(scope="session")
def clean_live_run(batched: Callable[[Scenario], RecordedJob]) -> RecordedJob:
    """``CLEAN_LIVE_JOB`` (``--stop-step 12``, no fault) with live detection every 5 steps.

    Read by ``test_lockstep.py`` (the job without the fault: no break, offline or live) and
    ``test_analyze_cli.py`` (a balanced run: no rank named a straggler).
    """
    job = batched(CLEAN_LIVE)
    assert "rank 0: 30 steps" in job.stdout, tail(job.stderr)
    return job


@pytest.fixture(scope="session")
def plain_run(batched: Callable[[Scenario], RecordedJob]) -> RecordedJob:
    """``PLAIN_JOB``, traced with hvtrace's defaults (the compiled hot path where it is built),
    rank 0 saving the final parameters to ``base / "params.pt"``.

    Read by ``test_record_horovod.py`` (what a plain traced run records) and
    ``test_hot_path_horovod.py`` (the compiled form's records, against the pure-Python one's).
    """
    job = batched(PLAIN)
    assert f"rank 0: {PLAIN_STEPS} steps" in job.stdout, tail(job.stderr)
    return job


@pytest.fixture(scope="session")
def slow_sleep_run(compare_runs: tuple[RecordedJob, RecordedJob]) -> RecordedJob:
    """``SLOW_SLEEP_JOB``: rank 1 sleeps ``SLOW_SLEEP_MS`` (50 ms) in each forward, live
    detection off.

    Read by ``test_compare_runs.py`` (against its base run: a new straggler) and
    ``test_causes.py`` (rank 1 named, blocked: the cause of a sleep). Recorded right after the
    base run of ``test_compare_runs.py`` (``compare_runs``).
    """
    return compare_runs[1]


#: ``test_compare_runs.py``'s jobs share a launch of their own (group ``compare``): its base run
#: and the slowed one first, one after the other
COMPARE_BASE = traced_scenario("compare_base", *COMPARE_JOB, env=LIVE_OFF, group="compare")
SLOW_SLEEP = traced_scenario("slow_sleep", *SLOW_SLEEP_JOB, env=LIVE_OFF, group="compare")


@pytest.fixture(scope="session")
def compare_runs(
    batched: Callable[[Scenario], RecordedJob],
) -> tuple[RecordedJob, RecordedJob]:
    """``COMPARE_JOB`` as is (the base run of ``test_compare_runs.py``), then at once
    ``slow_sleep_run``: the two runs that module's slowed-rank test diffs, recorded back to
    back (one launch, declared one after the other) whichever module asks first, so that a
    change of the machine's load between them cannot pass for (or hide) the sleep injected."""
    runs = [batched(COMPARE_BASE), batched(SLOW_SLEEP)]
    for job in runs:
        assert "rank 0: 60 steps" in job.stdout, tail(job.stderr)
    return runs[0], runs[1]


def _split(text: str) -> tuple[dict[str, list[str]], dict[str, dict[int, str]], set[str]]:
    """One launch's output (horovodrun's ``[rank]<stdout>:`` lines) cut at each rank's own
    ``@@batch begin`` marks: each job's lines, each job's end marks by rank, the jobs begun.
    A line of horovodrun's own goes with rank 0's job of the moment."""
    parts: dict[str, list[str]] = {}
    ends: dict[str, dict[int, str]] = {}
    begun: set[str] = set()
    current: dict[str, str] = {}
    for line in text.splitlines():
        rank = line[1 : line.index("]")] if line.startswith("[") and "]" in line else "0"
        m = _MARK.match(line)
        if m and m.group(2) == "begin":
            begun.add(m.group(3))
            current[rank] = m.group(3)
        elif m:
            ends.setdefault(m.group(3), {})[int(m.group(1))] = m.group(4)
        parts.setdefault(current.get(rank, ""), []).append(line)
    return parts, ends, begun


def _run_launch(
    jobs: list[Scenario], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, RecordedJob | str]:
    """Run ``jobs`` (one ``np``) in one launch of ``tests/batch_train.py``; each job's
    :class:`RecordedJob` (its lines of both outputs, the exit status its ranks reported) or why
    it failed; the jobs the launch did not begin are left out."""
    launch = tmp_path_factory.mktemp("batch")
    bases = {sc.name: tmp_path_factory.mktemp(sc.name) for sc in jobs}
    for sc in jobs:
        for rel, text in sc.files:
            (bases[sc.name] / rel).write_text(text)
    spec = [
        {"name": sc.name, "module": sc.module, "argv": sc.args_for(bases[sc.name]),
         "env": dict(sc.env), "cwd": str(bases[sc.name])}
        for sc in jobs
    ]  # fmt: skip
    (launch / "spec.json").write_text(json.dumps(spec, indent=1))
    timeout = 60 + BATCH_JOB_S * len(jobs)
    try:
        proc = run_horovodrun(
            [sys.executable, BATCH_WORKER, launch / "spec.json"],
            np=jobs[0].np, cwd=launch, timeout=timeout, check=False,
        )  # fmt: skip
    except pytest.fail.Exception as e:  # timed out: every job of the launch failed with it
        return {sc.name: f"batched launch of {[s.name for s in jobs]}: {e}" for sc in jobs}
    out, out_ends, begun = _split(proc.stdout)
    err, err_ends, _ = _split(proc.stderr)
    results: dict[str, RecordedJob | str] = {}
    for sc in jobs:
        if sc.name not in begun:
            continue
        mine = subprocess.CompletedProcess(
            proc.args, 0, "\n".join(out.get(sc.name, [])), "\n".join(err.get(sc.name, []))
        )
        rcs = {**out_ends.get(sc.name, {}), **err_ends.get(sc.name, {})}
        if sorted(rcs) == list(range(sc.np)) and set(rcs.values()) == {"0"}:
            results[sc.name] = RecordedJob(bases[sc.name] / "trace", mine, bases[sc.name])
        else:
            results[sc.name] = (
                f"job {sc.name} ({' '.join(sc.args_for(bases[sc.name]))}) failed in a batched "
                f"launch (horovodrun exit {proc.returncode}, ranks' ends {rcs})\n"
                f"stdout:\n{tail(mine.stdout, 15)}\nstderr:\n{tail(mine.stderr)}"
            )
    if proc.returncode != 0 and all(isinstance(r, RecordedJob) for r in results.values()):
        # every job it began ended well, and yet the launch failed (at exit, or before a job
        # began): as a launch of its own would have, it fails each of its jobs
        why = f"batched launch of {[s.name for s in jobs]} exited {proc.returncode}\n"
        results = {n: why + f"stderr:\n{tail(proc.stderr)}" for n in results}
    return results


@pytest.fixture(scope="session")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Scenario], RecordedJob]:
    """The finished job of a :class:`helpers.Scenario`, run the first time any test asks for
    it together with the other declared jobs of its ``np`` and group not yet run (up to
    ``BATCH_MAX`` a launch, the asked job first, then the others in the order declared from it
    on): one ``horovodrun`` launch instead of one a job. A job that failed fails each test that
    asks for it, with its output; the jobs its launch did not reach run in the next launch."""
    results: dict[str, RecordedJob | str] = {}

    def get(sc: Scenario) -> RecordedJob:
        while sc.name not in results:
            # the asked job, then the others in the order declared from it on (jobs declared
            # one after the other run one after the other: a pair that a test compares)
            order = list(SCENARIOS.values())
            at = order.index(sc)
            jobs = [
                s for s in order[at:] + order[:at]
                if s.name not in results and (s.np, s.group) == (sc.np, sc.group)
            ][:BATCH_MAX]  # fmt: skip
            done = _run_launch(jobs, tmp_path_factory)
            if not done:  # the launch began no job: none would in another
                done = {s.name: f"batched launch began no job (asked: {sc.name})" for s in jobs}
            results.update(done)
        result = results[sc.name]
        if isinstance(result, str):
            pytest.fail(result, pytrace=False)
        return result

    return get
