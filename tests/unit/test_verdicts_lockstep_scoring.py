"""bench/verdicts.py's scoring of ranks out of lockstep (issue 44), on analyses shaped as
``hvtrace analyze --json`` writes them: the injected rank at the injected step is right, another
rank or step is wrong, nothing is missed, and a lockstep warning on a clean job is a false alarm
(offline and live)."""

from __future__ import annotations

import pytest
from helpers import bench_module


@pytest.fixture(scope="module")
def vb():
    return bench_module("verdicts")


def _rep(*breaks: dict, live: tuple = ()) -> dict:
    return {
        "findings": [
            {
                "kind": "lockstep",
                "severity": "warning",
                "message": "ranks out of lockstep",
                "data": b,
            }
            for b in breaks
        ],
        "live": list(live),
    }


SKIPPED_PLAIN = {"kind": "stopped", "step": 198, "ranks": [1], "skipped_steps": [80]}
SKIPPED_LIGHTNING = {"kind": "sequence", "step": 80, "ranks": [1], "skipped": True}
STOPPED = {"kind": "stopped", "step": 79, "ranks": [0], "others": [1]}


def test_offline_lockstep_scores(vb) -> None:
    skip = vb.Case("s", "train", expect=vb._lockstep(1, 80, "skipped"))
    stop = vb.Case("e", "train", expect=vb._lockstep(0, 79, "stopped"))
    late = vb.Case("l", "train", expect=vb._lockstep(1, 81, "sequence"))
    score = lambda c, rep: vb.score_offline(c, rep, False, 200)["score"]  # noqa: E731
    assert score(skip, _rep(SKIPPED_PLAIN)) == "right"
    assert score(skip, _rep(SKIPPED_LIGHTNING)) == "right"
    assert score(skip, _rep(dict(SKIPPED_PLAIN, ranks=[0]))) == "wrong"
    assert score(skip, _rep(dict(SKIPPED_PLAIN, skipped_steps=[120]))) == "wrong"
    assert score(skip, _rep()) == "missed"
    assert score(stop, _rep(STOPPED)) == "right"
    assert score(stop, _rep(dict(STOPPED, kind="sequence"))) == "wrong"
    assert score(late, _rep({"kind": "sequence", "step": 81, "ranks": [1]})) == "right"
    assert score(late, _rep({"kind": "sequence", "step": 90, "ranks": [1]})) == "wrong"
    assert score(late, _rep({"kind": "sequence", "step": 81, "ranks": [0, 1]})) == "wrong"
    clean = vb.Case("c", "train")
    assert score(clean, _rep(STOPPED)) == "false_alarm"
    assert score(clean, _rep()) == "clean"


def test_live_lockstep_scores(vb) -> None:
    late = vb.Case("l", "train", expect=vb._lockstep(1, 81, "sequence"))
    ev = {"event": "lockstep", "kind": "sequence", "step": 81, "rank": 1, "ranks": [1]}
    score = lambda c, rep: vb.score_live(c, rep, False, 200)["score"]  # noqa: E731
    assert score(late, _rep(live=(ev,))) == "right"
    assert score(late, _rep(live=(dict(ev, rank=0, ranks=[0]),))) == "wrong"
    assert score(late, _rep()) == "missed"
    assert score(vb.Case("c", "train"), _rep(live=(ev,))) == "false_alarm"
