"""``hvtrace dashboard RUN_A --compare RUN_B``: two runs side by side, and what changed.

The page renders a :class:`hvtrace.analysis.diff.RunDiff` (the same comparison as ``hvtrace
diff``; it computes nothing of its own): the step time's change with its interval, where the
change went (the parts of a rank's step in A and in B, side by side, their changes adding up to
the total), the allreduced tensors whose time changed most, the stragglers of either run, the
run-level communication figures and the settings that differ. Each run is read from its saved
analysis when it has one (:mod:`hvtrace.analysis.saved`), else analyzed and kept.
"""

from __future__ import annotations

import html
import logging
from typing import Any

import plotly.graph_objects as go
from dash import Dash, dcc
from dash import html as H
from hvtrace_dashboard.figures import empty_figure, esc, one_page_app

from hvtrace.analysis.diff import RunDiff
from hvtrace.export.diff import comm_rows, config_rows, headline, straggler_lines
from hvtrace.units import printable

log = logging.getLogger("hvtrace.dashboard")

#: Tensors drawn (largest change first); ``hvtrace diff --json`` has them all.
PAGE_TENSORS = 12
_A, _B = "#1f77b4", "#d62728"


def parts_figure(d: RunDiff) -> go.Figure:
    """The parts of a rank's step (mean ms) in A and in B, side by side, each labelled with
    its change; the changes add up to the step's."""
    p = d.parts
    p = p[(p["a_ms"].abs() >= 0.005) | (p["b_ms"].abs() >= 0.005)]
    if p.empty:
        return empty_figure("no analyzed steps in one of the runs")
    parts = [esc(x) for x in p["part"]]
    fig = go.Figure()
    fig.add_bar(y=parts, x=p["a_ms"], name="A", orientation="h", marker_color=_A)
    fig.add_bar(
        y=parts,
        x=p["b_ms"],
        name="B",
        orientation="h",
        marker_color=_B,
        text=[f"{v:+.2f} ms" for v in p["delta_ms"]],
        textposition="outside",
        customdata=p[["ci_lo_ms", "ci_hi_ms"]].to_numpy(),
        hovertemplate="%{y}: %{x:.2f} ms in B (change %{text}; 95% interval "
        "%{customdata[0]:+.2f} .. %{customdata[1]:+.2f})<extra>B</extra>",
    )
    title = "Where it went: mean ms per rank and step (the changes add up to the total)"
    return _bars(fig, title, 120 + 44 * len(parts), left=90, right=90)


def tensors_figure(d: RunDiff, limit: int = PAGE_TENSORS) -> go.Figure:
    """Allreduce time per tensor (median ms) in A and in B, the largest changes."""
    t = d.tensors.head(limit)
    if t.empty:
        return empty_figure("no allreduced tensors in either run")
    names = [esc(printable(n)) + (f" ({s})" if s else "") for n, s in zip(t["name"], t["status"])]
    fig = go.Figure()
    fig.add_bar(y=names, x=t["time_a_ms"], name="A", orientation="h", marker_color=_A)
    fig.add_bar(y=names, x=t["time_b_ms"], name="B", orientation="h", marker_color=_B)
    title = f"Allreduce per tensor, median ms ({len(t)} of {len(d.tensors)}, largest change first)"
    return _bars(fig, title, 120 + 36 * len(names), left=220, right=40)


def _bars(fig: go.Figure, title: str, height: int, left: int, right: int) -> go.Figure:
    """The layout both A-vs-B bar charts share: grouped, rows top down, ms across."""
    fig.update_layout(
        barmode="group",
        title=title,
        height=height,
        margin={"l": left, "r": right, "t": 50, "b": 40},
        yaxis={"autorange": "reversed"},
        xaxis={"title": "ms"},
        template="plotly_white",
    )
    return fig


def _table(headers: list[str], rows: list[tuple[str, ...]]) -> Any:
    head = H.Thead(H.Tr([H.Th(h) for h in headers]))
    return H.Table([head, H.Tbody([H.Tr([H.Td(c) for c in r]) for r in rows])])


def compare_layout(d: RunDiff) -> Any:
    """The page of ``d`` (Dash components escape the text they are given)."""
    s = d.step
    head = headline(d)
    changed = bool(s.get("significant"))
    cards = [
        ("A", f"run {printable(d.a_id or '?')}", printable(d.a_dir)),
        ("B", f"run {printable(d.b_id or '?')}", printable(d.b_dir)),
    ]
    config = config_rows(d)
    body = [
        H.H1("hvtrace · two runs compared"),
        H.Div([H.P([H.B(k + ": "), who, H.Br(), H.Small(where)]) for k, who, where in cards]),
        H.H2(head[0], id="cmp-headline"),
        H.P(
            head[1] if len(head) > 1 else "",
            id="cmp-verdict",
            style={"fontWeight": "bold", "color": _B if changed else "#2a7d2a"},
        ),
        *[H.P("note: " + printable(n)) for n in d.notes],
        dcc.Graph(id="cmp-parts", figure=parts_figure(d), config={"displaylogo": False}),
        H.H3("Stragglers"),
        H.Ul([H.Li(t) for t in straggler_lines(d)], id="cmp-stragglers"),
        H.H3("Communication (run medians)"),
        _table(["", "A", "B"], comm_rows(d)),
        dcc.Graph(id="cmp-tensors", figure=tensors_figure(d), config={"displaylogo": False}),
        H.H3("Configuration"),
        _table(["setting", "A", "B"], config)
        if config
        else H.P(f"the same in both runs ({d.config_same} settings recorded)"),
    ]
    return H.Div(body, style={"maxWidth": "1100px", "margin": "0 auto", "fontFamily": "sans-serif"})


def create_compare_app(d: RunDiff) -> Dash:
    """The Dash app of the compare page (one page, no callbacks)."""
    title = f"hvtrace · {html.escape(printable(d.a_id))} vs {html.escape(printable(d.b_id))}"
    return one_page_app(title, compare_layout(d))
