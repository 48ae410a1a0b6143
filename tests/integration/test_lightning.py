"""PyTorch Lightning under real Horovod: ``Trainer(strategy="horovod")`` with ``HvtraceCallback``.

Five ``horovodrun -np 2 --gloo`` jobs of ``hvtrace.examples.train_lightning`` (a 2-layer,
64-wide MLP on synthetic data, 30 steps, a few seconds each): traced with validation, checkpoints
and a CSV logger; the same without the callback; the callback with ``HVTRACE=0``; traced with
rank 1 sleeping 40 ms in its forward (these four one after another in one launch:
``tests/batch_train.py``); and rank 0 alone told to stop at step 16 (a launch of its own).
Skipped when pytorch-lightning is not installed (``pip install -e '.[lightning]'``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from helpers import (
    LIGHTNING_JOB_MARKS,
    analyze_cli,
    describe,
    run_horovodrun,
    scenario,
    tail,
)

from hvtrace.analysis import analyze
from hvtrace.load import Run, load_run

pytestmark = LIGHTNING_JOB_MARKS

STEPS = 30
COMMON = ["--steps", str(STEPS), "--width", "64", "--layers", "2", "--batch-size", "32"]
#: validation every 10 steps (each followed by a checkpoint), a CSV logger every 5 steps
FEATURES = ["--val-every", "10"]
TENSORS = {"net.net.0.weight", "net.net.0.bias", "net.net.2.weight", "net.net.2.bias"}
TENSORS |= {"net.net.4.weight", "net.net.4.bias"}
PHASES = ("step", "input", "forward", "backward", "wait", "update")


@dataclass
class Job:
    """One horovodrun launch of the Lightning example."""

    proc: subprocess.CompletedProcess
    base: Path

    @property
    def trace_dir(self) -> Path:
        return self.base / "trace"

    @property
    def params(self) -> Path:
        return self.base / "params.pt"

    def context(self) -> str:
        return f"stdout:\n{tail(self.proc.stdout, 15)}\nstderr:\n{tail(self.proc.stderr)}"


def _launch(tmp_path_factory, name: str, *args: str, env=None, done: int = STEPS) -> Job:
    base = tmp_path_factory.mktemp(name)
    cmd = [sys.executable, "-m", "hvtrace.examples.train_lightning", *COMMON]
    cmd += ["--trace-dir", str(base / "trace"), "--save-params", str(base / "params.pt"), *args]
    proc = run_horovodrun(cmd, env=env, cwd=base)
    job = Job(proc, base)
    assert f"rank 0: {done} steps" in proc.stdout, job.context()
    return job


LIGHTNING = "hvtrace.examples.train_lightning"


def _scenario(name: str, *args: str, env=None) -> object:
    """The example with ``COMMON`` and ``args``, its trace and parameters in the job's directory:
    the Lightning jobs share a launch (group ``lightning``: ``tests/batch_train.py``)."""
    out = ["--trace-dir", "{base}/trace", "--save-params", "{base}/params.pt"]
    return scenario(
        f"lightning_{name}", *COMMON, *out, *args, env=env, group="lightning", module=LIGHTNING
    )


CKPT_LOGS = ["--ckpt-dir", "{base}/ckpt", "--log-dir", "{base}/logs"]
TRACED = _scenario("traced", *FEATURES, *CKPT_LOGS)
UNTRACED = _scenario("untraced", "--no-trace", *FEATURES, *CKPT_LOGS)
SLOWED = _scenario("slowed", "--slow-rank", "1", "--slow-ms", "40", "--slow-phase", "forward")
OFF = _scenario("off", env={"HVTRACE": "0"})


def _batched(batched, sc) -> Job:
    done = batched(sc)
    job = Job(done.proc, done.base)
    assert f"rank 0: {STEPS} steps" in job.proc.stdout, job.context()
    return job


@pytest.fixture(scope="module")
def traced(batched) -> Job:
    return _batched(batched, TRACED)


@pytest.fixture(scope="module")
def untraced(batched) -> Job:
    return _batched(batched, UNTRACED)


@pytest.fixture(scope="module")
def slowed(batched) -> Job:
    return _batched(batched, SLOWED)


def _spans(run: Run, rank: int) -> pd.DataFrame:
    """One rank's spans on its own clock."""
    df = run.files[rank].table.to_pandas()
    for c in ("kind", "name"):
        df[c] = df[c].astype(str)
    return df


# -- (a) traced, analyzed --------------------------------------------------------------------------
def test_records_the_optimizer_spans_and_lightning_phases(traced: Job) -> None:
    run = load_run(traced.trace_dir)
    assert run.ranks == [0, 1] and run.complete, run.problems
    for rank in (0, 1):
        f = run.files[rank]
        assert f.complete and f.dropped == 0 and f.last_step == STEPS, rank
        assert f.header["model"] == "LitMLP"
        df = _spans(run, rank)
        # every step has each phase once, and six allreduces (one per parameter tensor)
        for kind in PHASES:
            got = df[df["kind"] == kind].groupby("step").size().to_dict()
            assert got == {s: 1 for s in range(STEPS)}, (rank, kind, got)
        ar = df[df["kind"] == "allreduce"]
        for step, g in ar.groupby("step"):
            assert set(g["name"]) == TENSORS and len(g) == len(TENSORS), (rank, step)
        assert sorted(ar["step"].unique()) == list(range(STEPS))
        # Lightning's phases as user spans
        users = df[df["kind"] == "user"].groupby("name").size().to_dict()
        # validation: the sanity check, then after steps 10 and 20 (the one after step 30 ends
        # the fit, with the trace still open: on_fit_end comes after it)
        assert users.get("validation", 0) >= 3, users
        assert users.get("checkpoint", 0) == 3, users  # each validation's checkpoint
        assert users.get("callbacks", 0) >= 2 * STEPS, users  # batch start and end, at least
        assert users.get("log", 0) >= STEPS, users  # self.log in every training_step
        if rank == 0:
            assert users.get("logger", 0) >= STEPS // 5, users


def test_a_stop_decided_on_rank_0_alone_is_named_at_its_step(tmp_path_factory) -> None:
    """Issue 44's first case: a callback sets ``trainer.should_stop`` on rank 0 only at step 16.
    Lightning's Horovod teardown joins, so there is no hang and rank 1 trains on alone to the
    end (exit 0): hvtrace names rank 0, the step it stopped after, and that it joined."""
    job = _launch(tmp_path_factory, "stop0", "--stop-rank0-at", "16", done=16)
    a = analyze(load_run(job.trace_dir))
    assert [(b["kind"], b["ranks"], b["step"], b["others"]) for b in a.lockstep] == [
        ("stopped", [0], 15, [1])
    ], a.lockstep
    assert a.lockstep[0]["joined"] and a.lockstep[0]["others_last_step"] == STEPS - 1
    f = [f for f in a.findings if f.kind == "lockstep"]
    assert len(f) == 1 and f[0].severity == "warning" and a.findings[0].kind == "lockstep"
    assert "rank 0 stopped training after step 15 while rank 1 went on" in f[0].message


def test_step_phases_follow_each_other(traced: Job) -> None:
    """Under Lightning's closure (training_step and backward inside optimizer.step) the phases
    come in order, without overlap, from the step's start to its end; the allreduces start
    during backward."""
    run = load_run(traced.trace_dir)
    for rank in (0, 1):
        df = _spans(run, rank)
        ph = df[df["kind"].isin(PHASES)].set_index(["step", "kind"])
        gaps = []
        for step in range(1, STEPS):
            s = {k: ph.loc[(step, k)] for k in PHASES}
            assert s["input"]["start_ns"] == s["step"]["start_ns"], (rank, step)
            assert s["input"]["end_ns"] == s["forward"]["start_ns"], (rank, step)
            assert s["forward"]["end_ns"] <= s["backward"]["start_ns"], (rank, step)
            assert s["backward"]["end_ns"] <= s["wait"]["start_ns"], (rank, step)
            assert s["wait"]["end_ns"] == s["update"]["start_ns"], (rank, step)
            assert s["update"]["end_ns"] == s["step"]["end_ns"], (rank, step)
            ar = df[(df["kind"] == "allreduce") & (df["step"] == step)]
            assert (ar["start_ns"] >= s["backward"]["start_ns"]).all(), (rank, step)
            assert (ar["start_ns"] <= s["backward"]["end_ns"]).all(), (rank, step)
            phases = sum(s[k]["end_ns"] - s[k]["start_ns"] for k in PHASES[1:])
            step_ns = s["step"]["end_ns"] - s["step"]["start_ns"]
            assert phases <= step_ns, (rank, step)
            gaps.append((step_ns - phases) / step_ns)
        # the time no phase accounts for (Lightning's closure between training_step and the
        # backward, and between the last gradient and synchronize) is a small part of a step
        # (one step in a few may be preempted there on a busy 2-core machine)
        assert statistics.median(gaps) < 0.25, (rank, sorted(gaps))


def test_analyze_command(traced: Job, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    p = analyze_cli(traced.trace_dir, "--json", out)
    assert p.returncode == 0, describe(p)
    d = json.loads(out.read_text())
    assert d["ranks"] == [0, 1]
    for r in d["per_rank"]:
        assert r["steps"] == STEPS - 1  # step 0 is warm-up
        for phase in ("input", "forward", "backward", "wait", "update"):
            assert r[f"{phase}_ms"] > 0, (phase, r)
        assert r["allreduce_ms"] > 0 and r["compute_ms"] == 0
    assert {t["name"] for t in d["tensors"]} == TENSORS
    assert all(t["steps"] == STEPS - 1 for t in d["tensors"]), d["tensors"]


# -- (b) a slowed rank -----------------------------------------------------------------------------
def test_names_the_slowed_rank_and_its_phase(slowed: Job) -> None:
    a = analyze(load_run(slowed.trace_dir))
    assert a.stragglers["rank"].tolist() == [1], a.verdicts.to_string()
    s = a.stragglers.iloc[0]
    assert s["phase"] == "forward", a.verdicts.to_string()
    assert s["phase_excess_ms"] > 25, a.verdicts.to_string()
    assert s["cause"] == "blocked", a.verdicts.to_string()  # it sleeps
    assert any(f.kind == "straggler" and "rank 1" in f.message for f in a.findings)


# -- (c) bit-identical, and HVTRACE=0 --------------------------------------------------------------
def test_parameters_bit_identical_with_and_without_the_callback(traced: Job, untraced: Job) -> None:
    import torch

    a = torch.load(traced.params, map_location="cpu", weights_only=True)
    b = torch.load(untraced.params, map_location="cpu", weights_only=True)
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not untraced.trace_dir.exists()


def test_hvtrace_0_is_a_no_op(batched, untraced: Job) -> None:
    import torch

    job = _batched(batched, OFF)
    assert not job.trace_dir.exists(), list(job.base.rglob("*"))
    assert "hvtrace:" not in job.proc.stderr, job.context()  # no warning of hvtrace's
    a = torch.load(job.params, map_location="cpu", weights_only=True)
    b = torch.load(untraced.params, map_location="cpu", weights_only=True)
    # without --val-every etc. the run differs from `untraced` only in validation, which does
    # not change the parameters
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- (d) a correct job gets no warning about what it does right --------------------------------
def test_a_correct_lightning_job_gets_no_false_verdict(traced: Job) -> None:
    """val_loss averaged with hvd.allreduce, a checkpoint at each validation: no straggler, no
    blocking work on rank 0, no divergence warning, and no advice to log with sync_dist (a no-op
    under Horovod) or to run a once-per-validation collective 'every N steps'."""
    a = analyze(load_run(traced.trace_dir))
    msgs = [f"{f.severity} {f.kind}: {f.message}" for f in a.findings]
    warned = {f.kind for f in a.findings if f.severity == "warning"}
    assert not warned & {"straggler", "slow_host", "rank0_blocking", "divergence"}, msgs
    assert not any("sync_dist=True" in m and "averages nothing" not in m for m in msgs), msgs
    outside = [f for f in a.findings if f.kind in ("collective_cost", "collective_wait")]
    assert not any("every N steps" in f.message for f in outside), msgs
