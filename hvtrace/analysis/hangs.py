"""Who a hung job waits for: the ranks' stall records (:mod:`hvtrace.record.stall`) read back.

A rank whose writer noted a stall was waiting in ``synchronize`` in that step: it had arrived.
In the latest step with stall records, the ranks that neither waited there nor got past it did
not arrive: they are the ones the others wait for. If every rank got past that step later, the
job recovered: a stall, not a hang. Nothing in the records is trusted: steps and times are
checked, names are kept as text (the report escapes them).
"""

from __future__ import annotations

import math
from typing import Any

#: At most this many waiting tensors are kept per hang.
MAX_TENSORS = 8


def _stall_records(files: dict[int, Any]) -> list[tuple[int, int, float, list[str], str | None]]:
    """``(rank, step, waited_s, pending, collective)`` of every well-formed stall record
    (``collective``: the span name of the collective outside the optimizer it waited in, else
    None: it waited in the optimizer's ``synchronize``)."""
    out = []
    for rank, f in files.items():
        for rec in getattr(f, "stalls", None) or []:
            if not isinstance(rec, dict):
                continue
            step, waited = rec.get("step"), rec.get("waited_s")
            if type(step) is not int or step < 0:
                continue
            if not isinstance(waited, (int, float)) or not math.isfinite(waited) or waited < 0:
                continue
            pending = rec.get("pending")
            names = (
                [str(n)[:200] for n in pending if isinstance(n, str)]
                if isinstance(pending, list)
                else []
            )
            coll = rec.get("collective")
            coll = str(coll)[:300] if isinstance(coll, str) else None
            out.append((int(rank), step, float(waited), names, coll))
    return out


def find_hangs(files: dict[int, Any], expected_ranks: list[int]) -> list[dict[str, Any]]:
    """The hang (or stalls) the ranks' files show, latest step first.

    ``files``: rank -> :class:`hvtrace.format.read.RankFile`; ``expected_ranks``: every rank of
    the run (a rank without a file did not arrive either). Each item: ``step``, ``hung`` (True: some
    rank never got past the step in its file), ``ranks`` (those that did not arrive: neither
    waited in that step nor got past it), ``waiting_ranks``, ``tensor`` (the first tensor the
    waiting ranks waited for, the most common first pending name), ``tensors`` (all of them, up
    to :data:`MAX_TENSORS`), ``waited_s`` (the longest wait noted) and ``in_collective``:
    rank -> the collective outside the optimizer (span name ``op|phase|tensor``) that a rank
    which did not arrive waits in (a metric allreduce only it issued, say).

    Waits in the optimizer's ``synchronize`` make the hangs; waits in a collective outside it
    explain who did not arrive (they make hangs of their own only when no rank waits in the
    optimizer). When the ranks that did not arrive in ``synchronize`` all wait in one and the
    same collective, and they are more than the ranks waiting in ``synchronize``, it is the other
    way round: most ranks issued that collective and the few went on without it (they skipped
    it, and now wait for the others' gradients). Then ``ranks`` are those few, ``waiting_ranks``
    the ranks in the collective, ``tensor`` its span name, and ``skipped`` is True (else
    False).
    """
    every = _stall_records(files)
    if not every:
        return []
    in_coll: dict[int, str] = {}
    for r, _s, _w, _p, coll in sorted(every, key=lambda x: x[2]):  # the longest wait wins
        if coll is not None:
            in_coll[r] = coll
    recs = [x for x in every if x[4] is None] or every
    out = []
    for step in sorted({s for _, s, _, _, _ in recs}, reverse=True):
        here = [r for r in recs if r[1] == step]
        waiting = sorted({r for r, _, _, _, _ in here})
        # its step counter (the step it was in at its last flush) went beyond: it got past
        past = {r for r, f in files.items() if int(getattr(f, "last_step", -1)) > step}
        hung = any(r not in past for r in waiting)
        missing = [r for r in expected_ranks if r not in waiting and r not in past]
        firsts: dict[str, int] = {}
        tensors: list[str] = []
        for _, _, _, names, _ in here:
            if names:
                firsts[names[0]] = firsts.get(names[0], 0) + 1
            tensors += [n for n in names if n not in tensors]
        first = max(firsts, key=lambda n: firsts[n]) if firsts else ""
        elsewhere = {str(r): c for r, c in sorted(in_coll.items()) if r not in waiting}
        skipped = (
            hung
            and len(missing) > len(waiting)
            and sorted(int(r) for r in elsewhere) == missing
            and len(set(elsewhere.values())) == 1
        )
        if skipped:  # the many wait in a collective the few went past without issuing
            coll_waits = [w for r, _s, w, _p, c in every if c is not None and r in missing]
            out.append(
                {
                    "step": step,
                    "hung": True,
                    "ranks": waiting,
                    "waiting_ranks": missing,
                    "tensor": next(iter(elsewhere.values())),
                    "tensors": [next(iter(elsewhere.values()))],
                    "waited_s": max(coll_waits, default=max(w for _, _, w, _, _ in here)),
                    "in_collective": elsewhere,
                    "skipped": True,
                    "skippers_wait_for": tensors[:MAX_TENSORS],
                }
            )
            continue
        out.append(
            {
                "step": step,
                "hung": hung,
                "ranks": missing if hung else [],
                "waiting_ranks": waiting,
                "tensor": first,
                "tensors": tensors[:MAX_TENSORS],
                "waited_s": max(w for _, _, w, _, _ in here),
                "in_collective": elsewhere,
                "skipped": False,
            }
        )
    return out
