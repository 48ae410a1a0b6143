"""Tests of the Perfetto protobuf timeline (hvtrace.export.perfetto)."""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import make_header, row, write_rank_file
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from hvtrace.cli import main
from hvtrace.errors import TraceError
from hvtrace.export.chrome import chrome_events
from hvtrace.export.perfetto import (
    MAX_NAME_CHARS,
    encode_counters,
    encode_slices,
    varint_sizes,
    write_perfetto_trace,
)
from hvtrace.load import load_run, open_run

HOSTS = {0: "node-a", 1: "node-a", 2: "node-b"}
T0 = 10**12  # the hand-made ranks' monotonic anchor
#: rank -> its clock minus rank 0's (ns), as its header's clock estimate says
OFFSETS = {0: 0, 1: 3_000, 2: -250_000}


def run_spans(rank: int, steps: int = 4, tensors: int = 4) -> list[tuple]:
    """One rank's rows (local clock): every kind, overlapping allreduces, a loss scalar."""
    rows = []
    off = OFFSETS[rank]
    for s in range(steps):
        b = T0 + 5_000_000 + s * 1_000_000 + rank * 700 + off
        rows += [
            row("step", "step", b, b + 1_000_000, s),
            row("input", "input", b, b + 100_000, s),
            row("user", "data", b + 10_000, b + 90_000, s),
            row("forward", "forward", b + 100_000, b + 300_000, s),
            row("backward", "backward", b + 300_000, b + 700_000, s),
            row("wait", "synchronize", b + 700_000, b + 850_000, s),
            row("update", "update", b + 850_000, b + 990_000, s),
            row("scalar", "loss", b + 995_000, b + 995_000, s, value=2.5 - 0.1 * s),
        ]
        for k in range(tensors):
            a = b + 320_000 + k * 70_000 + (rank * 37 + k * 11) % 50
            rows.append(
                row("allreduce", f"layer{k}.w", a, b + 760_000 + k * 10_000, s,
                    nbytes=4096 * (k + 1), dtype="float32")
            )  # fmt: skip
    return rows


def write_run(run_dir: Path, ranks: int = 3, steps: int = 4, extra: dict | None = None) -> None:
    """Write a small run of real rank files (the writer's own format), clocks offset."""
    for r in range(ranks):
        clock = {"at_ns": T0 + OFFSETS[r], "offset_ns": OFFSETS[r], "uncertainty_ns": 1000,
                 "rounds": 5, "bounded": True}  # fmt: skip
        h = make_header(rank=r, size=ranks, run_id="run-pf", clock_start=clock, host=HOSTS[r],
                        mono_anchor_ns=T0 + OFFSETS[r], boot_id=f"boot-{r}")  # fmt: skip
        rows = run_spans(r, steps) + list((extra or {}).get(r, []))
        write_rank_file(run_dir / f"rank{r:05d}-run-pf.arrows", h, [rows])


# ---------------------------------------------------------------------------------------------
# Reading a .pftrace back: a small trace processor over perfetto_trace_pb2


@dataclass
class Slice:
    rank: int
    host: str
    lane: str
    name: str
    start_ns: int
    end_ns: int
    flows: tuple[int, ...]


@dataclass
class Decoded:
    slices: list[Slice]
    counters: dict[tuple[int, str], list[tuple[int, float]]]  # (rank, track) -> (ts, value)
    tracks: dict[int, tuple[str, int | None]]  # uuid -> (name, parent uuid)
    packets: int


def decode(path: Path) -> Decoded:
    """Decode ``path`` with perfetto_trace_pb2 and replay each sequence's incremental state
    (interned names, default track, incremental clock) the way Perfetto's trace processor does."""
    data = path.read_bytes()
    outer = pb.Trace.FromString(data)
    assert outer.SerializeToString() == data
    # compressed_packets blocks expand in place (zlib, framed as a Trace), as the trace
    # processor expands them; every byte inside is what protobuf itself writes
    packets = []
    for p in outer.packet:
        if p.HasField("compressed_packets"):
            assert p.ListFields() == [(p.DESCRIPTOR.fields_by_name["compressed_packets"],
                                       p.compressed_packets)]  # fmt: skip
            inner = zlib.decompress(p.compressed_packets)
            block = pb.Trace.FromString(inner)
            assert block.SerializeToString() == inner
            packets.extend(block.packet)
        else:
            packets.append(p)
    tracks: dict[int, tuple[str, int | None]] = {}
    seqs: dict[int, dict] = {}
    events = []
    for p in packets:
        sid = p.trusted_packet_sequence_id
        assert p.HasField("trusted_packet_sequence_id")
        if p.HasField("track_descriptor"):
            t = p.track_descriptor
            assert t.uuid not in tracks
            tracks[t.uuid] = (t.name, t.parent_uuid if t.HasField("parent_uuid") else None)
            continue
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            seqs[sid] = {"names": {}, "track": None, "ts": None, "clock": None}
        st = seqs[sid]  # no packet of a sequence comes before its state is set
        if p.HasField("trace_packet_defaults"):
            d = p.trace_packet_defaults
            st["clock"] = d.timestamp_clock_id
            st["track"] = d.track_event_defaults.track_uuid
        if p.HasField("clock_snapshot"):
            clocks = {c.clock_id: c for c in p.clock_snapshot.clocks}
            assert clocks[64].is_incremental and clocks[6].timestamp == clocks[64].timestamp
            st["ts"] = clocks[64].timestamp
        for n in p.interned_data.event_names:
            st["names"][n.iid] = n.name
        if p.HasField("track_event"):
            assert st["clock"] == 64 and not p.HasField("timestamp_clock_id")
            st["ts"] += p.timestamp
            te = p.track_event
            assert not te.HasField("track_uuid")  # the sequence's default track
            events.append((st["track"], te.type, st["names"].get(te.name_iid), st["ts"],
                           tuple(te.flow_ids), te.double_counter_value))  # fmt: skip

    def where(uuid: int) -> tuple[int, str, str]:
        lane, parent = tracks[uuid]
        rank_name, host_uuid = tracks[parent]
        assert rank_name.startswith("rank ")
        host, top = tracks[host_uuid]
        assert top is None
        return int(rank_name.split()[1]), host, lane

    slices: list[Slice] = []
    counters: dict[tuple[int, str], list[tuple[int, float]]] = defaultdict(list)
    open_: dict[int, tuple] = {}
    for track, typ, name, ts, flows, value in events:
        if typ == pb.TrackEvent.TYPE_COUNTER:
            rank, _, lane = where(track)
            counters[(rank, lane)].append((ts, value))
        elif typ == pb.TrackEvent.TYPE_SLICE_BEGIN:
            assert track not in open_  # slices of one lane never overlap
            open_[track] = (name, ts, flows)
        else:
            assert typ == pb.TrackEvent.TYPE_SLICE_END
            name, start, flows = open_.pop(track)
            rank, host, lane = where(track)
            slices.append(Slice(rank, host, lane, name, start, ts, flows))
    assert not open_
    return Decoded(slices, dict(counters), tracks, len(packets))


def aligned_spans(run_dir: Path) -> pd.DataFrame:
    """The run's spans as load_run aligns them (what the Chrome export draws), end >= start."""
    spans = load_run(run_dir).spans
    spans = spans[spans["kind"] != "clock"].copy()
    spans["end_ns"] = np.maximum(spans["end_ns"], spans["start_ns"])
    return spans


def export(run_dir: Path, out: Path, *args: str) -> Decoded:
    assert main(["analyze", str(run_dir), "-o", str(out), *args]) == 0
    return decode(out)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    write_run(d)
    return d


# ---------------------------------------------------------------------------------------------
# The bulk encoder: exactly protobuf's bytes


def _pb_trace(seq: int, packets: list[dict]) -> bytes:
    t = pb.Trace()
    for spec in packets:
        p = t.packet.add()
        p.timestamp = spec["ts"]
        p.trusted_packet_sequence_id = seq
        e = p.track_event
        e.type = spec["type"]
        if "iid" in spec:
            e.name_iid = spec["iid"]
        for f in spec.get("flows", ()):
            e.flow_ids.append(f)
        if "value" in spec:
            e.double_counter_value = spec["value"]
    return t.SerializeToString()


@pytest.mark.parametrize("with_flows", [False, True])
@pytest.mark.parametrize("seq", [2, 127, 128, 70_000])
def test_encode_slices_is_protobufs_encoding(seq: int, with_flows: bool) -> None:
    rng = np.random.default_rng(seq)
    n = 500
    gaps = rng.choice([0, 1, 127, 128, 16_383, 16_384, 10**9, 2**40, 2**52], n)
    durs = rng.choice([0, 1, 300, 2**21, 2**35], n)
    begin = np.cumsum(gaps + np.concatenate([[0], durs[:-1]])).astype(np.int64)
    end = begin + durs
    iid = rng.choice([1, 127, 128, 300, 2**31], n)
    flows = rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1 if with_flows else None
    got = encode_slices(seq, begin, end, iid, flows).tobytes()
    specs, last = [], 0
    for i in range(n):
        b = {"ts": int(begin[i]) - last, "type": 1, "iid": int(iid[i])}
        if with_flows:
            b["flows"] = [int(flows[i])]
        specs += [b, {"ts": int(end[i] - begin[i]), "type": 2}]
        last = int(end[i])
    assert got == _pb_trace(seq, specs)


def test_encode_counters_is_protobufs_encoding() -> None:
    ts = np.array([0, 0, 5, 2**20, 2**50], np.int64)
    values = np.array([0.0, -1.5, np.inf, 1e-300, np.nan])
    got = encode_counters(9, ts, values).tobytes()
    specs = [{"ts": int(d), "type": 4, "value": float(v)}
             for d, v in zip(np.diff(ts, prepend=0), values)]  # fmt: skip
    assert got == _pb_trace(9, specs)


def test_encode_refuses_decreasing_times() -> None:
    with pytest.raises(ValueError, match="must not decrease"):
        encode_slices(2, np.array([10, 5]), np.array([12, 6]), np.array([1, 1]))


def test_varint_sizes() -> None:
    v = np.array([0, 127, 128, 2**14 - 1, 2**14, 2**63, 2**64 - 1], np.uint64)
    assert varint_sizes(v).tolist() == [1, 1, 2, 2, 3, 10, 10]


# ---------------------------------------------------------------------------------------------
# The export


def test_every_span_is_a_slice_on_its_ranks_lane(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    dec = export(run_dir, out)
    spans = aligned_spans(run_dir)
    slices = spans[spans["kind"] != "scalar"]
    assert len(dec.slices) == len(slices) == 3 * 4 * (7 + 4)
    got = sorted((s.rank, s.name, s.start_ns, s.end_ns) for s in dec.slices)
    want = sorted(
        zip(slices["rank"].tolist(), slices["name"].astype(str).tolist(),
            slices["start_ns"].tolist(), slices["end_ns"].tolist())
    )  # fmt: skip
    assert got == want  # names, and times on rank 0's clock as load_run aligns them
    # the clock offsets were applied: rank 2's clock ran 250 us behind rank 0's
    r2 = min(s.start_ns for s in dec.slices if s.rank == 2)
    assert r2 == T0 + 5_000_000 + 2 * 700
    # hosts above ranks, and each kind on the lane the Chrome export puts it on
    assert {(s.rank, s.host) for s in dec.slices} == set(HOSTS.items())
    lane_of_kind = {
        "step": "step",
        "input": "compute",
        "forward": "compute",
        "backward": "compute",
        "wait": "wait",
        "update": "update",
        "user": "user",
    }
    kind = {
        (r, n, st): k
        for r, n, st, k in zip(
            slices["rank"],
            slices["name"].astype(str),
            slices["start_ns"],
            slices["kind"].astype(str),
        )
    }
    for s in dec.slices:
        k = kind[(s.rank, s.name, s.start_ns)]
        if k == "allreduce":
            assert s.lane.startswith("allreduce ")
        else:
            assert s.lane == lane_of_kind[k], (s, k)
    # the allreduces of a step overlap: as many allreduce lanes as the Chrome export has
    chrome = list(chrome_events(load_run(run_dir)))
    chrome_lanes = {e["args"]["name"] for e in chrome
                    if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert {s.lane for s in dec.slices} == chrome_lanes


def test_flows_link_each_collective_across_ranks(run_dir: Path, tmp_path: Path) -> None:
    dec = export(run_dir, tmp_path / "t.pftrace")
    spans = aligned_spans(run_dir)
    step = {
        (r, n, s): st
        for r, n, s, st in zip(
            spans["rank"], spans["name"].astype(str), spans["start_ns"], spans["step"]
        )
    }
    by_flow: dict[int, set] = defaultdict(set)
    for s in dec.slices:
        if not s.lane.startswith("allreduce"):
            assert s.flows == ()
            continue
        assert len(s.flows) == 1
        by_flow[s.flows[0]].add((step[(s.rank, s.name, s.start_ns)], s.name, s.rank))
    assert len(by_flow) == 4 * 4  # steps x tensors
    for members in by_flow.values():
        assert len({(st, n) for st, n, _ in members}) == 1  # one collective per id
        assert {r for _, _, r in members} == {0, 1, 2}  # on every rank


def test_counters_carry_the_analysis_values(run_dir: Path, tmp_path: Path) -> None:
    from hvtrace.analysis import analyze

    dec = export(run_dir, tmp_path / "t.pftrace")
    a = analyze(open_run(run_dir))
    for r in range(3):
        want = a.steps[a.steps["rank"] == r].sort_values("start_ns")
        got = dec.counters[(r, "comm/compute")]
        assert [t for t, _ in got] == want["start_ns"].tolist()
        assert [v for _, v in got] == want["comm_compute_ratio"].tolist()
        loss = dec.counters[(r, "loss")]
        assert [v for _, v in loss] == pytest.approx([2.5 - 0.1 * s for s in range(4)])
    spans = aligned_spans(run_dir)
    sc = spans[spans["kind"] == "scalar"]
    assert sorted(t for r in range(3) for t, _ in dec.counters[(r, "loss")]) == sorted(
        sc["start_ns"].tolist()
    )


def test_steps_and_ranks_cut_the_timeline(run_dir: Path, tmp_path: Path) -> None:
    spans = aligned_spans(run_dir)
    dec = export(run_dir, tmp_path / "a.pftrace", "--steps", "1:3")
    cut = spans[spans["step"].between(1, 2) & (spans["kind"] != "scalar")]
    assert sorted((s.rank, s.start_ns) for s in dec.slices) == sorted(
        zip(cut["rank"], cut["start_ns"])
    )
    assert all(len(v) == 2 for v in dec.counters.values())
    dec = export(run_dir, tmp_path / "b.pftrace", "--ranks", "0,2")
    assert {s.rank for s in dec.slices} == {0, 2}
    names = {n for n, _ in dec.tracks.values()}
    assert "rank 1" not in names and {"rank 0", "rank 2"} <= names


def test_hostile_name_is_carried_safely(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    b = T0 + 5_000_000
    hostile = "\x00\x1b[31m\n\r\t\u202e<script>" + "x" * 200_000
    write_run(d, extra={0: [row("user", hostile, b + 1_000, b + 2_000, 0)]})
    dec = export(d, tmp_path / "t.pftrace")
    mine = [s for s in dec.slices if s.rank == 0 and s.lane == "user" and s.name != "data"]
    assert len(mine) == 1
    assert len(mine[0].name) == MAX_NAME_CHARS
    assert mine[0].name[:-1] == hostile[: MAX_NAME_CHARS - 1] and mine[0].name[-1] == "…"
    assert (mine[0].start_ns, mine[0].end_ns) == (b + 1_000, b + 2_000)


def test_output_is_never_an_input_and_links_are_replaced(run_dir: Path, tmp_path: Path,
                                                         capsys) -> None:  # fmt: skip
    src = sorted(run_dir.glob("rank*"))[0]
    before = src.read_bytes()
    alias = tmp_path / "alias.pftrace"
    alias.symlink_to(src)
    assert main(["analyze", str(run_dir), "-o", str(alias)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "input of this analysis" in err[0]
    assert src.read_bytes() == before
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link.pftrace"
    link.symlink_to(target)
    decode_ok = export(run_dir, link)
    assert decode_ok.slices and target.read_bytes() == b"keep" and not link.is_symlink()
    assert not list(tmp_path.glob(".*.tmp"))


def test_nothing_to_export_leaves_no_file(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    with pytest.raises(TraceError, match="nothing to export"):
        write_perfetto_trace(open_run(run_dir), out, steps=(50, 60))
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_parquet_files_read_through_duckdb(run_dir: Path, tmp_path: Path) -> None:
    from hvtrace.format.compact import compact_run

    want = sorted((s.rank, s.name, s.start_ns, s.end_ns)
                  for s in export(run_dir, tmp_path / "a.pftrace").slices)  # fmt: skip
    compact_run(run_dir)
    assert sorted(run_dir.glob("*.parquet"))
    got = sorted((s.rank, s.name, s.start_ns, s.end_ns)
                 for s in export(run_dir, tmp_path / "b.pftrace").slices)  # fmt: skip
    assert got == want
