"""What ``--memory-limit`` bounds (issue 41): the spans reduced at once follow the limit, also
within one rank (read a window of whole steps at a time), and the analysis is the same."""

from __future__ import annotations

import struct
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import synth_module
from test_hostile_round2 import _set_step_stats

from hvtrace.analysis import engine
from hvtrace.analysis.engine import (
    GROUP_SPANS,
    MIN_GROUP_SPANS,
    Engine,
    group_spans,
    summarize,
)
from hvtrace.format.schema import COLUMNS
from hvtrace.load import open_run, span_sources
from hvtrace.selection import StepRange

#: Spans a step of the synthetic rank: input, forward, backward, wait, update, step and one
#: allreduce per tensor (its loss scalar is not a step's work).
TENSORS = 96
PER_STEP = TENSORS + 6


def test_the_groups_follow_the_limit() -> None:
    assert group_spans(64 << 20) == 131_072  # 64 MiB / 512 bytes a span
    assert group_spans(1 << 20) == MIN_GROUP_SPANS
    assert group_spans(100 << 30) == GROUP_SPANS


def _fetches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spans of each group the engine fetches, recorded."""
    sizes: list[int] = []
    fetch = Engine.fetch

    def recorded(self, sources, steps):  # type: ignore[no-untyped-def]
        cols = fetch(self, sources, steps)
        sizes.append(len(cols["k"]))
        return cols

    monkeypatch.setattr(Engine, "fetch", recorded)
    return sizes


def _same(a: engine.Summaries, b: engine.Summaries) -> None:
    pd.testing.assert_frame_equal(a.steps, b.steps)
    pd.testing.assert_frame_equal(a.users, b.users)
    pd.testing.assert_frame_equal(a.collectives, b.collectives)
    assert (a.spans_read, a.row_groups_read, a.row_groups_total) == (
        b.spans_read, b.row_groups_read, b.row_groups_total,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank of 2,000 steps of 96 tensors: 204,000 spans of work, more than a group holds at
    a 64 MiB limit (131,072)."""
    d = tmp_path_factory.mktemp("one_rank")
    synth_module().write_synth_run(d, ranks=1, steps=2000, tensors=TENSORS, slow_rank=-1)
    return d


def test_a_rank_larger_than_the_limit_allows_is_read_in_windows(
    one_rank: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = open_run(one_rank)
    sizes = _fetches(monkeypatch)
    whole = summarize(span_sources(run), max_group_spans=GROUP_SPANS)
    assert sizes == [2000 * PER_STEP]  # the rank at once
    sizes.clear()
    limited = summarize(span_sources(run), memory_limit_bytes=64 << 20)
    # two windows of whole steps, none past the group's size (by less than a step)
    assert len(sizes) == 2 and sum(sizes) == 2000 * PER_STEP
    assert max(sizes) <= group_spans(64 << 20) + PER_STEP
    _same(whole, limited)
    assert len(limited.collectives) == 2000 * TENSORS


def test_windows_keep_within_a_step_selection(
    one_rank: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = open_run(one_rank)
    sel = StepRange(333, 1777)
    whole = summarize(span_sources(run, sel), sel, max_group_spans=GROUP_SPANS)
    sizes = _fetches(monkeypatch)
    windows = summarize(span_sources(run, sel), sel, max_group_spans=20_000)
    assert len(sizes) >= 7 and max(sizes) <= 20_000 + PER_STEP
    _same(whole, windows)
    assert sorted(windows.steps["step"].unique()) == list(range(333, 1777))


@pytest.mark.parametrize("group", [0, 1], ids=["below-the-file's-min", "within-its-range"])
def test_step_statistics_that_lie_are_not_trusted_to_cut_a_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int
) -> None:
    """A window read by the engine skips row groups by their footer's step statistics; a rank
    whose statistics lie is not cut (read whole, as without a limit), so nothing is lost.
    Row group 0 claiming steps 200..211 leaves steps below the file's stated minimum (DuckDB's
    count by step then fails); row group 1 claiming them leaves the stated range whole, and
    only the windows' count check sees the lie."""
    synth_module().write_synth_run(
        tmp_path, ranks=1, steps=300, tensors=8, slow_rank=-1, row_group_rows=500
    )
    path = next(tmp_path.glob("*.parquet"))
    run = open_run(tmp_path)
    honest = summarize(span_sources(run), max_group_spans=GROUP_SPANS)
    st = pq.read_metadata(path).row_group(group).column(COLUMNS.index("step")).statistics
    lo, hi = st.min, st.max
    _set_step_stats(path, group, struct.pack("<i", 200), struct.pack("<i", 211))
    # the engine believes them: a window of that row group's real steps skips it
    ((seen,),) = duckdb.execute(
        "SELECT count(*) FROM read_parquet(?) WHERE step >= ? AND step <= ?",
        [str(path), lo, hi],
    ).fetchall()
    assert seen < pq.read_metadata(path).row_group(group).num_rows
    sizes = _fetches(monkeypatch)
    lied = summarize(span_sources(open_run(tmp_path)), max_group_spans=500)
    assert sizes == [300 * 14]  # read whole, never cut by these statistics
    _same(honest, lied)


def test_the_engines_collectives_need_no_second_grouping(one_rank: Path) -> None:
    """The engine's merged collectives (one row per step and tensor, sorted) give the same table
    taken as grouped as grouped again; a row without its key is left out either way."""
    from hvtrace.analysis.bandwidth import finish_collectives

    sel = StepRange(0, 50)
    parts = summarize(span_sources(open_run(one_rank), sel), sel)  # the engine's, merged
    assert len(parts.collectives) == 50 * TENSORS
    with Engine() as eng:  # one group's partials, as a Dask task returns them
        summ = eng.rank_pass(span_sources(open_run(one_rank), sel), sel)
    partials = summ.collectives.sort_values(["step", "name"]).reset_index(drop=True)
    odd = partials.iloc[:1].copy()
    odd["name"] = None
    partials = pd.concat([partials, odd], ignore_index=True)
    pd.testing.assert_frame_equal(
        finish_collectives(partials, grouped=True), finish_collectives(partials)
    )
    pd.testing.assert_frame_equal(finish_collectives(partials, grouped=True), parts.collectives)
