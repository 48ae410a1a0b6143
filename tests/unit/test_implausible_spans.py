"""Spans a recorder cannot have written (issue 41, "implausible values"), in real rank files:
duplicate rows, an end before its start, an impossible byte count. Each is left out of the figures
(or counted as unknown), reported as one problem line per rank and kind, and the rest of the run
is analyzed as if it were not there."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers import synth_module

from hvtrace.analysis import analyze
from hvtrace.load import open_run

STEPS = 24


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean")
    synth_module().write_synth_run(d, ranks=2, steps=STEPS, tensors=4, slow_rank=-1)
    return d


def _damaged(clean: Path, tmp: Path, change) -> Path:
    """A copy of the clean run whose rank 1 file is rewritten by ``change(table) -> table``
    (the header, in the schema's metadata, kept)."""
    d = tmp / "run"
    shutil.copytree(clean, d)
    (f,) = [p for p in d.iterdir() if p.name.startswith("rank00001")]
    t = pq.read_table(f)
    t2 = change(t).replace_schema_metadata(t.schema.metadata)
    f.unlink()
    pq.write_table(t2, f, row_group_size=5_000)
    return d


def _row(t: pa.Table, kind: str) -> int:
    """The index of the first span of ``kind`` at step 5."""
    m = pc.and_(pc.equal(pc.cast(t["kind"], pa.string()), kind), pc.equal(t["step"], 5))
    return int(np.flatnonzero(m.to_numpy(zero_copy_only=False))[0])


def _set(t: pa.Table, col: str, i: int, value: int) -> pa.Table:
    v = t[col].to_numpy().copy()
    v[i] = value
    return t.set_column(t.schema.get_field_index(col), col, pa.array(v, t.schema.field(col).type))


def test_duplicate_rows_are_counted_once(clean: Path, tmp_path: Path) -> None:
    want = analyze(open_run(clean))
    d = _damaged(clean, tmp_path, lambda t: pa.concat_tables([t, t]))
    a = analyze(open_run(d))
    w, g = want.per_rank.set_index("rank"), a.per_rank.set_index("rank")
    for col in ("step_ms", "forward_ms", "backward_ms", "allreduce_ms"):
        assert g.loc[1, col] == pytest.approx(w.loc[1, col], rel=1e-9), col
    assert a.collectives["n_ranks"].max() == 2
    lines = [p for p in a.problems if "duplicate spans" in p]
    assert len(lines) == 1 and lines[0].startswith("rank 1: ")
    # every copy the engine reads (a step's work: not its scalars or clock rows) once
    kinds = pc.cast(pq.read_table(next(clean.glob("rank00001*")))["kind"], pa.string())
    work = pc.sum(pc.invert(pc.is_in(kinds, pa.array(["scalar", "clock"])))).as_py()
    assert (
        lines[0] == f"rank 1: {work} duplicate spans (a step recorded twice: more than one "
        "step span): counted once"
    )


def test_a_span_that_ends_before_it_starts_is_left_out(clean: Path, tmp_path: Path) -> None:
    def change(t: pa.Table) -> pa.Table:
        i = _row(t, "forward")
        return _set(t, "end_ns", i, int(t["start_ns"][i].as_py()) - 1_000_000_000)

    a = analyze(open_run(_damaged(clean, tmp_path, change)))
    st = a.steps
    assert (st["forward_ns"].dropna() >= 0).all() and (st["step_ns"].dropna() >= 0).all()
    assert [p for p in a.problems if "end before they start" in p] == [
        "rank 1: 1 spans end before they start: left out of the figures"
    ]
    assert all(f.value is None or f.value == f.value for f in a.findings)


def test_an_impossible_byte_count_is_unknown_not_a_bandwidth(clean: Path, tmp_path: Path) -> None:
    def change(t: pa.Table) -> pa.Table:
        return _set(t, "bytes", _row(t, "allreduce"), np.iinfo(np.int64).max)

    a = analyze(open_run(_damaged(clean, tmp_path, change)))
    bw = a.tensors[[c for c in a.tensors.columns if c.endswith("_gbps")]].to_numpy(float)
    assert not (bw < 0).any()
    assert a.collectives["bytes"].max() < 1 << 50
    assert [p for p in a.problems if "byte count" in p] == [
        "rank 1: 1 spans carry an impossible byte count (< 0 or > 1 PiB): counted as unknown (0)"
    ]


def test_a_rank_whose_byte_counts_are_all_impossible_has_no_bandwidth_not_zero(
    clean: Path, tmp_path: Path
) -> None:
    def change(t: pa.Table) -> pa.Table:
        m = pc.equal(pc.cast(t["kind"], pa.string()), "allreduce").to_numpy(zero_copy_only=False)
        v = t["bytes"].to_numpy().copy()
        v[m] = np.iinfo(np.int64).max
        i = t.schema.get_field_index("bytes")
        return t.set_column(i, "bytes", pa.array(v, t.schema.field("bytes").type))

    a = analyze(open_run(_damaged(clean, tmp_path, change)))
    bw = a.per_rank.set_index("rank")["algbw_gbps"]
    assert np.isnan(bw[1]) and bw[0] > 0, bw.to_dict()


def test_a_clean_run_has_no_such_problem(clean: Path) -> None:
    a = analyze(open_run(clean))
    assert not [p for p in a.problems if p.startswith("rank ")]
