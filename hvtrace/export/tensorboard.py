"""Per-step figures as TensorBoard scalars after the run: ``hvtrace analyze RUN --tensorboard DIR``.

Each row of the analysis' per-step table (:attr:`hvtrace.analysis.Analysis.per_step`) becomes
one point of each scalar of :data:`hvtrace.format.tensorboard.SCALARS`, at the training step's
number, so the figures line up with the job's own curves in TensorBoard.
"""

from __future__ import annotations

from pathlib import Path

from hvtrace.analysis.model import Analysis
from hvtrace.export.output import make_output_dir
from hvtrace.format.tensorboard import add_points, step_points, summary_writer


def write_tensorboard(a: Analysis, log_dir: str | Path) -> Path:
    """Write the per-step figures of ``a`` as scalars into ``log_dir``; return the directory."""
    d = make_output_dir(log_dir)
    w = summary_writer(d)
    try:
        add_points(w, step_points(a.per_step))
    finally:
        w.close()
    return d


__all__ = ["write_tensorboard"]
