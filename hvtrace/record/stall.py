"""The stall watchdog: a rank that waits in ``synchronize`` too long says so in its file.

When one rank stops arriving (it skipped a tensor, deadlocked, or was stopped), the others wait
in ``synchronize`` forever, and Horovod's stall warning goes to rank 0's log only. The writer
thread (never the training thread) looks, at each of its flushes, at whether the traced
optimizer is inside ``synchronize`` and in which step; once the same wait has lasted
``HVTRACE_STALL_S`` seconds (default 60) the batch status gets a ``stall`` record, and again
every ``HVTRACE_STALL_S`` after that with the time waited so far, so that the file of a hung and
then killed job still shows it:

    {"step": 812, "micro": 0, "since_ns": ..., "waited_s": 61.0, "pending": ["net.0.weight"]}

``since_ns`` is when the wait was first seen (the recorder's clock, like the spans), so the
wait is known to within one flush interval; ``pending`` names the tensors whose allreduce this
rank had enqueued and not yet seen done, oldest first (at most :data:`MAX_PENDING`).

A rank blocked in a collective outside the optimizer (``hvd.allreduce`` of a metric,
``broadcast_object``, ...; :mod:`hvtrace.record.collectives`) gets the same record, with
``collective``: that collective's span name (``op|phase|tensor name``), and its tensor name as
``pending``.
"""

from __future__ import annotations

from typing import Any

from hvtrace.record.rows import handle_of
from hvtrace.record.timers import monotonic_ns

#: At most this many pending tensor names per stall record.
MAX_PENDING = 32


class StallWatch:
    """Called by the writer thread with the recorder's tracer; returns a record when due."""

    def __init__(self, stall_s: float) -> None:
        self.stall_ns = int(stall_s * 1e9)
        self._key: tuple[int, int, Any] | None = None
        self._since = 0
        self._next = 0

    def __call__(self, tracer: Any, step: int, micro: int) -> dict[str, Any] | None:
        """A stall record if this rank has waited in one ``synchronize`` for the stall time
        (and again each stall time after), else None."""
        coll = getattr(tracer, "in_collective", None) if tracer is not None else None
        if tracer is None or not (getattr(tracer, "in_sync", False) or coll):
            self._key = None
            return None
        now = monotonic_ns()
        key = (step, micro, coll)
        if key != self._key:
            self._key, self._since, self._next = key, now, now + self.stall_ns
            return None
        if now < self._next:
            return None
        self._next = now + self.stall_ns
        rec = {
            "step": step,
            "micro": micro,
            "since_ns": self._since,
            "waited_s": round((now - self._since) / 1e9, 3),
            "pending": pending_tensors(tracer) if not coll else [str(coll).rsplit("|", 1)[-1]],
        }
        if coll:
            rec["collective"] = str(coll)
        return rec


def pending_tensors(tracer: Any) -> list[str]:
    """Names of the tensors the tracer saw enqueued and not yet done, oldest first (read from
    the writer thread while the training thread waits: lists are copied first)."""
    done = {h for h, _t in list(getattr(tracer, "done", []))}
    meta = getattr(tracer, "meta", {})
    out: list[str] = []
    for _t, key, handle_ctx in list(getattr(tracer, "enqueued", [])):
        if handle_of(handle_ctx) in done:
            continue
        names = meta.get(key, ([],))[0] or ["?"]
        out += [str(n) for n in names]
        if len(out) >= MAX_PENDING:
            break
    return out[:MAX_PENDING]
