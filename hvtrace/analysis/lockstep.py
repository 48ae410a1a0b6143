"""Ranks out of lockstep: where a rank stopped taking the steps the others took.

Data-parallel training is correct only while every rank takes the same steps and issues the same
collectives in each. Horovod does not check it: a rank that skips a step pairs its allreduces
with the others' of another step from then on, and a rank that stops early and calls
``hvd.join()`` leaves the others training alone, their averages divided by a world that no longer
computes. Both often end with exit 0. This module finds the first place the ranks' recorded
sequences part, from what the analysis already has:

- **stopped**: ranks whose files were closed cleanly but end at different steps: the ranks that
  stopped first, the step, whether they joined (a ``join`` collective at their last step), and
  how many steps the others went on without them; and where such a rank ends short because it
  skipped optimizer steps, the steps it skipped: a step of its with a forward pass that had no
  backward (the skipped batch's forward, counted into the next step) where no other rank has
  one. (Alone, such a forward is no break: a rank may run an extra forward with gradients on,
  as for a metric; only with the steps it then lacks is it named.)
- **sequence**: the first step, among the steps every rank recorded whole, at which the ranks'
  counts of the optimizer's allreduces or of their collectives outside it differ: the rank(s)
  that differ from the others, and what they did (a step with no backward and no allreduce is a
  skipped step).

A rank whose recorder dropped spans, whose file was cut off, or a run whose membership changed
(elastic) is not judged here (those have findings of their own).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis.framework import step_words
from hvtrace.analysis.model import RankState
from hvtrace.format.lockstep_counts import LOCKSTEP_COUNTS

#: The step table's columns compared across ranks at each step, with what they count.
COUNTS: dict[str, str] = dict(
    zip(LOCKSTEP_COUNTS, ("gradient allreduces", "collectives outside the optimizer"), strict=True)
)


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


def lockstep_breaks(
    steps: pd.DataFrame,
    partials: pd.DataFrame | None,
    states: list[RankState],
    elastic: bool = False,
) -> list[dict[str, Any]]:
    """The places the ranks fell out of step (see the module doc), each a JSON-ready dict with
    ``kind`` (``stopped`` or ``sequence``), ``step``, ``ranks`` (those that did differently),
    ``others`` and the details; the earliest first."""
    if elastic or steps.empty or steps["rank"].nunique() < 2:
        return []
    judged = {s.rank for s in states if s.complete and not s.truncated and not s.dropped}
    st = steps[steps["rank"].isin(judged)]
    if st["rank"].nunique() < 2:
        return []
    out = _stopped(st, partials)
    seq = sequence_break(st)
    if seq is not None:
        out.append(seq)
    return sorted(out, key=lambda b: b["step"])


def _stopped(st: pd.DataFrame, partials: pd.DataFrame | None) -> list[dict[str, Any]]:
    taken = st[st["step_ns"].notna()]  # steps the rank finished (not an input gap after its last)
    if taken.empty:
        return []
    last = taken.groupby("rank")["step"].max()
    end = int(last.max())
    went_on = sorted(int(r) for r in last.index[last == end])
    out = []
    for step, group in last[last < end].groupby(last[last < end]):
        ranks = sorted(int(r) for r in group.index)
        joined = False
        if partials is not None and len(partials):
            at = partials["step"].between(step, step + 1)  # issued after its last step
            p = partials[at & partials["name"].astype(str).str.startswith("join|")]
            joined = bool(len(p))
        out.append(
            {
                "kind": "stopped",
                "step": int(step),
                "ranks": ranks,
                "others": went_on,
                "others_last_step": end,
                "steps_without": end - int(step),
                "joined": joined,
                "skipped_steps": _skipped_steps(st, ranks, end - int(step)),
            }
        )
    return out


def _skipped_steps(st: pd.DataFrame, ranks: list[int], short: int) -> list[int]:
    """The earliest ``short`` steps at which every rank of ``ranks`` ran a forward pass without
    a backward and no other rank did (a skipped batch: its forward, then no backward and no
    optimizer step); [] when the step table lacks the counts or no such step explains it."""
    if short < 1:
        return []
    found = lone_forwards(st, ranks)
    return found if len(found) <= short else []


def lone_forwards(st: pd.DataFrame, ranks: list[int]) -> list[int]:
    """The steps at which every rank of ``ranks`` ran a forward pass without a backward and no
    other rank of ``st`` did, in order ([] where the step table lacks the counts). Alone no
    break (a rank may run an extra forward with gradients on, as for a metric): with the steps
    the rank then lacks, the optimizer steps it skipped (:func:`lockstep_breaks`, and live
    detection's ``stopped``)."""
    if "n_forward" not in st.columns or "n_backward" not in st.columns:
        return []
    extra = st["n_forward"].fillna(0) > st["n_backward"].fillna(0)
    mine = st["rank"].isin(ranks)
    theirs = set(st.loc[extra & ~mine, "step"].astype(int))
    steps = st.loc[extra & mine].groupby("step")["rank"].nunique()
    return sorted(int(s) for s, k in steps.items() if k == len(ranks) and int(s) not in theirs)


def sequence_break(st: pd.DataFrame) -> dict[str, Any] | None:
    """The first step, recorded whole by every judged rank (``complete``), whose counts
    (:data:`COUNTS`) differ across ranks: the ``sequence`` break of :func:`lockstep_breaks`, or
    None. Live detection decides a window's the same way (:func:`hvtrace.analysis.live.
    verdicts`), on the counts each rank's window matrix carries."""
    done = st[st["complete"]]
    if done.empty:
        return None
    n = done["rank"].nunique()
    found = []
    for col, what in COUNTS.items():
        if col not in done.columns:
            continue
        wide = done.pivot_table(index="step", columns="rank", values=col, aggfunc="sum")
        wide = wide.dropna()
        if wide.shape[1] < 2:
            continue
        m = wide.to_numpy(dtype=np.int64)
        differ = np.flatnonzero((m != m[:, :1]).any(axis=1))
        if not len(differ):
            continue
        i = int(differ[0])
        row = dict(zip((int(r) for r in wide.columns), (int(v) for v in m[i]), strict=True))
        common, k = Counter(row.values()).most_common(1)[0]
        majority = k > n / 2
        if majority:
            ranks = sorted(r for r, v in row.items() if v != common)
        else:  # no majority (two ranks): the ranks with fewer, or name them all
            low = min(row.values())
            ranks = sorted(r for r, v in row.items() if v == low)
        step = int(wide.index[i])
        at = done[(done["step"] == step) & done["rank"].isin(ranks)]
        skipped = bool(
            col == "n_allreduce"
            and len(at)
            and (at["n_allreduce"] == 0).all()
            and (at["backward_ns"].fillna(0) == 0).all()
            and (at["compute_ns"].fillna(0) == 0).all()
        )
        found.append(
            {
                "kind": "sequence",
                "step": step,
                "ranks": ranks,
                "others": sorted(r for r in row if r not in ranks),
                "what": what,
                "counts": {str(r): v for r, v in row.items()},
                "majority": majority,
                "skipped": skipped,
                "steps_after": int(wide.index.max()) - step,
            }
        )
    return min(found, key=lambda b: b["step"]) if found else None


def describe(b: dict[str, Any]) -> str:
    """One finding's message for a break of :func:`lockstep_breaks`."""
    if b["kind"] == "stopped":
        who, others = _ranks(b["ranks"]), _ranks(b["others"])
        n = b["steps_without"]
        skipped = b.get("skipped_steps") or []
        if skipped:
            at = ", ".join(step_words(s, b) for s in skipped)
            return (
                f"ranks out of lockstep: {who} skipped an optimizer step at {at} (a forward "
                f"pass with no backward and no update, where {others} took the step), so from "
                f"then on its allreduces paired with those of {others} a step ahead, and it ended "
                f"at {step_words(b['step'], b)} while {others} went on to "
                f"{step_words(b['others_last_step'], b)}"
                + (" alone (it joined)" if b["joined"] else "")
                + ": averaged gradients mixed steps and the models drifted apart. Every rank must "
                "run the same steps: skip a bad batch on every rank (decide from a value reduced "
                "across ranks), never on one"
            )
        if b["joined"]:
            tail = (
                f"; it joined (hvd.join), so {others} went on alone for {n} more step(s): "
                "Horovod counts a joined rank's gradients as zeros, so their averaged gradients "
                "were divided among ranks that no longer computed (halved with two ranks), and "
                "the ranks end with different models"
            )
        else:
            tail = (
                f"; {others} went on for {n} more step(s) without it, and the ranks end with "
                "different models"
            )
        return (
            f"ranks out of lockstep: {who} stopped training after {step_words(b['step'], b)} while "
            f"{others} went on to {step_words(b['others_last_step'], b)}{tail}. Every rank must "
            "take the same steps: decide to stop on every rank from a value reduced across "
            "ranks (an averaged metric), never on one rank's own view"
        )
    counts = ", ".join(f"rank {r}: {v}" for r, v in b["counts"].items())
    who = _ranks(b["ranks"])
    if b["skipped"]:
        did = f"{who} skipped {step_words(b['step'], b)} (no backward, no allreduce)"
    else:
        did = f"{who} issued a different number of {b['what']} at {step_words(b['step'], b)}"
    return (
        f"ranks out of lockstep: {did} ({counts}); from then on the ranks' collectives pair "
        f"with other steps' ({b['steps_after']} step(s) after it): averaged gradients mix "
        "steps and the models drift apart. Every rank must run the same steps and issue the "
        "same collectives: skip a bad batch on every rank (decide from a value reduced across "
        "ranks), never on one"
    )


__all__ = ["COUNTS", "describe", "lockstep_breaks", "lone_forwards", "sequence_break"]
