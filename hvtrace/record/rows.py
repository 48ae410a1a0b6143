"""What the hot path puts in a rank's buffer, and how the writer turns it into rows.

The buffer (a deque) holds two kinds of entries:

- a **row**: a tuple ``(step, micro, kind, name, start, end, bytes, dtype, value, flags)``
  optionally followed by ``(cpu_start, cpu_end)``, the training thread's counter readings at the
  span's start and end (see :mod:`hvtrace.record.cpustat`; parsed by the writer). ``start`` and
  ``end`` are timer tokens (ns ints, or CUDA events resolved by the writer). A 10-tuple, or
  readings of ``None``, means not measured (null ``cpu_ns``/``runq_ns``).
- an :class:`Allreduces`: every allreduce of one ``synchronize()``, as the hot path saw them (one
  entry per enqueue and one per observed completion). Its rows, one per tensor, are the ones
  :func:`expand` makes; the writer thread builds them as columns instead
  (:meth:`hvtrace.record.writer.BatchEncoder.encode`, on host-timed and CUDA ranks alike, once
  a CUDA rank's events are resolved), and :func:`expand` is their reference (tests, benchmarks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

from hvtrace.format.schema import KIND_CODE

# Row layout (positions in the tuple).
STEP, MICRO, KIND, NAME, START, END, BYTES, DTYPE, VALUE, FLAGS, CPU_START, CPU_END = range(12)
#: Length of a row without counter readings.
BASE_LEN = 10
#: The counter readings ``(start, end)`` of a row that has none.
UNREAD = (None, None)

_K_ALLREDUCE = KIND_CODE["allreduce"]
_NAN = math.nan


class Allreduces(NamedTuple):
    """The allreduces of one ``synchronize()`` call, unexpanded (a named tuple: cheap to make).

    ``enqueued``: ``(start_token, key, handle_ctx)`` per ``_allreduce_grad_async`` (or grouped)
    call, in order: ``key`` finds the tensors' ``(names, bytes, dtype codes)`` in ``meta``,
    ``handle_ctx`` is what Horovod returned (a ``(handle, ctx)`` pair). ``done``: ``(handle,
    token)`` per completion observed (polled, or a ``synchronize(handle)`` that returned), earliest
    first. A tensor whose completion was not observed ends at ``end`` (``synchronize()``'s exit).
    """

    step: int
    micro: int
    flags: int
    enqueued: list[tuple]
    done: list[tuple]
    end: Any
    meta: dict[Any, tuple[list, list, list]]


def span_count(entries: list) -> int:
    """The number of spans buffer ``entries`` hold."""
    return sum(
        1 if type(e) is tuple else sum(len(e.meta[k][0]) for _, k, _ in e.enqueued) for e in entries
    )


def handle_of(handle_ctx: Any) -> Any:
    """Horovod's handle in what ``_allreduce_grad_async`` returned."""
    return handle_ctx[0] if type(handle_ctx) is tuple else handle_ctx


def call_ends(e: Allreduces) -> Iterator[Any]:
    """The end token of each of ``e``'s enqueued calls, in order: its handle's first observed
    completion, else ``e.end`` (``synchronize()``'s exit)."""
    ends: dict[Any, Any] = {}
    for handle, tok in e.done:
        ends.setdefault(handle, tok)
    get, end = ends.get, e.end
    return (get(h[0] if type(h) is tuple else h, end) for _, _, h in e.enqueued)


def expand(entries: list, out: list[tuple]) -> list[tuple]:
    """Append the rows of buffer ``entries`` to ``out`` (rows as they are, :class:`Allreduces`
    one row per tensor); return ``out``."""
    append = out.append
    for e in entries:
        if type(e) is tuple:
            append(e)
            continue
        step, micro, flags, meta = e.step, e.micro, e.flags, e.meta
        for (start, key, _), stop in zip(e.enqueued, call_ends(e)):
            names, nbytes, dtypes = meta[key]
            for name, nb, dt in zip(names, nbytes, dtypes):
                append((step, micro, _K_ALLREDUCE, name, start, stop, nb, dt, _NAN, flags))
    return out
