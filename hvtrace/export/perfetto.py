"""Merged timeline export in Perfetto's own protobuf trace format (``.pftrace``).

The file is a ``perfetto.protos.Trace``: a stream of ``TracePacket`` messages with
``TrackEvent`` slices, written rank by rank, so a run of any size is exported without holding
its spans in memory: DuckDB reads one rank's spans of the selected steps (the row groups of
``--steps`` only), they are aligned to rank 0's clock, encoded and written, and the next rank
is read.

Layout
------
* A track tree ``host`` -> ``rank N`` -> lanes, as plain named tracks (``TrackDescriptor`` with
  ``parent_uuid``) in explicit order. The lanes are those of the Chrome export
  (:mod:`hvtrace.export.chrome`): ``step``, ``compute``, ``wait``, ``update``, ``user`` and
  ``allreduce 0``, ``allreduce 1``, ... assigned by the same first-fit
  (:func:`~hvtrace.export.chrome.assign_lanes`), so no two slices of one lane overlap. Only the
  lanes a rank uses are written.
* Every span is a ``TYPE_SLICE_BEGIN`` / ``TYPE_SLICE_END`` pair on its lane's track, named
  after the span (the ``name`` column, as in the Chrome export). Times are nanoseconds on rank
  0's monotonic clock, aligned exactly as :func:`hvtrace.load.load_run` and the Chrome export
  align them (:func:`hvtrace.load.align_times`); ``end < start`` is drawn as a
  zero-length slice. Trace time 0 is rank 0's monotonic clock origin (boot), so the Perfetto UI
  shows the same offsets as the Chrome export, whose ``otherData.t0_ns`` is the first span.
* Each allreduce collective (same step and tensor on every rank) is one flow: every rank's slice
  of it carries the same flow id, so the Perfetto UI draws arrows from the rank that enqueued it
  first through the others in arrival order (the last arrow points at the rank that arrived
  last). The Chrome export draws one arrow from the first rank to each other instead.
* Counter tracks under each rank: ``comm/compute`` (the analysis's per-step ratio at each step's
  start, taken from :attr:`hvtrace.analysis.Analysis.steps`, never recomputed) and one per
  ``hvtrace.scalar`` name (``loss``, ...).

Encoding
--------
Descriptors, clock snapshots and interned names are built with the ``perfetto`` package's
protos (``perfetto_trace_pb2``) and serialized by ``protobuf``. The bulk packets (slice
begin/end pairs and counter values) are encoded by :func:`encode_slices` and
:func:`encode_counters`, vectorized with numpy (about 1.2 s per million spans): per-message
protobuf took 6.2 µs per span on the 2-core development machine, 62 s for 10 million spans, over
the 30 s goal (``bench/README.md``). The tests check that their bytes are exactly what protobuf
writes for the same messages.

Every lane is its own packet sequence (``trusted_packet_sequence_id``) whose first packet clears
the sequence's incremental state and sets ``TracePacketDefaults``: the lane's track as the
default ``track_uuid`` and an incremental clock (``timestamp_clock_id`` 64, a delta from the
sequence's previous packet, tied to the trace clock by a ``ClockSnapshot``); its names are
interned (``InternedData.event_names``). A slice thus costs about 26 bytes (11 + 9 bytes of
packet and event fields, and two nanosecond deltas of 3-4 bytes each), an allreduce 10 more for
its flow id. Sequence ids are reused from rank to rank (each reuse starts with
``SEQ_INCREMENTAL_STATE_CLEARED``), so they stay one byte long.

The packets are then deflated in blocks of about 4 MiB, each written as one
``TracePacket{compressed_packets}`` (zlib, the packets framed as a ``Trace``: what Perfetto's own
tracing service writes when it compresses, expanded in place by its trace processor and UI): about
11 bytes per span on disk instead of 35 (``bench/export_bench.py``), for about 0.3 s per
million spans.

Memory holds one rank's spans of the selected steps at a time (about 100 bytes per span while it
is encoded, in blocks of :data:`_CHUNK_SLICES` slices), never the run's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from hvtrace.errors import TraceError
from hvtrace.export.chrome import (
    GROUP_OF_KIND,
    LANE_GROUPS,
    RATIO_COUNTER,
    assign_lanes,
    check_steps,
    lane_name,
    steps_table,
)
from hvtrace.export.output import open_output
from hvtrace.format.schema import HASH_PREFIXES, KINDS, collective_keys
from hvtrace.load import RankSource, Run, align_times, span_sources
from hvtrace.selection import StepRange

log = logging.getLogger("hvtrace")

#: The file name suffix that selects this format (``hvtrace analyze -o run.pftrace``).
PFTRACE_SUFFIX = ".pftrace"

#: Perfetto's clock ids: the default trace clock, and the first sequence-scoped one (used as an
#: incremental clock: each packet's timestamp is a delta from the previous one).
CLOCK_BOOTTIME = 6
CLOCK_INCREMENTAL = 64

#: The sequence of the descriptor packets; lanes use the ids after it.
META_SEQUENCE = 1

#: Names longer than this (characters) are cut and end with an ellipsis.
MAX_NAME_CHARS = 1024

#: TrackEvent types, and TracePacket sequence flags (``perfetto_trace_pb2``'s values).
_TYPE_BEGIN, _TYPE_END, _TYPE_COUNTER = 1, 2, 4
_SEQ_CLEARED = 1

#: Field tags (field number << 3 | wire type) of the fields the bulk encoder writes.
_TAG_PACKET = 0x0A  # Trace.packet = 1, length-delimited
_TAG_TIMESTAMP = 0x40  # TracePacket.timestamp = 8, varint
_TAG_SEQ = 0x50  # TracePacket.trusted_packet_sequence_id = 10, varint
_TAG_TRACK_EVENT = 0x5A  # TracePacket.track_event = 11, length-delimited
_TAG_TYPE = 0x48  # TrackEvent.type = 9, varint
_TAG_NAME_IID = 0x50  # TrackEvent.name_iid = 10, varint
_TAG_FLOW = (0xF9, 0x02)  # TrackEvent.flow_ids = 47, fixed64
_TAG_DOUBLE = (0xE1, 0x02)  # TrackEvent.double_counter_value = 44, fixed64 (double)

_K = {k: i for i, k in enumerate(KINDS)}
_G_ALLREDUCE = LANE_GROUPS.index("allreduce")


def _pb() -> Any:
    """``perfetto_trace_pb2`` (imported on first use: only this export needs protobuf)."""
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2
    except ImportError as exc:  # pragma: no cover - a dependency of hvtrace
        raise TraceError(
            f"cannot write a .pftrace timeline: {exc} (pip install perfetto protobuf)"
        ) from None
    return perfetto_trace_pb2


def is_perfetto_path(path: str | os.PathLike) -> bool:
    """True when ``path`` names a Perfetto protobuf trace (``*.pftrace``)."""
    return str(path).lower().endswith(PFTRACE_SUFFIX)


# --------------------------------------------------------------------------------------------
# The vectorized packet encoder


_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], np.uint64)
_SHIFTS = (7 * np.arange(10)).astype(np.uint64)
_BYTE_INDEX = np.arange(10, dtype=np.int64)


def varint_sizes(values: np.ndarray) -> np.ndarray:
    """Bytes of each value as a protobuf varint (1..10), for unsigned 64-bit ``values``."""
    v = np.asarray(values, np.uint64)
    return 1 + np.searchsorted(_VARINT_LIMITS, v, side="right").astype(np.int64)


def _put_varint(
    out: np.ndarray, pos: np.ndarray, v: np.ndarray, size: np.ndarray, room: int = 0
) -> None:
    """Write varints ``v`` (uint64, ``size`` bytes each) at ``out[pos]``.

    ``room``: bytes after each varint that are written later anyway; up to that many bytes past
    a varint may be written with scratch (so most varints are written without a mask).
    """
    if not len(v):
        return
    top = int(size.max())
    width = min(top, room + 1)
    k = _BYTE_INDEX[:width]
    b = ((v[:, None] >> _SHIFTS[None, :width]) & np.uint64(0x7F)).astype(np.uint8)
    b[k[None, :] < (size[:, None] - 1)] |= 0x80
    if width == 1:
        out[pos] = b[:, 0]
    else:
        out[pos[:, None] + k[None, :]] = b
    if top > width:  # the few longer ones, whole
        long = np.flatnonzero(size > width)
        _put_varint(out, pos[long], v[long], size[long], 0)


class _Rows:
    """Builds ``n`` rows of bytes, each the concatenation of the same pieces in order.

    A piece is a constant byte string, a varint column or a fixed64 column. Rows may differ in
    length (varints); :meth:`encode` returns all rows back to back and each row's offset.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.pieces: list[tuple[str, Any, np.ndarray | int]] = []

    def const(self, data: bytes) -> None:
        self.pieces.append(("c", np.frombuffer(data, np.uint8), len(data)))

    def varint(self, v: np.ndarray | int) -> None:
        v = np.asarray(v, np.uint64)
        if v.ndim == 0:  # the same value in every row: a constant
            self.const(_varint_bytes(int(v)))
            return
        self.pieces.append(("v", v, varint_sizes(v)))

    def fixed64(self, v: np.ndarray) -> None:
        self.pieces.append(("f", np.ascontiguousarray(v).view(np.uint8).reshape(-1, 8), 8))

    def size(self) -> np.ndarray:
        """Bytes of all pieces, per row."""
        total = np.zeros(self.n, np.int64)
        for _, _, s in self.pieces:
            total += s
        return total

    def encode(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bytes, offsets)``: the rows back to back, and where each row starts (n + 1)."""
        n = self.n
        start = np.zeros(n + 1, np.int64)
        np.cumsum(self.size(), out=start[1:])
        out = np.empty(int(start[-1]), np.uint8)
        pos = start[:-1].copy()
        # bytes that follow each piece in every row (a varint counts 1): scratch room
        room = [0] * len(self.pieces)
        after = 0
        for i in range(len(self.pieces) - 1, -1, -1):
            room[i] = after
            kind, data, _ = self.pieces[i]
            after += len(data) if kind == "c" else (8 if kind == "f" else 1)
        for (kind, data, s), r in zip(self.pieces, room):
            if kind == "c":
                if len(data) == 1:
                    out[pos] = data[0]
                else:
                    out[pos[:, None] + _BYTE_INDEX[None, : len(data)]] = data[None, :]
            elif kind == "v":
                _put_varint(out, pos, data, s, r)
            else:
                out[pos[:, None] + _BYTE_INDEX[None, :8]] = data
            pos += s
        return out, start


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    v = int(value)
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _slice_rows(
    seq_id: np.ndarray | int,
    delta_begin: np.ndarray,
    delta_end: np.ndarray,
    name_iid: np.ndarray,
    flow_id: np.ndarray | None,
) -> _Rows:
    """Rows of one begin packet and one end packet each (see :func:`encode_slices`)."""
    n = len(delta_begin)
    seq = np.asarray(seq_id, np.uint64)
    seq_size = varint_sizes(seq) if seq.ndim else len(_varint_bytes(int(seq)))
    iid = np.asarray(name_iid, np.uint64)
    # begin: TrackEvent{type, name_iid[, flow_ids]} inside TracePacket{timestamp, seq, event}
    te_len = 2 + 1 + varint_sizes(iid) + (10 if flow_id is not None else 0)
    body_len = 1 + varint_sizes(delta_begin) + 1 + seq_size + 1 + 1 + te_len
    d_end = np.asarray(delta_end, np.uint64)
    end_len = 1 + varint_sizes(d_end) + 1 + seq_size + 1 + 1 + 2
    if int(np.max(body_len, initial=0)) >= 128:  # pragma: no cover - at most ~45 bytes
        raise AssertionError("slice packet longer than 127 bytes")
    rows = _Rows(n)
    rows.const(bytes([_TAG_PACKET]))
    rows.varint(body_len)
    rows.const(bytes([_TAG_TIMESTAMP]))
    rows.varint(delta_begin)
    rows.const(bytes([_TAG_SEQ]))
    rows.varint(seq)
    rows.const(bytes([_TAG_TRACK_EVENT]))
    rows.varint(te_len)
    rows.const(bytes([_TAG_TYPE, _TYPE_BEGIN, _TAG_NAME_IID]))
    rows.varint(iid)
    if flow_id is not None:
        rows.const(bytes(_TAG_FLOW))
        rows.fixed64(np.asarray(flow_id, np.uint64))
    rows.const(bytes([_TAG_PACKET]))
    rows.varint(end_len)
    rows.const(bytes([_TAG_TIMESTAMP]))
    rows.varint(d_end)
    rows.const(bytes([_TAG_SEQ]))
    rows.varint(seq)
    rows.const(bytes([_TAG_TRACK_EVENT, 2, _TAG_TYPE, _TYPE_END]))
    return rows


def _counter_rows(seq_id: np.ndarray | int, delta: np.ndarray, values: np.ndarray) -> _Rows:
    """Rows of one counter packet each (see :func:`encode_counters`)."""
    seq = np.asarray(seq_id, np.uint64)
    seq_size = varint_sizes(seq) if seq.ndim else len(_varint_bytes(int(seq)))
    d = np.asarray(delta, np.uint64)
    rows = _Rows(len(d))
    rows.const(bytes([_TAG_PACKET]))
    rows.varint(1 + varint_sizes(d) + 1 + seq_size + 2 + 12)
    rows.const(bytes([_TAG_TIMESTAMP]))
    rows.varint(d)
    rows.const(bytes([_TAG_SEQ]))
    rows.varint(seq)
    rows.const(bytes([_TAG_TRACK_EVENT, 12, _TAG_TYPE, _TYPE_COUNTER, *_TAG_DOUBLE]))
    rows.fixed64(np.asarray(values, np.float64).view(np.uint64))
    return rows


def _lane_deltas(ts: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per-sequence deltas of ``ts`` (sequences start where ``first`` is True, from 0); >= 0."""
    d = np.empty(len(ts), np.int64)
    if len(ts):
        d[0] = ts[0]
        np.subtract(ts[1:], ts[:-1], out=d[1:])
        d[first] = ts[first]
        if int(d.min()) < 0:
            raise ValueError("timestamps of one packet sequence must not decrease")
    return d.astype(np.uint64)


def encode_slices(
    seq_id: int,
    begin_ns: np.ndarray,
    end_ns: np.ndarray,
    name_iid: np.ndarray,
    flow_id: np.ndarray | None = None,
) -> np.ndarray:
    """Encode slices as ``Trace.packet`` entries: per slice a begin and an end packet.

    Each packet is ``TracePacket{timestamp: delta, trusted_packet_sequence_id: seq_id,
    track_event: {type, name_iid (begin), flow_ids (begin, when flow_id is given)}}``; the
    timestamps are deltas on the sequence's incremental clock (the first from 0, as after
    :func:`sequence_start`), the track is the sequence's default. Slices must be sorted and must
    not overlap (``begin_ns[i+1] >= end_ns[i] >= begin_ns[i] >= 0``). Returns the bytes as a
    uint8 array: exactly what protobuf serializes for a ``Trace`` holding those packets.
    """
    b = np.asarray(begin_ns, np.int64)
    ts = np.empty(2 * len(b), np.int64)
    ts[0::2], ts[1::2] = b, np.asarray(end_ns, np.int64)
    first = np.zeros(len(ts), bool)
    first[:1] = True
    d = _lane_deltas(ts, first)
    return _slice_rows(seq_id, d[0::2], d[1::2], name_iid, flow_id).encode()[0]


def encode_counters(seq_id: int, ts_ns: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Encode counter values as ``Trace.packet`` entries on the sequence's default track:
    ``TracePacket{timestamp: delta, trusted_packet_sequence_id, track_event: {type: COUNTER,
    double_counter_value}}`` (``ts_ns`` sorted, >= 0; deltas as in :func:`encode_slices`)."""
    ts = np.asarray(ts_ns, np.int64)
    first = np.zeros(len(ts), bool)
    first[:1] = True
    return _counter_rows(seq_id, _lane_deltas(ts, first), values).encode()[0]


# --------------------------------------------------------------------------------------------
# Packets built with protobuf


def _packet_bytes(packet: Any) -> bytes:
    """One ``Trace.packet`` entry (field 1, length-delimited) holding ``packet``."""
    body = packet.SerializeToString()
    return bytes([_TAG_PACKET]) + _varint_bytes(len(body)) + body


def _safe_name(name: str) -> str:
    """``name`` as carried in the trace: valid UTF-8 text, at most :data:`MAX_NAME_CHARS`."""
    text = str(name).encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_NAME_CHARS:
        text = text[: MAX_NAME_CHARS - 1] + "…"
    return text


def sequence_start(seq_id: int, track_uuid: int, names: Sequence[tuple[int, str]] = ()) -> bytes:
    """The first packets of a lane's sequence: clear its incremental state, make ``track_uuid``
    the default track and :data:`CLOCK_INCREMENTAL` (delta timestamps, starting at 0 = trace
    time 0) the default clock, and intern ``names`` (``(iid, name)`` pairs) as event names."""
    pb = _pb()
    p = pb.TracePacket()
    p.trusted_packet_sequence_id = seq_id
    p.sequence_flags = _SEQ_CLEARED
    p.timestamp = 0
    p.timestamp_clock_id = CLOCK_BOOTTIME
    d = p.trace_packet_defaults
    d.timestamp_clock_id = CLOCK_INCREMENTAL
    d.track_event_defaults.track_uuid = track_uuid
    c = p.clock_snapshot.clocks.add()
    c.clock_id, c.timestamp = CLOCK_BOOTTIME, 0
    c = p.clock_snapshot.clocks.add()
    c.clock_id, c.timestamp, c.is_incremental = CLOCK_INCREMENTAL, 0, True
    out = _packet_bytes(p)
    if names:
        q = pb.TracePacket()
        q.trusted_packet_sequence_id = seq_id
        for iid, name in names:
            en = q.interned_data.event_names.add()
            en.iid, en.name = iid, _safe_name(name)
        out += _packet_bytes(q)
    return out


def track_descriptor(
    uuid: int,
    name: str,
    parent_uuid: int | None = None,
    order: int | None = None,
    description: str = "",
    counter: bool = False,
    explicit_children: bool = False,
) -> bytes:
    """A ``TrackDescriptor`` packet (on :data:`META_SEQUENCE`)."""
    pb = _pb()
    p = pb.TracePacket()
    p.trusted_packet_sequence_id = META_SEQUENCE
    t = p.track_descriptor
    t.uuid = uuid
    t.name = _safe_name(name)
    if parent_uuid is not None:
        t.parent_uuid = parent_uuid
    if order is not None:
        t.sibling_order_rank = int(order)
    if description:
        t.description = _safe_name(description)
    if counter:
        t.counter.SetInParent()
    if explicit_children:
        t.child_ordering = pb.TrackDescriptor.ChildTracksOrdering.EXPLICIT
    return _packet_bytes(p)


# --------------------------------------------------------------------------------------------
# Reading one rank


def _rank_table(con: Any, src: RankSource, steps: StepRange | None) -> pa.Table:
    """One rank's spans of ``steps`` (kind ``clock`` left out): step, kind, name, start_ns,
    end_ns, value, read by DuckDB (a Parquet file: only the row groups ``steps`` meets)."""
    cols = "step, kind, name, start_ns, end_ns, value"
    where = "kind <> 'clock'" + (f" AND {steps.sql('step')}" if steps is not None else "")
    if src.parquet is not None:
        return con.sql(
            f"SELECT {cols} FROM read_parquet($file) WHERE {where}",
            params={"file": str(src.parquet)},
        ).to_arrow_table()
    con.register("hv_rank_spans", src.table)
    try:
        return con.sql(f"SELECT {cols} FROM hv_rank_spans WHERE {where}").to_arrow_table()
    finally:
        con.unregister("hv_rank_spans")


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes and values of a string column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    codes = arr.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, [str(v) for v in arr.dictionary.to_pylist()]


# --------------------------------------------------------------------------------------------
# Writing


@dataclass
class PerfettoResult:
    """What :func:`write_perfetto_trace` wrote."""

    path: Path
    slices: int = 0
    counters: int = 0
    flows: int = 0
    bytes: int = 0  # the file's size
    raw_bytes: int = 0  # the packets' size before compression
    ranks: int = 0


#: Packets are deflated in blocks of about this many bytes (``TracePacket.compressed_packets``).
COMPRESS_BLOCK_BYTES = 4 << 20
#: zlib level of the blocks: 1 is ~4x smaller at ~200 MB/s; higher levels gain little here.
COMPRESS_LEVEL = 1
_TAG_COMPRESSED = b"\x92\x03"  # TracePacket.compressed_packets = 50, length-delimited


class _Writer:
    """Writes one rank after another; keeps the name codes that make flow ids global.

    With ``compress``, whole packets are gathered into blocks of about
    :data:`COMPRESS_BLOCK_BYTES`, each written as one ``TracePacket{compressed_packets}``: the
    zlib stream of those packets framed as a ``Trace``, which Perfetto's trace processor expands
    in place (what Perfetto's own tracing service writes with deflate compression). Every
    ``write`` must hold whole packets; :meth:`close` writes the last block."""

    def __init__(self, f: BinaryIO, compress: bool = True) -> None:
        self.f = f
        self.compress = compress
        self.n_bytes = 0  # written to the file
        self.raw_bytes = 0  # the packets, before compression
        self.next_uuid = 1
        self.tensor_code: dict[str, int] = {}
        self.clamped = 0
        self._block: list[bytes] = []
        self._block_bytes = 0

    def write(self, data: bytes | np.ndarray) -> None:
        buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        self.raw_bytes += len(buf)
        if not self.compress:
            self._emit(buf)
            return
        self._block.append(buf)
        self._block_bytes += len(buf)
        if self._block_bytes >= COMPRESS_BLOCK_BYTES:
            self._flush_block()

    def close(self) -> None:
        """Write the last block."""
        if self._block:
            self._flush_block()

    def _flush_block(self) -> None:
        import zlib

        packed = zlib.compress(b"".join(self._block), COMPRESS_LEVEL)
        self._block, self._block_bytes = [], 0
        packet = _TAG_COMPRESSED + _varint_bytes(len(packed)) + packed
        self._emit(bytes([_TAG_PACKET]) + _varint_bytes(len(packet)) + packet)

    def _emit(self, buf: bytes) -> None:
        self.f.write(buf)
        self.n_bytes += len(buf)

    def uuid(self) -> int:
        u = self.next_uuid
        self.next_uuid += 1
        return u

    def flow_ids(self, step: np.ndarray, names: list[str], code: np.ndarray) -> np.ndarray:
        """One id per (step, tensor) collective, the same on every rank: the format's
        :func:`~hvtrace.format.schema.collective_keys` of a tensor code kept across ranks
        (never 0: Perfetto's flow ids start at 1)."""
        table = np.array(
            [self.tensor_code.setdefault(n, len(self.tensor_code) + 1) for n in names] or [0],
            np.int64,
        )
        return collective_keys(step, table[code]).view(np.uint64)


def write_perfetto_trace(
    run: Run,
    out_path: str | os.PathLike,
    steps: StepRange | tuple[int, int | None] | None = None,
    steps_df: pd.DataFrame | None = None,
    inputs: Iterable[str | os.PathLike] = (),
    progress: Callable[[int, int], None] | None = None,
    horovod: pd.DataFrame | None = None,
) -> PerfettoResult:
    """Write the merged timeline of ``run`` as one Perfetto protobuf trace; see the module doc.

    ``horovod``: Horovod's own timeline on rank 0's clock
    (:func:`hvtrace.analysis.hvd_timeline.aligned_activities`), drawn under rank 0 as one track
    per tensor (negotiation and operation) with a child track of the operation's parts.

    ``run``: an opened run (:func:`hvtrace.load.open_run`, which already applied ``--ranks``);
    its spans are read rank by rank through DuckDB, never all at once. ``steps`` keeps those
    steps only (a :class:`~hvtrace.selection.StepRange` or ``(first, stop)``). ``steps_df``: the
    analysis's per-step table (:attr:`hvtrace.analysis.Analysis.steps`; columns ``rank``,
    ``step``, ``start_ns``, ``comm_compute_ratio``) drawn as the ``comm/compute`` counters
    (None: no ratio counters). The file is written as :func:`hvtrace.export.output.open_output`
    writes (a temporary file renamed when complete; never over one of ``inputs``).
    ``progress(done, total)`` is called after each rank. Raises
    :class:`~hvtrace.errors.TraceError` when there is nothing to export.
    """
    import duckdb

    sel = check_steps(steps)
    sources = span_sources(run, sel)
    ratio = _ratio_rows(steps_df, sel, run.ranks)
    out = Path(out_path)
    hosts = {r: str(h) for r, h in run.hosts.items()}
    result = PerfettoResult(out, ranks=len(sources))
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET threads = 2")
        con.execute("SET preserve_insertion_order = false")
        with open_output(out, inputs) as f:
            w = _Writer(f)
            rank_uuid = _write_tree(w, run, hosts)
            for i, src in enumerate(sources):
                rank = int(src.rank if src.rank is not None else 0)
                try:
                    table = _rank_table(con, src, sel)
                except duckdb.Error as exc:
                    where = src.parquet or f"rank {rank}"
                    msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                    raise TraceError(f"{where}: cannot read the spans ({msg})") from None
                _write_rank(w, rank_uuid[rank], src, table, ratio.get(rank), result)
                del table
                if progress is not None:
                    progress(i + 1, len(sources))
            if horovod is not None and len(horovod) and 0 in rank_uuid:
                _write_horovod(w, rank_uuid[0], horovod, result)
            if result.slices + result.counters == 0:
                what = f"in steps {sel.label()}" if sel is not None else "in the run"
                raise TraceError(f"nothing to export: no spans {what}")
            w.close()
            result.bytes, result.raw_bytes = w.n_bytes, w.raw_bytes
            if w.clamped:
                log.warning(
                    "%d span end(s) before time 0 on rank 0's clock were drawn at 0", w.clamped
                )
    finally:
        con.close()
    return result


def _ratio_rows(
    steps_df: pd.DataFrame | None, steps: StepRange | None, ranks: Sequence[int]
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per rank, the comm/compute counter points ``(start_ns, ratio)`` of the analysis."""
    if steps_df is None or steps_df.empty:
        return {}
    t = steps_table(steps_df)
    t = t[np.isfinite(t["comm_compute_ratio"].to_numpy(np.float64))]
    if steps is not None:
        t = t[steps.mask(t["step"].to_numpy(np.int64))]
    t = t[t["rank"].isin(list(ranks))]
    out = {}
    for r, g in t.groupby("rank", sort=True):
        g = g.sort_values("start_ns", kind="stable")
        out[int(r)] = (
            np.maximum(g["start_ns"].to_numpy(np.int64), 0),
            g["comm_compute_ratio"].to_numpy(np.float64),
        )
    return out


def _write_horovod(w: _Writer, parent: int, acts: pd.DataFrame, result: PerfettoResult) -> None:
    """Horovod's timeline under rank 0, laid out by
    :func:`hvtrace.analysis.hvd_timeline.horovod_tracks`: per tensor a track
    ``horovod <tensor>`` and its child ``parts``."""
    from hvtrace.analysis.hvd_timeline import horovod_tracks

    t = horovod_tracks(acts)
    seq = META_SEQUENCE + 1
    activity = np.asarray(t.activity, object)
    bounds = np.flatnonzero(np.diff(t.tensor_idx * 2 + t.depth)) + 1
    tensor_uuid: dict[int, int] = {}
    for a, b in zip(np.concatenate([[0], bounds]).tolist(), np.append(bounds, len(t)).tolist()):
        if a == b:
            continue
        i, depth = int(t.tensor_idx[a]), int(t.depth[a])
        if i not in tensor_uuid:
            tensor_uuid[i] = w.uuid()
            w.write(track_descriptor(tensor_uuid[i], f"horovod {t.tensors[i]}", parent,
                                     order=1_000_000 + i, explicit_children=True))  # fmt: skip
        uuid = tensor_uuid[i]
        if depth:
            uuid = w.uuid()
            w.write(track_descriptor(uuid, "parts", tensor_uuid[i], order=0))
        labels = activity[a:b]
        names = sorted(set(labels))
        iid = {n: k + 1 for k, n in enumerate(names)}
        w.write(sequence_start(seq, uuid, [(iid[n], n) for n in names]))
        codes = np.array([iid[n] for n in labels], np.int64)
        w.write(encode_slices(seq, t.start_ns[a:b], t.end_ns[a:b], codes))
        result.slices += b - a


def _write_tree(w: _Writer, run: Run, hosts: dict[int, str]) -> dict[int, int]:
    """Host and rank tracks for every rank of the run; returns rank -> track uuid."""
    by_host: dict[str, list[int]] = {}
    for r in run.ranks:
        by_host.setdefault(hosts.get(r, "?"), []).append(r)
    order = sorted(by_host, key=lambda h: min(by_host[h]))
    rank_uuid: dict[int, int] = {}
    for hi, host in enumerate(order):
        hu = w.uuid()
        w.write(track_descriptor(hu, host, order=hi, explicit_children=True))
        for r in by_host[host]:
            ru = w.uuid()
            rank_uuid[r] = ru
            h = run.files[r].header if r in run.files else {}
            desc = ", ".join(
                f"{k} {h[k]}"
                for k in ("host", "device", "pid", "local_rank")
                if h.get(k) is not None
            )
            w.write(
                track_descriptor(ru, f"rank {r}", hu, order=r, description=desc,
                                 explicit_children=True)
            )  # fmt: skip
    return rank_uuid


#: Slices encoded at a time (bounds the encoder's temporary arrays, about 100 bytes a slice).
_CHUNK_SLICES = 1 << 18


def _write_rank(
    w: _Writer,
    rank_uuid: int,
    src: RankSource,
    table: pa.Table,
    ratio: tuple[np.ndarray, np.ndarray] | None,
    result: PerfettoResult,
) -> None:
    """Lanes, slices, flows and counters of one rank."""
    kind_code, kind_names = _codes(table.column("kind"))
    kmap = np.array([_K.get(k, -1) for k in kind_names] or [-1], np.int64)
    kind = kmap[kind_code]
    name_code, names = _codes(table.column("name"))
    step = table.column("step").to_numpy().astype(np.int64)
    start, end = align_times(
        src.clock,
        step,
        table.column("start_ns").to_numpy().astype(np.int64),
        table.column("end_ns").to_numpy().astype(np.int64),
        table.column("kind"),
    )
    end = np.maximum(end, start)
    if len(end) and int(start.min()) < 0:
        w.clamped += int((start < 0).sum())
        start, end = np.maximum(start, 0), np.maximum(end, 0)

    # ---- slices: lanes as the Chrome export assigns them, each lane sorted by time
    group = np.where(kind >= 0, GROUP_OF_KIND[np.maximum(kind, 0)], -1)
    xs = np.flatnonzero(group >= 0)
    lanes = assign_lanes(group[xs], start[xs], end[xs])
    key = group[xs] * (1 << 32) + lanes
    o = np.lexsort((end[xs], start[xs], key))
    xs, key = xs[o], key[o]
    del o, lanes
    lane_key, lane_lo = np.unique(key, return_index=True)
    n_lanes = len(lane_key)
    lane_hi = np.append(lane_lo[1:], len(xs))
    lane_of = np.repeat(np.arange(n_lanes), lane_hi - lane_lo)
    nc = name_code[xs]
    # iids: the rank's names, most frequent first (1 byte each for the first 127)
    counts = np.bincount(nc, minlength=len(names))
    iid_of = np.empty(len(names), np.int64)
    iid_of[np.argsort(-counts, kind="stable")] = np.arange(1, len(names) + 1)
    pairs = np.unique(lane_of * max(len(names), 1) + nc)
    lane_names: list[list[tuple[int, str]]] = [[] for _ in range(n_lanes)]
    for lane, c in zip(
        (pairs // max(len(names), 1)).tolist(), (pairs % max(len(names), 1)).tolist()
    ):
        lane_names[lane].append((int(iid_of[c]), names[c]))
    # counters: the analysis's comm/compute ratio, then each scalar
    counters: list[tuple[str, np.ndarray, np.ndarray]] = []
    if ratio is not None and len(ratio[0]):
        counters.append((RATIO_COUNTER, *ratio))
    is_scalar = np.flatnonzero(kind == _K["scalar"])
    if len(is_scalar):
        value = table.column("value").to_numpy(zero_copy_only=False).astype(np.float64)
        is_scalar = is_scalar[np.isfinite(value[is_scalar])]
        sc = name_code[is_scalar]
        for c in np.unique(sc):
            if names[int(c)].startswith(HASH_PREFIXES):
                continue  # a parameter or batch fingerprint (a hash): nothing to draw
            idx = is_scalar[sc == c]
            idx = idx[np.argsort(start[idx], kind="stable")]
            counters.append((names[int(c)], start[idx], value[idx]))

    # ---- descriptors of the rank's tracks, then each lane's sequence
    lane_uuid = []
    for i, k in enumerate(lane_key.tolist()):
        g, lane = divmod(k, 1 << 32)
        lane_uuid.append(w.uuid())
        w.write(track_descriptor(lane_uuid[-1], lane_name(g, lane), rank_uuid, order=i))
    counter_uuid = []
    for i, (name, _, _) in enumerate(counters):
        counter_uuid.append(w.uuid())
        w.write(track_descriptor(counter_uuid[-1], name, rank_uuid, order=n_lanes + i,
                                 counter=True))  # fmt: skip
    lane_seq = META_SEQUENCE + 1 + np.arange(n_lanes, dtype=np.int64)

    ts = np.empty(2 * len(xs), np.int64)
    ts[0::2], ts[1::2] = start[xs], end[xs]
    first = np.zeros(len(ts), bool)
    first[2 * lane_lo] = True
    delta = _lane_deltas(ts, first)
    del ts, first
    n_ar = int(np.searchsorted(lane_key, _G_ALLREDUCE << 32))  # allreduce lanes come last
    iid = iid_of[nc]
    flow = None
    if n_ar < n_lanes:
        a0 = int(lane_lo[n_ar])
        flow = w.flow_ids(step[xs[a0:]], names, nc[a0:])
        result.flows += len(flow)
    else:
        a0 = len(xs)
    for lo, hi in ((0, a0), (a0, len(xs))):
        for c0 in range(lo, hi, _CHUNK_SLICES):
            c1 = min(c0 + _CHUNK_SLICES, hi)
            rows = _slice_rows(
                lane_seq[lane_of[c0:c1]],
                delta[2 * c0 : 2 * c1 : 2],
                delta[2 * c0 + 1 : 2 * c1 : 2],
                iid[c0:c1],
                flow[c0 - a0 : c1 - a0] if lo == a0 and flow is not None else None,
            )
            data, offs = rows.encode()
            at = 0
            for lane in np.flatnonzero((lane_lo >= c0) & (lane_lo < c1)).tolist():
                cut = int(offs[int(lane_lo[lane]) - c0])
                w.write(data[at:cut])
                w.write(sequence_start(int(lane_seq[lane]), lane_uuid[lane], lane_names[lane]))
                at = cut
            w.write(data[at:])
    result.slices += len(xs)

    for i, (_, cts, values) in enumerate(counters):
        seq = META_SEQUENCE + 1 + n_lanes + i
        w.write(sequence_start(seq, counter_uuid[i]))
        w.write(encode_counters(seq, cts, values))
        result.counters += len(cts)
