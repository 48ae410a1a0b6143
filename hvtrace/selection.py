"""What part of a run to read: a step range and a set of ranks.

One type each, parsed from the command line once and passed to the reader, the analysis and the
exports, which apply it the same way (``StepRange.mask`` on arrays, ``StepRange.sql`` in DuckDB).
Imports nothing heavy: a training rank may import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class SelectionError(ValueError):
    """A step range or rank list that selects nothing or cannot be parsed (one-line message)."""


@dataclass(frozen=True)
class StepRange:
    """Steps ``first .. stop-1`` (``stop`` None: to the end of the run)."""

    first: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.first < 0 or (self.stop is not None and self.stop <= self.first):
            raise SelectionError(f"steps {self.first}:{self.stop} select no step (need 0 <= A < B)")

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """Parse ``A:B`` (steps A..B-1), ``A:`` (A to the end), ``:B`` or ``A`` (just step A)."""
        t = text.strip()
        try:
            if ":" in t:
                lo_s, hi_s = t.split(":", 1)
                lo = int(lo_s) if lo_s.strip() else 0
                hi = int(hi_s) if hi_s.strip() else None
            else:
                lo = int(t)
                hi = lo + 1
        except ValueError:
            raise SelectionError(
                f"{text!r} is not a step range: use A:B (steps A to B-1), A: or :B"
            ) from None
        if lo < 0 or (hi is not None and hi <= lo):
            raise SelectionError(f"{text!r} selects no step (need 0 <= A < B)")
        return cls(lo, hi)

    @classmethod
    def of(cls, value: StepRange | tuple[int, int | None] | None) -> StepRange | None:
        """Return ``value`` as a StepRange (a ``(first, stop)`` tuple is accepted; None stays)."""
        if value is None or isinstance(value, StepRange):
            return value
        first, stop = value
        return cls(int(first), None if stop is None else int(stop))

    @property
    def last(self) -> int | None:
        """The last step selected (None: to the end)."""
        return None if self.stop is None else self.stop - 1

    def label(self) -> str:
        """``"3..end"`` or ``"3..9"``: the steps selected, for messages."""
        return f"{self.first}..{'end' if self.stop is None else self.stop - 1}"

    def contains(self, step: int) -> bool:
        """True when ``step`` is selected."""
        return step >= self.first and (self.stop is None or step < self.stop)

    def mask(self, steps: Any) -> Any:
        """Return a boolean mask (numpy array or pandas Series, as given) of selected steps."""
        m = steps >= self.first
        if self.stop is not None:
            m &= steps < self.stop
        return m

    def sql(self, column: str = "step") -> str:
        """Return a SQL predicate selecting these steps from ``column`` (integers only)."""
        if self.stop is None:
            return f"{column} >= {int(self.first)}"
        return f"{column} BETWEEN {int(self.first)} AND {int(self.stop) - 1}"

    def overlaps(self, lo: int, hi: int) -> bool:
        """True when steps ``lo..hi`` (inclusive, e.g. a row group's min/max) meet this range."""
        return hi >= self.first and (self.stop is None or lo < self.stop)

    def to_list(self) -> list[int | None]:
        """``[first, stop]`` for JSON."""
        return [self.first, self.stop]


def parse_ranks(text: str) -> frozenset[int]:
    """Parse a rank list: ``0,3,5-7`` (ranges inclusive). Raises :class:`SelectionError`."""
    out: set[int] = set()
    for part in text.split(","):
        p = part.strip()
        if not p:
            continue
        try:
            if "-" in p:
                a, b = p.split("-", 1)
                lo, hi = int(a), int(b)
                if lo < 0 or hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                r = int(p)
                if r < 0:
                    raise ValueError
                out.add(r)
        except ValueError:
            raise SelectionError(
                f"{text!r} is not a rank list: use e.g. 0,3,5-7 (ranks >= 0)"
            ) from None
    if not out:
        raise SelectionError(f"{text!r} selects no rank")
    return frozenset(out)


def rank_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """The distinct ranks as runs of consecutive ones, ``(first, last)`` each, in order."""
    rs = sorted(set(int(r) for r in ranks))
    out: list[tuple[int, int]] = []
    for r in rs:
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def format_ranks(ranks: Iterable[int]) -> str:
    """Return ranks as a compact list: ``0,3,5-7``."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in rank_runs(ranks))
