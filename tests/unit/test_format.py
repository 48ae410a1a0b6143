"""Trace format: writer -> reader round trip, damaged files, bad input, plain-pyarrow reading."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import make_header, row, status, write_rank_file

from hvtrace.load import TraceError, load_run, read_header, read_rank_file
from hvtrace.schema import COLUMNS, FILE_SCHEMA, HEADER_KEY, KINDS

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
    from hvtrace.schema import DTYPES

    rows = [r for b in batches for r in b]
    out = {c: [r[i] for r in rows] for c, i in COL_POS.items()}
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


@pytest.mark.parametrize("frac", [0.0, 0.01, 0.1, 0.5, 0.99])
def test_truncated_inside_header_raises_trace_error(good_file, tmp_path, frac) -> None:
    path, _, _, _ = good_file
    schema_type, _, schema_end = _message_offsets(path)[0]
    assert schema_type == "schema"
    pos = max(1, min(schema_end - 1, int(schema_end * frac)))
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    cut.write_bytes(path.read_bytes()[:pos])
    with pytest.raises(TraceError) as ei:
        read_rank_file(cut)
    _assert_trace_error(ei.value, cut)
    with pytest.raises(TraceError) as ei:
        load_run(cut.parent)
    _assert_trace_error(ei.value, cut)


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
        ({"version": 2}, "version 2"),
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
