"""Hostile and broken input, round 2 (issue 41): what the earlier tests did not reach.

Real sample runs, compacted into small row groups, whose Parquet footers lie or break the reader
(a statistic of the wrong width made pyarrow abort the process; statistics claiming other steps
made ``--steps`` silently drop a rank; a negative row count crashed ``hvtrace info``), and
Horovod timelines whose times are not numbers (``NaN``, ``Infinity``: an internal error). Each
case runs the CLI as a user would and checks the contract: exit 0 with the problem named in one
line and every rank analyzed, never an abort (134) or a traceback (1).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import REPO_ROOT, analyze_cli, job_env

from hvtrace.analysis.hvd_timeline import read_timeline
from hvtrace.format.compact import compact
from hvtrace.format.footer import FooterError, _Reader, column_stats, read_footer
from hvtrace.format.schema import COLUMNS

BALANCED = Path(__file__).resolve().parents[2] / "sample_traces" / "balanced_2rank"
#: Rows per row group of the compacted copies: the sample's 721 spans a rank in 4 groups.
GROUP_ROWS = 200


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """The balanced 2-rank sample, compacted into row groups of :data:`GROUP_ROWS` rows."""
    d = tmp_path / "run"
    shutil.copytree(BALANCED, d)
    for p in sorted(d.glob("*.arrows")):
        compact(p, row_group_rows=GROUP_ROWS, live_check=False)
    assert len(list(d.glob("*.parquet"))) == 2
    return d


def _rank1(run: Path) -> Path:
    return sorted(run.glob("rank00001-*.parquet"))[0]


def _footer_span(raw: bytes) -> tuple[int, int]:
    """(offset, length) of a Parquet file's footer."""
    n = struct.unpack("<I", raw[-8:-4])[0]
    return len(raw) - 8 - n, n


def _write_footer(path: Path, raw: bytes, start: int, footer: bytes) -> None:
    path.write_bytes(raw[:start] + footer + struct.pack("<I", len(footer)) + b"PAR1")


def _set_step_stats(path: Path, group: int, new_min: bytes, new_max: bytes) -> None:
    """Replace the ``step`` min and max statistics of row group ``group`` (every encoding of
    them) by the given bytes, the footer otherwise unchanged."""
    st = pq.read_metadata(path).row_group(group).column(COLUMNS.index("step")).statistics
    fmt = "<i" if st.physical_type == "INT32" else "<q"
    old_min, old_max = struct.pack(fmt, st.min), struct.pack(fmt, st.max)
    raw = path.read_bytes()
    start, n = _footer_span(raw)
    footer = raw[start : start + n]
    at, hits = -1, []
    while (at := footer.find(b"\x04step", at + 1)) >= 0:
        hits.append(at)
    pos = hits[1 + group]  # the first is the schema's; then one per row group
    window = footer[pos : pos + 200]
    for old, new in ((old_max, new_max), (old_min, new_min)):
        window = window.replace(bytes([len(old)]) + old, bytes([len(new)]) + new)
    _write_footer(path, raw, start, footer[:pos] + window + footer[pos + 200 :])


def _set_total_rows(path: Path, rows: int) -> None:
    """Set the footer's total row count (``FileMetaData.num_rows``) to ``rows``."""
    raw = path.read_bytes()
    start, n = _footer_span(raw)
    footer = raw[start : start + n]
    r, fid = _Reader(footer), 0
    while True:
        head = r.byte()
        fid += head >> 4
        if fid == 3:
            a = r.pos
            r.zigzag()
            b = r.pos
            break
        r.value(head & 0x0F, 0)
    z, enc = (rows << 1) ^ (rows >> 63), bytearray()
    while z >= 0x80:
        enc.append((z & 0x7F) | 0x80)
        z >>= 7
    enc.append(z)
    _write_footer(path, raw, start, footer[:a] + bytes(enc) + footer[b:])


def _cli(command: str, *args: str | Path) -> subprocess.CompletedProcess:
    """``python -m hvtrace.cli COMMAND ARGS`` in a child process (an abort must not end pytest)."""
    return subprocess.run(
        [sys.executable, "-m", "hvtrace.cli", command, *map(str, args)],
        capture_output=True,
        text=True,
        env=job_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    """Stdout and stderr of a run that must have ended with exit 0 and no traceback."""
    both = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{both[-3000:]}"
    assert "Traceback" not in both and "internal error" not in both, both[-3000:]
    return both


def _one_line(text: str) -> str:
    """The report's lines joined (a problem wraps over several lines of the terminal)."""
    return " ".join(ln.strip() for ln in text.splitlines())


# -- the footer reader -------------------------------------------------------------------------
def test_the_footer_reader_agrees_with_pyarrow_on_a_real_file(run: Path) -> None:
    for path in sorted(run.glob("*.parquet")):
        md = pq.read_metadata(path)
        ours = column_stats(read_footer(path), ["step", "start_ns", "end_ns", "kind"])
        assert len(ours) == md.num_row_groups == 4
        for g, stats in enumerate(ours):
            for name in ("step", "start_ns", "end_ns"):
                st = md.row_group(g).column(COLUMNS.index(name)).statistics
                assert (stats[name].min, stats[name].max) == (st.min, st.max)
                assert stats[name].null_count == st.null_count == 0
            assert stats["kind"].min is None and stats["kind"].null_count == 0


@pytest.mark.parametrize("cut", [1, 5, 40, 200])
def test_a_cut_or_garbled_footer_is_a_footer_error(run: Path, cut: int) -> None:
    raw = _rank1(run).read_bytes()
    start, n = _footer_span(raw)
    from hvtrace.format.footer import parse_footer

    with pytest.raises(FooterError):
        column_stats(parse_footer(raw[start : start + n - cut]), ["step"])
    deep = b"\x1c" * 10_000  # a struct in a struct in ...: bounded, not a RecursionError
    with pytest.raises(FooterError):
        parse_footer(deep)


# -- class 3: rank files whose metadata lies or breaks the reader ----------------------------------
@pytest.mark.parametrize("command", ["info", "analyze"])
def test_a_one_byte_step_statistic_is_one_problem_not_an_abort(run: Path, command: str) -> None:
    path = _rank1(run)
    _set_step_stats(path, 1, b"\x01", b"\x02")
    with pytest.raises(FooterError, match="holds 1 bytes, not 4"):
        column_stats(read_footer(path), ["step"])
    both = _ok(_cli(command, run))  # was: 'terminate called ...', exit 134, nothing analyzed
    text = _one_line(both)
    assert f"{path.name}: the footer is malformed" in text
    assert "row groups from 1 on not read; 200 spans kept before it" in text
    if command == "analyze":
        assert "2 of 2 rank(s)" in both


def test_step_statistics_that_lie_do_not_drop_a_rank_from_a_step_selection(run: Path) -> None:
    honest = _ok(analyze_cli(run, "--steps", "10:20", "--json", run / "honest.json"))
    path = _rank1(run)
    _set_step_stats(path, 0, struct.pack("<i", 100), struct.pack("<i", 111))
    _set_step_stats(path, 1, struct.pack("<i", 111), struct.pack("<i", 122))
    st = pq.read_metadata(path).row_group(0).column(COLUMNS.index("step")).statistics
    assert (st.min, st.max) == (100, 111)
    # the whole run is analyzed right whatever the statistics say
    assert "2 of 2 rank(s)" in _ok(analyze_cli(run))
    lied = _ok(analyze_cli(run, "--steps", "10:20", "--json", run / "lied.json"))
    assert "2 of 2 rank(s)" in honest and "2 of 2 rank(s)" in lied  # was: "1 of 2", exit 0
    text = _one_line(lied)
    assert f"{path.name}: the footer's step statistics are wrong: row group 0 holds" in text
    a = json.loads((run / "honest.json").read_text())
    b = json.loads((run / "lied.json").read_text())
    assert [r["rank"] for r in b["per_rank"]] == [r["rank"] for r in a["per_rank"]] == [0, 1]
    assert b["per_rank"] == a["per_rank"]  # the same figures: nothing of rank 1 lost


@pytest.mark.parametrize("command", ["info", "analyze"])
def test_a_negative_row_count_in_the_footer_is_one_problem(run: Path, command: str) -> None:
    path = _rank1(run)
    _set_total_rows(path, -5)
    assert pq.read_metadata(path).num_rows == -5
    both = _ok(_cli(command, run))  # was: internal error (DuckDB: negative number of rows)
    text = _one_line(both)
    assert f"{path.name}: the footer states -5 rows, its row groups 721" in text
    if command == "analyze":
        assert "2 of 2 rank(s)" in both


# -- class 3: JSON in a Horovod timeline -----------------------------------------------------------
START_US = 1_763_789_769_000_000


def _timeline(bad_ts: str) -> str:
    """A small Horovod timeline of 5 allreduces of one tensor; the third's begin at ``bad_ts``."""
    ev: list[dict] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 1,
            "args": {
                "name": "allreduce.net.0.weight",
                "start_time_since_epoch_in_micros": START_US,
            },
        }
    ]
    for k in range(5):
        t = 1000 * k
        ev += [
            {"name": "NEGOTIATE_ALLREDUCE", "ph": "B", "pid": 1, "ts": t},
            {"name": "0", "ph": "X", "pid": 1, "ts": t + 1},
            {"ph": "E", "pid": 1, "ts": t + 5},
            {"name": "ALLREDUCE", "ph": "B", "pid": 1, "ts": t + 6},
            {"name": "GLOO_ALLREDUCE", "ph": "B", "pid": 1, "ts": t + 7},
            {"ph": "E", "pid": 1, "ts": t + 40},
            {"ph": "E", "pid": 1, "ts": t + 50},
        ]
    text = json.dumps(ev)
    assert text.count('"ts": 2006') == 1
    return text.replace('"ts": 2006', f'"ts": {bad_ts}')


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity", "1e300", "-5", '"soon"'])
def test_a_timeline_time_that_is_not_a_number_is_left_out_and_counted(
    tmp_path: Path, bad: str
) -> None:
    path = tmp_path / "timeline.json"
    path.write_text(_timeline(bad))
    tl = read_timeline(path)  # was: ValueError / OverflowError (int(nan), int(inf))
    assert any("1 events with an implausible time" in p for p in tl.problems), tl.problems
    assert tl.activities["start_us"].between(0, 10**15).all()
    assert (tl.activities["end_us"] >= tl.activities["start_us"]).all()
    # the other 4 allreduces, all 5 transfers and all 5 negotiations kept
    counts = tl.activities["activity"].value_counts()
    assert (counts["NEGOTIATE_ALLREDUCE"], counts["ALLREDUCE"], counts["GLOO_ALLREDUCE"]) == (
        5,
        4,
        5,
    )


def test_an_end_before_its_begin_in_a_timeline_is_left_out_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    path.write_text(_timeline("4000000"))  # the third ALLREDUCE begins after it ends
    tl = read_timeline(path)
    assert any("ending before they began" in p for p in tl.problems), tl.problems
    assert (tl.activities["end_us"] >= tl.activities["start_us"]).all()


@pytest.mark.parametrize("bad", ["NaN", "Infinity"])
def test_a_hostile_timeline_found_in_the_run_directory_does_not_stop_analyze(
    run: Path, bad: str
) -> None:
    (run / "hvd-timeline.json").write_text(_timeline(bad))  # picked up by its marker
    both = _ok(analyze_cli(run))  # was: internal error, exit 1, nothing of the run shown
    assert "2 of 2 rank(s)" in both
    text = _one_line(both)
    assert "Horovod's timeline (hvd-timeline.json)" in text
    assert "problem: 1 events with an implausible time" in text
