"""Per-step figures as TensorBoard scalars: the tags, and the event-file writer.

One definition of what hvtrace shows in TensorBoard, used after the run
(``hvtrace analyze RUN --tensorboard DIR``, :mod:`hvtrace.export.tensorboard`) and while it runs
(live detection's judge process writes each window's steps where ``HVTRACE_TENSORBOARD`` asks,
:mod:`hvtrace.analysis.live`). The points are rows of the analysis' per-step table
(:func:`hvtrace.analysis.steps.step_summary`), rendered, never recomputed; a live window has no
allreduce times, so its comm/compute and hidden share are left out there. Written with
tensorboardX (the ``tensorboard`` extra), which needs neither torch nor TensorFlow.
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from hvtrace.errors import TraceError

if TYPE_CHECKING:
    import pandas as pd

#: Scalar tag -> (column of the per-step table, what it is).
SCALARS: Final[dict[str, tuple[str, str]]] = {
    "hvtrace/step_ms": ("step_ms", "step time, ms (median over ranks)"),
    "hvtrace/late_rank": ("last_rank", "the rank whose gradients were ready last"),
    "hvtrace/lateness_ms": ("spread_ms", "how long after the first rank it was ready, ms"),
    "hvtrace/exposed_ms": ("exposed_ms", "time the last rank waited for communication, ms"),
    "hvtrace/comm_compute_ratio": ("comm_compute_ratio", "comm/compute of the last rank"),
    "hvtrace/hidden_share": ("overlap", "share of the last rank's allreduce time under backward"),
}

#: A step's points: (step, {tag: value}); values finite only.
Points = list[tuple[int, dict[str, float]]]


def step_points(per_step: pd.DataFrame, after_step: int | None = None) -> Points:
    """The TensorBoard points of a per-step table's rows (those after ``after_step``)."""
    out: Points = []
    cols = {tag: col for tag, (col, _) in SCALARS.items() if col in per_step.columns}
    for row in per_step.to_dict("records"):
        step = int(row["step"])
        if after_step is not None and step <= after_step:
            continue
        vals = {}
        for tag, col in cols.items():
            try:
                v = float(row[col])
            except (TypeError, ValueError):
                continue
            if math.isfinite(v):
                vals[tag] = v
        if vals:
            out.append((step, vals))
    return out


def summary_writer(log_dir: str | Path) -> Any:
    """A tensorboardX ``SummaryWriter`` writing a new event file into the directory ``log_dir``
    (created if needed; the file's name carries a random token, so no file already there is
    opened). A one-line :class:`TraceError` when tensorboardX is missing or ``log_dir`` is not a
    directory that can be made."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as exc:
        raise TraceError(
            f"TensorBoard output needs tensorboardX ({exc}); install it with "
            "pip install 'hvtrace[tensorboard]'"
        ) from None
    d = Path(log_dir)
    if d.exists() and not d.is_dir():
        raise TraceError(f"{d}: exists and is not a directory")
    try:  # it makes the directory
        return SummaryWriter(str(d), filename_suffix=f".hvtrace.{secrets.token_hex(4)}")
    except OSError as exc:
        raise TraceError(f"{d}: cannot write TensorBoard events there ({exc})") from None


def add_points(writer: Any, points: Points) -> None:
    """Add ``points`` to a ``SummaryWriter`` and flush it."""
    for step, vals in points:
        for tag, v in vals.items():
            writer.add_scalar(tag, v, step)
    writer.flush()


__all__ = ["SCALARS", "Points", "add_points", "step_points", "summary_writer"]
