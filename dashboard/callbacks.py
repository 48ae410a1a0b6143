"""Callbacks: heat-map metric, heat-map click -> step window, window/rank filter -> timeline;
and, for a run still being written, the live refresh.

All callbacks run only on user input or the live timer (``prevent_initial_call``): the first
figures are in the layout already. They read the run held by the app (``current()``: the data
of the last refresh); nothing a request sends can name another run.

Live: every few seconds the page sends the version it shows (``live-version``); when the server
has a newer one, the timer's callback returns the new cards, findings, straggler table and
charts and the new version, which in turn redraws the heat map, and moves the timeline window to
the latest steps when it showed the last ones (a window the user moved elsewhere stays put).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dash import Dash, Input, Output, State, ctx, no_update

if TYPE_CHECKING:
    from hvtrace_dashboard.app import DashboardData
    from hvtrace_dashboard.live import LiveFeed


def window_for_click(step: int, size: int, last_step: int) -> int:
    """Return the first step of a ``size``-step window that shows ``step`` near its middle."""
    start = int(step) - (int(size) - 1) // 2
    return max(0, min(start, max(0, last_step - int(size) + 1)))


def _clicked_step(click: dict[str, Any] | None) -> int | None:
    try:
        pt = click["points"][0]
    except (TypeError, KeyError, IndexError):
        return None
    step = pt.get("customdata", pt.get("x"))
    if isinstance(step, list):  # customdata of a 2-D heat map may arrive as [value]
        step = step[0] if step else None
    try:
        return int(step)
    except (TypeError, ValueError):
        return None


def register(app: Dash, current: Callable[[], DashboardData], feed: LiveFeed | None = None) -> None:
    """Attach the page's callbacks to ``app``, reading from ``current()``; with ``feed`` (a run
    still being written) also the live refresh."""
    live_input = [Input("live-version", "data")] if feed is not None else []

    @app.callback(
        Output("heatmap", "figure"),
        Input("heat-metric", "value"),
        *live_input,
        prevent_initial_call=True,
    )
    def _heatmap(metric: str, *_live: Any) -> Any:
        return current().heatmap(metric)

    @app.callback(
        Output("win-start", "value"),
        Output("focus-step", "data"),
        Input("heatmap", "clickData"),
        Input("win-prev", "n_clicks"),
        Input("win-next", "n_clicks"),
        *live_input,
        State("win-start", "value"),
        State("win-size", "value"),
        prevent_initial_call=True,
    )
    def _window(click: Any, _prev: int, _next: int, *rest: Any) -> Any:
        start, size = rest[-2:]
        size = int(size or 1)
        start = int(start or 0)
        last = current().last_step
        trig = ctx.triggered_id
        if trig == "live-version":  # follow the latest steps if the window showed the last ones
            shown_last = int((rest[0] or {}).get("shown_last", -1))
            if start + size - 1 >= shown_last and last > shown_last:
                return max(0, last - size + 1), no_update
            return no_update, no_update
        if trig == "heatmap":
            step = _clicked_step(click)
            if step is None:
                return no_update, no_update
            return window_for_click(step, size, last), step
        if trig == "win-prev":
            return max(0, start - size), None
        if trig == "win-next":
            return max(0, min(start + size, last - size + 1)), None
        return no_update, no_update

    @app.callback(
        Output("timeline", "figure"),
        Input("win-start", "value"),
        Input("win-size", "value"),
        Input("rank-filter", "value"),
        Input("focus-step", "data"),
        prevent_initial_call=True,
    )
    def _timeline(start: Any, size: Any, ranks: Any, focus: Any) -> Any:
        return current().timeline(int(start or 0), int(size or 1), ranks or None, focus)

    if feed is not None:
        _register_live(app, feed)


def _register_live(app: Dash, feed: LiveFeed) -> None:
    from hvtrace_dashboard.layout import (
        finding_items,
        header_notes,
        straggler_table,
        summary_cards,
    )

    @app.callback(
        Output("live-status", "children"),
        Output("live-status", "className"),
        Output("live-tick", "disabled"),
        Output("live-version", "data"),
        Output("summary-cards", "children"),
        Output("findings", "children"),
        Output("header-notes", "children"),
        Output("straggler-panel", "children"),
        Output("ratio-rank", "figure"),
        Output("ratio-steps", "figure"),
        Output("tensors", "figure"),
        Output("win-start", "max"),
        Input("live-tick", "n_intervals"),
        State("live-version", "data"),
        prevent_initial_call=True,
    )
    def _tick(_n: int, shown: Any) -> Any:
        st, data = feed.snapshot()
        line = (st["text"], "hv-live on" if st["live"] else "hv-live", not st["following"])
        shown = shown if isinstance(shown, dict) else {}
        if shown.get("version") == st["version"]:
            return (*line, *[no_update] * 9)
        return (
            *line,
            {
                "version": st["version"],
                "last": data.last_step,
                "shown_last": shown.get("last", -1),
            },
            summary_cards(data),
            finding_items(data),
            header_notes(data),
            straggler_table(data.stragglers, data.hosts),
            data.figure("ratio_rank"),
            data.figure("ratio_steps"),
            data.figure("tensors"),
            max(data.last_step, 0),
        )
