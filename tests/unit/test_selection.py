"""The step range and rank list selections (hvtrace.selection): parsed once, applied the same way
on arrays, in pandas, in SQL and on row-group statistics."""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import pytest

from hvtrace.cli import _step_range as parse_steps
from hvtrace.selection import SelectionError, StepRange, format_ranks, parse_ranks


@pytest.mark.parametrize(
    ("text", "first", "stop"),
    [("3:7", 3, 7), ("3:", 3, None), (":7", 0, 7), ("5", 5, 6), (" 2 : 4 ", 2, 4), ("0:", 0, None)],
)
def test_parse(text: str, first: int, stop: int | None) -> None:
    r = StepRange.parse(text)
    assert (r.first, r.stop) == (first, stop)
    assert r == StepRange(first, stop)  # a value: equal and hashable
    assert len({r, StepRange(first, stop)}) == 1


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("x", "is not a step range"),
        ("1:b", "is not a step range"),
        ("1.5:3", "is not a step range"),
        ("", "is not a step range"),
        ("9:3", "selects no step"),
        ("3:3", "selects no step"),
        ("-1:3", "selects no step"),
        ("-2", "selects no step"),
    ],
)
def test_parse_errors_are_one_line(text: str, words: str) -> None:
    with pytest.raises(SelectionError) as e:
        StepRange.parse(text)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and repr(text) in msg
    assert isinstance(e.value, ValueError)


def test_constructor_checks_and_of() -> None:
    with pytest.raises(SelectionError, match="select no step"):
        StepRange(4, 4)
    with pytest.raises(SelectionError):
        StepRange(-1)
    assert StepRange.of(None) is None
    r = StepRange(1, 3)
    assert StepRange.of(r) is r
    assert StepRange.of((1, 3)) == r and StepRange.of((np.int64(2), None)) == StepRange(2)
    with pytest.raises(SelectionError):
        StepRange.of((3, 3))


def test_label_last_contains_to_list() -> None:
    assert StepRange(3, 10).label() == "3..9" and StepRange(3).label() == "3..end"
    assert StepRange(3, 10).last == 9 and StepRange(3).last is None
    r = StepRange(2, 4)
    assert [s for s in range(6) if r.contains(s)] == [2, 3]
    assert StepRange(2).contains(10**9) and not StepRange(2).contains(1)
    assert r.to_list() == [2, 4] and StepRange(5).to_list() == [5, None]


def test_mask_on_numpy_and_pandas() -> None:
    steps = np.arange(8)
    assert StepRange(2, 5).mask(steps).tolist() == [s in (2, 3, 4) for s in range(8)]
    assert StepRange(6).mask(steps).tolist() == [s >= 6 for s in range(8)]
    ser = pd.Series([0, 5, 3, 9], index=[10, 11, 12, 13])
    m = StepRange(3, 9).mask(ser)
    assert isinstance(m, pd.Series) and list(m.index) == [10, 11, 12, 13]
    assert m.tolist() == [False, True, True, False]


def test_sql_predicate_matches_mask() -> None:
    assert StepRange(3, 10).sql() == "step BETWEEN 3 AND 9"
    assert StepRange(3).sql("s.step") == "s.step >= 3"
    steps = np.arange(20)
    for r in (StepRange(3, 10), StepRange(0, 1), StepRange(7)):
        where = r.sql("x")
        if "BETWEEN" in where:
            lo, hi = (int(v) for v in where.split("BETWEEN")[1].split("AND"))
            expect = (steps >= lo) & (steps <= hi)
        else:
            expect = steps >= int(where.split(">=")[1])
        assert (r.mask(steps) == expect).all(), where


def test_overlaps_row_group_statistics() -> None:
    r = StepRange(10, 20)  # steps 10..19
    assert r.overlaps(0, 10) and r.overlaps(19, 30) and r.overlaps(12, 15) and r.overlaps(0, 99)
    assert not r.overlaps(0, 9) and not r.overlaps(20, 30)
    assert StepRange(10).overlaps(50, 60) and not StepRange(10).overlaps(0, 9)


@pytest.mark.parametrize(
    ("text", "ranks", "canonical"),
    [
        ("0,3,5-7", {0, 3, 5, 6, 7}, "0,3,5-7"),
        ("7", {7}, "7"),
        ("3,1,2", {1, 2, 3}, "1-3"),
        (" 0 , 2-2 ,", {0, 2}, "0,2"),
        ("0-3,2-5,9", {0, 1, 2, 3, 4, 5, 9}, "0-5,9"),
    ],
)
def test_ranks_round_trip(text: str, ranks: set[int], canonical: str) -> None:
    got = parse_ranks(text)
    assert got == frozenset(ranks)
    assert format_ranks(got) == canonical
    assert parse_ranks(format_ranks(got)) == got


@pytest.mark.parametrize("text", ["", ",", "a", "3-1", "-1", "1-", "0,x"])
def test_rank_errors_are_one_line(text: str) -> None:
    with pytest.raises(SelectionError) as e:
        parse_ranks(text)
    assert "\n" not in str(e.value) and repr(text) in str(e.value)


def test_format_ranks_empty_and_unsorted() -> None:
    assert format_ranks([]) == ""
    assert format_ranks([5, 4, 4, 0]) == "0,4-5"


def test_cli_type_turns_selection_errors_into_usage_errors() -> None:
    assert parse_steps("5:10") == StepRange(5, 10)
    with pytest.raises(argparse.ArgumentTypeError, match="selects no step"):
        parse_steps("9:3")
