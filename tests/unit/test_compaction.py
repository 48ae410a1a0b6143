"""A cleanly closed trace file is rewritten in large batches; a crashed one is left as written."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import make_header

from hvtrace.clock import ClockEstimate
from hvtrace.load import read_rank_file
from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import compact
from hvtrace.schema import KIND_CODE


def _batches(path: Path) -> int:
    with pa.memory_map(str(path)) as src:
        return sum(1 for _ in pa.ipc.open_stream(src))


def _record(tmp_path: Path, n: int) -> Recorder:
    rec = Recorder(tmp_path, make_header(), flush_interval_s=0.005)
    for i in range(n):
        rec.add(KIND_CODE["allreduce"], f"t{i % 37}", 10 * i, 10 * i + 7, nbytes=i)
        if i % 500 == 0:
            time.sleep(0.02)  # let the writer flush many small batches
    rec.add_clock(ClockEstimate(at_ns=123, offset_ns=-45, uncertainty_ns=6, rounds=8))
    rec.dropped = 3
    time.sleep(0.05)
    return rec


def test_closed_file_is_compacted_with_everything_kept(tmp_path: Path) -> None:
    rec = _record(tmp_path, 5000)
    rec.flush()
    before = read_rank_file(rec.path)
    small_batches = _batches(rec.path)
    assert small_batches > 5
    rec.close()
    after = read_rank_file(rec.path)
    assert _batches(rec.path) == 1 < small_batches
    assert after.complete and not after.truncated
    assert after.table.to_pandas().equals(read_rank_file(rec.path).table.to_pandas())
    df = after.table.to_pandas()
    assert len(df) == 5000
    assert df["name"].astype(str).tolist() == [f"t{i % 37}" for i in range(5000)]
    assert df["bytes"].tolist() == list(range(5000))
    assert after.dropped == 3 and before.spans == 5000
    assert after.clock[-1].offset_ns == -45
    assert [c.to_dict() for c in after.clock] == [c.to_dict() for c in before.clock]
    assert after.header == before.header
    assert not list(tmp_path.glob("*.compact"))
    # the writer's own CPU time is reported, grows with the flushes, and survives compaction
    assert 0 < before.writer_cpu_s <= after.writer_cpu_s < 10


#: Magic numbers that open each compressed buffer's frame in an Arrow IPC body.
LZ4_FRAME_MAGIC = bytes.fromhex("04224d18")
ZSTD_FRAME_MAGIC = bytes.fromhex("28b52ffd")


def _codecs(data: bytes) -> set[str]:
    found = {"LZ4_FRAME": data.count(LZ4_FRAME_MAGIC), "ZSTD": data.count(ZSTD_FRAME_MAGIC)}
    return {k for k, n in found.items() if n >= 5}


def test_live_batches_use_lz4_and_the_compacted_file_zstd(tmp_path: Path) -> None:
    import pyarrow.ipc as ipc

    if not (pa.Codec.is_available("lz4") and pa.Codec.is_available("zstd")):
        pytest.skip("this pyarrow lacks lz4 or zstd")
    rec = _record(tmp_path, 2000)
    rec.flush()
    live = rec.path.read_bytes()
    rec.close()
    done = rec.path.read_bytes()
    # the IPC message metadata names the codec of each compressed batch (CompressionType enum)
    assert _codecs(live) == {"LZ4_FRAME"} and _codecs(done) == {"ZSTD"}
    assert ipc.open_stream(done).read_all().num_rows == 2000


def test_compaction_respects_the_batch_size(tmp_path: Path) -> None:
    rec = _record(tmp_path, 3000)
    rec.writer.compact_on_close = False
    rec.close()
    assert compact(rec.path, rows_per_batch=1000) >= 3
    f = read_rank_file(rec.path)
    assert f.spans == 3000 and f.complete


def test_unclosed_file_is_not_compacted(tmp_path: Path) -> None:
    rec = _record(tmp_path, 2000)
    rec.flush()
    n = _batches(rec.path)
    rec.writer = None  # as after a crash: nothing closes the file
    assert _batches(rec.path) == n and n > 1
    f = read_rank_file(rec.path)
    assert f.spans == 2000 and not f.complete
