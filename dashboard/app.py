"""The Dash app: ``create_app(run)`` and the ``hvtrace dashboard`` command.

:class:`DashboardData` is the only place the page gets numbers from: it calls
:mod:`hvtrace.analysis` once when the app is created and keeps the resulting tables; the figures
and callbacks only reshape them for display. The app serves the one run it was created with.
"""

from __future__ import annotations

import html
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from dash import Dash
from hvtrace_dashboard import callbacks, figures
from hvtrace_dashboard.layout import INDEX_STRING, build_layout

from hvtrace.load import Run, TraceError, load_run
from hvtrace.schema import TRACE_SUFFIXES
from hvtrace.selection import StepRange
from hvtrace.units import printable

log = logging.getLogger("hvtrace.dashboard")

#: Sample runs tried, in order, when ``hvtrace dashboard`` is given no RUN_DIR.
SAMPLE_RUNS = ("slow_rank1_forward_2rank", "balanced_2rank", "slow_rank2_input_4rank")
#: Default timeline window (steps), made smaller on large runs to keep the first render light.
DEFAULT_WINDOW = 3
#: Spans the first timeline aims to stay under (the window shrinks to 1 step at the least).
FIRST_TIMELINE_SPANS = 3_000


@dataclass
class DashboardData:
    """What the page shows, computed once per run by :mod:`hvtrace.analysis`.

    ``heat`` maps a metric key to a rank x step table (index rank, columns step) and
    ``heat_labels`` the key to the label of the control; ``per_rank``, ``per_step`` and
    ``per_tensor`` feed the comm/compute and tensor charts; ``stragglers`` is the table shown as
    is. ``spans`` is the run's span table for the timeline.
    """

    run_id: str
    run_dir: str
    spans: pd.DataFrame
    hosts: dict[int, str]
    ranks: list[int]
    last_step: int
    summary: dict[str, str]
    findings: list[str]
    heat: dict[str, pd.DataFrame]
    heat_labels: dict[str, str]
    heat_units: dict[str, str]
    per_rank: pd.DataFrame
    per_step: pd.DataFrame
    per_step_columns: dict[str, str]
    per_tensor: pd.DataFrame
    stragglers: pd.DataFrame
    straggler_ranks: list[int] = field(default_factory=list)
    focus_step: int = 0
    problems: list[str] = field(default_factory=list)
    clock_note: str = ""
    t0_ns: int = 0

    @property
    def rank_names(self) -> list[str]:
        """Label of each rank in ``ranks`` for the rank filter."""
        return [f"rank {r} ({self.hosts.get(r, '?')})" for r in self.ranks]

    # -- figures ------------------------------------------------------------------------------
    def heatmap(self, metric: str) -> Any:
        """Return the heat map of ``metric`` (a key of ``heat``)."""
        if metric not in self.heat:
            metric = next(iter(self.heat), "")
        return figures.heatmap_figure(
            self.heat.get(metric),
            title=f"{self.heat_labels.get(metric, metric)} per rank and step",
            unit=self.heat_units.get(metric, "ms"),
            hosts=self.hosts,
            highlight_ranks=self.straggler_ranks,
        )

    def window_spans(self, steps: StepRange, ranks: list[int] | None) -> pd.DataFrame:
        """Return the spans of ``steps`` of ``ranks`` (all when None)."""
        s = self.spans
        m = steps.mask(s["step"].to_numpy())
        if ranks:
            m &= s["rank"].isin(ranks).to_numpy()
        return s[m]

    def timeline(
        self, start: int, size: int, ranks: list[int] | None = None, focus: int | None = None
    ) -> Any:
        """Return the timeline of ``size`` steps from ``start`` for ``ranks`` (all when None)."""
        start = max(0, min(int(start), self.last_step))
        size = max(1, int(size))
        shown = sorted(int(r) for r in ranks) if ranks else self.ranks
        stop = min(start + size, self.last_step + 1)
        window, last = StepRange(start, stop), stop - 1
        steps = f"step {start}" if last == start else f"steps {start}–{last}"
        title = f"Timeline · {steps} · {len(shown)} of {len(self.ranks)} ranks"
        if focus is not None and window.contains(int(focus)):
            title += f" · step {int(focus)} highlighted"
        return figures.timeline_figure(
            self.window_spans(window, shown),
            ranks=shown,
            t0_ns=self.t0_ns,
            title=title,
            hosts=self.hosts,
            focus_step=None if focus is None else int(focus),
        )

    def figure_builders(self) -> dict[str, Any]:
        """Return {name: zero-argument builder} of the page's first figures."""
        start, size = self.initial_window(), self.initial_size()
        return {
            "heatmap": lambda: self.heatmap(next(iter(self.heat), "")),
            "timeline": lambda: self.timeline(start, size, None, self.focus_step),
            "ratio_rank": lambda: figures.ratio_per_rank_figure(
                self.per_rank, highlight_ranks=self.straggler_ranks, hosts=self.hosts
            ),
            "ratio_steps": lambda: figures.ratio_over_steps_figure(
                self.per_step, self.per_step_columns
            ),
            "tensors": lambda: figures.tensor_figure(self.per_tensor),
        }

    def initial_size(self) -> int:
        """Return the steps of the first timeline window: DEFAULT_WINDOW, fewer on big runs."""
        per_step = len(self.spans) / max(1, self.last_step + 1)
        return int(max(1, min(DEFAULT_WINDOW, FIRST_TIMELINE_SPANS // max(per_step, 1))))

    def initial_window(self) -> int:
        """Return the first step of the first timeline window (around ``focus_step``)."""
        return callbacks.window_for_click(self.focus_step, self.initial_size(), self.last_step)

    @classmethod
    def from_run(cls, run: Run) -> DashboardData:
        """Analyze ``run`` with :func:`hvtrace.analysis.analyze` and keep what the page shows."""
        from hvtrace.analysis import analyze

        return cls.from_analysis(run, analyze(run))

    @classmethod
    def from_analysis(cls, run: Run, a: Any) -> DashboardData:
        """Keep the tables of an :class:`hvtrace.analysis.Analysis` of ``run`` for the page.

        Only reshaping happens here (pivots to rank x step, column picks, formatting), plus the
        header's run-level medians of the analyzer's per-step table (see ``_headline``).
        """
        from hvtrace.analysis import arrival_table

        st = a.steps
        heat: dict[str, pd.DataFrame] = {}
        if len(st):
            heat["step"] = st.pivot(index="rank", columns="step", values="step_ns") / 1e6
            heat["compute"] = st.pivot(index="rank", columns="step", values="model_ns") / 1e6
            late = arrival_table(st)
            if late["lateness_ms"].notna().any():
                heat["lateness"] = late.pivot(index="rank", columns="step", values="lateness_ms")
        labels = {
            "lateness": "arrival lateness",
            "step": "step time",
            "compute": "compute time (forward + backward)",
        }
        heat = {k: heat[k] for k in labels if k in heat}  # lateness first: stragglers stand out
        first, last, count = a.analyzed_step_numbers
        per_step = a.per_step
        analyzed = per_step[(per_step["step"] >= first) & (per_step["step"] <= last)]
        head = _headline(analyzed)
        n_steps = int(st["step"].nunique()) if len(st) else 0
        n_strag = len(a.stragglers) + len(a.slow_hosts)
        summary = {
            "ranks": f"{len(a.ranks)}" + (f" of {a.size}" if len(a.ranks) != a.size else ""),
            "hosts": str(len(set(a.hosts.values()))),
            "steps": str(n_steps),
            "median step": _fmt(head.get("step_ms"), " ms"),
            "comm/compute": _fmt(head.get("comm_compute_ratio"), "", ".2f"),
            "overlap": _fmt(head.get("overlap"), "", ".0%"),
            "busbw": _fmt(a.comm.get("busbw_gbps"), " GB/s", ".2f"),
            "stragglers": str(n_strag),
        }
        focus = first if count else 0
        if len(analyzed) and analyzed["step_ms"].notna().any():
            focus = int(analyzed.loc[analyzed["step_ms"].idxmax(), "step"])  # the slowest step
        stragglers = a.stragglers.copy()
        if len(a.slow_hosts):
            hosts_rows = a.slow_hosts.assign(
                rank=a.slow_hosts["ranks"].map(lambda rs: ", ".join(map(str, rs))),
                reason="every rank of this host is late",
            ).drop(columns=["ranks"])
            stragglers = pd.concat([stragglers, hosts_rows], ignore_index=True)
        notes = [a.clock] if a.clock else []
        if count:
            notes.append(
                f"statistics over steps {first}..{last} ({count} steps; "
                f"warm-up steps before {a.skip_steps} left out)"
            )
        return cls(
            run_id=a.run_id or run.run_id,
            run_dir=str(run.run_dir),
            spans=run.spans,
            hosts=dict(a.hosts),
            ranks=list(a.ranks),
            last_step=int(run.spans["step"].max()) if len(run.spans) else 0,
            summary=summary,
            findings=[("⚠ " if f.severity == "warning" else "") + f.message for f in a.findings],
            heat=heat,
            heat_labels={k: labels[k] for k in heat},
            heat_units={k: "ms" for k in heat},
            per_rank=a.per_rank[["rank", "host", "comm_compute_ratio"]],
            per_step=per_step,
            per_step_columns={
                "comm_compute_ratio": "comm/compute (rank that arrived last)",
                "overlap": "overlap (share of allreduce hidden under backward)",
            },
            per_tensor=a.tensors,
            stragglers=stragglers,
            straggler_ranks=[int(r) for r in a.stragglers["rank"]],
            focus_step=focus,
            problems=list(a.problems),
            clock_note=" · ".join(notes),
            t0_ns=int(run.spans["start_ns"].min()) if len(run.spans) else 0,
        )


def _headline(per_step: pd.DataFrame) -> dict[str, float]:
    """Run-level numbers of the header: medians over the analyzed steps of the analyzer's
    per-step table (:func:`hvtrace.analysis.step_summary`), which has no run-level row."""
    cols = ["step_ms", "comm_compute_ratio", "overlap"]
    return {c: float(per_step[c].median()) for c in cols if c in per_step and len(per_step)}


def _fmt(x: Any, unit: str = "", spec: str = ".1f") -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "—"
    if x != x:  # NaN
        return "—"
    return f"{x:{spec}}{unit}"


def create_app(run: Run, data: DashboardData | None = None) -> Dash:
    """Return the Dash app showing ``run`` (analyzed now unless ``data`` is given)."""
    if data is None:
        data = DashboardData.from_run(run)
    app = Dash(
        __name__,
        title=f"hvtrace · {html.escape(data.run_id)}",  # Dash puts the title in raw HTML
        update_title=None,
        serve_locally=True,
        assets_ignore=".*",
    )
    app.index_string = INDEX_STRING
    _serve_partial_plotly(app)
    built = {k: b() for k, b in data.figure_builders().items()}
    initial = {
        "metric": next(iter(data.heat), ""),
        "heatmap": built["heatmap"],
        "timeline": built["timeline"],
        "ratio_rank": built["ratio_rank"],
        "ratio_steps": built["ratio_steps"],
        "tensors": built["tensors"],
        "start": data.initial_window(),
        "size": data.initial_size(),
        "focus": data.focus_step,
    }
    app.layout = build_layout(data, initial)
    callbacks.register(app, data)
    app.hvtrace_data = data  # for tests and the benchmark
    return app


#: plotly.js's cartesian partial bundle, vendored (see dashboard/static/README.md).
PLOTLY_BUNDLE = Path(__file__).resolve().parent / "static" / "plotly-cartesian.min.js"


def bundle_version(path: Path = PLOTLY_BUNDLE) -> str | None:
    """Return the plotly.js version named in a bundle's banner ("v4.1.1" -> "4.1.1"), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(300).decode("ascii", "replace")
    except OSError:
        return None
    m = re.search(r"plotly\.js \([^)]*\) v(\d+\.\d+\.\d+)", head)
    return m.group(1) if m else None


def _serve_partial_plotly(app: Dash) -> bool:
    """Load the vendored cartesian plotly.js before Dash starts, if it matches plotly's version.

    dcc.Graph uses ``window.Plotly`` when it is already there and fetches the full bundle only
    otherwise, so the 1.5 MB partial bundle replaces 4.8 MB of JavaScript to fetch and compile.
    Returns whether it is used.
    """
    from plotly.offline import get_plotlyjs_version

    version = bundle_version()
    if version is None or version != get_plotlyjs_version():
        log.debug(
            "plotly.js %s is installed, the vendored bundle is %s: using Dash's full bundle",
            get_plotlyjs_version(),
            version,
        )
        return False
    route = f"/_hvtrace/plotly-cartesian-{version}.min.js"

    def bundle() -> Any:
        from flask import send_file

        return send_file(PLOTLY_BUNDLE, mimetype="text/javascript", max_age=365 * 24 * 3600)

    app.server.add_url_rule(route, "hvtrace_plotly", bundle)
    app.index_string = app.index_string.replace(
        "{%scripts%}", f'<script src="{route}"></script>{{%scripts%}}', 1
    )
    return True


# -- command line ---------------------------------------------------------------------------------


def _has_traces(d: Path) -> bool:
    """True when ``d`` holds non-empty trace files (a sample being written has empty ones)."""
    return d.is_dir() and any(
        p.suffix in TRACE_SUFFIXES and p.stat().st_size > 0 for p in d.iterdir()
    )


def sample_run_dir() -> Path:
    """Return the built-in sample run; raise :class:`TraceError` when there is none.

    The package carries one (``hvtrace_dashboard/sample``: the 2-rank run whose rank 1 is slowed
    in its forward), so an installed wheel has it; a checkout's ``sample_traces/`` is preferred.
    """
    packaged = Path(__file__).resolve().parent / "sample"
    roots = [Path(__file__).resolve().parent.parent / "sample_traces", Path.cwd() / "sample_traces"]
    for root in roots:
        if not root.is_dir():
            continue
        for name in SAMPLE_RUNS:
            if _has_traces(root / name):
                return root / name
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            if _has_traces(d):
                return d
    if _has_traces(packaged):
        return packaged
    raise TraceError(
        "no RUN_DIR given and no built-in sample run found in sample_traces/ "
        "(make one with scripts/make_samples.sh, or pass a run directory)"
    )


def _check_can_listen(host: str, port: int) -> None:
    """Raise TraceError (one line, exit 2) now if ``host:port`` cannot be bound, before loading."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TraceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise TraceError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(
    run_dir: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8050,
    run_id: str | None = None,
    verbose: bool = False,
) -> int:
    """Load and analyze the run (no ``run_dir``: the built-in sample), then serve it until
    Ctrl-C. Errors in the input or the address raise :class:`TraceError` (one line)."""
    run_dir = Path(run_dir) if run_dir else sample_run_dir()
    if not run_dir.exists():
        raise TraceError(f"{run_dir}: no such directory")
    if not 0 <= port <= 65535:
        raise TraceError(f"--port {port} is not a port number")
    _check_can_listen(host, port)
    run = load_run(run_dir, run_id=run_id)
    if run.spans.empty or not (run.spans["kind"] == "step").any():
        raise TraceError(f"{run_dir}: the run has no completed step to show")
    app = create_app(run)
    url = f"http://{host}:{port}/"
    print(printable(f"hvtrace dashboard: run {run.run_id} ({run_dir}) on {url}  (Ctrl-C to stop)"))
    sys.stdout.flush()
    if not verbose:  # no per-request lines, no second "running on" line
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        logging.getLogger("dash.dash").setLevel(logging.WARNING)
    try:
        app.run(host=host, port=port, debug=False, dev_tools_ui=False)
    except OSError as exc:
        raise TraceError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return 0
