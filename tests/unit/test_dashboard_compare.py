"""``hvtrace dashboard RUN_A --compare RUN_B``: the compare page renders the same comparison as
``hvtrace diff`` (its headline, where the change went, stragglers, settings), names escaped."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import layout_texts, synth_module

pytest.importorskip("dash")

from hvtrace_dashboard import app as dash_app
from hvtrace_dashboard.compare import compare_layout, create_compare_app

from hvtrace.analysis import analyze
from hvtrace.analysis.diff import diff_runs
from hvtrace.cli import build_parser
from hvtrace.export.diff import format_diff
from hvtrace.load import open_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    synth = synth_module()
    a = tmp_path_factory.mktemp("a")
    b = tmp_path_factory.mktemp("b")
    synth.write_synth_run(a, ranks=4, steps=40, tensors=3, slow_rank=-1, seed=1)
    synth.write_synth_run(b, ranks=4, steps=40, tensors=3, slow_rank=2, slow_ms=20.0,
                          slow_phase="forward", seed=2)  # fmt: skip
    return a, b


def test_the_page_shows_what_hvtrace_diff_says(runs: tuple[Path, Path]) -> None:
    d = diff_runs(analyze(open_run(runs[0])), analyze(open_run(runs[1])))
    text = format_diff(d, width=10_000)
    page = layout_texts(compare_layout(d).to_plotly_json())
    joined = "\n".join(page)
    head = next(ln for ln in text.splitlines() if ln.startswith("step time (median)"))
    assert head in page and "slower: a significant change" in page
    assert "rank 2 became a straggler in B: forward" in joined
    # where it went: A and B per part, the forward's change the largest, labelled
    parts = next(g for g in compare_layout(d).children if getattr(g, "id", "") == "cmp-parts")
    a_bar, b_bar = parts.figure.data
    assert list(a_bar.y) == list(b_bar.y) and "forward" in a_bar.y
    i = list(b_bar.y).index("forward")
    # rank 2's 20 ms of 4 ranks: +5 ms a rank-step in the forward, +15 in the others' wait
    assert b_bar.x[i] - a_bar.x[i] == pytest.approx(5.0, abs=1.0)
    w = list(b_bar.y).index("wait")
    assert b_bar.x[w] - a_bar.x[w] == pytest.approx(15.0, abs=2.0)
    assert b_bar.text[i] == f"{d.parts.set_index('part').loc['forward', 'delta_ms']:+.2f} ms"
    app = create_compare_app(d)
    assert app.layout is not None


def test_names_from_the_traces_are_escaped_in_the_figures(runs: tuple[Path, Path]) -> None:
    d = diff_runs(analyze(open_run(runs[0])), analyze(open_run(runs[1])))
    d.tensors = d.tensors.copy()
    d.tensors.loc[d.tensors.index[0], "name"] = "<img src=x onerror=alert(1)>"
    tens = next(g for g in compare_layout(d).children if getattr(g, "id", "") == "cmp-tensors")
    labels = list(tens.figure.data[0].y)
    assert not any("<img" in y for y in labels) and any("&lt;img" in y for y in labels)


def test_the_command_takes_compare(runs: tuple[Path, Path], monkeypatch) -> None:
    args = build_parser().parse_args(["dashboard", str(runs[0]), "--compare", str(runs[1])])
    assert args.compare == str(runs[1])
    seen = {}

    def fake_serve_compare(a, b, host, port, verbose=False):
        seen["args"] = (str(a), str(b), host, port)
        return 0

    monkeypatch.setattr(dash_app, "serve_compare", fake_serve_compare)
    monkeypatch.setattr(dash_app, "_check_can_listen", lambda host, port: None)
    assert args.func(args) == 0
    assert seen["args"] == (str(runs[0]), str(runs[1]), "127.0.0.1", 8050)
