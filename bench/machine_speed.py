"""How steady this machine's CPUs are: the same fixed piece of work, timed over and over.

    .venv/bin/python bench/machine_speed.py [--seconds 6] [--cpus 0,1] [--together]

Whole-process comparisons (``overhead.py``, ``process_spread.py``) assume that the same work
costs the same CPU time from one process to the next. This times a fixed pure-Python loop
(about 25 ms) on each CPU in turn (``--together``: on all of them at once), by the thread's own
CPU clock, and prints how its cost spreads: the fastest tenth, the median, the slowest tenth,
and the share of pieces that took over 1.3 times the fastest tenth. A hypervisor that slows a
virtual CPU without accounting it as steal shows here as pieces that take far longer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

#: Iterations of the fixed piece of work (about 25 ms of one CPU here).
WORK = 300_000


def _piece() -> float:
    t0 = time.thread_time()
    x = 0
    for i in range(WORK):
        x += i * i
    return time.thread_time() - t0


def timings(cpu: int, seconds: float) -> list[float]:
    """The fixed piece's CPU time (s), over and over for ``seconds``, pinned to ``cpu``."""
    os.sched_setaffinity(0, {cpu})
    end, out = time.monotonic() + seconds, []
    while time.monotonic() < end:
        out.append(_piece())
    return out


def _child(cpu: int, seconds: float, q: mp.Queue) -> None:
    q.put((cpu, timings(cpu, seconds)))


def describe(cpu: int, ts: list[float], together: bool) -> str:
    """One line: the spread of ``ts``."""
    ms = sorted(1e3 * t for t in ts)
    q = statistics.quantiles(ms, n=10)
    slow = sum(t > 1.3 * q[0] for t in ms) / len(ms)
    return (
        f"CPU {cpu}{' (all busy)' if together else ''}: {len(ms)} pieces, fastest tenth "
        f"{q[0]:.1f} ms, median {statistics.median(ms):.1f}, slowest tenth {q[-1]:.1f}, "
        f"{100 * slow:.0f}% over 1.3x the fastest tenth"
    )


def main(argv: list[str] | None = None) -> int:
    """Time the piece on each CPU and print the spreads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=6.0, help="per CPU")
    p.add_argument("--cpus", default=None, help="comma-separated CPUs (default: all usable)")
    p.add_argument("--together", action="store_true", help="every CPU busy at once")
    args = p.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else sorted(os.sched_getaffinity(0))
    if args.together:
        q: mp.Queue = mp.Queue()
        procs = [mp.Process(target=_child, args=(c, args.seconds, q)) for c in cpus]
        for pr in procs:
            pr.start()
        got = dict(q.get() for _ in procs)
        for pr in procs:
            pr.join()
        for c in cpus:
            print(describe(c, got[c], True))
    else:
        for c in cpus:
            print(describe(c, timings(c, args.seconds), False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
