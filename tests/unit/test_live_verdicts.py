"""Live straggler detection's pieces, without Horovod: a window's rows reduced per step, the
offline straggler decision on the gathered windows, the log line, the callbacks, the records."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hvtrace.analysis import live as live_judge
from hvtrace.format.schema import KIND_CODE
from hvtrace.format.status import MAX_EVENTS, merge_live
from hvtrace.record import live
from hvtrace.record.rows import Allreduces

MS = 1_000_000


def _step_rows(step: int, t0: int, fwd_ms: float) -> list:
    """What the tracer hands over for one step: phase rows and one synchronize's allreduces."""
    k = KIND_CODE
    f1 = t0 + 2 * MS + int(fwd_ms * MS)
    b1 = f1 + 10 * MS
    end = b1 + 6 * MS
    row = lambda kind, s, e: (step, 0, k[kind], kind, s, e, 0, 0, np.nan, 0, s, e)  # noqa: E731
    return [
        row("input", t0, t0 + 2 * MS),
        row("forward", t0 + 2 * MS, f1),
        row("backward", f1, b1),
        Allreduces(step, 0, 2, [(b1 - 1 * MS, 1, 7)], [], b1 + 3 * MS, {}),
        row("wait", b1, b1 + 4 * MS),
        row("update", b1 + 4 * MS, end),
        row("step", t0, end),
    ]


def _window(slow_ms: float, first: int = 40, n: int = 20, offset_ns: int = 0) -> np.ndarray:
    rows, t = [], 10_000 * MS
    for s in range(first, first + n):
        rows.append(_step_rows(s, t + offset_ns, 10 + slow_ms))
        t += 100 * MS
    return live.step_matrix(rows, offset_ns)


def test_a_window_is_reduced_to_one_row_per_step() -> None:
    m = _window(0.0, offset_ns=5 * MS)
    assert m.shape == (20, live.N_COLS)
    assert list(m[:3, 0]) == [40, 41, 42]
    fwd = 1 + 3 * live.PHASES.index("forward")
    assert m[0, fwd] == 10 * MS
    assert m[0, fwd + 1] == 10 * MS  # CPU readings are plain ints here: cpu = end - start
    # arrival: the latest enqueue, on rank 0's clock (the offset taken off)
    assert m[0, live._ARRIVAL] == 10_000 * MS + 2 * MS + 10 * MS + 10 * MS - 1 * MS


def _monitor(monkeypatch, every: int, offset_ns: int) -> live.LiveMonitor:
    """A LiveMonitor without its thread or judge: the test drains its queue or runs ``_run``."""
    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.window, mon.in_window, mon.windows_sent, mon.every = [], 0, 0, every
    mon.length, mon.chunk_steps, mon.window_s, mon.window_start_ns = every, live.CHUNK_STEPS, 0, 0
    mon.offset_ns, mon._stopped, mon._closed, mon.index = offset_ns, False, False, 0
    mon.prev_steps, mon._matrices, mon._orphans = 0, {}, []
    mon._due, mon._due_in = None, 0
    mon._cond = live.threading.Condition()
    mon._q = live.queue.SimpleQueue()
    mon.tracer = _Tracer()
    mon.hosts = {}
    monkeypatch.setattr(mon, "_stop_judge", lambda: None)
    return mon


class _Rec:
    enabled = False
    step = 0


class _Tracer:
    """What the monitor reads of its tracer: the steps counted, the recorder, the checks."""

    def __init__(self) -> None:
        self.steps_done = 0
        self.rec = _Rec()
        self.checks = None


class FakeHorovod:
    """horovod.torch.mpi_ops as the live monitor uses it, one rank (not the judge): records
    which thread issued each collective; a gathered window is done ``polls`` looks later."""

    def __init__(self, monkeypatch, polls: int = 0) -> None:
        mpi_ops = pytest.importorskip("horovod.torch.mpi_ops")
        import torch

        self.issued: list[tuple[str, str, str]] = []  # (thread, op, name): the gathers
        self.here: list[str] = []  # the presence allreduces' names
        #: ranks that joined: zeros in every presence allreduce (as Horovod counts them)
        self.joined: set[int] = set()
        self.size = 2
        self.gathered: dict[str, np.ndarray] = {}
        self.polls, self.looks = polls, 0
        for op in ("allgather_async", "allreduce_async", "broadcast_async", "allreduce"):
            monkeypatch.setattr(mpi_ops, op, self._issue(op))
        monkeypatch.setattr(mpi_ops, "poll", self.poll)
        monkeypatch.setattr(mpi_ops, "synchronize", lambda h: torch.from_numpy(self.gathered[h]))
        monkeypatch.setattr(mpi_ops, "rank", lambda: 1)
        monkeypatch.setattr(mpi_ops, "size", lambda: self.size)

    def _issue(self, op: str):
        def issue(tensor, *args, name=None, **kwargs):
            got = tensor.numpy().copy()
            if not name.endswith(".here"):
                self.issued.append((live.threading.current_thread().name, op, name))
            else:
                self.here.append(name)  # the presence: every rank but those joined
                got[: self.size] = [0.0 if r in self.joined else 1.0 for r in range(self.size)]
            self.gathered[name] = got
            return name

        return issue

    def poll(self, handle) -> bool:
        self.looks += 1
        return self.looks > self.polls


def test_windows_are_gathered_by_the_training_thread_in_order_and_whole(monkeypatch) -> None:
    """Horovod names a collective issued without a name after a count of the process's
    collectives: one issued from the live thread, at a moment that differs by rank, gave a
    user's unnamed allreduce different names on different ranks (a job hung, or segfaulted
    when two ranks' tensors of different shapes met under one name). So each window is
    gathered by the training thread CHUNK_STEPS steps into the next window, at the same step
    on every rank, with the rows the live thread reduced from its chunks (at most CHUNK_STEPS
    steps' entries held by the training thread); the live thread issues no collective. The
    job's last window is gathered too when that many steps follow it."""
    hvd = FakeHorovod(monkeypatch)
    every = 25  # not a multiple of the chunk: the window's last chunk is shorter
    mon = _monitor(monkeypatch, every, 3 * MS)
    thread = live.threading.Thread(target=mon._run, name="hvtrace-live")
    thread.start()
    n_steps = 4 * every + live.CHUNK_STEPS
    steps = [_step_rows(s, 10_000 * MS + s * 100 * MS, 10.0 + s % 7) for s in range(n_steps)]
    held, issued_at = [], []
    for i, rows in enumerate(steps):
        before = len(hvd.issued)
        mon.on_step(rows)
        held.append(len(mon.window))
        issued_at += [i + 1] * (len(hvd.issued) - before)  # steps ended when it was issued
    mon.close()
    thread.join(10)
    assert max(held) < live.CHUNK_STEPS and mon.windows_sent == 4
    assert hvd.issued == [
        ("MainThread", "allgather_async", f"hvtrace.live.0.{k}") for k in (0, 1, 2, 3)
    ]
    # each with its presence, issued beside it (a rank that joined is absent there)
    assert hvd.here == [f"hvtrace.live.0.{k}.here" for k in (0, 1, 2, 3)]
    assert issued_at == [(k + 1) * every + live.CHUNK_STEPS for k in range(4)]
    for k in range(4):
        whole = live.step_matrix(steps[k * every : (k + 1) * every], 3 * MS)
        np.testing.assert_array_equal(hvd.gathered[f"hvtrace.live.0.{k}"], whole)


def test_a_window_shorter_than_a_chunk_is_gathered_at_the_next_windows_end(monkeypatch) -> None:
    """Windows of fewer steps than the gather's lag: each is gathered when the next ends, in
    order, none skipped (every rank counts the same steps)."""
    hvd = FakeHorovod(monkeypatch)
    every = live.CHUNK_STEPS // 2
    mon = _monitor(monkeypatch, every, 0)
    thread = live.threading.Thread(target=mon._run, name="hvtrace-live")
    thread.start()
    issued_at = []
    for i in range(3 * every):
        before = len(hvd.issued)
        mon.on_step(_step_rows(i, 10_000 * MS + i * 100 * MS, 10.0))
        issued_at += [i + 1] * (len(hvd.issued) - before)
    mon.close()
    thread.join(10)
    assert [name for _, _, name in hvd.issued] == ["hvtrace.live.0.0", "hvtrace.live.0.1"]
    assert issued_at == [2 * every, 3 * every]
    assert len(hvd.gathered["hvtrace.live.0.1"]) == every


def test_windows_of_short_steps_last_the_window_seconds_on_every_rank(monkeypatch) -> None:
    """HVTRACE_LIVE_S: at the end of windows 1, 2, 4, ... rank 0's mean step is broadcast and
    every rank lengthens its windows to the steps that fill ``window_s`` at that step (the same
    count on every rank, whatever its own clock says), handing steps over about CHUNK_S at a
    time. Judging a window costs rank 0 a fixed ~30 ms of CPU: fewer windows, less cost."""
    hvd = FakeHorovod(monkeypatch)
    mpi_ops = pytest.importorskip("horovod.torch.mpi_ops")
    import torch

    names: list[str] = []

    def broadcast(t, root_rank, name):
        assert root_rank == 0 and float(t[0]) > 0  # this rank's own mean step goes in
        names.append(name)
        return torch.tensor([3e6], dtype=torch.float64)  # rank 0's: 3 ms

    monkeypatch.setattr(mpi_ops, "broadcast", broadcast)
    every = 20
    mon = _monitor(monkeypatch, every, 0)
    mon.window_s = 1.0
    long = live.window_steps(3e6, every, 1.0)
    assert long == 334 and live.chunk_steps(3e6) == 84
    n = every + 2 * long + 5
    for s in range(n):
        mon.on_step(_step_rows(s, 10_000 * MS + s * 3 * MS, 1.0))
    queued = []
    while not mon._q.empty():
        queued.append(mon._q.get())
    windows, steps = [], 0
    for x in queued:
        if type(x) is int:
            windows.append(steps)
            steps = 0
        elif type(x) is list:
            steps += len(x)
            assert len(x) <= max(live.CHUNK_STEPS, 84)
    assert windows == [every, long, long]  # the first at HVTRACE_LIVE_EVERY, then 1 s of steps
    assert names == ["hvtrace.live.0.len.1", "hvtrace.live.0.len.2"]  # after windows 1, 2 (4...)
    # windows 0 and 1 gathered at the ends of windows 1 and 2 (no live thread here: NaN rows)
    assert [n for _, _, n in hvd.issued] == ["hvtrace.live.0.0", "hvtrace.live.0.1"]
    assert [len(hvd.gathered[f"hvtrace.live.0.{k}"]) for k in (0, 1)] == [every, long]
    assert max(len(x) for x in queued if type(x) is list) == 84  # ~250 ms a hand-over


def test_a_failed_length_agreement_stops_live_detection_not_training(monkeypatch) -> None:
    mpi_ops = pytest.importorskip("horovod.torch.mpi_ops")

    def broken(t, root_rank, name):
        raise RuntimeError("Horovod is shut down")

    monkeypatch.setattr(mpi_ops, "broadcast", broken)
    mon = _monitor(monkeypatch, 10, 0)
    mon.window_s = 5.0
    for s in range(30):  # the first window's end: the agreement fails; no exception out
        mon.on_step(_step_rows(s, 10_000 * MS + s * 3 * MS, 1.0))
    assert mon._closed and mon.windows_sent == 1 and mon.length == 10


def test_a_rank_whose_live_detection_failed_still_agrees_with_the_others(monkeypatch) -> None:
    """The length agreement is a collective on the training thread: a rank whose live thread
    failed (or, rank 0, whose judge did) hands nothing over but still counts the windows and
    takes part in every agreement, at the same steps, or the other ranks would wait in it for
    ever. Only close() (every rank's finish or reset) ends it."""
    mpi_ops = pytest.importorskip("horovod.torch.mpi_ops")
    import torch

    names: list[str] = []

    def broadcast(t, root_rank, name):
        names.append(name)
        return torch.tensor([50e6], dtype=torch.float64)

    monkeypatch.setattr(mpi_ops, "broadcast", broadcast)
    hvd = FakeHorovod(monkeypatch)
    mon = _monitor(monkeypatch, 10, 0)
    mon.window_s = 1.0
    mon._stopped = True  # the live thread failed
    for s in range(40):
        mon.on_step(_step_rows(s, 10_000 * MS + s * 50 * MS, 1.0))
    assert mon._q.empty() and mon.window == []  # nothing handed over
    assert mon.windows_sent == 2 and names == ["hvtrace.live.0.len.1", "hvtrace.live.0.len.2"]
    # and in every gather, with NaN rows (which name nobody), released once done
    # (window 0: steps 0-9, gathered at step 20; window 1: steps 10-29, gathered at step 40)
    assert [n for _, _, n in hvd.issued] == ["hvtrace.live.0.0", "hvtrace.live.0.1"]
    for k, n_rows in ((0, 10), (1, 20)):
        gathered = hvd.gathered[f"hvtrace.live.0.{k}"]
        assert gathered.shape == (n_rows, live.N_COLS) and np.isnan(gathered).all()
    assert mon._orphans == ["hvtrace.live.0.1"]  # window 0's released when window 1's went
    mon._closed = True
    for s in range(40):
        mon.on_step(_step_rows(s, 10_000 * MS + s * 50 * MS, 1.0))
    assert len(names) == 2 and mon.windows_sent == 2


def test_window_lengths_are_bounded() -> None:
    assert live.window_steps(3e6, 100, 5.0) == 1667
    assert live.window_steps(50e6, 100, 5.0) == 100  # long steps: HVTRACE_LIVE_EVERY
    assert live.window_steps(0.1e6, 100, 5.0) == live.MAX_WINDOW_STEPS
    assert live.window_steps(0.1e6, 5000, 5.0) == 5000  # a larger HVTRACE_LIVE_EVERY wins
    assert live.window_steps(3e6, 100, 0.0) == 100  # HVTRACE_LIVE_S=0: steps only
    assert live.window_steps(float("nan"), 100, 5.0) == 100
    assert live.chunk_steps(100e6) == live.CHUNK_STEPS
    assert live.chunk_steps(0.01e6) == live.CHUNK_MAX_STEPS


def test_a_live_thread_that_failed_is_handed_nothing_more(monkeypatch) -> None:
    """Live detection stops on an error (training goes on); the steps after it are not queued
    for a thread that no longer takes them."""
    hvd = FakeHorovod(monkeypatch)
    mon = _monitor(monkeypatch, 10, 0)

    def broken(window, offset_ns):
        raise RuntimeError("cannot reduce")

    monkeypatch.setattr(live, "step_matrix", broken)
    steps = [_step_rows(s, 10_000 * MS + s * 100 * MS, 10.0) for s in range(10)]
    for rows in steps:
        mon.on_step(rows)
    mon._run()  # the chunk fails: the thread returns (the window's end, queued after it, stays)
    left = mon._q.qsize()
    assert mon._stopped and left == 1
    for rows in steps * 5:
        mon.on_step(rows)
    assert mon._q.qsize() == left and mon.window == []
    # the windows are still gathered (a collective the other ranks wait in), with NaN rows
    assert len(hvd.issued) == 5 and all(np.isnan(hvd.gathered[n]).all() for _, _, n in hvd.issued)


def test_the_gathered_windows_name_the_slow_rank_as_the_analysis_does() -> None:
    gathered = np.vstack([_window(0.0), _window(20.0)])
    out = live_judge.verdicts(gathered, 2, {0: "a", 1: "b"})
    assert [(v["rank"], v["host"], v["phase"]) for v in out] == [(1, "b", "forward")]
    v = out[0]
    assert (v["first_step"], v["last_step"]) == (40, 59)
    assert v["late_ms"] == pytest.approx(20.0) and v["phase_excess_ms"] == pytest.approx(20.0)
    assert live_judge.verdicts(np.vstack([_window(0.0), _window(0.0)]), 2, {}) == []


@pytest.mark.parametrize("use_process", [False, True], ids=["in-process", "judge-process"])
def test_verdicts_are_logged_written_and_passed_to_callbacks(
    monkeypatch, caplog, use_process: bool
) -> None:
    got: list[dict] = []
    monkeypatch.setattr(live, "_callbacks", [])
    live.on_straggler(got.append)
    live.on_straggler(lambda v: 1 / 0)  # a broken callback is logged, never raised
    rec = SimpleNamespace(enabled=True, live_events=[])
    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.tracer, mon.hosts = SimpleNamespace(rec=rec), {0: "a", 1: "b"}
    mon.init_verdicts()
    mon.judge = None if use_process else live_judge.verdicts
    mon._judge_proc, mon._judge_q = None, None
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        for first, slow in ((20, 20.0), (40, 0.0), (60, 20.0), (80, 20.0), (100, 20.0)):
            mon._judge(np.vstack([_window(0.0, first), _window(slow, first)]), 2)
        # one window of 20 steps is not "consistently": logged at the second in a row
        for first in (120, 140):  # recovered after two windows without it
            mon._judge(np.vstack([_window(0.0, first), _window(0.0, first)]), 2)
    text = caplog.text
    assert "steps 20-39" not in text  # named once, alone: not logged
    assert "hvtrace: rank 1 (host b) late 20.0 ms/step over steps 80-99: forward" in text
    assert text.count("ms/step over steps") == 1  # still late at 100-119: no new line
    assert "rank 1 (host b) no longer late over steps 140-159" in text
    assert "on_straggler callback failed: ZeroDivisionError" in text
    assert [e["event"] for e in got] == ["late", "recovered"]
    assert [e["event"] for e in rec.live_events] == ["late", "recovered"]
    # what a judgment cost: the judge's CPU for that window (the process's own count, its start
    # left out), the budget's measure
    assert 0.0 < mon.judge_cpu_s < 5.0
    if use_process and sys.platform.startswith("linux"):  # `top` shows it as hvtrace's
        comm = Path(f"/proc/{mon._judge_proc.pid}/comm").read_text().strip()
        assert comm == "hvtrace-judge"
    mon._stop_judge()


def test_the_judge_process_writes_each_steps_figures_once_to_tensorboard_and_back(
    monkeypatch, tmp_path
) -> None:
    """Where HVTRACE_TENSORBOARD is set, the judge process writes every step of the windows it
    judges as TensorBoard scalars, once each however the decision windows overlap (a 10-step
    window is decided with the one before), and rank 0's figure listeners get the same points:
    the late rank is the slow one, lateness and step time its 20 ms."""
    pytest.importorskip("tensorboardX")
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    monkeypatch.setenv("HVTRACE_TENSORBOARD", str(tmp_path / "tb"))
    monkeypatch.setattr(live, "_callbacks", [])
    monkeypatch.setattr(live, "_figure_listeners", [])
    got: list = []
    live.on_window_figures(got.extend)
    live.on_window_figures(lambda pts: 1 / 0)  # a broken listener is logged, never raised
    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.tracer, mon.hosts = SimpleNamespace(rec=SimpleNamespace(enabled=False)), {0: "a", 1: "b"}
    mon.init_verdicts()
    mon.judge, mon._judge_proc, mon._judge_q = None, None, None
    try:
        for first, n, slow in ((20, 20, 20.0), (40, 10, 20.0), (50, 10, 0.0)):
            mon._judge(np.vstack([_window(0.0, first, n), _window(slow, first, n)]), 2)
    finally:
        mon._stop_judge()
    steps = [st for st, _ in got]
    assert steps == list(range(20, 60))  # every step once, in order
    by = dict(got)
    assert by[45]["hvtrace/late_rank"] == 1 and by[45]["hvtrace/lateness_ms"] == pytest.approx(20)
    assert by[55]["hvtrace/lateness_ms"] == pytest.approx(0, abs=1e-6)
    assert by[45]["hvtrace/step_ms"] > by[55]["hvtrace/step_ms"]
    assert "hvtrace/comm_compute_ratio" not in by[45]  # a live window has no allreduce times
    acc = ea_mod.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    late = acc.Scalars("hvtrace/lateness_ms")
    assert [e.step for e in late] == steps
    assert [e.value for e in late] == pytest.approx([by[s]["hvtrace/lateness_ms"] for s in steps])


def test_live_records_merge_once_each_and_drop_junk() -> None:
    a = {"event": "late", "rank": 1, "first_step": 40}
    b = {"event": "recovered", "rank": 1, "first_step": 80}
    out = merge_live([a, "junk"], [a, b, None, 7])
    assert out == [a, b]
    many = [{"event": "late", "rank": i, "first_step": 0} for i in range(MAX_EVENTS + 5)]
    assert len(merge_live(many, None)) == MAX_EVENTS


def test_windows_where_no_rank_recorded_a_step_are_judged_without_error(monkeypatch) -> None:
    """Recording off everywhere (live detection still runs, in step): the gathered rows are all
    NaN; a window of them names nobody and stops nothing, and a rank named before recovers."""
    rec = SimpleNamespace(enabled=True, live_events=[])
    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.tracer, mon.hosts = SimpleNamespace(rec=rec), {0: "a", 1: "b"}
    mon.init_verdicts()
    mon.judge, mon._judge_proc, mon._judge_q = live_judge.verdicts, None, None
    for first in (20, 40):
        mon._judge(np.vstack([_window(0.0, first), _window(20.0, first)]), 2)
    assert [e["event"] for e in rec.live_events] == ["late"]
    empty = np.full((8, live.N_COLS), np.nan)
    for _ in range(live.PERSIST_WINDOWS):
        mon._judge(empty, 2)
    assert [e["event"] for e in rec.live_events] == ["late", "recovered"]
    assert rec.live_events[-1]["first_step"] is None and mon.named == {}


def test_two_monitors_in_one_process_gather_under_their_own_names(monkeypatch) -> None:
    """Two traced optimizers in one process (a GAN's): each tracer's windows go out under names
    of their own, or Horovod refuses the second while the first is in flight."""
    hvd = FakeHorovod(monkeypatch)
    for index in (0, 1):
        mon = _monitor(monkeypatch, 10, 0)
        mon.index = index
        mon._matrices[3] = _window(0.0)
        mon._gather(3)
        assert mon._q.get() == (3, f"hvtrace.live.{index}.3")  # for the live thread to take
    assert [n for _, _, n in hvd.issued] == ["hvtrace.live.0.3", "hvtrace.live.1.3"]


def test_the_live_thread_looks_at_a_gathered_window_sleeping_longer_between_looks(
    monkeypatch,
) -> None:
    """A gathered window is done once the slowest rank gathered it. The live thread looks
    (``poll``) between chunks and, while nothing comes, waits 0.5 ms doubling to 10 ms between
    looks: never Horovod's spinning ``synchronize``, which would spend a CPU and pull the GIL
    away from the training thread. Once done, rank 0 judges it."""
    hvd = FakeHorovod(monkeypatch, polls=9)
    hvd.gathered["h"] = _window(0.0)
    mon = _monitor(monkeypatch, 10, 0)
    waits: list[float | None] = []

    class Queue:
        def __init__(self) -> None:
            self.items = [(0, "h")]

        def get(self, timeout=None):
            waits.append(timeout)
            if self.items:
                return self.items.pop(0)
            if timeout is None:  # nothing pending: the end
                mon._stopped = True
                return None
            raise live.queue.Empty

    judged = []
    monkeypatch.setattr(mon, "_gathered", lambda ops, g: judged.append(g))
    mon._q = Queue()
    mon._run()
    expected, d = [None], live.WAIT_FIRST_S
    for _ in range(9):
        expected.append(d)
        d = min(2 * d, live.WAIT_MAX_S)
    assert waits == pytest.approx([*expected, None])
    assert hvd.looks == 10 and len(judged) == 1
    np.testing.assert_array_equal(judged[0], _window(0.0))


def test_rank_0_judges_on_a_thread_of_its_own_in_order(monkeypatch) -> None:
    """The judge's answer (seconds for the judge process to start on a busy CPU) is waited for
    on the judge thread: handing a window over returns at once, the windows are judged in the
    order handed over, and stopping ends the thread after them, closing the judge process."""
    import threading

    mon = _monitor(monkeypatch, 20, 0)
    mon._judge_q, mon._judge_proc = None, None
    gate, judged, closed = threading.Event(), [], []
    live_thread = threading.get_ident()

    def judge(gathered, size, windows=1):
        gate.wait(10)
        judged.append((int(gathered[0, 0]), size, threading.get_ident() != live_thread))

    monkeypatch.setattr(mon, "_judge", judge)
    monkeypatch.setattr(mon, "_close_judge_proc", lambda: closed.append(True))
    for first in (20, 40, 60):
        mon._hand_to_judge(_window(0.0, first), 2)  # returns while the judge is held
    assert judged == []
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)  # (the fixture stubs the instance's)
    gate.set()
    thread.join(10)
    assert judged == [(20, 2, True), (40, 2, True), (60, 2, True)] and closed == [True]


def test_drain_waits_for_the_windows_handed_to_the_judge_and_no_longer(monkeypatch) -> None:
    """At the job's end rank 0 waits for the judge's answers to the windows already handed to it
    (a job of a few seconds ends before the judge process has started), within the time given."""
    import time

    mon = _monitor(monkeypatch, 20, 0)
    mon._judge_q, mon._judge_proc, mon._thread = None, None, None
    judged = []

    def judge(gathered, size, windows=1):
        time.sleep(0.3)
        judged.append(int(gathered[0, 0]))

    monkeypatch.setattr(mon, "_judge", judge)
    monkeypatch.setattr(mon, "_close_judge_proc", lambda: None)
    for first in (20, 40):
        mon._hand_to_judge(_window(0.0, first), 2)
    live.LiveMonitor._stop_judge(mon)  # what the live thread's end does at close
    t0 = time.monotonic()
    mon.drain(0.05)  # bounded: returns before the judge is done
    assert time.monotonic() - t0 < 0.25 and judged == []
    mon.drain(10)
    assert judged == [20, 40] and not mon._judge_thread.is_alive()


def test_a_judge_that_falls_behind_judges_the_newest_windows(monkeypatch) -> None:
    """At most JUDGE_BACKLOG windows wait for the judge thread (gathered windows of hundreds of
    ranks are megabytes each, and a late verdict is worth little): a newer one pushes the
    oldest out, counted; the stop is never pushed out."""
    import threading

    mon = _monitor(monkeypatch, 20, 0)
    mon._judge_q, mon._judge_proc, mon.judge_skipped = None, None, 0
    gate, inside, judged = threading.Event(), threading.Event(), []

    def judge(gathered, size, windows=1):
        inside.set()
        gate.wait(10)
        judged.append(int(gathered[0, 0]))

    monkeypatch.setattr(mon, "_judge", judge)
    monkeypatch.setattr(mon, "_close_judge_proc", lambda: None)
    mon._hand_to_judge(_window(0.0, 20), 2)
    assert inside.wait(10)  # the judge thread holds the first window
    for first in (40, 60, 80, 100, 120, 140):
        mon._hand_to_judge(_window(0.0, first), 2)
    assert mon.judge_skipped == 6 - live.JUDGE_BACKLOG
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)  # full: the stop pushes out one more window
    gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert judged == [20, 100, 120, 140] and mon.judge_skipped == 3


def _counts(size: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Every rank's counts matrix (:data:`COUNTS_FRAME_COLS`) of ``n`` steps of a job in
    lockstep: the same steps and counts on every rank."""
    one = np.zeros((n, len(live_judge.COUNTS_FRAME_COLS)))
    col = {c: j for j, c in enumerate(live_judge.COUNTS_FRAME_COLS)}
    one[:, col["step"]] = np.arange(100, 100 + n)
    one[:, col["backward_ns"]] = 5e6
    one[:, col["n_allreduce"]] = rng.integers(1, 4)
    one[:, col["n_forward"]] = one[:, col["n_backward"]] = 1
    return np.vstack([one] * size)


def test_the_judge_skips_the_lockstep_check_only_where_it_finds_nothing() -> None:
    """``counts_agree`` lets the judge skip its lockstep check's pandas work: wherever it says
    the counts agree, the check finds nothing; every kind of break is still judged."""
    rng = np.random.default_rng(7)
    col = {c: j for j, c in enumerate(live_judge.COUNTS_FRAME_COLS)}
    skipped = judged = 0
    for case in range(80):
        size, n = int(rng.integers(2, 5)), int(rng.integers(3, 9))
        m = _counts(size, n, rng)
        for _ in range(int(rng.integers(0, 3))):  # changes on one rank's row
            r, i = int(rng.integers(size)), int(rng.integers(n))
            what = rng.choice(["n_allreduce", "n_collective", "n_forward", "step", "nan", "dup"])
            row = r * n + i
            if what == "nan":
                m[row, col["step"]] = np.nan  # a step the rank did not record
            elif what == "dup":
                m[row] = m[r * n + (i + 1) % n]  # a step recorded twice
            else:
                m[row, col[what]] += 1
        agree = live_judge.counts_agree(m, size, live_judge.COUNTS_FRAME_COLS)
        found = live_judge.lockstep_verdicts(live_judge.counts_frame(m, size), size)
        if agree:
            assert found == [], (case, m)
            skipped += 1
        else:
            judged += 1
        if case % 8 == 0:  # the judge's own answer, through the fast path
            empty = np.full((0, live.N_COLS), np.nan)
            assert live_judge.verdicts(empty, size, {}, m) == found, case
    assert skipped > 15 and judged > 15  # both paths were taken
    clean = _counts(2, 10, rng)
    assert live_judge.counts_agree(clean, 2, live_judge.COUNTS_FRAME_COLS)
    clean[15, col["n_allreduce"]] += 1  # rank 1 allreduces one tensor more at step 105
    assert not live_judge.counts_agree(clean, 2, live_judge.COUNTS_FRAME_COLS)
    (b,) = live_judge.verdicts(np.full((0, live.N_COLS), np.nan), 2, {}, clean)
    assert (b["kind"], b["step"]) == ("lockstep", 105)


def test_a_gathered_window_in_lockstep_skips_the_check_and_a_break_does_not() -> None:
    same = np.vstack([_window(0.0), _window(0.0)])
    assert live_judge.counts_agree(same, 2)
    broken = same.copy()
    broken[25, live.N_COLS - 4] += 1  # rank 1's step 45: one allreduce more
    assert not live_judge.counts_agree(broken, 2)
    kinds = [v.get("kind") for v in live_judge.verdicts(broken, 2, {})]
    assert kinds == ["lockstep"]


def test_a_break_waits_for_a_judge_that_starts_more_than_max_count_windows_late(
    monkeypatch,
) -> None:
    """The judge process's first answer can come hundreds of steps late (its start at the lowest
    CPU priority on cores the ranks fill): the counts of a window with a break are kept for it
    however many windows in lockstep follow, the windows in lockstep after it dropped first."""
    import threading

    mon = _monitor(monkeypatch, 5, 0)
    mon._judge_q, mon._judge_proc, mon._counts, mon.judge_skipped = None, None, [], 0
    gate, inside, taken = threading.Event(), threading.Event(), []

    def judge(gathered, size, windows=1):
        inside.set()
        gate.wait(10)
        taken.append(mon._take_counts())  # (the judge's first answer takes what waited)

    monkeypatch.setattr(mon, "_judge", judge)
    monkeypatch.setattr(mon, "_close_judge_proc", lambda: None)
    mon._hand_to_judge(np.vstack([_window(0.0, 0, 5)] * 2), 2)
    assert inside.wait(10)  # the judge holds the first window: its process is starting
    n_cnt = live.LIVE_COLS - live.LIVE_COUNT_COL
    for first in range(5, 5 + 5 * (2 * live.MAX_COUNT_WINDOWS), 5):
        w = _window(0.0, first, 5)
        other = w.copy()
        if first == 10:  # rank 1 issues no collective at step 13, rank 0 one
            w[3, live.LIVE_COLS - n_cnt + 1] = 1
            other[3, live.LIVE_COLS - n_cnt + 1] = 0
        mon._hand_to_judge(np.vstack([w, other]), 2)
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)
    gate.set()
    thread.join(10)
    first = taken[0]
    assert len(first) == 2 * 5 * live.MAX_COUNT_WINDOWS and 13 in first[:, 0]
    (b,) = live_judge.verdicts(np.full((0, live.N_COLS), np.nan), 2, {}, first)
    assert (b["kind"], b["step"], b["ranks"]) == ("lockstep", 13, [1])


def test_the_judge_keeps_to_its_cpu_share_judging_held_windows_together(monkeypatch) -> None:
    """HVTRACE_JUDGE_PCT: after a judgment that took c s of the judge's CPU, windows that end
    within c / share are held and judged together at the first window after that (each rank's
    steps in order), or at the stop; the first judgment (the judge's start) is not counted."""
    import threading

    mon = _monitor(monkeypatch, 10, 0)
    mon._judge_q, mon._judge_proc, mon.judge_skipped = None, None, 0
    mon.judge_share = 0.01  # 1 % of a core: 50 ms of CPU holds the next judgment for 5 s
    judged: list[tuple[list[int], list[float]]] = []
    counted: list[int] = []  # the windows each judgment says it holds
    done = threading.Semaphore(0)

    def judge(gathered, size, windows=1):
        per = gathered.reshape(size, -1, gathered.shape[1])
        fwd = 1 + 3 * live.PHASES.index("forward")
        judged.append(([int(x) for x in per[0, :, 0]], [float(x) for x in per[:, 0, fwd]]))
        counted.append(windows)
        mon.judge_cpu_s = 0.05
        done.release()

    def gathered(first: int) -> np.ndarray:  # rank 1 is 5 ms slower in its forward
        return np.vstack([_window(0.0, first, n=10), _window(5.0, first, n=10)])

    monkeypatch.setattr(mon, "_judge", judge)
    monkeypatch.setattr(mon, "_close_judge_proc", lambda: None)
    mon._hand_to_judge(gathered(20), 2)  # the first: judged, its cost not counted
    assert done.acquire(timeout=10)
    mon._hand_to_judge(gathered(30), 2)  # judged: the next may be 5 s later
    assert done.acquire(timeout=10)
    for first in (40, 50):
        mon._hand_to_judge(gathered(first), 2)
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)
    thread.join(10)
    assert not thread.is_alive() and done.acquire(timeout=1)
    assert [steps for steps, _ in judged] == [
        list(range(20, 30)),
        list(range(30, 40)),
        list(range(40, 60)),  # held, then judged together at the stop
    ]
    assert all(f == [10 * MS, 15 * MS] for _, f in judged)  # each rank's rows stay its own
    assert counted == [1, 1, 2]  # the held two count as two windows for the logging
    assert mon.judge_held == 2 and mon.judge_skipped == 0 and mon.judgments == 3
    assert mon.judge_next_s > time.monotonic() + 4  # 50 ms at 1 %: 5 s from the last

    # once the time has passed, a window is judged as it comes, with the ones held before it
    mon._judge_q, judged[:] = None, []
    mon.judge_next_s = time.monotonic() + 0.3
    mon._hand_to_judge(gathered(60), 2)  # held
    time.sleep(0.4)
    mon._hand_to_judge(gathered(70), 2)  # due: judged with 60-69
    assert done.acquire(timeout=10)
    assert [steps for steps, _ in judged] == [list(range(60, 80))]

    # what is held is bounded in bytes: past JUDGE_HELD_BYTES the oldest drops, counted
    monkeypatch.setattr(live, "JUDGE_HELD_BYTES", 2 * gathered(0).nbytes)
    judged[:] = []
    mon.judge_next_s = time.monotonic() + 60
    for first in (80, 90, 100):
        mon._hand_to_judge(gathered(first), 2)
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)
    thread.join(10)
    assert done.acquire(timeout=1) and mon.judge_skipped == 1
    assert [steps for steps, _ in judged] == [list(range(90, 110))]

    # the world changes size (elastic): what was held is judged at once, apart from the new
    mon._judge_q, judged[:] = None, []
    mon.judge_next_s = time.monotonic() + 60
    mon._hand_to_judge(gathered(110), 2)
    mon._hand_to_judge(_window(0.0, 120, n=10), 1)
    assert done.acquire(timeout=10) and [steps for steps, _ in judged] == [list(range(110, 120))]
    thread = [t for t in threading.enumerate() if t.name == "hvtrace-judge"][-1]
    live.LiveMonitor._stop_judge(mon)
    thread.join(10)
    assert [steps for steps, _ in judged] == [list(range(110, 120)), list(range(120, 130))]
    assert mon.judge_skipped == 1


def test_windows_judged_together_count_as_that_many_for_the_logging(caplog) -> None:
    """A judgment of windows that the CPU budget held counts as that many windows in a row: a
    slow rank named in two held windows judged together is logged at once (as two windows
    judged one by one would be), and one clean judgment of two windows recovers it; a single
    window named alone is still not logged."""
    rec = SimpleNamespace(enabled=True, live_events=[])
    mon = live.LiveMonitor.__new__(live.LiveMonitor)
    mon.tracer, mon.hosts = SimpleNamespace(rec=rec), {0: "a", 1: "b"}
    mon.init_verdicts()
    mon.judge = live_judge.verdicts
    mon._judge_proc, mon._judge_q = None, None

    def two(first: int, slow: float) -> np.ndarray:  # windows first.. and first+20.., merged
        held = [np.vstack([_window(0.0, f), _window(slow, f)]) for f in (first, first + 20)]
        return live._merge_windows(held, 2)

    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        mon._judge(np.vstack([_window(0.0, 0), _window(20.0, 0)]), 2)  # one window: not yet
        mon._judge(np.vstack([_window(0.0, 20), _window(0.0, 20)]), 2)
        assert not rec.live_events
        mon._judge(two(40, 20.0), 2, windows=2)
        assert [e["event"] for e in rec.live_events] == ["late"]
        assert "rank 1 (host b) late 20.0 ms/step over steps 40-79: forward" in caplog.text
        mon._judge(two(80, 0.0), 2, windows=2)
    assert [e["event"] for e in rec.live_events] == ["late", "recovered"]


def test_the_judges_share_is_a_setting(monkeypatch) -> None:
    """0.25 % of a core by default; HVTRACE_JUDGE_PCT in percent, bounded to 0.01..100."""
    from hvtrace import settings

    monkeypatch.delenv("HVTRACE_JUDGE_PCT", raising=False)
    assert settings.judge_share() == pytest.approx(0.0025)
    monkeypatch.setenv("HVTRACE_JUDGE_PCT", "100")
    assert settings.judge_share() == 1.0
    monkeypatch.setenv("HVTRACE_JUDGE_PCT", "0")
    assert settings.judge_share() == pytest.approx(0.0025)  # out of bounds: the default
