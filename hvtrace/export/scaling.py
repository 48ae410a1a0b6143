"""``hvtrace scaling``: where scaling is lost, as text and JSON.

Renders a :class:`hvtrace.analysis.scaling.Scaling`; computes nothing of its own.
"""

from __future__ import annotations

import math
from typing import Any

from hvtrace.analysis.scaling import LOSS_LABELS, LOSS_PARTS, Scaling
from hvtrace.export.jsondoc import _clean, _records
from hvtrace.export.report import WIDTH, wrap
from hvtrace.units import printable


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(float(x)) else format(float(x), fmt)


def format_scaling(s: Scaling, width: int = WIDTH) -> str:
    """Return ``s`` as plain text lines no wider than ``width``."""
    t = s.runs
    L = wrap(f"hvtrace scaling: {len(t)} runs, {', '.join(str(n) for n in t['size'])} ranks", width)
    for n in s.notes:
        L += wrap("note: " + n, width)
    L += ["", f"{'ranks':>5}{'median':>9}{'mean':>9}{'efficiency':>12}{'speedup':>9}"
          f"{'lost ms':>9}  run"]  # fmt: skip
    for r in t.itertuples():
        L.append(
            f"{r.size:>5}{_f(r.median_step_ms):>9}{_f(r.step_ms):>9}{_f(r.efficiency, '.0%'):>12}"
            f"{_f(r.speedup, '.2f'):>9}{_f(r.loss_ms, '+.2f'):>9}  {printable(r.run_id)}"
        )
    L += wrap(
        "step ms per rank and step: the median (as hvtrace analyze reports it) and the mean, "
        "which the efficiency and the lost time are of (the mean's parts add up)",
        width,
    )
    used = [p for p in LOSS_PARTS if (t[p].abs() >= 0.005).any()]
    if len(t) > 1 and used:
        L += ["", "Where the time went (ms per step against the smallest run; they add up)"]
        L.append(f"{'':<30}" + "".join(f"{n:>9}" for n in t["size"].iloc[1:]))
        for p in used:
            L.append(f"{LOSS_LABELS[p]:<30}" + "".join(f"{v:>+9.2f}" for v in t[p].iloc[1:]))
        L.append(f"{'total':<30}" + "".join(f"{v:>+9.2f}" for v in t["loss_ms"].iloc[1:]))
    if s.prediction:
        L += ["", *wrap(prediction_text(s.prediction), width)]
        fit = fit_text(s.prediction)
        if fit:
            L += wrap("  " + fit, width)
    L += ["", "Assumptions"]
    for a in s.assumptions:
        L += wrap("- " + a, width)
    return "\n".join(L)


def prediction_text(p: dict[str, Any]) -> str:
    """The step predicted at the next size, in one sentence (``p``: :attr:`Scaling.prediction`,
    not empty)."""
    if p.get("model") == "latency":
        how = (
            f"{_f(p['comm_growth_ms'], '+.2f')} ms of allreduce per step, "
            f"{_f(p.get('exposed_growth_ms'), '+.2f')} ms of it exposed"
        )
    else:
        how = (
            f"{_f(p['comm_growth_ms'], '+.2f')} ms of allreduce per step, all of it exposed: a "
            "ring's bytes alone, no per-message latency"
        )
    return (
        f"at {p['size']} ranks (predicted): a step of about {_f(p['step_ms'])} ms, efficiency "
        f"{_f(p['efficiency'], '.0%')} ({how})"
    )


def fit_text(p: dict[str, Any]) -> str:
    """The fitted cost of an allreduce message (or why none is used), in one sentence; ""
    when nothing was fitted."""
    lat, bw = p.get("latency_us"), p.get("busbw_gbps")
    if lat is None and not p.get("fit_notes"):
        return ""
    said = ""
    if lat is not None:
        lr = p.get("latency_us_range") or [None, None]
        br = p.get("busbw_gbps_range") or [None, None]
        said = (
            f"per allreduce message: a latency of {_f(lat, '.1f')} µs per ring transfer step "
            f"(95 %: {_f(lr[0], '.1f')} to {_f(lr[1], '.1f')})"
        )
        if bw is not None:
            said += (
                f" and a bus bandwidth of {_f(bw, '.3g')} GB/s ({_bound(br[0])} to {_bound(br[1])})"
            )
        sizes = ", ".join(str(n) for n in p.get("fit_sizes") or [])
        said += (
            f", R^2 {_f(p.get('r2'))}, fitted on {p.get('fit_points')} message sizes at "
            f"{sizes} ranks"
        )
    if p.get("model") != "latency":
        why = "; ".join(p.get("fit_notes") or [])
        said = (said + ": not used, " if said else "no per-message latency fitted: ") + why
    return said


def _bound(x: Any) -> str:
    return "unbounded" if x is None else _f(x, ".3g")


def scaling_to_dict(s: Scaling) -> dict[str, Any]:
    """The JSON form: ``runs`` (one record per run, :attr:`Scaling.runs`' columns),
    ``prediction``, ``assumptions``, ``notes``."""
    return _clean(
        {
            "runs": _records(s.runs),
            "parts": {p: LOSS_LABELS[p] for p in LOSS_PARTS},
            "prediction": s.prediction,
            "assumptions": s.assumptions,
            "notes": s.notes,
        }
    )
