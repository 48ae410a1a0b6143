"""What the switch check's perf event costs a context switch of the thread it watches.

    .venv/bin/python bench/switch_cost.py [--trips 100000] [--rounds 6]

The compiled counter reader (``hvtrace.record._hot.ThreadReader``) opens a perf event on the
training thread whose user page tells it, without a system call, whether the thread was switched
out since the CPU clock was last read (``hvtrace/record/cpustat.py``). The kernel updates that
page at each switch of the thread, so each switch costs more while the event is open. Here the
main thread and a peer thread, both pinned to one CPU, pass a byte back and forth through two
pipes (each round trip switches the main thread out and in once); rounds alternate between a
reader with the event open and one without (``ThreadCounters(derive=False)``), and the figure is
the median of the per-round differences in µs per round trip, beside what one reading costs each
way (a derived one, and one that reads the clock). The reader reviews itself against the same
trade (every 4096 readings it keeps the event only while the derived readings saved more than the
switches cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

from hvtrace.record.cpustat import ThreadCounters


def round_trips(n: int) -> float:
    """µs per round trip of one byte between this thread and a peer on the same CPU."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    cpu = {min(os.sched_getaffinity(0))}

    def peer() -> None:
        os.sched_setaffinity(0, cpu)
        for _ in range(n):
            os.write(b_w, os.read(a_r, 1))

    t = threading.Thread(target=peer)
    t.start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpu)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(a_w, b"x")
            os.read(b_r, 1)
        dt = time.perf_counter() - t0
    finally:
        os.sched_setaffinity(0, before)
        t.join()
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
    return dt / n * 1e6


def reading_ns(read, n: int = 200_000) -> float:
    """ns per call of ``read`` in a loop (the loop's own cost included)."""
    t0 = time.perf_counter()
    for _ in range(n):
        read()
    return (time.perf_counter() - t0) / n * 1e9


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print it."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trips", type=int, default=100_000, help="round trips per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds of each (alternating)")
    args = p.parse_args(argv)
    probe = ThreadCounters()
    if not getattr(probe.read, "switch_check", False):
        print("no switch check here (no compiled reader, no schedstat, or no perf event)")
        return 1
    derived_ns = reading_ns(probe.read)
    probe.close()
    exact = ThreadCounters(derive=False)
    exact_ns = reading_ns(exact.read)
    exact.close()
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(2 * args.rounds):
        on = r % 2 == 0
        c = ThreadCounters(derive=on)  # the event is open while c's reader lives
        assert getattr(c.read, "switch_check", False) == on
        times[on].append(round_trips(args.trips))
        c.close()
        del c
    diffs = [a - b for a, b in zip(times[True], times[False])]
    print(
        f"round trip, µs: with the event {statistics.median(times[True]):.2f}, without "
        f"{statistics.median(times[False]):.2f}; added per switch of the watched thread "
        f"{statistics.median(diffs):.2f} (rounds: {', '.join(f'{d:.2f}' for d in diffs)})"
    )
    print(
        f"one reading from Python, ns: derived {derived_ns:.0f}, reading the clock "
        f"{exact_ns:.0f}; saved per derived reading {(exact_ns - derived_ns) / 1e3:.2f} µs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
