"""CPU time and run-queue wait of the training thread: the cause of a phase's time.

A phase of a step takes wall time for one of three reasons, and these counters tell them apart:

- **CPU**: the training thread ran on a CPU (``cpu_ns``);
- **run queue**: the training thread was runnable but waited for a CPU that other threads or
  processes held (``runq_ns``: CPU contention, oversubscription);
- **blocked**: neither, the rest of the wall time: the thread slept or waited (for DataLoader
  worker processes, a lock, I/O, Horovod's background thread in ``synchronize``, a CUDA sync).

Only the *training thread* is counted: the thread that created the tracer, which runs the
training loop and calls ``optimizer.step()``. Not torch's intra-op worker threads, not
DataLoader worker processes, not Horovod's background thread, not hvtrace's writer. On a GPU the
counters are the host thread's, not the device's. Autograd hooks may run on other threads (on
CUDA): a reading always samples the training thread's counters, whichever thread takes it.

A *reading* is taken at each phase boundary on the hot path and is one of:

- ``(cpu_ns, schedstat_bytes)``: the thread's CPU clock (``clock_gettime`` of its
  ``pthread_getcpuclockid``) and the raw line of ``/proc/self/task/TID/schedstat`` (CPU time, run
  queue wait and timeslices), read with ``pread`` from a file kept open (one compiled call,
  ``hvtrace.record._hot.ThreadReader``, where it is built; else a closure, its Python twin
  :func:`hvtrace.record.hot.schedstat_reader`). The line is parsed later, by the writer thread
  (:func:`deltas`), never on the hot path. Its first field is not used: the kernel updates it
  only at scheduler ticks and context switches while the thread runs, so it lags by up to a
  tick; the CPU clock is exact. The run queue wait (second field) is current: it
  only grows while the thread is not running, and is added up when the thread is switched in.

  The line is re-read only when it can have changed by more than :data:`RUNQ_SLACK_NS`: the run
  queue wait only grows while the thread is off a CPU, and the time it was off a CPU since the
  last ``pread`` is at most the wall time minus the CPU time elapsed since then (host monotonic
  clock and the thread's CPU clock, both read anyway). Below that, the reading carries the last
  line read (the same ``bytes`` object). A thread that ran without interruption (the common case
  in forward and backward on an uncontended core) thus costs one system call per reading, not
  two; a phase's ``runq_ns`` may then be off by less than :data:`RUNQ_SLACK_NS`, moved to a
  neighbouring phase (their sum, and the step's, stay exact up to the same bound).
  Where the compiled reader runs and Linux lets a process open a perf event on its own thread
  (``perf_event_paranoid`` <= 2, no seccomp filter against ``perf_event_open``), most readings
  make no system call at all (the *switch check*): the kernel changes a counter in the event's
  user page, mapped read-only, at each context switch of the thread. A reading made on the
  training thread that finds it unchanged since the last time the clock was read, at most
  :data:`MAX_DERIVED_NS` ago, knows the thread has run without a break since then: its CPU time
  grew by the wall time (the host monotonic clock, read anyway) and its run-queue wait did not
  grow, so the reading adds the one and reuses the line. It can differ from the CPU clock by the
  interrupts served and the time a hypervisor took the CPU in that stretch (up to
  :data:`MAX_DERIVED_NS`), and by the clock read's return (under a µs) the other way; readings
  never go back. A phase's ``cpu_ns`` is then a difference of such readings. A reading made on
  another thread, after a switch, or when the last clock read is older always reads the clock.
  The perf event counts nothing (``PERF_COUNT_SW_DUMMY``), but the kernel's work on it makes each
  context switch of the training thread dearer (about 1.3 µs on the development VM, against
  about 0.7 µs saved per derived reading; ``bench/switch_cost.py``): after the first 256
  readings, then every 4096, the reader compares the two since the last look (the page's counter
  tells the switches) and closes the event for good where the switches cost more, as on
  oversubscribed CPUs or in waits that spin on ``sched_yield``; every reading reads the clock
  from then on. While recording is off (a failure disabled it, or the job switched it off)
  nothing is derived and no review comes: after 64 optimizer steps without a reading the
  compiled ``step()`` closes the event too. The compiled reader's
  ``exact_reads``, ``derived_reads`` and ``switch_check`` say how it went; closing the counters
  (the recorder's close, a forked child) closes the event.
- ``cpu_ns`` (an int) where schedstat is missing (no ``CONFIG_SCHEDSTATS``, not Linux): CPU time
  only, the run queue wait is unknown (null);
- ``None`` where neither is available.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hvtrace.record.hot import schedstat_reader
from hvtrace.record.native import hot_module

#: Per-thread scheduler counters: ``cpu_ns runq_ns timeslices``.
SCHEDSTAT_PATH = "/proc/self/task/{tid}/schedstat"
#: A reading re-reads schedstat only when the thread may have waited longer than this (ns) since
#: the last time it was read: off a CPU (wall time minus CPU time) for more than this long. The
#: bound on how far a phase's ``runq_ns`` can be off (see the module's docstring).
RUNQ_SLACK_NS = 20_000
#: With the switch check, the CPU clock is read at least this often (ns): a derived reading is
#: at most this far from the last clock read (see the module's docstring).
MAX_DERIVED_NS = 1_000_000

Reading = tuple[int, bytes] | int | None


def _no_reading() -> None:
    return None


class ThreadCounters:
    """Readings of one thread's CPU time and run-queue wait (by default the calling thread's).

    ``read()`` is the hot-path call (one system call, two when the thread was off a CPU for more
    than ``slack_ns`` since schedstat was last read); :attr:`mode` says what it returns:
    ``"schedstat"`` (CPU clock and schedstat line), ``"cputime"`` (CPU clock only) or ``"none"``.
    """

    def __init__(
        self,
        native_id: int | None = None,
        ident: int | None = None,
        slack_ns: int | None = None,
        derive: bool = True,
    ) -> None:
        """``derive``: use the switch check where it can be opened (see the module)."""
        self.native_id = threading.get_native_id() if native_id is None else native_id
        self.ident = threading.get_ident() if ident is None else ident
        self.mode = "none"
        #: With the switch check: the longest stretch (ns) a reading derives; 0: every reading
        #: reads the CPU clock.
        self.derived_max_ns = 0
        self._fd: int | None = None
        self.read: Callable[[], Reading] = _no_reading
        found = _cpu_clock(self.ident)
        if found is None:
            return
        clock, clock_id = found
        self.mode = "cputime"
        self.read = clock
        try:
            fd = os.open(
                SCHEDSTAT_PATH.format(tid=self.native_id),
                os.O_RDONLY | getattr(os, "O_CLOEXEC", 0),
            )
        except OSError:
            return
        try:
            int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            os.close(fd)
            return
        self._fd = fd
        self.mode = "schedstat"
        slack = RUNQ_SLACK_NS if slack_ns is None else slack_ns
        self.read = _schedstat_reader(
            clock,
            fd,
            slack,
            clock_id,
            (self.native_id, self.ident, MAX_DERIVED_NS) if derive else None,
        )
        if getattr(self.read, "switch_check", False):
            self.derived_max_ns = MAX_DERIVED_NS

    def close(self) -> None:
        """Close the schedstat file and the switch check's perf event; later readings are
        ``None`` (a reader still held elsewhere, as the tracer's, reads the clock only)."""
        close_event = getattr(self.read, "close_switch_check", None)
        if close_event is not None:
            close_event()
        self.read = _no_reading
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _cpu_clock(ident: int) -> tuple[Callable[[], int], int] | None:
    """A function returning the thread's CPU time in ns and the clock's id, or None when there
    is none."""
    try:
        clock_id = time.pthread_getcpuclockid(ident)
        time.clock_gettime_ns(clock_id)
    except (AttributeError, OSError, OverflowError):
        return None
    gettime = time.clock_gettime_ns

    def cpu_ns() -> int:
        return gettime(clock_id)

    return cpu_ns, clock_id


def _schedstat_reader(
    clock: Callable[[], int],
    fd: int,
    slack_ns: int,
    clock_id: int | None = None,
    switch_check: tuple[int, int, int] | None = None,
) -> Callable[[], tuple[int, bytes]]:
    """The hot-path reading: the CPU clock, and the schedstat line when it may have changed by
    more than ``slack_ns`` since it was last read (else that line again; see the module).

    The compiled form (``hvtrace.record._hot.ThreadReader``, one call instead of three Python
    calls around the system call) where it is built, ``$HVTRACE_NATIVE`` is on and ``clock_id``
    (the CPU clock's id) is given; else its Python twin's closure
    (:func:`hvtrace.record.hot.schedstat_reader`), which does the same but the switch check.
    ``switch_check``: ``(native thread id, thread ident, max derived ns)`` of the thread counted,
    for the compiled form's switch check (opened where Linux allows; see the module)."""
    hot = hot_module() if clock_id is not None else None
    if hot is not None:
        tid, ident, max_ns = switch_check or (0, 0, 0)
        return hot.ThreadReader(clock_id, fd, slack_ns, tid, ident, max_ns)
    return schedstat_reader(clock, fd, slack_ns)


def runq_ns(raw: bytes) -> int:
    """The run-queue wait (ns) of a schedstat line."""
    return int(raw.split()[1])


def deltas(start: Any, end: Any) -> tuple[int | None, int | None]:
    """``(cpu_ns, runq_ns)`` between two readings; None where not measured (see
    :func:`deltas_columns`, which defines them)."""
    cpu, runq, cpu_ok, runq_ok = deltas_columns([(start, end)])
    return (int(cpu[0]) if cpu_ok[0] else None), (int(runq[0]) if runq_ok[0] else None)


def deltas_columns(
    pairs: Sequence[tuple[Any, Any]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The CPU time and run-queue wait (ns, int64) between each pair of readings ``(start,
    end)``, and whether each was measured (bool): not where a reading is None, no run-queue
    wait where a reading has no schedstat line (the CPU clock only), neither where a counter
    went back (impossible for one thread).

    Called by the writer thread and the live thread, off the hot path but holding the GIL the
    training thread needs: in one pass of C (``hvtrace.record._hot.deltas_into``) where the
    compiled hot path is built and on, else (or for readings it does not take) its Python twin,
    :func:`_deltas_py`; the same columns."""
    n = len(pairs)
    cpu, runq = np.zeros(n, np.int64), np.zeros(n, np.int64)
    cpu_ok, runq_ok = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    into = getattr(hot_module(), "deltas_into", None)
    if into is not None and into(pairs if type(pairs) is list else list(pairs), cpu, runq,
                                 cpu_ok, runq_ok):  # fmt: skip
        return cpu, runq, cpu_ok, runq_ok
    for col in (cpu, runq, cpu_ok, runq_ok):
        col[:] = 0
    _deltas_py(pairs, cpu, runq, cpu_ok, runq_ok)
    return cpu, runq, cpu_ok, runq_ok


def _deltas_py(
    pairs: Sequence[tuple[Any, Any]],
    cpu: np.ndarray,
    runq: np.ndarray,
    cpu_ok: np.ndarray,
    runq_ok: np.ndarray,
) -> None:
    """:func:`deltas_columns`'s Python form, into its four zeroed columns. Each schedstat line
    is parsed once: readings that found it unchanged share the same bytes object."""
    parsed: dict[int, int] = {}  # id of a line (kept alive by ``pairs``) -> its run-queue wait
    for j, (start, end) in enumerate(pairs):
        if start is None or end is None:
            continue
        both = type(start) is tuple and type(end) is tuple
        c = (end[0] if type(end) is tuple else end) - (start[0] if type(start) is tuple else start)
        if c >= 0:
            cpu[j], cpu_ok[j] = c, True
        if both:
            r0, r1 = parsed.get(id(start[1])), parsed.get(id(end[1]))
            if r0 is None:
                r0 = parsed[id(start[1])] = runq_ns(start[1])
            if r1 is None:
                r1 = parsed[id(end[1])] = runq_ns(end[1])
            if r1 >= r0:
                runq[j], runq_ok[j] = r1 - r0, True
