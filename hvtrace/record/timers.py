"""Timestamps for the hot path: host monotonic clock, or CUDA events resolved lazily.

A timer's ``now()`` returns a *token*: an ``int`` (ns on the host monotonic clock) or, for the CUDA
timer, a CUDA event recorded on the current stream. Tokens are turned into ns on the
rank's monotonic clock by ``resolve()``, called only from the writer thread and only for events
that ``query()`` reports done, so the training loop never synchronizes with the device.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from hvtrace.format.schema import FLAG_CUDA

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


class CudaTimer:
    """CUDA-event timer for one device.

    At construction (outside the training loop) it records anchor events and synchronizes after
    each, so that an anchor's device time is known on the host clock: of ``ANCHOR_TRIES`` such
    round trips it keeps the shortest (the anchor fired somewhere inside it; its midpoint is off
    by at most half of it, ``anchor_uncertainty_ns``). Later events are taken from a pool and
    recorded on the current stream without synchronizing; ``resolve`` converts an event to host
    ns as ``anchor_ns + anchor.elapsed_time(event)``.

    Events are ``torch.Event`` (recorded on the device's current stream in C++, a few µs) where
    that works, else ``torch.cuda.Event`` (whose ``record`` builds a Python stream object first).
    """

    flags = FLAG_CUDA
    is_cuda = True
    #: Record-and-synchronize round trips tried for the anchor (the shortest is kept).
    ANCHOR_TRIES = 16

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
        assert best is not None
        t0, t1, self._anchor = best
        self.anchor_ns = (t0 + t1) // 2
        self.anchor_uncertainty_ns = (t1 - t0) // 2

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
        return self.anchor_ns + round(self._anchor.elapsed_time(token) * 1e6)

    def release(self, token: Any) -> None:
        """Give a resolved event back to the pool."""
        if not isinstance(token, int):
            self._pool.append(token)


def make_timer(device: Any) -> HostTimer | CudaTimer:
    """Return a CUDA timer when ``device`` is a CUDA device, else the host timer."""
    if device is not None and getattr(device, "type", str(device)).startswith("cuda"):
        return CudaTimer(device)
    return HostTimer()
