"""Advice that fits what was seen: collectives outside the optimizer stated at their real cost
(per call, per step over the run, share of the run), never told to run "every N steps" when they
already run less than once per step; Lightning's own collectives named as Lightning's, with what
the user can change; waiting routed to the wait; costs within the noise not warned about; and
warnings listed before info notes. Hand-made two-rank jobs of 100 ms steps."""

from __future__ import annotations

import pandas as pd
import pytest
from analysis_frames import MS
from analysis_frames import span_row as _span

from hvtrace.analysis import analyze_spans, make_findings
from hvtrace.analysis.findings import OUTSIDE_RUN_SHARE
from hvtrace.format.schema import FLAG_AGREE

STEPS = 41  # steps 1..40 analyzed (step 0 is warm-up)


def _job(calls: dict[int, list[tuple[str, dict[int, tuple[float, float]]]]], nbytes: int = 4):
    """Two ranks, 100 ms steps (input 5, forward 70, backward 10, wait 3, update 12 ms).

    ``calls``: step -> [(span name, {rank: (start, end) ms into the forward})]: a blocking
    collective issued in the forward, the rank blocked from start to end."""
    rows = []
    for r in (0, 1):
        for st in range(STEPS):
            t0 = st * 100
            rows.append(_span(r, st, "step", t0, t0 + 100))
            rows.append(_span(r, st, "input", t0, t0 + 5))
            rows.append(_span(r, st, "forward", t0 + 5, t0 + 75))
            rows.append(_span(r, st, "backward", t0 + 75, t0 + 85))
            rows.append(_span(r, st, "allreduce", t0 + 76, t0 + 86, "w"))
            rows.append(_span(r, st, "wait", t0 + 85, t0 + 88))
            rows.append(_span(r, st, "update", t0 + 88, t0 + 100))
            for name, at in calls.get(st, []):
                s, e = at[r]
                cs, ce = t0 + 5 + s, t0 + 5 + e
                rows.append(_span(r, st, "collective", cs, ce, name, (ce - cs) * MS, nbytes=nbytes))
    return pd.DataFrame(rows)


def _every(n: int, name: str, at: dict[int, tuple[float, float]] | None = None, first: int = 10):
    """The same call every ``n`` steps from step ``first``, both ranks blocked 0..60 ms."""
    at = at or {0: (0.0, 60.0), 1: (0.0, 60.0)}
    return {st: [(name, at)] for st in range(first, STEPS, n)}


def _outside(a) -> list:
    return [f for f in a.findings if f.kind in ("collective_cost", "collective_wait")]


def test_a_call_once_every_ten_steps_is_not_told_to_run_every_n_steps() -> None:
    a = analyze_spans(_job(_every(10, "allreduce.average|forward|val_loss")))
    (f,) = _outside(a)
    d = f.data
    assert d["count"] == 4 and d["count_per_step"] == pytest.approx(4 / 40)
    assert d["blocked_ms_per_call"] == pytest.approx(60.0)
    # 60 % of the 100 ms step it runs in, once every 10 steps: 6 % of the run
    assert d["run_share"] == pytest.approx(0.60 * d["count_per_step"])
    assert "every N steps" not in f.message and "instead of every step" not in f.message
    assert "once every 10 steps" in f.message and "60% of a median step" in f.message
    assert (
        "6.0% of the run's time" in f.message
        and "6.00 ms per step averaged over the run" in f.message
    )
    assert "already runs less than once per step" in f.message
    assert f.severity == "warning"  # 6 % of the run: worth it (>= OUTSIDE_RUN_SHARE)
    assert d["run_share"] >= OUTSIDE_RUN_SHARE


def test_a_call_every_step_is_still_told_to_reduce_every_n_steps() -> None:
    at = {0: (0.0, 20.0), 1: (0.0, 20.0)}
    a = analyze_spans(_job(_every(1, "allreduce.average|forward|loss", at, first=0)))
    (f,) = _outside(a)
    assert f.kind == "collective_cost" and f.severity == "warning"
    assert "every N steps instead of every step" in f.message
    assert "20.0 ms per step" in f.message and "20.0% of the run's time" in f.message


def test_lightnings_checkpoint_collective_says_what_it_is_and_what_to_change() -> None:
    a = analyze_spans(
        _job(_every(10, "broadcast_object|forward|lightning:ModelCheckpoint.file_exists"))
    )
    (f,) = _outside(a)
    assert "Lightning's ModelCheckpoint callback" in f.message
    assert "every_n_train_steps" in f.message and "every_n_epochs" in f.message
    assert "_async" not in f.message and "every N steps" not in f.message
    assert "6.0% of the run's time" in f.message
    assert f.data["issued_by"] == "Lightning's ModelCheckpoint callback"
    # the trace shows Lightning by that name
    assert a.lightning == ""


def test_the_join_and_allreduce_of_one_lightning_reduce_are_one_finding() -> None:
    name = "lightning:ModelCheckpoint.check_monitor_top_k"
    join = {0: (0.0, 20.0), 1: (0.0, 20.0)}
    red = {0: (20.0, 60.0), 1: (20.0, 60.0)}
    pair = [(f"join|forward|{name}", join), (f"allreduce.sum|forward|{name}", red)]
    a = analyze_spans(_job({st: pair for st in range(10, STEPS, 10)}, nbytes=8))
    assert len(a.outside) == 2
    (f,) = _outside(a)
    assert f.data["op"] == "join+allreduce.sum" and f.data["count"] == 4
    assert f.data["run_share"] == pytest.approx(0.06)  # 20 + 40 ms once every 10 steps
    assert f.message.startswith(f"hvd.join then hvd.allreduce (sum) '{name}'")
    assert "Lightning's ModelCheckpoint callback" in f.message


def test_lightnings_data_loader_check_is_never_a_warning() -> None:
    a = analyze_spans(_job(_every(10, "allreduce.sum|forward|lightning:has_len_all_ranks")))
    (f,) = _outside(a)
    assert f.severity == "info" and "nothing to change" in f.message


def test_an_unnamed_broadcast_object_in_a_lightning_run_is_named_as_probably_lightnings() -> None:
    a = analyze_spans(_job(_every(10, "broadcast_object|forward|"), nbytes=0))
    (plain,) = _outside(a)
    assert "Lightning" not in plain.message  # not known to be a Lightning run
    a.framework = {"name": "pytorch_lightning", "version": "1.9.5"}
    (f,) = [f for f in make_findings(a) if f.kind == "collective_cost"]
    assert "most likely Lightning's own" in f.message and "every_n_train_steps" in f.message


def test_ranks_waiting_for_one_late_rank_are_told_so() -> None:
    # rank 1 issues it 50 ms after rank 0, which waits: rank 0 blocked 55 ms, rank 1 5 ms
    at = {0: (0.0, 55.0), 1: (50.0, 55.0)}
    a = analyze_spans(_job(_every(10, "allreduce.average|forward|val_loss", at)))
    (f,) = _outside(a)
    assert f.kind == "collective_wait" and f.data["rank"] == 1
    # rank 0 waited 50 of its 55 ms (the call itself: rank 1's 5 ms)
    assert f.data["wait_share"] == pytest.approx(50 / 55)
    assert "for rank 1" in f.message and "of the run's time" in f.message


def test_waiting_for_a_different_rank_each_call_is_not_advised_to_run_less_often() -> None:
    # the last rank alternates: no one rank to name, but the time is waiting, not the call
    calls = {}
    for i, st in enumerate(range(5, STEPS, 5)):
        late = i % 2
        at = {late: (50.0, 55.0), 1 - late: (0.0, 55.0)}
        calls[st] = [("allreduce.average|forward|val_loss", at)]
    a = analyze_spans(_job(calls))
    (f,) = _outside(a)
    assert f.kind == "collective_cost"
    assert "mostly wait in it for the last one" in f.message
    assert "every N steps" not in f.message and "_async" not in f.message
    # 55 ms every 5 steps blocks 11 % of the run, but 50 of the 55 ms are the wait for the
    # other rank, which without the call moves to the next collective: a note, not a warning
    assert f.data["run_share"] > OUTSIDE_RUN_SHARE
    assert f.severity == "info"


def test_a_cost_within_the_noise_is_no_finding_and_a_small_one_only_a_note() -> None:
    tiny = {0: (0.0, 3.0), 1: (0.0, 3.0)}  # 3 ms every 10 steps: 0.3 % of the run
    a = analyze_spans(_job(_every(10, "allreduce.average|forward|m", tiny)))
    assert not _outside(a), [f.message for f in a.findings]
    small = {0: (0.0, 30.0), 1: (0.0, 30.0)}  # 30 ms every 10 steps: 3 % of the run
    a = analyze_spans(_job(_every(10, "allreduce.average|forward|m", small)))
    (f,) = _outside(a)
    assert f.severity == "info" and "3.0% of the run's time" in f.message


def test_warnings_come_before_info_notes() -> None:
    frame = _job(_every(1, "allreduce.average|forward|loss", {0: (0, 20), 1: (0, 20)}, first=0))
    # a logged metric that differs across ranks: an info divergence, assembled early
    metric = "hvtrace.metric|val_loss"
    scal = [
        _span(r, 20, "scalar", 2010, 2010, metric, 1.0 + r) | {"flags": FLAG_AGREE} for r in (0, 1)
    ]
    a = analyze_spans(pd.concat([frame, pd.DataFrame(scal)], ignore_index=True))
    sev = [f.severity for f in a.findings]
    kinds = [f.kind for f in a.findings]
    assert "divergence" in kinds and "collective_cost" in kinds, kinds
    assert sev == sorted(sev, key=lambda s: s != "warning"), list(zip(kinds, sev))
    assert kinds.index("collective_cost") < kinds.index("divergence")


def _defined_in(path: str, src: str) -> dict:
    """Run ``src`` as if it were the file ``path`` (its functions' frames carry that name)."""
    ns: dict = {}
    exec(compile(src, path, "exec"), ns)
    return ns


def test_the_recorder_names_an_unnamed_call_by_the_lightning_code_that_asked_for_it() -> None:
    import sys

    from hvtrace.record.collectives import lightning_caller

    site = "/venv/lib/python3.11/site-packages/pytorch_lightning"
    # the Horovod function sees its caller's frame: the strategy's method
    strategy = _defined_in(
        f"{site}/strategies/horovod.py",
        "def broadcast(probe):\n    return probe()\n",
    )
    parallel = _defined_in(
        f"{site}/strategies/parallel.py",
        "def reduce_boolean_decision(bcast, probe):\n    return bcast(probe)\n",
    )
    ckpt = _defined_in(
        f"{site}/callbacks/model_checkpoint.py",
        "class ModelCheckpoint:\n"
        "    def file_exists(self, decide, bcast, probe):\n"
        "        return decide(bcast, probe)\n",
    )
    user = _defined_in(
        "/home/me/train.py", "def on_val_end(bcast, probe):\n    return bcast(probe)\n"
    )

    def probe() -> str | None:  # what collectives._describe does: its caller's caller
        return lightning_caller(sys._getframe(1))

    b, decide = strategy["broadcast"], parallel["reduce_boolean_decision"]
    got = ckpt["ModelCheckpoint"]().file_exists(decide, b, probe)
    assert got == "lightning:ModelCheckpoint.file_exists"
    assert user["on_val_end"](b, probe) is None  # the user's own call through the strategy
    assert probe() is None  # any other caller


def test_a_per_step_call_mostly_waiting_for_uneven_ranks_is_a_note() -> None:
    """A metric averaged every step, the ranks taking turns to be 16 ms late to it: it blocks
    12 % of the run, but 80 % of the waiting rank's time in it is that wait, which without the
    call moves to the next collective; what the call costs by itself is under the warning's
    share."""
    calls = {}
    for st in range(STEPS):
        late = st % 2
        calls[st] = [
            ("allreduce.average|forward|loss", {late: (16.0, 20.0), 1 - late: (0.0, 20.0)})
        ]
    a = analyze_spans(_job(calls))
    (f,) = _outside(a)
    assert f.data["run_share"] > OUTSIDE_RUN_SHARE
    assert f.data["run_share"] * (1 - f.data["wait_share"]) < OUTSIDE_RUN_SHARE
    assert f.severity == "info", f.message
