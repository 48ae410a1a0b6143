"""``hvtrace analyze --json``: the machine-readable summary of an analysis.

:func:`analysis_to_dict` renders an :class:`hvtrace.analysis.Analysis` as plain JSON types (NaN
becomes null); :func:`write_json` / :func:`write_json_doc` write it, never over a trace file.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis import Analysis
from hvtrace.analysis.bandwidth import BANDWIDTH_CAVEAT
from hvtrace.analysis.framework import json_section
from hvtrace.export.output import open_output
from hvtrace.selection import StepRange


def _clean(x: Any) -> Any:
    """Make ``x`` JSON-ready: numpy scalars to Python, NaN/NA to None, keys to strings."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [_clean(v) for v in x]
    if x is None or x is pd.NA or x is pd.NaT:
        return None
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        x = float(x)
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    return x


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [_clean(r) for r in df.to_dict("records")]


def analysis_to_dict(a: Analysis) -> dict[str, Any]:
    """Return the JSON summary of an analysis (plain Python types; NaN becomes None).

    Keys: ``run_id``, ``run_dir``, ``size``, ``ranks``, ``hosts``, ``steps`` (first, last, count,
    skip_steps, selected), ``run`` (the run-level figures:
    :attr:`hvtrace.analysis.Analysis.run_row`), ``per_rank`` (medians and p95 in ms, ratios,
    ``user_ms`` per user span), ``stragglers`` (rank, host, late_ms, last_share, phase,
    phase_excess_ms, reason, and why: cause (work, contention, blocked, speed or "" when not
    measured), work_ms, contention_ms, blocked_ms, speed_ratio, speed_ms (the slowdown a rank shows
    in every phase, and what it accounts for), and what it costs: lost_ms_per_step, lost_share,
    phase_lost_ms_per_step), ``slow_hosts`` (with the same costs), ``verdicts`` (every rank's
    evidence), ``findings``, ``whatif`` (step_ms, step_ms_without_stragglers, lost_ms_per_step,
    lost_share, steps, ranks: :mod:`hvtrace.analysis.whatif`), ``hangs`` (step, hung, ranks that did
    not arrive, waiting_ranks, tensor, tensors, waited_s: :mod:`hvtrace.analysis.hangs`),
    ``lockstep`` (where ranks fell out of step: :mod:`hvtrace.analysis.lockstep`; under Lightning
    ``lightning_steps``: Lightning's ``global_step`` at the steps it names, where it differs),
    ``accumulation`` (gradient accumulation that updated every micro-batch, else null), ``trainer``
    (Lightning's ``global_steps`` records per rank, the callbacks' ``decisions`` that rested on some
    ranks' values, ``best_checkpoints`` that differ across ranks:
    :mod:`hvtrace.analysis.framework`), ``consistency`` (what was compared across ranks: parameter
    checks, steps and tensors, learning-rate steps and groups, values that must agree; and the
    divergences, first step first: :func:`hvtrace.analysis.consistency.check`), ``batches`` (the
    ranks' batch fingerprints compared: :func:`hvtrace.analysis.antipatterns.batch_check`),
    ``placement`` (per host, torch threads against cores; CUDA devices shared:
    :func:`~hvtrace.analysis.antipatterns. placement`), ``scale`` (the learning rates recorded,
    beside the world size: :func:`~hvtrace.analysis.antipatterns.lr_summary`), ``gradients`` (how
    the gradients were sent: ``manual``, the ranks that allreduced them themselves after the
    backward, and ``zero_rows``, embedding gradients sent dense with their zero rows:
    :mod:`hvtrace.analysis.gradients`), ``communication`` (per-step aggregates and the caveat),
    ``tensors``, ``per_step``, ``clock`` (summary; per rank uncertainty_ns, offset_ns, method,
    drift_ppm and drift_uncertainty_ppm), ``problems``, ``horovod_env``, ``optimizer``,
    ``framework`` (the header's: ``{"name": "pytorch_lightning", "version": ...}`` under Lightning,
    else empty), ``controller`` (Horovod's: ``mpi``, ``gloo``, or empty when not recorded),
    ``gpu_operations`` (``nccl``, ``host``, or empty on a CPU run or when not recorded).
    """
    from hvtrace import __version__

    first, last, count = a.analyzed_step_numbers
    rng = StepRange.of(a.step_range)  # a (first, stop) tuple from older callers is fine too
    per_rank = _records(a.per_rank)
    up = a.user_per_rank
    by_rank: dict[int, dict[str, Any]] = {}
    if len(up):
        for r, n, v in zip(up["rank"], up["name"], up["median_ms"]):
            by_rank.setdefault(int(r), {})[str(n)] = _clean(v)
    for rec in per_rank:
        rec["user_spans_ms"] = by_rank.get(int(rec["rank"]), {})
    # the records are clean already; clean the rest
    head = _clean(
        {
            "hvtrace_version": __version__,
            "run_id": a.run_id,
            "run_dir": str(a.run_dir) if a.run_dir else None,
            "size": a.size,
            "ranks": a.ranks,
            "hosts": a.hosts,
            "steps": {
                "first": first if count else None,
                "last": last if count else None,
                "count": count,
                "skip_steps": a.skip_steps,
                "warmup_included": bool(count and first < a.skip_steps),
                "selected": rng.to_list() if rng is not None else None,
            },
            "run": dict(a.run_row),
            "read": dict(a.read),
            "engine": dict(a.engine),
        }
    )
    tail = _clean(
        {
            "findings": [f.to_dict() for f in a.findings],
            "whatif": dict(a.whatif),
            "hangs": list(a.hangs),
            "lockstep": list(a.lockstep),
            "accumulation": dict(a.accumulation) if a.accumulation else None,
            "trainer": json_section(a.trainer),
            "consistency": dict(a.consistency),
            "batches": dict(a.batches),
            "placement": dict(a.placement),
            "scale": dict(a.scale),
            "gradients": dict(getattr(a, "gradients", None) or {}),
            "horovod_timeline": dict(a.horovod_timeline),
            "live": list(a.live),
            "membership": list(a.membership),
            "communication": {
                **a.comm,
                "caveat": BANDWIDTH_CAVEAT,
                "links": a.links.to_dict("records") if len(a.links) else [],
                "limiting_link": a.limiting_link,
                "outside_optimizer": _records(a.outside) if len(a.outside) else [],
            },
        }
    )
    rest = _clean(
        {
            "clock": {
                "summary": a.clock,
                "uncertainty_ns": a.clock_uncertainty_ns,
                **{
                    key: {r: c[key] for r, c in a.clock_ranks.items()}
                    for key in ("offset_ns", "method", "drift_ppm", "drift_uncertainty_ppm")
                },
            },
            "problems": a.problems,
            "missing_ranks": a.missing_ranks,
            "timing": a.timing,
            "horovod_env": a.horovod_env,
            "optimizer": a.optimizer,
            "framework": a.framework,
            "controller": a.controller,
            "gpu_operations": a.gpu_operations,
        }
    )
    return {
        **head,
        "per_rank": per_rank,
        "stragglers": _records(a.stragglers),
        "slow_hosts": _records(a.slow_hosts),
        "verdicts": _records(a.verdicts),
        **tail,
        "tensors": _records(a.tensors),
        "per_step": _records(a.per_step),
        **rest,
    }


def write_json(
    a: Analysis, path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Write :func:`analysis_to_dict` to ``path`` (``-``: stdout); return the path.

    Written whole or not at all, never over one of ``inputs`` (see
    :func:`hvtrace.export.output.open_output`)."""
    return write_json_doc(analysis_to_dict(a), path, inputs)


def write_json_doc(
    doc: dict[str, Any], path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Write the JSON document ``doc`` to ``path`` (``-``: stdout), whole or not at all, never
    over one of ``inputs``; return the path."""
    text = json.dumps(doc, indent=1)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
        return Path("-")
    p = Path(path)
    with open_output(p, inputs) as f:
        f.write((text + "\n").encode())
    return p
