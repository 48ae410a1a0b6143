"""Horovod's own timeline, started by hvtrace and merged (real ``horovodrun``, 2 ranks, Gloo).

Rank 1 sleeps 20 ms in its forward, so rank 0 waits for it in every negotiation. With
``HOROVOD_CACHE_CAPACITY=0`` Horovod notes every rank's readiness in every negotiation (not only
the first of each tensor), which the test compares with hvtrace's own arrival.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from helpers import analyze_cli, run_train, tail

from hvtrace.analysis.summary import analyze
from hvtrace.load import open_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(900)]


def test_horovod_timeline_is_merged_with_negotiation_transfer_and_arrival(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    proc = run_train(
        "--steps", "30", "--width", "256", "--layers", "4", "--batch-size", "64",
        "--trace-dir", str(trace), "--slow-rank", "1", "--slow-ms", "20",
        env={"HVTRACE_HOROVOD_TIMELINE": "1", "HOROVOD_CACHE_CAPACITY": "0"},
        cwd=tmp_path,
    )  # fmt: skip
    assert "rank 0: 30 steps" in proc.stdout, tail(proc.stderr)
    run = open_run(trace)
    (tl_file,) = trace.glob("horovod-timeline-*.json")
    assert tl_file.name == f"horovod-timeline-{run.run_id}.json"
    assert tl_file.read_text().rstrip().endswith("]")  # stopped cleanly at hvtrace.finish()

    a = analyze(run)
    h = a.horovod_timeline
    assert h["merged"] and not h["partial"] and h["offset_ns"] is not None, h
    grads = {r["name"]: r for r in h["tensors"] if r["name"] in set(a.tensors["name"])}
    assert set(grads) == set(a.tensors["name"]), (sorted(grads), list(a.tensors["name"]))
    for r in grads.values():
        assert r["count"] >= 30, r  # every step's allreduce
        assert r["negotiate_ms"] >= 10.0, r  # waiting for rank 1, ~20 ms late
        assert 0 < r["transfer_ms"] < r["negotiate_ms"], r
        assert r["last_rank"] == 1 and r["last_share"] >= 0.9, r
    arr = h["arrival"]
    assert arr["clear_compared"] >= 0.8 * arr["compared"] > 0, arr
    assert arr["clear_agree_share"] >= 0.9, arr
    assert 0 <= h["queue_ms"] < 20, h

    # the merged Perfetto timeline: a track per tensor under rank 0, with the transfer's parts
    from hvtrace.export.timeline import write_timeline

    pf = tmp_path / "t.pftrace"
    write_timeline(run, a, str(pf), None)
    tracks = _track_names(pf)
    assert "horovod allreduce.net.0.weight" in tracks and "parts" in tracks, tracks
    # ... and the Chrome JSON one: the same tracks as threads of rank 0, every transfer drawn
    cj = tmp_path / "t.json.gz"
    write_timeline(run, a, str(cj), None)
    ev = json.loads(gzip.decompress(cj.read_bytes()))["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    w = "horovod allreduce.net.0.weight"
    assert {w, f"{w} parts"} <= set(threads.values()), threads
    transfers = [e for e in ev if e.get("cat") == "horovod" and e["name"] == "GLOO_ALLREDUCE"]
    assert len([e for e in transfers if threads[e["tid"]] == f"{w} parts"]) >= 30
    assert all(e["pid"] == 0 for e in transfers)

    # a killed job's timeline has no closing bracket: what was written is still merged
    cut = tmp_path / "cut.json"
    data = tl_file.read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    a2 = analyze(run, horovod_timeline=cut)
    h2 = a2.horovod_timeline
    assert h2["merged"] and h2["partial"].startswith("cut off"), h2
    assert h2["file"] == "cut.json" and h2["tensors"]

    # the JSON and the report a user reads; a file that is not a timeline: one line, no merge
    shutil.copy(tl_file, tmp_path / "copy.json")
    js = tmp_path / "a.json"
    p = analyze_cli(trace, "--json", js)
    assert p.returncode == 0, p.stderr
    assert "Horovod's timeline" in p.stdout and "negotiate" in p.stdout
    d = json.loads(js.read_text())["horovod_timeline"]
    assert d["merged"] and {"negotiate_ms", "transfer_ms"} <= set(d["tensors"][0])
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    p = analyze_cli(trace, "--horovod-timeline", junk)
    assert p.returncode == 0, p.stderr
    flat = " ".join(p.stdout.split())  # the report wraps at 80 columns
    assert "not merged: " in flat and "junk.json: not a Horovod timeline" in flat, p.stdout


def _track_names(path: Path) -> list[str]:
    """Names of the track descriptors in a .pftrace (its packets deflated in blocks)."""
    import zlib

    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    outer = pb.Trace()
    outer.ParseFromString(path.read_bytes())
    names = []
    for p in outer.packet:
        packets = [p]
        if p.HasField("compressed_packets"):
            inner = pb.Trace()
            inner.ParseFromString(zlib.decompress(p.compressed_packets))
            packets = list(inner.packet)
        names += [q.track_descriptor.name for q in packets if q.HasField("track_descriptor")]
    return names
