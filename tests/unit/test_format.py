"""Trace format: writer -> reader round trip, damaged files, bad input, plain-pyarrow reading."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import damage_row_group, make_header, row, status, write_rank_file

from hvtrace.format.read import read_header, read_rank_file
from hvtrace.format.schema import COLUMNS, FILE_SCHEMA, HEADER_KEY, KINDS
from hvtrace.load import TraceError, load_run, open_run

RUN = "20240101-000000-abcdef"


def _batches() -> list[list[tuple]]:
    """Three batches; batches 2 and 3 introduce names not seen before (delta dictionaries)."""
    b1 = [
        row("step", "step", 1_000, 9_000, step=0),
        row("input", "input", 1_000, 2_000, step=0),
        row("forward", "forward", 2_000, 3_000, step=0),
        row("allreduce", "net.0.weight", 3_000, 5_000, step=0, nbytes=4096, dtype="float32"),
        row("allreduce", "net.0.bias", 3_100, 5_100, step=0, nbytes=64, dtype="float32", flags=2),
    ]
    b2 = [
        row("allreduce", "net.0.weight", 10_000, 12_000, step=1, nbytes=2048, dtype="float16"),
        row("allreduce", "net.2.weight", 10_500, 12_500, step=1, micro=1, nbytes=8, dtype="int64"),
        row("scalar", "loss", 13_000, 13_000, step=1, value=0.25),
        row("user", "data", 9_000, 9_500, step=1),
    ]
    b3 = [
        row("user", "checkpoint ✓", 20_000, 30_000, step=2),
        row("scalar", "lr", 31_000, 31_000, step=2, value=-1.5e-3),
        row("clock", "clock", 32_000, 32_000, step=2, value=12.0, nbytes=7, flags=1),
        row("wait", "synchronize", 33_000, 34_000, step=2),
        row("update", "update", 34_000, 35_000, step=2, dtype="bfloat16"),
    ]
    return [b1, b2, b3]


COL_POS = {c: i for i, c in enumerate(COLUMNS)}


def _expected_columns(batches: list[list[tuple]]) -> dict[str, list]:
    """Expected column values as Python lists (kind and dtype decoded to names)."""
    from hvtrace.format.schema import DTYPES

    rows = [r for b in batches for r in b]
    # rows without CPU readings (these): cpu_ns and runq_ns are null
    out = {c: [r[i] if i < 10 else None for r in rows] for c, i in COL_POS.items()}
    out["kind"] = [KINDS[k] for k in out["kind"]]
    out["dtype"] = [DTYPES[d] for d in out["dtype"]]
    return out


def _assert_values(actual: dict[str, list], expected: dict[str, list]) -> None:
    assert set(actual) >= set(expected)
    for col, exp in expected.items():
        got = actual[col]
        if col == "value":
            assert len(got) == len(exp)
            for g, e in zip(got, exp):
                assert (math.isnan(g) and math.isnan(e)) or g == e, (col, got, exp)
        elif col in ("cpu_ns", "runq_ns"):  # null: None from Arrow, NaN from a DataFrame
            assert [None if g is None or g != g else g for g in got] == list(exp), col
        else:
            assert list(got) == list(exp), col


def _message_offsets(path: Path) -> list[tuple[str, int, int]]:
    """Return (message type, start byte, end byte) of every IPC message in a stream file."""
    out = []
    pos = 0
    data = path.read_bytes()
    for m in pa.ipc.MessageReader.open_stream(pa.BufferReader(data)):
        n = m.serialize().size
        out.append((m.type, pos, pos + n))
        pos += n
    return out


@pytest.fixture()
def good_file(tmp_path: Path) -> tuple[Path, dict, list[list[tuple]], list[int]]:
    header = make_header(rank=0, size=1, run_id=RUN, extra_field={"nested": [1, 2]})
    batches = _batches()
    path = tmp_path / f"rank00000-{RUN}.arrows"
    sizes = write_rank_file(path, header, batches)
    return path, header, batches, sizes


# -- round trip -----------------------------------------------------------------------------------
def test_round_trip_read_rank_file(good_file) -> None:
    path, header, batches, _ = good_file
    rf = read_rank_file(path)
    assert rf.header == header
    assert rf.rank == 0
    assert rf.complete and not rf.truncated
    assert rf.dropped == 0
    assert rf.spans == sum(len(b) for b in batches)
    assert rf.table.schema.equals(FILE_SCHEMA, check_metadata=False)
    actual = {c: rf.table.column(c).to_pylist() for c in COLUMNS}
    _assert_values(actual, _expected_columns(batches))


def test_names_use_delta_dictionaries(good_file) -> None:
    path, _, batches, _ = good_file
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_stream(src)
        sizes = [b.num_rows for b in reader]
        stats = reader.stats
    assert [n for n in sizes if n] == [len(b) for b in batches]
    # batches 2 and 3 add names to a non-empty dictionary: sent as deltas (only the new names).
    # The one replacement allowed is of the empty name dictionary written with the header at open.
    assert stats.num_dictionary_deltas >= 2
    assert stats.num_replaced_dictionaries <= 1


def test_header_is_on_disk_right_after_open(tmp_path: Path) -> None:
    """A rank that dies before its first flush still leaves a file with its header."""
    from hvtrace.record.writer import TraceFile

    header = make_header(1, 2, RUN)
    path = tmp_path / f"rank00001-{RUN}.arrows"
    tf = TraceFile(path, header)
    try:
        assert read_header(path) == header
        rf = read_rank_file(path)
        assert rf.rank == 1 and rf.spans == 0
        assert not rf.complete and not rf.truncated
        run = load_run(tmp_path)
        assert run.ranks == [1] and run.missing_ranks == [0]
        assert any("not closed cleanly" in p for p in run.problems), run.problems
    finally:
        tf.close()
    assert read_rank_file(path).spans == 0


def test_round_trip_load_run(good_file) -> None:
    path, _, batches, _ = good_file
    run = load_run(path.parent)
    assert run.run_id == RUN and run.size == 1 and run.ranks == [0]
    assert run.problems == []
    assert run.complete
    df = run.spans
    expected = _expected_columns(batches)
    actual = {c: df[c].tolist() for c in COLUMNS}
    # no clock estimate in the header: times are kept as they were written
    _assert_values(actual, expected)
    assert (df["rank"] == 0).all()
    assert df["step"].dtype == np.int32
    assert df["micro"].dtype == np.int16
    for c in ("start_ns", "end_ns", "bytes"):
        assert df[c].dtype == np.int64, c
    assert df["value"].dtype == np.float64
    assert df["flags"].dtype == np.uint8
    for c in ("kind", "name", "dtype"):
        assert df[c].dtype == "category", c


def test_readable_with_plain_pyarrow(good_file) -> None:
    """The documented recipe, with no hvtrace code involved in reading."""
    path, header, batches, _ = good_file
    with open(path, "rb") as f:
        reader = pa.ipc.open_stream(f)
        raw_header = reader.schema.metadata[HEADER_KEY]
        df = reader.read_all().to_pandas()
    assert json.loads(raw_header) == header
    assert list(df.columns) == list(COLUMNS)
    _assert_values({c: df[c].tolist() for c in COLUMNS}, _expected_columns(batches))


def test_rank_is_read_from_inside_the_file(tmp_path: Path) -> None:
    # a file whose name claims rank 0 but whose header says rank 1 (of 2)
    write_rank_file(tmp_path / f"rank00000-{RUN}.arrows", make_header(1, 2, RUN), _batches())
    write_rank_file(tmp_path / f"rank00001-{RUN}.arrows", make_header(0, 2, RUN), _batches()[:1])
    run = load_run(tmp_path)
    assert run.ranks == [0, 1]
    assert run.files[1].path.name == f"rank00000-{RUN}.arrows"
    assert run.files[0].path.name == f"rank00001-{RUN}.arrows"
    counts = run.spans.groupby("rank").size().to_dict()
    assert counts == {0: len(_batches()[0]), 1: sum(len(b) for b in _batches())}


# -- damaged files --------------------------------------------------------------------------------
def _cut_positions(path: Path) -> list[int]:
    """Byte positions strictly inside the last batch (its delta dictionary + record batch)."""
    msgs = _message_offsets(path)
    assert [m[0] for m in msgs[-2:]] == ["dictionary", "record batch"]
    dict_start, dict_end = msgs[-2][1], msgs[-2][2]
    rb_start, rb_end = msgs[-1][1], msgs[-1][2]
    return [
        dict_start + 1,
        dict_start + 4,
        dict_start + 7,
        (dict_start + dict_end) // 2,
        dict_end,  # the delta dictionary complete, the record batch not started
        rb_start + 5,
        rb_start + 12,
        (rb_start + rb_end) // 2,
        rb_end - 1,
    ]


def test_cut_positions_are_inside_the_last_batch(good_file) -> None:
    path, _, _, sizes = good_file
    # sizes: [after open, batch 1, batch 2, batch 3, after close]; batch 3 spans sizes[2]:sizes[3]
    for pos in _cut_positions(path):
        assert sizes[2] < pos < sizes[3]


@pytest.mark.parametrize("which", range(9))
def test_truncated_inside_last_batch_keeps_earlier_batches(good_file, tmp_path, which) -> None:
    path, header, batches, _ = good_file
    pos = _cut_positions(path)[which]
    run_dir = tmp_path / "cut"
    run_dir.mkdir()
    cut = run_dir / path.name
    cut.write_bytes(path.read_bytes()[:pos])

    rf = read_rank_file(cut)
    assert rf.truncated, f"cut at byte {pos} not detected as truncated"
    assert not rf.complete
    assert rf.header == header
    assert rf.spans == len(batches[0]) + len(batches[1])
    actual = {c: rf.table.column(c).to_pylist() for c in COLUMNS}
    _assert_values(actual, _expected_columns(batches[:2]))

    run = load_run(run_dir)
    assert run.ranks == [0]
    assert len(run.spans) == rf.spans
    assert not run.complete
    assert any(str(cut) in p and "truncated" in p for p in run.problems), run.problems


def test_truncated_inside_first_batch_keeps_header(good_file, tmp_path) -> None:
    """Cut after the header but inside the first data batch: header usable, no spans."""
    path, header, _, sizes = good_file
    msgs = _message_offsets(path)
    schema_end = msgs[0][2]
    # the first data batch: its delta dictionary starts where the file ended after opening
    first = next(i for i, m in enumerate(msgs) if m[1] == sizes[0])
    assert msgs[first][0] == "dictionary" and msgs[first + 1][0] == "record batch"
    data = path.read_bytes()
    positions = [schema_end + 3, msgs[first][1] + 3, msgs[first][2], msgs[first + 1][1] + 100]
    positions += [sizes[1] - 1]
    for pos in positions:
        cut = tmp_path / f"cut{pos}" / path.name
        cut.parent.mkdir()
        cut.write_bytes(data[:pos])
        rf = read_rank_file(cut)
        assert rf.header == header
        assert rf.truncated, pos
        assert rf.spans == 0
        assert any("truncated" in p for p in load_run(cut.parent).problems)


def test_cut_at_batch_boundary_is_unclosed_not_truncated(good_file, tmp_path) -> None:
    """A rank killed between flushes: every batch intact, no end marker, no final status."""
    path, _, batches, sizes = good_file
    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    cut = run_dir / path.name
    cut.write_bytes(path.read_bytes()[: sizes[2]])
    rf = read_rank_file(cut)
    assert not rf.truncated and not rf.complete
    assert rf.spans == len(batches[0]) + len(batches[1])
    run = load_run(run_dir)
    assert any("not closed cleanly" in p for p in run.problems), run.problems


def _assert_trace_error(exc: TraceError, path: Path) -> None:
    msg = str(exc)
    assert str(path) in msg, msg
    assert "\n" not in msg, msg


def _assert_unusable(path: Path) -> None:
    """Reading ``path`` alone, and loading its directory, each raise one line naming it."""
    with pytest.raises(TraceError) as ei:
        read_rank_file(path)
    _assert_trace_error(ei.value, path)
    with pytest.raises(TraceError) as ei:
        load_run(path.parent)
    _assert_trace_error(ei.value, path)


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.1, 0.5, 0.99])
def test_truncated_inside_header_raises_trace_error(good_file, tmp_path, frac) -> None:
    path, _, _, _ = good_file
    schema_type, _, schema_end = _message_offsets(path)[0]
    assert schema_type == "schema"
    pos = max(1, min(schema_end - 1, int(schema_end * frac)))
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    cut.write_bytes(path.read_bytes()[:pos])
    _assert_unusable(cut)


def test_empty_file_raises_trace_error(tmp_path: Path) -> None:
    empty = tmp_path / f"rank00000-{RUN}.arrows"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="empty") as ei:
        read_rank_file(empty)
    _assert_trace_error(ei.value, empty)
    with pytest.raises(TraceError) as ei:
        load_run(tmp_path)
    _assert_trace_error(ei.value, empty)


def test_unreadable_rank_file_is_a_problem_not_fatal(tmp_path: Path) -> None:
    write_rank_file(tmp_path / f"rank00000-{RUN}.arrows", make_header(0, 2, RUN), _batches())
    bad = tmp_path / f"rank00001-{RUN}.arrows"
    bad.write_bytes(b"")
    run = load_run(tmp_path)
    assert run.ranks == [0] and run.missing_ranks == [1]
    assert any(str(bad) in p and "empty" in p for p in run.problems), run.problems


def test_no_hvtrace_header_raises(tmp_path: Path) -> None:
    path = tmp_path / "plain.arrows"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, FILE_SCHEMA) as w:
        w.write_table(FILE_SCHEMA.empty_table())
    with pytest.raises(TraceError, match="no hvtrace header") as ei:
        read_header(path)
    _assert_trace_error(ei.value, path)
    with pytest.raises(TraceError) as ei:
        load_run(tmp_path)
    _assert_trace_error(ei.value, path)


def test_not_an_arrow_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "junk.arrows"
    path.write_text("this is not an Arrow stream\n" * 10)
    with pytest.raises(TraceError) as ei:
        read_rank_file(path)
    _assert_trace_error(ei.value, path)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"version": 3}, "version 3"),
        ({"version": 0}, "version 0"),
        ({"format": "chrometrace"}, "format"),
    ],
)
def test_wrong_version_or_format_raises(tmp_path: Path, override: dict, match: str) -> None:
    path = tmp_path / f"rank00000-{RUN}.arrows"
    write_rank_file(path, make_header(0, 1, RUN, **override), _batches())
    with pytest.raises(TraceError, match=match) as ei:
        read_rank_file(path)
    _assert_trace_error(ei.value, path)
    with pytest.raises(TraceError, match=match):
        load_run(tmp_path)


def test_header_missing_field_raises(tmp_path: Path) -> None:
    header = make_header(0, 1, RUN)
    del header["run_id"]
    path = tmp_path / f"rank00000-{RUN}.arrows"
    write_rank_file(path, header, _batches())
    with pytest.raises(TraceError, match="run_id") as ei:
        read_rank_file(path)
    _assert_trace_error(ei.value, path)


def test_directory_without_traces_raises(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no traces here")
    (tmp_path / "sub").mkdir()
    with pytest.raises(TraceError, match="no hvtrace trace files") as ei:
        load_run(tmp_path)
    assert str(tmp_path) in str(ei.value)
    with pytest.raises(TraceError, match="no such directory"):
        load_run(tmp_path / "does-not-exist")


def test_missing_rank_is_reported(tmp_path: Path) -> None:
    for r in (0, 2):
        write_rank_file(tmp_path / f"rank{r:05d}-{RUN}.arrows", make_header(r, 3, RUN), _batches())
    run = load_run(tmp_path)
    assert run.size == 3
    assert run.ranks == [0, 2]
    assert run.missing_ranks == [1]
    assert not run.complete
    missing = [p for p in run.problems if "no usable file for rank(s) 1" in p]
    assert len(missing) == 1, run.problems
    assert sorted(run.spans["rank"].unique().tolist()) == [0, 2]


def test_other_run_in_same_directory_is_ignored(tmp_path: Path) -> None:
    old = "20230101-000000-000000"
    write_rank_file(
        tmp_path / f"rank00000-{old}.arrows",
        make_header(0, 1, old, wall_anchor_ns=1_600_000_000 * 10**9),
        _batches()[:1],
    )
    write_rank_file(tmp_path / f"rank00000-{RUN}.arrows", make_header(0, 1, RUN), _batches())
    run = load_run(tmp_path)
    assert run.run_id == RUN  # the newest run by wall clock anchor
    assert len(run.spans) == sum(len(b) for b in _batches())
    assert any(old in p and "another run" in p for p in run.problems), run.problems
    assert load_run(tmp_path, run_id=old).run_id == old
    with pytest.raises(TraceError, match="no files of run"):
        load_run(tmp_path, run_id="nope")


def test_unclosed_file_without_status(tmp_path: Path) -> None:
    """Batches written but the file never closed: kept, not complete, last_step from status."""
    path = tmp_path / f"rank00000-{RUN}.arrows"
    sts = [status(last_step=0), status(last_step=1), status(last_step=2)]
    write_rank_file(path, make_header(0, 1, RUN), _batches(), statuses=sts, close=False)
    rf = read_rank_file(path)
    assert rf.spans == sum(len(b) for b in _batches())
    assert not rf.complete and not rf.truncated
    assert rf.last_step == 2


# -- the compacted form: Parquet ------------------------------------------------------------------
def _sorted_expected(batches: list[list[tuple]]) -> dict[str, list]:
    """Expected columns of the Parquet form: the rows sorted stably by (step, start_ns)."""
    rows = sorted((r for b in batches for r in b), key=lambda r: (r[0], r[COL_POS["start_ns"]]))
    return _expected_columns([rows])


def test_round_trip_parquet(good_file, tmp_path: Path) -> None:
    from hvtrace.format.compact import compact

    path, header, batches, _ = good_file
    res = compact(path)
    assert res.done and res.target == path.with_suffix(".parquet") and not path.exists()
    rf = read_rank_file(res.target)
    assert rf.format == "parquet" and rf.header == header and rf.rank == 0
    assert rf.complete and not rf.truncated and rf.dropped == 0
    assert rf.spans == sum(len(b) for b in batches)
    assert rf.table.schema.equals(FILE_SCHEMA, check_metadata=False)
    _assert_values({c: rf.table.column(c).to_pylist() for c in COLUMNS}, _sorted_expected(batches))
    run = load_run(path.parent)
    assert run.complete and run.problems == [] and run.ranks == [0]
    _assert_values({c: run.spans[c].tolist() for c in COLUMNS}, _sorted_expected(batches))
    for c in ("kind", "name", "dtype"):
        assert run.spans[c].dtype == "category", c


def test_parquet_readable_with_plain_pyarrow(good_file) -> None:
    """The documented recipe for the compacted form, with no hvtrace code involved in reading."""
    import pyarrow.parquet as pq

    from hvtrace.format.compact import compact

    path, header, batches, _ = good_file
    target = compact(path).target
    meta = pq.read_metadata(target).metadata  # the footer's key-value metadata
    assert json.loads(meta[b"hvtrace"]) == header
    st = json.loads(meta[b"hvtrace.status"])
    assert st["final"] is True and st["spans"] == sum(len(b) for b in batches)
    table = pq.read_table(target)
    assert table.schema.field("name").type == pa.dictionary(pa.int32(), pa.string())
    df = table.to_pandas()
    assert list(df.columns) == list(COLUMNS)
    _assert_values({c: df[c].tolist() for c in COLUMNS}, _sorted_expected(batches))


def test_parquet_readable_with_duckdb(tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb")
    from hvtrace.format.compact import compact

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for r in (0, 1):
        p = run_dir / f"rank{r:05d}-{RUN}.arrows"
        write_rank_file(p, make_header(r, 2, RUN), _batches())
        compact(p)
    con = duckdb.connect()
    glob = str(run_dir / "*.parquet")
    got = con.execute(
        f"SELECT filename, step, kind, count(*) AS n, sum(bytes) AS bytes "
        f"FROM read_parquet('{glob}', filename = true) "
        f"WHERE kind = 'allreduce' GROUP BY ALL ORDER BY filename, step"
    ).fetchall()
    assert [(Path(f).name[:9], s, k, n, b) for f, s, k, n, b in got] == [
        (f"rank0000{r}", s, "allreduce", 2, nb) for r in (0, 1) for s, nb in ((0, 4160), (1, 2056))
    ]
    meta = con.execute(
        f"SELECT file_name, decode(value) FROM parquet_kv_metadata('{glob}') "
        f"WHERE decode(key) = 'hvtrace' ORDER BY file_name"
    ).fetchall()
    assert [json.loads(v)["rank"] for _, v in meta] == [0, 1]


def _write_parquet(path: Path, table: pa.Table, meta: dict[bytes, bytes]) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(table.replace_schema_metadata(meta), path)
    return path


def _good_table() -> pa.Table:
    from hvtrace.record.writer import BatchEncoder

    return pa.Table.from_batches([BatchEncoder().encode(b) for b in _batches()])


def _hdr(rank: int = 0, size: int = 1, **kw) -> dict[bytes, bytes]:
    return {HEADER_KEY: json.dumps(make_header(rank, size, RUN, **kw)).encode()}


PARQUET_CASES = {
    "no header": ({}, None, "no hvtrace header"),
    "header not json": ({HEADER_KEY: b"{nope"}, None, "not valid JSON"),
    "header nested too deep": ({HEADER_KEY: b"[" * 100_000 + b"]" * 100_000}, None, "valid JSON"),
    "version 3": (_hdr(version=3), None, "version 3"),
    # past int64 (or near it): the times built on it would overflow
    "anchor out of range": (_hdr(mono_anchor_ns=2**63 - 1), None, "out of range"),
    "anchor of 30 digits": (_hdr(wall_anchor_ns=10**30), None, "out of range"),
    "negative pid": (_hdr(pid=-5), None, "out of range"),
    "rank outside size": (_hdr(3, 2), None, "outside size"),
    "wrong columns": (
        _hdr(),
        pa.table({"step": pa.array([1], pa.int32()), "what": pa.array(["x"])}),
        "span columns do not match",
    ),
    "strings, not dictionaries": (_hdr(), "plain", "span columns do not match"),
}


@pytest.mark.parametrize("case", list(PARQUET_CASES), ids=list(PARQUET_CASES))
def test_bad_parquet_raises_one_line_trace_error(tmp_path: Path, case: str) -> None:
    meta, table, match = PARQUET_CASES[case]
    if table is None:
        table = _good_table()
    elif isinstance(table, str):
        table = _good_table()
        for c in ("kind", "name", "dtype"):
            i = table.schema.get_field_index(c)
            table = table.set_column(i, c, table.column(c).cast(pa.string()))
    path = _write_parquet(tmp_path / f"rank00000-{RUN}.parquet", table, meta)
    for read in (read_header, read_rank_file):
        with pytest.raises(TraceError, match=match) as ei:
            read(path)
        _assert_trace_error(ei.value, path)
    with pytest.raises(TraceError, match=match) as ei:
        load_run(tmp_path)
    _assert_trace_error(ei.value, path)


@pytest.mark.parametrize("what", ["empty", "junk", "magic only", "cut"])
def test_damaged_parquet_file_raises_one_line_trace_error(good_file, tmp_path, what) -> None:
    from hvtrace.format.compact import compact

    path = compact(good_file[0]).target
    data = path.read_bytes()
    bad = tmp_path / "bad" / path.name
    bad.parent.mkdir()
    variants = {
        "empty": [b""],
        "junk": [b"this is not a Parquet file\n" * 20],
        "magic only": [b"PAR1" + b"\0" * 100 + b"PAR1"],
        "cut": [data[:n] for n in (4, 100, len(data) // 2, len(data) - 9, len(data) - 1)],
    }
    for content in variants[what]:
        bad.write_bytes(content)
        _assert_unusable(bad)


def test_damaged_row_group_keeps_what_is_readable(tmp_path: Path) -> None:
    """A Parquet file whose data is damaged after its first row group: the first is kept."""
    import pyarrow.parquet as pq

    from hvtrace.format.compact import compact

    path = tmp_path / f"rank00000-{RUN}.arrows"
    rows = [row("allreduce", f"t{i}", i, i + 5, step=i // 10, nbytes=i) for i in range(300)]
    write_rank_file(path, make_header(0, 1, RUN), [rows[:150], rows[150:]])
    target = compact(path, row_group_rows=100).target
    assert pq.read_metadata(target).num_row_groups == 3
    damage_row_group(target, 1)
    rf = read_rank_file(target, read_spans=False)
    assert rf.n_spans == 300 and not rf.truncated  # the footer is intact
    full = read_rank_file(target)
    assert full.truncated and full.spans == 100
    assert full.table.column("bytes").to_pylist()[:100] == list(range(100))
    run = load_run(tmp_path)
    assert any("truncated" in p for p in run.problems), run.problems
    lazy = open_run(tmp_path)
    assert len(lazy.spans) == full.spans and lazy.files[0].truncated
    assert any("unreadable" in p for p in lazy.problems), lazy.problems


@pytest.mark.parametrize("form", ["parquet", "arrows"])
@pytest.mark.parametrize("col", ["step", "kind", "start_ns", "end_ns"])
def test_a_span_lacking_a_step_kind_or_time_is_left_out_and_reported(
    tmp_path: Path, form: str, col: str, capsys
) -> None:
    """hvtrace never writes a null there; a file that has one (damage, tampering) is analyzed
    without that row, and the problem says how many rows were left out (was: an internal error,
    OverflowError or 'cannot convert NA to integer', and nothing analyzed)."""
    import pyarrow.compute as pc

    from hvtrace.cli import main

    t = _good_table()
    i = t.schema.get_field_index(col)
    c = t.column(col).combine_chunks()
    c = pc.if_else(pa.array([j == 3 for j in range(len(c))]), pa.scalar(None, c.type), c)
    t = t.set_column(i, t.schema.field(i), c)
    path = tmp_path / f"rank00000-{RUN}.{form}"
    if form == "parquet":
        _write_parquet(path, t, _hdr())
    else:
        with pa.ipc.new_stream(str(path), t.schema.with_metadata(_hdr())) as w:
            w.write_table(t)
    run = load_run(tmp_path)
    assert len(run.spans) == t.num_rows - 1
    assert [p for p in run.problems if "1 spans lack a step, kind or time" in p], run.problems
    assert main(["analyze", str(tmp_path), "--json", str(tmp_path / "a.json")]) == 0
    assert "lack a step, kind or time" in capsys.readouterr().out


def test_thousands_of_junk_files_are_summarized_not_listed(good_file) -> None:
    path = good_file[0]
    for i in range(300):
        (path.parent / f"junk{i:04d}.parquet").write_bytes(b"not a Parquet file")
    run = open_run(path.parent)
    assert run.ranks == [0]
    junk = [p for p in run.problems if "junk" in p]
    assert len(junk) == 10, run.problems
    assert "... and 290 more unreadable files (not listed)" in run.problems


def test_a_row_group_whose_dictionary_decompresses_to_a_bomb_is_not_expanded(
    tmp_path: Path,
) -> None:
    """One name of 80 MiB (of one letter) is a few kilobytes compressed: the rows alone look
    plausible, but the footer states the column's uncompressed size, which is checked too. The
    row group before it is kept; the file is reported as refused there."""
    import pyarrow.parquet as pq

    t = _good_table()
    names = t.column("name").combine_chunks()
    dictionary = ["x" * (80 << 20), *names.dictionary.to_pylist()[1:]]
    big = pa.DictionaryArray.from_arrays(names.indices, pa.array(dictionary))
    i = t.schema.get_field_index("name")
    bomb = t.set_column(i, t.schema.field(i), big.cast(t.schema.field(i).type))
    whole = pa.concat_tables([t, bomb]).replace_schema_metadata(_hdr())
    path = tmp_path / f"rank00000-{RUN}.parquet"
    pq.write_table(whole, path, row_group_size=t.num_rows, compression="zstd")
    assert path.stat().st_size < 1 << 20
    run = load_run(tmp_path)
    assert len(run.spans) == t.num_rows  # the first row group
    (msg,) = [p for p in run.problems if "uncompressed" in p]
    assert "row group 1" in msg and "column 'name'" in msg and "not expanded" in msg
