"""Rank 0's live judge, in a child process: ``python -m hvtrace.record.live_judge``.

The straggler decision (:func:`hvtrace.analysis.stragglers.straggler_table`, pandas) takes tens
of milliseconds per window; run in the training process it would hold the GIL while the
training thread waits for it. So rank 0's live thread (:class:`hvtrace.record.live.LiveMonitor`)
hands each gathered window to this child: on stdin, a line of JSON (``size``, ``hosts``,
``rows``, ``cols``) then ``rows x cols`` float64 values; on stdout, one line of JSON per window:
the list of verdicts (:func:`hvtrace.record.live.verdicts`). It exits at the end of its input.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> int:
    """Answer windows until stdin closes, at the lowest CPU priority: the judge is never in a
    hurry, and on a host whose cores the ranks fill it must not slow rank 0 (which would then
    be named the straggler for the judge's own work)."""
    import os

    try:
        os.nice(19)
    except OSError:
        pass
    from hvtrace.record.live import verdicts

    inp, out = sys.stdin.buffer, sys.stdout
    while True:
        head = inp.readline()
        if not head:
            return 0
        meta = json.loads(head)
        rows, cols = int(meta["rows"]), int(meta["cols"])
        data = inp.read(rows * cols * 8)
        gathered = np.frombuffer(data, dtype=np.float64).reshape(rows, cols)
        hosts = {int(k): str(v) for k, v in meta.get("hosts", {}).items()}
        try:
            res = verdicts(gathered, int(meta["size"]), hosts)
        except Exception as exc:  # noqa: BLE001 - one bad window does not end live detection
            res = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
