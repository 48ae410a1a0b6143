"""What live straggler detection costs the training process, per step, measured in pieces.

    .venv/bin/python bench/live_cost.py [--window 100] [--ranks 2,16,64] [--step-ms 20]

Live detection (:mod:`hvtrace.record.live`) does three things in the training process:

1. on the training thread, each step: :meth:`LiveMonitor.on_step` (a list append);
2. on the live thread, each window: :func:`hvtrace.record.live.step_matrix` (the window's rows
   reduced to a matrix: Python, so it holds the GIL the training thread also needs), then one
   allgather (Horovod's background thread does the transfer);
3. on rank 0's live thread, each window: the verdicts, in a child process
   (:mod:`hvtrace.analysis.live`): only a pipe write and read here.

This benchmark times 1 and 2 on rows shaped like a real rank's (phase rows with counter
readings as the recorder takes them, one synchronize's allreduces of 14 tensors), and the
judge's time for 3 (in its own process, so it costs the training process nothing but is
printed to show the judge keeps up). Figures per step and as a share of ``--step-ms``: the
training process's added CPU time, an upper bound of what it can add to the step time.
An in-run A/B of wall time cannot resolve 0.1 % on this machine (its noise is a few %).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from itertools import pairwise

import numpy as np

from hvtrace.format.schema import KIND_CODE
from hvtrace.record import live
from hvtrace.record.rows import Allreduces

MS = 1_000_000


def rank_rows(step: int, t0: int, slow_ms: float = 0.0) -> list:
    """One step's entries as the tracer hands them over, with schedstat-style readings."""
    k = KIND_CODE

    def reading(t: int) -> tuple[int, bytes]:
        return (t // 2, f"{t // 2} {t // 10} {step}\n".encode())

    marks = [t0, t0 + 2 * MS, t0 + int((12 + slow_ms) * MS), t0 + int((24 + slow_ms) * MS)]
    marks += [marks[-1] + 3 * MS, marks[-1] + 8 * MS]
    read = {t: reading(t) for t in marks}  # a boundary's reading is shared, as in the tracer
    rows = []
    for kind, (a, b) in zip(("input", "forward", "backward", "wait", "update"), pairwise(marks)):
        rows.append((step, 0, k[kind], kind, a, b, 0, 0, np.nan, 0, read[a], read[b]))
    rows.append((step, 0, k["step"], "step", marks[0], marks[-1], 0, 0, np.nan, 0,
                 read[marks[0]], read[marks[-1]]))  # fmt: skip
    enq = [(marks[2] - i * 100_000, i, i + 10) for i in range(14)]
    rows.append(Allreduces(step, 0, 2, enq, [], marks[3], {}))
    return rows


def slow_window(m: np.ndarray, size: int) -> np.ndarray:
    """The gathered window of ``size`` ranks each with the window matrix ``m``, rank 1 20 ms
    slower in its forward in every step (the judge then names it)."""
    n = len(m)
    gathered = np.vstack([m] * size)
    gathered[n : 2 * n, 1 + 3 * live.PHASES.index("forward")] += 20 * MS
    return gathered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--window", type=int, default=100, help="steps per window (default 100)")
    p.add_argument("--ranks", default="2,16,64", help="ranks gathered, for the judge's time")
    p.add_argument("--step-ms", type=float, default=20.0, help="step time the shares refer to")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    n = args.window
    window = [rank_rows(s, s * 40 * MS) for s in range(n)]

    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.window, mon.every, mon.windows_sent, mon.in_window = [], 10**9, 0, 0
    mon._stopped = mon._closed = False
    mon.length, mon.chunk_steps, mon.collectives = 10**9, live.CHUNK_STEPS, 0
    mon._due, mon._due_in = None, 0
    mon._q = queue.SimpleQueue()  # (the chunks handed over pile up here: not reduced)
    t0 = time.perf_counter_ns()
    for rows in window * 100:
        mon.on_step(rows)
    on_step_ns = (time.perf_counter_ns() - t0) / (100 * n)

    per = []
    for _ in range(args.repeats):
        t0 = time.perf_counter_ns()
        m = live.step_matrix(window, 0)
        per.append(time.perf_counter_ns() - t0)
    matrix_ns = statistics.median(per) / n
    step_ns = args.step_ms * 1e6
    total = on_step_ns + matrix_ns
    print(f"live detection, window {n} steps, rows like a 14-tensor model's:")
    print(f"  training thread, per step (on_step):        {on_step_ns / 1e3:8.3f} µs")
    print(f"  live thread, per step (step_matrix, GIL):   {matrix_ns / 1e3:8.3f} µs")
    print(f"  training process CPU per step:              {total / 1e3:8.3f} µs = "
          f"{100 * total / step_ns:.3f} % of a {args.step_ms:g} ms step")  # fmt: skip
    for size in [int(x) for x in args.ranks.split(",")]:
        gathered = slow_window(m, size)
        mon2 = live.LiveMonitor.__new__(live.LiveMonitor)
        mon2.hosts, mon2._judge_proc, mon2._judge_q = {i: "h" for i in range(size)}, None, None
        mon2._ask_judge(gathered, size)  # start the process, import pandas
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            res = mon2._ask_judge(gathered, size)
            times.append(time.perf_counter() - t0)
        mon2._stop_judge()
        print(f"  rank 0's judge (child process), {size:>3} ranks: {1e3 * min(times):8.1f} ms per "
              f"window ({n * args.step_ms / 1e3:.1f} s of training); named {[v['rank'] for v in res]}")  # noqa: E501  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
