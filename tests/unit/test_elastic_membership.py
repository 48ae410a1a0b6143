"""Elastic Horovod's membership, without Horovod: what every rank derives from the set-up gather,
the records merged from a file's statuses, and the epochs and resets the analysis makes of them
(real trace files written by the real writer; nothing in them trusted)."""

from __future__ import annotations

from pathlib import Path

from helpers import make_header, row, status, write_rank_file

from hvtrace.analysis.membership import epochs, reset_findings
from hvtrace.analysis.summary import analyze
from hvtrace.format.read import read_rank_file
from hvtrace.format.status import merge_membership
from hvtrace.load import load_run, open_run
from hvtrace.record.elastic import agree

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def _prior(worker: int, step: int, gen: int = 0, nxt: int = 2, run_id: str = "run-a") -> dict:
    return {"run_id": run_id, "worker": worker, "step": step, "gen": gen, "next_worker": nxt}


def test_first_start_gives_each_rank_its_rank_as_worker() -> None:
    m = agree([(20, "a", None, "h0"), (50, "b", None, "h1")])
    assert (m.gen, m.start_step, m.after_reset, m.run_id) == (0, 0, False, None)
    assert m.workers == {0: 0, 1: 1} and m.live_every == 20  # rank 0's window for all
    assert m.record(1, 5)["members"] == [[0, 0, "a", "h0"], [1, 1, "b", "h1"]]


def test_rank_0s_live_window_in_steps_and_seconds_is_everyone_s() -> None:
    m = agree([((20, 5.0), "a", None, None), ((50, 1.0), "b", None, None)])
    assert (m.live_every, m.live_s) == (20, 5.0)
    old = agree([(20, "a", None, None)])  # an older rank 0's: steps alone
    assert (old.live_every, old.live_s) == (20, 0.0)
    for bad in [("x", 5.0), (20, float("nan")), (20, -1.0), (-5, 1.0), (20,), None]:
        m = agree([(bad, "a", None, None)])
        assert (m.live_every, m.live_s) == (0, 0.0), bad  # malformed: live detection off


def test_after_a_reset_survivors_keep_their_ids_and_joiners_get_new_ones() -> None:
    # the worker that was 1 survives as rank 0; a new worker is rank 1; a garbled entry is new
    m = agree(
        [
            (0, "b", _prior(1, 25, gen=0, nxt=2, run_id="run-a"), None),
            (0, "c", None, None),
            (0, "d", {"worker": "x"}, None),
        ]
    )
    assert m.after_reset and m.gen == 1 and m.start_step == 25 and m.run_id == "run-a"
    assert m.workers == {0: 1, 1: 2, 2: 3} and m.next_worker == 4
    # the step goes on from the survivors' largest count; generations from the largest
    m2 = agree([(0, "a", _prior(0, 40, gen=3, nxt=5), None), (0, "b", _prior(4, 38, 3, 5), None)])
    assert (m2.gen, m2.start_step, m2.workers, m2.next_worker) == (4, 40, {0: 0, 1: 4}, 5)


def test_membership_records_merge_once_each_and_garbage_is_dropped() -> None:
    a = [{"gen": 1, "x": 1}, "junk", {"gen": "nope"}]
    b = [{"gen": 1, "x": 2}, {"gen": 2}]
    assert merge_membership(a, b) == [{"gen": 1, "x": 1}, {"gen": 2}]
    assert merge_membership(None, {"gen": 1}) == []


def _members(*spec: tuple[int, int, str]) -> list:
    return [[w, r, "vm", h] for w, r, h in spec]


def _write(tmp: Path, worker: int, size: int, first: dict, later: list, steps: range) -> Path:
    """A worker's file: a step span per step, its first membership in the header, the later
    ones in a batch status."""
    header = make_header(rank=worker, size=size, membership=first, worker=worker)
    rows = [
        row("step", "step", 10**12 + s * 10**7, 10**12 + s * 10**7 + 9 * 10**6, s) for s in steps
    ]
    st = status(final=True, last_step=steps.stop)
    if later:
        st["membership"] = later
    path = tmp / f"rank{worker:05d}-20240101-000000-abcdef.arrows"
    write_rank_file(path, header, [rows], [st])
    return path


def _lost_worker_run(tmp: Path) -> None:
    gen0 = {
        "gen": 0, "start_step": 0, "size": 2, "rank": 0, "worker": 0, "at_ns": 1,
        "members": _members((0, 0, "localhost"), (1, 1, "127.0.0.1")), "reset": None,
    }  # fmt: skip
    gen1 = {
        "gen": 1, "start_step": 25, "size": 1, "rank": 0, "worker": 0,
        "members": _members((0, 0, "localhost")), "at_ns": 10**12 + 3 * 10**9,
        "reset": {
            "prev_rank": 0, "prev_size": 2, "step": 25, "commit_step": 20, "restored": True,
            "replayed_steps": 5, "last_step_end_ns": 10**12 + 10**9,
        },
    }  # fmt: skip
    _write(tmp, 0, 2, gen0, [gen1, {"gen": 2, "members": "\x1b[2J"}], range(0, 60))
    _write(tmp, 1, 2, dict(gen0, rank=1, worker=1), [], range(0, 25))


def test_epochs_and_the_reset_of_a_lost_worker(tmp_path: Path) -> None:
    _lost_worker_run(tmp_path)
    run = open_run(tmp_path)
    assert read_rank_file(run.files[0].path).membership[0]["gen"] == 1
    eps, resets, problems = epochs(run)
    assert [(e["gen"], e["start_step"], e["stop_step"], e["size"]) for e in eps] == [
        (0, 0, 25, 2),
        (1, 25, 60, 1),
    ]
    assert eps[0]["hosts"] == ["127.0.0.1", "localhost"]
    assert len(problems) == 1 and "does not check" in problems[0]  # the garbled record
    (f,) = reset_findings(eps, resets, {0: 100.0})
    d = f.data
    assert f.kind == "reset" and f.severity == "warning"
    assert (d["step"], d["size_before"], d["size_after"]) == (25, 2, 1)
    assert (d["workers_left"], d["ranks_left"], d["hosts_left"]) == ([1], [1], ["127.0.0.1"])
    assert d["workers_joined"] == [] and d["replayed_steps"] == 5 and d["restored"]
    assert d["stall_s"] == 2.0 and d["lost_s"] == 2.5  # + 5 replayed steps of 100 ms
    assert "lost worker 1 (rank 1, host 127.0.0.1)" in f.message


def test_analysis_reports_each_epoch_and_the_reset(tmp_path: Path) -> None:
    _lost_worker_run(tmp_path)
    a = analyze(open_run(tmp_path))
    assert [e["size"] for e in a.membership] == [2, 1]
    assert all("analysis" in e for e in a.membership)
    (reset,) = [f for f in a.findings if f.kind == "reset"]
    # when: the end of the survivor's last step, 1 s after its anchors (the run's start)
    assert reset.data["at_s"] == 1.0 and "1.0 s into the run" in reset.message
    # the worker that left at the reset is not also reported as an incomplete run
    assert not any(f.kind == "incomplete" and "stopped" in (f.data or {}) for f in a.findings)


def test_a_run_without_resets_has_no_membership_section() -> None:
    a = analyze(load_run(SAMPLES / "balanced_2rank"))
    assert a.membership == [] and not any(f.kind == "reset" for f in a.findings)
