"""Callbacks: heat-map metric, heat-map click -> step window, window/rank filter -> timeline.

All callbacks run only on user input (``prevent_initial_call``): the first figures are in the
layout already. They read the run held by the app; nothing a request sends can name another run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dash import Dash, Input, Output, State, ctx, no_update

if TYPE_CHECKING:
    from hvtrace_dashboard.app import DashboardData


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


def register(app: Dash, data: DashboardData) -> None:
    """Attach the page's callbacks to ``app``, reading from ``data``."""

    @app.callback(
        Output("heatmap", "figure"),
        Input("heat-metric", "value"),
        prevent_initial_call=True,
    )
    def _heatmap(metric: str) -> Any:
        return data.heatmap(metric)

    @app.callback(
        Output("win-start", "value"),
        Output("focus-step", "data"),
        Input("heatmap", "clickData"),
        Input("win-prev", "n_clicks"),
        Input("win-next", "n_clicks"),
        State("win-start", "value"),
        State("win-size", "value"),
        prevent_initial_call=True,
    )
    def _window(click: Any, _prev: int, _next: int, start: Any, size: Any) -> Any:
        size = int(size or 1)
        start = int(start or 0)
        last = data.last_step
        trig = ctx.triggered_id
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
        return data.timeline(int(start or 0), int(size or 1), ranks or None, focus)
