"""Live detection's judge: the verdicts of one window of steps, as the offline analysis decides.

Each rank reduces a window of steps to a matrix (:data:`hvtrace.format.schema.LIVE_COLS`: one row
per step, :func:`hvtrace.record.live.step_matrix`); rank 0 gathers them and hands them to this
module in a child process (``python -m hvtrace.analysis.live``, started by
:class:`hvtrace.record.live.LiveMonitor`): its pandas work never holds the training process's
GIL. On stdin, per window, a line of JSON (``size``, ``hosts``, ``rows``, ``cols``) then ``rows x
cols`` float64 values (``figures``: rank 0 wants the window's per-step figures back); on stdout,
one line of JSON per window: ``verdicts`` (the list of :func:`verdicts`) and ``figures``
(:func:`window_points`, where asked), or ``error``. Where ``HVTRACE_TENSORBOARD`` names a
directory, it also writes each window's steps there as TensorBoard scalars. It exits at the end
of its input.

The decision is the offline analysis's own (:func:`hvtrace.analysis.stragglers.straggler_table`
on a step table built as :func:`hvtrace.analysis.steps.finish_steps` builds it): one
definition, so the live verdict and ``hvtrace analyze --steps`` of the same steps name the same
rank and phase.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis.lockstep import describe, lone_forwards, sequence_break
from hvtrace.analysis.steps import PHASES as STEP_PHASES
from hvtrace.analysis.steps import finish_steps, step_summary
from hvtrace.analysis.stragglers import (
    StragglerConfig,
    find_stragglers,
    host_contention,
    straggler_table,
)
from hvtrace.format.lockstep_counts import COUNTS_FRAME_COLS, counts_agree
from hvtrace.format.schema import (
    LIVE_ARRIVAL_COL,
    LIVE_COLS,
    LIVE_COUNT_COL,
    LIVE_COUNTS,
    LIVE_PHASES,
)
from hvtrace.format.tensorboard import Points, add_points, step_points, summary_writer

N_COLS = LIVE_COLS
PHASES = LIVE_PHASES
_ARRIVAL = LIVE_ARRIVAL_COL


def step_frame(gathered: np.ndarray, size: int) -> Any:
    """The step table (as :func:`hvtrace.analysis.steps.finish_steps` makes it) of the gathered
    matrices: ``gathered`` is every rank's :func:`step_matrix`, stacked in rank order."""
    per = gathered.reshape(size, -1, N_COLS)
    flat = per.reshape(-1, N_COLS)
    step_at = 1 + 3 * PHASES.index("step")
    keep = np.isfinite(flat[:, 0]) & np.isfinite(flat[:, step_at])
    rows = flat[keep]  # the steps a rank recorded, in numpy (a window's frame is small: pandas'
    # per-column work was most of its cost)
    cols: dict[str, Any] = {
        "rank": np.repeat(np.arange(size), per.shape[1])[keep],
        "step": rows[:, 0].astype(np.int64),
    }
    for j, p in enumerate(PHASES):
        cols[f"{p}_ns"] = rows[:, 1 + 3 * j]
        for k, which in ((2, "cpu"), (3, "runq")):
            v = rows[:, k + 3 * j]
            if not np.isnan(v).all():  # a counter no rank measured: no column
                cols[f"{p}_{which}_ns"] = v
    for j, c in enumerate(LIVE_COUNTS):
        cols[c] = rows[:, LIVE_COUNT_COL + j]
    for p in STEP_PHASES:
        cols[f"{p}_ns"] = np.where(np.isnan(cols[f"{p}_ns"]), 0.0, cols[f"{p}_ns"])
    cols["model_ns"] = cols["forward_ns"] + cols["backward_ns"] + cols["compute_ns"]
    phase_sum = sum(cols[f"{p}_ns"] for p in STEP_PHASES)
    cols["other_ns"] = np.maximum(cols["step_ns"] - phase_sum, 0.0)
    arrival = rows[:, _ARRIVAL]
    seen = np.isfinite(arrival)
    cols["arrival_ns"] = pd.arrays.IntegerArray(np.where(seen, arrival, 0).astype(np.int64), ~seen)
    cols["has_step"] = np.ones(len(rows), dtype=bool)
    df = pd.DataFrame(cols)
    return finish_steps(df, size)


def counts_frame(counts: np.ndarray, size: int) -> pd.DataFrame:
    """The step table's lockstep columns (``rank``, :data:`COUNTS_FRAME_COLS`) of a counts
    matrix: every rank's rows stacked in rank order, the steps a rank recorded (a finite step)."""
    per = counts.reshape(size, -1, len(COUNTS_FRAME_COLS))
    df = pd.DataFrame({"rank": np.repeat(np.arange(size), per.shape[1])})
    for j, c in enumerate(COUNTS_FRAME_COLS):
        df[c] = per[:, :, j].ravel()
    df = df[np.isfinite(df["step"])].copy()
    df["step"] = df["step"].astype(np.int64)
    df[["backward_ns", "compute_ns"]] = df[["backward_ns", "compute_ns"]].fillna(0)
    return df.drop_duplicates(["rank", "step"], keep="last").reset_index(drop=True)


def lockstep_verdicts(st: pd.DataFrame, size: int) -> list[dict[str, Any]]:
    """The window's lockstep verdicts, from the counts each rank's matrix carries
    (:data:`hvtrace.format.schema.LIVE_COUNTS`), decided by the offline check's own rules
    (:mod:`hvtrace.analysis.lockstep`) on the steps of the window every rank recorded:

    - ``kind`` ``"lockstep"``: the first step whose counts of gradient allreduces or of
      collectives outside the optimizer differ across ranks (:func:`sequence_break`; its
      ``message``: :func:`describe`'s);
    - ``kind`` ``"lone_forward"``: per rank, the steps at which it alone ran a forward with no
      backward (:func:`lone_forwards`): no break alone, kept by rank 0 to name the optimizer
      steps a rank skipped if it then stops short (``stopped``, seen by
      :class:`hvtrace.record.live.LiveMonitor` itself)."""
    if st.empty or "n_allreduce" not in st.columns:
        return []
    st = st[np.isfinite(st["n_allreduce"])]
    ranks_at = st.groupby("step")["rank"].transform("nunique")
    st = st.assign(complete=ranks_at == size)
    if st["rank"].nunique() < 2:
        return []
    out: list[dict[str, Any]] = []
    b = sequence_break(st[st["complete"]])
    if b is not None:
        out.append(dict(b, kind="lockstep", rule=b["kind"], message=describe(b)))
    done = st[st["complete"]]
    for r in sorted(int(x) for x in done["rank"].unique()):
        steps = lone_forwards(done, [r])
        if steps:
            out.append({"kind": "lone_forward", "rank": r, "steps": steps})
    return out


def verdicts(
    gathered: np.ndarray, size: int, hosts: dict[int, str], counts: np.ndarray | None = None
) -> list[dict[str, Any]]:
    """The verdicts of one window, as the offline analysis decides (host-timed thresholds).

    Stragglers (one dict per rank named) and hosts short of CPU (``kind`` ``"host"``: as
    :func:`hvtrace.analysis.stragglers.host_contention` decides). A rank named for contention
    is not a rank verdict: over a window of steps, on a host short of CPU, whichever rank is
    behind waits for a CPU while its peers spin in their wait for it, and the next window it
    may be another rank; the offline analysis, over the whole run, names a rank whose CPU is
    taken away all along (a neighbour pinned to its core). Live, its host is named instead."""
    st = step_frame(gathered, size)
    if counts is not None and len(counts):
        quiet = counts_agree(counts, size, COUNTS_FRAME_COLS)
        lockstep = [] if quiet else lockstep_verdicts(counts_frame(counts, size), size)
    else:
        lockstep = [] if counts_agree(gathered, size) else lockstep_verdicts(st, size)
    if st.empty:
        return lockstep
    cfg = StragglerConfig.for_timing("host_monotonic")
    named = find_stragglers(straggler_table(st, None, hosts, None, 0, cfg))
    med_step_ms = float(st["step_ns"].median()) / 1e6
    first, last = int(st["step"].min()), int(st["step"].max())
    out = []
    contended: dict[str, dict[str, Any]] = {}
    for h in host_contention(st, 0, {r: hosts.get(r, "?") for r in range(size)}).itertuples():
        if h.short:
            contended[str(h.host)] = {
                "kind": "host",
                "host": str(h.host),
                "first_step": first,
                "last_step": last,
                "work_share": round(float(h.work_share), 4),
                "runq_ms": round(float(h.runq_ms), 3),
            }
    for _, v in named.iterrows():
        late = float(v["late_ms"]) if np.isfinite(v["late_ms"]) else 0.0
        cause = str(v.get("cause", "") or "")
        if cause == "contention":
            host = str(v["host"])
            contended.setdefault(
                host,
                {"kind": "host", "host": host, "first_step": first, "last_step": last,
                 "work_share": None, "runq_ms": None},
            )  # fmt: skip
            continue
        out.append(
            {
                "rank": int(v["rank"]),
                "host": str(v["host"]),
                "first_step": first,
                "last_step": last,
                "late_ms": round(late, 3),
                "phase": str(v["phase"]),
                "cause": cause,
                "phase_excess_ms": round(float(v["phase_excess_ms"]), 3),
                "step_share": round(late / med_step_ms, 4) if med_step_ms > 0 else None,
            }
        )
    return out + list(contended.values()) + lockstep


def window_points(gathered: np.ndarray, size: int, after_step: int | None = None) -> Points:
    """The TensorBoard points (:func:`hvtrace.format.tensorboard.step_points`) of a window's
    steps after ``after_step``: the offline per-step table (:func:`step_summary`) of its step
    frame. A window has no allreduce times and no collectives outside the optimizer, so its
    comm/compute and hidden share are absent and its exposed time is the wait in
    ``synchronize()``."""
    st = step_frame(gathered, size)
    if st.empty:
        return []
    st["collective_wait_ns"] = 0.0
    st["comm_ns"] = np.nan
    st["overlap"] = np.nan
    return step_points(step_summary(st), after_step)


class _FiguresFailed(Exception):
    """The window's figures could not be computed (said once on stderr)."""


class _Figures:
    """The judge's per-step figures: written to ``HVTRACE_TENSORBOARD`` where it is set, and
    sent back to rank 0 when it asks (a Lightning job's logger); each step once, however the
    decision windows overlap."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir  # emptied when writing there fails
        self.writer: Any = None
        self.failed = False  # the figures could not be computed: none from now on
        self.last_step: int | None = None

    def points(self, gathered: np.ndarray, size: int, wanted: bool) -> Points:
        """The window's new points (written where asked); raises :class:`_FiguresFailed`, once,
        when they cannot be computed (the verdicts do not depend on them)."""
        if self.failed or (not wanted and not self.log_dir):
            return []
        try:
            pts = window_points(gathered, size, self.last_step)
        except Exception as exc:
            self.failed = True
            sys.stderr.write(f"hvtrace: live figures stopped: {type(exc).__name__}: {exc}\n")
            raise _FiguresFailed from exc
        if pts:
            self.last_step = pts[-1][0]
        if self.log_dir and pts:
            try:
                if self.writer is None:
                    self.writer = summary_writer(self.log_dir)
                add_points(self.writer, pts)
            except Exception as exc:  # noqa: BLE001 - TensorBoard output never ends live detection
                self.log_dir = ""  # rank 0's logger still gets the figures
                sys.stderr.write(f"hvtrace: live TensorBoard output stopped: {exc}\n")
        return pts if wanted else []


def main() -> int:
    """Answer windows until stdin closes, at the lowest CPU priority: the judge is never in a
    hurry, and on a host whose cores the ranks fill it must not slow rank 0 (which would then
    be named the straggler for the judge's own work)."""
    try:
        os.nice(19)
    except OSError:
        pass
    inp, out = sys.stdin.buffer, sys.stdout
    figures = _Figures(os.environ.get("HVTRACE_TENSORBOARD", "").strip())
    while True:
        head = inp.readline()
        if not head:
            return 0
        meta = json.loads(head)
        rows, cols = int(meta["rows"]), int(meta["cols"])
        data = inp.read(rows * cols * 8)
        n_counts = int(meta.get("count_rows", 0))
        counts = np.frombuffer(inp.read(n_counts * len(COUNTS_FRAME_COLS) * 8), dtype=np.float64)
        counts = counts.reshape(n_counts, len(COUNTS_FRAME_COLS))
        gathered = np.frombuffer(data, dtype=np.float64).reshape(rows, cols)
        hosts = {int(k): str(v) for k, v in meta.get("hosts", {}).items()}
        c0 = time.process_time()
        try:
            size = int(meta["size"])
            res: dict[str, Any] = {"verdicts": verdicts(gathered, size, hosts, counts)}
            res["figures"] = figures.points(gathered, size, bool(meta.get("figures")))
        except _FiguresFailed:
            res["figures"] = []  # the verdicts stand; the figures are off from now on
        except Exception as exc:  # noqa: BLE001 - one bad window does not end live detection
            res = {"error": f"{type(exc).__name__}: {exc}"}
        res["cpu_s"] = time.process_time() - c0  # this window's judging (the rank's budget)
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
