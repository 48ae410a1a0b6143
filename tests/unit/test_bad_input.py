"""Damaged input, property-based: real sample traces, broken in every way a disk or a user can.

Each case runs ``hvtrace analyze`` in-process and must either load (exit 0) with a warning naming
what was dropped, or fail with exit code 2 and a one-line error; never a traceback (exit 1), never
a hang (pytest-timeout). Each property must have tried at least half the examples its settings ask
for (it prints how many: ``-s``).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import rewrite_header as _rewrite_header
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hvtrace.cli import main as cli_main
from hvtrace.format.compact import compact_run
from hvtrace.format.schema import TRACE_SUFFIXES

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"
BALANCED = SAMPLES / "balanced_2rank"
SLOW = SAMPLES / "slow_rank1_forward_2rank"
FOUR = SAMPLES / "slow_rank2_input_4rank"

CASES: dict[str, int] = {}
#: Examples per property: each runs the whole CLI on a copied run directory (about 0.2 s), so the
#: suite draws 20 fresh ones per run (every run draws others: no example database);
#: ``HVTRACE_DEEP_TESTS=1`` draws 10 times as many.
EXAMPLES = 200 if os.environ.get("HVTRACE_DEEP_TESTS") == "1" else 20
#: No shrinking: each example runs the whole CLI.
DAMAGE_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
#: Half as many for the compacted form.
PARQUET_SETTINGS = settings(DAMAGE_SETTINGS, max_examples=EXAMPLES // 2)


def _tries_its_examples(test):
    """Fail a property test that passed on fewer damaged inputs than half of its settings'
    examples: a settings slip (a phase left out, a database replaying one example) would let it
    pass on none. Prints the count (``-s``)."""
    wanted = test._hypothesis_internal_use_settings.max_examples

    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        before = sum(CASES.values())
        test(*args, **kwargs)
        tried = sum(CASES.values()) - before
        print(f"\n{test.__name__}: {tried} damaged inputs tried")
        assert tried >= wanted // 2, f"{test.__name__} tried {tried} inputs, not {wanted}"

    return run


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.suffix in TRACE_SUFFIXES)


@functools.cache
def _compacted_sample(src: Path) -> Path:
    """The sample run compacted once (``hvtrace compact``: Parquet files), for copies."""
    where = tempfile.mkdtemp(prefix="hvtrace-compacted-")
    atexit.register(shutil.rmtree, where, True)
    run = _copy(src, Path(where) / src.name)
    compact_run(run)
    assert {p.suffix for p in _files(run)} == {".parquet"}
    return run


def _compacted(src: Path, dst: Path) -> Path:
    """A copy of a sample run in the compacted form."""
    return _copy(_compacted_sample(src), dst)


def _analyze(run_dir: Path, capsys: pytest.CaptureFixture, kind: str) -> tuple[int, str, str]:
    """Run `hvtrace analyze`; check the contract; return (rc, stdout, stderr)."""
    CASES[kind] = CASES.get(kind, 0) + 1
    capsys.readouterr()
    rc = cli_main(["analyze", str(run_dir), "--json", str(run_dir / "report.json")])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert rc in (0, 2), f"{kind}: exit {rc}\n{err}"
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("hvtrace: error: "), err
    else:
        report = json.loads((run_dir / "report.json").read_text())
        assert "per_rank" in report and "stragglers" in report
    return rc, out, err


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


@_tries_its_examples
@DAMAGE_SETTINGS
@given(data=st.data())
def test_truncated_at_any_byte(tmp_path: Path, capsys, data) -> None:
    run = _copy(BALANCED, tmp_path / "run")
    victim = data.draw(st.sampled_from(_files(run)))
    raw = victim.read_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    victim.write_bytes(raw[:cut])
    rc, out, err = _analyze(run, capsys, "truncation")
    if rc == 0 and cut < len(raw) - 8:  # spans lost (not just the end-of-stream marker)
        assert victim.name in out + err, "a damaged file must be reported, not silently used"


@_tries_its_examples
@PARQUET_SETTINGS
@given(data=st.data())
def test_compacted_truncated_at_any_byte(tmp_path: Path, capsys, data) -> None:
    run = _compacted(BALANCED, tmp_path / "run")
    victim = data.draw(st.sampled_from(_files(run)))
    raw = victim.read_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    victim.write_bytes(raw[:cut])
    rc, out, err = _analyze(run, capsys, "parquet truncation")
    if rc == 0:  # a Parquet file cut anywhere loses its footer: reported, never silently used
        assert victim.name in out + err


def _flip_bytes(run: Path, data: st.DataObject) -> None:
    """Flip 1-8 random bytes of one of the run's files, in place."""
    victim = data.draw(st.sampled_from(_files(run)))
    raw = bytearray(victim.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    victim.write_bytes(bytes(raw))


@_tries_its_examples
@PARQUET_SETTINGS
@given(data=st.data())
def test_compacted_flipped_bytes(tmp_path: Path, capsys, data) -> None:
    run = _compacted(data.draw(st.sampled_from([BALANCED, SLOW])), tmp_path / "run")
    _flip_bytes(run, data)
    _analyze(run, capsys, "parquet flipped bytes")


@_tries_its_examples
@DAMAGE_SETTINGS
@given(data=st.data())
def test_flipped_bytes(tmp_path: Path, capsys, data) -> None:
    run = _copy(data.draw(st.sampled_from([BALANCED, SLOW])), tmp_path / "run")
    _flip_bytes(run, data)
    _analyze(run, capsys, "flipped bytes")


HEADER_EDITS = {
    "no header": lambda h: None,
    "header not json": lambda h: b"{not json",
    "unknown version": lambda h: {**h, "version": 99},
    "wrong format": lambda h: {**h, "format": "other"},
    "rank outside size": lambda h: {**h, "rank": 7},
    "rank missing": lambda h: {k: v for k, v in h.items() if k != "rank"},
    "negative size": lambda h: {**h, "size": -1},
    "bad clock": lambda h: {**h, "clock": {"start": {"at_ns": "x"}}},
}


@pytest.mark.parametrize("edit", list(HEADER_EDITS), ids=list(HEADER_EDITS))
@pytest.mark.parametrize("which", ["one", "all"])
@pytest.mark.parametrize("form", ["stream", "parquet"])
def test_bad_headers(tmp_path: Path, capsys, edit: str, which: str, form: str) -> None:
    run = (_copy if form == "stream" else _compacted)(BALANCED, tmp_path / "run")
    victims = _files(run)[:1] if which == "one" else _files(run)
    for v in victims:
        _rewrite_header(v, HEADER_EDITS[edit])
    rc, out, err = _analyze(run, capsys, f"header: {edit}")
    if which == "all":
        assert rc == 2
    else:
        assert rc == 0 and victims[0].name in out + err  # the other rank is analyzed, loss named


def test_directory_cases(tmp_path: Path, capsys) -> None:
    # no traces at all
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _analyze(empty, capsys, "no traces")[0] == 2
    # not a directory / missing
    assert _analyze(tmp_path / "missing", capsys, "missing dir")[0] == 2
    # unrelated files beside the traces are ignored
    run = _copy(BALANCED, tmp_path / "unrelated")
    (run / "notes.txt").write_text("hello")
    (run / "model.pt").write_bytes(b"\x80\x02junk")
    assert _analyze(run, capsys, "unrelated files")[0] == 0
    # an empty trace file beside good ones
    run = _copy(BALANCED, tmp_path / "emptyfile")
    (run / "rank00005-x.arrows").write_bytes(b"")
    rc, out, err = _analyze(run, capsys, "empty file")
    assert rc == 0 and "rank00005-x.arrows" in out + err
    # every file empty
    run = tmp_path / "allempty"
    run.mkdir()
    for p in _files(BALANCED):
        (run / p.name).write_bytes(b"")
    assert _analyze(run, capsys, "all empty")[0] == 2
    # two files claiming the same rank
    run = _copy(BALANCED, tmp_path / "duprank")
    f0 = _files(run)[0]
    shutil.copy(f0, run / ("rank00000-copy-" + f0.name.split("-", 1)[1]))
    rc, out, err = _analyze(run, capsys, "duplicate rank")
    assert rc == 0 and "also claims rank 0" in out + err
    # files from two different runs in one directory: the newest is analyzed, the other named
    run = _copy(BALANCED, tmp_path / "tworuns")
    for p in _files(SLOW):
        shutil.copy(p, run / p.name)
    rc, out, err = _analyze(run, capsys, "two runs")
    assert rc == 0 and "another run" in out + err
    # missing ranks: 2 of 4
    run = _copy(FOUR, tmp_path / "missing")
    for p in _files(run)[1:3]:
        p.unlink()
    rc, out, err = _analyze(run, capsys, "missing ranks")
    assert rc == 0 and "rank(s) 1, 2" in out + err


#: Any JSON value (the shapes a hostile or broken header can hold).
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
HEADER_FIELDS = [
    "run_id", "rank", "size", "host", "pid", "mono_anchor_ns", "wall_anchor_ns", "clock",
    "boot_id", "timing", "device", "horovod_env", "optimizer", "model", "local_rank",
    "format", "version", "framework",
]  # fmt: skip


@_tries_its_examples
@DAMAGE_SETTINGS
@given(data=st.data())
def test_any_json_value_in_any_header_field(tmp_path: Path, capsys, data) -> None:
    """Exit 0 or 2 with one line, never exit 1 or a traceback, whatever a header field holds."""
    run = _copy(data.draw(st.sampled_from([BALANCED, SLOW])), tmp_path / "run")
    victim = data.draw(st.sampled_from(_files(run)))
    field = data.draw(st.sampled_from(HEADER_FIELDS))
    value = data.draw(JSON_VALUES)
    _rewrite_header(victim, lambda h: {**h, field: value})
    _analyze(run, capsys, f"header {field}")
    capsys.readouterr()
    rc = cli_main(["info", str(run)])
    err = capsys.readouterr().err
    assert rc in (0, 2) and "Traceback" not in err, err


def test_a_size_claim_does_not_drive_the_work(tmp_path: Path, capsys) -> None:
    """One file claiming 10**8 ranks is refused; claims that disagree are reported, and the
    size most files state is used."""
    run = _copy(FOUR, tmp_path / "run")
    files = _files(run)
    _rewrite_header(files[3], lambda h: {**h, "size": 10**8})
    rc, out, _ = _analyze(run, capsys, "size claim")
    assert rc == 0 and "implausible" in out and "3 of 4 rank(s)" in out.splitlines()[0]
    _rewrite_header(files[3], lambda h: {**h, "size": 9})
    rc, out, _ = _analyze(run, capsys, "size claims disagree")
    assert rc == 0 and "disagree on size [4, 9]; using 4" in " ".join(out.split())


def _append_bomb(path: Path, rows: int) -> int:
    """Rewrite a stream with one more batch: ``rows`` copies of its first span, zstd-compressed
    to a few KB (a decompression bomb). Returns the spans before it."""
    import numpy as np
    import pyarrow as pa

    from hvtrace.record.writer import write_options

    reader = pa.ipc.open_stream(pa.py_buffer(path.read_bytes()))
    schema, batches = reader.schema, list(reader)
    bomb = batches[-1].take(pa.array(np.zeros(rows, np.int64)))
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, schema, options=write_options()) as w,
    ):
        for b in [*batches, bomb]:
            w.write_batch(b)
    return sum(b.num_rows for b in batches)


def test_a_small_batch_claiming_millions_of_rows_is_not_expanded(tmp_path: Path, capsys) -> None:
    """A batch whose metadata claims far more rows than its compressed bytes can plausibly hold
    is refused before decompression; the batches before it are kept and the report says so."""
    import pyarrow as pa

    from hvtrace.format.read import MAX_EXPANSION, StreamScan, plausible_batches, read_rank_file

    run = _copy(FOUR, tmp_path / "run")
    victim = _files(run)[3]
    kept = _append_bomb(victim, 3_000_000)
    assert victim.stat().st_size < 1 << 20  # a few hundred KB on disk ...
    n, why = plausible_batches(victim)  # ... claiming ~130 MB
    assert n is not None and "claims 3,000,000 rows" in why and f"over {MAX_EXPANSION}x" in why
    before = pa.total_allocated_bytes()
    with StreamScan(victim) as scan:
        got = sum(b.num_rows for b, _ in scan)
        peak = pa.total_allocated_bytes() - before
    assert got == kept and scan.truncated and "not expanded" in scan.refused
    assert peak < 16 << 20, f"{peak:,} bytes allocated: the bomb was expanded"
    rf = read_rank_file(victim)
    assert rf.spans == kept and rf.truncated and rf.refused
    rc, out, _ = _analyze(run, capsys, "decompression bomb")
    text = " ".join(out.split())
    assert rc == 0 and victim.name in text and "claims 3,000,000 rows" in text, text
    assert f"{kept} spans kept before it" in text
    # a plausible stream of the same size is read whole (the bound is not the row count)
    assert plausible_batches(_files(run)[0]) == (None, "")


def test_a_small_row_group_claiming_millions_of_rows_is_not_decoded(tmp_path: Path, capsys) -> None:
    """The same bound for a compacted file: a row group whose footer claims far more rows than
    its compressed bytes can hold is neither decoded by the careful reader nor given to DuckDB."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hvtrace.analysis import analyze
    from hvtrace.format.read import plausible_row_groups, read_rank_file
    from hvtrace.load import open_run

    run = _compacted(FOUR, tmp_path / "run")
    victim = _files(run)[3]
    table = pq.read_table(victim)
    meta = dict(pq.read_metadata(victim).metadata)
    kept = table.num_rows
    bomb = table.slice(kept - 1, 1).take(pa.array(np.zeros(3_000_000, np.int64)))
    with pq.ParquetWriter(victim, table.schema.with_metadata(meta), compression="zstd") as w:
        w.write_table(table)
        w.write_table(bomb, row_group_size=4_000_000)
    assert victim.stat().st_size < 1 << 20
    n, why = plausible_row_groups(pq.read_metadata(victim))
    assert n == 1 and "claims 3,000,000 rows" in why
    rf = read_rank_file(victim, read_spans=False)
    assert rf.refused and rf.truncated and rf.n_spans == kept and rf.table.num_rows == kept
    rc, out, _ = _analyze(run, capsys, "parquet bomb")
    text = " ".join(out.split())
    assert rc == 0 and "claims 3,000,000 rows" in text and f"{kept} spans kept" in text, text
    opened = open_run(run)
    a = analyze(opened)  # the engine reads the kept spans, not the bomb
    assert a.read["spans_total"] == sum(int(f.n_spans) for f in opened.files.values()) < 10_000
    assert 0 < a.read["spans"] <= a.read["spans_total"]
