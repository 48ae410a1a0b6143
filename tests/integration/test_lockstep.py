"""Ranks out of lockstep, under real ``horovodrun -np 2 --gloo`` (issue 44).

Two jobs whose ranks stop taking the same steps, as user code does by deciding on one rank's
view, and that Horovod lets finish with exit 0 (every rank calls ``hvd.join()`` after its loop,
the pattern for uneven data): rank 0 leaves the loop at step 12 (the others train on alone), and
rank 1 skips the backward of step 12 but steps the optimizer (a "bad loss" guard), so its
allreduces pair with the others' of the next step from then on. Each must be named at its rank
and step; the same job without the fault (the run every other test of the example makes) stays
quiet.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_train

from hvtrace.analysis import analyze
from hvtrace.load import load_run

pytestmark = pytest.mark.horovod

SMALL = ["--steps", "30", "--width", "128", "--layers", "3", "--batch-size", "32"]


def _job(tmp_path_factory, name: str, *args: str) -> Path:
    d = tmp_path_factory.mktemp(name)
    run_train(*SMALL, "--trace-dir", d / "trace", "--stop-step", "12", *args, cwd=d)
    return d / "trace"


def _lockstep(trace: Path) -> tuple[list[dict], list]:
    a = analyze(load_run(trace))
    return a.lockstep, [f for f in a.findings if f.kind == "lockstep"]


def test_a_rank_that_stops_early_and_joins_is_named_at_its_step(tmp_path_factory) -> None:
    breaks, findings = _lockstep(_job(tmp_path_factory, "early", "--end-early-rank", "0"))
    assert [(b["kind"], b["ranks"], b["step"], b["others"]) for b in breaks] == [
        ("stopped", [0], 11, [1])
    ], breaks
    assert breaks[0]["joined"] and breaks[0]["steps_without"] == 18
    assert len(findings) == 1 and findings[0].severity == "warning"
    assert "rank 0 stopped training after step 11 while rank 1 went on to step 29" in (
        findings[0].message
    )


def test_a_rank_that_skips_a_backward_is_named_at_its_step(tmp_path_factory) -> None:
    breaks, findings = _lockstep(_job(tmp_path_factory, "skip", "--skip-backward-rank", "1"))
    assert [(b["kind"], b["ranks"], b["step"], b["skipped"]) for b in breaks] == [
        ("sequence", [1], 12, True)
    ], breaks
    assert "rank 1 skipped step 12 (no backward, no allreduce)" in findings[0].message


def test_the_same_job_without_the_fault_is_quiet(tmp_path_factory) -> None:
    breaks, findings = _lockstep(_job(tmp_path_factory, "clean"))
    assert breaks == [] and findings == []
