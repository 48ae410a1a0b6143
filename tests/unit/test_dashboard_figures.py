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


def test_ratio_per_rank_highlights_stragglers():
    per_rank = pd.DataFrame({"rank": [0, 1, 2], "comm_compute_ratio": [0.5, 0.1, 0.5]})
    fig = figures.ratio_per_rank_figure(per_rank, highlight_ranks=[1])
    bar = fig.data[0]
    assert list(bar.y) == [0.5, 0.1, 0.5]
    assert bar.marker.color[1] != bar.marker.color[0]


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
    from hvtrace_dashboard.app import DashboardData

    ranks = sorted(spans["rank"].unique().tolist())
    steps = sorted(spans["step"].unique().tolist())
    v = np.full((len(ranks), len(steps)), 70.0)
    v[1] = 100.0
    return DashboardData(
        run_id="test-run",
        run_dir="/nowhere",
        spans=spans,
        hosts={r: f"h{r // 2}" for r in ranks},
        ranks=ranks,
        last_step=max(steps),
        summary={"ranks": str(len(ranks)), "stragglers": "1"},
        findings=["rank 1 is late by 30 ms in forward"],
        heat={"lateness": rank_step(v), "step": rank_step(v * 0 + 72)},
        heat_labels={"lateness": "arrival lateness", "step": "step time"},
        heat_units={"lateness": "ms", "step": "ms"},
        per_rank=pd.DataFrame({"rank": ranks, "comm_compute_ratio": 0.5}),
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
