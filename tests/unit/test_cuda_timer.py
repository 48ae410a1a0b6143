"""The CUDA timer without a GPU: its anchor (the shortest of its record-and-synchronize round
trips), its choice of event type, and how it resolves events onto the host clock. The same timer
on a GPU, against CUPTI: scripts/gpu_check.py (issue 38)."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from hvtrace.record import timers


class _Clock:
    """The device's clock as fake events see it (ms), advanced by each record."""

    def __init__(self) -> None:
        self.ms = 0.0


def _event_class(clock: _Clock, fail: bool = False):
    class Event:
        made = 0

        def __init__(self, *args, **kwargs) -> None:
            if fail:
                raise RuntimeError("no generic events here")
            type(self).made += 1
            self.t_ms: float | None = None

        def record(self, stream=None) -> None:
            clock.ms += 0.5
            self.t_ms = clock.ms

        def query(self) -> bool:
            return self.t_ms is not None

        def elapsed_time(self, other) -> float:
            return other.t_ms - self.t_ms

    return Event


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's CUDA calls replaced: synchronize does nothing, the device context is empty, the
    host clock (the timer's monotonic_ns) is scripted: round trips of 40, 10, 30, then 20 µs..."""
    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _event_class(clock))
    gaps = itertools.cycle([40_000, 10_000, 30_000, 20_000])
    state = {"t": 1_000_000_000, "open": False}

    def mono() -> int:
        if state["open"]:
            state["t"] += next(gaps)
        else:
            state["t"] += 1_000_000
        state["open"] = not state["open"]
        return state["t"]

    monkeypatch.setattr(timers, "monotonic_ns", mono)
    return clock, monkeypatch


def test_the_anchor_is_the_shortest_round_trip(fake_cuda) -> None:
    clock, monkeypatch = fake_cuda
    monkeypatch.setattr(torch, "Event", _event_class(clock))
    timer = timers.CudaTimer(torch.device("cuda", 0))
    assert timer.anchor_uncertainty_ns == 5_000  # half the shortest (10 µs) of 16 round trips
    ev = timer.now()
    # resolved as the anchor plus the device time between them (here 0.5 ms per record)
    assert timer.resolve(ev) == timer.anchor_ns + round(timer._anchor.elapsed_time(ev) * 1e6)
    assert timer.resolve(ev) > timer.anchor_ns and timer.ready(ev)
    assert timer.resolve(12345) == 12345 and timer.ready(12345)  # host tokens pass through


def test_generic_events_are_used_where_they_work(fake_cuda) -> None:
    clock, monkeypatch = fake_cuda
    generic = _event_class(clock)
    monkeypatch.setattr(torch, "Event", generic)
    timer = timers.CudaTimer(torch.device("cuda", 0))
    assert isinstance(timer.now(), generic)


def test_the_cuda_event_where_generic_events_fail(fake_cuda) -> None:
    clock, monkeypatch = fake_cuda
    monkeypatch.setattr(torch, "Event", _event_class(clock, fail=True))
    timer = timers.CudaTimer(torch.device("cuda", 0))
    assert isinstance(timer.now(), torch.cuda.Event)


def test_released_events_are_recorded_again(fake_cuda) -> None:
    """The pool: an event given back is the next one recorded (no new event per token)."""
    clock, monkeypatch = fake_cuda
    monkeypatch.setattr(torch, "Event", _event_class(clock))
    timer = timers.CudaTimer(torch.device("cuda", 0))
    ev = timer.now()
    timer.release(ev)
    assert timer.now() is ev
    timer.release(7)  # a host token: nothing to give back
    assert len(timer._pool) == 0


# -- re-tying the clocks: a device clock that drifts from the host's ------------------------------
DRIFT_PPM = 21.0  # as measured on an H100 (scripts/gpu_check.py: 0.84 ms in 41 s)


class _Host:
    """The host clock: each reading moves it on 1 µs (the code between two readings)."""

    def __init__(self) -> None:
        self.ns = 5_000_000_000

    def mono(self) -> int:
        self.ns += 1_000
        return self.ns


def _drifting_event_class(host: _Host, pending: set):
    """Events stamped by a device clock DRIFT_PPM slower than the host's, with elapsed_time a
    32-bit float of ms as CUDA gives it; an event whose stream is in ``pending`` never completes."""
    import numpy as np

    class Event:
        def __init__(self, *args, **kwargs) -> None:
            self.t_dev_ns: float | None = None
            self.stream = None

        def record(self, stream=None) -> None:
            self.stream = stream
            self.t_dev_ns = 7e12 + host.ns * (1 - DRIFT_PPM * 1e-6)

        def query(self) -> bool:
            return self.t_dev_ns is not None and self.stream not in pending

        def elapsed_time(self, other) -> float:
            return float(np.float32((other.t_dev_ns - self.t_dev_ns) / 1e6))

    return Event


@pytest.fixture
def drifting_cuda(monkeypatch):
    host, pending = _Host(), set()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: object())
    monkeypatch.setattr(torch.cuda, "Event", _drifting_event_class(host, pending))
    monkeypatch.delattr(torch, "Event", raising=False)
    monkeypatch.setattr(timers, "monotonic_ns", host.mono)
    return host, pending


def _run_for(timer, host: _Host, seconds: int) -> list[int]:
    """A token a second for ``seconds`` s, the writer tying and resolving as it goes: each
    token's error (resolved minus the host time it was recorded at), ns."""
    errors = []
    for _ in range(seconds):
        host.ns += 1_000_000_000
        true_ns = host.ns
        tok = timer.now()
        host.ns += 300_000_000  # resolved at the writer's next flush
        timer.keep_tied()
        errors.append(timer.resolve(tok) - true_ns)
    return errors


def test_drifting_clocks_stay_tied_over_an_hour(drifting_cuda) -> None:
    """By the first anchor alone, an hour at 21 ppm puts events 76 ms early (and the 32-bit
    elapsed_time rounds to 0.2 ms); re-tied once a second, every event is within 10 µs of when
    it was recorded (at rate 1 before a rate is fitted: 0.3 s at 21 ppm), and within 2 µs once
    the ties span RATE_MIN_SPAN_NS and a rate is fitted, to the hour's end."""
    host, _ = drifting_cuda
    timer = timers.CudaTimer(torch.device("cuda", 0))
    anchor = timer._anchor
    errors = _run_for(timer, host, 3600)
    assert max(abs(e) for e in errors) <= 10_000, (min(errors), max(errors))
    assert max(abs(e) for e in errors[3:]) <= 2_000, (min(errors[3:]), max(errors[3:]))
    assert timer.drift_ppm == pytest.approx(DRIFT_PPM, abs=0.1)
    tok = timer.now()
    by_anchor = timer.anchor_ns + round(anchor.elapsed_time(tok) * 1e6)
    assert by_anchor - host.ns < -70_000_000  # what the first anchor alone would give


def test_a_tie_that_does_not_complete_is_dropped(drifting_cuda) -> None:
    """The side stream held up (its events never complete): each try gives up after TIE_MAX_NS,
    the last tie and rate stay, and the timer tries again a second later."""
    host, pending = drifting_cuda
    timer = timers.CudaTimer(torch.device("cuda", 0))
    _run_for(timer, host, 10)
    tie, rate, n = timer._tie, timer.rate, len(timer._ties)
    pending.add(timer._side)
    before = host.ns
    host.ns += 2_000_000_000
    timer.keep_tied()
    assert (timer._tie, timer.rate, len(timer._ties)) == (tie, rate, n)
    spent = host.ns - before - 2_000_000_000
    assert spent < timer.TIE_TRIES * (timer.TIE_MAX_NS + 10_000)  # bounded polling
    pending.clear()
    host.ns += 2_000_000_000
    timer.keep_tied()
    assert len(timer._ties) == n + 1


def test_a_failing_tie_keeps_the_last_and_stops_trying(drifting_cuda, caplog) -> None:
    host, _ = drifting_cuda
    timer = timers.CudaTimer(torch.device("cuda", 0))
    _run_for(timer, host, 5)
    tie = timer._tie

    def broken(*a, **k):
        raise RuntimeError("device lost")

    timer._new = broken
    host.ns += 2_000_000_000
    with caplog.at_level("WARNING"):
        timer.keep_tied()
    assert timer._tie is tie and timer._side is None
    assert "CUDA clock tie failed" in caplog.text
    timer.keep_tied()  # no second warning, no exception


def test_an_implausible_rate_is_refused(drifting_cuda) -> None:
    """A tie 5 ms off (not a clock: a tie gone wrong) does not bend the rate past RATE_MAX_PPM."""
    host, _ = drifting_cuda
    timer = timers.CudaTimer(torch.device("cuda", 0))
    _run_for(timer, host, 3)
    d, h = timer._ties[-1]
    timer._ties.append((d + 1e9, h + 1_000_000_000 + 5_000_000))
    assert abs(timer._fit_rate() - 1.0) * 1e6 <= timer.RATE_MAX_PPM
