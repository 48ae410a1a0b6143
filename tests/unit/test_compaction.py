"""A cleanly closed trace stream becomes a Parquet file; a crashed one stays a stream until
``hvtrace compact``, and stays marked as crashed after it."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from analysis_frames import synth_spans
from helpers import make_header, row, status, write_rank_file

from hvtrace.cli import main as cli_main
from hvtrace.clock import ClockEstimate
from hvtrace.format.compact import compact, compact_run
from hvtrace.format.read import read_rank_file
from hvtrace.format.schema import (
    BATCH_STATUS_KEY,
    COLUMNS,
    FILE_SCHEMA,
    HEADER_KEY,
    KIND_CODE,
    PARQUET_ROW_GROUP_ROWS,
)
from hvtrace.load import TraceError, load_run, open_run
from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import TraceFile
from hvtrace.selection import StepRange

RUN = "20240101-000000-abcdef"


def _batches(path: Path) -> int:
    with pa.memory_map(str(path)) as src:
        return sum(1 for _ in pa.ipc.open_stream(src))


def _record(tmp_path: Path, n: int, steps: int = 50) -> Recorder:
    """Record ``n`` allreduce spans over ``steps`` steps, in many small batches; within a step
    the spans are added out of start-time order (as a real rank adds them: at completion)."""
    rec = Recorder(tmp_path, make_header(), flush_interval_s=0.005)
    per = max(1, n // steps)
    for i in range(n):
        step, k = divmod(i, per)
        start = 1_000_000 * step + 10 * ((k * 7919) % per)  # a permutation within the step
        rec.add(KIND_CODE["allreduce"], f"t{i % 37}", start, start + 7, nbytes=i, step=step)
        if i % 500 == 0:
            time.sleep(0.02)  # let the writer flush many small batches
    rec.add_clock(ClockEstimate(at_ns=123, offset_ns=-45, uncertainty_ns=6, rounds=8))
    rec.dropped = 3
    time.sleep(0.05)
    return rec


def _sorted_rows(table: pa.Table) -> dict[str, list]:
    """Columns as Python lists (dictionaries decoded), rows sorted stably by (step, start_ns)."""
    idx = pc.sort_indices(table, sort_keys=[("step", "ascending"), ("start_ns", "ascending")])
    return _rows(table.take(idx))


def _rows(t: pa.Table) -> dict[str, list]:
    """Columns as Python lists (dictionaries decoded; NaN as "nan", so that NaN == NaN)."""
    out = {c: t.column(c).to_pylist() for c in COLUMNS}
    out["value"] = ["nan" if math.isnan(v) else v for v in out["value"]]
    return out


def _raw_header(path: Path) -> bytes:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).schema.metadata[HEADER_KEY]


def _status(path: Path) -> dict:
    return json.loads(pq.ParquetFile(path).metadata.metadata[BATCH_STATUS_KEY])


def _stream_copy(rec_path: Path, tmp_path: Path) -> Path:
    """A copy of the live stream (as it is before close), kept for comparison."""
    keep = tmp_path / "copy"
    keep.mkdir(exist_ok=True)
    return Path(shutil.copy(rec_path, keep / rec_path.name))


# -- compaction at close ---------------------------------------------------------------------
def test_closed_file_becomes_parquet_with_everything_kept(tmp_path: Path) -> None:
    rec = _record(tmp_path, 5000)
    rec.flush()
    stream = _stream_copy(rec.path, tmp_path)
    before = read_rank_file(stream)
    assert _batches(stream) > 5
    rec.close()
    parquet = rec.path.with_suffix(".parquet")
    # only the Parquet file is left: no stream, no temporary file
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [parquet.name]
    after = read_rank_file(parquet)
    assert after.format == "parquet" and before.format == "arrows"
    assert after.complete and not after.truncated
    assert after.n_spans == after.spans == 5000 == before.spans
    assert after.table.schema.equals(FILE_SCHEMA, check_metadata=False)
    assert after.table.column_names == list(COLUMNS)
    # the same spans, every column, sorted by (step, start_ns) (the stream was not)
    assert _sorted_rows(after.table) == _sorted_rows(before.table)
    assert _rows(after.table) == _sorted_rows(before.table)
    assert before.table.column("start_ns").to_pylist() != sorted(
        before.table.column("start_ns").to_pylist()
    )
    # header exactly as in the stream; merged status kept
    md = pq.ParquetFile(parquet).metadata.metadata
    assert md[HEADER_KEY] == _raw_header(stream)
    assert after.header == before.header
    assert after.dropped == 3
    assert after.clock[-1].offset_ns == -45
    assert [c.to_dict() for c in after.clock] == [c.to_dict() for c in before.clock]
    # the writer's own CPU time is reported, grows with the flushes, and survives compaction
    assert 0 < before.writer_cpu_s <= after.writer_cpu_s < 10
    st = _status(parquet)
    assert st["final"] is True and st["truncated"] is False and st["spans"] == 5000


def test_merged_status_of_many_batches(tmp_path: Path) -> None:
    path = tmp_path / f"rank00000-{RUN}.arrows"
    c = [{"at_ns": i, "offset_ns": -i, "uncertainty_ns": 5, "rounds": 8} for i in range(4)]
    batches = [[row("step", "step", 10 * i, 10 * i + 5, step=i)] for i in range(4)]
    statuses = [
        {**status(dropped=2, last_step=0, clock=c[:2]), "writer_cpu_s": 0.5, "spans": 1},
        {**status(dropped=7, last_step=3, clock=[]), "writer_cpu_s": 0.75, "spans": 2},
        {**status(dropped=5, last_step=2, clock=c[2:3]), "writer_cpu_s": 0.25, "spans": 3},
        {**status(final=True, dropped=7, last_step=3, clock=c[3:]), "writer_cpu_s": 1.0},
    ]
    write_rank_file(path, make_header(0, 1, RUN), batches, statuses)
    res = compact(path)
    assert res.action == "compacted" and res.done and res.spans == 4 and res.final
    assert not path.exists() and res.target.exists()
    assert _status(res.target) == {
        "dropped": 7,
        "clock": c,
        "last_step": 3,
        "spans": 4,
        "writer_cpu_s": 1.0,
        "final": True,
        "truncated": False,
    }
    rf = read_rank_file(res.target)
    assert rf.dropped == 7 and rf.last_step == 3 and rf.complete
    assert [e.offset_ns for e in rf.clock] == [0, -1, -2, -3]


def test_parquet_is_zstd_and_the_live_stream_lz4(tmp_path: Path) -> None:
    if not (pa.Codec.is_available("lz4") and pa.Codec.is_available("zstd")):
        pytest.skip("this pyarrow lacks lz4 or zstd")
    rec = _record(tmp_path, 2000)
    rec.flush()
    live = rec.path.read_bytes()
    assert live.count(bytes.fromhex("04224d18")) >= 5  # lz4 frames in the IPC bodies
    rec.close()
    md = pq.ParquetFile(rec.path.with_suffix(".parquet")).metadata
    codecs = {md.row_group(0).column(i).compression for i in range(md.num_columns)}
    assert codecs == {"ZSTD"}


@pytest.mark.parametrize("group_rows", [1000, PARQUET_ROW_GROUP_ROWS])
def test_row_groups_are_bounded_with_correct_step_statistics(tmp_path, group_rows) -> None:
    n = 40_000 if group_rows == PARQUET_ROW_GROUP_ROWS else 5_500
    path = tmp_path / f"rank00000-{RUN}.arrows"
    batches = [
        [row("allreduce", f"t{i % 13}", 100 * (i + j), 100 * (i + j) + 9, step=i // 700)
         for j in range(0, 500, 1)][::-1]  # each batch backwards in time
        for i in range(0, n, 500)
    ]  # fmt: skip
    write_rank_file(path, make_header(0, 1, RUN), batches)
    res = compact(path, row_group_rows=group_rows)
    pf = pq.ParquetFile(res.target)
    md = pf.metadata
    sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    assert sum(sizes) == n and max(sizes) <= group_rows
    assert sizes == [group_rows] * (n // group_rows) + ([n % group_rows] if n % group_rows else [])
    assert res.row_groups == md.num_row_groups
    prev_max = -1
    for g in range(md.num_row_groups):
        st = md.row_group(g).column(COLUMNS.index("step")).statistics
        assert st is not None and st.has_min_max
        steps = pf.read_row_group(g, columns=["step"]).column("step").to_pylist()
        assert (st.min, st.max) == (min(steps), max(steps))
        assert st.min >= prev_max  # this stream is in step order: row groups do not overlap
        prev_max = st.max
    t = pf.read()
    keys = list(zip(t.column("step").to_pylist(), t.column("start_ns").to_pylist(), strict=True))
    assert keys == sorted(keys)


def test_unclosed_file_is_not_compacted(tmp_path: Path) -> None:
    rec = _record(tmp_path, 2000)
    rec.flush()
    n = _batches(rec.path)
    rec.writer = None  # as after a crash: nothing closes the file
    assert _batches(rec.path) == n and n > 1
    assert not rec.path.with_suffix(".parquet").exists()
    f = read_rank_file(rec.path)
    assert f.spans == 2000 and not f.complete


def test_close_compacts_in_a_child_process(tmp_path: Path, monkeypatch) -> None:
    """The rank's own process never compacts (its memory would grow by the Parquet writer): with
    in-process compaction made to fail, closing still leaves a Parquet file, written by the
    child."""
    import hvtrace.record.writer as w

    def not_here(*a, **k):
        raise AssertionError("compacted in the rank's process")

    rec = _record(tmp_path, 1000)
    monkeypatch.setattr(w, "compact", not_here)
    rec.close()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".parquet"]
    assert rec.writer is None
    rf = read_rank_file(rec.path.with_suffix(".parquet"))
    assert rf.complete and rf.spans == 1000


def test_without_a_child_process_the_rank_compacts_itself(tmp_path: Path, monkeypatch) -> None:
    import hvtrace.record.writer as w

    rec = _record(tmp_path, 500)
    monkeypatch.setattr(w.sys, "executable", str(tmp_path / "no-such-python"))
    rec.close()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".parquet"]
    assert read_rank_file(rec.path.with_suffix(".parquet")).spans == 500


def test_compaction_failure_leaves_the_stream(tmp_path: Path, monkeypatch) -> None:
    import hvtrace.format.compact as fc
    import hvtrace.record.writer as w

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    rec = _record(tmp_path, 1000)
    monkeypatch.setattr(fc, "_write_parquet", boom)
    monkeypatch.setattr(w, "compact_in_child", lambda p: w.compact(p, live_check=False))
    rec.close()  # never raises into training
    assert sorted(p.name for p in tmp_path.iterdir()) == [rec.path.name]
    rf = read_rank_file(rec.path)
    assert rf.complete and rf.spans == 1000


# -- never follow or replace what hvtrace did not create -------------------------------------------
def test_symlink_at_the_old_compact_name_is_left_alone(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    rec = _record(tmp_path / "run", 1000)
    planted = rec.path.with_name(rec.path.name + ".compact")
    planted.symlink_to(victim)
    rec.close()
    assert victim.read_text() == "precious"
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    assert rec.path.with_suffix(".parquet").is_file() and not rec.path.exists()


@pytest.mark.parametrize("dangling", [False, True])
def test_symlink_at_the_parquet_name_is_not_followed(tmp_path: Path, dangling: bool) -> None:
    victim = tmp_path / "victim.parquet"
    if not dangling:
        victim.write_bytes(b"precious")
    rec = _record(tmp_path / "run", 1000)
    planted = rec.path.with_suffix(".parquet")
    planted.symlink_to(victim)
    rec.close()  # the compaction refuses; the stream stays as written
    assert planted.is_symlink() and os.readlink(planted) == str(victim)
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_bytes() == b"precious"
    assert rec.path.is_file() and read_rank_file(rec.path).spans == 1000
    res = compact(rec.path)
    assert res.action == "kept" and "not a regular file" in res.reason
    assert rec.path.is_file() and planted.is_symlink()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]


def test_existing_parquet_of_other_spans_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / f"rank00000-{RUN}.arrows"
    write_rank_file(path, make_header(0, 1, RUN), [[row("step", "step", 1, 2)]])
    other = tmp_path / "other"
    other.mkdir()
    write_rank_file(other / path.name, make_header(0, 1, RUN), [[row("step", "step", 1, 2)] * 3])
    target = compact(other / path.name).target
    shutil.copy(target, tmp_path / target.name)
    kept = (tmp_path / target.name).read_bytes()
    res = compact(path)
    assert res.action == "kept" and "left both" in res.reason
    assert path.exists() and (tmp_path / target.name).read_bytes() == kept


def test_interrupted_compaction_loads_once_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for r in (0, 1):
        batches = [[row("step", "step", 10 * i, 10 * i + 5, step=i)] for i in range(3 + r)]
        write_rank_file(run_dir / f"rank{r:05d}-{RUN}.arrows", make_header(r, 2, RUN), batches)
    stream = run_dir / f"rank00001-{RUN}.arrows"
    keep = Path(shutil.copy(stream, tmp_path / stream.name))
    assert compact(stream).done
    shutil.copy(keep, stream)  # as if the compaction had stopped before removing the stream
    published = stream.with_suffix(".parquet").read_bytes()
    run = load_run(run_dir)
    assert run.ranks == [0, 1] and run.files[1].format == "parquet"
    assert run.spans.groupby("rank").size().to_dict() == {0: 3, 1: 4}
    assert not any("also claims" in p for p in run.problems), run.problems
    assert any("already compacted" in p for p in run.problems), run.problems
    assert run.complete
    res = compact(stream)
    assert res.action == "resumed" and res.done and res.spans == 4
    assert not stream.exists() and stream.with_suffix(".parquet").read_bytes() == published


def test_a_stream_still_being_written_is_not_compacted(tmp_path: Path) -> None:
    path = tmp_path / f"rank00000-{RUN}.arrows"
    tf = TraceFile(path, make_header(0, 1, RUN))
    tf.append([row("step", "step", 1, 2)], status())
    try:
        res = compact(path)
        assert res.action == "kept" and "still writing" in res.reason
        assert path.exists() and not path.with_suffix(".parquet").exists()
    finally:
        tf.close()
    assert compact(path).done


# -- hvtrace compact: after the fact, crashed ranks stay crashed -----------------------------------
def _write_crashed_run(run_dir: Path) -> dict[int, int]:
    """A 3-rank run: rank 0 closed (stream not compacted), rank 1 killed between flushes, rank 2
    cut inside its last batch. One batch per step. Returns rank -> spans that survive."""
    df = synth_spans(ranks=3, steps=12, tensors=3)
    run_dir.mkdir(parents=True)
    kept = {}
    clock = {"at_ns": 0, "offset_ns": 0, "uncertainty_ns": 20_000, "rounds": 8}
    for r, g in df.groupby("rank"):
        r = int(r)
        per_step = [
            [
                row(
                    str(x.kind), str(x.name), int(x.start_ns), int(x.end_ns), step=int(x.step),
                    nbytes=int(x.bytes), dtype="float32" if x.kind == "allreduce" else "",
                )
                for x in s.itertuples()
            ]
            for _, s in g.groupby("step")
        ]  # fmt: skip
        last = {0: 11, 1: 7, 2: 9}[r]
        batches = per_step[: last + 1]
        sts = [status(final=(r == 0 and i == last), last_step=i) for i in range(len(batches))]
        h = make_header(rank=r, size=3, run_id=RUN, clock_start=clock)
        path = run_dir / f"rank{r:05d}-{RUN}.arrows"
        sizes = write_rank_file(path, h, batches, sts, close=(r == 0))
        kept[r] = sum(len(b) for b in batches)
        if r == 2:  # cut in the middle of the last batch
            path.write_bytes(path.read_bytes()[: (sizes[-2] + sizes[-1]) // 2])
            kept[r] -= len(batches[-1])
    return kept


def test_hvtrace_compact_keeps_crashed_files_marked(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    kept = _write_crashed_run(run_dir)
    before = load_run(run_dir)
    sizes = {p.name: p.stat().st_size for p in run_dir.iterdir()}
    rc = cli_main(["compact", str(run_dir)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 4, out  # one per file, then the total
    for r, line in enumerate(lines[:3]):
        name = f"rank{r:05d}-{RUN}.arrows"
        parquet = run_dir / f"rank{r:05d}-{RUN}.parquet"
        assert name in line and f"{kept[r]:,} spans" in line, line
        assert f"{sizes[name]:,} -> {parquet.stat().st_size:,} bytes" in line, line
    assert "truncated" in lines[2] and "not closed cleanly" in lines[1]
    assert (
        lines[3].startswith("total: 3 of 3 file(s) compacted")
        and f"{sum(kept.values()):,}" in (lines[3])
    )
    assert sorted(p.suffix for p in run_dir.iterdir()) == [".parquet"] * 3

    after = load_run(run_dir)
    assert {r: f.spans for r, f in after.files.items()} == kept
    f0, f1, f2 = (after.files[r] for r in (0, 1, 2))
    assert f0.complete and not f0.truncated
    assert not f1.complete and not f1.truncated and f1.last_step == 7
    assert f2.truncated and not f2.complete
    assert _status(f2.path)["truncated"] is True and _status(f2.path)["final"] is False
    assert not after.complete
    assert any("truncated" in p and f2.path.name in p for p in after.problems), after.problems
    assert any("not closed cleanly" in p and f1.path.name in p for p in after.problems)
    # the same spans on the same clock as before compaction
    key = ["rank", "step", "start_ns", "kind", "name"]
    a = before.spans.astype({"kind": str, "name": str}).sort_values(key, kind="stable")
    b = after.spans.astype({"kind": str, "name": str}).sort_values(key, kind="stable")
    assert (
        a.reset_index(drop=True)
        .astype({"dtype": str})
        .equals(b.reset_index(drop=True).astype({"dtype": str}))
    )

    # the analysis still says the run is incomplete, and analyzes the steps every rank has
    rc = cli_main(["analyze", str(run_dir), "--json", str(tmp_path / "report.json")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    problems = " ".join(report["problems"])
    assert "truncated" in problems and f2.path.name in problems
    assert "not closed cleanly" in problems and f1.path.name in problems
    assert f2.path.name in out

    # a second run finds nothing left to compact
    assert cli_main(["compact", str(run_dir)]) == 0
    assert "nothing to compact" in capsys.readouterr().out


def test_hvtrace_compact_run_id_and_bad_input(tmp_path: Path, capsys) -> None:
    def one_line_error(argv: list[str]) -> str:
        capsys.readouterr()
        rc = cli_main(argv)
        _, err = capsys.readouterr()
        lines = [x for x in err.splitlines() if x.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("hvtrace: error: "), err
        return lines[0]

    assert "no such directory" in one_line_error(["compact", str(tmp_path / "nope")])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no hvtrace trace files" in one_line_error(["compact", str(empty)])
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / f"rank00000-{RUN}.arrows").write_bytes(b"not an arrow stream" * 10)
    assert "rank00000" in one_line_error(["compact", str(junk)])
    assert (junk / f"rank00000-{RUN}.arrows").exists()

    two = tmp_path / "two"
    two.mkdir()
    old = "20230101-000000-000000"
    write_rank_file(
        two / f"rank00000-{old}.arrows", make_header(0, 1, old), [[row("step", "s", 1, 2)]]
    )
    write_rank_file(
        two / f"rank00000-{RUN}.arrows", make_header(0, 1, RUN), [[row("step", "s", 1, 2)]]
    )
    (two / f"rank00001-{RUN}.arrows").write_bytes(b"")  # unusable: reported, not fatal
    assert "no files of run nope" in one_line_error(["compact", str(two), "--run-id", "nope"])
    assert cli_main(["compact", str(two), "--run-id", old]) == 0
    out = capsys.readouterr().out
    assert f"rank00000-{old}.arrows" in out and RUN not in out
    assert (two / f"rank00000-{old}.parquet").exists()
    assert (two / f"rank00000-{RUN}.arrows").exists()
    assert cli_main(["compact", str(two)]) == 0
    out = capsys.readouterr().out
    assert "total: 1 of 2 file(s) compacted" in out
    assert f"rank00001-{RUN}.arrows: left as is: empty file" in out


def test_compact_run_function(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    kept = _write_crashed_run(run_dir)
    results = compact_run(run_dir)
    assert [r.spans for r in results] == [kept[0], kept[1], kept[2]]
    assert [(r.final, r.truncated) for r in results] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert all(r.done and r.bytes_after > 0 for r in results)
    with pytest.raises(TraceError, match="no such directory"):
        compact_run(tmp_path / "missing")


# -- reading: only what is asked for ---------------------------------------------------------
def _write_parquet_run(run_dir: Path, ranks: int = 3, steps: int = 40) -> None:
    run_dir.mkdir(parents=True)
    for r in range(ranks):
        batches = [
            [row("step", "step", 1000 * s, 1000 * s + 900, step=s)]
            + [row("allreduce", f"g{k}", 1000 * s + k, 1000 * s + 50 + k, step=s)
               for k in range(24)]
            for s in range(steps)
        ]  # fmt: skip
        path = run_dir / f"rank{r:05d}-{RUN}.arrows"
        write_rank_file(path, make_header(r, ranks, RUN), batches)
        assert compact(path, row_group_rows=100).done


def test_open_run_reads_no_spans_and_builds_them_on_demand(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _write_parquet_run(run_dir)
    run = open_run(run_dir)
    assert run.ranks == [0, 1, 2] and run.complete and run.problems == []
    for f in run.files.values():
        assert f.format == "parquet" and not f.spans_read
        assert f.table.num_rows == 0 and f.n_spans == f.spans == 40 * 25
    assert "spans" not in run.__dict__
    spans = run.spans  # built now, from the files
    assert run.spans is spans
    full = load_run(run_dir)
    assert all(f.spans_read for f in full.files.values())
    assert spans.equals(full.spans)
    assert len(spans) == 3 * 40 * 25


def test_open_run_with_ranks_opens_no_other_rank_file(tmp_path: Path, monkeypatch) -> None:
    import hvtrace.format.read as read
    import hvtrace.load as load

    run_dir = tmp_path / "run"
    _write_parquet_run(run_dir, ranks=4)
    garbage = run_dir / f"rank00002-{RUN}.parquet"
    garbage.write_bytes(b"garbage, never opened" * 50)
    (run_dir / f"rank00003-{RUN}.parquet").chmod(0)  # unreadable: never opened either
    opened: list[str] = []
    real = read._is_parquet
    for module in (read, load):  # the run's listing and the file reader
        monkeypatch.setattr(module, "_is_parquet", lambda p: opened.append(Path(p).name) or real(p))
    run = open_run(run_dir, ranks=frozenset({0, 1}))
    assert run.ranks == [0, 1] and run.selected_ranks == {0, 1}
    assert run.problems == [] and run.missing_ranks == [] and run.complete
    assert all(n.startswith(("rank00000", "rank00001")) for n in opened), opened
    assert sorted(run.spans["rank"].unique().tolist()) == [0, 1]
    assert load_run(run_dir, ranks=frozenset({1})).ranks == [1]

    # a selected rank without a file is reported, relative to the selection
    (run_dir / f"rank00001-{RUN}.parquet").unlink()
    run = open_run(run_dir, ranks=frozenset({0, 1, 7}))
    assert run.ranks == [0] and run.missing_ranks == [1]
    assert any("no usable file for selected rank(s) 1" in p for p in run.problems), run.problems
    assert any("rank(s) 7 do not exist" in p for p in run.problems), run.problems
    with pytest.raises(TraceError, match="no trace file of rank"):
        open_run(run_dir, ranks=frozenset({5}))


def test_name_is_only_a_hint_for_the_rank_filter(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    one = [[row("step", "s", 1, 2)]]
    # named rank 0 but holds rank 1, and the other way round; a third name says no rank
    write_rank_file(run_dir / f"rank00000-{RUN}.arrows", make_header(1, 3, RUN), one)
    write_rank_file(run_dir / f"rank00001-{RUN}.arrows", make_header(0, 3, RUN), one * 2)
    write_rank_file(run_dir / "renamed.arrows", make_header(2, 3, RUN), one * 3)
    run = open_run(run_dir, ranks=frozenset({0, 1}))
    assert run.files[1].path.name == f"rank00000-{RUN}.arrows"
    assert run.files[0].path.name == f"rank00001-{RUN}.arrows"
    assert run.ranks == [0, 1] and run.missing_ranks == []  # renamed.arrows: read, dropped
    run = open_run(run_dir, ranks=frozenset({2}))
    assert run.ranks == [2] and run.files[2].path.name == "renamed.arrows"
    # rank 0's file is named rank 1: not opened; the file named rank 0 holds rank 1: dropped
    run = open_run(run_dir, ranks=frozenset({0, 2}))
    assert run.ranks == [2] and run.missing_ranks == [0]
    assert any("selected rank(s) 0" in p for p in run.problems), run.problems


def test_read_table_reads_only_the_row_groups_of_the_steps(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    _write_parquet_run(run_dir, ranks=1, steps=40)
    rf = open_run(run_dir).files[0]
    total = len(rf.row_groups())
    assert total == 10  # 1000 spans in groups of 100
    sel = StepRange(12, 16)
    groups = rf.row_groups(sel)
    assert 0 < len(groups) < total / 2
    read: list[int] = []
    real = pq.ParquetFile.read_row_group

    def spy(self, i, *a, **k):
        read.append(i)
        return real(self, i, *a, **k)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    t = rf.read_table(steps=sel)
    assert read == groups
    assert sorted(set(t.column("step").to_pylist())) == [12, 13, 14, 15]
    assert t.num_rows == 4 * 25 and t.schema.equals(FILE_SCHEMA, check_metadata=False)
    only = rf.read_table(steps=(12, 16), columns=["name", "end_ns"])
    assert only.column_names == ["name", "end_ns"] and only.num_rows == 100
    full = read_rank_file(rf.path)  # in memory: filtered, same rows
    assert _rows(full.read_table(steps=sel)) == _rows(t)
    # an .arrows file is filtered in memory
    stream = tmp_path / f"rank00000-{RUN}.arrows"
    write_rank_file(
        stream, make_header(0, 1, RUN), [[row("step", "s", i, i + 1, step=i)] for i in range(9)]
    )
    srf = read_rank_file(stream)
    assert srf.row_groups() == []
    assert srf.read_table(steps=StepRange(3, None)).column("step").to_pylist() == list(range(3, 9))
    with pytest.raises(ValueError, match="unknown span column"):
        srf.read_table(columns=["nope"])


def test_a_rerun_removes_what_a_killed_compaction_left_and_says_so(tmp_path: Path, capsys) -> None:
    """``hvtrace compact`` killed midway leaves its temporary file (hidden, up to the Parquet
    file's size); the next run removes it and says how much, and removes nothing else: not a
    file of another name, not a link, not one named like it with other characters."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    batches = [[row("step", "step", 10 * i, 10 * i + 5, step=i)] for i in range(4)]
    stream = run_dir / f"rank00000-{RUN}.arrows"
    write_rank_file(stream, make_header(0, 1, RUN), batches)
    target = stream.with_suffix(".parquet").name
    stale = run_dir / f".{target}k3x_9q0z.tmp"
    stale.write_bytes(b"x" * 7000)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    keep = [
        run_dir / f".{target}link0000.tmp",  # a link, though named like one
        run_dir / f".{target}abc.tmp",  # not mkstemp's form
        run_dir / f".other.parquet{'a' * 8}.tmp",
    ]
    keep[0].symlink_to(victim)
    keep[1].write_text("mine")
    keep[2].write_text("someone's")
    assert cli_main(["compact", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "removed 7,000 bytes an interrupted compaction left" in out, out
    assert not stale.exists() and all(p.is_symlink() or p.exists() for p in keep)
    assert victim.read_text() == "precious"
    assert load_run(run_dir).spans.shape[0] == 4


def test_compact_prints_hostile_names_as_visible_escapes(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run\x1b]0;pwned\x07"
    run_dir.mkdir()
    assert cli_main(["compact", str(run_dir)]) in (0, 2)
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "\\x1b" in captured.out + captured.err


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_the_parquet_file_keeps_the_streams_permissions(tmp_path: Path, mode: int) -> None:
    """The compacted file gets the stream's permissions (its temporary file, from mkstemp, is
    0600: a 0644 stream used to become a 0600 Parquet file whatever the umask)."""
    rec = _record(tmp_path, 100)
    rec.flush()
    stream = _stream_copy(rec.path, tmp_path)
    rec.close()
    os.chmod(stream, mode)
    out = compact(stream, live_check=False)
    assert out.target.exists() and (out.target.stat().st_mode & 0o777) == mode
