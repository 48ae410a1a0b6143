"""``hvtrace analyze -o``: the merged timeline of a run, rendered from its analysis.

:func:`write_timeline` picks the format from the name: Perfetto's protobuf trace
(:mod:`hvtrace.export.perfetto`) or the Chrome JSON trace (:mod:`hvtrace.export.chrome`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pandas as pd

from hvtrace.analysis import Analysis
from hvtrace.errors import TraceError
from hvtrace.selection import StepRange


def _horovod_acts(a: Analysis, steps: StepRange | None) -> pd.DataFrame | None:
    """Horovod's timeline activities on rank 0's clock, when the analysis merged one (those of
    the selected steps' time span only)."""
    h = a.horovod_timeline
    if not h.get("merged") or h.get("offset_ns") is None or not h.get("path"):
        return None
    from hvtrace.analysis.hvd_timeline import TimelineError, aligned_activities

    try:
        acts = aligned_activities(h["path"], int(h["offset_ns"]))
    except TimelineError:
        return None
    if steps is not None and len(a.steps):
        lo, hi = int(a.steps["start_ns"].min()), int(a.steps["end_ns"].max())
        acts = acts[(acts["end_ns"] >= lo) & (acts["start_ns"] <= hi)]
    return acts


def write_timeline(
    run: Any,
    a: Analysis,
    path: str,
    steps: StepRange | None,
    inputs: Iterable[str | os.PathLike] = (),
) -> str:
    """Write the merged timeline of ``run`` (rendered from ``a``); return a note naming the file(s).

    The format follows the name: ``*.pftrace`` is Perfetto's protobuf trace
    (:mod:`hvtrace.export.perfetto`, one file, streamed rank by rank); anything else (``.json``,
    ``.json.gz``) the Chrome JSON trace (:mod:`hvtrace.export.chrome`). Raises
    :class:`TraceError` (one line) when it cannot be written.
    """
    try:
        from hvtrace.export.chrome import write_chrome_trace
        from hvtrace.export.perfetto import is_perfetto_path, write_perfetto_trace
    except ImportError as exc:
        raise TraceError(f"cannot write the timeline: {exc}") from None
    horovod = _horovod_acts(a, steps)
    try:
        if is_perfetto_path(path):
            res = write_perfetto_trace(
                run, path, steps=steps, steps_df=a.steps, inputs=inputs, horovod=horovod
            )
            return f"timeline: {res.path} (open in https://ui.perfetto.dev)"
        files = write_chrome_trace(
            run, path, steps=steps, steps_df=a.steps, inputs=inputs, horovod=horovod
        )
    except ValueError as exc:
        raise TraceError(f"{path}: {exc}") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot write ({exc.strerror or exc})") from None
    if len(files) == 1:
        return f"timeline: {files[0]} (open in https://ui.perfetto.dev)"
    return (
        f"timeline: {len(files)} parts {files[0].name} .. {files[-1].name} in "
        f"{files[0].parent} (open each in https://ui.perfetto.dev)"
    )
