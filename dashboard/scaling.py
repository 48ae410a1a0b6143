"""``hvtrace dashboard RUN_1 --scaling RUN_2 [RUN_4 ...]``: where scaling is lost, as a page.

The page renders a :class:`hvtrace.analysis.scaling.Scaling` (the same study as ``hvtrace
scaling``; it computes no metric of its own): the efficiency of each run against the smallest
one, with the step predicted at twice the largest world size drawn apart as a prediction (dashed,
open marker) and its assumptions in text; the time lost per step against the smallest run, as
stacked parts (exposed communication, waiting for the last rank, compute by cause, input,
update, other) that add up to the total drawn beside them; and the runs as a table. Each run is
read from its saved analysis when it has one (:mod:`hvtrace.analysis.saved`), else analyzed and
kept.
"""

from __future__ import annotations

import html
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from dash import Dash, dcc
from dash import html as H
from hvtrace_dashboard.figures import empty_figure, esc, one_page_app

from hvtrace.analysis.scaling import LOSS_LABELS, LOSS_PARTS, Scaling
from hvtrace.export.scaling import fit_text
from hvtrace.units import printable

log = logging.getLogger("hvtrace.dashboard")

#: Colour of each part of the loss (the same in every figure of the page).
PART_COLORS: dict[str, str] = {
    "exposed_comm": "#d62728",
    "waiting_for_last": "#ff7f0e",
    "compute_work": "#1f77b4",
    "compute_contention": "#9467bd",
    "compute_blocked": "#7f7f7f",
    "compute": "#17becf",
    "input": "#8c564b",
    "update": "#2ca02c",
    "other": "#c7c7c7",
}
#: A part drawn in the stacked loss when it reaches this (ms) in some run, as in the text report.
SHOWN_MS = 0.005
_MEASURED, _PREDICTED = "#1f77b4", "#d62728"
_GRAPH = {"displaylogo": False}


def _f(x: Any, fmt: str = ".2f") -> str:
    """``x`` formatted, or "-" where it is missing or not finite."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return format(v, fmt) if math.isfinite(v) else "-"


def _run_labels(s: Scaling) -> list[str]:
    """A label per run ("4 ranks"; with "(2)", "(3)" after a world size seen before)."""
    seen: dict[int, int] = {}
    out = []
    for n in s.runs["size"]:
        n = int(n)
        seen[n] = seen.get(n, 0) + 1
        out.append(f"{n} rank{'s' if n != 1 else ''}" + (f" ({seen[n]})" if seen[n] > 1 else ""))
    return out


def efficiency_figure(s: Scaling) -> go.Figure:
    """Efficiency per world size (measured: a solid line), the ideal (100 %, dotted) and the
    prediction for twice the largest size (a dashed line to an open marker)."""
    t = s.runs
    if t.empty:
        return empty_figure("no runs")
    sizes = [int(n) for n in t["size"]]
    p = s.prediction
    ticks = sorted({*sizes, *([int(p["size"])] if p else [])})
    fig = go.Figure()
    fig.add_scatter(
        x=[ticks[0], ticks[-1]],
        y=[1.0, 1.0],
        mode="lines",
        name="perfect scaling",
        line={"color": "#999999", "dash": "dot", "width": 1},
        hoverinfo="skip",
    )
    fig.add_scatter(
        x=sizes,
        y=list(t["efficiency"]),
        mode="lines+markers+text",
        name="measured",
        line={"color": _MEASURED, "width": 3},
        marker={"size": 10},
        text=[_f(v, ".0%") for v in t["efficiency"]],
        textposition="top center",
        customdata=[
            [esc(r.run_id), _f(r.step_ms), _f(r.speedup), _f(r.loss_ms, "+.2f")]
            for r in t.itertuples()
        ],
        hovertemplate="%{x} ranks: efficiency %{y:.1%}<br>step %{customdata[1]} ms (mean per "
        "rank and step), speed-up %{customdata[2]}x, lost %{customdata[3]} ms per step<br>"
        "run %{customdata[0]}<extra>measured</extra>",
    )
    if p:
        last = t.iloc[-1]
        fig.add_scatter(
            x=[int(last["size"]), int(p["size"])],
            y=[float(last["efficiency"]), float(p["efficiency"])],
            mode="lines",
            name="predicted",
            legendgroup="predicted",
            showlegend=False,
            line={"color": _PREDICTED, "dash": "dash", "width": 2},
            hoverinfo="skip",
        )
        latency = p.get("model") == "latency"
        how = (
            f"the fitted message cost, {_f(p.get('exposed_growth_ms'), '+.2f')} ms of it exposed"
            if latency
            else "a ring's bytes alone, all of it exposed"
        )
        fig.add_scatter(
            x=[int(p["size"])],
            y=[float(p["efficiency"])],
            mode="markers+text",
            name=f"predicted at {int(p['size'])} ranks"
            + ("" if latency else " (an upper bound of the loss)"),
            legendgroup="predicted",
            marker={
                "size": 13,
                "symbol": "diamond-open",
                "color": _PREDICTED,
                "line": {"width": 2},
            },
            text=[f"{_f(p['efficiency'], '.0%')} (predicted)"],
            textposition="bottom center",
            customdata=[[_f(p["step_ms"]), _f(p["comm_growth_ms"], "+.2f"), esc(how)]],
            hovertemplate="%{x} ranks (predicted): efficiency %{y:.1%}<br>step about "
            "%{customdata[0]} ms (%{customdata[1]} ms of allreduce per step: "
            "%{customdata[2]})<br>see the assumptions below the chart<extra>predicted</extra>",
        )
    top = max([1.0, *[float(v) for v in t["efficiency"] if math.isfinite(float(v))]])
    fig.update_layout(
        title=f"Scaling efficiency against the smallest run ({sizes[0]} "
        f"rank{'s' if sizes[0] != 1 else ''}; 100 %: perfect weak scaling)",
        height=420,
        margin={"l": 70, "r": 30, "t": 60, "b": 50},
        template="plotly_white",
        xaxis={
            "title": "world size (ranks)",
            "type": "log",
            "tickvals": ticks,
            "ticktext": [str(n) for n in ticks],
        },
        yaxis={"title": "efficiency", "tickformat": ".0%", "range": [0, top * 1.15]},
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def loss_figure(s: Scaling) -> go.Figure:
    """The time lost per step against the smallest run (ms), one stacked bar per larger run
    (positive parts up, negative ones down), with the total beside each bar: the parts add up
    to it (:data:`hvtrace.analysis.scaling.LOSS_PARTS`)."""
    t = s.runs.iloc[1:]
    if t.empty:
        return empty_figure("one run: nothing to compare it with")
    labels = _run_labels(s)[1:]
    ids = [esc(x) for x in t["run_id"]]
    fig = go.Figure()
    for part in LOSS_PARTS:
        if part not in t.columns or not (t[part].abs() >= SHOWN_MS).any():
            continue
        fig.add_bar(
            x=labels,
            y=list(t[part]),
            name=LOSS_LABELS[part],
            marker_color=PART_COLORS.get(part),
            customdata=ids,
            hovertemplate=f"%{{x}}: %{{y:+.2f}} ms per step (run %{{customdata}})"
            f"<extra>{LOSS_LABELS[part]}</extra>",
        )
    fig.add_scatter(
        x=labels,
        y=list(t["loss_ms"]),
        mode="markers+text",
        name="total lost",
        marker={"symbol": "line-ew-open", "size": 36, "color": "black", "line": {"width": 3}},
        text=[f"{_f(v, '+.2f')} ms" for v in t["loss_ms"]],
        textposition="top center",
        hovertemplate="%{x}: %{y:+.2f} ms per step lost in all<extra>total</extra>",
    )
    base = int(s.runs["size"].iloc[0])
    fig.update_layout(
        barmode="relative",
        title=f"Where the time went: ms lost per step against the {base}-rank run (the parts "
        "add up)",
        height=460,
        margin={"l": 70, "r": 30, "t": 60, "b": 50},
        template="plotly_white",
        yaxis={"title": "ms per rank and step", "zeroline": True},
        xaxis={"title": "world size"},
        legend={"traceorder": "reversed"},  # as the bars stack: the top part first
    )
    return fig


def prediction_lines(s: Scaling) -> list[str]:
    """The prediction in words (the numbers :func:`hvtrace.analysis.scaling.scaling` gave)."""
    p = s.prediction
    if not p:
        return [
            "No prediction for the next size: it needs the allreduce time of the largest run "
            "(a run of two ranks or more)."
        ]
    latency = p.get("model") == "latency"
    how = (
        f"{_f(p.get('exposed_growth_ms'), '+.2f')} ms of it exposed"
        if latency
        else "all of it exposed: a ring's bytes alone, no per-message latency"
    )
    bound = (
        "under the assumptions below"
        if latency
        else "an upper bound of the loss under the assumptions below"
    )
    out = [
        f"At {int(p['size'])} ranks (predicted): a step of about {_f(p['step_ms'])} ms, "
        f"efficiency {_f(p['efficiency'], '.0%')} ({_f(p['comm_growth_ms'], '+.2f')} ms of "
        f"allreduce per step, {how}). This is a prediction, not a measurement: {bound}."
    ]
    fit = fit_text(p)
    if fit:
        out.append(fit[0].upper() + fit[1:] + ".")
    return out


def _table(s: Scaling, hosts: Sequence[Sequence[str]] | None) -> Any:
    heads = ["ranks", "median ms", "mean ms", "efficiency", "speed-up", "lost ms", "run", "dir"]
    if hosts is not None:
        heads.append("hosts")
    rows = []
    for i, r in enumerate(s.runs.itertuples()):
        cells = [
            str(int(r.size)),
            _f(r.median_step_ms),
            _f(r.step_ms),
            _f(r.efficiency, ".0%"),
            _f(r.speedup),
            _f(r.loss_ms, "+.2f"),
            printable(r.run_id),
            printable(r.run_dir),
        ]
        if hosts is not None:
            h = list(hosts[i]) if i < len(hosts) else []
            cells.append(", ".join(printable(x) for x in h) if h else "-")
        rows.append(H.Tr([H.Td(c) for c in cells]))
    return H.Table(
        [H.Thead(H.Tr([H.Th(h) for h in heads])), H.Tbody(rows)],
        id="scl-runs",
        style={"borderSpacing": "12px 2px"},
    )


def scaling_layout(s: Scaling, hosts: Sequence[Sequence[str]] | None = None) -> Any:
    """The page of ``s`` (Dash components escape the text they are given; figure text goes
    through :func:`hvtrace_dashboard.figures.esc`). ``hosts``: each run's hosts, in the order
    of ``s.runs`` (:func:`run_hosts`), or None."""
    t = s.runs
    sizes = ", ".join(str(int(n)) for n in t["size"])
    body = [
        H.H1("hvtrace · where scaling is lost"),
        H.P(
            f"{len(t)} runs of one job at {sizes} ranks: the same study as hvtrace scaling.",
            id="scl-headline",
        ),
        *[H.P("note: " + printable(n)) for n in s.notes],
        dcc.Graph(id="scl-efficiency", figure=efficiency_figure(s), config=_GRAPH),
        H.Div(
            [H.P(x, style={"fontWeight": "bold"}) for x in prediction_lines(s)],
            id="scl-prediction",
        ),
        H.H3("Assumptions"),
        H.Ul([H.Li(printable(a)) for a in s.assumptions], id="scl-assumptions"),
        dcc.Graph(id="scl-loss", figure=loss_figure(s), config=_GRAPH),
        H.P(
            "Each part is the change of a mean per rank and step against the smallest run: "
            "exposed communication (the last rank's wait), waiting for the last rank (every "
            "other wait), compute (by cause where CPU time was measured), input, update, other.",
            style={"color": "#555"},
        ),
        H.H3("Runs"),
        _table(s, hosts),
    ]
    return H.Div(body, style={"maxWidth": "1100px", "margin": "0 auto", "fontFamily": "sans-serif"})


def run_hosts(s: Scaling, analyses: Sequence[Any]) -> list[list[str]]:
    """Each run's hosts (sorted), in the order of ``s.runs``: each row is matched with the
    analysis of the same world size, run id and directory not matched before."""
    left = list(analyses)
    out = []
    for r in s.runs.itertuples():
        key = (int(r.size), str(r.run_id), str(r.run_dir))
        for i, a in enumerate(left):
            if (int(a.size), str(a.run_id), str(a.run_dir or "")) == key:
                out.append(sorted({str(h) for h in (a.hosts or {}).values()}))
                del left[i]
                break
        else:
            out.append([])
    return out


def create_scaling_app(s: Scaling, hosts: Sequence[Sequence[str]] | None = None) -> Dash:
    """The Dash app of the scaling page (one page, no callbacks)."""
    sizes = ", ".join(str(int(n)) for n in s.runs["size"])
    title = f"hvtrace · scaling at {html.escape(sizes)} ranks"
    return one_page_app(title, scaling_layout(s, hosts))


def serve_scaling(
    run_dirs: Sequence[str | Path], host: str, port: int, verbose: bool = False
) -> int:
    """Serve the scaling page of ``run_dirs`` (two or more) until Ctrl-C."""
    from hvtrace_dashboard.app import _run_app, open_analyses

    from hvtrace.analysis.scaling import scaling
    from hvtrace.load import TraceError

    if len(run_dirs) < 2:
        raise TraceError("--scaling needs two runs or more (of one job at different world sizes)")
    t0 = time.perf_counter()
    analyses = open_analyses((f"run {k}", d) for k, d in enumerate(run_dirs, 1))
    s = scaling(analyses)
    app = create_scaling_app(s, run_hosts(s, analyses))
    url = f"http://{host}:{port}/"
    print(
        printable(
            f"hvtrace dashboard: scaling of {len(run_dirs)} runs ready in "
            f"{time.perf_counter() - t0:.1f} s on {url}  (Ctrl-C to stop)"
        ),
        flush=True,
    )
    return _run_app(app, host, port, verbose)
