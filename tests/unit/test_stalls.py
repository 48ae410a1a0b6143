"""The stall watchdog (hvtrace.record.stall) and who a hung job waits for
(hvtrace.analysis.hangs), on made-up tracers and files."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvtrace.analysis.hangs import find_hangs
from hvtrace.format.status import merge_stalls
from hvtrace.record import stall


def tracer(in_sync: bool = True) -> SimpleNamespace:
    meta: dict = {
        1: (["net.0.weight"], [4], ["float32"]),
        (2, 3): (["net.2.weight", "net.2.bias"], [], []),
    }
    return SimpleNamespace(
        in_sync=in_sync,
        meta=meta,
        enqueued=[(0, 1, (11, None)), (0, (2, 3), 12), (0, 9, 13)],
        done=[(12, 5)],
    )


def test_the_watch_notes_a_wait_once_it_lasts_and_again_each_period(monkeypatch) -> None:
    now = [0]
    monkeypatch.setattr(stall, "monotonic_ns", lambda: now[0])
    w = stall.StallWatch(stall_s=2.0)
    t = tracer()
    assert w(t, 7, 0) is None  # first seen
    now[0] = int(1.9e9)
    assert w(t, 7, 0) is None
    now[0] = int(2.0e9)
    rec = w(t, 7, 0)
    assert rec["step"] == 7 and rec["waited_s"] == 2.0 and rec["since_ns"] == 0
    assert rec["pending"] == ["net.0.weight", "?"]  # 12 is done; 9 has no names
    now[0] = int(3.0e9)
    assert w(t, 7, 0) is None
    now[0] = int(4.0e9)
    assert w(t, 7, 0)["waited_s"] == 4.0
    now[0] = int(5.0e9)
    assert w(t, 8, 0) is None  # a new wait starts over
    t.in_sync = False
    now[0] = int(9.0e9)
    assert w(t, 8, 0) is None
    assert w(None, 8, 0) is None


def test_stall_records_merge_per_step() -> None:
    a = {"step": 3, "micro": 0, "waited_s": 2.0}
    b = {"step": 3, "micro": 0, "waited_s": 4.0}
    c = {"step": 9, "micro": 0, "waited_s": 2.0}
    out = merge_stalls([a, "junk"], b)
    out = merge_stalls(out, [c, None, {"no": "step"}])
    assert sorted((r["step"], r["waited_s"]) for r in out) == [(3, 4.0), (9, 2.0)]


def rf(last_step: int, *stalls: dict) -> SimpleNamespace:
    return SimpleNamespace(last_step=last_step, stalls=list(stalls))


def rec(step: int, waited: float, *pending: str) -> dict:
    return {"step": step, "micro": 0, "since_ns": 1, "waited_s": waited, "pending": list(pending)}


def test_the_rank_that_did_not_arrive_is_named() -> None:
    files = {
        0: rf(12, rec(12, 2.0, "net.4.weight"), rec(12, 30.0, "net.4.weight", "net.0.weight")),
        1: rf(12),  # stopped in step 12 before its allreduces
        2: rf(12, rec(12, 28.5, "net.4.weight")),
    }
    (h,) = find_hangs(files, [0, 1, 2, 3])
    assert h["hung"] and h["step"] == 12
    assert h["ranks"] == [1, 3]  # rank 3 left no file at all
    assert h["waiting_ranks"] == [0, 2] and h["waited_s"] == 30.0
    assert h["tensor"] == "net.4.weight" and h["tensors"] == ["net.4.weight", "net.0.weight"]


def test_a_wait_the_job_got_past_is_a_stall_not_a_hang() -> None:
    files = {0: rf(40, rec(12, 75.0, "net.4.weight")), 1: rf(40)}
    (h,) = find_hangs(files, [0, 1])
    assert not h["hung"] and h["ranks"] == [] and h["waited_s"] == 75.0


def test_no_stall_records_no_hang() -> None:
    assert find_hangs({0: rf(5), 1: rf(5)}, [0, 1]) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"step": "12", "waited_s": 3.0},
        {"step": -1, "waited_s": 3.0},
        {"step": 12, "waited_s": float("nan")},
        {"step": 12, "waited_s": -4},
        {"step": True, "waited_s": 3.0},
        "not a record",
    ],
)
def test_malformed_stall_records_are_ignored(bad) -> None:
    assert find_hangs({0: rf(5, bad), 1: rf(5)}, [0, 1]) == []


def test_hostile_names_are_kept_as_bounded_text() -> None:
    files = {0: rf(3, rec(3, 9.0, "\x1b[2J" + "x" * 500, 7)), 1: rf(3)}  # type: ignore[arg-type]
    (h,) = find_hangs(files, [0, 1])
    assert h["tensor"].startswith("\x1b[2J") and len(h["tensor"]) == 200  # the report escapes it
    assert h["tensors"] == [h["tensor"]]


def test_a_wait_in_a_collective_outside_the_optimizer_is_noted_with_it(monkeypatch) -> None:
    now = [0]
    monkeypatch.setattr(stall, "monotonic_ns", lambda: now[0])
    w = stall.StallWatch(stall_s=1.0)
    t = tracer(in_sync=False)
    t.in_collective = "allreduce.average|input|metric.loss"
    assert w(t, 13, 0) is None
    now[0] = int(1.5e9)
    r = w(t, 13, 0)
    assert r["collective"] == "allreduce.average|input|metric.loss"
    assert r["pending"] == ["metric.loss"] and r["waited_s"] == 1.5
    t.in_collective = "broadcast_object|input|cfg"  # another wait starts over
    assert w(t, 13, 0) is None
    # the same step's wait in synchronize and in a collective are kept apart when merged
    merged = merge_stalls([r], {"step": 13, "micro": 0, "waited_s": 3.0})
    assert len(merged) == 2


def test_a_rank_waiting_in_a_collective_only_it_issued_did_not_arrive() -> None:
    lone = dict(rec(13, 40.0, "metric.loss"), collective="allreduce.average|input|metric.loss")
    files = {
        0: rf(13, rec(13, 41.0, "net.4.weight")),
        1: rf(13, rec(13, 41.0, "net.4.weight")),
        2: rf(13, lone),
    }
    (h,) = find_hangs(files, [0, 1, 2])
    assert h["hung"] and h["ranks"] == [2] and h["waiting_ranks"] == [0, 1]
    assert h["in_collective"] == {"2": "allreduce.average|input|metric.loss"}
    assert h["tensor"] == "net.4.weight"
    # without the optimizer waits (every rank in mismatched collectives), those make the hang
    (h2,) = find_hangs({2: rf(13, lone), 0: rf(13)}, [0, 2])
    assert h2["waiting_ranks"] == [2] and h2["ranks"] == [0]


def test_ranks_that_went_past_a_collective_the_others_wait_in_are_named() -> None:
    """Rank 1 skipped the metric allreduce ranks 0 and 2 issued: they wait in it, rank 1 waits
    in the next step's synchronize for their gradients. Rank 1 is the one named, and the
    finding says which collective it never issued."""
    from hvtrace.analysis.findings import _hangs

    coll = "allreduce.average|input|metric.loss"
    files = {
        0: rf(13, dict(rec(13, 40.0, "metric.loss"), collective=coll)),
        1: rf(13, rec(13, 39.0, "net.4.weight", "net.0.weight")),
        2: rf(13, dict(rec(13, 41.0, "metric.loss"), collective=coll)),
    }
    (h,) = find_hangs(files, [0, 1, 2])
    assert h["hung"] and h["skipped"] and h["step"] == 13
    assert h["ranks"] == [1] and h["waiting_ranks"] == [0, 2]
    assert h["tensor"] == coll and h["waited_s"] == 41.0
    assert h["skippers_wait_for"] == ["net.4.weight", "net.0.weight"]
    (f,) = _hangs(SimpleNamespace(hangs=[h]))
    assert "rank 1 skipped hvd.allreduce (average) 'metric.loss'" in f.message, f.message
    assert "ranks 0, 2 issued it and waited in it 41 s or more; it went on" in f.message
    # two ranks in different collectives: not one skipped collective, named as before
    files[2] = rf(13, dict(rec(13, 41.0, "other"), collective="allgather|input|other"))
    (h,) = find_hangs(files, [0, 1, 2])
    assert not h["skipped"] and h["ranks"] == [0, 2]
