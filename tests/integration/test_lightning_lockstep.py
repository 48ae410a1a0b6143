"""Lightning's steps and callbacks beside hvtrace's, under real ``horovodrun -np 2 --gloo``
(issue 44's Lightning part), with ``hvtrace.examples.train_lightning``:

- ``Trainer(accumulate_grad_batches=2)`` under Lightning 1.9's Horovod strategy updates (and
  allreduces every gradient) after every micro-batch: the optimizer's updates are counted in the
  job by torch's optimizer hooks (``--count-updates``, hvtrace or not) and the finding must give
  the same count, twice Lightning's global steps; ``accumulate_grad_batches=1`` is quiet.
- Rank 0 alone stops at Lightning's global step 8 while accumulating over 2 micro-batches: the
  lockstep finding names hvtrace's step and Lightning's (hvtrace step // 2) beside it.
- Rank 1's ``training_step`` returns None at batch 12: named at rank 1, step 12.
- ``EarlyStopping(patience=2)`` and ``ModelCheckpoint(monitor="val_loss", save_top_k=2)`` on each
  rank's own ``val_loss`` (not averaged), rank 1's getting worse at every validation while rank
  0's improves (``--val-drift-rank 1``): the job stops at the third validation on rank 1's view,
  rank 1 vetoes rank 0's save there, and the ranks end with different best checkpoints (each
  rank prints its own ``best_model_path``). The same job with ``val_loss`` averaged across ranks
  is quiet.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from helpers import LIGHTNING_JOB_MARKS, Scenario, run_horovodrun, tail, traced_scenario

from hvtrace.analysis import analyze
from hvtrace.analysis.model import Analysis
from hvtrace.load import load_run

pytestmark = LIGHTNING_JOB_MARKS

COMMON = ["--width", "64", "--layers", "2", "--batch-size", "32"]
CALLBACKS = ["--steps", "40", "--val-every", "10", "--early-stopping", "--patience", "2"]
CALLBACKS += ["--top-k", "2", "--val-drift-rank", "1"]


class Job:
    def __init__(self, base: Path, stdout: str, stderr: str) -> None:
        self.base, self.stdout, self.stderr = base, stdout, stderr
        self.a: Analysis = analyze(load_run(base / "trace"))

    def printed(self, pattern: str) -> dict[int, str]:
        """Per rank, the first group of ``rank R: PATTERN`` lines the job printed."""
        return {
            int(m.group(1)): m.group(2) for m in re.finditer(rf"rank (\d+): {pattern}", self.stdout)
        }

    def kinds(self, *kinds: str) -> list:
        return [f for f in self.a.findings if f.kind in kinds]


_jobs: dict[tuple[str, ...], Job] = {}


def _job(tmp_path_factory, *args: str) -> Job:
    """A launch of its own: a job that stops one rank early or skips a step on one."""
    if args not in _jobs:
        base = tmp_path_factory.mktemp("lightning_lockstep")
        cmd = [sys.executable, "-m", "hvtrace.examples.train_lightning", *COMMON, *args]
        cmd += ["--trace-dir", str(base / "trace")]
        proc = run_horovodrun(cmd, cwd=base, timeout=600)
        assert "rank 0:" in proc.stdout, tail(proc.stderr)
        _jobs[args] = Job(base, proc.stdout, proc.stderr)
    return _jobs[args]


def _scenario(name: str, *args: str) -> Scenario:
    """A job that runs on every rank to its end: with the other Lightning jobs, in one launch
    (group ``lightning``: ``tests/batch_train.py``)."""
    return traced_scenario(
        f"lightning_lockstep_{name}", *COMMON, *args,
        group="lightning", module="hvtrace.examples.train_lightning",
    )  # fmt: skip


def _batched(batched, sc: Scenario) -> Job:
    done = batched(sc)
    assert "rank 0:" in done.stdout, tail(done.stderr)
    return Job(done.base, done.stdout, done.stderr)


def _updates(run_dir: Path) -> dict[int, int]:
    """hvtrace's recorded updates per rank."""
    run = load_run(run_dir)
    sp = run.spans
    up = sp[sp["kind"].astype(str) == "update"]
    return {int(r): int(n) for r, n in up.groupby("rank").size().items()}


# -- accumulation ----------------------------------------------------------------------------------
ACCUMULATE = ["--steps", "20", "--epochs", "2", "--count-updates"]
ACCUMULATE_2 = _scenario("acc2", *ACCUMULATE, "--accumulate", "2")
ACCUMULATE_1 = _scenario("acc1", *ACCUMULATE, "--accumulate", "1")
UNSYNCED = _scenario("unsynced", *CALLBACKS, "--val-unsynced", "--ckpt-dir", "ckpt")
SYNCED = _scenario("synced", *CALLBACKS, "--ckpt-dir", "ckpt")


def test_accumulation_that_updates_every_micro_batch_is_named_with_the_real_counts(
    batched,
) -> None:
    job = _batched(batched, ACCUMULATE_2)
    counted = {r: int(n) for r, n in job.printed(r"(\d+) optimizer updates").items()}
    global_steps = int(job.printed(r"(\d+) steps")[0])
    # what the job did, counted by torch's hooks: an update per micro-batch, 2 per global step
    assert counted == {0: 2 * global_steps, 1: 2 * global_steps}, job.stdout
    assert _updates(job.base / "trace") == counted
    (f,) = job.kinds("accumulation")
    d = f.data
    assert f.severity == "warning" and d["backward_passes_per_step"] == 2
    assert d["backward_per_update"] == 1 and d["updates"] == counted[0]
    assert d["lightning_steps"] == global_steps
    assert (
        f"{counted[0]} updates and {6 * counted[0]} gradient allreduces for {global_steps} "
        "Lightning global steps" in f.message
    ), f.message
    assert "accumulate_grad_batches=2" in f.message and "after each one" in f.message
    # Lightning's step beside hvtrace's: one record per global step, hvtrace step // 2
    gs = job.a.trainer["global_steps"]
    assert len(gs["0"]) == global_steps + 1, gs
    from hvtrace.analysis.framework import lightning_step

    assert [lightning_step(job.a.trainer, s) for s in range(counted[0])] == [
        s // 2 for s in range(counted[0])
    ]


def test_no_accumulation_is_quiet(batched) -> None:
    job = _batched(batched, ACCUMULATE_1)
    counted = {r: int(n) for r, n in job.printed(r"(\d+) optimizer updates").items()}
    assert counted == {0: 20, 1: 20} and _updates(job.base / "trace") == counted
    assert job.kinds("accumulation", "lockstep", "callback_decision", "best_checkpoint") == []
    assert job.a.accumulation is None
    assert len(job.a.trainer["global_steps"]["0"]) == 1  # Lightning's step is hvtrace's


def test_a_lockstep_break_names_lightnings_step_beside_hvtraces(tmp_path_factory) -> None:
    """Rank 0 stops at global step 8 (its callback) while accumulating over 2 micro-batches:
    hvtrace's steps are the updates, 2 per global step, so the break is at hvtrace step 15 and
    Lightning's global step 7 (the step during which it stopped)."""
    job = _job(tmp_path_factory, *ACCUMULATE, "--accumulate", "2", "--stop-rank0-at", "8")
    (b,) = job.a.lockstep
    assert (b["kind"], b["ranks"], b["step"], b["others"]) == ("stopped", [0], 15, [1]), b
    end = b["others_last_step"]
    assert b["lightning_steps"] == {"15": 7, str(end): end // 2}, b
    (f,) = job.kinds("lockstep")
    assert "rank 0 stopped training after step 15 (Lightning global_step 7)" in f.message
    assert f"went on to step {end} (Lightning global_step {end // 2})" in f.message


def test_a_training_step_skipped_on_one_rank_is_named_at_its_step(tmp_path_factory) -> None:
    """Rank 1's ``training_step`` returns None at batch 12 (a "bad loss" guard on one rank):
    Lightning skips that batch's backward and update there alone, so from step 12 on rank 1's
    gradient allreduces pair with rank 0's of another step. Named at rank 1, step 12, with what
    it did not do; the job itself ends with exit 0 and nothing in its output says so."""
    job = _job(tmp_path_factory, "--steps", "20", "--skip-step-rank", "1", "--skip-at", "12")
    (b,) = job.a.lockstep
    assert (b["step"], b["ranks"], b["others"], b.get("skipped")) == (12, [1], [0], True), b
    assert b["counts"]["1"] == 0 and b["counts"]["0"] > 0, b
    (f,) = job.kinds("lockstep")
    assert f.severity == "warning" and job.a.findings[0].kind == "lockstep"
    assert "rank 1 skipped step 12 (no backward, no allreduce)" in f.message, f.message
    assert "from then on the ranks' collectives pair with other steps'" in f.message


# -- what the callbacks did ------------------------------------------------------------------------
def test_callbacks_deciding_on_one_ranks_view_are_named_at_their_step(batched) -> None:
    job = _batched(batched, UNSYNCED)
    stopped_at = int(job.printed(r"(\d+) steps")[0])
    assert stopped_at == 30, job.stdout  # the third validation, not max_steps=40
    found = {(d["callback"], d["decision"]): d for d in job.a.trainer["decisions"]}
    stop = found[("EarlyStopping", True)]
    assert (stop["step"], stop["global_step"], stop["ranks"], stop["others"]) == (
        29,
        stopped_at,
        [1],
        [0],
    )
    assert stop["values"]["1"] > stop["values"]["0"]  # rank 1's own, drifting up
    veto = found[("ModelCheckpoint", False)]
    assert (veto["step"], veto["ranks"]) == (29, [1])  # the top-2 was full at the third
    best = {int(r): f for r, f in job.printed(r"best checkpoint (\S+)").items()}
    assert best[0] != best[1], job.stdout
    (bd,) = job.a.trainer["best_checkpoints"]
    assert {int(r): f for r, f in bd["files"].items()} == best
    assert (bd["step"], bd["global_step"]) == (19, 20)  # rank 0's second save is its best
    msgs = {f.kind: f.message for f in job.kinds("callback_decision", "best_checkpoint")}
    assert any(
        f.kind == "callback_decision"
        and "EarlyStopping stopped the job after step 29 (Lightning global_step 30) on rank 1's"
        in f.message
        for f in job.a.findings
    ), msgs
    assert f"rank 0 {best[0]}" in msgs["best_checkpoint"], msgs
    assert job.a.findings[0].kind in ("callback_decision", "best_checkpoint"), [
        f.kind for f in job.a.findings
    ]


def test_the_same_callbacks_on_an_averaged_metric_are_quiet(batched) -> None:
    job = _batched(batched, SYNCED)
    best = job.printed(r"best checkpoint (\S+)")
    assert best[0] == best[1], job.stdout
    assert job.a.trainer.get("decisions") == [] and job.a.trainer.get("best_checkpoints") == []
    assert job.kinds("callback_decision", "best_checkpoint", "lockstep") == []
    # the decisions were recorded, and every rank took each alike
    rows = job.a.trainer["rows"]
    assert rows["name"].str.contains("decision|EarlyStopping", regex=False).any()
