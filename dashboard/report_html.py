"""The report as one HTML file: ``hvtrace analyze RUN_DIR --html report.html``.

A single self-contained page to attach to a ticket: the run's figures and findings, the report's
tables, the dashboard's charts (rank x step heat maps, per-rank lateness and comm/compute,
comm/compute over steps, allreduce per tensor) and a timeline window around the slowest step,
with plotly.js embedded once. It opens from disk with no server and no network: a Content
Security Policy in the page forbids every request (scripts, styles and images are inline).

It renders what the analysis computed: the figures are the dashboard's own
(:class:`hvtrace_dashboard.app.DashboardData`, from the same :class:`hvtrace.analysis.Analysis`),
the tables are the analysis' tables, and the full text report is
:func:`hvtrace.export.report.format_report`'s. Every string from a trace file (run id, hosts,
tensor and span names) is escaped; figure JSON is embedded with ``<``, ``>`` and ``&`` escaped, so
no name can end its script element.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hvtrace.analysis import Analysis
from hvtrace.export.output import open_output
from hvtrace.export.report import format_gbps, format_report, step_phases
from hvtrace.load import Run
from hvtrace.units import format_bytes, printable

log = logging.getLogger("hvtrace.dashboard")

#: Tensors listed in the per-tensor table (the costliest first; the chart has them all).
MAX_TENSOR_ROWS = 20
#: Ranks listed in the per-rank table: every rank up to this many, else the stragglers and the
#: latest ranks (the JSON has every rank).
MAX_RANK_ROWS = 64

#: Forbids every request: the page's scripts and styles are inline, its images data: URLs.
CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "img-src data: blob:; font-src data:"
)

STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1f2933;
  background:#f5f7fa}
header{background:#1f2933;color:#fff;padding:14px 24px}
header h1{font-size:20px;margin:0 0 4px 0}
header .sub{color:#cbd2d9;font-size:13px}
main{padding:8px 24px 40px 24px;max-width:1400px}
section{background:#fff;border-radius:6px;padding:12px 16px;margin:14px 0;
  box-shadow:0 1px 2px #0001}
h2{font-size:16px;margin:4px 0 10px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border-radius:6px;padding:8px 14px;box-shadow:0 1px 2px #0001;min-width:110px}
.card .k{font-size:12px;color:#616e7c}.card .v{font-size:18px;font-weight:600}
ul.findings{padding-left:0;list-style:none;margin:0}
ul.findings li{padding:6px 8px;margin:4px 0;border-left:4px solid #9aa5b1;background:#f5f7fa}
ul.findings li.warning{border-color:#d64545;background:#fff5f5}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
th,td{padding:3px 10px;border-bottom:1px solid #e4e7eb;text-align:right;white-space:nowrap}
th{background:#f5f7fa;position:sticky;top:0}
td.t,th.t{text-align:left}
.note{color:#616e7c;font-size:12px;margin:4px 0}
.fig{width:100%;min-height:260px}
pre{font-size:12px;background:#f5f7fa;padding:10px;overflow-x:auto}
details summary{cursor:pointer;font-weight:600}
"""

#: Draws every figure embedded as JSON (``<script type="application/json" data-fig=ID>``).
DRAW = """
document.querySelectorAll('script[type="application/json"][data-fig]').forEach(function (s) {
  var f = JSON.parse(s.textContent), el = document.getElementById(s.getAttribute('data-fig'));
  Plotly.newPlot(el, f.data, f.layout, {displaylogo: false, responsive: true});
});
"""


def _e(x: Any) -> str:
    """Text from a trace file (or anything) as HTML text: control characters shown escaped."""
    return html.escape(printable(str(x)), quote=True)


def _num(x: Any, spec: str = ".1f") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return _e(x) if x not in (None, "") else "–"
    return format(v, spec) if np.isfinite(v) else "–"


def _table(
    headers: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]], text_cols: int = 1
) -> str:
    """An HTML table: ``headers`` are (label, unit) pairs; the first ``text_cols`` columns are
    text (left-aligned), the rest numbers already formatted."""
    head = "".join(
        f'<th class="{"t" if i < text_cols else ""}">{_e(h)}'
        + (f"<br><small>{_e(u)}</small>" if u else "")
        + "</th>"
        for i, (h, u) in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{"t" if i < text_cols else ""}">{c}</td>' for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _script_json(obj: Any) -> str:
    """JSON that cannot end the script element it is put in (nor open a comment there)."""
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def plotly_js() -> str:
    """plotly.js for the page: the vendored cartesian bundle (1.5 MB) where it matches the
    installed plotly's version, else the installed plotly's full bundle."""
    from hvtrace_dashboard.app import PLOTLY_BUNDLE, bundle_version
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    if bundle_version() == get_plotlyjs_version():
        return PLOTLY_BUNDLE.read_text(encoding="utf-8")
    return get_plotlyjs()


def _per_rank_table(a: Analysis) -> str:
    pr = a.per_rank
    if pr.empty:
        return '<p class="note">no complete step to analyze</p>'
    phases = step_phases(pr)
    named = {int(r) for r in a.stragglers["rank"]}
    rows_df = pr
    note = ""
    if len(pr) > MAX_RANK_ROWS:
        order = pr.sort_values("lateness_ms", ascending=False)["rank"].astype(int).tolist()
        keep = list(dict.fromkeys([*sorted(named), *order]))[:MAX_RANK_ROWS]
        rows_df = pr[pr["rank"].isin(keep)]
        note = (
            f'<p class="note">showing {len(rows_df)} of {len(pr)} ranks: the stragglers and the '
            "latest; the JSON report has every rank</p>"
        )
    rows = []
    for _, r in rows_df.iterrows():
        rank = int(r["rank"])
        rows.append(
            [
                f"{rank}{' ⚠' if rank in named else ''}",
                _e(r.get("host", "")),
                _num(r.get("step_ms")),
                *[_num(r.get(f"{p}_ms")) for p, _ in phases],
                _num(r.get("allreduce_ms")),
                _num(r.get("overlap"), ".0%"),
                _num(r.get("comm_compute_ratio"), ".2f"),
                _num(r.get("lateness_ms")),
                _num(r.get("last_share"), ".0%"),
            ]
        )
    headers = [
        ("rank", ""),
        ("host", ""),
        ("step", "ms"),
        *[(t, "ms") for _, t in phases],
        ("allreduce", "ms"),
        ("hidden", ""),
        ("comm/comp", ""),
        ("late", "ms"),
        ("last", ""),
    ]
    return (
        _table(headers, rows, text_cols=2)
        + note
        + '<p class="note">medians per step. allreduce: time with at least one allreduce in '
        "flight (it includes waiting for late ranks); hidden: share of it under backward; late: "
        "after the first rank's last gradient was ready; last: share of steps this rank was "
        "ready last.</p>"
    )


def _stragglers_table(a: Analysis) -> str:
    s = a.stragglers
    if s.empty and a.slow_hosts.empty:
        return '<p class="note">no straggler named</p>'
    rows = []
    for _, h in a.slow_hosts.iterrows():
        rows.append(
            [
                f"host {_e(h['host'])}",
                _e(", ".join(map(str, h["ranks"]))),
                _num(h.get("late_ms")),
                _num(h.get("last_share"), ".0%"),
                _e(h.get("phase") or "–"),
                "–",
                _e(h.get("cause") or "–"),
                _num(h.get("lost_ms_per_step")),
            ]
        )
    for _, r in s.iterrows():
        rows.append(
            [
                f"rank {int(r['rank'])}",
                _e(r.get("host", "")),
                _num(r.get("late_ms")),
                _num(r.get("last_share"), ".0%"),
                _e(r.get("phase") or "–"),
                _num(r.get("phase_excess_ms"), "+.1f"),
                _e(r.get("cause") or "–"),
                _num(r.get("lost_ms_per_step")),
            ]
        )
    headers = [
        ("who", ""),
        ("host / ranks", ""),
        ("late", "ms"),
        ("last", ""),
        ("phase", ""),
        ("excess", "ms"),
        ("cause", ""),
        ("costs", "ms/step"),
    ]
    return _table(headers, rows, text_cols=2) + (
        '<p class="note">costs: job time lost per step (the step time with the rank working '
        "like the others, replayed step by step); excess: how much longer the phase takes than "
        "the other ranks' median.</p>"
    )


def _tensors_table(a: Analysis) -> str:
    t = a.tensors
    if t.empty:
        return '<p class="note">no allreduce recorded</p>'
    t = t.sort_values("time_ms", ascending=False).head(MAX_TENSOR_ROWS)
    rows = [
        [
            _e(r["name"]),
            _e(format_bytes(r.get("bytes", 0))),
            _e(r.get("dtype", "")),
            _num(r.get("time_ms"), ".2f"),
            _e(format_gbps(r.get("algbw_gbps"))),
            _e(format_gbps(r.get("busbw_gbps"))),
        ]
        for _, r in t.iterrows()
    ]
    headers = [
        ("tensor", ""),
        ("bytes", ""),
        ("dtype", ""),
        ("time", "ms"),
        ("algbw", "GB/s"),
        ("busbw", "GB/s"),
    ]
    return _table(headers, rows, text_cols=3)


def _findings(a: Analysis) -> str:
    if not a.findings:
        return '<p class="note">no finding</p>'
    items = "".join(
        f'<li class="{_e(f.severity)}"><b>{_e(f.kind)}</b> · {_e(f.message)}</li>'
        for f in a.findings
    )
    return f'<ul class="findings">{items}</ul>'


def render_html(run: Run, a: Analysis) -> str:
    """Return the whole page for the analysis ``a`` of ``run``."""
    from hvtrace_dashboard.app import DashboardData

    data = DashboardData.from_analysis(run, a)
    figs: list[tuple[str, Any]] = [("heat-" + key, data.heatmap(key)) for key in data.heat]
    builders = data.figure_builders()
    for name in ("ratio_rank", "ratio_steps", "tensors", "timeline"):
        try:
            figs.append((name, builders[name]()))
        except Exception as exc:  # noqa: BLE001 - a chart that cannot be drawn is said; the page stays
            log.warning("hvtrace: the %s chart could not be drawn: %s", name, exc)
    fig_html = {
        name: f'<div class="fig" id="fig-{_e(name)}"></div>'
        f'<script type="application/json" data-fig="fig-{_e(name)}">'
        f"{_script_json(fig.to_json())}</script>"
        for name, fig in figs
    }
    cards = "".join(
        f'<div class="card"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div></div>'
        for k, v in data.summary.items()
    )
    problems = "".join(f"<li class='warning'>{_e(p)}</li>" for p in a.problems)
    heat = "".join(fig_html[n] for n, _ in figs if n.startswith("heat-"))
    first, last, count = a.analyzed_step_numbers
    steps = f"steps {first}..{last} analyzed ({count} steps)" if count else "no complete step"
    title = f"hvtrace · run {a.run_id or run.run_id}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{STYLE}</style>",
        f"<script>{plotly_js()}</script>",
        "</head><body>",
        f"<header><h1>{_e(title)}</h1><div class='sub'>{_e(data.run_dir)} · {_e(steps)}"
        + (f" · {_e(data.clock_note)}" if data.clock_note else "")
        + "</div></header><main>",
        f'<div class="cards">{cards}</div>',
        f'<section><h2>Findings</h2><ul class="findings">{problems}</ul>{_findings(a)}</section>',
        f"<section><h2>Stragglers</h2>{_stragglers_table(a)}</section>",
        f"<section><h2>Rank × step</h2>{heat}</section>",
        f"<section><h2>Where each step's time goes</h2>{_per_rank_table(a)}</section>",
        "<section><h2>Communication</h2>"
        + fig_html.get("ratio_rank", "")
        + fig_html.get("ratio_steps", "")
        + "</section>",
        "<section><h2>Allreduce per tensor</h2>"
        + _tensors_table(a)
        + fig_html.get("tensors", "")
        + "</section>",
        "<section><h2>Timeline around the slowest step</h2>"
        + fig_html.get("timeline", "")
        + "</section>",
        "<section><details><summary>The full text report</summary>"
        f"<pre>{_e(format_report(a))}</pre></details></section>",
        f"</main><script>{DRAW}</script></body></html>",
    ]
    return "\n".join(parts)


def write_html_report(
    run: Run, a: Analysis, path: str | Path, inputs: Iterable[str | Path] = ()
) -> Path:
    """Write the page to ``path`` (never over one of ``inputs``: see
    :func:`hvtrace.export.output.open_output`); return the path."""
    page = render_html(run, a).encode("utf-8")
    with open_output(path, inputs) as f:
        f.write(page)
    return Path(path)


__all__ = ["render_html", "write_html_report"]
