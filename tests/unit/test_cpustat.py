"""The training thread's CPU time and run-queue wait (hvtrace.record.cpustat), measured for real:
busy loops, sleeps, a CPU shared with another busy process, through the recorder into the file."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import make_header

import hvtrace
from hvtrace.record import cpustat
from hvtrace.record import recorder as recmod
from hvtrace.record.cpustat import ThreadCounters, deltas
from hvtrace.record.native import hot_module
from hvtrace.record.recorder import Recorder

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux counters"),
    # busy loops measured against the wall clock: another test beside them takes their CPU
    pytest.mark.timing,
]

RUN = "20240101-000000-c0ffee"
MS = 1_000_000


def _busy(ns: int) -> None:
    end = time.monotonic_ns() + ns
    while time.monotonic_ns() < end:
        pass


def _spin_cpu(ns: int) -> None:
    """Spin until this thread has run for ns of CPU, however long a busy host makes that take."""
    end = time.thread_time_ns() + ns
    while time.thread_time_ns() < end:
        pass


_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10 * MS


def _steal_ns() -> int:
    """Time the hypervisor took from this VM's CPUs so far (all CPUs, /proc/stat), in ns: a
    thread loses it from neither its CPU clock nor its run-queue wait. 0 where not known."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * _TICK_NS if fields[0] == "cpu" and len(fields) > 8 else 0
    except (OSError, ValueError):
        return 0


def _accounted(wall: int, cpu: int, runq: int, steal: int) -> None:
    """CPU time and run-queue wait add up to the wall time, less what the hypervisor stole from
    the VM meanwhile (counted in ticks: one tick of slack)."""
    assert cpu + runq <= 1.1 * wall, (wall, cpu, runq)
    assert cpu + runq >= 0.9 * (wall - steal) - _TICK_NS, (wall, cpu, runq, steal)


def _measure(counters: ThreadCounters, fn, *args) -> tuple[int, int | None, int | None]:
    """(wall, cpu, runq) ns of ``fn(*args)`` on this thread."""
    t0, c0 = time.monotonic_ns(), counters.read()
    fn(*args)
    t1, c1 = time.monotonic_ns(), counters.read()
    return (t1 - t0, *deltas(c0, c1))


@pytest.fixture(params=["native", "python"])
def counters(request, monkeypatch):
    """The reader in both forms: compiled (``hvtrace.record._hot.ThreadReader``) and the
    closure (``HVTRACE_NATIVE=0``); they must measure the same."""
    if request.param == "native" and hot_module() is None:
        pytest.skip("hvtrace.record._hot is not built here")
    monkeypatch.setenv("HVTRACE_NATIVE", "1" if request.param == "native" else "0")
    c = ThreadCounters()
    if c.mode == "schedstat":
        native = type(c.read).__name__ == "ThreadReader"
        assert native == (request.param == "native")
    yield c
    c.close()


def test_reading_is_raw_and_parsed_off_the_hot_path(counters: ThreadCounters) -> None:
    if counters.mode != "schedstat":
        pytest.skip("no /proc/self/task/TID/schedstat here")
    cpu, raw = counters.read()
    assert isinstance(cpu, int) and isinstance(raw, bytes)  # nothing parsed while recording
    assert len(raw.split()) == 3
    with pytest.raises(TypeError):  # both forms: a reading takes nothing
        counters.read(1)
    assert deltas((100, b"5 1000 3\n"), (350, b"5 1600 4\n")) == (250, 600)
    assert deltas(100, 350) == (250, None)  # CPU clock only
    assert deltas(None, (1, b"1 2 3")) == (None, None)


def test_schedstat_is_read_again_only_after_time_off_a_cpu(monkeypatch) -> None:
    """A reading re-reads the schedstat line only once the thread was off a CPU (wall time minus
    CPU time since the last read) for more than the slack: the run-queue wait cannot have grown
    by more than that meanwhile."""
    wall, cpu, line, preads = [10 * MS], [5 * MS], [b"7 100 1\n"], []

    def pread(fd: int, n: int, offset: int) -> bytes:
        preads.append(fd)
        return line[0]

    monkeypatch.setattr(time, "monotonic_ns", lambda: wall[0])
    monkeypatch.setattr(os, "pread", pread)
    read = cpustat._schedstat_reader(lambda: cpu[0], 3, 20_000)
    assert len(preads) == 1

    def advance(wall_ns: int, cpu_ns: int, runq_line: bytes) -> tuple[int, bytes]:
        wall[0] += wall_ns
        cpu[0] += cpu_ns
        line[0] = runq_line
        return read()

    # on a CPU all along: the line cannot have changed; the CPU clock is read every time
    assert advance(MS, MS, b"9 100 1\n") == (6 * MS, b"7 100 1\n") and len(preads) == 1
    # 15 us off a CPU since the line was read: within the slack, still not read
    assert advance(MS, MS - 15_000, b"9 110 2\n")[1] == b"7 100 1\n" and len(preads) == 1
    # 15 + 10 us off a CPU since then: more than the slack, read again
    assert advance(MS, MS - 10_000, b"9 125 3\n")[1] == b"9 125 3\n" and len(preads) == 2
    # counted from that read: 10 us more off a CPU is within the slack again
    assert advance(MS, MS - 10_000, b"9 135 4\n")[1] == b"9 125 3\n" and len(preads) == 2
    # a long wait (sleep, run queue) is always seen
    assert advance(5 * MS, MS, b"9 900 5\n")[1] == b"9 900 5\n" and len(preads) == 3
    assert deltas((0, b"7 100 1\n"), (1, b"9 900 5\n")) == (1, 800)


def test_the_line_is_kept_on_a_cpu_and_read_again_after_a_sleep(counters) -> None:
    """Both forms, for real: a reading right after another, the thread on a CPU between them,
    returns the same line object (no ``pread``); after a 5 ms sleep, a line read again, with the
    thread's CPU time in it. (A preemption between two readings can force a read: the first
    check passes once in five tries.)"""
    if counters.mode != "schedstat":
        pytest.skip("no /proc/self/task/TID/schedstat here")
    kept = 0
    for _ in range(5):
        a, b = counters.read(), counters.read()
        kept += b[1] is a[1]
        assert b[0] >= a[0]
    assert kept >= 1
    before = counters.read()
    _busy(2 * MS)
    time.sleep(0.005)
    after = counters.read()
    assert after[1] is not before[1]
    assert int(after[1].split()[0]) - int(before[1].split()[0]) >= MS  # the busy loop's CPU


def test_busy_loop_is_cpu_and_sleep_is_blocked(counters: ThreadCounters) -> None:
    if counters.mode != "schedstat":
        pytest.skip("no /proc/self/task/TID/schedstat here")
    steal = _steal_ns()
    wall, cpu, runq = _measure(counters, _busy, 60 * MS)
    steal = _steal_ns() - steal
    # every ns of a busy loop is either on a CPU or waiting for one (other jobs on this machine),
    # but for what the hypervisor takes from the VM
    _accounted(wall, cpu, runq, steal)
    assert cpu > 0.3 * wall
    wall, cpu, runq = _measure(counters, time.sleep, 0.06)
    assert cpu < 0.1 * wall  # sleeping is neither CPU nor run queue: blocked
    assert runq < 0.2 * wall


def test_sharing_one_cpu_with_a_busy_process_shows_in_the_run_queue(
    counters: ThreadCounters,
) -> None:
    if counters.mode != "schedstat" or not hasattr(os, "sched_setaffinity"):
        pytest.skip("no schedstat or no CPU affinity here")
    before = os.sched_getaffinity(0)
    cpu_id = min(before)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu_id})
        os.sched_setaffinity(0, {cpu_id})  # this thread only
        _busy(20 * MS)  # let the scheduler settle both on the CPU
        steal = _steal_ns()
        wall, cpu, runq = _measure(counters, _busy, 400 * MS)
        steal = _steal_ns() - steal
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    # two busy tasks on one CPU: each runs about half the time and waits the other half (more
    # when other jobs of this machine run there too)
    _accounted(wall, cpu, runq, steal)
    assert runq > 0.25 * (wall - steal) and cpu < 0.75 * wall, (wall, cpu, runq, steal)


def test_readings_are_the_training_threads_whichever_thread_reads(
    counters: ThreadCounters,
) -> None:
    """An autograd hook on another thread (CUDA) reads the training thread's counters."""
    seen = []
    t = threading.Thread(target=lambda: seen.append(counters.read()))
    steal = _steal_ns()
    t0, c0 = time.monotonic_ns(), counters.read()
    _busy(30 * MS)
    wall = time.monotonic_ns() - t0
    steal = _steal_ns() - steal
    t.start()
    t.join()
    cpu, runq = deltas(c0, seen[0])
    assert cpu is not None
    # this thread's busy loop, not the reader's (but for what the hypervisor took meanwhile)
    assert cpu + (runq or 0) >= 0.8 * (wall - steal) - _TICK_NS, (wall, cpu, runq, steal)


def _recorded(tmp_path: Path, mode: str) -> dict[str, dict]:
    """Record a busy and a sleeping user span through a real Recorder and writer; return the
    rows of the closed (compacted) file by name."""
    # (the writer thread flushes only at close: its GIL would block the busy loop for a while)
    rec = Recorder(tmp_path, make_header(0, 1, RUN), flush_interval_s=1e6)
    try:
        assert rec.counters.mode == mode
        recmod._set_active(rec)
        steal = _steal_ns()
        with hvtrace.span("busy"):
            _busy(50 * MS)
        steal = _steal_ns() - steal
        with hvtrace.span("sleep"):
            time.sleep(0.05)
        hvtrace.scalar("loss", 1.5)
        done = threading.Event()

        def other_thread() -> None:
            with hvtrace.span("elsewhere"):  # not the training thread: not measured
                _busy(MS)
            done.set()

        threading.Thread(target=other_thread).start()
        assert done.wait(10)
    finally:
        recmod._set_active(None)
        rec.close()
        atexit.unregister(rec.close)
    table = pq.read_table(rec.path.with_suffix(".parquet"))
    assert json.loads(table.schema.metadata[b"hvtrace"])["rank"] == 0
    rows = {r["name"]: r for r in table.to_pylist()}
    rows["busy"]["steal_ns"] = steal  # the hypervisor's, meanwhile (see _steal_ns)
    return rows


def test_spans_reach_the_file_with_their_counters(tmp_path: Path, restore_signals) -> None:
    if ThreadCounters().mode != "schedstat":
        pytest.skip("no /proc/self/task/TID/schedstat here")
    rows = _recorded(tmp_path, "schedstat")
    busy, sleep = rows["busy"], rows["sleep"]
    wall = busy["end_ns"] - busy["start_ns"]
    _accounted(wall, busy["cpu_ns"], busy["runq_ns"], busy["steal_ns"])
    assert busy["cpu_ns"] > 0.3 * wall
    assert sleep["cpu_ns"] < 0.1 * (sleep["end_ns"] - sleep["start_ns"])
    assert sleep["runq_ns"] is not None
    for name in ("loss", "elsewhere"):
        assert rows[name]["cpu_ns"] is None and rows[name]["runq_ns"] is None


def test_without_schedstat_cpu_only(tmp_path: Path, monkeypatch, restore_signals) -> None:
    monkeypatch.setattr(cpustat, "SCHEDSTAT_PATH", str(tmp_path / "missing" / "{tid}"))
    c = ThreadCounters()
    assert c.mode == "cputime"
    assert isinstance(c.read(), int)
    rows = _recorded(tmp_path, "cputime")
    busy = rows["busy"]
    assert busy["cpu_ns"] > 0.3 * (busy["end_ns"] - busy["start_ns"])
    assert busy["runq_ns"] is None
    assert rows["sleep"]["cpu_ns"] < 0.1 * (rows["sleep"]["end_ns"] - rows["sleep"]["start_ns"])


def test_without_any_counter_nulls(tmp_path: Path, monkeypatch, restore_signals) -> None:
    def no_clock(ident: int) -> int:
        raise OSError("no thread CPU clock")

    monkeypatch.setattr(time, "pthread_getcpuclockid", no_clock)
    assert ThreadCounters().read() is None
    rows = _recorded(tmp_path, "none")
    assert rows["busy"]["cpu_ns"] is None and rows["busy"]["runq_ns"] is None


@pytest.fixture()
def restore_signals():
    """A Recorder installs SIGTERM/SIGXFSZ handlers: put the previous ones back."""
    import signal

    saved = {
        s: signal.getsignal(s) for s in (signal.SIGTERM, getattr(signal, "SIGXFSZ", None)) if s
    }
    yield
    for s, h in saved.items():
        signal.signal(s, h)


TRACER_CHILD = r"""
import json, sys
import horovod.torch as hvd, torch
from torch import nn
import hvtrace
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = hvtrace.DistributedOptimizer(
    torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
    trace_dir=sys.argv[1], model=m,
)
x = torch.randn(64, 32)
for step in range(12):
    with hvtrace.span("data"):
        xb = x * 1.0
    opt.zero_grad()
    m(xb).sum().backward()
    opt.step()
hvtrace.finish(sync_clock=False)
"""


def _traced_child(tmp_path: Path, elastic: bool) -> tuple[list[dict], str]:
    """Run :data:`TRACER_CHILD` as one process (``HOROVOD_ELASTIC=1``: Horovod's optimizer
    allreduces even at one rank); return its trace's rows and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "HOROVOD_ELASTIC"}
    env.update(HOROVOD_CYCLE_TIME="0.1", PYTHONWARNINGS="ignore")
    if elastic:
        env["HOROVOD_ELASTIC"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", TRACER_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*.parquet")
    return pq.read_table(path).to_pylist(), proc.stderr


def test_tracer_phases_carry_counters_that_tile_the_step(tmp_path: Path) -> None:
    """A real one-rank Horovod run: every phase span has counters, allreduces none; the phases'
    counters (input, forward, backward, wait, update) add up to the step's."""
    pytest.importorskip("horovod.torch")
    if ThreadCounters().mode != "schedstat":
        pytest.skip("no /proc/self/task/TID/schedstat here")
    rows, _ = _traced_child(tmp_path, elastic=True)
    kinds = {r["kind"] for r in rows}
    assert {"step", "input", "forward", "backward", "wait", "update", "allreduce"} <= kinds
    for r in rows:
        measured = r["kind"] in ("step", "input", "forward", "backward", "wait", "update", "user")
        if r["name"] == "hvtrace.clock_sync":
            measured = False
        assert (r["cpu_ns"] is not None) == measured, r
        assert (r["runq_ns"] is not None) == measured, r
    # CPU + run queue fit in the wall time (up to a preemption between a boundary's timestamp
    # and its reading, which moves a run-queue wait to the next span: summed over the run)
    for kind in ("step", "input", "forward", "wait", "update", "user"):  # (backward: see Tracer)
        mine = [r for r in rows if r["kind"] == kind and r["cpu_ns"] is not None]
        counted = sum(r["cpu_ns"] + r["runq_ns"] for r in mine)
        assert counted <= sum(r["end_ns"] - r["start_ns"] for r in mine) * 1.05 + 5_000_000, kind
    for step in range(12):
        mine = [r for r in rows if r["step"] == step and r["kind"] != "allreduce"]
        by = {r["kind"]: r for r in mine if r["kind"] != "user"}
        # one reading per boundary, shared: the phases' counters add up to the step's exactly
        for col in ("cpu_ns", "runq_ns"):
            parts = sum(by[k][col] for k in ("input", "forward", "backward", "wait", "update"))
            assert parts == by["step"][col], (step, col)


def test_a_plain_single_process_run_is_traced_whole(tmp_path: Path) -> None:
    """``python train.py`` without horovodrun: one rank, where Horovod's optimizer registers no
    gradient hooks and allreduces nothing, so every ``synchronize()`` enqueues nothing. The
    trace must still hold every step (the writer once failed on such a first synchronize and
    disabled tracing)."""
    pytest.importorskip("horovod.torch")
    rows, stderr = _traced_child(tmp_path, elastic=False)
    assert "tracing disabled" not in stderr, stderr[-3000:]
    assert sorted(r["step"] for r in rows if r["kind"] == "step") == list(range(12))
    assert not [r for r in rows if r["kind"] == "allreduce"]
    for kind in ("input", "forward", "backward", "wait", "update"):
        assert len([r for r in rows if r["kind"] == kind]) == 12, kind


@pytest.fixture()
def switch_checked():
    """The compiled reader with the switch check (skipped where Linux allows no perf event)."""
    if hot_module() is None:
        pytest.skip("hvtrace.record._hot is not built here")
    c = ThreadCounters()
    if c.mode != "schedstat" or not getattr(c.read, "switch_check", False):
        c.close()
        pytest.skip("no schedstat or no perf event on this thread here")
    assert c.derived_max_ns == cpustat.MAX_DERIVED_NS
    yield c
    c.close()


def _thread_cpu_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_THREAD_CPUTIME_ID)


def test_the_switch_check_derives_on_a_cpu_and_reads_the_clock_after_a_switch(
    switch_checked: ThreadCounters,
) -> None:
    """On a CPU since the last clock read: the reading adds the wall time, no system call, and
    agrees with the CPU clock. After a sleep (a switch), past the longest stretch, or from
    another thread: the clock is read, so a sleep never counts as CPU time."""
    read = switch_checked.read
    for _ in range(20):  # a preemption in between forces a clock read: retry
        e0, d0 = read.exact_reads, read.derived_reads
        a, k0 = read(), _thread_cpu_ns()
        _busy(200_000)
        b, k1 = read(), _thread_cpu_ns()
        if read.exact_reads == e0 and read.derived_reads == d0 + 2:
            break
    else:
        pytest.fail("no two readings 200 µs apart without a context switch in 20 tries")
    assert b[1] is a[1]  # the run-queue line: unchanged, not read
    assert abs((b[0] - a[0]) - (k1 - k0)) < 30_000, (b[0] - a[0], k1 - k0)
    for _ in range(5):  # sleeps shorter than the longest derived stretch: the switch is seen
        e0, b = read.exact_reads, read()
        time.sleep(0.0003)
        c = read()
        assert read.exact_reads >= e0 + 1
        assert 0 <= c[0] - b[0] < 150_000, c[0] - b[0]  # the sleep is not CPU time
    e0 = read.exact_reads
    _busy(2 * cpustat.MAX_DERIVED_NS)
    read()
    assert read.exact_reads == e0 + 1  # longer than the longest derived stretch
    seen = []
    t = threading.Thread(target=lambda: seen.append(read()))
    t.start()
    t.join()
    assert read.exact_reads == e0 + 2 and seen[0][0] >= c[0]
    switch_checked.close()  # (finish, or a forked child): the event goes with the counters
    assert not read.switch_check


def test_the_switch_check_sees_every_preemption_on_a_shared_cpu(
    switch_checked: ThreadCounters,
) -> None:
    """A busy thread sharing one CPU with a busy process, read every 50 µs for 300 ms: half its
    wall time is spent waiting for the CPU, in stretches the readings must not count as CPU
    time. Their CPU times add up to the thread's CPU clock, their run-queue waits to schedstat's,
    and some readings were derived (the rest read the clock after a switch). The longest derived
    stretch is lifted here: only the switch check can tell a preemption."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    c = switch_checked
    clock = time.pthread_getcpuclockid(c.ident)
    read = cpustat._schedstat_reader(
        _thread_cpu_ns, c._fd, cpustat.RUNQ_SLACK_NS, clock, (c.native_id, c.ident, 10**12)
    )
    assert read.switch_check and read.max_derived_ns == 10**12
    before = os.sched_getaffinity(0)
    cpu_id = min(before)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    readings = []
    try:
        os.sched_setaffinity(hog.pid, {cpu_id})
        os.sched_setaffinity(0, {cpu_id})  # this thread only
        _busy(20 * MS)
        e0, d0 = read.exact_reads, read.derived_reads
        k0, w0 = _thread_cpu_ns(), time.monotonic_ns()
        readings.append(read())
        end = time.monotonic_ns() + 300 * MS
        while time.monotonic_ns() < end:
            _busy(50_000)
            readings.append(read())
        k1, w1 = _thread_cpu_ns(), time.monotonic_ns()
        exact, derived = read.exact_reads - e0, read.derived_reads - d0
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    pairs = [deltas(a, b) for a, b in itertools.pairwise(readings)]
    cpu = sum(c for c, _ in pairs)
    runq = sum(r for _, r in pairs)
    true_runq = cpustat.runq_ns(readings[-1][1]) - cpustat.runq_ns(readings[0][1])
    assert all(c is not None and c >= 0 for c, _ in pairs)
    assert abs(cpu - (k1 - k0)) < 0.05 * (k1 - k0) + MS, (cpu, k1 - k0, w1 - w0)
    assert runq == true_runq and runq > 0.2 * (w1 - w0), (runq, w1 - w0)
    assert cpu < 0.8 * (w1 - w0)  # had preemptions been missed, cpu would be about the wall
    assert derived > 0 and exact > 0, (exact, derived)


def test_the_switch_check_closes_itself_where_switches_outnumber_derived_readings(
    switch_checked: ThreadCounters,
) -> None:
    """Reviewed every N readings: a thread read once per context switch (a short sleep between
    readings: no reading can be derived, each switch made dearer) has the perf event closed and
    reads the clock from then on, still measuring; one read many times between switches keeps
    it."""
    c, hot = switch_checked, hot_module()
    clock = time.pthread_getcpuclockid(c.ident)

    def reader():
        return hot.ThreadReader(
            clock, c._fd, cpustat.RUNQ_SLACK_NS, c.native_id, c.ident, 10**9, 64
        )

    sleepy = reader()
    for _ in range(64):
        sleepy()
        time.sleep(0.0002)
    assert not sleepy.switch_check and sleepy.derived_reads < 8
    before = sleepy()
    _spin_cpu(5 * MS)  # 5 ms of CPU, not of wall time: a preempted loop would read less
    time.sleep(0.005)
    cpu, _ = deltas(before, sleepy())
    assert 5 * MS <= cpu < 7 * MS  # the busy loop, not the sleep: the clock, read
    busy = reader()
    for _ in range(5):
        for _ in range(64):
            busy()
            _busy(5_000)
        time.sleep(0.0002)  # one switch per 64 readings
    assert busy.switch_check and busy.derived_reads > 200


def test_the_first_review_comes_within_a_few_dozen_steps(switch_checked: ThreadCounters) -> None:
    """The default reader reviews after its first 256 readings (then every 4096): a thread read
    once per context switch has the event closed by then, not after 4096 readings (about 600
    steps of a job that reads 7 times a step)."""
    c, hot = switch_checked, hot_module()
    clock = time.pthread_getcpuclockid(c.ident)
    read = hot.ThreadReader(clock, c._fd, cpustat.RUNQ_SLACK_NS, c.native_id, c.ident, 10**9)
    assert read.review_reads == 4096
    for _ in range(255):
        read()
        time.sleep(0.0001)
    assert read.switch_check  # not reviewed yet
    read()
    assert not read.switch_check and read.exact_reads + read.derived_reads == 256


def test_steps_without_readings_close_the_switch_check(switch_checked: ThreadCounters) -> None:
    """Recording off (a failure, or switched off): the optimizer's steps tell the reader that no
    reading came; after 64 in a row it closes the event, which would only make every context
    switch dearer. A reading resets the count, and another thread's step closes nothing."""
    c, hot = switch_checked, hot_module()
    clock = time.pthread_getcpuclockid(c.ident)
    read = hot.ThreadReader(clock, c._fd, cpustat.RUNQ_SLACK_NS, c.native_id, c.ident, 10**9)
    for _ in range(63):
        read.idle_step()
    read()  # a reading: recording is on again
    for _ in range(63):
        read.idle_step()
    assert read.switch_check
    other = threading.Thread(target=read.idle_step)
    other.start()
    other.join()
    assert read.switch_check  # not the counted thread
    read.idle_step()
    assert not read.switch_check
    cpu, _ = deltas(read(), read())
    assert cpu is not None and cpu >= 0  # still measuring, by the clock
