"""Ranks out of lockstep, under real ``horovodrun -np 2 --gloo`` (issue 44).

Jobs whose ranks stop taking the same steps, as user code does by deciding on one rank's view,
and that Horovod lets finish with exit 0 (every rank calls ``hvd.join()`` after its loop, the
pattern for uneven data): rank 0 leaves the loop at step 12 (the others train on alone); rank 1
skips its step 12 after the forward (a "bad loss" guard: one optimizer step fewer). Each must be
named at its rank and step. Quiet: the same job without the fault, and a rank that skips only
its backward (Horovod allreduces zeros for it: the ranks stay in step).
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


def test_a_rank_that_skips_a_step_is_named_with_the_step_it_skipped(tmp_path_factory) -> None:
    """A rank that skips its optimizer step once (at step 12: its forward, then no backward and
    no update) takes one step fewer: its allreduces pair with the others' of the next step from
    then on, and its last step pairs with nothing (it joins). hvtrace's steps are the
    optimizer's: the skipped batch's forward is counted into the rank's step 12, a forward with
    no backward that no other rank has; with the step the rank ends short, that names the step
    it skipped."""
    breaks, findings = _lockstep(_job(tmp_path_factory, "skipstep", "--skip-step-rank", "1"))
    assert [(b["kind"], b["ranks"], b["step"], b["others"]) for b in breaks] == [
        ("stopped", [1], 28, [0])
    ], breaks
    assert breaks[0]["joined"] and breaks[0]["steps_without"] == 1
    assert breaks[0]["skipped_steps"] == [12], breaks
    msg = findings[0].message
    assert "rank 1 skipped an optimizer step at step 12" in msg, msg
    assert "it ended at step 28 while rank 0 went on to step 29 alone (it joined)" in msg, msg


def test_a_rank_that_skips_a_backward_stays_in_step(tmp_path_factory) -> None:
    """Without its backward a rank still steps the optimizer, and Horovod's synchronize
    allreduces zeros for the gradients it lacks: the ranks stay in step (and apply the same
    averaged gradients), so no lockstep finding."""
    breaks, findings = _lockstep(_job(tmp_path_factory, "skipbwd", "--skip-backward-rank", "1"))
    assert breaks == [] and findings == []


def test_the_same_job_without_the_fault_is_quiet(tmp_path_factory) -> None:
    breaks, findings = _lockstep(_job(tmp_path_factory, "clean"))
    assert breaks == [] and findings == []
