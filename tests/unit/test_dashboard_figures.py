"""Dashboard figures are pure functions DataFrame -> Figure: tested here without a server.

Also: the step-window logic, the app's first layout and its callbacks through Flask's test client
(no browser), and the ``hvtrace dashboard`` command's errors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

pytest.importorskip("dash")

from hvtrace_dashboard import figures
from hvtrace_dashboard.callbacks import window_for_click

KINDS_PER_STEP = ("input", "forward", "backward", "wait", "update", "step")


def make_spans(
    ranks: int = 4, steps: int = 5, tensors: int = 4, slow_rank: int = 1
) -> pd.DataFrame:
    """A span table shaped like ``Run.spans``: per rank and step the phases, allreduces, a step."""
    rows = []
    t = 1_000_000_000
    for s in range(steps):
        for r in range(ranks):
            t0 = t + r * 10_000
            fw = 8_000_000 + (30_000_000 if r == slow_rank else 0)
            marks = {
                "input": (t0, t0 + 2_000_000),
                "forward": (t0 + 2_000_000, t0 + 2_000_000 + fw),
            }
            b0 = marks["forward"][1]
            marks["backward"] = (b0, b0 + 16_000_000)
            marks["wait"] = (b0 + 16_000_000, t + 70_000_000)
            marks["update"] = (t + 70_000_000, t + 71_000_000)
            marks["step"] = (t0, t + 71_000_000)
            for k, (a, b) in marks.items():
                rows.append((r, s, 0, k, k, a, b, 0, "", np.nan, 0))
            for i in range(tensors):
                a = b0 + (i + 1) * 16_000_000 // tensors
                rows.append(
                    (r, s, 0, "allreduce", f"layer{i}.weight", a, t + 69_000_000, 4096 << i,
                     "float32", np.nan, 2)
                )  # fmt: skip
            rows.append((r, s, 0, "scalar", "loss", t + 71_000_000, t + 71_000_000, 0, "", 1.0, 0))
        t += 72_000_000
    df = pd.DataFrame(
        rows,
        columns=[
            "rank", "step", "micro", "kind", "name", "start_ns", "end_ns", "bytes", "dtype",
            "value", "flags",
        ],
    )  # fmt: skip
    for c in ("kind", "name", "dtype"):
        df[c] = df[c].astype("category")
    return df


def rank_step(values: np.ndarray, first_step: int = 0) -> pd.DataFrame:
    ranks, steps = values.shape
    return pd.DataFrame(
        values,
        index=pd.Index(range(ranks), name="rank"),
        columns=range(first_step, first_step + steps),
    )


def n_drawn(fig: go.Figure) -> int:
    """Number of bars/points/cells the figure sends to the browser."""
    n = 0
    for tr in fig.data:
        if getattr(tr, "z", None) is not None:
            n += int(np.asarray(tr.z).size)
        elif getattr(tr, "x", None) is not None:
            n += len(tr.x)
    return n + len(fig.layout.shapes or ())


# -- heat map -----------------------------------------------------------------------------------


def test_heatmap_cells_carry_their_step_and_straggler_row_is_marked():
    v = np.full((4, 6), 60.0)
    v[2, :] = 95.0
    fig = figures.heatmap_figure(rank_step(v, first_step=10), "step time", highlight_ranks=[2])
    (hm,) = fig.data
    assert isinstance(hm, go.Heatmap)
    assert np.asarray(hm.z).shape == (4, 6)
    assert np.asarray(hm.customdata)[0].tolist() == list(range(10, 16))
    assert "◀" in fig.layout.yaxis.ticktext[2] and "◀" not in fig.layout.yaxis.ticktext[0]
    assert fig.layout.yaxis.autorange == "reversed"
    assert hm.zmax >= 95.0 > 60.0 >= hm.zmin


def test_heatmap_bins_long_runs_and_clicks_open_the_worst_step_of_the_bin():
    rng = np.random.default_rng(0)
    v = rng.uniform(50, 60, (8, 2500))
    v[3, 1234] = 500.0
    fig = figures.heatmap_figure(rank_step(v), "step time", max_cols=1000)
    hm = fig.data[0]
    z = np.asarray(hm.z)
    assert z.shape[0] == 8 and z.shape[1] <= 1000
    custom = np.asarray(hm.customdata)
    col = int(np.nanargmax(z[3]))
    assert custom[3, col] == 1234
    assert custom.min() >= 0 and custom.max() < 2500
    assert "per column" in fig.layout.xaxis.title.text


def test_heatmap_colour_range_ignores_the_warmup_step():
    v = np.full((4, 300), 60.0) + np.arange(300) * 0.01
    v[:, 0] = 5000.0  # warm-up step
    fig = figures.heatmap_figure(rank_step(v), "step time")
    assert fig.data[0].zmax < 100


def test_heatmap_of_many_ranks_one_straggler_sets_the_colour_top_and_is_labelled():
    rng = np.random.default_rng(2)
    v = rng.uniform(1.4, 1.9, (512, 400))
    v[170] = 21.0
    fig = figures.heatmap_figure(rank_step(v), "lateness", highlight_ranks=[170])
    assert fig.data[0].zmax > 15  # one row of 512 is not clipped away as noise
    ticks = list(fig.layout.yaxis.tickvals)
    assert "rank 170 ◀" in ticks and len(ticks) <= 41
    i = ticks.index("rank 170 ◀")
    assert ticks[i - 1] == "rank 156" and ticks[i + 1] == "rank 182"  # neighbours kept apart


def test_heatmap_of_more_ranks_than_rows_bins_them_and_the_straggler_row_stands_out():
    """Past MAX_HEATMAP_ROWS ranks, consecutive ranks share a row showing the worst of them: one
    slow rank among 2,000 still sets its row (and the colour top), is marked, and a click on its
    row opens the slow step."""
    rng = np.random.default_rng(3)
    v = rng.uniform(1.4, 1.9, (2000, 60))
    v[1234, 20:] = 21.0  # a straggler from step 20, worst at step 40
    v[1234, 40] = 30.0
    fig = figures.heatmap_figure(rank_step(v), "lateness", highlight_ranks=[1234])
    hm = fig.data[0]
    z = np.asarray(hm.z, dtype=float)
    assert z.shape == (500, 60)  # 4 ranks a row
    assert "the worst of 4 ranks per row" in fig.layout.title.text
    row = 1234 // 4
    assert hm.y[row] == "ranks 1232–1235 ◀" and "ranks 1232–1235 ◀" in fig.layout.yaxis.tickvals
    assert z[row, 40] == pytest.approx(30.0) and np.nanargmax(z) == row * 60 + 40
    assert np.asarray(hm.customdata)[row, 40] == 40
    assert hm.zmax > 15
    # the others show their worst, not their mean: every row's cell is its ranks' maximum
    assert z[0, 0] == pytest.approx(v[0:4, 0].max(), rel=1e-6)


def test_heatmap_empty_says_so():
    fig = figures.heatmap_figure(pd.DataFrame(), "x")
    assert not fig.data and "no per-step data" in fig.layout.annotations[0].text


# -- timeline -----------------------------------------------------------------------------------


def _hover(fig) -> list[str]:
    """Each bar's hover as plotly renders it: kind, text, rank, step, duration (ms), bytes."""
    out = []
    for t in fig.data:
        cd = np.asarray(t.customdata, dtype=float)
        for i in range(1, len(t.x), 4):  # the middle point of each bar
            r, st, dur, nb = cd[i]
            out.append(f"{t.name}|{t.text[i]}|rank {r:.0f}|step {st:.0f}|{dur:.3f} ms|{nb:.0f}")
    return out


def test_timeline_one_row_per_rank_bars_are_svg_lines_with_gaps():
    spans = make_spans(ranks=3, steps=2, tensors=4)
    fig = figures.timeline_figure(spans, ranks=[0, 1, 2], title="T")
    assert list(fig.layout.yaxis.ticktext) == ["rank 0", "rank 1", "rank 2"]
    assert fig.data and all(isinstance(t, go.Scatter) and t.mode == "lines" for t in fig.data)
    kinds = {t.name for t in fig.data}
    assert kinds == {"input", "forward", "backward", "allreduce", "wait", "update", "step"}
    ar = next(t for t in fig.data if t.name == "allreduce")
    x = np.asarray(ar.x, dtype=float)
    assert len(x) == 4 * 3 * 2 * 4 and np.isnan(x[3::4]).all()  # start, middle, end, gap
    assert (x[2::4] >= x[0::4]).all() and np.allclose(x[1::4], (x[0::4] + x[2::4]) / 2)
    # y stays inside each rank's row, one sub-lane per tensor
    y = np.asarray(ar.y, dtype=float)
    assert ((y[0::4] > -0.5) & (y[0::4] < 2.5)).all()
    assert len(np.unique(np.round(y[0::4] - np.floor(y[0::4] + 0.5), 6))) == 4
    assert "merged" not in fig.layout.title.text


def test_timeline_hover_names_tensor_bytes_and_duration():
    spans = make_spans(ranks=2, steps=1, tensors=2)
    fig = figures.timeline_figure(spans)
    hover = _hover(fig)
    assert len(hover) == sum(len(t.x) // 4 for t in fig.data)
    ar = [h for h in hover if h.startswith("allreduce|")]
    assert any("layer1.weight · float32 · 8.0 KiB|" in h and h.endswith("|8192") for h in ar)
    assert all("|step 0|" in h for h in hover)
    fwd = [h for h in hover if h.startswith("forward|")]
    assert any("|rank 1|" in h and "|38.000 ms|" in h for h in fwd)  # rank 1's slow forward
    # bytes shown for allreduces only, in the report's units (hvtrace.units.format_bytes)
    assert all(h.split("|")[1].endswith(" KiB") for h in ar)
    assert not any("KiB" in h or "kB" in h for h in hover if not h.startswith("allreduce|"))
    assert all("customdata[3]" not in t.hovertemplate for t in fig.data)


def test_timeline_merges_allreduces_when_tensor_lanes_would_be_thinner_than_a_pixel():
    few = figures.timeline_figure(make_spans(ranks=8, steps=1, tensors=16))
    assert "merged" not in few.layout.title.text
    spans = make_spans(ranks=64, steps=1, tensors=16)
    fig = figures.timeline_figure(spans)
    assert "allreduces merged per step" in fig.layout.title.text
    ar = next(t for t in fig.data if t.name == "allreduce")
    assert len(ar.x) == 4 * 64  # one bar per rank and step
    assert all(s == "16 tensors (merged) · 256.0 MiB" for s in ar.text[0::4])
    # the envelope covers every tensor of the step: first enqueue to last completion
    one = spans[(spans["rank"] == 5) & (spans["kind"] == "allreduce")]
    t0 = int(spans["start_ns"].min())
    x = np.asarray(ar.x, dtype=float).reshape(-1, 4)
    row = x[np.asarray(ar.customdata, dtype=float)[0::4, 0] == 5][0]
    assert row[0] == pytest.approx((one["start_ns"].min() - t0) / 1e9)
    assert row[2] == pytest.approx((one["end_ns"].max() - t0) / 1e9)


def test_timeline_rank_filter_and_x_is_seconds_since_t0():
    spans = make_spans(ranks=4, steps=2)
    sub = spans[spans["rank"].isin([1, 3])]
    t0 = int(spans["start_ns"].min())
    fig = figures.timeline_figure(sub, ranks=[1, 3], t0_ns=t0)
    assert list(fig.layout.yaxis.ticktext) == ["rank 1", "rank 3"]
    step = next(t for t in fig.data if t.name == "step")
    assert np.nanmin(np.asarray(step.x, dtype=float)) >= 0
    assert fig.layout.xaxis.range[1] < 1.0  # two ~72 ms steps


def test_timeline_caps_spans_by_merging_then_cutting():
    spans = make_spans(ranks=8, steps=6, tensors=40)  # 8*6*(6+40) = 2208 drawable spans
    fig = figures.timeline_figure(spans, max_spans=1000)
    drawn = sum(len(t.x) // 4 for t in fig.data)
    assert drawn <= 1000
    assert "merged" in fig.layout.title.text
    fig2 = figures.timeline_figure(spans, max_spans=200)
    assert sum(len(t.x) // 4 for t in fig2.data) <= 200
    assert "cut to the first 200" in fig2.layout.title.text
    merged = next(t for t in fig.data if t.name == "allreduce")
    assert any("40 tensors (merged)" in s for s in merged.text)


def test_timeline_focus_step_is_shaded_and_empty_window_says_so():
    spans = make_spans(ranks=2, steps=3)
    fig = figures.timeline_figure(spans, focus_step=1)
    assert len(fig.layout.shapes) == 1
    empty = figures.timeline_figure(spans.iloc[0:0], ranks=[0])
    assert not empty.data and "no spans" in empty.layout.annotations[0].text


# -- comm/compute, tensors ------------------------------------------------------------------------


def test_per_rank_figure_one_row_per_metric_highlights_stragglers():
    per_rank = pd.DataFrame(
        {"rank": [2, 0, 1], "late_ms": [0.1, 0.0, 30.0], "comm_compute_ratio": [0.5, 0.5, 0.1]}
    )
    rows = {"late_ms": ("arrival lateness", "ms"), "comm_compute_ratio": ("comm/compute", "")}
    fig = figures.per_rank_figure(per_rank, rows, highlight_ranks=[1])
    late, ratio = fig.data
    assert list(late.x) == [0, 1, 2] and list(late.y) == [0.0, 30.0, 0.1]
    assert list(ratio.y) == [0.5, 0.1, 0.5]
    assert late.marker.color[1] != late.marker.color[0] == late.marker.color[2]
    assert fig.layout.xaxis.matches == ratio.xaxis  # the rows share the rank axis
    assert fig.layout.yaxis2.title.text == "comm/compute"
    # a column that is missing or all NaN is left out; nothing at all says so
    only = figures.per_rank_figure(per_rank.assign(late_ms=np.nan), rows)
    assert [t.name for t in only.data] == ["comm/compute"]
    assert "no per-rank" in figures.per_rank_figure(per_rank.iloc[0:0]).layout.annotations[0].text


def test_ratio_over_steps_one_line_per_column():
    per_step = pd.DataFrame({"step": range(100), "median": 0.4, "max": 0.6})
    fig = figures.ratio_over_steps_figure(per_step, {"median": "median", "max": "max"})
    assert [t.name for t in fig.data] == ["median", "max"] and len(fig.data[0].x) == 100
    assert all(isinstance(t, go.Scatter) for t in fig.data)
    assert "mean of" not in fig.layout.title.text


def test_ratio_over_steps_bins_long_runs_into_means():
    per_step = pd.DataFrame({"step": range(10_000), "median": np.arange(10_000) % 2.0})
    fig = figures.ratio_over_steps_figure(per_step, {"median": "median"}, max_points=1000)
    (line,) = fig.data
    assert len(line.x) == 1000 and list(line.x[:3]) == [0, 10, 20]
    assert np.allclose(np.asarray(line.y, dtype=float), 0.5)  # mean of 0,1,0,1,...
    assert "mean of 10 steps per point" in fig.layout.title.text


def test_tensor_figure_time_and_busbw_and_cap():
    per_tensor = pd.DataFrame(
        {
            "name": [f"t{i}" for i in range(300)],
            "time_ms": np.linspace(1, 3, 300),
            "busbw_gbps": np.linspace(5, 1, 300),
            "bytes": 1 << 20,
        }
    )
    fig = figures.tensor_figure(per_tensor, max_tensors=50)
    assert len(fig.data) == 2 and len(fig.data[0].x) == 50 and len(fig.data[1].x) == 50
    assert "t299" in list(fig.data[0].x)  # the slowest kept
    assert figures.tensor_figure(per_tensor.iloc[0:0]).layout.annotations


def test_no_figure_exceeds_ten_thousand_elements_on_a_large_window():
    spans = make_spans(ranks=64, steps=5, tensors=40)  # 64*5*46 = 14720 spans
    fig = figures.timeline_figure(spans)
    assert sum(len(t.x) // 4 for t in fig.data) <= 10_000
    big = rank_step(np.random.default_rng(1).uniform(1, 2, (64, 2000)))
    assert np.asarray(figures.heatmap_figure(big, "x").data[0].z).shape[1] <= 500


# -- window logic ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "size", "last", "start"),
    [
        (10, 3, 40, 9),
        (0, 3, 40, 0),
        (40, 3, 40, 38),
        (5, 1, 40, 5),
        (7, 10, 5, 0),
        (20, 10, 39, 16),
    ],
)
def test_window_for_click_centres_the_step(step, size, last, start):
    got = window_for_click(step, size, last)
    assert got == start
    assert got <= step <= got + size - 1 or last < size


# -- the app (no browser) -------------------------------------------------------------------------


def hand_made_data(spans: pd.DataFrame):
    """A DashboardData filled by hand (as the analysis would), to test the app without it."""
    from hvtrace_dashboard.app import DashboardData, frame_window

    ranks = sorted(spans["rank"].unique().tolist())
    steps = sorted(spans["step"].unique().tolist())
    v = np.full((len(ranks), len(steps)), 70.0)
    v[1] = 100.0
    return DashboardData(
        run_id="test-run",
        run_dir="/nowhere",
        window=frame_window(spans),
        hosts={r: f"h{r // 2}" for r in ranks},
        ranks=ranks,
        last_step=max(steps),
        summary={"ranks": str(len(ranks)), "stragglers": "1"},
        findings=["rank 1 is late by 30 ms in forward"],
        heat={"lateness": rank_step(v), "step": rank_step(v * 0 + 72)},
        heat_labels={"lateness": "arrival lateness", "step": "step time"},
        heat_units={"lateness": "ms", "step": "ms"},
        per_rank=pd.DataFrame({"rank": ranks, "late_ms": 1.0, "comm_compute_ratio": 0.5}),
        per_step=pd.DataFrame({"step": steps, "median": 0.5}),
        per_step_columns={"median": "median over ranks"},
        per_tensor=pd.DataFrame({"name": ["a", "b"], "time_ms": [1.0, 2.0], "busbw_gbps": [3, 4]}),
        stragglers=pd.DataFrame({"rank": [1], "host": ["h0"], "late_ms": [30.0]}),
        straggler_ranks=[1],
        focus_step=2,
        t0_ns=int(spans["start_ns"].min()),
    )


def _post(client, output: str, outputs: list, inputs: list, state: list | None = None):
    changed = [f"{inputs[0]['id']}.{inputs[0]['property']}"]
    body = {
        "output": output,
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": inputs,
        "state": state or [],
        "changedPropIds": changed,
    }
    resp = client.post("/_dash-update-component", json=body)
    assert resp.status_code == 200, resp.data[:500]
    return json.loads(resp.data)["response"]


def test_app_first_layout_holds_every_figure_and_callbacks_move_the_timeline():
    from hvtrace_dashboard.app import create_app

    spans = make_spans(ranks=4, steps=10)
    app = create_app(None, data=hand_made_data(spans))
    client = app.server.test_client()
    layout = json.loads(client.get("/_dash-layout").data)
    text = json.dumps(layout)
    for gid in ("heatmap", "timeline", "ratio-rank", "ratio-steps", "tensors"):
        assert f'"id": "{gid}"' in text
    assert "rank 1 is late by 30 ms" in text and "steps 1\\u20133" in text

    # click on step 7 of the heat map -> window 6..8, focus 7
    resp = _post(
        client,
        "..win-start.value...focus-step.data..",
        [{"id": "win-start", "property": "value"}, {"id": "focus-step", "property": "data"}],
        [
            {"id": "heatmap", "property": "clickData",
             "value": {"points": [{"x": 7, "y": 1, "customdata": 7}]}},
            {"id": "win-prev", "property": "n_clicks", "value": 0},
            {"id": "win-next", "property": "n_clicks", "value": 0},
        ],
        [{"id": "win-start", "property": "value", "value": 1},
         {"id": "win-size", "property": "value", "value": 3}],
    )  # fmt: skip
    assert resp["win-start"]["value"] == 6 and resp["focus-step"]["data"] == 7

    resp = _post(
        client,
        "timeline.figure",
        [{"id": "timeline", "property": "figure"}],
        [
            {"id": "win-start", "property": "value", "value": 6},
            {"id": "win-size", "property": "value", "value": 3},
            {"id": "rank-filter", "property": "value", "value": [3, 1]},
            {"id": "focus-step", "property": "data", "value": 7},
        ],
    )
    fig = resp["timeline"]["figure"]
    assert "steps 6–8" in fig["layout"]["title"]["text"]
    assert fig["layout"]["yaxis"]["ticktext"] == ["1 · h0", "3 · h1"]

    resp = _post(
        client,
        "heatmap.figure",
        [{"id": "heatmap", "property": "figure"}],
        [{"id": "heat-metric", "property": "value", "value": "step"}],
    )
    assert "step time" in resp["heatmap"]["figure"]["layout"]["title"]["text"]


def test_app_loads_the_vendored_cartesian_plotly_only_when_versions_match(monkeypatch):
    from hvtrace_dashboard import app as app_mod
    from plotly.offline import get_plotlyjs_version

    spans = make_spans(ranks=2, steps=3)
    version = app_mod.bundle_version()
    assert version is not None, "dashboard/static/plotly-cartesian.min.js is missing"
    if version == get_plotlyjs_version():
        client = app_mod.create_app(None, data=hand_made_data(spans)).server.test_client()
        page = client.get("/").get_data(as_text=True)
        route = f"/_hvtrace/plotly-cartesian-{version}.min.js"
        # loaded before Dash's scripts, so that dcc.Graph finds window.Plotly and loads no other
        assert page.index(route) < page.index("dash_renderer")
        js = client.get(route)
        assert js.status_code == 200 and b"plotly.js (cartesian" in js.data[:300]
    monkeypatch.setattr(app_mod, "bundle_version", lambda *a: "0.0.1")
    client = app_mod.create_app(None, data=hand_made_data(spans)).server.test_client()
    assert "/_hvtrace/plotly-cartesian" not in client.get("/").get_data(as_text=True)


def test_page_uses_only_trace_types_of_the_cartesian_bundle():
    from hvtrace_dashboard.app import create_app

    data = hand_made_data(make_spans(ranks=64, steps=30, tensors=8))
    layout = json.loads(create_app(None, data=data).server.test_client().get("/_dash-layout").data)
    types = set()

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Graph":
                types.update(t.get("type", "scatter") for t in node["props"]["figure"]["data"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(layout)
    assert types and types <= {"scatter", "bar", "heatmap"}, types


# -- command line ---------------------------------------------------------------------------------


def test_cli_bad_run_dir_is_one_line_exit_2(tmp_path, capsys):
    from hvtrace.cli import main

    assert main(["dashboard", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0]
    (tmp_path / "junk.arrows").write_bytes(b"not arrow")
    assert main(["dashboard", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_defaults_and_no_dash_import_for_other_commands():
    code = (
        "import sys; from hvtrace.cli import build_parser; p = build_parser();"
        "a = p.parse_args(['dashboard']);"
        "assert (a.run_dir, a.host, a.port) == (None, '127.0.0.1', 8050), a;"
        "assert 'dash' not in sys.modules and 'hvtrace_dashboard' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the analysis adapter on a run written with hvtrace's writer -----------------------------------


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "dashboard_bench.py"
    spec = importlib.util.spec_from_file_location("dashboard_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dashboard_data_from_a_run_shows_the_analyzers_straggler(tmp_path):
    from hvtrace_dashboard.app import DashboardData

    from hvtrace.load import load_run

    _bench_module().write_run(tmp_path, ranks=6, steps=20, tensors=6, slow_rank=4, slow_ms=20)
    data = DashboardData.from_run(load_run(tmp_path))
    assert data.ranks == list(range(6)) and data.last_step == 19
    assert data.summary["ranks"] == "6" and data.summary["steps"] == "20"
    assert data.summary["stragglers"] == "1" and data.straggler_ranks == [4]
    assert data.summary["median step"].endswith(" ms")
    assert any("rank 4" in f for f in data.findings)
    assert list(data.heat) == ["lateness", "step", "compute"]
    late = data.heat["lateness"]
    assert late.shape == (6, 20)
    assert late.loc[4].median() > 15 and late.drop(index=4).median(axis=1).max() < 5
    heat = data.heatmap("lateness")
    assert [lab for lab in heat.layout.yaxis.ticktext if "◀" in lab] == ["rank 4 ◀"]
    assert data.stragglers.iloc[0]["phase"] == "forward"
    assert 1 <= data.focus_step <= 19
    fig = data.timeline(3, 2, [4, 0])
    assert list(fig.layout.yaxis.ticktext) == ["rank 0", "rank 4"]
    assert "steps 3–4" in fig.layout.title.text
    for name, build in data.figure_builders().items():
        assert build().data, name


def test_cli_busy_port_is_one_line_exit_2_before_loading(tmp_path, capsys):
    import socket

    from hvtrace.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["dashboard", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0]


# -- a run of any size: engine analysis, per-window span queries --------------------------------


def _synth_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "synth_run.py"
    spec = importlib.util.spec_from_file_location("synth_run_dash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("compact", [True, False], ids=["parquet", "arrows"])
def test_window_query_returns_exactly_the_windows_spans_on_rank0s_clock(tmp_path, compact):
    from hvtrace_dashboard.app import run_window

    from hvtrace.load import load_run, open_run
    from hvtrace.selection import StepRange

    _synth_module().write_synth_run(
        tmp_path, ranks=4, steps=40, tensors=3, compact_files=compact, row_group_rows=60
    )
    run = open_run(tmp_path)
    got = run_window(run)(StepRange(10, 13), [3, 1])
    assert "spans" not in run.__dict__  # the run's span table was never built
    full = load_run(tmp_path).spans  # every span, each moved by its own clock estimate
    want = full[full["step"].between(10, 12) & full["rank"].isin([1, 3])]

    def ordered(df: pd.DataFrame) -> pd.DataFrame:
        df = df.astype({"kind": str, "name": str, "dtype": str})
        keys = ["rank", "step", "start_ns", "end_ns", "kind", "name"]
        return df.sort_values(keys).reset_index(drop=True)

    got, want = ordered(got), ordered(want)
    assert len(got) == len(want) > 0
    assert sorted(set(got["rank"])) == [1, 3] and sorted(set(got["step"])) == [10, 11, 12]
    for col in ("rank", "step", "start_ns", "end_ns", "bytes"):
        assert got[col].to_numpy().tolist() == want[col].to_numpy().tolist(), col
    for col in ("kind", "name", "dtype"):
        assert got[col].tolist() == want[col].tolist(), col
    # the files' own times are not rank 0's: the offsets were applied
    raw = run.files[1].read_table(StepRange(10, 13), ["start_ns"]).column("start_ns").to_numpy()
    off = run.files[1].clock[0].offset_ns
    assert off != 0 and sorted(raw - off) == sorted(got.loc[got["rank"] == 1, "start_ns"])


def test_window_query_uses_the_analysis_offsets_when_the_clock_drifts(tmp_path):
    """With drift, a window's spans are moved by the analysis' per-(rank, step) offset, so the
    timeline's step spans start exactly where the analysis' step table says."""
    from hvtrace_dashboard.app import run_window

    from hvtrace.analysis import analyze
    from hvtrace.clock import ClockEstimate, offset_at
    from hvtrace.load import open_run
    from hvtrace.selection import StepRange

    _synth_module().write_synth_run(tmp_path, ranks=3, steps=30, tensors=2)
    run = open_run(tmp_path)
    rf = run.files[2]
    e = rf.clock[0]  # 2 ms of drift over the run's first second
    rf.clock = [e, ClockEstimate(e.at_ns + 1_000_000_000, e.offset_ns + 2_000_000, 1000, 5)]
    a = analyze(run)
    got = run_window(run)(StepRange(20, 23), [2])
    steps = got[got["kind"] == "step"].set_index("step")["start_ns"]
    ref = a.steps[a.steps["rank"] == 2].set_index("step")["start_ns"]
    assert steps.tolist() == ref.loc[[20, 21, 22]].tolist()
    raw = rf.read_table(StepRange(20, 23)).to_pandas()
    raw = raw[raw["kind"] == "step"].set_index("step")["start_ns"]
    moved = (raw - steps).to_numpy()  # the offset applied: at the step's start, with the drift
    assert moved.tolist() == offset_at(rf.clock, raw.to_numpy()).tolist()
    assert (moved > e.offset_ns + 1_000_000).all()


def test_a_big_run_is_binned_and_its_straggler_stands_out(tmp_path):
    """80 ranks x 1,200 steps (864,000 spans): the figures are built from the analysis' tables,
    binned for the browser, and the injected straggler (rank 37) stands out per rank."""
    from hvtrace_dashboard.app import TIMELINE_SUBSET, DashboardData, create_app

    from hvtrace.load import open_run

    _synth_module().write_synth_run(
        tmp_path, ranks=80, steps=1200, tensors=2, slow_rank=37, slow_ms=20
    )
    run = open_run(tmp_path)
    data = DashboardData.from_run(run)
    assert "spans" not in run.__dict__
    assert data.straggler_ranks == [37] and data.last_step == 1199
    heat = data.heatmap("lateness")
    z = np.asarray(heat.data[0].z)
    assert z.shape[0] == 80 and z.shape[1] <= figures.MAX_HEATMAP_COLS < 1200
    assert "binned: mean of 3 steps per column" in heat.layout.title.text
    assert int(np.nanargmax(np.nanmedian(z, axis=1))) == 37  # the straggler's row
    assert "37 · node004 ◀" in heat.layout.yaxis.ticktext  # always labelled
    builders = data.figure_builders()
    per_rank = builders["ratio_rank"]()
    late = next(t for t in per_rank.data if t.name == "arrival lateness")
    y = np.asarray(late.y, dtype=float)
    assert len(y) == 80 and int(np.nanargmax(y)) == 37 and y[37] > 15 > np.nanmax(np.delete(y, 37))
    assert late.type == "scatter" and late.line.shape == "hvh"  # 80 ranks: one path, no bars
    marked = next(t for t in per_rank.data if t.name == "arrival lateness: straggler")
    assert list(marked.x) == [37] and list(marked.y) == [y[37]]
    lines = builders["ratio_steps"]()
    assert all(len(t.x) <= figures.MAX_LINE_POINTS for t in lines.data)
    # the timeline: a window of rank 0, the straggler and the latest ranks, queried for it alone
    assert len(data.timeline_ranks) == TIMELINE_SUBSET and {0, 37} <= set(data.timeline_ranks)
    tl = builders["timeline"]()
    assert f"{TIMELINE_SUBSET} of 80 ranks (rank 0 and the latest" in tl.layout.title.text
    assert len(tl.layout.yaxis.ticktext) == TIMELINE_SUBSET
    drawn = {int(r) for t in tl.data for r in np.asarray(t.customdata, dtype=float)[0::4, 0]}
    assert drawn == set(data.timeline_ranks)
    # rank filter: picked ranks only; junk in the request is ignored, not an error
    fig = data.timeline(500, 2, [79, "x", 10_000, None, 5])
    assert list(fig.layout.yaxis.ticktext) == ["5 · node000", "79 · node009"]
    assert "steps 500–501 · 2 of 80 ranks" in fig.layout.title.text
    client = create_app(run, data=data).server.test_client()
    assert len(client.get("/_dash-layout").data) < 3_000_000
    assert "spans" not in run.__dict__


def test_a_window_that_cannot_be_read_is_a_message_not_an_error(tmp_path):
    """A rank file removed after the start: the timeline says so in one line; the app stays up."""
    from hvtrace_dashboard.app import DashboardData

    from hvtrace.load import open_run

    _synth_module().write_synth_run(tmp_path, ranks=3, steps=20, tensors=2)
    run = open_run(tmp_path)
    data = DashboardData.from_run(run)
    assert data.timeline(5, 2).data
    run.files[1].path.unlink()
    assert data.timeline(5, 2).data  # a window seen before is kept
    fig = data.timeline(8, 2)
    (note,) = fig.layout.annotations
    assert not fig.data and "cannot read steps 8..9" in note.text and "\n" not in note.text
    assert data.timeline(8, 2, [0, 2]).data  # the other ranks' windows still open


def test_header_lists_hosts_with_their_ranks() -> None:
    from hvtrace_dashboard.layout import hosts_line

    hosts = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b", 4: "<b>x</b>"}
    assert (
        hosts_line(hosts) == "3 host(s): <b>x</b> (ranks 4), node-a (ranks 0-1), node-b (ranks 2-3)"
    )
    many = {r: f"h{r // 2:02d}" for r in range(40)}
    line = hosts_line(many, limit=3)
    assert line.startswith("20 host(s): h00 (ranks 0-1), h01 (ranks 2-3), h02 (ranks 4-5)")
    assert line.endswith("… 17 more")


def test_names_in_figures_are_shown_as_they_are_never_as_markup_or_reversed() -> None:
    """plotly reads a subset of HTML in labels and hover text: < > & are escaped; a quote is
    not (plotly would show "&quot;" as written); a bidirectional control (U+202E reverses the
    text around it) and control characters are visible escapes."""
    from hvtrace_dashboard.figures import esc

    assert esc('<img src=x onerror=alert(1)> "q" & co') == (
        '&lt;img src=x onerror=alert(1)&gt; "q" &amp; co'
    )
    assert esc("gpu\u202e1.0") == "gpu\\u202e1.0" and esc("a\x1b[2Jb") == "a\\x1b[2Jb"


def test_a_dashboard_off_the_loopback_warns_that_anyone_can_read_it() -> None:
    from hvtrace_dashboard.app import _loopback

    assert _loopback("127.0.0.1") and _loopback("localhost") and _loopback("::1")
    assert _loopback("127.8.9.1")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("10.1.2.3")
    assert not _loopback("example.org")


def test_a_request_body_past_the_bound_is_refused_before_it_is_read() -> None:
    from hvtrace_dashboard.app import MAX_REQUEST_BYTES, create_app

    client = create_app(
        None, data=hand_made_data(make_spans(ranks=2, steps=4))
    ).server.test_client()
    body = b"{" + b" " * (MAX_REQUEST_BYTES + 10) + b"}"
    resp = client.post("/_dash-update-component", data=body, content_type="application/json")
    assert resp.status_code == 413
    assert client.get("/_dash-layout").status_code == 200  # the server goes on
