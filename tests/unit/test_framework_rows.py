"""What Lightning counted and decided (:mod:`hvtrace.analysis.framework`), on hand-made rows and
step tables: Lightning's step beside hvtrace's, accumulation that updated every micro-batch, a
callback decision that rested on some ranks' own values, ranks whose best checkpoints differ;
and no word where the ranks agree or the configuration is right."""

from __future__ import annotations

import pandas as pd

from hvtrace.analysis import analyze_spans, framework
from hvtrace.analysis.lockstep import describe, lockstep_breaks
from hvtrace.analysis.model import RankState
from hvtrace.format.schema import (
    BEST_CKPT_PREFIX,
    DECIDED_ON_PREFIX,
    DECISION_PREFIX,
    LIGHTNING_STEP,
)

ES, MC = "EarlyStopping|val_loss", "ModelCheckpoint|val_loss"


def _rows(rows: list[tuple]) -> pd.DataFrame:
    """Rows ``(rank, step, name, value, bytes)`` in recording order."""
    df = pd.DataFrame(rows, columns=["rank", "step", "name", "value", "bytes"])
    df["start_ns"] = range(len(df))
    return df


def _decision(rank: int, step: int, key: str, own: int, combined: int, value: float) -> list:
    g = step + 1
    return [
        (rank, step, DECISION_PREFIX + key, float(own + 2 * combined), g),
        (rank, step, DECIDED_ON_PREFIX + key, value, g),
    ]


# -- Lightning's step ------------------------------------------------------------------------------
def _accumulating(ranks=(0, 1), n: int = 2, steps: int = 20) -> dict:
    """The records of ``accumulate_grad_batches=n`` updating every micro-batch: Lightning's step
    is hvtrace's // n, recorded where it is not the last record's plus the steps since."""
    rows = []
    for r in ranks:
        last = None
        for s in range(steps):
            g = s // n
            if last is None or g != last[1] + s - last[0]:
                rows.append((r, s, LIGHTNING_STEP, float(g), 0))
                last = (s, g)
    return framework.summarize(_rows(rows))


def test_lightning_step_is_read_back_at_every_step_from_the_few_records() -> None:
    state = _accumulating(n=2)
    assert len(state["global_steps"]["0"]) == 11  # one per global step, and the first
    assert [framework.lightning_step(state, s) for s in range(20)] == [s // 2 for s in range(20)]
    one = framework.summarize(_rows([(0, 0, LIGHTNING_STEP, 0.0, 0)]))
    assert framework.lightning_step(one, 57) == 57  # no accumulation: one record
    resumed = framework.summarize(_rows([(0, 0, LIGHTNING_STEP, 100.0, 0)]))
    assert framework.lightning_step(resumed, 7) == 107
    assert framework.lightning_step({}, 7) is None


def test_a_lockstep_break_names_lightnings_step_where_it_differs() -> None:
    last = {0: 11, 1: 29}
    rows = [
        {"rank": r, "step": s, "step_ns": 1e7, "n_allreduce": 6, "n_collective": 0,
         "backward_ns": 4e6, "compute_ns": 0.0, "complete": s <= 11}
        for r, stop in last.items() for s in range(stop + 1)
    ]  # fmt: skip
    states = [RankState(r, True, False, 0, s) for r, s in last.items()]
    joined = pd.DataFrame({"step": [12], "name": ["join|input|"], "n_spans": [1]})
    breaks = lockstep_breaks(pd.DataFrame(rows), joined, states)
    framework.annotate_lockstep(breaks, _accumulating(n=2, steps=30))
    (b,) = breaks
    assert b["lightning_steps"] == {"11": 5, "29": 14}
    msg = describe(b)
    assert "rank 0 stopped training after step 11 (Lightning global_step 5)" in msg, msg
    assert "went on to step 29 (Lightning global_step 14)" in msg, msg
    # where Lightning's step is hvtrace's, nothing is added
    plain = lockstep_breaks(pd.DataFrame(rows), joined, states)
    framework.annotate_lockstep(
        plain, framework.summarize(_rows([(r, 0, LIGHTNING_STEP, 0.0, 0) for r in (0, 1)]))
    )
    assert "lightning_steps" not in plain[0] and "Lightning" not in describe(plain[0])


# -- accumulation ----------------------------------------------------------------------------------
def _analysis(n_backward: int, bpps: int, trainer: dict | None = None, lightning: bool = True):
    st = pd.DataFrame(
        [
            {"rank": r, "step": s, "step_ns": 1e7, "n_allreduce": 6, "n_backward": n_backward,
             "wait_ns": 2e6, "update_ns": 1e6}
            for r in (0, 1) for s in range(20)
        ]
    )  # fmt: skip
    return _Fake(
        steps=st,
        analyzed=st,
        optimizer={"backward_passes_per_step": bpps},
        lightning="1.9.5" if lightning else None,
        trainer=trainer or {},
    )


class _Fake:
    """The parts of an :class:`Analysis` the module reads."""

    def __init__(self, **kw) -> None:
        self.accumulation = None
        self.lightning = None
        self.trainer: dict = {}
        vars(self).update(kw)


def test_accumulation_that_updates_every_micro_batch_is_a_warning_with_its_cost() -> None:
    a = _analysis(n_backward=1, bpps=2, trainer=_accumulating(n=2))
    d = framework.accumulation(a)
    assert d is not None
    assert (d["updates"], d["allreduces"], d["lightning_steps"]) == (20, 120, 10)
    a.accumulation = d
    (f,) = framework.findings(a)
    assert f.kind == "accumulation" and f.severity == "warning" and f.value == 2
    assert "accumulate_grad_batches=2" in f.message and "after each one" in f.message
    assert "20 updates and 120 gradient allreduces for 10 Lightning global steps" in f.message
    assert "handles_gradient_accumulation" in f.message
    assert "backward_passes_per_step=2) and optimizer.step()" in f.message
    # plain Horovod: the advice is about where optimizer.step() is called
    b = _analysis(n_backward=1, bpps=4, lightning=False)
    b.accumulation = framework.accumulation(b)
    (g,) = framework.findings(b)
    assert "backward_passes_per_step=4 asks" in g.message and "Lightning" not in g.message
    assert "once every 4 backward passes" in g.message


def test_accumulation_that_accumulates_or_none_asked_is_quiet() -> None:
    assert framework.accumulation(_analysis(n_backward=2, bpps=2)) is None  # accumulates
    assert framework.accumulation(_analysis(n_backward=1, bpps=1)) is None  # none asked
    assert framework.accumulation(_analysis(n_backward=0, bpps=2)) is None  # not recorded


# -- what the callbacks did ------------------------------------------------------------------------
def test_an_early_stop_on_one_ranks_view_names_that_rank_and_the_values() -> None:
    rows = []
    for step, (v0, v1), (o0, o1) in (
        (9, (2.3, 2.4), (0, 0)),
        (19, (2.2, 2.5), (0, 0)),
        (29, (2.1, 2.6), (0, 1)),
    ):
        stop = int(o0 or o1)
        rows += _decision(0, step, ES, o0, stop, v0) + _decision(1, step, ES, o1, stop, v1)
    state = framework.summarize(_rows(rows))
    (d,) = state["decisions"]
    assert (d["callback"], d["monitor"], d["step"], d["global_step"]) == (
        "EarlyStopping",
        "val_loss",
        29,
        30,
    )
    assert d["decision"] is True and d["ranks"] == [1] and d["others"] == [0]
    assert d["values"] == {"0": 2.1, "1": 2.6} and (d["count"], d["decisions"]) == (1, 3)
    a = _Fake(lightning="1.9.5", trainer=state)
    (f,) = framework.findings(a)
    assert f.kind == "callback_decision" and f.severity == "warning"
    assert "EarlyStopping stopped the job after step 29 (Lightning global_step 30) on rank 1's" in (
        f.message
    )
    assert "rank 1: 2.6), while rank 0's own EarlyStopping would have gone on (rank 0: 2.1)" in (
        f.message
    )
    assert "sync_dist=True" in f.message  # the advice that works under Horovod


def test_a_checkpoint_vetoed_by_one_rank_is_named() -> None:
    rows = _decision(0, 19, MC, 1, 0, 2.2) + _decision(1, 19, MC, 0, 0, 2.5)
    rows += _decision(0, 29, MC, 1, 0, 2.1) + _decision(1, 29, MC, 0, 0, 2.6)
    (d,) = framework.summarize(_rows(rows))["decisions"]
    assert (d["callback"], d["step"], d["decision"], d["ranks"], d["count"]) == (
        "ModelCheckpoint",
        19,
        False,
        [1],
        2,
    )
    f = framework._decision_finding(d, "average it")
    assert "ModelCheckpoint did not save a checkpoint after step 19" in f.message
    assert "because of rank 1's own val_loss" in f.message and "1 more such" in f.message


def test_decisions_the_ranks_took_alike_are_quiet() -> None:
    rows = []
    for step, stop in ((9, 0), (19, 1)):
        rows += _decision(0, step, ES, stop, stop, 2.3) + _decision(1, step, ES, stop, stop, 2.4)
    assert framework.summarize(_rows(rows))["decisions"] == []


def test_different_best_checkpoints_are_named_with_each_ranks_file() -> None:
    def best(rank: int, step: int, file: str, score: float) -> tuple:
        return (rank, step, f"{BEST_CKPT_PREFIX}val_loss|{file}", score, step + 1)

    rows = [
        best(0, 9, "epoch=0-step=10.ckpt", 2.3),
        best(1, 9, "epoch=0-step=10.ckpt", 2.4),
        best(0, 19, "epoch=0-step=20.ckpt", 2.2),
    ]
    (d,) = framework.summarize(_rows(rows))["best_checkpoints"]
    assert d["files"] == {"0": "epoch=0-step=20.ckpt", "1": "epoch=0-step=10.ckpt"}
    assert (d["step"], d["global_step"], d["scores"]) == (19, 20, {"0": 2.2, "1": 2.4})
    f = framework._best_finding(d, "average it")
    assert f.kind == "best_checkpoint" and "rank 0 epoch=0-step=20.ckpt (val_loss 2.2)" in (
        f.message
    )
    same = [best(r, 9, "epoch=0-step=10.ckpt", 2.3 + r) for r in (0, 1)]
    assert framework.summarize(_rows(same))["best_checkpoints"] == []


def test_a_span_frame_with_lightning_rows_is_analyzed_with_them() -> None:
    """:func:`analyze_spans` reads the rows from the frame (as the run's files are read)."""
    spans = []
    for r in (0, 1):
        for s in range(6):
            t = s * 10_000_000
            spans.append((r, s, "step", "", t, t + 9_000_000, float("nan")))
            spans.append((r, s, "update", "", t + 8_000_000, t + 9_000_000, float("nan")))
        spans += [
            (r, 0, "scalar", LIGHTNING_STEP, 1, 1, 0.0),
            (r, 3, "scalar", DECISION_PREFIX + ES, 3, 3, float(r + 2)),
            (r, 3, "scalar", DECIDED_ON_PREFIX + ES, 3, 3, 2.3 + r),
        ]
    df = pd.DataFrame(
        spans, columns=["rank", "step", "kind", "name", "start_ns", "end_ns", "value"]
    )
    a = analyze_spans(df)
    assert [(d["callback"], d["ranks"]) for d in a.trainer["decisions"]] == [("EarlyStopping", [1])]
    assert any(f.kind == "callback_decision" for f in a.findings)
