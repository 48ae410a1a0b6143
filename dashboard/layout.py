"""The page: header, heat map, step-window controls, timeline, straggler table, comm charts.

Every graph is created with its first figure already in it, so the first render needs no
callback round trip; callbacks (see :mod:`hvtrace_dashboard.callbacks`) only run on user input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
from dash import dcc, html

from hvtrace.selection import format_ranks

if TYPE_CHECKING:
    from hvtrace_dashboard.app import DashboardData

#: Step-window sizes offered in the timeline control.
WINDOW_SIZES = (1, 2, 3, 5, 10, 20, 50)

CSS = """
body { margin: 0; background: #f5f6f8; color: #1d2330;
       font-family: Inter, "Segoe UI", Helvetica, Arial, sans-serif; font-size: 14px; }
.hv-page { max-width: 1500px; margin: 0 auto; padding: 14px 20px 40px; }
.hv-title { display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; }
.hv-title h1 { font-size: 22px; margin: 4px 0; }
.hv-sub { color: #5b6473; font-size: 13px; }
.hv-cards { display: flex; gap: 10px; flex-wrap: wrap; margin: 10px 0; }
.hv-card { background: #fff; border: 1px solid #e1e4ea; border-radius: 8px; padding: 8px 14px;
           min-width: 110px; }
.hv-card .v { font-size: 20px; font-weight: 600; }
.hv-card .k { font-size: 12px; color: #5b6473; text-transform: uppercase; letter-spacing: .03em; }
.hv-card.bad { border-color: #e8a0a0; background: #fff5f5; }
.hv-panel { background: #fff; border: 1px solid #e1e4ea; border-radius: 8px; padding: 8px 12px;
            margin: 10px 0; }
.hv-panel h2 { font-size: 15px; margin: 6px 0 8px; }
.hv-findings { margin: 4px 0; padding-left: 20px; }
.hv-findings li { margin: 2px 0; }
.hv-problems { color: #8a5a00; font-size: 12px; }
.hv-live { font-size: 13px; font-weight: 600; color: #5b6473; }
.hv-live.on { color: #1a7f37; }
.hv-controls { display: flex; gap: 14px; align-items: center; flex-wrap: wrap; margin: 4px 0; }
.hv-controls label { font-size: 12px; color: #5b6473; }
.hv-row { display: flex; gap: 10px; flex-wrap: wrap; }
.hv-row > .hv-panel { flex: 1 1 520px; min-width: 0; }
table.hv-table { border-collapse: collapse; font-size: 13px; width: 100%; }
table.hv-table th, table.hv-table td { padding: 4px 10px; border-bottom: 1px solid #eceef2;
                                        text-align: left; }
table.hv-table th { color: #5b6473; font-weight: 600; }
table.hv-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
"""

#: Dash's scripts include core-js 2 (``polyfill@7``), which replaces the browser's
#: ``String.prototype.trim``, ``parseFloat`` and ``parseInt`` with JavaScript ones (it counts U+180E
#: as white space, as Unicode no longer does); plotly and d3 call them for every element they
#: draw, about 0.1 s of a first render. The page keeps the native ones before those scripts and
#: puts them back after (they differ only on U+180E).
_NATIVE = (
    ("String.prototype", "trim"),
    ("window", "parseFloat"),
    ("window", "parseInt"),
    ("Number", "parseFloat"),
    ("Number", "parseInt"),
)
_SAVE_NATIVE = "window.hvNative = [" + ", ".join(f"{o}.{k}" for o, k in _NATIVE) + "];"
_RESTORE_NATIVE = (
    "if (window.hvNative) {"
    + " ".join(f"{o}.{k} = window.hvNative[{i}];" for i, (o, k) in enumerate(_NATIVE))
    + "}"
)

#: The page.
INDEX_STRING = (
    """<!DOCTYPE html>
<html>
  <head>
    {%metas%}
    <title>{%title%}</title>
    {%favicon%}
    {%css%}
    <style>"""
    + CSS
    + """</style>
  </head>
  <body>
    {%app_entry%}
    <footer>{%config%}<script>"""
    + _SAVE_NATIVE
    + """</script>{%scripts%}<script>"""
    + _RESTORE_NATIVE
    + """</script>
    {%renderer%}</footer>
  </body>
</html>"""
)

_GRAPH_CONFIG = {"displaylogo": False, "scrollZoom": False}


def _card(key: str, value: str, bad: bool = False, card_id: str | None = None) -> html.Div:
    kw = {"id": card_id} if card_id else {}
    return html.Div(
        [html.Div(value, className="v"), html.Div(key, className="k")],
        className="hv-card bad" if bad else "hv-card",
        **kw,
    )


def summary_cards(data: DashboardData) -> list[html.Div]:
    """Return the header's cards (ranks, steps, median step, ..., stragglers)."""
    s = data.summary
    return [_card(k, v, bad=(k == "stragglers" and v not in ("0", "—"))) for k, v in s.items()]


def finding_items(data: DashboardData) -> list[html.Li]:
    """Return the findings as list items."""
    return [html.Li(f) for f in data.findings or ["no findings"]]


def live_parts(live: dict[str, Any] | None) -> list[Any]:
    """The live line and its timer (a run still being written), or nothing.

    ``live``: :meth:`hvtrace_dashboard.live.LiveFeed.status` plus ``refresh_ms``."""
    if live is None:
        return []
    return [
        html.Span(
            live["text"], id="live-status", className="hv-live on" if live["live"] else "hv-live"
        ),
        dcc.Interval(
            id="live-tick", interval=int(live["refresh_ms"]), disabled=not live["following"]
        ),
        dcc.Store(id="live-version", data={"version": live["version"], "last": live["last_step"]}),
    ]


def header(data: DashboardData, live: dict[str, Any] | None = None) -> html.Div:
    """Return the header: run id (and whether the run is live), summary cards, findings and
    loading problems."""
    children: list[Any] = [
        html.Div(
            [
                html.H1("hvtrace dashboard"),
                html.Span(f"run {data.run_id} · {data.run_dir}", className="hv-sub"),
                *live_parts(live),
            ],
            className="hv-title",
        ),
        html.Div(summary_cards(data), className="hv-cards", id="summary-cards"),
        html.Div(
            [
                html.H2("Findings"),
                html.Ul(finding_items(data), className="hv-findings", id="findings"),
            ],
            className="hv-panel",
        ),
        html.Div(header_notes(data), id="header-notes"),
    ]
    return html.Div(children, id="header")


def header_notes(data: DashboardData) -> list[Any]:
    """Return the header's notes: loading problems, clocks and analyzed steps, hosts."""
    notes: list[Any] = []
    if data.problems:
        notes.append(
            html.Details(
                [
                    html.Summary(f"{len(data.problems)} problem(s) while loading the run"),
                    html.Ul([html.Li(p) for p in data.problems]),
                ],
                className="hv-problems",
            )
        )
    if data.clock_note:
        notes.append(html.Div(data.clock_note, className="hv-sub"))
    if data.hosts:
        notes.append(html.Div(hosts_line(data.hosts), className="hv-sub", id="hosts"))
    if data.membership:
        notes.append(membership_table(data.membership))
    return notes


def membership_table(epochs: list[dict[str, Any]], limit: int = 50) -> html.Details:
    """Elastic Horovod: each membership epoch (steps, size, its workers as ``worker:rank@host``)
    and what its own analysis says (median step, comm/compute, stragglers)."""
    head = html.Tr(
        [
            html.Th(c)
            for c in (
                "epoch",
                "steps",
                "size",
                "workers",
                "median step",
                "comm/compute",
                "stragglers",
            )
        ]
    )
    rows = []
    for e in epochs[:limit]:
        ea = e.get("analysis") or {}
        stop = e.get("stop_step")
        steps = f"{e['start_step']}–{stop - 1}" if isinstance(stop, int) else f"{e['start_step']}–"
        workers = e.get("workers") or []
        who = ", ".join(
            f"{m['worker']}:{m['rank']}@{m.get('horovod_host', m.get('host', '?'))}"
            for m in workers[:8]
        ) + (f", +{len(workers) - 8}" if len(workers) > 8 else "")
        strag = ", ".join(
            f"worker {s['worker']} ({s.get('phase', '')})" for s in ea.get("stragglers", [])
        )
        step_ms, ratio = ea.get("step_ms"), ea.get("comm_compute_ratio")
        rows.append(
            html.Tr(
                [
                    html.Td(str(e.get("gen", "?")), className="num"),
                    html.Td(steps),
                    html.Td(str(e.get("size", "?")), className="num"),
                    html.Td(who),
                    html.Td("—" if step_ms is None else f"{step_ms:.1f} ms", className="num"),
                    html.Td("—" if ratio is None else f"{ratio:.2f}", className="num"),
                    html.Td(strag or ea.get("error", "none")),
                ]
            )
        )
    return html.Details(
        [
            html.Summary(
                f"Elastic Horovod: {len(epochs)} membership epochs (resets: see findings)"
            ),
            html.Table([html.Thead(head), html.Tbody(rows)], className="hv-table"),
        ],
        open=True,
        id="membership",
    )


def hosts_line(hosts: dict[int, str], limit: int = 8) -> str:
    """``hosts: a (ranks 0-3), b (ranks 4-7)``: every host with its ranks, the first ``limit``
    hosts by name when there are more."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(hosts):
        by_host.setdefault(str(hosts[r]), []).append(int(r))
    parts = [f"{h} (ranks {format_ranks(rs)})" for h, rs in sorted(by_host.items())[:limit]]
    more = f", … {len(by_host) - limit} more" if len(by_host) > limit else ""
    return f"{len(by_host)} host(s): " + ", ".join(parts) + more


def straggler_table(table: pd.DataFrame | None, hosts: dict[int, str]) -> html.Div:
    """Return the straggler table (or a sentence saying there is none)."""
    if table is None or table.empty:
        return html.Div("No straggler found.", id="straggler-table", className="hv-sub")
    cols = list(table.columns)
    head = html.Tr([html.Th(c.replace("_", " ")) for c in cols])
    body = []
    for rec in table.to_dict("records"):
        cells = []
        for c in cols:
            v = rec[c]
            if isinstance(v, float) and c.endswith("share"):
                cells.append(html.Td("—" if v != v else f"{v:.0%}", className="num"))
            elif isinstance(v, float):
                txt = "—" if v != v else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
                cells.append(html.Td(txt, className="num"))
            else:
                cells.append(html.Td(str(v)))
        body.append(html.Tr(cells))
    return html.Table(
        [html.Thead(head), html.Tbody(body)], className="hv-table", id="straggler-table"
    )


def build_layout(
    data: DashboardData, initial: dict[str, Any], live: dict[str, Any] | None = None
) -> html.Div:
    """Return the page for ``data``; ``initial`` holds the first figures and control values;
    ``live`` the live line of a run still being written (see :func:`live_parts`)."""
    last = max(data.last_step, 0)
    metric_opts = [{"label": v, "value": k} for k, v in data.heat_labels.items()]
    rank_opts = [{"label": lab, "value": r} for r, lab in zip(data.ranks, data.rank_names)]
    return html.Div(
        [
            header(data, live),
            html.Div(
                [
                    html.Div(
                        [
                            html.H2("Ranks x steps", style={"margin": "0"}),
                            dcc.RadioItems(
                                id="heat-metric",
                                options=metric_opts,
                                value=initial["metric"],
                                inline=True,
                                inputStyle={"marginRight": "4px", "marginLeft": "12px"},
                            ),
                            html.Span(
                                "click a cell to open that step in the timeline",
                                className="hv-sub",
                            ),
                        ],
                        className="hv-controls",
                    ),
                    dcc.Graph(id="heatmap", figure=initial["heatmap"], config=_GRAPH_CONFIG),
                ],
                className="hv-panel",
            ),
            html.Div(
                [
                    html.Div(
                        [
                            html.H2("Timeline", style={"margin": "0"}),
                            html.Label("first step"),
                            html.Button("◀", id="win-prev", n_clicks=0, title="previous window"),
                            dcc.Input(
                                id="win-start",
                                type="number",
                                min=0,
                                max=last,
                                step=1,
                                value=initial["start"],
                                debounce=True,
                                style={"width": "80px"},
                            ),
                            html.Button("▶", id="win-next", n_clicks=0, title="next window"),
                            html.Label("steps shown"),
                            dcc.Dropdown(
                                id="win-size",
                                options=[{"label": str(n), "value": n} for n in WINDOW_SIZES],
                                value=initial["size"],
                                clearable=False,
                                style={"width": "80px"},
                            ),
                            html.Label("ranks"),
                            dcc.Dropdown(
                                id="rank-filter",
                                options=rank_opts,
                                value=[],
                                multi=True,
                                placeholder=data.rank_filter_placeholder,
                                style={"minWidth": "260px", "flex": "1"},
                            ),
                        ],
                        className="hv-controls",
                    ),
                    dcc.Store(id="focus-step", data=initial["focus"]),
                    dcc.Graph(id="timeline", figure=initial["timeline"], config=_GRAPH_CONFIG),
                ],
                className="hv-panel",
            ),
            html.Div(
                [
                    html.H2("Stragglers"),
                    html.Div(straggler_table(data.stragglers, data.hosts), id="straggler-panel"),
                ],
                className="hv-panel",
            ),
            html.Div(
                [
                    html.Div(
                        dcc.Graph(
                            id="ratio-rank", figure=initial["ratio_rank"], config=_GRAPH_CONFIG
                        ),
                        className="hv-panel",
                    ),
                    html.Div(
                        dcc.Graph(
                            id="ratio-steps", figure=initial["ratio_steps"], config=_GRAPH_CONFIG
                        ),
                        className="hv-panel",
                    ),
                ],
                className="hv-row",
            ),
            html.Div(
                dcc.Graph(id="tensors", figure=initial["tensors"], config=_GRAPH_CONFIG),
                className="hv-panel",
            ),
        ],
        className="hv-page",
    )
