"""Horovod's own timeline: read whole or cut off, summed per tensor, compared with hvtrace."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from hvtrace.analysis.hvd_timeline import (
    TimelineError,
    find_timeline,
    merge,
    read_timeline,
)

START_US = 1_795_000_000_000_000


def _events(n_occ: int = 3, late_rank: int = 1, late_us: int = 20_000) -> list[dict]:
    """Two tensors, each reduced ``n_occ`` times: negotiation (rank 0 ready at once, the late
    rank ``late_us`` later), then the allreduce with a fusion copy and the Gloo transfer."""
    ev: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0,
         "args": {"start_time_since_epoch_in_micros": START_US}},
    ]  # fmt: skip
    for pid, name in ((1, "allreduce.net.0.weight"), (2, "allreduce.net.0.bias")):
        ev.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
    for k in range(n_occ):
        for pid in (1, 2):
            t = 100_000 * k + pid * 10
            ev += [
                {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t, "pid": pid},
                {"ph": "X", "name": str(1 - late_rank), "ts": t, "pid": pid, "dur": 0},
                {"ph": "X", "name": str(late_rank), "ts": t + late_us, "pid": pid, "dur": 0},
                {"ph": "E", "ts": t + late_us + 1, "pid": pid},
                {"ph": "B", "name": "ALLREDUCE", "ts": t + late_us + 100, "pid": pid},
                {"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": t + late_us + 110, "pid": pid},
                {"ph": "E", "ts": t + late_us + 150, "pid": pid},
                {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": t + late_us + 200, "pid": pid},
                {"ph": "E", "ts": t + late_us + 2200, "pid": pid},
                {"ph": "E", "ts": t + late_us + 2300, "pid": pid},
            ]
    return ev


def _write(path: Path, events: list[dict]) -> Path:
    # Horovod's layout: one event per line or several per line, comma separated
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "]")
    return path


def test_a_whole_timeline_is_summed_per_tensor(tmp_path: Path) -> None:
    tl = read_timeline(_write(tmp_path / "t.json", _events()))
    assert tl.partial == "" and tl.problems == [] and tl.start_epoch_us == START_US
    out = merge(tl, None, None)
    by = {r["name"]: r for r in out["tensors"]}
    assert set(by) == {"net.0.weight", "net.0.bias"}
    r = by["net.0.weight"]
    assert (r["op"], r["count"]) == ("allreduce", 3)
    assert r["negotiate_ms"] == pytest.approx(20.001)
    assert r["transfer_ms"] == pytest.approx(2.0) and r["memcpy_ms"] == pytest.approx(0.04)
    assert (r["last_rank"], r["last_share"]) == (1, 1.0)
    assert out["offset_ns"] is None and out["arrival"] == {"compared": 0}


def test_a_timeline_cut_off_by_a_killed_job_keeps_what_was_written(tmp_path: Path) -> None:
    whole = _write(tmp_path / "whole.json", _events(n_occ=4)).read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(whole[: int(len(whole) * 0.7)])  # no closing bracket, half an event
    tl = read_timeline(cut)
    assert tl.partial.startswith("cut off") and 0 < tl.events < len(_events(n_occ=4))
    out = merge(tl, None, None)
    assert out["partial"] and out["tensors"]
    assert all(r["count"] >= 2 for r in out["tensors"])


def test_not_a_timeline_is_a_one_line_error(tmp_path: Path) -> None:
    p = tmp_path / "junk.json"
    p.write_text('{"not": "an array"}')
    with pytest.raises(TimelineError, match=r"junk\.json: not a Horovod timeline"):
        read_timeline(p)
    with pytest.raises(TimelineError, match="cannot read"):
        read_timeline(tmp_path / "missing.json")


def test_the_clock_is_aligned_and_arrival_compared(tmp_path: Path) -> None:
    tl = read_timeline(_write(tmp_path / "t.json", _events(n_occ=2, late_us=20_000)))
    anchors = {"mono_anchor_ns": 5_000_000_000, "wall_anchor_ns": START_US * 1000}
    # hvtrace's enqueues on rank 0's clock: rank 1 enqueued 19 ms after rank 0, except the second
    # bias allreduce, where hvtrace saw rank 0 last
    rows = []
    for name, pid in (("net.0.weight", 1), ("net.0.bias", 2)):
        for occ in (1, 2):
            t0 = 5_000_000_000 + (100_000 * (occ - 1) + pid * 10) * 1000 - 500_000
            late = 19_000_000 if not (name == "net.0.bias" and occ == 2) else -19_000_000
            rows += [(0, name, occ, t0), (1, name, occ, t0 + late)]
    starts = pd.DataFrame(rows, columns=["rank", "name", "occ", "start_ns"])
    out = merge(tl, anchors, starts)
    assert out["offset_ns"] == 5_000_000_000
    arr = out["arrival"]
    assert arr["compared"] == 4 and arr["agree_share"] == pytest.approx(0.75)
    assert arr["clear_compared"] == 4 and arr["horovod_last"] == {"1": 4}
    # Horovod saw rank 0 ready 0.5 ms after hvtrace's enqueue
    assert out["queue_ms"] == pytest.approx(0.5)


def test_hostile_names_are_bounded_and_events_without_a_name_ignored(tmp_path: Path) -> None:
    ev = _events(n_occ=1)
    ev[1]["args"]["name"] = "allreduce.\x1b[2J" + "x" * 1000
    ev.append({"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": "soon", "pid": 1})
    ev.append({"ph": "E", "ts": 5, "pid": 99})  # a pid no metadata named
    ev.append(["not", "an", "event"])  # type: ignore[arg-type]
    tl = read_timeline(_write(tmp_path / "t.json", ev))
    names = {r["name"] for r in merge(tl, None, None)["tensors"]}
    long = next(n for n in names if n.startswith("\x1b"))
    assert len(long) <= 300  # the report escapes control characters when it prints them


def test_the_run_directory_timeline_is_found_without_following_links(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert find_timeline(run, "R1") is None
    (run / "notes.json").write_text('{"a": 1}')
    user = _write(run / "my-timeline.json", _events(n_occ=1))  # a user's HOROVOD_TIMELINE
    assert find_timeline(run, "R1") == user
    own = _write(run / "horovod-timeline-R1.json", _events(n_occ=1))
    assert find_timeline(run, "R1") == own
    own.unlink()
    user.unlink()
    (run / "link.json").symlink_to(tmp_path / "elsewhere.json")
    _write(tmp_path / "elsewhere.json", _events(n_occ=1))
    assert find_timeline(run, "R1") is None
