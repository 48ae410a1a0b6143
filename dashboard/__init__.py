"""hvtrace's dashboard (installed as ``hvtrace_dashboard``): a Dash page for one run.

``create_app(run)`` returns the :class:`dash.Dash` app for a :class:`hvtrace.Run` (opened with
:func:`hvtrace.load.open_run`: its spans are never loaded as one table); the ``hvtrace dashboard
RUN_DIR`` command serves it on 127.0.0.1:8050. Modules: ``app`` (the app, the data it shows, the
per-window span query, the command), ``figures`` (pure DataFrame -> plotly Figure functions),
``layout`` and ``callbacks``. All numbers come from :mod:`hvtrace.analysis`.

Dash is imported only when ``create_app`` (or a module) is first used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DashboardData", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hvtrace_dashboard import app

        return getattr(app, name)
    raise AttributeError(f"module 'hvtrace_dashboard' has no attribute {name!r}")
