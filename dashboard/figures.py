"""Figures of the dashboard: pure functions from DataFrames to plotly Figures.

No function here computes a metric: the numbers come from :mod:`hvtrace.analysis` (through
:class:`hvtrace_dashboard.app.DashboardData`) or, for the timeline, from the spans of its window.
Every figure stays small enough for the browser on runs of any size: the heat map bins steps into
at most ``max_cols`` columns (fewer with many ranks: ``max_cells``), the per-step lines bin steps
beyond ``max_points``, the per-rank chart has one bar per rank, the timeline draws each span kind
as one SVG line trace (gaps between bars) and merges or cuts spans beyond ``max_spans``, and
per-tensor charts show at most ``max_tensors`` bars each. A binned figure says so in its title.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from dash import Dash
from plotly.subplots import make_subplots

from hvtrace.units import format_bytes, printable

#: Colour of each span kind in the timeline (and its legend order).
KIND_COLORS: dict[str, str] = {
    "step": "#b0b0b0",
    "input": "#8c564b",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "compute": "#17becf",
    "allreduce": "#ff7f0e",
    "wait": "#d62728",
    "update": "#9467bd",
    "user": "#e377c2",
}
#: Lane of each kind inside a rank's row, as (top, bottom) offsets from the row centre.
_LANES: dict[str, tuple[float, float]] = {
    "step": (-0.42, -0.34),
    "user": (-0.30, -0.22),
    "input": (-0.18, 0.02),
    "forward": (-0.18, 0.02),
    "backward": (-0.18, 0.02),
    "compute": (-0.18, 0.02),
    "wait": (-0.18, 0.02),
    "update": (-0.18, 0.02),
    "allreduce": (0.08, 0.42),
}
#: Spans the timeline draws at most (above: allreduces merged per rank and step, then cut).
MAX_TIMELINE_SPANS = 10_000
#: Thinnest allreduce sub-lane (px) drawn per tensor; below it allreduces are merged per step.
MIN_LANE_PX = 1.0
#: Points per line at most in the per-step charts (above: steps are binned).
MAX_LINE_POINTS = 4_000
#: Ranks drawn as bars in the per-rank chart at most (above: one filled step line).
MAX_RANK_BARS = 64
#: Heat-map columns at most (above: steps are binned).
MAX_HEATMAP_COLS = 500
#: Heat-map cells at most: with many ranks, steps are binned into fewer columns (at least
#: ``MIN_HEATMAP_COLS``), so that a 512-rank run sends and draws about as much as a 200-rank one.
MAX_HEATMAP_CELLS = 100_000
MIN_HEATMAP_COLS = 100
#: Heat-map rows at most (the map is at most 720 px high): above, consecutive ranks share a row,
#: which shows the worst of them (a straggler among many still stands out).
MAX_HEATMAP_ROWS = 600


def _template() -> go.layout.Template:
    """Return plotly_white with tick labels drawn as they are (``ticklabeloverflow="allow"``).

    Plotly's default ("hide past div") measures every tick label's box in the browser, which cost
    a fifth of a second on the first render of a 64-rank run; the margins leave room anyway.
    """
    import plotly.io as pio

    t = go.layout.Template(pio.templates["plotly_white"])
    t.layout.xaxis.ticklabeloverflow = "allow"
    t.layout.yaxis.ticklabeloverflow = "allow"
    return t


_TEMPLATE = _template()
_FONT = {"family": "Inter, Segoe UI, Helvetica, Arial, sans-serif", "size": 12}
_MARGIN = {"l": 70, "r": 20, "t": 50, "b": 40}


def _base_layout(title: str, height: int) -> dict[str, Any]:
    return {
        "title": {"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        "height": height,
        "margin": _MARGIN,
        "font": _FONT,
        "template": _TEMPLATE,
    }


def empty_figure(message: str, height: int = 260) -> go.Figure:
    """Return a figure that only says ``message`` (no data to draw)."""
    fig = go.Figure()
    fig.update_layout(**_base_layout("", height))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(
        text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font_size=14
    )
    return fig


def esc(text: object) -> str:
    """Text from a trace file (a name, a host) made safe to show in a figure: plotly reads a
    subset of HTML in labels and hover text, so ``<``, ``>`` and ``&`` are escaped and the name
    is shown as it is, never as markup (quotes are not: plotly shows ``&quot;`` as it is
    written, and without ``<`` no attribute can be opened); control and bidirectional
    characters (U+202E would reverse the text around it) are shown as visible escapes
    (:func:`hvtrace.units.printable`)."""
    return html.escape(printable(text), quote=False)


def rank_labels(ranks: Sequence[int], hosts: dict[int, str] | None = None) -> list[str]:
    """Return row labels "rank N" (with the host when several hosts are involved)."""
    hosts = hosts or {}
    multi = len({hosts.get(r) for r in ranks}) > 1
    return [f"{r} · {esc(hosts.get(r, '?'))}" if multi else f"rank {r}" for r in ranks]


# -- heat map -----------------------------------------------------------------------------------


def _bin_width(n: int, max_bins: int) -> int:
    """Return how many consecutive steps go into one bin so that ``n`` fit in ``max_bins``."""
    return int(np.ceil(n / max_bins))


def _bins(a: np.ndarray, width: int, fill: float) -> np.ndarray:
    """Return ``a`` with its last axis padded with ``fill`` and cut into bins of ``width``."""
    nb = -(-a.shape[-1] // width)
    pad = [(0, 0)] * (a.ndim - 1) + [(0, nb * width - a.shape[-1])]
    return np.pad(a, pad, constant_values=fill).reshape(*a.shape[:-1], nb, width)


def heatmap_figure(
    values: pd.DataFrame,
    title: str,
    unit: str = "ms",
    hosts: dict[int, str] | None = None,
    highlight_ranks: Sequence[int] = (),
    max_cols: int = MAX_HEATMAP_COLS,
    colorscale: str = "YlOrRd",
    max_cells: int = MAX_HEATMAP_CELLS,
    max_rows: int = MAX_HEATMAP_ROWS,
) -> go.Figure:
    """Return a rank x step heat map of ``values`` (index: rank, columns: step, cells: a number).

    More than ``max_cols`` steps (or than ``max_cells`` cells over all ranks, keeping at least
    ``MIN_HEATMAP_COLS`` columns) are binned (mean per bin; the title and x axis say so); each
    cell's ``customdata`` is the step to open when it is clicked (the cell's own step, or the
    bin's worst step for that rank). The
    colour range ignores the first step and the extreme cells (top 2 %, 0.5 % from 1,000 cells,
    at most half a row's worth with many ranks, so that one straggler of 512 still sets the top)
    so that one warm-up step or one hiccup does not wash out the rest; hover shows the true
    value. ``highlight_ranks`` are marked on the y axis (their label is always a tick). More
    than ``max_rows`` ranks are binned too: consecutive ranks share a row showing the worst
    (largest) of their cells, and its step on click (the title says so).
    """
    if values is None or values.empty or values.shape[1] == 0:
        return empty_figure("no per-step data to show")
    values = values.sort_index().sort_index(axis=1)
    ranks = [int(r) for r in values.index]
    steps = np.asarray(values.columns, dtype=np.int64)
    z = values.to_numpy(dtype=np.float64)
    ncol = z.shape[1]
    max_cols = min(max_cols, max(MIN_HEATMAP_COLS, max_cells // max(1, min(len(ranks), max_rows))))
    if ncol > max_cols:
        width = _bin_width(ncol, max_cols)
        zp = _bins(z, width, np.nan)
        sp = _bins(steps, width, -1)
        with np.errstate(all="ignore"):
            zbin = np.nanmean(zp, axis=2)
        filled = np.where(np.isnan(zp), -np.inf, zp)
        worst = np.take_along_axis(
            np.broadcast_to(sp, zp.shape), filled.argmax(axis=2)[..., None], axis=2
        )[..., 0]
        x = sp[:, 0]
        custom = worst
        z = zbin
        xtitle = f"step ({width} steps per column, mean)"
        where = f"{width} steps from step %{{x}} (worst: step %{{customdata}})"
        title += f" · binned: mean of {width} steps per column"
    else:
        x = steps
        custom = np.broadcast_to(steps, z.shape)
        xtitle = "step"
        where = "step %{x}"
    hl = set(int(r) for r in highlight_ranks)
    rows = [[r] for r in ranks]
    if len(ranks) > max_rows:  # ranks binned: each row the worst of its ranks
        rw = _bin_width(len(ranks), max_rows)
        zt = _bins(np.ascontiguousarray(z.T), rw, np.nan)
        ct = _bins(np.ascontiguousarray(np.broadcast_to(custom, z.shape).T), rw, -1)
        pick = np.where(np.isnan(zt), -np.inf, zt).argmax(axis=2)[..., None]
        z = np.take_along_axis(zt, pick, axis=2)[..., 0].T
        custom = np.take_along_axis(ct, pick, axis=2)[..., 0].T
        rows = [ranks[i : i + rw] for i in range(0, len(ranks), rw)]
        title += f" · ranks binned: the worst of {rw} ranks per row"
    scale = z[:, 1:] if z.shape[1] > 2 else z
    finite = scale[np.isfinite(scale)]
    zmin = zmax = None
    if finite.size:
        # clip fewer extreme cells than half a row holds: one slow rank of many sets the top
        q_hi = max(0.98 if finite.size < 1000 else 0.995, 1 - 0.5 / len(rows))
        lo, hi = np.quantile(finite, [0.005, q_hi]) if finite.size >= 50 else (None, None)
        zmin = float(lo) if lo is not None else float(finite.min())
        zmax = float(hi) if hi is not None else float(finite.max())
        if zmax <= zmin:
            zmax = zmin + 1e-9
    if all(len(g) == 1 for g in rows):
        base = rank_labels(ranks, hosts)
    else:
        base = [f"ranks {g[0]}–{g[-1]}" for g in rows]
    labels = [f"{lab} ◀" if hl & set(g) else lab for g, lab in zip(rows, base)]
    fig = go.Figure(
        go.Heatmap(
            z=z.astype(np.float32),
            x=x,
            y=labels,
            customdata=np.ascontiguousarray(custom, dtype=np.int32),
            zmin=zmin,
            zmax=zmax,
            colorscale=colorscale,
            colorbar={"title": {"text": unit, "side": "right"}, "thickness": 12},
            hovertemplate="%{y}<br>"
            + where
            + "<br>%{z:.3f} "
            + unit
            + "<extra>click: open timeline</extra>",
            hoverongaps=False,
        )
    )
    height = int(min(720, max(260, 110 + 16 * len(rows))))
    fig.update_layout(**_base_layout(title, height))
    every = max(1, int(np.ceil(len(rows) / 40)))
    marked = {i for i, g in enumerate(rows) if hl & set(g)}
    near = {j for i in marked for j in range(i - every // 2, i + every // 2 + 1)}  # no overlap
    ticks = sorted({i for i in range(0, len(rows), every) if i not in near} | marked)
    fig.update_yaxes(
        type="category",
        tickvals=[labels[i] for i in ticks],
        ticktext=[labels[i] for i in ticks],
        autorange="reversed",
        title=None,
    )
    fig.update_xaxes(title=xtitle, showgrid=False)
    return fig


# -- timeline -----------------------------------------------------------------------------------


def _merge_allreduces(spans: pd.DataFrame) -> pd.DataFrame:
    """Replace each rank/step/micro's allreduce spans by one envelope span ("N tensors")."""
    ar = spans["kind"] == "allreduce"
    if not ar.any():
        return spans
    keys = ["rank", "step", "micro"] if "micro" in spans else ["rank", "step"]
    g = spans[ar].groupby(keys, observed=True, sort=False)
    merged = g.agg(
        start_ns=("start_ns", "min"),
        end_ns=("end_ns", "max"),
        bytes=("bytes", "sum"),
        n=("start_ns", "size"),
    ).reset_index()
    merged["kind"] = "allreduce"
    merged["name"] = merged["n"].map(lambda n: f"{n} tensors (merged)")
    merged["dtype"] = ""
    rest = spans[~ar]
    cols = [*keys, "kind", "name", "start_ns", "end_ns", "bytes", "dtype"]
    out = pd.concat(
        [rest[cols].astype({"kind": str, "name": str, "dtype": str}), merged[cols]],
        ignore_index=True,
    )
    return out


def _bar_trace(
    kind: str,
    color: str,
    width: float,
    x0: np.ndarray,
    x1: np.ndarray,
    y: np.ndarray,
    names: np.ndarray,
    dtypes: np.ndarray,
    ranks: np.ndarray,
    steps: np.ndarray,
    dur_ms: np.ndarray,
    nbytes: np.ndarray,
) -> go.Scatter:
    """Return one kind's bars as one SVG line trace: start, middle, end, gap for each bar.

    One ``<path>`` per kind draws thousands of bars faster than bars, shapes or a WebGL context
    (which costs seconds in a browser without a GPU). Each bar's three points carry its hover:
    the name in ``text`` (for an allreduce: tensor, dtype and size, as :func:`format_bytes`
    writes it), and rank, step, duration (ms) and bytes in ``customdata``.
    """
    n = len(x0)
    lx = np.empty(4 * n)
    lx[0::4], lx[1::4], lx[2::4], lx[3::4] = x0, (x0 + x1) / 2, x1, np.nan
    ly = np.repeat(y, 4)
    ly[3::4] = np.nan
    if kind == "allreduce":
        sizes, which = np.unique(nbytes, return_inverse=True)  # few sizes: format each once
        size = np.asarray([format_bytes(b) for b in sizes], dtype=object)[which.reshape(-1)]
        label = [
            f"{nm} · {dt} · {sz}" if dt else f"{nm} · {sz}"
            for nm, dt, sz in zip(names, dtypes, size)
        ]
    else:
        label = [str(nm) for nm in names]
    text = np.repeat(np.asarray(label, dtype=object), 4)
    text[3::4] = ""
    custom = np.repeat(np.column_stack([ranks, steps, dur_ms, nbytes]).astype(np.float32), 4, 0)
    hover = f"<b>{kind}</b> %{{text}}<br>rank %{{customdata[0]}} · step %{{customdata[1]}}"
    hover += "<br>%{customdata[2]:.3f} ms"
    return go.Scatter(
        x=lx,
        y=ly,
        mode="lines",
        line={"color": color, "width": width, "simplify": True},
        name=kind,
        legendgroup=kind,
        text=text,
        customdata=custom,
        hovertemplate=hover + "<extra></extra>",
        connectgaps=False,
    )


def timeline_figure(
    spans: pd.DataFrame,
    ranks: Sequence[int] | None = None,
    t0_ns: int | None = None,
    title: str = "Timeline",
    hosts: dict[int, str] | None = None,
    max_spans: int = MAX_TIMELINE_SPANS,
    focus_step: int | None = None,
) -> go.Figure:
    """Return a timeline of ``spans``: one row per rank, bars coloured by kind.

    ``spans`` has the columns of :attr:`hvtrace.load.Run.spans` (already cut to the window and
    ranks to show); ``ranks`` fixes the rows (default: the ranks present). x is seconds since
    ``t0_ns`` (default: the first span). Each kind is one line trace whose bars are separated by
    gaps (see :func:`_bar_trace`); hover shows name, tensor, rank, step, duration and bytes.
    Beyond ``max_spans`` spans, or when one sub-lane per tensor would be thinner than
    ``MIN_LANE_PX`` (many ranks shown), allreduces are merged per rank and step; beyond
    ``max_spans`` the latest spans are then cut; the title says so. ``focus_step``'s extent is
    shaded.
    """
    spans = spans[spans["kind"].isin(list(KIND_COLORS))] if len(spans) else spans
    if ranks is None:
        ranks = sorted(int(r) for r in spans["rank"].unique()) if len(spans) else []
    ranks = [int(r) for r in ranks]
    if not len(spans) or not ranks:
        return empty_figure("no spans in this window for the selected ranks")
    note = ""
    nrows = len(ranks)
    row_px = int(max(16, min(64, 720 // nrows)))
    top, bot = _LANES["allreduce"]
    tensors = spans.loc[spans["kind"] == "allreduce", "name"].nunique()
    if len(spans) > max_spans or (bot - top) * row_px < MIN_LANE_PX * tensors:
        # too many bars, or one line per tensor would be thinner than a pixel: one bar per step
        spans = _merge_allreduces(spans)
        note = " · allreduces merged per step"
        if len(spans) > max_spans:
            spans = spans.nsmallest(max_spans, "start_ns")
            note += f" · cut to the first {max_spans:,} spans"
    if t0_ns is None:
        t0_ns = int(spans["start_ns"].min())
    row_of = {r: i for i, r in enumerate(ranks)}
    height = 120 + nrows * row_px
    rows = spans["rank"].map(row_of).to_numpy(dtype=np.float64)
    kinds = spans["kind"].astype(str).to_numpy()
    start = spans["start_ns"].to_numpy(dtype=np.int64)
    end = spans["end_ns"].to_numpy(dtype=np.int64)
    names = np.array([esc(n) for n in spans["name"].astype(str)], dtype=object)
    nbytes = spans["bytes"].to_numpy(dtype=np.int64)
    dtypes = spans["dtype"].astype(str).to_numpy() if "dtype" in spans else np.full(len(spans), "")
    stepcol = spans["step"].to_numpy(dtype=np.int64)
    xs = (start - t0_ns) / 1e9
    xe = (np.maximum(end, start) - t0_ns) / 1e9
    fig = go.Figure()
    for kind, color in KIND_COLORS.items():
        m = kinds == kind
        n = int(m.sum())
        if not n:
            continue
        top, bot = _LANES[kind]
        y = rows[m]
        if kind == "allreduce":
            # one sub-lane per tensor so that overlapping allreduces show, tensors ordered by their
            # earliest arrival in the window (gradient-ready order)
            first = pd.Series(start[m]).groupby(names[m]).min().sort_values()
            lane_of = {n: i for i, n in enumerate(first.index)}
            order = np.fromiter((lane_of[n] for n in names[m]), np.int64, n)
            lanes = max(1, len(lane_of))
            y = y + top + (bot - top) * (order + 0.5) / lanes
            width = max(1.0, 0.8 * (bot - top) * row_px / lanes)
        else:
            y = y + (top + bot) / 2
            width = max(1.5, 0.9 * (bot - top) * row_px)
        fig.add_trace(
            _bar_trace(
                kind,
                color,
                width,
                xs[m],
                xe[m],
                y,
                names[m],
                dtypes[m],
                np.asarray(ranks, np.int64)[rows[m].astype(np.int64)],
                stepcol[m],
                (end[m] - start[m]) / 1e6,
                nbytes[m],
            )
        )
    if focus_step is not None:
        f = stepcol == focus_step
        if f.any():
            fig.add_vrect(
                x0=float(xs[f].min()),
                x1=float(xe[f].max()),
                fillcolor="#fff3c4",
                opacity=0.45,
                line_width=0,
                layer="below",
            )
    plot_px = nrows * row_px
    fig.update_layout(
        **_base_layout(title + note, height + 40),
        hovermode="closest",
        legend={
            "orientation": "h",
            "y": -58 / plot_px,  # below the x axis title, whatever the number of rows
            "yanchor": "top",
            "x": 0,
            "xanchor": "left",
        },
        uirevision=f"{title}|{','.join(map(str, ranks))}",
    )
    fig.update_layout(margin={**_MARGIN, "b": 80})
    fig.update_yaxes(
        tickvals=list(range(nrows)),
        ticktext=rank_labels(ranks, hosts),
        range=[nrows - 0.5, -0.5],
        showgrid=False,
        zeroline=False,
        fixedrange=True,
    )
    pad = (float(xe.max()) - float(xs.min())) * 0.01
    fig.update_xaxes(
        title="time since run start (s, rank 0's clock)",
        range=[float(xs.min()) - pad, float(xe.max()) + pad],
        showgrid=True,
        zeroline=False,
    )
    return fig


# -- comm/compute and tensors ---------------------------------------------------------------------


def per_rank_figure(
    per_rank: pd.DataFrame,
    rows: dict[str, tuple[str, str]] | None = None,
    title: str = "Per rank (median over the analyzed steps)",
    highlight_ranks: Sequence[int] = (),
    hosts: dict[int, str] | None = None,
) -> go.Figure:
    """Return one bar row per entry of ``rows`` ({column: (label, unit)}) of ``per_rank`` (one
    row per rank: a ``rank`` column or index), sharing the rank axis; ``highlight_ranks`` (the
    stragglers) are red. Default row: ``comm_compute_ratio``. Columns missing or all NaN are
    left out. With many ranks the bars touch (one bar per rank, however many: a per-rank
    summary stays one value per rank), so a straggler is a red spike.
    """
    rows = rows or {"comm_compute_ratio": ("comm/compute", "ratio")}
    if per_rank is None or per_rank.empty:
        return empty_figure("no per-rank data")
    df = per_rank.reset_index() if "rank" not in per_rank.columns else per_rank
    rows = {c: v for c, v in rows.items() if c in df and df[c].notna().any()}
    if not rows:
        return empty_figure("no per-rank data")
    df = df.sort_values("rank")
    ranks = df["rank"].astype(int).to_numpy()
    hl = set(int(r) for r in highlight_ranks)
    colors = ["#d62728" if r in hl else "#1f77b4" for r in ranks]
    hosts = hosts or {}
    host_text = [esc(hosts.get(int(r), "")) for r in ranks]
    many = len(ranks) > MAX_RANK_BARS
    fig = make_subplots(
        rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.12 if len(rows) > 1 else 0
    )
    for i, (col, (label, unit)) in enumerate(rows.items(), start=1):
        y = df[col].to_numpy(dtype=np.float64)
        hover = f"rank %{{x}} %{{customdata}}<br>%{{y:.3f}} {unit}<extra>{label}</extra>"
        if many:  # one filled step line: a path, where hundreds of bars take the browser long
            fig.add_trace(
                go.Scatter(
                    x=ranks,
                    y=y,
                    mode="lines",
                    line={"shape": "hvh", "width": 1, "color": "#1f77b4"},
                    fill="tozeroy",
                    customdata=host_text,
                    name=label,
                    hovertemplate=hover,
                ),
                row=i,
                col=1,
            )
            m = np.isin(ranks, list(hl))
            if m.any():
                fig.add_trace(
                    go.Scatter(
                        x=ranks[m],
                        y=y[m],
                        mode="markers",
                        marker={"color": "#d62728", "size": 8},
                        customdata=[t for t, k in zip(host_text, m) if k],
                        name=f"{label}: straggler",
                        hovertemplate=hover.replace("<extra>", "<extra>straggler · "),
                    ),
                    row=i,
                    col=1,
                )
        else:
            fig.add_trace(
                go.Bar(
                    x=ranks,
                    y=y,
                    marker={"color": colors, "line": {"width": 0}},
                    customdata=host_text,
                    name=label,
                    hovertemplate=hover,
                ),
                row=i,
                col=1,
            )
        y_title = f"{label} ({unit})" if unit not in ("", "ratio") else label
        fig.update_yaxes(title=y_title, row=i, col=1)
    fig.update_layout(**_base_layout(title, 200 + 130 * len(rows)), bargap=0.15, showlegend=False)
    fig.update_xaxes(type="linear" if many else "category")
    fig.update_xaxes(title="rank", row=len(rows), col=1)
    return fig


def ratio_over_steps_figure(
    per_step: pd.DataFrame,
    columns: dict[str, str] | None = None,
    title: str = "Comm/compute ratio over steps",
    y_title: str = "ratio",
    max_points: int = MAX_LINE_POINTS,
) -> go.Figure:
    """Return one line per entry of ``columns`` ({column: label}) against ``per_step``'s ``step``.

    Beyond ``max_points`` steps, steps are binned (the mean of each bin; the title says so), so
    that a long run stays a light SVG line.
    """
    if per_step is None or per_step.empty:
        return empty_figure("no per-step comm/compute data")
    df = per_step.reset_index() if "step" not in per_step.columns else per_step
    columns = {c: lab for c, lab in (columns or {c: c for c in df.columns}).items() if c in df}
    columns.pop("step", None)
    df = df.sort_values("step")
    x = df["step"].to_numpy(dtype=np.int64)
    ys = {c: df[c].to_numpy(dtype=np.float64) for c in columns}
    where = "step %{x}"
    if len(x) > max_points:
        width = _bin_width(len(x), max_points)
        with np.errstate(all="ignore"):
            ys = {c: np.nanmean(_bins(y, width, np.nan), axis=-1) for c, y in ys.items()}
        x = x[::width]
        title += f" (mean of {width} steps per point)"
        where = f"{width} steps from step %{{x}}"
    fig = go.Figure()
    for col, label in columns.items():
        fig.add_trace(
            go.Scatter(
                x=x,
                y=ys[col],
                mode="lines",
                name=label,
                hovertemplate=where + "<br>%{y:.3f}<extra>" + label + "</extra>",
            )
        )
    fig.update_layout(
        **_base_layout(title, 320),
        legend={"orientation": "h", "y": -0.22, "yanchor": "top", "x": 0, "xanchor": "left"},
    )
    fig.update_layout(margin={**_MARGIN, "b": 80})
    fig.update_xaxes(title=None)
    fig.update_yaxes(title=y_title, rangemode="tozero")
    return fig


def tensor_figure(
    per_tensor: pd.DataFrame,
    time_col: str = "time_ms",
    busbw_col: str = "busbw_gbps",
    name_col: str = "name",
    bytes_col: str | None = "bytes",
    max_tensors: int = 200,
    title: str = "Allreduce time and bus bandwidth per tensor (median over steps and ranks)",
) -> go.Figure:
    """Return two bar rows sharing the tensor axis: allreduce time and busbw per tensor.

    More than ``max_tensors`` tensors: the ones with the largest time are kept.
    """
    if per_tensor is None or per_tensor.empty or time_col not in per_tensor:
        return empty_figure("no allreduce spans in this run")
    df = per_tensor.reset_index() if name_col not in per_tensor.columns else per_tensor
    note = ""
    if len(df) > max_tensors:
        df = df.nlargest(max_tensors, time_col)
        note = f" · {max_tensors} slowest of {len(per_tensor)}"
    names = np.array([esc(n) for n in df[name_col].astype(str)], dtype=object)
    sizes = (
        [format_bytes(b) for b in df[bytes_col]]
        if bytes_col and bytes_col in df
        else [""] * len(df)
    )
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    fig.add_trace(
        go.Bar(
            x=names,
            y=df[time_col].to_numpy(dtype=np.float64),
            marker_color=KIND_COLORS["allreduce"],
            name="allreduce time",
            text=sizes,
            textposition="none",
            hovertemplate="%{x} (%{text})<br>%{y:.3f} ms<extra>allreduce time</extra>",
        ),
        row=1,
        col=1,
    )
    if busbw_col in df:
        fig.add_trace(
            go.Bar(
                x=names,
                y=df[busbw_col].to_numpy(dtype=np.float64),
                marker_color="#1f77b4",
                name="busbw",
                text=sizes,
                textposition="none",
                hovertemplate="%{x} (%{text})<br>%{y:.3f} GB/s<extra>busbw</extra>",
            ),
            row=2,
            col=1,
        )
    fig.update_layout(**_base_layout(title + note, 520), showlegend=False, bargap=0.2)
    longest = max((len(n) for n in names), default=0)
    fig.update_layout(margin={**_MARGIN, "b": int(min(200, 30 + 6 * longest))})
    fig.update_yaxes(title="ms", row=1, col=1)
    fig.update_yaxes(title="busbw GB/s", row=2, col=1)
    fig.update_xaxes(tickangle=-45, type="category", row=2, col=1)
    return fig


def bench_builders(data: Any) -> dict[str, Callable[[], go.Figure]]:
    """Return {name: zero-argument builder} for every figure of the page (for the benchmark)."""
    return data.figure_builders()


def one_page_app(title: str, layout: Any) -> Dash:
    """A Dash app of one page and no callbacks (the compare and scaling pages): its assets
    served locally, none picked up from the folder, request bodies bounded to 1 MiB. ``title``
    must already be escaped."""
    app = Dash(__name__, title=title, update_title=None, serve_locally=True, assets_ignore=".*")
    app.server.config["MAX_CONTENT_LENGTH"] = 1 << 20
    app.layout = layout
    return app
