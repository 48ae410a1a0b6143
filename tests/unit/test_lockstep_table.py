"""The lockstep check on step tables: where ranks stopped taking the same steps, and no word
about runs whose ranks kept in step."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from hvtrace.analysis.lockstep import describe, lockstep_breaks
from hvtrace.analysis.model import RankState


def _steps(last: dict[int, int], n_ar: int = 6, edit=None) -> pd.DataFrame:
    rows = []
    for r, stop in last.items():
        for s in range(stop + 1):
            rows.append(
                {"rank": r, "step": s, "step_ns": 1e7, "n_allreduce": n_ar, "n_collective": 0,
                 "backward_ns": 4e6, "compute_ns": 0.0}
            )  # fmt: skip
    st = pd.DataFrame(rows)
    if edit is not None:
        edit(st)
    counts = st.groupby("step")["rank"].transform("nunique")
    st.insert(2, "complete", counts == len(last))
    return st


def _states(last: dict[int, int], **kw) -> list[RankState]:
    return [RankState(r, kw.get("complete", True), False, 0, s) for r, s in last.items()]


def _join(step: int, rank_count: int = 1) -> pd.DataFrame:
    return pd.DataFrame({"step": [step], "name": ["join|input|"], "n_spans": [rank_count]})


def test_ranks_in_step_get_nothing() -> None:
    last = {0: 39, 1: 39, 2: 39}
    assert lockstep_breaks(_steps(last), None, _states(last)) == []


def test_a_rank_that_stopped_and_joined_is_named_with_how_long_the_others_went_on() -> None:
    last = {0: 15, 1: 31}
    out = lockstep_breaks(_steps(last), _join(16), _states(last))
    assert len(out) == 1
    b = out[0]
    assert (b["kind"], b["ranks"], b["step"], b["others"], b["steps_without"], b["joined"]) == (
        "stopped",
        [0],
        15,
        [1],
        16,
        True,
    )
    msg = describe(b)
    assert "rank 0 stopped training after step 15 while rank 1 went on to step 31" in msg
    assert "hvd.join" in msg and "16 more step(s)" in msg


def test_a_step_with_no_backward_and_no_allreduce_is_a_skipped_step() -> None:
    last = {0: 29, 1: 29}

    def skip(st: pd.DataFrame) -> None:
        at = (st["rank"] == 1) & (st["step"] == 12)
        st.loc[at, ["n_allreduce", "backward_ns"]] = 0

    b = lockstep_breaks(_steps(last, edit=skip), None, _states(last))[0]
    assert (b["kind"], b["step"], b["ranks"], b["skipped"]) == ("sequence", 12, [1], True)
    assert "rank 1 skipped step 12 (no backward, no allreduce) (rank 0: 6, rank 1: 0)" in (
        describe(b)
    )


def test_the_odd_rank_out_of_four_is_named_and_only_the_first_break() -> None:
    last = {r: 19 for r in range(4)}

    def extra(st: pd.DataFrame) -> None:
        st.loc[(st["rank"] == 2) & (st["step"] >= 7), "n_collective"] = 1
        st.loc[(st["rank"] == 3) & (st["step"] == 9), "n_allreduce"] = 5

    out = lockstep_breaks(_steps(last, edit=extra), None, _states(last))
    # the collectives part first, at step 7 (the allreduces at step 9: after it, not reported)
    assert [(b["step"], b["ranks"], b["what"], b["majority"]) for b in out] == [
        (7, [2], "collectives outside the optimizer", True)
    ]
    assert not out[0]["skipped"] and out[0]["counts"] == {"0": 0, "1": 0, "2": 1, "3": 0}
    assert "rank 2 issued a different number of collectives outside the optimizer at step 7" in (
        describe(out[0])
    )


@pytest.mark.parametrize("why", ["dropped", "truncated", "not closed", "elastic"])
def test_ranks_not_judged_where_other_findings_explain_them(why: str) -> None:
    last = {0: 15, 1: 31}
    states = _states(last)
    if why == "dropped":
        states[0] = RankState(0, True, False, 10, 15)
    elif why == "truncated":
        states[0] = RankState(0, False, True, 0, 15)
    elif why == "not closed":
        states[0] = RankState(0, False, False, 0, 15)
    elastic = why == "elastic"
    assert lockstep_breaks(_steps(last), _join(16), states, elastic=elastic) == []


def test_a_rank_with_an_input_gap_after_its_last_step_did_not_go_on() -> None:
    """The input gap recorded after a rank's last step (no step span) is not a step taken."""
    last = {0: 19, 1: 19}

    def gap(st: pd.DataFrame) -> None:
        st.loc[len(st)] = {"rank": 0, "step": 20, "step_ns": np.nan, "n_allreduce": 0,
                           "n_collective": 0, "backward_ns": 0.0, "compute_ns": 0.0}  # fmt: skip

    assert lockstep_breaks(_steps(last, edit=gap), None, _states(last)) == []


def test_a_table_without_a_finished_step_gets_nothing_not_an_error() -> None:
    last = {0: 3, 1: 3}

    def unfinished(st: pd.DataFrame) -> None:
        st["step_ns"] = np.nan

    assert lockstep_breaks(_steps(last, edit=unfinished), None, _states(last)) == []


def _forwards(extra: dict[int, list[int]]):
    """An edit giving every step one forward and one backward, and the listed (rank: steps) a
    second forward with no backward (a skipped batch's forward, or an extra metric forward)."""

    def edit(st: pd.DataFrame) -> None:
        st["n_forward"], st["n_backward"] = 1, 1
        for r, steps in extra.items():
            st.loc[(st["rank"] == r) & st["step"].isin(steps), "n_forward"] = 2

    return edit


def test_a_rank_short_of_a_step_with_a_forward_that_had_no_backward_is_named_at_that_step() -> None:
    last = {0: 29, 1: 28}
    out = lockstep_breaks(_steps(last, edit=_forwards({1: [12]})), _join(29), _states(last))
    assert [(b["kind"], b["ranks"], b["step"], b["skipped_steps"]) for b in out] == [
        ("stopped", [1], 28, [12])
    ]
    assert "rank 1 skipped an optimizer step at step 12" in describe(out[0])


def test_an_extra_forward_alone_is_no_break_and_an_unclear_one_is_not_named() -> None:
    """A rank's extra forward with gradients on (a metric) while it keeps in step: nothing. A
    rank a step short with two such forwards: which one was the skip is not clear, so the break
    is named without a step skipped; one that every rank has explains nothing."""
    same = {0: 29, 1: 29}
    assert lockstep_breaks(_steps(same, edit=_forwards({0: [5]})), None, _states(same)) == []
    last = {0: 29, 1: 28}
    two = lockstep_breaks(_steps(last, edit=_forwards({1: [5, 12]})), _join(29), _states(last))
    assert two[0]["skipped_steps"] == [] and "stopped training after step 28" in describe(two[0])
    both = lockstep_breaks(
        _steps(last, edit=_forwards({0: [12], 1: [12]})), _join(29), _states(last)
    )
    assert both[0]["skipped_steps"] == []
