"""Following a run while it is written (hvtrace.follow): each byte read once, in any pieces."""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from helpers import make_header, row, status, write_rank_file

from hvtrace.errors import TraceError
from hvtrace.follow import STALE_S, RunFollower, StreamTail
from hvtrace.format.read import StreamScan, read_rank_file

RUN = "20240101-000000-abcdef"


def _step_rows(step: int, rank: int, names: int) -> list[tuple]:
    """One step of one rank: step, forward, backward, an allreduce per name (new names each
    step, so the stream carries dictionary deltas), wait."""
    t = 10**9 + step * 10_000_000 + rank * 100_000
    rows = [
        row("forward", "forward", t, t + 2_000_000, step),
        row("backward", "backward", t + 2_000_000, t + 5_000_000, step),
    ]
    for k in range(names):
        rows.append(
            row("allreduce", f"grad.{step}.{k}", t + 3_000_000, t + 6_000_000, step, nbytes=4096,
                dtype="float32")
        )  # fmt: skip
    rows += [
        row("wait", "synchronize", t + 5_000_000, t + 7_000_000, step),
        row("step", "step", t, t + 8_000_000, step),
    ]
    return rows


def _write_run(d: Path, ranks: int, steps: int, close: bool) -> list[Path]:
    paths = []
    d.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        p = d / f"rank{r:05d}-{RUN}.arrows"
        batches = [_step_rows(s, r, names=3) for s in range(steps)]
        sts = [status(final=close and s == steps - 1, last_step=s + 1) for s in range(steps)]
        write_rank_file(p, make_header(r, ranks, RUN), batches, sts, close=close)
        paths.append(p)
    return paths


def test_a_stream_grown_in_any_pieces_is_read_once_and_whole(tmp_path: Path) -> None:
    (src,) = _write_run(tmp_path / "src", 1, 12, close=True)
    whole = read_rank_file(src)
    data = src.read_bytes()
    rnd = random.Random(7)
    for trial in range(5):
        dst = tmp_path / f"grow{trial}.arrows"
        dst.write_bytes(b"")
        tail = None
        at, polls = 0, 0
        while at < len(data):
            cut = min(len(data), at + rnd.choice([1, 7, 64, 500, 3000]))
            with open(dst, "ab") as f:
                f.write(data[at:cut])
            at = cut
            if tail is None:
                tail = StreamTail(dst)  # opening needs no byte of the file yet
            tail.poll()
            polls += 1
            # never more than the whole messages written so far
            assert tail.offset <= at
        tail.poll()
        got = tail.rank_file()
        assert tail.ended and tail.offset == len(data), (tail.offset, len(data))
        pd.testing.assert_frame_equal(
            got.table.to_pandas(), whole.table.to_pandas(), check_categorical=False
        )
        assert got.complete and got.last_step == whole.last_step == 12
        assert not got.truncated
        tail.close()


def test_each_poll_reads_only_the_new_bytes(tmp_path: Path, monkeypatch) -> None:
    (src,) = _write_run(tmp_path / "src", 1, 6, close=False)
    data = src.read_bytes()
    dst = tmp_path / "g.arrows"
    dst.write_bytes(data[: len(data) // 2])
    read: list[tuple[int, int]] = []
    real = os.pread

    def counting(fd: int, n: int, off: int) -> bytes:
        out = real(fd, n, off)
        read.append((off, len(out)))
        return out

    monkeypatch.setattr(os, "pread", counting)
    tail = StreamTail(dst)
    n1 = tail.poll(chunk_bytes=1000)  # in small chunks: all of it still, each byte once
    with open(dst, "ab") as f:
        f.write(data[len(data) // 2 :])
    n2 = tail.poll()
    assert tail.poll() == 0  # nothing new: nothing read
    with StreamScan(src) as scan:
        n_batches = sum(1 for _ in scan)
    assert n1 + n2 == n_batches == len(tail.batches) >= 6 and n1 < n_batches
    # every byte of the file was read exactly once, in order
    assert read[0][0] == 0 and sum(n for _, n in read) == len(data)
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(read))
    assert not tail.ended and not tail.rank_file().complete


def test_a_decompression_bomb_is_refused_while_following(tmp_path: Path) -> None:
    from hvtrace.record.writer import write_options

    (src,) = _write_run(tmp_path / "src", 1, 3, close=False)
    reader = pa.ipc.open_stream(pa.py_buffer(src.read_bytes()))
    schema, batches = reader.schema, list(reader)
    bomb = batches[-1].take(pa.array(np.zeros(3_000_000, np.int64)))
    dst = tmp_path / "b.arrows"
    with (
        pa.OSFile(str(dst), "wb") as sink,
        pa.ipc.new_stream(sink, schema, options=write_options()) as w,
    ):
        for b in [*batches, bomb]:
            w.write_batch(b)
    before = pa.total_allocated_bytes()
    tail = StreamTail(dst)
    tail.poll()
    assert pa.total_allocated_bytes() - before < 16 << 20
    rf = tail.rank_file()
    assert rf.truncated and "claims 3,000,000 rows" in rf.refused
    assert rf.spans == sum(b.num_rows for b in batches) and tail.ended


def test_a_link_is_never_followed(tmp_path: Path) -> None:
    (src,) = _write_run(tmp_path / "src", 1, 2, close=True)
    link = tmp_path / "l.arrows"
    link.symlink_to(src)
    with pytest.raises(TraceError, match=r"l\.arrows"):
        StreamTail(link)


def test_a_followed_run_is_analyzed_as_a_whole_one(tmp_path: Path) -> None:
    """Analyze a run while it grows (reusing the settled steps), then once it is whole: the same
    step table as a fresh analysis of the finished files."""
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    srcs = _write_run(tmp_path / "src", 2, 30, close=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    datas = [p.read_bytes() for p in srcs]
    dsts = [run_dir / p.name for p in srcs]
    for d in dsts:
        d.write_bytes(b"")
    f = RunFollower(run_dir)
    looks = []
    for frac in (0.3, 0.55, 0.8, 1.0):
        for d, data in zip(dsts, datas, strict=True):
            with open(d, "ab") as out:
                out.write(data[os.path.getsize(d) : int(len(data) * frac)])
        look = f.look()
        assert look.live == (frac < 1.0), frac  # closed streams: not live any more
        a = f.analyze(look)
        looks.append((look, a))
    assert [lk.problems for lk, _ in looks] == [[]] * 4  # a growing stream is no problem
    assert looks[-1][0].new_bytes < sum(len(d) for d in datas)  # only the last part was read
    fresh = analyze(open_run(run_dir))
    a = looks[-1][1]
    cols = list(fresh.steps.columns)
    got = a.steps.sort_values(["rank", "step"]).reset_index(drop=True)[cols]
    want = fresh.steps.sort_values(["rank", "step"]).reset_index(drop=True)[cols]
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    assert a.read["spans"] < fresh.read["spans"]  # the settled steps were not read again


def test_a_stream_nobody_writes_any_more_is_reported_as_cut(tmp_path: Path) -> None:
    (src,) = _write_run(tmp_path / "src", 1, 5, close=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dst = run_dir / src.name
    data = src.read_bytes()
    dst.write_bytes(data[:-10])  # a crash inside the last batch
    f = RunFollower(run_dir)
    look = f.look()
    assert look.live and look.problems == []
    old = time.time() - STALE_S - 5
    os.utime(dst, (old, old))
    look = f.look()
    assert not look.live and look.open_streams == 1 and look.quiet_s > STALE_S
    kept = look.run.files[0].spans  # the whole batches before the cut
    assert kept > 0 and f"truncated after {kept} spans" in look.problems[0], look.problems
    assert dst.name in look.problems[0] and look.problems == look.run.problems
    # ... and the analysis (what the report and the dashboard show) says so too
    a = f.analyze(look)
    assert any("truncated after" in p for p in a.problems)


def test_a_message_claiming_a_huge_length_is_refused_not_waited_for(tmp_path: Path) -> None:
    (src,) = _write_run(tmp_path / "src", 1, 2, close=False)
    data = src.read_bytes()
    dst = tmp_path / "h.arrows"
    # whole batches, then a message whose metadata claims 2 GiB - 1
    dst.write_bytes(data + b"\xff\xff\xff\xff" + (2**31 - 1).to_bytes(4, "little") + b"x" * 64)
    tail = StreamTail(dst)
    tail.poll()
    rf = tail.rank_file()
    assert tail.ended and rf.truncated and "2,147,483,647 bytes of metadata" in rf.refused
    assert rf.spans == read_rank_file(src).spans  # what came before is kept
    assert len(tail._pending) <= 72  # nothing more is buffered for it
