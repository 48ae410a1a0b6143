"""``hvtrace analyze``'s terminal report: :func:`format_report` renders an
:class:`hvtrace.analysis.Analysis` as plain text that fits in 80 columns.

The other renderings of the same analysis: the JSON summary (:mod:`hvtrace.export.jsondoc`), the
CSV/Parquet tables (:mod:`hvtrace.export.tables`), the merged timeline
(:mod:`hvtrace.export.timeline`). The command line is :mod:`hvtrace.cli`.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis import Analysis
from hvtrace.analysis.bandwidth import BANDWIDTH_CAVEAT
from hvtrace.analysis.findings import cause_line
from hvtrace.selection import StepRange, format_ranks
from hvtrace.units import format_bytes, printable

WIDTH = 80


# -- terminal report -------------------------------------------------------------------------------
def wrap(text: str, width: int, first: str = "", rest: str = "  ") -> list[str]:
    """Wrap ``text`` to ``width`` columns; long words (paths) stay whole. Characters a terminal
    would act on are shown escaped (:func:`hvtrace.units.printable`)."""
    return textwrap.wrap(
        printable(text),
        width=width,
        initial_indent=first,
        subsequent_indent=rest,
        break_on_hyphens=False,
        break_long_words=False,  # a file path stays whole (copyable) even past the width
    ) or [first.rstrip()]


def _num(x: Any, fmt: str = ".1f") -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(x):
        return "-"
    return format(x, fmt)


def format_gbps(x: Any) -> str:
    """Bandwidth in GB/s with 3 significant digits; tiny values (fused small tensors) as <0.01."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    if not math.isfinite(x):
        return "-"
    return "<0.01" if 0 < x < 0.01 else format(x, ".3g")


def _pct(x: Any) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    return "-" if not math.isfinite(x) else f"{x:.0%}"


def _table(headers: list[tuple[str, int, str]], rows: list[list[str]]) -> list[str]:
    """Fixed-width table: headers are (title, width, align '<' or '>')."""
    line = " ".join(f"{t:{a}{w}}"[:w] if a == "<" else f"{t:>{w}}"[-w:] for t, w, a in headers)
    out = [line.rstrip()]
    for r in rows:
        cells = []
        for (_, w, a), v in zip(headers, r):
            v = printable(v)
            if len(v) > w:
                v = v[: w - 1] + "…" if a == "<" else v[:w]
            cells.append(f"{v:{a}{w}}")
        out.append(" ".join(cells).rstrip())
    return out


def _gain_lines(a: Analysis, w: int) -> list[str]:
    """What the job would gain without its stragglers (the what-if), near the top."""
    wi = a.whatif
    if not wi or not wi.get("ranks"):
        return []
    who = [f"rank {int(s['rank'])} {_num(s['lost_ms_per_step'])} ms"
           for _, s in a.stragglers.iterrows()]  # fmt: skip
    who += [f"host {h['host']} {_num(h['lost_ms_per_step'])} ms"
            for _, h in a.slow_hosts.iterrows()]  # fmt: skip
    upper = " (at most: see the findings)" if wi.get("lost_bound") == "upper" else ""
    return wrap(
        f"what the stragglers cost{upper}: without them a step would take about "
        f"{_num(wi['step_ms_without_stragglers'])} ms instead of {_num(wi['step_ms'])} ms, "
        f"{_num(wi['lost_ms_per_step'])} ms per step or {_pct(wi['lost_share'])} of the run "
        f"(each alone: {'; '.join(who)} per step; a what-if replay of {wi['steps']} steps)",
        w,
        "! " if wi["lost_share"] >= 0.02 else "- ",
        "  ",
    )


def _links_section(a: Analysis, w: int) -> list[str]:
    """The host-to-host links the ranks' TCP counters measured (nothing on one host)."""
    k = a.links
    if k is None or k.empty:
        return []
    L = ["", "Links between hosts (the ranks' TCP connections, whole run)"]
    headers = [
        ("from", 12, "<"),
        ("to", 12, "<"),
        ("bytes", 10, ">"),
        ("busy s", 8, ">"),
        ("rate", 8, ">"),
        ("Mbit/s", 8, ">"),
        ("rtt ms", 7, ">"),
        ("retrans", 7, ">"),
    ]
    rows = [["", "", "", "", "GB/s", "", "min", ""]]
    for _, x in k.iterrows():
        rate = float(x["rate_gbps"])
        rows.append(
            [
                str(x["src_host"]),
                str(x["dst_host"]),
                format_bytes(x["bytes"]),
                _num(x["busy_ms"] / 1e3, ".2f"),
                format_gbps(rate),
                _num(rate * 8e3, ".0f"),
                _num(x["min_rtt_ms"], ".2f"),
                str(int(x["retrans"])),
            ]
        )
    L += _table(headers, rows)
    L += wrap(
        "rate: the best a connection of the pair reached, bytes sent / time it had data to send "
        "(less time waiting for the receiver); '-': little of the job's data went that way. A "
        "ring allreduce runs at its slowest link's rate.",
        w,
    )
    return L


def _outside_section(a: Analysis, w: int, max_rows: int = 8) -> list[str]:
    """The collectives issued outside the optimizer (empty when there are none)."""
    t = a.outside
    if t is None or t.empty:
        return []
    L = ["", f"Collectives outside the optimizer ({len(t)} sources, per analyzed step)"]
    headers = [
        ("collective", 22, "<"),
        ("name", 18, "<"),
        ("phase", 8, "<"),
        ("calls", 6, ">"),
        ("flight", 7, ">"),
        ("blocked", 7, ">"),
        ("run", 5, ">"),
        ("last", 12, ">"),
    ]
    rows = [["", "", "", "", "ms", "ms", "", "rank (share)"]]
    for _, x in t.head(max_rows).iterrows():
        last = (
            f"{int(x['late_rank'])} ({_pct(x['late_share'])})" if int(x["late_rank"]) >= 0 else "-"
        )
        rows.append(  # _table makes every cell printable
            [
                str(x["op"]),
                str(x["name"]) or "-",
                str(x["phase"]),
                _num(x["count_per_step"], ".2g"),
                _num(x["ms_per_step"]),
                _num(x["blocked_ms_per_step"]),
                _pct(x["run_share"] if "run_share" in x else x["step_share"]),
                last,
            ]
        )
    L += _table(headers, rows)
    L += wrap(
        "counted as communication (comm/comp, exposed time) and not as the phase they were "
        "issued in. calls, flight and blocked are per step, averaged over the run (a call once "
        "every 10 steps counts a tenth). flight: enqueue to result; blocked: the training thread "
        "waiting in it; run: blocked share of the run's time; last: the rank that issued it last "
        "most often.",
        w,
    )
    return L


def _horovod_timeline_section(a: Analysis, w: int, max_rows: int = 6) -> list[str]:
    """Horovod's own timeline, merged: negotiation and transfer per tensor (empty without)."""
    h = a.horovod_timeline
    if not h:
        return []
    L = ["", f"Horovod's timeline ({printable(h.get('file', '?'))})"]
    if not h.get("merged"):
        return L + wrap("not merged: " + "; ".join(map(printable, h.get("problems", []))), w)
    rows = h.get("tensors", [])
    headers = [
        ("tensor", 26, "<"),
        ("n", 5, ">"),
        ("negotiate", 9, ">"),
        ("transfer", 8, ">"),
        ("last", 12, ">"),
    ]
    table = [["", "", "ms", "ms", "rank (share)"]]
    for r in rows[:max_rows]:
        last = "-" if r.get("last_rank") is None else f"{r['last_rank']} ({_pct(r['last_share'])})"
        table.append(
            [str(r["name"]), str(r["count"]), _num(r["negotiate_ms"], ".2f"),
             _num(r["transfer_ms"], ".2f"), last]
        )  # fmt: skip
    L += _table(headers, table)
    arr = h.get("arrival", {})
    notes = [
        "negotiate: until the last rank was ready (medians over the tensor's allreduces); "
        "transfer: the collective itself; last: the rank Horovod saw ready last, where it noted "
        "each rank (outside its response cache)."
    ]
    if arr.get("clear_compared"):
        notes.append(
            f"Horovod's last rank agrees with hvtrace's arrival in "
            f"{_pct(arr['clear_agree_share'])} of {arr['clear_compared']} negotiations whose ranks "
            f"were clearly apart."
        )
    if h.get("partial"):
        notes.append(f"partial: {printable(h['partial'])}.")
    notes += [f"problem: {printable(str(p))}." for p in h.get("problems", [])]
    for n in notes:
        L += wrap(n, w)
    return L


def _select_ranks(a: Analysis, max_ranks: int) -> tuple[list[int], str]:
    """All ranks when they fit; else the named stragglers, then the latest ranks."""
    ranks = list(a.per_rank["rank"].astype(int))
    if len(ranks) <= max_ranks:
        return ranks, ""
    show = max(max_ranks - 2, 1)  # two rows go to the median and max over all ranks
    named = [int(r) for r in a.stragglers["rank"]]
    late = a.verdicts.sort_values("late_ms", ascending=False)["rank"].astype(int).tolist()
    keep: list[int] = []
    for r in [*named, *late]:
        if r not in keep:
            keep.append(r)
        if len(keep) >= show:
            break
    keep.sort()
    note = (
        f"(showing {len(keep)} of {len(ranks)} ranks: stragglers and latest first; med/max: "
        "over all ranks; --json or --csv for every rank)"
    )
    return keep, note


def _rank_rows(a: Analysis, ranks: list[int], note: str) -> list[tuple[str, pd.Series]]:
    """(label, per-rank row) for the shown ranks, plus med/max rows over all ranks if cut."""
    pr = a.per_rank.set_index("rank")
    rows = [(str(r), pr.loc[r]) for r in ranks]
    if note:
        num = pr.select_dtypes("number")
        med = pd.concat([num.median(), pd.Series({"host": ""})])
        mx = pd.concat([num.max(), pd.Series({"host": ""})])
        rows += [("med", med), ("max", mx)]
    return rows


def _host_lines(a: Analysis, w: int) -> list[str]:
    """With ranks on several hosts: one line per host, its ranks and their clock offsets to rank
    0 (range, worst uncertainty, how they were measured)."""
    if len(set(a.hosts.values())) < 2 or not a.clock_ranks:
        return []
    by_host: dict[str, list[int]] = {}
    for r in sorted(a.hosts):
        by_host.setdefault(a.hosts[r], []).append(r)
    out = ["hosts and clocks (offset to rank 0's clock, ms):"]
    for host, ranks in by_host.items():
        c = [a.clock_ranks[r] for r in ranks if r in a.clock_ranks]
        if not c:
            continue
        lo = min(x["offset_ns"] for x in c) / 1e6
        hi = max(x["offset_ns"] for x in c) / 1e6
        unc = max(x["uncertainty_ns"] for x in c) / 1e6
        methods = ", ".join(dict.fromkeys(x["method"] for x in c))
        offs = f"{lo:+.3f}" if lo == hi else f"{lo:+.3f}..{hi:+.3f}"
        drift = [(x["drift_ppm"], x["drift_uncertainty_ppm"] or 0.0) for x in c]
        drift = [d for d in drift if d[0] is not None]
        dr = ""
        if drift:
            d, du = max(drift, key=lambda d: abs(d[0]))
            dr = f", drift {d:+.1f} ±{du:.1f} ppm"
        out += wrap(
            f"{host}: ranks {format_ranks(ranks)}: {offs} ±{unc:.3f} ({methods}{dr})",
            w,
            "  ",
            "    ",
        )
    return out


def step_phases(per_rank: pd.DataFrame) -> list[tuple[str, str]]:
    """The phases of a step breakdown this run has, as (column prefix in ``per_rank``, short
    label): forward and backward where the model was given, compute where it was not (a run
    may have both, from ranks that differ)."""
    phases = [("input", "input")]
    fwd = per_rank["forward_ms"].fillna(0) > 0
    if fwd.any() or (per_rank["backward_ms"].fillna(0) > 0).any():
        phases += [("forward", "fwd"), ("backward", "bwd")]
    if (per_rank["compute_ms"].fillna(0) > 0).any():
        phases += [("compute", "compute")]
    return [*phases, ("wait", "wait"), ("update", "update"), ("user", "user"), ("other", "other")]


def engine_summary(engine: dict[str, Any]) -> str:
    """One line saying where a Dask engine ran the per-rank pass."""
    workers = engine.get("tasks_by_worker") or {}
    return printable(
        f"engine: Dask ({engine.get('scheduler', '?')}): {engine.get('tasks', 0):,} tasks on "
        f"{len(workers)} worker(s)"
    )


def read_summary(read: dict[str, int]) -> str:
    """One line saying what the engine read (spans, row groups, rank files)."""
    r = read
    parts = [f"{r.get('spans', 0):,} of {r.get('spans_total', 0):,} spans"]
    if r.get("row_groups_total"):
        parts.append(f"{r.get('row_groups', 0):,} of {r['row_groups_total']:,} Parquet row groups")
    files, total = r.get("files", 0), r.get("files_total", 0)
    parts.append(f"{files:,} of {total:,} ranks' files" if total > files else f"{files:,} files")
    return "read: " + ", ".join(parts)


def format_report(
    a: Analysis, width: int = WIDTH, max_ranks: int = 16, max_tensors: int = 6
) -> str:
    """Return the analysis as plain text lines no wider than ``width`` (80 by default)."""
    w = width
    L: list[str] = []
    n_hosts = len(set(a.hosts.values()))
    hosts = ", ".join(sorted(set(a.hosts.values())))
    head = (
        f"hvtrace analyze: run {a.run_id or '?'}, {len(a.ranks)} of {a.size} rank(s) on "
        f"{n_hosts} host(s)"
        + (f" ({hosts})" if n_hosts <= 3 else "")
        + ({"mpi": ", Horovod over MPI", "gloo": ", Horovod over Gloo"}.get(a.controller, ""))
        # CUDA tensors' collectives: NCCL, or through host memory by the controller's library
        + {"nccl": ", GPU tensors over NCCL", "host": ", GPU tensors through host memory"}.get(
            a.gpu_operations, ""
        )
    )
    L += wrap(head, w)
    first, last, count = a.analyzed_step_numbers
    sel = ""
    rng = StepRange.of(a.step_range)
    if rng is not None:
        sel = f"; selected steps {rng.label()}"
    if count:
        skipped = ""
        warm = "step 0" if a.skip_steps == 1 else f"steps 0..{a.skip_steps - 1}"
        if a.skip_steps and first < a.skip_steps:
            # nothing complete after the warm-up: the statistics include it, and say so
            skipped = f"no complete step after warm-up {warm}, so it is included"
        elif a.skip_steps:
            skipped = f"warm-up {warm} skipped"
        L += wrap(
            f"steps {first}..{last} analyzed ({count} steps"
            + (f"; {skipped}" if skipped else "")
            + f"{sel})"
            + ("; those every worker recorded, each epoch: below" if a.membership else ""),
            w,
        )
    elif a.membership:
        L += wrap(f"no step that every worker recorded{sel}: see the membership epochs", w)
    else:
        L += wrap(f"no complete step to analyze{sel}", w)
    if a.run_dir is not None:
        L += wrap(f"directory: {a.run_dir}", w)
    if a.read:
        L += wrap(read_summary(a.read), w)
    if a.engine.get("name") == "dask":
        L += wrap(engine_summary(a.engine), w)
    if a.clock:
        L += wrap(a.clock, w)
    L += _host_lines(a, w)
    for p in a.problems:
        L += wrap(_relative(p, a.run_dir), w, "! ", "  ")
    for f in a.findings:
        if f.kind in ("hang", "reset", "lockstep", "unsharded_data") or (
            f.kind == "divergence" and f.severity == "warning"
        ):
            L += wrap(f.message, w, "! ", "  ")  # at the top
    L += _gain_lines(a, w)

    ranks, note = _select_ranks(a, max_ranks)
    pr = a.per_rank.set_index("rank")
    shown = _rank_rows(a, ranks, note)
    # -- where the time goes
    L.append("")
    L.append("Where each step's time goes (median ms per step, per rank)")
    phases = step_phases(pr)
    headers = [("rank", 4, ">"), ("host", 10, "<"), ("step", 7, ">")]
    headers += [(t, 7, ">") for _, t in phases]
    show_p95 = sum(h[1] + 1 for h in headers) + 8 <= w
    if show_p95:
        headers.append(("p95", 7, ">"))
    rows = []
    for label, x in shown:
        row = [label, str(x["host"]), _num(x["step_ms"])]
        row += [_num(x[f"{p}_ms"]) for p, _ in phases]
        if show_p95:
            row.append(_num(x["step_p95_ms"]))
        rows.append(row)
    L += _table(headers, rows)
    if show_p95:
        L += wrap(
            "p95: 95th percentile of the step time. wait: blocked in synchronize() "
            "(communication not hidden). other: time no phase or user span covers.",
            w,
        )
    if note:
        L += wrap(note, w)

    # -- communication and arrival
    L.append("")
    L.append("Communication and arrival (medians per step)")
    headers = [
        ("rank", 4, ">"),
        ("allreduce", 9, ">"),
        ("hidden", 6, ">"),
        ("comm/comp", 9, ">"),
        ("algbw", 7, ">"),
        ("late", 7, ">"),
        ("last", 5, ">"),
    ]
    units = ["", "ms", "", "", "GB/s", "ms", ""]
    rows = [list(units)]
    for label, x in shown:
        rows.append(
            [
                label,
                _num(x["allreduce_ms"]),
                _pct(x["overlap"]),
                _num(x["comm_compute_ratio"], ".2f"),
                format_gbps(x["algbw_gbps"]),
                _num(x["lateness_ms"]),
                _pct(x["last_share"]),
            ]
        )
    L += _table(headers, rows)
    L += wrap(
        "allreduce: time with at least one allreduce in flight (it includes waiting for late "
        "ranks); hidden: share of it under backward; late: after the first rank's last gradient "
        "was ready; last: share of steps this rank was ready last.",
        w,
    )

    L += _outside_section(a, w)
    L += _horovod_timeline_section(a, w)
    L += _live_section(a, w)
    L += _membership_section(a, w)

    # -- tensors
    t = a.tensors
    if len(t):
        L.append("")
        L.append(
            f"Allreduce per tensor (top {min(max_tensors, len(t))} of {len(t)} by time; "
            "median over steps)"
        )
        headers = [
            ("tensor", 26, "<"),
            ("bytes", 10, ">"),
            ("dtype", 8, "<"),
            ("ms", 8, ">"),
            ("algbw", 8, ">"),
            ("busbw", 8, ">"),
        ]
        rows = [["", "", "", "", "GB/s", "GB/s"]]
        for _, x in t.head(max_tensors).iterrows():
            rows.append(
                [
                    str(x["name"]),
                    format_bytes(x["bytes"]),
                    str(x["dtype"]),
                    _num(x["time_ms"], ".2f"),
                    format_gbps(x["algbw_gbps"]),
                    format_gbps(x["busbw_gbps"]),
                ]
            )
        L += _table(headers, rows)
        c = a.comm
        L += wrap(
            f"per step: {_num(c['tensors_per_step'], '.0f')} tensors, "
            f"{format_bytes(c['bytes_per_step'])} in {_num(c['comm_ms'])} ms of allreduce -> algbw "
            f"{format_gbps(c['algbw_gbps'])} GB/s, busbw {format_gbps(c['busbw_gbps'])} GB/s "
            f"(n={a.size}, busbw = algbw x 2(n-1)/n).",
            w,
        )
        L += wrap(
            "tensor time = first observed end - last rank's enqueue. Note: "
            + BANDWIDTH_CAVEAT
            + ".",
            w,
        )

    L += _links_section(a, w)

    # -- stragglers
    L.append("")
    if a.stragglers.empty:
        L.append("Stragglers: none named")
    else:
        L.append("Stragglers")
        headers = [
            ("rank", 4, ">"),
            ("host", 14, "<"),
            ("late ms", 8, ">"),
            ("last", 5, ">"),
            ("phase", 14, "<"),
            ("excess ms", 9, ">"),
            ("cause", 10, "<"),
            ("costs ms", 8, ">"),
        ]
        rows = []
        for _, s in a.stragglers.iterrows():
            rows.append(
                [
                    str(int(s["rank"])),
                    str(s["host"]),
                    _num(s["late_ms"]),
                    _pct(s["last_share"]),
                    str(s["phase"] or "-"),
                    _num(s["phase_excess_ms"], "+.1f"),
                    str(s.get("cause") or "-"),
                    _num(s.get("lost_ms_per_step")),
                ]
            )
        L += _table(headers, rows)
        causes = a.stragglers[a.stragglers["cause"].astype(str) != ""]
        L += wrap(
            "costs: job time lost per step (the step time with the rank working like the others, "
            "replayed step by step); excess: how much longer the phase takes than the other "
            "ranks' median"
            + (
                "; cause: the largest part of it: work (more CPU time), contention (waiting "
                "for a CPU) or blocked (neither):"
                if len(causes)
                else "."
            ),
            w,
        )
        for _, s in causes.iterrows():
            L += wrap(cause_line(s), w)
    for _, h in a.slow_hosts.iterrows():
        L += wrap(
            f"slow host {h['host']}: ranks {', '.join(map(str, h['ranks']))}, median "
            f"{h['late_ms']:.1f} ms late, last in {h['last_share']:.0%} of steps",
            w,
        )

    L += _setup_section(a, w)

    # -- findings
    if a.findings:
        L.append("")
        L.append("Findings")
        for f in a.findings:
            mark = "!" if f.severity == "warning" else "-"
            L += wrap(f.message, w, f"{mark} ", "  ")
    return "\n".join(L)


def _relative(problem: str, run_dir: Path | None) -> str:
    """Shorten a loader problem: file paths relative to the run directory (printed above)."""
    if run_dir is None:
        return problem
    d = str(run_dir).rstrip(os.sep)
    if problem.startswith(d + ": "):
        problem = problem[len(d) + 2 :]
    return problem.replace(d + os.sep, "")


# -- more report sections --------------------------------------------------------------------------
def _gradient_lines(a: Analysis, w: int, max_tensors: int = 4) -> list[str]:
    """How the gradients were sent (:mod:`hvtrace.analysis.gradients`): allreduced by the job
    itself after the backward, and embedding gradients sent dense with their zero rows."""
    lines: list[str] = []
    g = getattr(a, "gradients", None) or {}
    m = g.get("manual") or {}
    named = [r for r in m.get("per_rank") or [] if r["rank"] in (m.get("ranks") or [])]
    if named:
        seen, steps = sum(r["seen"] for r in named), sum(r["steps"] for r in named)
        first = min(int(r["first_step"]) for r in named)

        def med(k: str) -> float:
            return float(pd.Series([float(r[k] or 0.0) for r in named]).median())

        lines += wrap(
            f"gradients: allreduced by the job itself after the backward on rank"
            f"{'s' if len(named) > 1 else ''} {format_ranks([r['rank'] for r in named])}, in "
            f"{seen} of their {steps} steps from step {first} (median {med('tensors'):.0f} "
            f"tensors, {format_bytes(med('bytes'))}, {med('comm_ms'):.1f} ms after a "
            f"{med('backward_ms'):.1f} ms backward: see the findings)",
            w,
            "  ",
            "    ",
        )
    for t in (g.get("zero_rows") or [])[:max_tensors]:
        how = "dense" if t["how"] == "dense" else "dense (sparse_as_dense)"
        lines += wrap(
            f"gradient {printable(t['name'])} ({format_bytes(t['bytes'])}, sent {how}): a median "
            f"{t['share']:.0%} of its rows zero at {t['checks']} check(s) on rank(s) "
            f"{format_ranks(t['ranks'])}" + (" (see the findings)" if t["share"] >= 0.5 else ""),
            w,
            "  ",
            "    ",
        )
    return lines


def _setup_section(a: Analysis, w: int, max_hosts: int = 8) -> list[str]:
    """The job's set-up as the ranks recorded it: whether their batches differ (the batch
    fingerprints), each host's torch threads against its cores, CUDA devices shared, and the
    learning rates beside the world size (:mod:`hvtrace.analysis.antipatterns`)."""
    lines: list[str] = []
    b = a.batches or {}
    if b.get("checked"):
        steps = b.get("steps") or []
        listed = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
        if b.get("groups"):
            verdict = (
                f"{len(b['groups'])} group(s) of ranks trained on the same batches, "
                f"{_pct(b.get('wasted_share'))} of the compute on duplicates (see the findings)"
            )
        elif int(b.get("checks") or 0) < 2:
            verdict = "too few checks to judge (two needed)"
        else:
            verdict = "the ranks' batches differ (sharded)"
        lines += wrap(
            f"batches: fingerprints of {b.get('ranks')} ranks compared at {b.get('checks')} "
            f"checked step(s) ({listed}): {verdict}",
            w,
            "  ",
            "    ",
        )
    p = a.placement or {}
    for e in (p.get("hosts") or [])[:max_hosts]:
        threads = list(e["threads"].values())
        each = (
            f"{threads[0]} torch thread(s) each"
            if len(set(threads)) == 1
            else "torch threads " + "+".join(map(str, threads))
        )
        lines += wrap(
            f"host {printable(str(e['host']))}: ranks {format_ranks(e['ranks'])}, {each}, "
            f"{e['threads_total']} on {e['cores']} core(s)"
            + (" (oversubscribed: see the findings)" if e.get("oversubscribed") else ""),
            w,
            "  ",
            "    ",
        )
    for g in p.get("shared_gpus") or []:
        lines += wrap(
            f"GPU {printable(str(g['device']))} on {printable(str(g['host']))}: shared by "
            f"ranks {format_ranks(g['ranks'])}",
            w,
            "  ",
            "    ",
        )
    lines += _gradient_lines(a, w)
    sc = a.scale or {}
    for g in (sc.get("groups") or [])[:4]:
        lr = (
            f"{g['first_lr']:.6g}"
            if g["min_lr"] == g["max_lr"]
            else f"{g['first_lr']:.6g} at step {g['first_step']} to {g['last_lr']:.6g} at step "
            f"{g['last_step']} (min {g['min_lr']:.6g}, max {g['max_lr']:.6g})"
        )
        lines += wrap(
            f"learning rate (param group {g['group']}, rank {sc.get('rank', 0)}): {lr}, with "
            f"{sc.get('size')} ranks (information: scaling the learning rate with the ranks "
            "is the usual rule, not a requirement)",
            w,
            "  ",
            "    ",
        )
    if not lines:
        return []
    return ["", "Set-up: data, threads, devices", *lines]


def _live_section(a: Analysis, w: int, max_lines: int = 8) -> list[str]:
    """What live detection logged while the job ran (empty when nothing)."""
    if not a.live:
        return []
    from hvtrace.format.status import live_line as line

    L = ["", f"Seen live, while the job ran ({len(a.live)} events)"]
    for e in a.live[:max_lines]:
        try:
            text = line(e).removeprefix("hvtrace: ")
        except (KeyError, TypeError, ValueError):
            continue  # a damaged record
        L += wrap(printable(text), w, "  ", "    ")
    if len(a.live) > max_lines:
        L.append(f"  ... and {len(a.live) - max_lines} more (JSON: live)")
    return L


def _membership_section(a: Analysis, w: int, max_epochs: int = 12) -> list[str]:
    """Elastic Horovod: each membership epoch and what its own analysis says (empty when the
    workers never changed; the resets are findings, at the top)."""
    if not a.membership:
        return []
    L = ["", f"Membership epochs (Elastic Horovod: {len(a.membership)} epochs)"]
    headers = [
        ("epoch", 5, ">"),
        ("steps", 11, ">"),
        ("size", 4, ">"),
        ("step ms", 8, ">"),
        ("comm/comp", 9, ">"),
        ("workers (rank@host)", 32, "<"),
    ]
    rows = []
    for e in a.membership[:max_epochs]:
        ea = e.get("analysis") or {}
        stop = e.get("stop_step")
        steps = f"{e['start_step']}-{stop - 1}" if isinstance(stop, int) else f"{e['start_step']}-"
        who = ", ".join(
            f"{m['worker']}:{m['rank']}@{printable(m.get('horovod_host', m['host']))}"
            for m in e["workers"][:6]
        )
        if len(e["workers"]) > 6:
            who += f", +{len(e['workers']) - 6}"
        rows.append(
            [
                str(e["gen"]),
                steps,
                str(e["size"]),
                _num(ea.get("step_ms"), ".2f"),
                _num(ea.get("comm_compute_ratio"), ".2f"),
                who,
            ]
        )
    L += _table(headers, rows)
    for e in a.membership[:max_epochs]:
        ea = e.get("analysis") or {}
        if ea.get("error"):
            L += wrap(f"epoch {e['gen']}: not analyzed ({printable(ea['error'])})", w)
        for s in ea.get("stragglers") or []:
            why = s["phase"] + (f", {s['cause']}" if s.get("cause") else "")
            late = f" {s['late_ms']:.1f} ms late per step" if s.get("late_ms") is not None else ""
            L += wrap(f"epoch {e['gen']}: straggler worker {s['worker']}{late} ({why})", w)
    if len(a.membership) > max_epochs:
        L.append(f"  ... and {len(a.membership) - max_epochs} more (JSON: membership)")
    L += wrap(
        "workers: stable ids (the rank file keys), with their rank in the epoch; each epoch is "
        "analyzed on its own (its first step after a reset is a warm-up).",
        w,
    )
    return L
