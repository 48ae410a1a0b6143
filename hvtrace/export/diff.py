"""``hvtrace diff``: two runs compared, as text for a terminal and as JSON.

Renders a :class:`hvtrace.analysis.diff.RunDiff`; computes nothing of its own.
"""

from __future__ import annotations

import math
from typing import Any

from hvtrace.analysis.diff import MIN_REL_CHANGE, RunDiff
from hvtrace.export.jsondoc import _clean, _records
from hvtrace.export.report import WIDTH, wrap
from hvtrace.units import format_bytes, printable

#: Tensors listed in the text (largest change first); the JSON has them all.
TEXT_TENSORS = 8


def _ms(x: Any, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:+.2f}" if sign else f"{x:.2f}"


def _val(x: Any) -> str:
    if x is None:
        return "(not recorded)"
    if isinstance(x, float):
        return f"{x:g}"
    return printable(x)


def format_diff(d: RunDiff, width: int = WIDTH) -> str:
    """Return ``d`` as plain text lines no wider than ``width``."""
    L: list[str] = []
    L += wrap(f"hvtrace diff: A = run {d.a_id or '?'} ({d.a_dir}), B = run {d.b_id or '?'} "
              f"({d.b_dir})", width)  # fmt: skip
    for n in d.notes:
        L += wrap("note: " + n, width)
    s = d.step
    head = headline(d)
    if not math.isfinite(s["delta_ms"]):
        L += ["", *head]
        return "\n".join(L)
    L += [""]
    for h in head:
        L += wrap(h, width)

    L += ["", "Where it went (mean ms per rank and step; the changes add up to the total)"]
    L.append(f"{'part':<12}{'A':>9}{'B':>9}{'change':>9}  {'95% interval':<19}{'share':>7}")
    p = d.parts
    for r in p.itertuples():
        if abs(r.a_ms) < 0.005 and abs(r.b_ms) < 0.005:
            continue
        ci = f"{_ms(r.ci_lo_ms, True)} .. {_ms(r.ci_hi_ms, True)}"
        share = f"{r.share:.0%}" if math.isfinite(r.share) else "-"
        L.append(
            f"{r.part:<12}{_ms(r.a_ms):>9}{_ms(r.b_ms):>9}{_ms(r.delta_ms, True):>9}  "
            f"{ci:<19}{share:>7}"
        )
    total = s["mean_b_ms"] - s["mean_a_ms"]
    means = f"{_ms(s['mean_a_ms']):>9}{_ms(s['mean_b_ms']):>9}{_ms(total, True):>9}"
    L.append(f"{'step (mean)':<12}{means}")

    if len(d.causes):
        L += ["", "Why (mean ms per rank and step: CPU time, waiting for a CPU, neither)"]
        L.append(f"{'phase':<10}{'cause':<12}{'A':>9}{'B':>9}{'change':>9}")
        for r in d.causes.itertuples():
            if abs(r.delta_ms) < 0.05:
                continue
            L.append(
                f"{r.phase:<10}{r.cause:<12}{_ms(r.a_ms):>9}{_ms(r.b_ms):>9}"
                f"{_ms(r.delta_ms, True):>9}"
            )

    L += ["", "Stragglers"]
    for text in straggler_lines(d):
        L += wrap(text, width)

    L += ["", "Communication (run medians)"]
    for label, va, vb in comm_rows(d):
        L.append(f"{label:<24}{va:>12}{vb:>12}")

    t = d.tensors
    if len(t):
        L += ["", f"Allreduce per tensor (median ms; {min(len(t), TEXT_TENSORS)} of {len(t)}, "
              "largest change first)"]  # fmt: skip
        L.append(f"{'tensor':<30}{'bytes A':>11}{'bytes B':>11}{'A':>8}{'B':>8}{'change':>8}")
        for r in t.head(TEXT_TENSORS).itertuples():
            name = printable(r.name)
            name = name if len(name) <= 28 else name[:27] + "…"
            mark = f" {r.status}" if r.status else ""
            L.append(
                f"{name:<30}{_bytes(r.bytes_a):>11}{_bytes(r.bytes_b):>11}"
                f"{_ms(r.time_a_ms):>8}{_ms(r.time_b_ms):>8}{_ms(r.delta_ms, True):>8}{mark}"
            )

    L += ["", "Configuration"]
    if not d.config:
        L.append(f"the same in both runs ({d.config_same} settings recorded)")
    else:
        L.append(f"{len(d.config)} differ ({d.config_same} the same):")
        for k, va, vb in config_rows(d):
            L += wrap(f"{k}: {va} -> {vb}", width, first="  ", rest="    ")
    return "\n".join(L)


def headline(d: RunDiff) -> list[str]:
    """The step time's change, its interval and whether it is significant (one or two
    sentences)."""
    s = d.step
    lo, hi = s["ci_ms"]
    if not math.isfinite(s["delta_ms"]):
        return ["step time: no analyzed steps in one of the runs"]
    out = [
        f"step time (median): {_ms(s['median_a_ms'])} -> {_ms(s['median_b_ms'])} ms, "
        f"{_ms(s['delta_ms'], True)} ms ({s['rel']:+.1%}; 95% interval {_ms(lo, True)} .. "
        f"{_ms(hi, True)} ms; {s['steps_a']} and {s['steps_b']} steps)"
    ]
    if s["significant"]:
        out.append(f"{'slower' if s['delta_ms'] > 0 else 'faster'}: a significant change")
    else:
        why = (
            f"under {MIN_REL_CHANGE:.0%} of A's step"
            if lo > 0 or hi < 0
            else "its interval includes zero"
        )
        out.append(f"no significant change ({why})")
    return out


def straggler_lines(d: RunDiff) -> list[str]:
    """One sentence per rank that is a straggler in either run."""
    if d.ranks.empty:
        return ["none named in either run"]
    out = []
    for r in d.ranks.itertuples():
        if r.status == "new":
            text = f"rank {r.rank} became a straggler in B: {r.phase_b}"
            text += f", {r.cause_b}" if r.cause_b else ""
            text += f", {_ms(r.late_b_ms)} ms late"
        elif r.status == "gone":
            text = f"rank {r.rank} is no longer a straggler (in A: {r.phase_a}"
            text += f", {r.cause_a}" if r.cause_a else ""
            text += f", {_ms(r.late_a_ms)} ms late)"
        else:
            text = (
                f"rank {r.rank} is a straggler in both: {r.phase_a} -> {r.phase_b}, "
                f"{_ms(r.late_a_ms)} -> {_ms(r.late_b_ms)} ms late"
            )
        out.append(text)
    return out


#: The run-level communication figures, with their label and format.
_COMM = {
    "exposed_ms": ("exposed allreduce ms", "ms"),
    "exposed_share": ("exposed share of step", "pct"),
    "comm_compute_ratio": ("comm/compute", "ratio"),
    "overlap": ("hidden under compute", "pct"),
    "busbw_gbps": ("bus bandwidth GB/s", "ratio"),
    "bytes_per_step": ("bytes per step", "bytes"),
    "tensors_per_step": ("tensors per step", "ratio"),
}


def comm_rows(d: RunDiff) -> list[tuple[str, str, str]]:
    """(label, A, B) of each run-level communication figure, formatted."""
    fmt = {"ms": _ms, "pct": _pct, "ratio": _ratio, "bytes": _bytes}
    out = []
    for k, (va, vb) in d.comm.items():
        label, kind = _COMM[k]
        out.append((label, fmt[kind](va), fmt[kind](vb)))
    return out


def config_rows(d: RunDiff) -> list[tuple[str, str, str]]:
    """(setting, A, B) of each recorded setting that differs, as text."""
    return [(printable(k), _val(va), _val(vb)) for k, va, vb in d.config]


def _pct(x: Any) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.0%}"


def _ratio(x: Any) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _bytes(x: Any) -> str:
    return "-" if x is None or not math.isfinite(float(x)) else format_bytes(int(x))


def diff_to_dict(d: RunDiff) -> dict[str, Any]:
    """Return the JSON form of a :class:`RunDiff` (plain Python types; NaN becomes None).

    Keys: ``a`` / ``b`` (run id and directory), ``step``, ``parts``, ``causes``, ``stragglers``,
    ``tensors``, ``communication`` (figure -> [A, B]), ``config`` (list of {what, a, b}: the
    settings that differ), ``config_same``, ``notes``: the fields of :class:`RunDiff`."""
    return _clean(
        {
            "a": {"run_id": d.a_id, "run_dir": d.a_dir},
            "b": {"run_id": d.b_id, "run_dir": d.b_dir},
            "step": d.step,
            "parts": _records(d.parts),
            "causes": _records(d.causes),
            "stragglers": _records(d.ranks),
            "tensors": _records(d.tensors),
            "communication": {k: list(v) for k, v in d.comm.items()},
            "config": [{"what": k, "a": va, "b": vb} for k, va, vb in d.config],
            "config_same": d.config_same,
            "notes": d.notes,
        }
    )
