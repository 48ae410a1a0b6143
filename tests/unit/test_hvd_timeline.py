"""Horovod's own timeline: read whole or cut off, summed per tensor, compared with hvtrace."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pandas as pd
import pytest

from hvtrace.analysis.hvd_timeline import (
    TimelineError,
    aligned_activities,
    find_timeline,
    horovod_tracks,
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


@pytest.mark.parametrize(
    "hostile",
    ['{"a": ' * 50_000 + "1" + "}" * 50_000, '{"ph": "X", "ts": ' + "9" * 5000 + "}"],
    ids=["nested-too-deep", "integer-too-long"],
)
def test_an_event_that_cannot_be_decoded_keeps_the_events_before_it(
    tmp_path: Path, hostile: str
) -> None:
    """A hostile event (JSON nested 50,000 deep, an integer of 5,000 digits) ends the read
    there, with the reason; the events before it are kept, never a traceback."""
    whole = _write(tmp_path / "t.json", _events(n_occ=4)).read_text()
    cut = whole.rindex(',\n{"ph": "B", "name": "NEGOTIATE_ALLREDUCE"')
    p = tmp_path / "hostile.json"
    p.write_text(whole[:cut] + ",\n" + hostile + whole[cut:])
    tl = read_timeline(p)
    assert tl.partial.startswith("cut off") and "cannot be decoded" in tl.partial
    assert 0 < tl.events < len(_events(n_occ=4))
    assert merge(tl, None, None)["tensors"]


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


def _rank0_steps(n: int, step_ns: int = 100_000_000, t0: int = 5_000_000_000) -> pd.DataFrame:
    """Rank 0's and rank 1's step spans: step k runs from ``t0 + k * step_ns``."""
    rows = [
        (r, k, "step", t0 + k * step_ns, t0 + (k + 1) * step_ns - 1)
        for r in (0, 1)
        for k in range(n)
    ]
    return pd.DataFrame(rows, columns=["rank", "step", "kind", "start_ns", "end_ns"])


def test_the_tracks_of_a_tensor_never_overlap_and_keep_their_order() -> None:
    acts = pd.DataFrame(
        {
            "tensor": ["b", "a", "a", "a", "b"],
            "depth": [0, 0, 0, 1, 0],
            "activity": ["X", "NEGOTIATE", "ALLREDUCE", "GLOO", "Y"],
            "start_ns": [50, 10, 30, 35, 40],
            "end_ns": [60, 32, 45, 38, 70],  # a's negotiation ends after its allreduce starts
        }
    )
    t = horovod_tracks(acts, origin_ns=20)
    assert t.tensors == ["a", "b"]  # by first activity
    assert t.tensor_idx.tolist() == [0, 0, 0, 1, 1] and t.depth.tolist() == [0, 0, 1, 0, 0]
    assert t.activity == ["NEGOTIATE", "ALLREDUCE", "GLOO", "Y", "X"]
    # before the origin: drawn at 0; the allreduce starts where the negotiation ended; X lies
    # inside Y: drawn at Y's end, empty
    assert t.start_ns.tolist() == [0, 12, 15, 20, 50]
    assert t.end_ns.tolist() == [12, 25, 18, 50, 50]


def test_the_chrome_timeline_draws_horovod_tracks_under_rank_0(tmp_path: Path) -> None:
    from hvtrace.export.chrome import chrome_events, write_chrome_trace

    evil = 'w"</script>\x1b[31m'
    ev = _events(n_occ=3)
    ev[1]["args"]["name"] = evil  # a hostile tensor name stays a string, escaped
    tl = _write(tmp_path / "t.json", ev)
    t0 = 5_000_000_000
    acts = aligned_activities(tl, t0)  # occurrence k at k * 100 ms: inside step k
    spans = _rank0_steps(3, t0=t0)
    events = list(chrome_events(spans, hosts={0: "h", 1: "h"}, horovod=acts))
    threads = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 0
    }
    names = set(threads.values())
    assert {f"horovod {evil}", f"horovod {evil} parts"} <= names, names
    assert {"horovod allreduce.net.0.bias", "horovod allreduce.net.0.bias parts"} <= names
    hv = [e for e in events if e.get("cat") == "horovod"]
    assert len(hv) == len(acts) == 3 * 2 * 4
    assert all(e["pid"] == 0 and e["tid"] in threads for e in hv)
    gloo = sorted(
        (e for e in hv if e["name"] == "GLOO_ALLREDUCE" and e["args"]["tensor"] == evil),
        key=lambda e: e["ts"],
    )
    # occurrence k's transfer: 20.2 ms .. 22.2 ms after step k's start, 2 ms long
    assert [round(e["ts"] - 100_000 * k) for k, e in enumerate(gloo)] == [20_210] * 3
    assert all(e["dur"] == pytest.approx(2000.0) for e in gloo)
    part = {e["tid"]: threads[e["tid"]] for e in gloo}
    assert set(part.values()) == {f"horovod {evil} parts"}
    for tid in threads:  # one track's slices never overlap (Chrome nests slices on a thread)
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in hv if e["tid"] == tid)
        assert all(b[0] >= a[1] - 1e-3 for a, b in itertools.pairwise(mine)), mine

    # split by steps: each part holds its steps' Horovod slices, with every track named
    out = tmp_path / "tl.json"
    n_meta = sum(e["ph"] == "M" for e in events)
    files = write_chrome_trace(
        spans, out, max_events=n_meta + 12, hosts={0: "h", 1: "h"}, horovod=acts
    )
    assert len(files) == 3  # a step and its 8 Horovod slices per part
    seen = 0
    for f in files:
        d = json.loads(f.read_text())
        lo, hi = d["otherData"]["steps"]
        got = [e for e in d["traceEvents"] if e.get("cat") == "horovod"]
        seen += len(got)
        for e in got:  # occurrence k lies in step k
            assert lo <= int(e["ts"] // 100_000) <= hi, (e, lo, hi)
    assert seen == len(acts)
    # without rank 0 in the timeline there is nowhere to draw them
    only1 = spans[spans["rank"] == 1]
    assert not [e for e in chrome_events(only1, horovod=acts) if e.get("cat") == "horovod"]
