"""Timestamps for the hot path: host monotonic clock, or CUDA events resolved lazily.

A timer's ``now()`` returns a *token*: an ``int`` (ns on the host monotonic clock) or, for the CUDA
timer, a CUDA event recorded on the current stream. Tokens are turned into ns on the
rank's monotonic clock by ``resolve()``, called only from the writer thread and only for events
that ``query()`` reports done, so the training loop never synchronizes with the device.

The device's clock and the host's drift apart (about 21 ppm on an H100: 0.84 ms in 41 s,
``scripts/gpu_check.py``), so the CUDA timer re-ties them from the writer thread about once a
second and resolves through a line fitted to its recent ties (see :class:`CudaTimer`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from hvtrace.format.schema import FLAG_CUDA

log = logging.getLogger(__name__)

monotonic_ns = time.monotonic_ns


class HostTimer:
    """Host monotonic clock timer: tokens are ints and resolve to themselves."""

    flags = 0
    is_cuda = False

    now = staticmethod(monotonic_ns)

    @staticmethod
    def ready(token: Any) -> bool:
        """Return True: host tokens are always resolved."""
        return True

    @staticmethod
    def resolve(token: Any) -> int:
        """Return the token's time in ns on the monotonic clock."""
        return int(token)

    def release(self, token: Any) -> None:
        """Return a token to the pool (nothing to do for host tokens)."""

    def keep_tied(self) -> None:
        """Nothing to do: host tokens are on the host clock."""


class CudaTimer:
    """CUDA-event timer for one device.

    At construction (outside the training loop) it records anchor events and synchronizes after
    each, so that an anchor's device time is known on the host clock: of ``ANCHOR_TRIES`` such
    round trips it keeps the shortest (the anchor fired somewhere inside it; its midpoint is off
    by at most half of it, ``anchor_uncertainty_ns``). Later events are taken from a pool and
    recorded on the current stream without synchronizing.

    The two clocks drift apart (tens of ppm: a millisecond a minute), and ``elapsed_time`` is a
    32-bit float of ms (2 µs steps 40 s after its reference, 0.2 ms an hour after). So the writer
    thread calls :meth:`keep_tied` before it resolves, which about once a second (``TIE_EVERY_NS``)
    ties the clocks again without touching the training stream: an event recorded on an idle
    high-priority side stream, polled until it completes (shortest of ``TIE_TRIES``; a try longer
    than ``TIE_MAX_NS`` is dropped). ``resolve`` maps an event through the newest tie and the rate
    of a line fitted to the last ``TIES_KEPT`` ties (rate 1 until they span ``RATE_MIN_SPAN_NS``;
    a fit beyond ``RATE_MAX_PPM`` is refused): ``tie_ns + tie.elapsed_time(event) * rate``.

    Events are ``torch.Event`` (recorded on the device's current stream in C++, a few µs) where
    that works, else ``torch.cuda.Event`` (whose ``record`` builds a Python stream object first).
    """

    flags = FLAG_CUDA
    is_cuda = True
    #: Record-and-synchronize round trips tried for the anchor (the shortest is kept).
    ANCHOR_TRIES = 16
    #: How often (host ns) the writer ties the clocks again.
    TIE_EVERY_NS = 1_000_000_000
    #: Side-stream records polled per tie (the shortest is kept).
    TIE_TRIES = 4
    #: A try whose event has not completed this long after its record is dropped.
    TIE_MAX_NS = 200_000
    #: Ties the rate is fitted to (one a second: the last minute).
    TIES_KEPT = 64
    #: The ties must span this much host time before a rate other than 1 is fitted.
    RATE_MIN_SPAN_NS = 2_000_000_000
    #: A fitted rate further from 1 than this is refused (a tie gone wrong, not a clock).
    RATE_MAX_PPM = 500.0

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self._device = dev
        self._pool: deque = deque()
        with torch.cuda.device(dev):
            self._new = self._event_factory(torch, dev)
            best: tuple[int, int, Any] | None = None
            torch.cuda.synchronize()
            for _ in range(self.ANCHOR_TRIES):
                ev = self._new()
                t0 = monotonic_ns()
                ev.record()
                torch.cuda.synchronize()
                t1 = monotonic_ns()
                if best is None or t1 - t0 < best[1] - best[0]:
                    best = (t0, t1, ev)
            try:  # the stream ties are recorded on; without it the anchor alone, as before
                self._side: Any = torch.cuda.Stream(device=dev, priority=-1)
            except Exception as exc:  # noqa: BLE001 - a figure less exact, never a failure
                log.warning("hvtrace: no side stream to re-tie CUDA clocks (%s)", exc)
                self._side = None
        assert best is not None
        t0, t1, self._anchor = best
        self.anchor_ns = (t0 + t1) // 2
        self.anchor_uncertainty_ns = (t1 - t0) // 2
        #: the newest tie: its event, its host time (ns) and the host time it was made
        self._tie, self._tie_ns, self._tied_at_ns = self._anchor, self.anchor_ns, t1
        #: the ties kept for the rate: (device ns since the anchor, host ns)
        self._ties: deque[tuple[float, int]] = deque([(0.0, self.anchor_ns)], self.TIES_KEPT)
        #: host ns per device ns (1 until fitted)
        self.rate = 1.0

    @property
    def drift_ppm(self) -> float:
        """How much faster the host clock runs than the device's, in ppm, as last fitted."""
        return (self.rate - 1.0) * 1e6

    def keep_tied(self) -> None:
        """Tie the clocks again when ``TIE_EVERY_NS`` has passed (writer thread; never raises)."""
        if self._side is None or monotonic_ns() - self._tied_at_ns < self.TIE_EVERY_NS:
            return
        try:
            self._tie_again()
        except Exception as exc:  # noqa: BLE001 - keep the last tie, never fail the writer
            log.warning("hvtrace: CUDA clock tie failed (%s); keeping the last one", exc)
            self._side = None

    def _tie_again(self) -> None:
        best: tuple[int, int, Any] | None = None
        for _ in range(self.TIE_TRIES):
            ev = self._new()
            t0 = monotonic_ns()
            ev.record(self._side)
            t1 = t0
            while not ev.query():
                t1 = monotonic_ns()
                if t1 - t0 > self.TIE_MAX_NS:
                    break
            else:
                t1 = monotonic_ns()
                if best is None or t1 - t0 < best[1] - best[0]:
                    best = (t0, t1, ev)
        self._tied_at_ns = monotonic_ns()
        if best is None:
            return
        t0, t1, ev = best
        host_ns = (t0 + t1) // 2
        dev_ns = self._ties[-1][0] + self._tie.elapsed_time(ev) * 1e6
        self._ties.append((dev_ns, host_ns))
        self.rate = self._fit_rate()
        self._tie, self._tie_ns = ev, host_ns

    def _fit_rate(self) -> float:
        """Least-squares slope of host ns on device ns over the ties kept (1 when they span too
        little time or the slope is implausible)."""
        ties = self._ties
        if ties[-1][1] - ties[0][1] < self.RATE_MIN_SPAN_NS:
            return 1.0
        n = len(ties)
        md = sum(d for d, _ in ties) / n
        mh = sum(h for _, h in ties) / n
        var = sum((d - md) ** 2 for d, _ in ties)
        if var <= 0:
            return 1.0
        rate = sum((d - md) * (h - mh) for d, h in ties) / var
        if abs(rate - 1.0) * 1e6 > self.RATE_MAX_PPM:
            return self.rate
        return rate

    @staticmethod
    def _event_factory(torch: Any, dev: Any) -> Any:
        """``torch.Event`` on ``dev`` when it records, completes and times as the CUDA event does
        (checked here, once, synchronizing), else ``torch.cuda.Event``."""

        def cuda_event() -> Any:
            return torch.cuda.Event(enable_timing=True)

        generic = getattr(torch, "Event", None)
        if generic is None:
            return cuda_event

        def event() -> Any:
            return generic(device=dev, enable_timing=True)

        try:
            a, b = event(), event()
            a.record()
            b.record()
            torch.cuda.synchronize()
            if not (a.query() and b.query() and a.elapsed_time(b) >= 0):
                return cuda_event
        except Exception:  # noqa: BLE001 - an older or different torch: the CUDA event
            return cuda_event
        return event

    def now(self) -> Any:
        """Record an event on the current stream and return it (no synchronization)."""
        try:
            ev = self._pool.pop()
        except IndexError:
            ev = self._new()
        ev.record()
        return ev

    @staticmethod
    def ready(token: Any) -> bool:
        """Return whether the token's time is known without waiting (its event completed)."""
        return isinstance(token, int) or token.query()

    def resolve(self, token: Any) -> int:
        """Return the token's time in ns on the host monotonic clock (call only when ready)."""
        if isinstance(token, int):
            return token
        return self._tie_ns + round(self._tie.elapsed_time(token) * 1e6 * self.rate)

    def release(self, token: Any) -> None:
        """Give a resolved event back to the pool."""
        if not isinstance(token, int):
            self._pool.append(token)


def make_timer(device: Any) -> HostTimer | CudaTimer:
    """Return a CUDA timer when ``device`` is a CUDA device, else the host timer."""
    if device is not None and getattr(device, "type", str(device)).startswith("cuda"):
        return CudaTimer(device)
    return HostTimer()
