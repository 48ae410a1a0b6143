"""Vectorized interval arithmetic: union, intersection and merging per group, exact numbers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hvtrace.analysis.overlap import intersection_ns, merge_intervals, union_ns


def arrays(rows):
    g, s, e = zip(*rows) if rows else ((), (), ())
    return np.array(g, np.int64), np.array(s, np.int64), np.array(e, np.int64)


def test_union_of_overlapping_nested_touching_and_disjoint_intervals():
    g, s, e = arrays(
        [
            (0, 0, 10), (0, 5, 15), (0, 20, 30),  # overlap, then a gap: 15 + 10
            (1, 0, 100), (1, 10, 20),  # nested: 100
            (3, 0, 5), (3, 5, 10),  # touching: 10
            (4, 7, 3),  # end before start: empty
        ]
    )  # fmt: skip
    assert union_ns(g, s, e, 5).tolist() == [25, 100, 0, 10, 0]


def test_union_does_not_depend_on_row_order():
    g, s, e = arrays([(0, 20, 30), (1, 10, 20), (0, 5, 15), (1, 0, 100), (0, 0, 10)])
    assert union_ns(g, s, e, 2).tolist() == [25, 100]


def test_merge_intervals_returns_disjoint_sorted_runs():
    g, s, e = arrays([(0, 5, 15), (0, 0, 10), (0, 20, 30), (2, 1, 2), (2, 2, 4)])
    mg, ms, me = merge_intervals(g, s, e)
    assert list(zip(mg.tolist(), ms.tolist(), me.tolist())) == [(0, 0, 15), (0, 20, 30), (2, 1, 4)]


def test_intersection_of_two_unions():
    # A = [0,10] u [20,30], B = [5,25]: A n B = [5,10] u [20,25] = 10; group 1 has no B
    ga, sa, ea = arrays([(0, 0, 10), (0, 20, 30), (0, 22, 28), (1, 0, 50)])
    gb, sb, eb = arrays([(0, 5, 25), (2, 0, 9)])
    assert intersection_ns(ga, sa, ea, gb, sb, eb, 3).tolist() == [10, 0, 0]


def test_empty_input():
    g, s, e = arrays([])
    assert union_ns(g, s, e, 2).tolist() == [0, 0]
    assert intersection_ns(g, s, e, g, s, e, 1).tolist() == [0]


def test_huge_extents_fall_back_without_overflow():
    big = 2**61
    g, s, e = arrays([(k, 0, big) for k in range(8)] + [(k, 5, 10) for k in range(8)])
    assert union_ns(g, s, e, 8).tolist() == [big] * 8


intervals = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 30)), max_size=40
)


def brute(rows, n):
    cover = np.zeros((n, 100), bool)
    for g, s, d in rows:
        cover[g, s : s + d] = True
    return cover


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_union_and_intersection_match_brute_force(a_rows, b_rows):
    n = 4
    ca, cb = brute(a_rows, n), brute(b_rows, n)
    ga, sa, ea = arrays([(g, s, s + d) for g, s, d in a_rows])
    gb, sb, eb = arrays([(g, s, s + d) for g, s, d in b_rows])
    assert union_ns(ga, sa, ea, n).tolist() == ca.sum(axis=1).tolist()
    assert intersection_ns(ga, sa, ea, gb, sb, eb, n).tolist() == (ca & cb).sum(axis=1).tolist()
