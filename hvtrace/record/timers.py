"""Timestamps for the hot path: host monotonic clock, or CUDA events resolved lazily.

A timer's ``now()`` returns a *token*: an ``int`` (ns on the host monotonic clock) or, for the CUDA
timer, a ``torch.cuda.Event`` recorded on the current stream. Tokens are turned into ns on the
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

    At construction (outside the training loop) it records an anchor event and synchronizes once,
    so that the anchor's device time is known on the host clock. Later events are taken from a
    pool and recorded on the current stream without synchronizing; ``resolve`` converts an event
    to host ns as ``anchor_ns + anchor.elapsed_time(event)``.
    """

    flags = FLAG_CUDA
    is_cuda = True

    def __init__(self, device: Any = None) -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device) if device is not None else torch.device("cuda")
        self._pool: deque = deque()
        with torch.cuda.device(self._device):
            torch.cuda.synchronize()
            self._anchor = torch.cuda.Event(enable_timing=True)
            t0 = monotonic_ns()
            self._anchor.record()
            torch.cuda.synchronize()
            t1 = monotonic_ns()
        self.anchor_ns = (t0 + t1) // 2
        self.anchor_uncertainty_ns = (t1 - t0) // 2

    def now(self) -> Any:
        """Record an event on the current stream and return it (no synchronization)."""
        try:
            ev = self._pool.pop()
        except IndexError:
            ev = self._torch.cuda.Event(enable_timing=True)
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
