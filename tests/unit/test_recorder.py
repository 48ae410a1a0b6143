"""The per-rank Recorder, its background writer, and the user API (span, scalar)."""

from __future__ import annotations

import atexit
import errno
import logging
import math
import signal
import time
import warnings
from pathlib import Path

import pytest
from helpers import make_header

import hvtrace
from hvtrace.format.read import read_rank_file
from hvtrace.format.schema import DTYPE_CODE, KIND_CODE
from hvtrace.load import load_run
from hvtrace.record import recorder as recmod
from hvtrace.record.recorder import Recorder, active_recorder
from hvtrace.record.rows import Allreduces
from hvtrace.record.writer import TraceFile

RUN = "20240101-000000-7ec0de"
NEVER = 1e6  # a flush interval the writer thread never reaches during a test


@pytest.fixture()
def recorders():
    """Create Recorders; afterwards close them and undo their process-wide side effects."""
    saved = {
        s: signal.getsignal(s) for s in (signal.SIGTERM, getattr(signal, "SIGXFSZ", None)) if s
    }
    made: list[Recorder] = []

    def make(trace_dir, **kw) -> Recorder:
        header = kw.pop("header", None) or make_header(0, 1, RUN)
        rec = Recorder(trace_dir, header, **kw)
        made.append(rec)
        return rec

    yield make
    for rec in made:
        rec.close()
        atexit.unregister(rec.close)
    recmod._set_active(None)
    for s, h in saved.items():
        signal.signal(s, h)


def _hvtrace_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings hvtrace logged (its one channel for 'tracing disabled')."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "hvtrace" and r.levelno >= logging.WARNING
    ]


def _rows(rf) -> list[dict]:
    return rf.table.to_pylist()


def _closed(rec: Recorder) -> Path:
    """The rank's file: the Parquet file a cleanly closed stream was compacted into, else the
    stream itself (still open, or left as written)."""
    parquet = rec.path.with_suffix(".parquet")
    return parquet if parquet.exists() else rec.path


def test_add_close_writes_final_complete_file(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path / "trace", flush_interval_s=NEVER)
    assert rec.enabled
    assert rec.path == tmp_path / "trace" / f"rank00000-{RUN}.arrows"
    rec.add(KIND_CODE["forward"], "forward", 100, 200)
    rec.step = 1
    rec.micro = 1
    rec.add(KIND_CODE["allreduce"], "net.0.weight", 300, 400, 1024, DTYPE_CODE["float16"], flags=2)
    rec.add(KIND_CODE["scalar"], "loss", 500, 500, value=0.5, step=0)
    rec.close()
    assert not rec.enabled
    rec.close()  # idempotent

    rf = read_rank_file(_closed(rec))
    assert rf.format == "parquet" and not rec.path.exists()  # compacted when closed
    assert rf.complete and not rf.truncated
    assert rf.dropped == 0
    assert rf.header == rec.header
    rows = _rows(rf)  # the compacted file is sorted by (step, start_ns)
    assert [(r["kind"], r["name"], r["step"], r["micro"]) for r in rows] == [
        ("forward", "forward", 0, 0),
        ("scalar", "loss", 0, 1),
        ("allreduce", "net.0.weight", 1, 1),
    ]
    assert [(r["start_ns"], r["end_ns"]) for r in rows] == [(100, 200), (500, 500), (300, 400)]
    assert rows[2]["bytes"] == 1024 and rows[2]["dtype"] == "float16" and rows[2]["flags"] == 2
    assert rows[1]["value"] == 0.5 and math.isnan(rows[0]["value"])
    assert rf.last_step == 1
    run = load_run(tmp_path / "trace")
    assert run.complete and run.problems == []


def test_writer_thread_flushes_periodically(tmp_path: Path, recorders) -> None:
    """Spans reach the file within about one flush interval, before close()."""
    rec = recorders(tmp_path, flush_interval_s=0.05)
    for i in range(5):
        rec.add(KIND_CODE["user"], f"u{i}", i, i + 1)
    deadline = time.monotonic() + 20
    spans = 0
    while time.monotonic() < deadline:
        if rec.path.exists() and rec.path.stat().st_size > 0:
            rf = read_rank_file(_closed(rec))
            spans = rf.spans
            if spans == 5:
                break
        time.sleep(0.05)
    assert spans == 5
    assert not rf.complete  # still open
    rec.close()
    assert read_rank_file(_closed(rec)).complete


def test_full_buffer_drops_and_counts(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path, buffer_spans=10, flush_interval_s=NEVER)
    for i in range(25):
        rec.add(KIND_CODE["user"], f"s{i}", i, i + 1)
    assert rec.dropped == 15
    rec.close()
    rf = read_rank_file(_closed(rec))
    assert rf.dropped == 15
    assert rf.spans == 10
    assert [r["name"] for r in _rows(rf)] == [f"s{i}" for i in range(10)]  # the first ones kept
    assert rf.complete
    run = load_run(tmp_path)
    assert not run.complete
    assert any("dropped 15 spans" in p for p in run.problems), run.problems


def test_extend_expands_allreduces_in_the_writer_and_drops_whole(tmp_path: Path, recorders) -> None:
    """A synchronize's allreduces are one buffer entry: the writer makes one span per tensor,
    ending when its handle's completion was first observed (else at the synchronize's end)."""
    rec = recorders(tmp_path, buffer_spans=4, flush_interval_s=NEVER)
    meta = {"a": (["t0", "t1"], [8, 4], [1, 1]), "b": (["u"], [2], [2])}
    enq = [(10, "a", (7, None)), (12, "b", (8, None)), (13, "b", lambda: None)]
    done = [(7, 15), (8, 30), (7, 99)]  # polled first (15), then seen again at synchronize
    rec.extend(
        [
            (3, 0, KIND_CODE["user"], "first", 0, 1, 0, 0, math.nan, 0),
            Allreduces(3, 1, 2, enq, done, 40, meta),
        ]
    )
    assert rec.dropped == 0
    rec.extend([(4, 0, KIND_CODE["user"], f"x{i}", 0, 1, 0, 0, math.nan, 0) for i in range(3)])
    assert rec.dropped == 3  # 2 + 3 entries > 4: the three are dropped together
    rec.extend([Allreduces(4, 0, 2, enq[:1], [], 50, meta)])
    assert rec.dropped == 3
    rec.extend([Allreduces(5, 0, 2, enq, [], 50, meta)] * 2)
    assert rec.dropped == 3 + 2 * 4  # a dropped entry counts its spans (tensors)
    rec.close()
    rows = sorted(_rows(read_rank_file(_closed(rec))), key=lambda r: (r["step"], r["start_ns"]))
    got = [(r["step"], r["micro"], r["name"], r["start_ns"], r["end_ns"], r["bytes"]) for r in rows]
    assert got == [
        (3, 0, "first", 0, 1, 0),
        (3, 1, "t0", 10, 15, 8),
        (3, 1, "t1", 10, 15, 4),
        (3, 1, "u", 12, 30, 2),
        (3, 1, "u", 13, 40, 2),  # a callable handle (sparse): ends at the synchronize's end
        (4, 0, "t0", 10, 50, 8),
        (4, 0, "t1", 10, 50, 4),
    ]
    assert all(r["flags"] == 2 and r["cpu_ns"] is None for r in rows[1:])


def test_buffer_frees_up_after_a_flush(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path, buffer_spans=4, flush_interval_s=NEVER)
    for i in range(6):
        rec.add(KIND_CODE["user"], f"a{i}", i, i)
    rec.flush()
    for i in range(3):
        rec.add(KIND_CODE["user"], f"b{i}", i, i)
    rec.close()
    rf = read_rank_file(_closed(rec))
    assert rf.dropped == 2
    names = sorted(r["name"] for r in _rows(rf))  # (the compacted file is in step order)
    assert names == ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]


def test_unwritable_trace_dir_disables_with_one_warning(
    tmp_path: Path, recorders, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    trace_dir = blocker / "trace"
    with (
        caplog.at_level(logging.WARNING, logger="hvtrace"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        rec = recorders(trace_dir)  # must not raise
        assert not rec.enabled
        assert rec.writer is None
        rec.add(KIND_CODE["user"], "x", 0, 1)  # the hot path still never raises
        rec.fail("a second failure")  # no second warning
        rec.flush()
        rec.close()
    msgs = _hvtrace_warnings(caplog)
    assert len(msgs) == 1, msgs
    assert "tracing disabled" in msgs[0]
    assert str(trace_dir) in msgs[0]
    # one channel: not repeated through the warnings module (the user would see it twice)
    assert not [w for w in caught if "tracing disabled" in str(w.message)]
    assert blocker.read_text() == "not a directory"
    assert not trace_dir.exists()


def test_span_context_manager_and_decorator(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path, flush_interval_s=NEVER)
    recmod._set_active(rec)
    assert active_recorder() is rec

    rec.step = 3
    with hvtrace.span("data") as sp:
        assert isinstance(sp, hvtrace.span)
        rec.step = 4  # the step advances inside the span: it still belongs to step 3
        time.sleep(0.02)

    @hvtrace.span("checkpoint")
    def save(x: int, *, y: int = 0) -> int:
        """Docstring kept."""
        time.sleep(0.01)
        return x + y

    rec.step = 7
    assert save(1, y=2) == 3
    assert save.__name__ == "save" and save.__doc__ == "Docstring kept."
    rec.step = 8
    assert save(5) == 5

    with pytest.raises(ValueError, match="boom"), hvtrace.span("failing"):
        raise ValueError("boom")

    rec.close()
    rows = _rows(read_rank_file(_closed(rec)))
    assert all(r["kind"] == "user" for r in rows)
    assert [(r["name"], r["step"]) for r in rows] == [
        ("data", 3),
        ("checkpoint", 7),
        ("checkpoint", 8),
        ("failing", 8),
    ]
    durations = [r["end_ns"] - r["start_ns"] for r in rows]
    assert durations[0] >= 20_000_000
    assert durations[1] >= 10_000_000 and durations[2] >= 10_000_000
    assert all(d >= 0 for d in durations)
    # nested/sequential spans are in time order
    starts = [r["start_ns"] for r in rows]
    assert starts == sorted(starts)


def test_scalar_records_value_and_step(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path, flush_interval_s=NEVER)
    recmod._set_active(rec)
    rec.step = 5
    hvtrace.scalar("loss", 1.25)
    rec.step, rec.between_steps = 6, True  # after opt.step(): belongs to the step just finished
    hvtrace.scalar("loss", 0.75)
    rec.between_steps = False
    hvtrace.scalar("lr", 3)
    rec.close()
    rows = _rows(read_rank_file(_closed(rec)))
    assert [(r["kind"], r["name"], r["step"], r["value"]) for r in rows] == [
        ("scalar", "loss", 5, 1.25),
        ("scalar", "loss", 5, 0.75),
        ("scalar", "lr", 6, 3.0),
    ]
    assert all(r["start_ns"] == r["end_ns"] for r in rows)


def test_span_and_scalar_are_noops_without_active_recorder(tmp_path: Path, recorders) -> None:
    rec = recorders(tmp_path, flush_interval_s=NEVER)  # exists but is not active
    assert active_recorder() is None

    with hvtrace.span("nothing"):
        pass

    @hvtrace.span("deco")
    def f() -> str:
        return "ok"

    assert f() == "ok"
    assert hvtrace.scalar("loss", 1.0) is None
    assert len(rec._buf) == 0

    # an active but disabled recorder records nothing either
    recmod._set_active(rec)
    rec.enabled = False
    with hvtrace.span("off"):
        pass
    assert f() == "ok"
    hvtrace.scalar("loss", 2.0)
    assert len(rec._buf) == 0
    rec.enabled = True
    rec.close()
    assert read_rank_file(_closed(rec)).spans == 0


def test_writer_error_disables_and_keeps_flushed_spans(
    tmp_path: Path, recorders, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    rec = recorders(tmp_path, flush_interval_s=NEVER)
    recmod._set_active(rec)
    for i in range(5):
        rec.add(KIND_CODE["user"], f"ok{i}", i, i + 1)
    rec.flush()  # first batch written for real

    def no_space(self, batch, status):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TraceFile, "write_batch", no_space)
    for i in range(3):
        rec.add(KIND_CODE["user"], f"lost{i}", i, i + 1)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        rec.flush()  # must not raise
        assert not rec.enabled
        assert active_recorder() is None  # span()/scalar() stop recording at once
        with hvtrace.span("after"):
            pass
        rec.flush()
        rec.close()  # must not raise either
    msgs = _hvtrace_warnings(caplog)
    assert len(msgs) == 1, msgs
    assert "tracing disabled" in msgs[0] and "No space left" in msgs[0]

    monkeypatch.undo()
    rf = read_rank_file(_closed(rec))
    assert [r["name"] for r in _rows(rf)] == [f"ok{i}" for i in range(5)]
    assert not rf.truncated
    assert not rf.complete  # no final batch could be written
    run = load_run(tmp_path)
    assert any("not closed cleanly" in p for p in run.problems), run.problems


def test_writer_error_in_background_thread(
    tmp_path: Path, recorders, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same failure inside the writer thread: recording stops, training code never sees it."""

    def no_space(self, batch, status):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TraceFile, "write_batch", no_space)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        rec = recorders(tmp_path, flush_interval_s=0.02)
        rec.add(KIND_CODE["user"], "x", 0, 1)
        deadline = time.monotonic() + 20
        while rec.enabled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not rec.enabled
        rec.add(KIND_CODE["user"], "y", 0, 1)
        rec.close()
    msgs = _hvtrace_warnings(caplog)
    assert len(msgs) == 1 and "No space left" in msgs[0], msgs


class _Event:
    """A stand-in for a CUDA event (the writer's view: query, synchronize), completed unless
    ``done`` is False (``synchronize`` completes it)."""

    def __init__(self, t: int, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _FakeCudaTimer:
    is_cuda = True
    flags = 1

    def __init__(self) -> None:
        self.released: list = []
        self.resolved: list = []

    @staticmethod
    def ready(tok) -> bool:
        return isinstance(tok, int) or tok.query()

    def resolve(self, tok) -> int:
        t = tok if isinstance(tok, int) else tok.t
        self.resolved.append(t)  # the time, not the event (held, it would never go back)
        return t

    def release(self, tok) -> None:
        self.released.append(tok)

    def keep_tied(self) -> None:
        pass


def test_cuda_events_go_back_to_the_pool_once_and_only_when_free(tmp_path: Path, recorders) -> None:
    """A token shared by two spans is given back once; one the tracer still holds (the next
    step's start) is not given back (it would be recorded again while still in use)."""
    timer = _FakeCudaTimer()
    rec = recorders(tmp_path, timer=timer, flush_interval_s=NEVER)
    shared, held = _Event(20), _Event(30)
    rec.add(KIND_CODE["forward"], "forward", _Event(10), shared, flags=1)
    rec.add(KIND_CODE["backward"], "backward", shared, held, flags=1)
    del shared  # only the buffer holds it now; ``held`` is still ours
    rec.flush()
    assert sorted(t.t for t in timer.released) == [10, 20]
    assert held.t == 30  # still ours
    rec.close()
    rows = sorted(_rows(read_rank_file(_closed(rec))), key=lambda r: r["start_ns"])
    assert [(r["start_ns"], r["end_ns"]) for r in rows] == [(10, 20), (20, 30)]


def test_cuda_allreduces_are_resolved_once_per_event_and_wait_whole(
    tmp_path: Path, recorders
) -> None:
    """A synchronize's allreduces with CUDA-event starts and end: each event is resolved once
    (the end is every tensor's end), the entry is written as its tensors' rows with those times,
    and one whose event has not completed waits whole for the next flush (no tensor of it
    written before)."""
    timer = _FakeCudaTimer()
    rec = recorders(tmp_path, timer=timer, flush_interval_s=NEVER)
    meta = {1: (["a", "b"], [8, 16], [DTYPE_CODE["float32"]] * 2), 2: (["c"], [4], [1])}
    end = _Event(900)
    first = Allreduces(
        0,
        0,
        1,
        [(_Event(100), 1, (11, None)), (_Event(200), 2, (12, None))],
        [(12, 500)],
        end,
        meta,
    )
    late_start = _Event(1100, done=False)
    second = Allreduces(1, 0, 1, [(late_start, 1, (13, None))], [], _Event(1900), meta)
    rec.extend([first, second])
    del first, second, end
    rec.flush()
    assert sorted(timer.resolved) == [100, 200, 900, 1900]  # once each; 500 a host int
    # the written entry's events back to the pool, once; the waiting entry's kept
    assert sorted(t.t for t in timer.released) == [100, 200, 900]
    assert [r["step"] for r in _rows(read_rank_file(rec.path))] == [0, 0, 0]
    late_start.done = True
    rec.flush()
    rec.close()
    rows = _rows(read_rank_file(_closed(rec)))
    got = sorted((r["step"], r["name"], r["start_ns"], r["end_ns"], r["bytes"]) for r in rows)
    assert got == [
        (0, "a", 100, 900, 8),
        (0, "b", 100, 900, 16),
        (0, "c", 200, 500, 4),  # its handle's wait returned first, on the host clock
        (1, "a", 1100, 1900, 8),
        (1, "b", 1100, 1900, 16),
    ]


def test_a_recorder_notes_a_stall_in_its_file(tmp_path, recorders, monkeypatch) -> None:
    """Through the real writer thread: a tracer stuck in synchronize for longer than
    HVTRACE_STALL_S gets a stall record into the file, which the loader reads back."""
    from types import SimpleNamespace

    monkeypatch.setenv("HVTRACE_STALL_S", "0.5")
    r = recorders(tmp_path, flush_interval_s=0.05)
    r.tracer = SimpleNamespace(
        in_sync=True, meta={1: (["net.0.weight"], [4], ["float32"])}, enqueued=[(0, 1, 7)], done=[]
    )
    r.step = 4
    time.sleep(1.5)
    r.tracer = None
    r.close()
    (path,) = tmp_path.glob("rank00000-*")  # compacted at close: the merged status
    got = read_rank_file(path).stalls
    assert [(s["step"], s["pending"]) for s in got] == [(4, ["net.0.weight"])]
    assert got[0]["waited_s"] >= 1.0  # merged: the latest record wins
