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
