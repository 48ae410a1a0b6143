"""One bad value a user passes to a recording call never costs the rest of the run (issue 41,
class 1): it is stored escaped or dropped, with one warning per kind of problem, and recording
goes on; every step is in the file."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import make_header

from hvtrace.format.schema import KIND_CODE
from hvtrace.load import open_run
from hvtrace.record import recorder as R

STEPS = 20


@pytest.fixture
def rec(tmp_path: Path, monkeypatch):
    """An active recorder (what ``hvtrace.span`` and ``hvtrace.scalar`` record into) that flushes
    often, so that a bad value has many batches to spoil."""
    r = R.Recorder(tmp_path, make_header(), flush_interval_s=0.02)
    monkeypatch.setattr(R, "_active", r)
    monkeypatch.setattr(R, "_warned", set())
    yield r
    r.close()


def _steps(rec, bad) -> None:
    """STEPS steps of one forward span each; ``bad(step)`` records whatever it records."""
    for s in range(STEPS):
        rec.step = s
        rec.add(KIND_CODE["forward"], "forward", s * 10, s * 10 + 5)
        bad(s)
        time.sleep(0.005)


def test_a_name_that_is_not_unicode_is_stored_escaped_and_the_run_kept(rec, tmp_path, caplog):
    name = os.fsdecode(b"data-\xff.bin")  # a lone surrogate, as any non-UTF-8 file name gives
    with caplog.at_level(logging.WARNING, logger="hvtrace"):

        def bad(s: int) -> None:
            if s in (3, 9):
                with R.span(name):
                    pass
            if s == 5:
                R.scalar(name, 1.0)

        _steps(rec, bad)
        assert rec.enabled
        rec.close()
    spans = open_run(tmp_path).spans
    assert sorted(spans.loc[spans["kind"] == "forward", "step"]) == list(range(STEPS))
    stored = set(spans.loc[spans["kind"].isin(["user", "scalar"]), "name"])
    assert stored == {"data-\\udcff.bin"}  # the code point escaped, nothing lost
    warned = [r.getMessage() for r in caplog.records if "not valid Unicode" in r.getMessage()]
    assert len(warned) == 1, warned


class FloatRaises:
    """A value whose ``__float__`` raises what no number conversion would."""

    def __float__(self) -> float:
        raise ZeroDivisionError("boom")


class StrRaises:
    """A name whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise KeyError("no name")


@pytest.mark.parametrize(
    "value",
    [
        "text",
        b"raw",
        [1, 2],
        None,
        {"a": 1},
        complex(1, 2),
        np.array([1.0, 2.0]),
        object(),
        FloatRaises(),
    ],
    ids=lambda v: type(v).__name__,
)
def test_a_value_that_is_not_a_number_is_dropped_and_recording_goes_on(
    rec, tmp_path, caplog, value
) -> None:
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        _steps(rec, lambda s: (R.scalar("v", value), R.scalar("ok", float(s))))
        assert rec.enabled
        rec.close()
    spans = open_run(tmp_path).spans
    assert sorted(spans.loc[spans["kind"] == "forward", "step"]) == list(range(STEPS))
    ok = spans[(spans["kind"] == "scalar") & (spans["name"] == "ok")]
    assert sorted(ok["value"]) == [float(s) for s in range(STEPS)]
    assert not (spans["name"] == "v").any()
    warned = [r.getMessage() for r in caplog.records if "hvtrace.scalar() got a" in r.getMessage()]
    assert len(warned) == 1 and type(value).__name__ in warned[0], warned


def test_numbers_of_every_kind_are_recorded(rec, tmp_path):
    torch = pytest.importorskip("torch")
    values = [1, 2.5, True, np.float32(0.25), np.int64(7), np.array([3.0]), torch.tensor(4.5)]
    _steps(rec, lambda s: R.scalar("x", values[s]) if s < len(values) else None)
    rec.close()
    spans = open_run(tmp_path).spans
    got = spans.loc[spans["name"] == "x", "value"].tolist()
    assert got == [1.0, 2.5, 1.0, 0.25, 7.0, 3.0, 4.5]


def test_a_name_that_cannot_be_printed_is_recorded_unnamed_and_recording_goes_on(
    rec, tmp_path, caplog
) -> None:
    def bad(s: int) -> None:
        if s == 3:
            with R.span(StrRaises()):
                pass
            R.scalar(StrRaises(), 2.0)
        R.scalar("ok", float(s))

    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        _steps(rec, bad)
        assert rec.enabled
        rec.close()
    spans = open_run(tmp_path).spans
    assert sorted(spans.loc[spans["kind"] == "forward", "step"]) == list(range(STEPS))
    assert len(spans[spans["name"] == "ok"]) == STEPS
    unnamed = spans[spans["name"] == R.UNNAMED]
    assert sorted(unnamed["kind"].astype(str)) == ["scalar", "user"]
    assert (unnamed["step"] == 3).all()
    warned = [r.getMessage() for r in caplog.records if "cannot be made a string" in r.getMessage()]
    assert len(warned) == 2 and {"span()" in w for w in warned} == {True, False}, warned
