"""bench/verdicts.py's scoring of the seed article's anti-patterns (issue 40), on analyses shaped
as ``hvtrace analyze --json`` writes them: the finding naming the job's ranks at the first checked
step is right whatever its severity, other ranks or another step is wrong, none is missed, a rank
named slow beside it is wrong, and the same finding on a clean job is a false alarm."""

from __future__ import annotations

import pytest
from helpers import bench_module


@pytest.fixture(scope="module")
def vb():
    return bench_module("verdicts")


def _f(kind: str, data: dict, severity: str = "warning") -> dict:
    return {"kind": kind, "severity": severity, "message": f"{kind} message", "data": data}


def _rep(*findings: dict, size: int = 4) -> dict:
    return {"size": size, "findings": list(findings), "live": []}


UNSHARDED = _f("unsharded_data", {"groups": [{"ranks": [0, 1, 2, 3], "first_step": 0}], "step": 0})
MANUAL = _f("manual_averaging", {"ranks": [0, 1, 2, 3], "step": 0}, "info")
SLOW = _f("straggler", {"rank": 1, "phase": "forward", "cause": "blocked"})


def test_an_antipattern_named_for_every_rank_at_its_step_is_right(vb) -> None:
    score = lambda c, rep: vb.score_offline(c, rep, False, 200)["score"]  # noqa: E731
    un = vb.Case("u", "train", expect=vb._antipattern("unsharded_data", None, 0))
    man = vb.Case("m", "train", expect=vb._antipattern("manual_averaging", None, 0))
    over = vb.Case("o", "train", expect=vb._antipattern("oversubscribed", (0, 1), None))
    assert score(un, _rep(UNSHARDED)) == "right"
    assert score(un, _rep(UNSHARDED, size=8)) == "wrong"  # ranks 4-7 not named
    assert score(un, _rep(dict(UNSHARDED, data=dict(UNSHARDED["data"], step=10)))) == "wrong"
    assert score(un, _rep(UNSHARDED, SLOW)) == "wrong"  # a rank accused beside it
    assert score(un, _rep(MANUAL)) == "missed"
    assert score(man, _rep(MANUAL)) == "right"  # a note is a finding too
    assert score(over, _rep(_f("oversubscribed", {"ranks": [0, 1]}), size=2)) == "right"
    assert score(over, _rep(_f("oversubscribed", {"ranks": [0]}), size=2)) == "wrong"
    # a rank named late for its starved threads on that host is the same verdict; for I/O, not
    over_f = _f("oversubscribed", {"ranks": [0, 1]})
    threads = dict(SLOW, data=dict(SLOW["data"], cause="blocked", oversubscribed_host="vm"))
    assert score(over, _rep(over_f, threads, size=2)) == "right"
    assert score(over, _rep(over_f, SLOW, size=2)) == "wrong"
    assert score(un, _rep(UNSHARDED, threads)) == "wrong"
    # four 1-thread ranks on 2 cores are oversubscribed: a fact of the host, not an accusation
    assert score(un, _rep(UNSHARDED, over_f)) == "right"
    assert vb.score_offline(vb.Case("c", "train"), _rep(over_f), False, 200)["score"] == "clean"


def test_an_antipattern_warning_on_a_clean_job_is_a_false_alarm(vb) -> None:
    clean = vb.Case("c", "train")
    assert vb.score_offline(clean, _rep(UNSHARDED), False, 200)["score"] == "false_alarm"
    # a cheap one, reported as a note, is not an alarm
    assert vb.score_offline(clean, _rep(MANUAL), False, 200)["score"] == "clean"
    # live verdicts have nothing to say about an anti-pattern: n/a, unless a rank is named late
    un = vb.Case("u", "train", expect=vb._antipattern("unsharded_data", None, 0))
    assert vb.score_live(un, _rep(UNSHARDED), False, 200)["score"] == "n/a"
    late = {"event": "late", "rank": 1, "phase": "forward", "cause": "blocked", "last_step": 40}
    got = vb.score_live(un, dict(_rep(UNSHARDED), live=[late]), False, 200)
    assert got["score"] == "false_alarm"
