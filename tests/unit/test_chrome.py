"""Structural tests of the merged Chrome-trace export (hvtrace.export.chrome)."""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hvtrace.export.chrome import (
    RATIO_COUNTER,
    assign_lanes,
    chrome_events,
    write_chrome_trace,
)
from hvtrace.format.read import RankFile
from hvtrace.format.schema import (
    DTYPE_CODE,
    FILE_SCHEMA,
    FORMAT_NAME,
    FORMAT_VERSION,
    KIND_CODE,
    KINDS,
)
from hvtrace.load import Run, TraceError, load_run

T0 = 5_000_000_000  # absolute ns of the earliest span in the hand-made runs
HOSTS = {0: "node-a", 1: "node-a", 2: "node-b"}


# ---------------------------------------------------------------------------------------------
# Hand-made input


def make_spans(ranks: int = 3, steps: int = 4, tensors: int = 5) -> pd.DataFrame:
    """A small run: per rank and step, every kind, overlapping allreduces, a loss scalar.

    Rank r runs ``r * 700 ns`` late; allreduce k of a step starts during backward and ends near
    the synchronize, so the allreduces of a step overlap each other.
    """
    rows = []
    step_ns = 1_000_000
    for r in range(ranks):
        for s in range(steps):
            b = T0 + s * step_ns + r * 700
            rows += [
                (r, s, 0, "step", "step", b, b + step_ns, 0, "", np.nan),
                (r, s, 0, "input", "input", b, b + 100_000, 0, "", np.nan),
                (r, s, 0, "user", "data", b + 10_000, b + 90_000, 0, "", np.nan),
                (r, s, 0, "forward", "forward", b + 100_000, b + 300_000, 0, "", np.nan),
                (r, s, 0, "backward", "backward", b + 300_000, b + 700_000, 0, "", np.nan),
                (r, s, 0, "wait", "synchronize", b + 700_000, b + 850_000, 0, "", np.nan),
                (r, s, 0, "update", "update", b + 850_000, b + 990_000, 0, "", np.nan),
                (r, s, 0, "scalar", "loss", b + 995_000, b + 995_000, 0, "", 2.5 - 0.1 * s),
            ]
            for k in range(tensors):
                a = b + 320_000 + k * 70_000 + (r * 37 + k * 11) % 50
                e = b + 760_000 + k * 10_000
                rows.append(
                    (r, s, 0, "allreduce", f"layer{k}.w", a, e, 4096 * (k + 1), "float32", np.nan)
                )
    df = pd.DataFrame(
        rows,
        columns=[
            "rank",
            "step",
            "micro",
            "kind",
            "name",
            "start_ns",
            "end_ns",
            "bytes",
            "dtype",
            "value",
        ],
    )
    df["flags"] = np.uint8(0)
    df["kind"] = pd.Categorical(df["kind"], categories=KINDS)
    for c in ("name", "dtype"):
        df[c] = df[c].astype("category")
    return df


def make_run(spans: pd.DataFrame, tmp_path: Path, hosts: dict[int, str] = HOSTS) -> Run:
    ranks = sorted(int(r) for r in spans["rank"].unique())
    files = {}
    for r in ranks:
        header = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "run_id": "test-run",
            "rank": r,
            "size": len(ranks),
            "host": hosts[r],
            "pid": 1000 + r,
            "device": "cpu",
            "mono_anchor_ns": T0,
            "wall_anchor_ns": 10**18,
            "clock": {},
        }
        files[r] = RankFile(tmp_path / f"rank{r:05d}.arrows", header, FILE_SCHEMA.empty_table())
    return Run(tmp_path, "test-run", len(ranks), files, spans)


# ---------------------------------------------------------------------------------------------
# Checks


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def ns(x: float) -> int:
    """µs value as written (exact decimal of ns) back to integer ns."""
    return round(x * 1000)


def check_trace(events: list[dict], ranks: dict[int, str]) -> None:
    """Assert the structural rules every exported trace must satisfy."""
    assert events, "no events"
    for e in events:
        assert {"ph", "ts", "pid"} <= e.keys(), e
        assert e["ph"] in {"M", "X", "C", "s", "f"}, e
        # Perfetto's tokenizer rejects a whole file whose events hold a top-level array
        assert not any(isinstance(v, list) for v in e.values()), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
    meta = [e for e in events if e["ph"] == "M"]
    assert all(
        e["name"]
        in {
            "process_name",
            "process_sort_index",
            "process_labels",
            "thread_name",
            "thread_sort_index",
        }
        for e in meta
    )
    # every rank is a named, sorted process
    pname = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    psort = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    for r, host in ranks.items():
        assert pname.get(r) == f"rank {r} ({host})", pname
        assert psort.get(r) == r
    named = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    sorted_ = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_sort_index"}
    assert named == sorted_
    tids = Counter(e["tid"] for e in meta if e["name"] == "thread_name")
    assert max(tids.values()) == 1, "thread ids must be unique across processes"
    # complete events: non-negative, and properly nested on each thread
    lanes = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            assert (e["pid"], e["tid"]) in named, e
            lanes[e["pid"], e["tid"]].append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"])))
    for key, iv in lanes.items():
        iv.sort(key=lambda x: (x[0], -x[1]))
        stack: list[int] = []
        for a, b in iv:
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1], f"mis-nested slice {a}..{b} on {key}"
            stack.append(b)
    # counters sit in a named process, flows pair up and bind inside a slice of their thread
    for e in events:
        if e["ph"] == "C":
            assert e["pid"] in pname and e["args"], e
            assert all(isinstance(v, (int, float)) for v in e["args"].values()), e
    starts = {}
    ends = {}
    for e in events:
        if e["ph"] in ("s", "f"):
            assert (e["pid"], e["tid"]) in named, e
            t = ns(e["ts"])
            assert any(a <= t <= b for a, b in lanes[e["pid"], e["tid"]]), f"unbound flow {e}"
            d = starts if e["ph"] == "s" else ends
            k = (e["id"], e["cat"], e["name"])
            assert k not in d, f"duplicate flow {e}"
            d[k] = e
            if e["ph"] == "f":
                assert e["bp"] == "e"
    assert starts.keys() == ends.keys()


def x_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


# ---------------------------------------------------------------------------------------------
# Tests


def test_structure_lanes_and_args(tmp_path: Path) -> None:
    spans = make_spans()
    run = make_run(spans, tmp_path)
    events = list(chrome_events(run))
    check_trace(events, HOSTS)
    xs = x_events(events)
    assert len(xs) == int((spans["kind"] != "scalar").sum())
    assert min(e["ts"] for e in events if e["ph"] != "M") == 0  # rebased to the run's start
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_lane = defaultdict(set)
    for e in xs:
        by_lane[names[e["pid"], e["tid"]]].add(e["cat"])
    assert by_lane["step"] == {"step"}
    assert by_lane["compute"] == {"input", "forward", "backward"}
    assert by_lane["wait"] == {"wait"} and by_lane["update"] == {"update"}
    assert by_lane["user"] == {"user"}
    ar_lanes = sorted(n for n in by_lane if n.startswith("allreduce"))
    assert len(ar_lanes) >= 2 and all(by_lane[n] == {"allreduce"} for n in ar_lanes)
    assert ar_lanes[0] == "allreduce 0"
    # µs with the ns kept: rank 1 is 700 ns late
    first = {e["pid"]: e["ts"] for e in xs if e["cat"] == "step" and e["args"]["step"] == 0}
    assert first == {0: 0.0, 1: 0.7, 2: 1.4}
    ar = next(e for e in xs if e["cat"] == "allreduce" and e["name"] == "layer2.w")
    assert ar["args"]["tensor"] == "layer2.w"
    assert ar["args"]["bytes"] == 4096 * 3 and ar["args"]["dtype"] == "float32"
    assert ar["args"]["dur_ms"] == pytest.approx(ar["dur"] / 1000, abs=1e-9)
    assert {"step", "micro", "dur_ms"} <= xs[0]["args"].keys()


def test_collectives_linked_across_ranks() -> None:
    spans = make_spans(ranks=3, steps=2, tensors=3)
    events = list(chrome_events(spans, hosts=HOSTS))
    check_trace(events, HOSTS)
    ar = [e for e in x_events(events) if e["cat"] == "allreduce"]
    by_coll = defaultdict(list)
    for e in ar:
        by_coll[e["args"]["collective"]].append(e)
    assert len(by_coll) == 2 * 3
    for members in by_coll.values():
        assert len({(m["args"]["step"], m["name"]) for m in members}) == 1
        assert sorted(m["pid"] for m in members) == [0, 1, 2]
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(flows) == 2 * len(by_coll) * 2  # (ranks - 1) s/f pairs per collective
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    for f in (e for e in flows if e["ph"] == "f"):
        s = starts[f["id"]]
        src = [
            m for m in ar if m["pid"] == s["pid"] and m["tid"] == s["tid"] and m["ts"] == s["ts"]
        ]
        dst = [
            m for m in ar if m["pid"] == f["pid"] and m["tid"] == f["tid"] and m["ts"] == f["ts"]
        ]
        assert len(src) == 1 and len(dst) == 1
        assert src[0]["args"]["collective"] == dst[0]["args"]["collective"]
        members = by_coll[src[0]["args"]["collective"]]
        assert s["ts"] == min(m["ts"] for m in members)  # from the earliest enqueue
        assert f["pid"] != s["pid"]


def test_counters_scalar_and_ratio() -> None:
    spans = make_spans(ranks=2, steps=3, tensors=2)
    events = list(chrome_events(spans, hosts=HOSTS))
    loss = [e for e in events if e["ph"] == "C" and e["name"] == "loss"]
    assert len(loss) == 2 * 3
    assert sorted({e["args"]["value"] for e in loss}) == pytest.approx([2.3, 2.4, 2.5])
    ratio = [e for e in events if e["ph"] == "C" and e["name"] == RATIO_COUNTER]
    assert len(ratio) == 2 * 3 and all(e["args"]["ratio"] > 0 for e in ratio)
    # a steps table from the analysis replaces the built-in ratio
    steps_df = pd.DataFrame(
        {
            "rank": [0, 1],
            "step": [1, 1],
            "start_ns": [T0 + 1_000_000, T0 + 1_000_700],
            "comm_compute_ratio": [0.25, 0.75],
        }
    )
    events = list(chrome_events(spans, steps_df=steps_df, hosts=HOSTS))
    ratio = [e for e in events if e["ph"] == "C" and e["name"] == RATIO_COUNTER]
    assert sorted((e["pid"], e["ts"], e["args"]["ratio"]) for e in ratio) == [
        (0, 1000.0, 0.25),
        (1, 1000.7, 0.75),
    ]


def test_ratio_counter_renders_the_analysis_step_table() -> None:
    """The export draws the analysis's comm/compute ratio; it never computes its own."""
    from hvtrace.analysis.steps import step_table

    spans = make_spans(ranks=3, steps=4, tensors=3)
    st = step_table(spans)
    t0 = int(spans["start_ns"].min())
    want = sorted(
        (int(r.rank), round((int(r.start_ns) - t0) / 1e3, 3), round(float(r.comm_compute_ratio), 9))
        for r in st.itertuples()
        if np.isfinite(r.comm_compute_ratio)
    )
    events = list(chrome_events(spans))
    got = sorted(
        (e["pid"], round(e["ts"], 3), round(e["args"]["ratio"], 9))
        for e in events
        if e["ph"] == "C" and e["name"] == RATIO_COUNTER
    )
    assert got == want and len(got) == 3 * 4


def test_gzip_round_trip(tmp_path: Path) -> None:
    run = make_run(make_spans(), tmp_path)
    [plain] = write_chrome_trace(run, tmp_path / "t.json")
    [gz] = write_chrome_trace(run, tmp_path / "t.json.gz")
    assert plain.name == "t.json" and gz.name == "t.json.gz"
    with gzip.open(gz, "rb") as f:
        assert f.read(16).startswith(b'{"traceEvents":')
    assert read_trace(gz) == read_trace(plain)
    doc = read_trace(plain)
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"]["run_id"] == "test-run"
    assert doc["traceEvents"] == list(chrome_events(run))
    check_trace(doc["traceEvents"], HOSTS)


def test_steps_cut(tmp_path: Path) -> None:
    run = make_run(make_spans(steps=5), tmp_path)
    [p] = write_chrome_trace(run, tmp_path / "cut.json", steps=(1, 3))
    events = read_trace(p)["traceEvents"]
    check_trace(events, HOSTS)
    assert {e["args"]["step"] for e in x_events(events)} == {1, 2}
    assert len(x_events(events)) == 2 * len(x_events(list(chrome_events(run, steps=(1, 2)))))
    # the time origin stays the run's start, so a cut lines up with the full timeline
    full = {(e["pid"], e["name"], e["args"]["step"]): e["ts"] for e in x_events(chrome_events(run))}
    for e in x_events(events):
        assert full[e["pid"], e["name"], e["args"]["step"]] == e["ts"]
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and all(1_000_000 <= ns(e["ts"]) < 3_100_000 for e in counters)
    tail = list(chrome_events(run, steps=(3, None)))
    assert {e["args"]["step"] for e in x_events(tail)} == {3, 4}
    with pytest.raises(TraceError, match="no spans in steps 7"):
        write_chrome_trace(run, tmp_path / "none.json", steps=(7, 9))
    with pytest.raises(ValueError):
        list(chrome_events(run, steps=(3, 3)))


def test_split_by_max_events(tmp_path: Path) -> None:
    run = make_run(make_spans(steps=6), tmp_path)
    whole = read_trace(write_chrome_trace(run, tmp_path / "whole.json")[0])["traceEvents"]
    n_meta = sum(e["ph"] == "M" for e in whole)
    max_events = n_meta + 130  # one step has 3 * (12 + 5 + 2 * 4) = 75 events
    paths = write_chrome_trace(run, tmp_path / "timeline.json", max_events=max_events)
    assert len(paths) >= 3
    assert [p.name for p in paths] == [f"timeline.part{i:03d}.json" for i in range(len(paths))]
    assert not (tmp_path / "timeline.json").exists()
    assert not list(tmp_path.glob(".*tmp"))
    seen = []
    last = -1
    for p in paths:
        doc = read_trace(p)
        ev = doc["traceEvents"]
        assert len(ev) <= max_events
        check_trace(ev, HOSTS)  # each part opens on its own
        steps = sorted({e["args"]["step"] for e in x_events(ev)})
        assert steps[0] > last  # split by step ranges
        last = steps[-1]
        assert doc["otherData"]["steps"] == [steps[0], steps[-1]]
        seen += [e for e in ev if e["ph"] != "M"]
    key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
    assert sorted(map(key, seen)) == sorted(key(e) for e in whole if e["ph"] != "M")


def test_split_by_max_bytes_gz(tmp_path: Path) -> None:
    run = make_run(make_spans(steps=6), tmp_path)
    whole = tmp_path / "whole.json"
    write_chrome_trace(run, whole)
    limit = whole.stat().st_size // 3
    paths = write_chrome_trace(run, tmp_path / "t.json.gz", max_bytes=limit)
    assert len(paths) >= 3 and all(p.name.endswith(".json.gz") for p in paths)
    for p in paths:
        with gzip.open(p, "rb") as f:
            assert len(f.read()) <= limit
        check_trace(read_trace(p)["traceEvents"], HOSTS)


def test_step_larger_than_a_part_is_cut_between_collectives(tmp_path: Path) -> None:
    run = make_run(make_spans(steps=2, tensors=6), tmp_path)
    n_meta = sum(e["ph"] == "M" for e in chrome_events(run))
    paths = write_chrome_trace(run, tmp_path / "t.json", max_events=n_meta + 20)
    assert len(paths) >= 6
    total = 0
    for p in paths:
        ev = read_trace(p)["traceEvents"]
        assert len(ev) <= n_meta + 20
        check_trace(ev, HOSTS)  # flows stay with their slices
        total += len(ev) - n_meta
    assert total == sum(e["ph"] != "M" for e in chrome_events(run))
    with pytest.raises(ValueError, match="max_events"):
        write_chrome_trace(run, tmp_path / "x.json", max_events=n_meta)


def test_odd_input_is_still_valid() -> None:
    spans = make_spans(ranks=2, steps=1, tensors=2)
    bad = spans.index[spans["kind"] == "forward"][0]
    spans.loc[bad, "end_ns"] = spans.loc[bad, "start_ns"] - 5  # negative duration
    spans["name"] = spans["name"].cat.rename_categories({"data": 'lo"ad\\ä\n'})
    spans.loc[spans.index[0], "value"] = np.nan
    events = list(chrome_events(spans, hosts={0: "h", 1: "h"}))
    check_trace(events, {0: "h", 1: "h"})
    fwd = [e for e in x_events(events) if e["name"] == "forward"]
    assert min(e["dur"] for e in fwd) == 0
    assert any(e["name"] == 'lo"ad\\ä\n' for e in x_events(events))


@pytest.mark.parametrize("vector_limit", [1, 1024])
def test_assign_lanes_first_fit(vector_limit: int) -> None:
    rng = np.random.default_rng(1)
    n = 3000
    group = rng.integers(0, 4, n)
    start = rng.integers(0, 20_000, n)
    end = start + rng.integers(0, 400, n)
    end[:50] = start[:50]  # zero-length intervals
    lanes = assign_lanes(group, start, end, vector_limit=vector_limit)
    for g in range(4):
        m = group == g
        # no two intervals of one lane overlap
        for lane in np.unique(lanes[m]):
            k = m & (lanes == lane)
            o = np.argsort(start[k], kind="stable")
            s, e = start[k][o], end[k][o]
            assert (s[1:] >= e[:-1]).all()
        # first-fit in start order is optimal: lanes == most intervals open at once
        ev = sorted(
            [(a, 1) for a in start[m]] + [(b, -1) for b in end[m]], key=lambda x: (x[0], x[1])
        )
        depth = max(np.cumsum([d for _, d in ev]))
        assert lanes[m].max() + 1 == depth
    assert (
        assign_lanes(group, start, end, vector_limit=1)
        == assign_lanes(group, start, end, vector_limit=1024)
    ).all()


def test_real_trace_files(tmp_path: Path) -> None:
    """Files written by the recorder's writer, loaded by load_run, exported."""
    from hvtrace.record.writer import TraceFile

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    k = KIND_CODE
    f32 = DTYPE_CODE["float32"]
    for r, offset in ((0, 0), (1, 2_000)):
        est = {"at_ns": T0, "offset_ns": offset, "uncertainty_ns": 50, "rounds": 8, "bounded": True}
        header = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "run_id": "real",
            "rank": r,
            "size": 2,
            "host": f"host{r}",
            "pid": 42 + r,
            "device": "cpu",
            "mono_anchor_ns": T0,
            "wall_anchor_ns": 1_700_000_000 * 10**9,
            "clock": {"method": "barrier-interval", "reference_rank": 0, "start": est},
        }
        tf = TraceFile(run_dir / f"rank{r:05d}-real.arrows", header)
        for s in range(3):
            b = T0 + offset + s * 1_000_000 + r * 300
            rows = [
                (s, 0, k["step"], "step", b, b + 1_000_000, 0, 0, float("nan"), 0),
                (s, 0, k["forward"], "forward", b + 1_000, b + 300_000, 0, 0, float("nan"), 0),
                (s, 0, k["backward"], "backward", b + 300_000, b + 600_000, 0, 0, float("nan"), 0),
                (
                    s,
                    0,
                    k["allreduce"],
                    "fc.bias",
                    b + 350_000,
                    b + 800_000,
                    40,
                    f32,
                    float("nan"),
                    2,
                ),
                (
                    s,
                    0,
                    k["allreduce"],
                    "fc.weight",
                    b + 360_000,
                    b + 810_000,
                    4000,
                    f32,
                    float("nan"),
                    2,
                ),
                (s, 0, k["wait"], "synchronize", b + 600_000, b + 810_000, 0, 0, float("nan"), 0),
                (s, 0, k["update"], "update", b + 810_000, b + 1_000_000, 0, 0, float("nan"), 0),
                (s, 0, k["scalar"], "loss", b + 999_000, b + 999_000, 0, 0, 1.5 / (s + 1), 0),
            ]
            tf.append(rows, {"last_step": s, "final": s == 2})
        tf.close()
    run = load_run(run_dir)
    paths = write_chrome_trace(run, tmp_path / "out" / "timeline.json.gz")
    doc = read_trace(paths[0])
    ev = doc["traceEvents"]
    check_trace(ev, {0: "host0", 1: "host1"})
    assert doc["otherData"]["size"] == 2 and doc["otherData"]["t0_ns"] == T0
    assert min(e["ts"] for e in ev if e["ph"] != "M") == 0
    # rank 1's clock runs 2000 ns ahead; aligned, it is 300 ns late
    steps = {
        e["pid"]: e["ts"] for e in x_events(ev) if e["cat"] == "step" and e["args"]["step"] == 0
    }
    assert steps == {0: 0.0, 1: 0.3}
    assert sum(e["ph"] == "s" for e in ev) == 3 * 2
    assert len([e for e in ev if e["ph"] == "C" and e["name"] == "loss"]) == 6
    lanes = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert {"step", "compute", "wait", "update", "allreduce 0", "allreduce 1"} <= lanes


def test_collectives_are_the_analysis_collectives() -> None:
    """One collective per (step, tensor), as hvtrace.analysis.bandwidth counts them."""
    from hvtrace.analysis.engine import collective_table

    spans = make_spans(ranks=3, steps=3, tensors=4)
    ids = {
        (e["args"]["step"], e["name"], e["args"]["collective"])
        for e in chrome_events(spans)
        if e["ph"] == "X" and "collective" in e.get("args", {})
    }
    coll = collective_table(spans)
    assert len({c for _, _, c in ids}) == len(coll) == 3 * 4
    assert {(s, n) for s, n, _ in ids} == set(zip(coll["step"], coll["name"]))


def test_a_run_is_exported_from_its_files_chunk_by_chunk_as_from_its_frame(tmp_path: Path) -> None:
    """A run's files are read through the engine a chunk of steps at a time (its span frame is
    never built): the same events, in the same order, as the export of its frame, whatever the
    chunk size, with a steps cut too, and through the part writer."""
    from helpers import synth_module

    from hvtrace.export import chrome
    from hvtrace.load import load_run, open_run

    synth = synth_module()
    synth.write_synth_run(tmp_path / "r", ranks=3, steps=24, tensors=5, slow_rank=1)
    frame_run = load_run(tmp_path / "r")  # its frame built: exported from it
    want = list(chrome_events(frame_run))
    assert sum(e["ph"] == "f" for e in want) > 0
    for chunk_spans in (10**9, 400, 1):
        run = open_run(tmp_path / "r")
        chunks = chrome._Chunks(run, None, None, None, None, chunk_spans=chunk_spans)
        try:
            n_chunks = len(chunks.ranges())
            got = [dict(m) for m in chunks.layout.meta]
            for t in chunks.tables():
                for lo, hi in chrome._batches(t):
                    for s in chrome._batch_strings(t, lo, hi).to_pylist():
                        got += json.loads("[" + s[2:] + "]")
        finally:
            chunks.close()
        assert "spans" not in vars(run)  # the frame was not built
        assert n_chunks == (1 if chunk_spans == 10**9 else 24 if chunk_spans == 1 else n_chunks)
        assert got == want, chunk_spans
    # a steps cut: the time origin stays the run's, the steps are those asked
    run = open_run(tmp_path / "r")
    cut = list(chrome_events(run, steps=(5, 9)))
    assert "spans" not in vars(run)
    assert cut == list(chrome_events(frame_run, steps=(5, 9)))
    assert {e["args"]["step"] for e in x_events(cut)} == set(range(5, 9))
    # parts: the same steps end up in the same parts
    a = write_chrome_trace(open_run(tmp_path / "r"), tmp_path / "a.json", max_events=400)
    b = write_chrome_trace(frame_run, tmp_path / "b.json", max_events=400)
    assert len(a) == len(b) > 2
    for pa_, pb_ in zip(a, b):
        assert read_trace(pa_)["traceEvents"] == read_trace(pb_)["traceEvents"]
