"""``hvtrace dashboard RUN_1 --scaling RUN_2 RUN_4``: the scaling page draws what ``hvtrace
scaling`` computes (the efficiency of each run, the prediction apart, the parts of the loss adding
up to it), names from the traces escaped."""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis_frames import synth_spans
from helpers import REPO_ROOT, layout_texts

pytest.importorskip("dash")

from hvtrace_dashboard import app as dash_app
from hvtrace_dashboard import scaling as scaling_page
from hvtrace_dashboard.scaling import (
    create_scaling_app,
    efficiency_figure,
    loss_figure,
    run_hosts,
    scaling_layout,
)

from hvtrace.analysis import analyze_spans
from hvtrace.analysis.scaling import LOSS_LABELS, LOSS_PARTS, ring_factor, scaling
from hvtrace.cli import build_parser, main

EVIL_ID = "<img src=x onerror=alert(1)>"
EVIL_HOST = "<script>alert('h')</script>"


def _analyses(run_id: str = "job", host: str = "node", steps: int = 60) -> list:
    """The same job at 4, 1 and 2 ranks, each allreduce a ring's share of the bytes per rank
    (none at one rank), rank 2 slowed at 4 ranks (as tests/unit/test_scaling.py makes them)."""
    out = []
    for n in (4, 1, 2):
        kw = {"comm_ms": 4.0 * ring_factor(n) + 0.01}
        if n == 4:
            kw.update(slow_ranks=(2,), slow_phase="forward", slow_ms=6.0)
        spans = synth_spans(ranks=n, steps=steps, noise=0.02, seed=n, **kw)
        hosts = {r: f"{host}{r // 2}" for r in range(n)}
        out.append(analyze_spans(spans, run_id=f"{run_id}-{n}", hosts=hosts))
    return out


@pytest.fixture(scope="module")
def study():
    analyses = _analyses()
    return scaling(analyses), analyses


def _by_id(layout, id_: str):
    return next(c for c in layout.children if getattr(c, "id", None) == id_)


def test_the_efficiency_curve_holds_the_analysis_numbers_and_the_prediction_apart(study) -> None:
    s, _ = study
    t = s.runs
    fig = efficiency_figure(s)
    measured = next(d for d in fig.data if d.name == "measured")
    assert list(measured.x) == [1, 2, 4]
    assert list(measured.y) == pytest.approx(list(t["efficiency"]))
    assert measured.y[0] == pytest.approx(1.0) and measured.y[2] < measured.y[1] < 1.0
    # the prediction: its own trace, dashed from the largest run, an open marker, its numbers
    p = s.prediction
    assert p["size"] == 8
    point = next(d for d in fig.data if d.name and d.name.startswith("predicted at 8 ranks"))
    assert list(point.x) == [8] and point.y[0] == pytest.approx(p["efficiency"])
    assert point.marker.symbol.endswith("-open") and "predicted" in point.text[0]
    line = next(d for d in fig.data if d.name == "predicted")
    assert line.line.dash == "dash" and list(line.x) == [4, 8]
    assert list(line.y) == pytest.approx([t["efficiency"].iloc[-1], p["efficiency"]])
    assert measured.line.dash is None  # the measured curve is solid: only the prediction dashed
    # its assumptions, in words, on the page
    page = scaling_layout(s)
    said = "\n".join(layout_texts(_by_id(page, "scl-prediction").to_plotly_json()))
    assert "At 8 ranks (predicted)" in said and f"{p['step_ms']:.2f} ms" in said
    assumptions = layout_texts(_by_id(page, "scl-assumptions").to_plotly_json())
    assert all(a in assumptions for a in s.assumptions) and len(s.assumptions) == 3


def test_the_stacked_loss_is_the_analysis_parts_and_adds_up(study) -> None:
    s, _ = study
    t = s.runs.iloc[1:]
    fig = loss_figure(s)
    assert fig.layout.barmode == "relative"
    bars = [d for d in fig.data if d.type == "bar"]
    labels = {LOSS_LABELS[p]: p for p in LOSS_PARTS}
    assert {"exposed communication", "waiting for the last rank"} <= {b.name for b in bars}
    for b in bars:
        assert list(b.x) == ["2 ranks", "4 ranks"]
        assert list(b.y) == pytest.approx(list(t[labels[b.name]]))  # the analysis' values
    total = next(d for d in fig.data if d.name == "total lost")
    assert list(total.y) == pytest.approx(list(t["loss_ms"]))
    for i in range(len(t)):  # the drawn parts add up to the total (those left out are < 0.005)
        assert sum(b.y[i] for b in bars) == pytest.approx(t["loss_ms"].iloc[i], abs=0.05)
    # the straggler at 4 ranks (rank 2's forward +6 ms): the other ranks wait for it
    waiting = next(b for b in bars if b.name == "waiting for the last rank")
    assert waiting.y[1] > waiting.y[0] + 3.0


def test_the_app_builds_and_shows_each_run(study) -> None:
    s, analyses = study
    hosts = run_hosts(s, analyses)
    assert hosts == [["node0"], ["node0"], ["node0", "node1"]]
    app = create_scaling_app(s, hosts)
    texts = layout_texts(app.layout.to_plotly_json())
    for r in s.runs.itertuples():
        assert r.run_id in texts and f"{r.efficiency:.0%}" in texts
    assert "node0, node1" in texts
    assert app.title == "hvtrace · scaling at 1, 2, 4 ranks"


def test_run_ids_and_hosts_from_the_traces_are_escaped() -> None:
    analyses = _analyses(run_id=EVIL_ID, host=EVIL_HOST, steps=20)
    s = scaling(analyses)
    page = create_scaling_app(s, run_hosts(s, analyses)).layout
    # text in Dash components is shown as text (React escapes it), never parsed as HTML: the
    # names are there as they are, and nothing on the page renders raw markup
    texts = layout_texts(page.to_plotly_json())
    assert f"{EVIL_ID}-4" in texts and any(EVIL_HOST + "0" in x for x in texts)

    def kinds(c) -> set[str]:
        out = {type(c).__name__}
        kids = getattr(c, "children", None)
        for k in kids if isinstance(kids, list) else [kids]:
            if hasattr(k, "to_plotly_json"):
                out |= kinds(k)
        return out

    assert not kinds(page) & {"Markdown", "Iframe", "Script", "DangerouslySetInnerHTML"}
    # figure text (hover, labels) is read by plotly as HTML: there the names are escaped
    for fig in (efficiency_figure(s), loss_figure(s)):
        ftexts = layout_texts(fig.to_plotly_json())
        assert not any("<img" in x or "<script" in x for x in ftexts)
        assert any("&lt;img src=x onerror=alert(1)&gt;-4" in x for x in ftexts)


def test_the_command_takes_scaling(tmp_path: Path, monkeypatch) -> None:
    dirs = [tmp_path / n for n in ("np1", "np2", "np4")]
    for d in dirs:
        d.mkdir()
    seen = {}

    def fake(run_dirs, host, port, verbose=False):
        seen["args"] = ([str(d) for d in run_dirs], host, port)
        return 0

    monkeypatch.setattr(scaling_page, "serve_scaling", fake)
    monkeypatch.setattr(dash_app, "_check_can_listen", lambda host, port: None)
    want = ([str(d) for d in dirs], "127.0.0.1", 8050)
    for argv in (
        ["dashboard", str(dirs[0]), "--scaling", str(dirs[1]), str(dirs[2])],
        ["dashboard", "--scaling", *map(str, dirs)],
    ):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 0
        assert seen.pop("args") == want
    with pytest.raises(SystemExit):  # one page or the other
        build_parser().parse_args(["dashboard", str(dirs[0]), "--compare", str(dirs[1]),
                                   "--scaling", str(dirs[2])])  # fmt: skip


def test_one_run_is_not_a_scaling_page(tmp_path: Path, capsys) -> None:
    assert main(["dashboard", "--scaling", str(tmp_path)]) == 2
    assert "two runs or more" in capsys.readouterr().err


def test_serve_scaling_opens_the_runs_and_serves_their_page(monkeypatch, capsys) -> None:
    samples = REPO_ROOT / "sample_traces"
    runs = [samples / "slow_rank2_input_4rank", samples / "balanced_2rank"]
    served = {}

    def fake_run(app, host, port, verbose):
        served["app"] = app
        return 0

    monkeypatch.setattr(dash_app, "_run_app", fake_run)
    assert scaling_page.serve_scaling(runs, "127.0.0.1", 8050) == 0
    assert "scaling of 2 runs ready" in capsys.readouterr().out
    page = served["app"].layout
    measured = next(d for d in _by_id(page, "scl-efficiency").figure.data if d.name == "measured")
    assert list(measured.x) == [2, 4]
    loss = _by_id(page, "scl-loss").figure
    assert next(d for d in loss.data if d.name == "waiting for the last rank").y[0] > 0


def test_a_fitted_prediction_is_drawn_with_its_latency_and_bandwidth() -> None:
    """Runs whose messages come in several sizes: the page says the fitted latency and bus
    bandwidth (the numbers hvtrace scaling computed) and no longer calls it an upper bound."""
    from test_scaling import ring_spans

    analyses = [analyze_spans(ring_spans(n, seed=n, steps=20), run_id=f"np{n}") for n in (1, 2, 4)]
    s = scaling(analyses)
    p = s.prediction
    assert p["model"] == "latency"
    said = "\n".join(layout_texts(_by_id(scaling_layout(s), "scl-prediction").to_plotly_json()))
    assert f"{p['step_ms']:.2f} ms" in said and "not a measurement" in said
    assert f"{p['latency_us']:.1f} µs per ring transfer step" in said
    assert f"{p['busbw_gbps']:.3g} GB/s" in said and "upper bound" not in said
    point = next(d for d in efficiency_figure(s).data if (d.name or "").startswith("predicted at"))
    assert point.name == "predicted at 8 ranks" and point.y[0] == pytest.approx(p["efficiency"])
