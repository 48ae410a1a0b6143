"""The Dash app: ``create_app(run)`` and the ``hvtrace dashboard`` command.

:class:`DashboardData` is the only place the page gets numbers from: it runs the engine analysis
(:func:`hvtrace.analysis.analyze`, which never loads the run's spans as one table) once when the
app is created and keeps its per-(rank, step) tables, reshaped for the figures (rank x step
arrays, per-rank and per-step summaries); the figures bin them to what a browser draws quickly.
The timeline is the one view that shows spans: those of its window only (a step range and a set
of ranks), queried from the rank files on DuckDB when it is drawn
(:func:`hvtrace.analysis.engine.window_spans`, on rank 0's clock by the analysis' own offsets).
So a run of any size opens. The app serves the one run it was created with.
"""

from __future__ import annotations

import functools
import html
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from dash import Dash
from hvtrace_dashboard import callbacks, figures
from hvtrace_dashboard.layout import INDEX_STRING, WINDOW_SIZES, build_layout

from hvtrace.format.schema import TRACE_SUFFIXES
from hvtrace.load import Run, TraceError, span_sources
from hvtrace.selection import StepRange
from hvtrace.units import printable

log = logging.getLogger("hvtrace.dashboard")

#: Sample runs tried, in order, when ``hvtrace dashboard`` is given no RUN_DIR.
SAMPLE_RUNS = ("slow_rank1_forward_2rank", "balanced_2rank", "slow_rank2_input_4rank")
#: Default timeline window (steps), made smaller on large runs to keep the first render light.
DEFAULT_WINDOW = 3
#: Spans the first timeline aims to stay under (the window shrinks to 1 step at the least).
FIRST_TIMELINE_SPANS = 3_000
#: Ranks the timeline shows when no rank is picked, all of them up to this many; a run with more
#: shows ``TIMELINE_SUBSET`` ranks: rank 0 and the ranks that arrive latest (median lateness:
#: the stragglers first), and the title says so.
TIMELINE_RANKS = 32
TIMELINE_SUBSET = 16

#: Timeline windows whose spans are kept in memory (a few thousand spans each at most).
WINDOW_CACHE = 64

#: ``fetch(steps, ranks)``: the spans of a timeline window (columns of
#: :func:`hvtrace.analysis.engine.window_spans`, times on rank 0's clock).
WindowFetch = Callable[[StepRange, list[int]], pd.DataFrame]


def run_window(run: Run) -> WindowFetch:
    """Return the window query of ``run``: each call reads only the row groups of its steps from
    the files of its ranks (:func:`hvtrace.analysis.engine.window_spans`) on a cursor of its own
    (concurrent requests share one in-memory DuckDB database, with the analysis' memory limit,
    closed when the query is garbage-collected or at exit). The last
    ``WINDOW_CACHE`` windows are kept (moving back and forth, or changing the rank filter back,
    costs no query); a window that could not be read is asked again."""
    import duckdb

    from hvtrace.analysis.engine import default_memory_limit_bytes, window_spans

    # a window is small: no spilling, so no spill directory to leave behind if the server is
    # killed (the analysis' engine has one, removed when it is done)
    db = duckdb.connect(
        ":memory:",
        config={
            "threads": 1,
            "memory_limit": f"{default_memory_limit_bytes() // (1 << 20)}MiB",
            "temp_directory": "",
        },
    )

    def fetch(steps: StepRange, ranks: list[int]) -> pd.DataFrame:
        return query(steps.first, steps.stop, tuple(sorted(set(int(r) for r in ranks))))

    @functools.lru_cache(maxsize=WINDOW_CACHE)
    def query(first: int, stop: int | None, ranks: tuple[int, ...]) -> pd.DataFrame:
        steps = StepRange(first, stop)
        want = set(ranks)
        sources = span_sources(run, steps, want)
        if not sources:
            return _no_spans()
        t0 = time.perf_counter()
        con = db.cursor()
        try:
            out = window_spans(sources, steps, con)
        except (duckdb.Error, OSError) as exc:  # a file changed or vanished since the start
            text = str(exc).strip()
            first = text.splitlines()[0][:200] if text else type(exc).__name__
            raise TraceError(f"cannot read steps {steps.label()}: {first}") from None
        finally:
            con.close()
        log.debug(
            "window %s of %d rank(s): %d spans in %.3f s",
            steps.label(),
            len(sources),
            len(out),
            time.perf_counter() - t0,
        )
        return out

    weakref.finalize(fetch, db.close)  # with the query, or at exit
    return fetch


def frame_window(spans: pd.DataFrame) -> WindowFetch:
    """Return the window query of a span table already in memory (``Run.spans`` of a loaded
    run, or a hand-made one): for tests and notebooks."""

    def fetch(steps: StepRange, ranks: list[int]) -> pd.DataFrame:
        m = steps.mask(spans["step"].to_numpy()) & spans["rank"].isin(ranks).to_numpy()
        return spans[m]

    return fetch


def _no_spans() -> pd.DataFrame:
    cols = {"rank": np.int32, "step": np.int32, "kind": object, "name": object}
    cols |= {"start_ns": np.int64, "end_ns": np.int64, "bytes": np.int64, "dtype": object}
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in cols.items()})


@dataclass
class DashboardData:
    """What the page shows, computed once per run by :mod:`hvtrace.analysis`.

    ``heat`` maps a metric key to a rank x step table (index rank, columns step, float32 cells)
    and ``heat_labels`` the key to the label of the control; ``per_rank`` (``rank``, ``host``,
    ``late_ms``, ``comm_compute_ratio``), ``per_step`` and ``per_tensor`` feed the per-rank,
    comm/compute and tensor charts; ``stragglers`` is the table shown as is. ``window(steps,
    ranks)`` returns the spans of a timeline window; ``spans_per_rank_step`` (the run's average)
    sizes the first one; ``timeline_ranks`` are the rows shown when no rank is picked.
    """

    run_id: str
    run_dir: str
    window: WindowFetch
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
    #: Elastic Horovod: the run's membership epochs (:attr:`hvtrace.analysis.Analysis.membership`;
    #: empty when the workers never changed). The resets are among the findings.
    membership: list[dict[str, Any]] = field(default_factory=list)
    t0_ns: int = 0
    spans_per_rank_step: float = 20.0
    timeline_ranks: list[int] = field(default_factory=list)
    _heat_figures: dict[str, Any] = field(default_factory=dict, repr=False)
    _figures: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.timeline_ranks:
            self.timeline_ranks = default_timeline_ranks(
                self.ranks, self.per_rank, self.straggler_ranks
            )

    @property
    def has_steps(self) -> bool:
        """Whether any heat map has a value (a run with no complete step has none)."""
        return any(np.isfinite(h.to_numpy()).any() for h in self.heat.values())

    @property
    def rank_names(self) -> list[str]:
        """Label of each rank in ``ranks`` for the rank filter."""
        return [f"rank {r} ({self.hosts.get(r, '?')})" for r in self.ranks]

    @property
    def rank_filter_placeholder(self) -> str:
        """What the rank filter says when no rank is picked."""
        if len(self.timeline_ranks) >= len(self.ranks):
            return "all ranks"
        return f"{len(self.timeline_ranks)} of {len(self.ranks)}: rank 0 and the latest to arrive"

    # -- figures ------------------------------------------------------------------------------
    def heatmap(self, metric: str) -> Any:
        """Return the heat map of ``metric`` (a key of ``heat``; built once, then cached)."""
        if metric not in self.heat:
            metric = next(iter(self.heat), "")
        fig = self._heat_figures.get(metric)
        if fig is None:
            fig = figures.heatmap_figure(
                self.heat.get(metric),
                title=f"{self.heat_labels.get(metric, metric)} per rank and step",
                unit=self.heat_units.get(metric, "ms"),
                hosts=self.hosts,
                highlight_ranks=self.straggler_ranks,
            )
            self._heat_figures[metric] = fig
        return fig

    def window_spans(self, steps: StepRange, ranks: list[int] | None) -> pd.DataFrame:
        """Return the spans of ``steps`` of ``ranks`` (None: ``timeline_ranks``)."""
        return self.window(steps, list(ranks) if ranks else list(self.timeline_ranks))

    def shown_ranks(self, ranks: Any) -> tuple[list[int], bool]:
        """Return the timeline's rows for a rank-filter value and whether they were picked
        (values that are not ranks of the run are ignored; none left: ``timeline_ranks``)."""
        known = set(self.ranks)
        picked = []
        for r in ranks if isinstance(ranks, list | tuple) else []:
            try:
                rank = int(r)
            except (TypeError, ValueError):
                continue
            if rank in known:
                picked.append(rank)
        if picked:
            return sorted(set(picked)), True
        return list(self.timeline_ranks), False

    def timeline(
        self, start: int, size: int, ranks: list[int] | None = None, focus: int | None = None
    ) -> Any:
        """Return the timeline of ``size`` steps from ``start`` for ``ranks`` (None: the
        default rows, ``timeline_ranks``); its spans are queried for this window only."""
        start = max(0, min(int(start), self.last_step))
        size = max(1, min(int(size), max(WINDOW_SIZES)))
        shown, picked = self.shown_ranks(ranks)
        stop = min(start + size, self.last_step + 1)
        window, last = StepRange(start, stop), stop - 1
        steps = f"step {start}" if last == start else f"steps {start}–{last}"
        title = f"Timeline · {steps} · {len(shown)} of {len(self.ranks)} ranks"
        if not picked and len(shown) < len(self.ranks):
            title += " (rank 0 and the latest to arrive; pick ranks above)"
        if focus is not None and window.contains(int(focus)):
            title += f" · step {int(focus)} highlighted"
        try:
            spans = self.window_spans(window, shown)
        except TraceError as exc:
            log.warning("%s", exc)
            return figures.empty_figure(figures.esc(f"{title}: {exc}"))
        return figures.timeline_figure(
            spans,
            ranks=shown,
            t0_ns=self.t0_ns,
            title=title,
            hosts=self.hosts,
            focus_step=None if focus is None else int(focus),
        )

    def figure(self, name: str) -> Any:
        """Return the first figure ``name`` of :meth:`figure_builders` but the timeline (whose
        window changes), built once (every page and every live client gets the same)."""
        fig = self._figures.get(name)
        if fig is None:
            fig = self._figures[name] = self.figure_builders()[name]()
        return fig

    def figure_builders(self) -> dict[str, Any]:
        """Return {name: zero-argument builder} of the page's first figures."""
        start, size = self.initial_window(), self.initial_size()
        return {
            "heatmap": lambda: self.heatmap(next(iter(self.heat), "")),
            "timeline": lambda: self.timeline(start, size, None, self.focus_step),
            "ratio_rank": lambda: figures.per_rank_figure(
                self.per_rank,
                {
                    "late_ms": ("arrival lateness", "ms"),
                    "comm_compute_ratio": ("comm/compute", "ratio"),
                },
                highlight_ranks=self.straggler_ranks,
                hosts=self.hosts,
            ),
            "ratio_steps": lambda: figures.ratio_over_steps_figure(
                self.per_step, self.per_step_columns
            ),
            "tensors": lambda: figures.tensor_figure(self.per_tensor),
        }

    def initial_size(self) -> int:
        """Return the steps of the first timeline window: DEFAULT_WINDOW, fewer on big runs."""
        per_step = self.spans_per_rank_step * max(1, len(self.timeline_ranks))
        return int(max(1, min(DEFAULT_WINDOW, FIRST_TIMELINE_SPANS // max(per_step, 1))))

    def initial_window(self) -> int:
        """Return the first step of the first timeline window (around ``focus_step``)."""
        return callbacks.window_for_click(self.focus_step, self.initial_size(), self.last_step)

    @classmethod
    def from_run(cls, run: Run, **analyze_kw: Any) -> DashboardData:
        """Analyze ``run`` with :func:`hvtrace.analysis.analyze` (on the engine: the run's spans
        are never one table) and keep what the page shows; ``analyze_kw`` go to ``analyze``."""
        from hvtrace.analysis import analyze

        return cls.from_analysis(run, analyze(run, **analyze_kw))

    @classmethod
    def from_analysis(cls, run: Run, a: Any) -> DashboardData:
        """Keep the tables of an :class:`hvtrace.analysis.Analysis` of ``run`` for the page.

        Only reshaping happens here (rank x step arrays, column picks, formatting), plus the
        header's run-level medians of the analyzer's per-step table (see ``_headline``). The
        timeline's spans are read from ``run``'s files per window (:func:`run_window`).
        """
        st = a.steps
        heat = _heat_tables(st)
        labels = {
            "lateness": "arrival lateness",
            "step": "step time",
            "compute": "compute time (forward + backward)",
        }
        heat = {k: heat[k] for k in labels if k in heat}  # lateness first: stragglers stand out
        first, last, count = a.analyzed_step_numbers
        per_step = a.per_step
        analyzed = per_step[(per_step["step"] >= first) & (per_step["step"] <= last)]
        head = a.run_row
        n_steps = int(st["step"].nunique()) if len(st) else 0
        n_strag = len(a.stragglers) + len(a.slow_hosts)
        summary = {
            "ranks": f"{len(a.ranks)}" + (f" of {a.size}" if len(a.ranks) != a.size else ""),
            "hosts": str(len(set(a.hosts.values()))),
            "steps": str(n_steps),
            "median step": _fmt(head.get("step_ms"), " ms"),
            "comm/compute": _fmt(head.get("comm_compute_ratio"), "", ".2f"),
            "overlap": _fmt(head.get("overlap"), "", ".0%"),
            "busbw": _fmt(head.get("busbw_gbps"), " GB/s", ".2f"),
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
        per_rank = a.per_rank[["rank", "host", "comm_compute_ratio"]].copy()
        late = a.verdicts.set_index("rank")["late_ms"] if "late_ms" in a.verdicts else None
        per_rank.insert(2, "late_ms", per_rank["rank"].map(late) if late is not None else np.nan)
        last_step = int(st["step"].max()) if len(st) else 0
        total = a.read.get("spans_total") or sum(int(f.n_spans) for f in run.files.values())
        cells = max(1, len(a.ranks) * (last_step + 1))
        return cls(
            run_id=a.run_id or run.run_id,
            run_dir=str(run.run_dir),
            window=run_window(run),
            hosts=dict(a.hosts),
            ranks=list(a.ranks),
            last_step=last_step,
            summary=summary,
            findings=[("⚠ " if f.severity == "warning" else "") + f.message for f in a.findings],
            heat=heat,
            heat_labels={k: labels[k] for k in heat},
            heat_units={k: "ms" for k in heat},
            per_rank=per_rank,
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
            membership=list(getattr(a, "membership", []) or []),
            clock_note=" · ".join(notes),
            t0_ns=int(st["start_ns"].min()) if len(st) else 0,
            spans_per_rank_step=total / cells,
        )


def default_timeline_ranks(
    ranks: list[int],
    per_rank: pd.DataFrame | None,
    stragglers: Sequence[int] = (),
    limit: int = TIMELINE_RANKS,
    subset: int = TIMELINE_SUBSET,
) -> list[int]:
    """Return the timeline's rows when no rank is picked: every rank up to ``limit``; beyond,
    ``subset`` ranks: rank 0, the stragglers and the ranks with the largest median lateness
    (``late_ms`` of ``per_rank``; without it, the first ranks), sorted."""
    if len(ranks) <= limit:
        return list(ranks)
    limit = subset
    chosen = [r for r in (ranks[0], *stragglers) if r in set(ranks)]
    order: list[int] = list(ranks)
    if per_rank is not None and "late_ms" in per_rank and per_rank["late_ms"].notna().any():
        by_late = per_rank.sort_values("late_ms", ascending=False, na_position="last")
        order = [int(r) for r in by_late["rank"]] + order
    for r in order:
        if len(chosen) >= limit:
            break
        if r not in chosen:
            chosen.append(r)
    return sorted(chosen[:limit])


def _heat_tables(st: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Rank x step tables (ms, float32) of step time, compute time and arrival lateness, built
    by indexing (a pivot of millions of rows takes seconds)."""
    if st.empty:
        return {}
    # factorize (hashing) rather than np.unique (sorting): 5 M rows in a tenth of the time
    ri, ranks = pd.factorize(st["rank"].to_numpy(), sort=True)
    si, steps = pd.factorize(st["step"].to_numpy(), sort=True)
    out: dict[str, pd.DataFrame] = {}
    cols = {"step": "step_ns", "compute": "model_ns", "lateness": "lateness_ns"}
    for key, col in cols.items():
        if col not in st:
            continue
        v = st[col].to_numpy(dtype=np.float64, na_value=np.nan)
        if key == "lateness" and not np.isfinite(v).any():
            continue
        z = np.full((len(ranks), len(steps)), np.nan, np.float32)
        z[ri, si] = v / 1e6
        out[key] = pd.DataFrame(
            z, index=pd.Index(ranks, name="rank"), columns=pd.Index(steps, name="step")
        )
    return out


def _fmt(x: Any, unit: str = "", spec: str = ".1f") -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "—"
    if x != x:  # NaN
        return "—"
    return f"{x:{spec}}{unit}"


def _data_of(look: Any, follower: Any) -> DashboardData | None:
    """The page's data of a look at a followed run; None when it has no complete step yet."""
    try:
        a = follower.analyze(look)
    except TraceError:
        if look.live:
            return None
        raise
    data = DashboardData.from_analysis(look.run, a)
    return data if data.has_steps else None


#: The columns of the analysis's step table the page reads (the rest stays on disk), and the
#: narrower types it reads some as (it draws milliseconds: float32 is plenty).
PAGE_STEP_COLUMNS = ["rank", "step", "start_ns", "step_ns", "model_ns", "lateness_ns", "complete"]
PAGE_STEP_TYPES = {
    "rank": "int32",
    "step": "int32",
    "step_ns": "float32",
    "model_ns": "float32",
    "lateness_ns": "float32",
}
#: Runs of more spans than this are analyzed in a child process when not saved yet (the server
#: then holds only what the page shows, not the analysis's peak); smaller ones in this one.
CHILD_ANALYSIS_SPANS = 2_000_000


def _saved_data(run: Run, spans: int) -> DashboardData | None:
    """The page's data of a finished ``run`` from its saved analysis
    (:mod:`hvtrace.analysis.saved`): read if kept, else made (in a child process for a run of
    more than :data:`CHILD_ANALYSIS_SPANS` spans) and kept. None when the cache is off or
    unusable, or the run has no complete step: the caller analyzes it here."""
    from hvtrace.analysis import saved

    key = saved.default_key(run)
    if key is None or saved.cache_dir() is None:
        return None
    a = saved.load_analysis(key, PAGE_STEP_COLUMNS, PAGE_STEP_TYPES)
    if a is None:
        if spans > CHILD_ANALYSIS_SPANS:
            if not _analyze_in_child(run, key):
                return None
            a = saved.load_analysis(key, PAGE_STEP_COLUMNS, PAGE_STEP_TYPES)
        else:
            from hvtrace.analysis import analyze

            a = analyze(run)
            saved.save_analysis(a, key)
    if a is None:
        return None
    log.info("analysis of run %s: saved (%s)", run.run_id, key)
    data = DashboardData.from_analysis(run, a)
    return data if data.has_steps else None


def _analyze_in_child(run: Run, key: str) -> bool:
    """Analyze ``run`` in a child process that keeps the analysis under ``key``; whether it did
    (a child that failed, or found other files than ``key`` names, did not)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ranks = sorted(run.selected_ranks) if run.selected_ranks is not None else None
    child = ctx.Process(
        target=_child_analysis,
        args=(str(run.run_dir), str(run.run_id), ranks, key),
        name="hvtrace-dashboard-analysis",
    )
    child.start()
    try:
        child.join()
    except BaseException:
        child.terminate()
        child.join()
        raise
    if child.exitcode != 0:
        log.warning("hvtrace dashboard: the analysis process ended with %s", child.exitcode)
    return child.exitcode == 0


def _child_analysis(run_dir: str, run_id: str, ranks: list[int] | None, key: str) -> None:
    """The child of :func:`_analyze_in_child`: open the run again, analyze it, keep it."""
    from hvtrace.analysis import analyze, saved
    from hvtrace.load import open_run

    try:
        run = open_run(run_dir, run_id=run_id, ranks=None if ranks is None else frozenset(ranks))
        if saved.default_key(run) != key:  # the files changed since the parent opened them
            sys.exit(3)
        if saved.save_analysis(analyze(run), key) is None:
            sys.exit(4)
    except Exception as exc:  # noqa: BLE001 - the parent analyzes the run itself
        print(f"hvtrace dashboard: analysis process: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)


_LAYOUT_LOCK = threading.Lock()


class _PageDash(Dash):
    """Dash, with the layout's JSON made once: the page's layout is built at start and never
    changes (each figure's arrays are encoded once, not on every page load). For a live run
    (``live_feed``) the layout is built again, once, after each refresh, when a page asks."""

    _layout_json: str | None = None
    live_feed: Any = None
    _layout_version: int = 0

    def encode_layout(self) -> None:
        """Encode the layout now (``create_app`` does: the first page load does not wait)."""
        from plotly.io.json import to_json_plotly

        self._layout_json = to_json_plotly(self.get_layout())

    def serve_layout(self) -> Any:
        """Return the layout as JSON (encoded once per version of the data)."""
        feed = self.live_feed
        with _LAYOUT_LOCK:  # pages loading at once build a new version's layout once
            if feed is not None and feed.version != self._layout_version:
                status, data = feed.snapshot()
                self.layout = page_layout(data, status)
                self._layout_version = status["version"]
                self._layout_json = None
            if self._layout_json is None:
                self.encode_layout()
            body = self._layout_json
        return self.backend.make_response(body, mimetype="application/json")


def page_layout(data: DashboardData, live: dict[str, Any] | None = None) -> Any:
    """The page of ``data`` with its first figures (every heat-map metric made ahead, so a switch
    costs no binning); ``live``: :meth:`hvtrace_dashboard.live.LiveFeed.status` of a live run."""
    size = data.initial_size()
    start, focus = data.initial_window(), data.focus_step
    if live is not None:
        from hvtrace_dashboard.live import REFRESH_MS

        live = dict(live, refresh_ms=REFRESH_MS)
        # a live page opens on the latest steps (the slowest step may be long past)
        start, focus = max(0, data.last_step - size + 1), None
    for metric in data.heat:
        data.heatmap(metric)
    initial = {
        "metric": next(iter(data.heat), ""),
        "timeline": data.timeline(start, size, None, focus),
        **{k: data.figure(k) for k in ("heatmap", "ratio_rank", "ratio_steps", "tensors")},
        "start": start,
        "size": size,
        "focus": focus,
    }
    return build_layout(data, initial, live)


#: The largest request body the dashboard reads (its callbacks send a few hundred bytes).
MAX_REQUEST_BYTES = 1 << 20


def create_app(run: Run, data: DashboardData | None = None, feed: Any = None) -> Dash:
    """Return the Dash app showing ``run`` (analyzed now unless ``data`` is given); ``feed``: a
    :class:`hvtrace_dashboard.live.LiveFeed` for a run still being written (its data is shown,
    and the page follows it)."""
    if feed is not None:
        data = feed.data
    if data is None:
        data = DashboardData.from_run(run)
    app = _PageDash(
        __name__,
        title=f"hvtrace · {html.escape(printable(data.run_id))}",  # Dash writes it as raw HTML
        update_title=None,
        serve_locally=True,
        assets_ignore=".*",
    )
    app.index_string = INDEX_STRING
    # the page's requests are a click or a control's value; a bigger body is refused (413)
    # before it is read, so that no request can grow the server (a 300 MB body grew it 1.2 GB)
    app.server.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    _serve_partial_plotly(app)
    if feed is not None:
        status = feed.status()
        app.layout = page_layout(data, status)
        app.live_feed, app._layout_version = feed, status["version"]
        callbacks.register(app, lambda: feed.data, feed)
    else:
        app.layout = page_layout(data)
        callbacks.register(app, lambda: data)
    app.encode_layout()
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


def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback only (``localhost``, ``127.x``, ``::1``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def _run_app(app: Dash, host: str, port: int, verbose: bool) -> int:
    """Serve ``app`` until Ctrl-C (quiet unless ``verbose``: no per-request lines, no second
    "running on" line); an address that cannot be served is one line."""
    if not verbose:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        logging.getLogger("dash.dash").setLevel(logging.WARNING)
    try:
        app.run(host=host, port=port, debug=False, dev_tools_ui=False)
    except OSError as exc:
        raise TraceError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return 0


def saved_or_analyzed(run: Run) -> Any:
    """The analysis of a finished ``run`` with the default options: its saved one
    (:mod:`hvtrace.analysis.saved`), else made here and kept."""
    from hvtrace.analysis import analyze, saved

    key = saved.default_key(run)
    a = saved.load_analysis(key)
    if a is None:
        a = analyze(run)
        saved.save_analysis(a, key)
    return a


def open_analyses(runs: Iterable[tuple[str, str | Path]]) -> list[Any]:
    """Open each ``(label, run directory)``, say so, log its problems, and return each run's
    analysis, read from its saved analysis when it has one (the compare and scaling pages)."""
    from hvtrace.load import open_run

    analyses = []
    for label, d in runs:
        if not Path(d).exists():
            raise TraceError(f"{d}: no such directory")
        run = open_run(d)
        print(printable(f"hvtrace dashboard: {label}: {run.run_id} ({d}) ..."), flush=True)
        for msg in run.problems:
            log.warning("%s", msg)
        analyses.append(saved_or_analyzed(run))
    return analyses


def serve_compare(
    run_a: str | Path, run_b: str | Path, host: str, port: int, verbose: bool = False
) -> int:
    """Serve the compare page of two runs (:mod:`hvtrace_dashboard.compare`) until Ctrl-C."""
    from hvtrace_dashboard.compare import create_compare_app

    from hvtrace.analysis.diff import diff_runs

    t0 = time.perf_counter()
    analyses = open_analyses([("run A", run_a), ("run B", run_b)])
    app = create_compare_app(diff_runs(*analyses))
    url = f"http://{host}:{port}/"
    print(
        printable(
            f"hvtrace dashboard: {run_a} vs {run_b} ready in {time.perf_counter() - t0:.1f} s "
            f"on {url}  (Ctrl-C to stop)"
        ),
        flush=True,
    )
    return _run_app(app, host, port, verbose)


def serve(
    run_dir: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8050,
    run_id: str | None = None,
    verbose: bool = False,
    compare: str | Path | None = None,
    scaling: Sequence[str | Path] | None = None,
) -> int:
    """Open and analyze the run (no ``run_dir``: the built-in sample), then serve it until
    Ctrl-C (``compare``: another run, served side by side with it: :func:`serve_compare`;
    ``scaling``: more runs of the job at other world sizes, served as where scaling is lost:
    :func:`hvtrace_dashboard.scaling.serve_scaling`).
    The run is analyzed on the engine (its spans are never loaded as one table), so a run
    of any size opens. A run still being written (a rank's stream open and growing) is followed:
    the page refreshes as the files grow (:mod:`hvtrace_dashboard.live`); with no complete step
    yet, the command waits for the first one. Errors in the input or the address raise
    :class:`TraceError` (one line).
    """
    run_dir = Path(run_dir) if run_dir else sample_run_dir()
    if not run_dir.exists():
        raise TraceError(f"{run_dir}: no such directory")
    if not 0 <= port <= 65535:
        raise TraceError(f"--port {port} is not a port number")
    _check_can_listen(host, port)
    if not _loopback(host):
        log.warning(
            "hvtrace dashboard: listening on %s, not on this machine's loopback: anyone who can "
            "reach it on port %d can read this run (names, hosts, timings); there is no login",
            "every interface" if host in ("0.0.0.0", "::", "") else host,
            port,
        )
    if compare is not None:
        return serve_compare(run_dir, compare, host, port, verbose)
    if scaling:
        from hvtrace_dashboard.scaling import serve_scaling

        return serve_scaling([run_dir, *scaling], host, port, verbose)
    t0 = time.perf_counter()
    from hvtrace_dashboard.live import POLL_S, LiveFeed

    from hvtrace.follow import RunFollower

    follower = RunFollower(run_dir, run_id=run_id)
    look = follower.look()
    run = look.run
    spans = sum(int(f.n_spans) for f in run.files.values())
    print(
        printable(
            f"hvtrace dashboard: analyzing run {run.run_id} ({len(run.ranks)} rank(s), "
            f"{spans:,} spans{', live' if look.live else ''}) ..."
        ),
        flush=True,
    )
    for msg in look.problems:
        log.warning("%s", msg)
    data = None if look.live else _saved_data(run, spans)
    said = False
    while data is None:
        data = _data_of(look, follower)
        if data is not None or not look.live:
            break
        if not said:
            print("hvtrace dashboard: the run is live, no step complete yet: waiting", flush=True)
            said = True
        time.sleep(POLL_S)
        look = follower.look()
    if data is None:
        raise TraceError(f"{run_dir}: the run has no completed step to show")
    feed = None
    if look.live:
        feed = LiveFeed(
            follower, data, look, make=lambda lk, a: DashboardData.from_analysis(lk.run, a)
        )
        feed.start()
    else:
        follower.close()
    app = create_app(run, data=data, feed=feed)
    log.info("analysis and first figures: %.2f s", time.perf_counter() - t0)
    url = f"http://{host}:{port}/"
    print(
        printable(
            f"hvtrace dashboard: run {run.run_id} ({run_dir}) ready in "
            f"{time.perf_counter() - t0:.1f} s on {url}  (Ctrl-C to stop)"
        )
    )
    sys.stdout.flush()
    return _run_app(app, host, port, verbose)
