"""What live lockstep detection adds to the training process, measured side by side.

    .venv/bin/python bench/lockstep_cost.py [--window 100] [--step-ms 20] [--repeats 7]

Live lockstep detection (issue 44, :mod:`hvtrace.record.live`) adds to the training thread:

1. each step, in :meth:`LiveMonitor.on_step`: the count of the user's collectives handed over
   with the step's entries, and a countdown to the presence read (an attribute or two);
2. each user collective (:mod:`hvtrace.record.collectives`): one attribute increment;
3. each window: the presence allreduce (a tensor of ``size + 1`` float64, issued asynchronously
   beside the window's allgather) and, a chunk of steps later, its ``synchronize`` (done by
   then);

and to the live thread (which holds the GIL the training thread needs while it runs), each step:
the counts of the window matrix (:func:`step_matrix`: allreduced tensors, collectives, forward
and backward passes).

1 and the live thread's share are timed against the code before this change, loaded from git
(``git show <rev>:hvtrace/record/live.py``, ``--rev``, default HEAD), on the same rows in the
same process, alternating; 3 under a one-process Horovod (Gloo), per window, divided by the
window's steps. Figures per step and as a share of ``--step-ms``.
"""

from __future__ import annotations

import argparse
import importlib.util
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from live_cost import rank_rows

from hvtrace.record import live

MS = 1_000_000
REPO = Path(__file__).resolve().parents[1]


def old_live(rev: str):
    """hvtrace.record.live as of ``rev`` (a module of its own), or None if git cannot give it."""
    try:
        src = subprocess.run(
            ["git", "show", f"{rev}:hvtrace/record/live.py"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "live_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("live_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def monitor(mod):
    """A monitor of module ``mod`` without its thread: windows never end, chunks pile up."""
    mon = mod.LiveMonitor.__new__(mod.LiveMonitor)
    mon.window, mon.every, mon.windows_sent, mon.in_window = [], 10**9, 0, 0
    mon.length, mon.chunk_steps, mon._due = 10**9, mod.CHUNK_STEPS, None
    mon._stopped = mon._closed = False
    mon._q = queue.SimpleQueue()
    return mon


def on_step_ns(mod, window: list, repeats: int) -> float:
    """Median ns per on_step call over ``repeats`` runs of the window 100 times."""
    times = []
    for _ in range(repeats):
        mon = monitor(mod)
        t0 = time.perf_counter_ns()
        for rows in window * 100:
            mon.on_step(rows)
        times.append((time.perf_counter_ns() - t0) / (100 * len(window)))
    return statistics.median(times)


def matrix_ns(mod, window: list, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        mod.step_matrix(window, 0)
        times.append((time.perf_counter_ns() - t0) / len(window))
    return statistics.median(times)


def presence_ns(repeats: int) -> float | None:
    """One window's presence allreduce under a one-process Horovod: its enqueue plus, after it
    is done, its synchronize (what the training thread spends); None without Horovod."""
    try:
        import horovod.torch as hvd
        import torch
        from horovod.torch import mpi_ops
    except ImportError:
        return None
    hvd.init()
    times = []
    for k in range(repeats * 20):
        here = torch.from_numpy(np.zeros(hvd.size() + 1))
        t0 = time.perf_counter_ns()
        h = mpi_ops.allreduce_async(here, name=f"bench.here.{k}", op=mpi_ops.Sum)
        t1 = time.perf_counter_ns()
        while not mpi_ops.poll(h):  # done long before it is read (a chunk of steps later)
            time.sleep(0.0005)
        t2 = time.perf_counter_ns()
        mpi_ops.synchronize(h)
        times.append((t1 - t0) + (time.perf_counter_ns() - t2))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--window", type=int, default=100, help="steps per window (default 100)")
    p.add_argument("--step-ms", type=float, default=20.0, help="step time the shares refer to")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rev", default="HEAD", help="git revision of the code before (HEAD)")
    args = p.parse_args(argv)
    before = old_live(args.rev)
    if before is None:
        print("git cannot give the code before: nothing to compare", file=sys.stderr)
        return 1
    n = args.window
    window = [rank_rows(s, s * 40 * MS) for s in range(n)]
    # a step in 10 carries a user collective (a metric averaged every 10 steps)
    counted = [(rows, 1) if s % 10 == 0 else rows for s, rows in enumerate(window)]
    step_ns = args.step_ms * 1e6
    a_on, b_on, a_mx, b_mx = [], [], [], []
    for _ in range(3):  # alternating: the machine's drift falls on both
        b_on.append(on_step_ns(before, window, args.repeats))
        a_on.append(on_step_ns(live, window, args.repeats))
        b_mx.append(matrix_ns(before, window, args.repeats))
        a_mx.append(matrix_ns(live, counted, args.repeats))
    on_b, on_a = min(b_on), min(a_on)
    mx_b, mx_a = min(b_mx), min(a_mx)
    here = presence_ns(args.repeats)
    here_step = (here or 0.0) / n
    added = max(on_a - on_b, 0.0) + max(mx_a - mx_b, 0.0) + here_step
    print(f"live lockstep detection, window {n} steps, rows like a 14-tensor model's "
          f"(best of 3 alternating runs, each a median of {args.repeats}):")  # fmt: skip
    print("                                          before      after      added")
    print(f"  training thread, on_step per step:   {on_b:8.0f} ns {on_a:8.0f} ns "
          f"{on_a - on_b:+8.0f} ns")  # fmt: skip
    print(f"  live thread, step_matrix per step:   {mx_b:8.0f} ns {mx_a:8.0f} ns "
          f"{mx_a - mx_b:+8.0f} ns")  # fmt: skip
    if here is None:
        print("  presence allreduce: Horovod not installed, not measured")
    else:
        print(f"  presence allreduce per window:       {'':>11} {here:8.0f} ns "
              f"= {here_step:6.1f} ns a step")  # fmt: skip
    print(f"  added per step, at most:             {added:8.0f} ns = "
          f"{100 * added / step_ns:.4f} % of a {args.step_ms:g} ms step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
