"""The dashboard in a real browser: ``hvtrace dashboard RUN`` in a subprocess, headless Chromium.

The run is recorded by a real ``horovodrun -np 2 --gloo`` job of the built-in model with rank 1's
forward slowed by 40 ms (``slow_rank1_run`` in ``conftest.py``, shared with
``test_analyze_cli.py``). When that is impossible here (no Horovod, or the job fails or hangs)
the committed sample run of the same kind is used, else a synthetic run written with hvtrace's
writer; the test prints which one it used. Screenshots go to ``tests/artifacts/``.

Skipped only when ``/usr/bin/chromium`` (or its driver, or selenium) is missing.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
from helpers import (
    CHROMEDRIVER,
    CHROMIUM,
    headless_chromium,
    horovod_unavailable_reason,
    serve_dashboard,
    synth_module,
)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
SAMPLE = REPO / "sample_traces" / "slow_rank1_forward_2rank"
GRAPHS = ("heatmap", "timeline", "ratio-rank", "ratio-steps", "tensors")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
    pytest.mark.skipif(not CHROMEDRIVER.exists(), reason=f"{CHROMEDRIVER} is not installed"),
    pytest.mark.timeout(900),
]


def _usable(run_dir: Path) -> bool:
    files = [p for p in run_dir.glob("rank*") if p.suffix in (".arrows", ".parquet")]
    return len(files) >= 2 and all(f.stat().st_size > 0 for f in files)


@pytest.fixture(scope="module")
def run_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """The real run (``slow_rank1_run``, recorded once a session with ``test_analyze_cli.py``);
    where Horovod is missing or its job failed, the sample run of the same kind, else a
    synthetic one."""
    why = horovod_unavailable_reason()
    if why is None:
        try:
            out = request.getfixturevalue("slow_rank1_run")
        except pytest.fail.Exception as exc:  # the job failed or hung: its tail is in exc
            why = f"horovodrun failed: {str(exc).strip().splitlines()[:1]}"
        else:
            if _usable(out):
                print(f"\n[dashboard browser test] real horovodrun run recorded in {out}")
                return out
            why = f"the horovodrun job left no usable rank files in {out}"
    if _usable(SAMPLE):
        print(f"\n[dashboard browser test] {why}; using the recorded sample run {SAMPLE}")
        return SAMPLE
    spec = importlib.util.spec_from_file_location(
        "dashboard_bench", REPO / "bench/dashboard_bench.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    synth = tmp_path_factory.mktemp("synthetic")
    bench.write_run(synth, ranks=2, steps=12, tensors=10, slow_rank=1, slow_ms=30.0)
    print(f"\n[dashboard browser test] {why}; no sample run either: synthetic run in {synth}")
    return synth


@pytest.fixture(scope="module")
def server(run_dir):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with serve_dashboard(run_dir, ARTIFACTS / "dashboard_server.log") as url:
        yield url


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with headless_chromium(tmp_path_factory.mktemp("chromium-profile"), "1400,1000") as drv:
        yield drv


def _wait(driver, js: str, *args, timeout: float = 90, what: str = "condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        val = driver.execute_script(js, *args)
        if val:
            return val
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _settled(driver, graph: str, quiet_s: float = 0.6, timeout: float = 30) -> None:
    """Wait until ``graph`` (a JS expression) keeps its size and place for ``quiet_s``: the page
    may still grow (a scroll bar appears and plotly resizes), which would move a measured click."""
    js = (
        f"const g={graph}, r=g && g.getBoundingClientRect(); "
        "return g && g._fullLayout ? [r.left, r.top, r.width, r.height, g._fullLayout.width] : null"
    )
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - t0 < timeout:
        now = driver.execute_script(js)
        if now != last:
            last, since = now, time.monotonic()
        elif now is not None and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.1)
    raise AssertionError(f"{graph} did not keep its size for {quiet_s} s within {timeout:.0f} s")


#: JS: the bars of a timeline graph as plotly drew them (each bar's middle point and its hover
#: data: kind, name, rank, step), read from the graph's full data.
_BARS = (
    "(g=>g._fullData.flatMap(t=>{const o=[];for(let i=1;i<t.x.length;i+=4)"
    "o.push({kind:t.name,text:t.text[i],rank:t.customdata[i][0],step:t.customdata[i][1]});"
    "return o;}))"
)


def _graph(gid: str) -> str:
    return f"document.querySelector('#{gid} .js-plotly-plot')"


def _screenshot(driver, name: str, full: bool = False) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    if full:
        h = int(driver.execute_script("return document.documentElement.scrollHeight"))
        driver.set_window_size(1400, min(h + 40, 6000))
        time.sleep(1.0)
    driver.save_screenshot(str(path))
    if full:
        driver.set_window_size(1400, 1000)
    return path


def _severe(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


ALL_DRAWN = (
    "return arguments[0].every(id=>{const g=document.querySelector('#'+id+' .js-plotly-plot');"
    "return g && g.data && g.data.length>0 && g._fullLayout && g.querySelector('.main-svg');});"
)


def test_dashboard_in_chromium(server, driver, run_dir):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    t0 = time.monotonic()
    driver.get(server)
    _wait(driver, ALL_DRAWN, list(GRAPHS), what="every graph to be drawn")
    first_render = time.monotonic() - t0
    print(f"[dashboard browser test] every graph drawn {first_render:.2f} s after navigation")

    # -- the page and every graph have data drawn -------------------------------------------------
    assert "hvtrace" in driver.title
    cards = driver.find_elements(By.CSS_SELECTOR, "#summary-cards .hv-card")
    assert len(cards) >= 7, [c.text for c in cards]
    labels = " ".join(c.text.lower() for c in cards)
    for key in ("ranks", "hosts", "steps", "median step", "comm/compute", "overlap", "straggler"):
        assert key in labels, labels
    assert driver.find_elements(By.CSS_SELECTOR, "#findings li")
    drawn = driver.execute_script(
        """const out = {};
        for (const id of arguments[0]) {
          const g = document.querySelector('#' + id + ' .js-plotly-plot');
          const full = g._fullData;  // typed arrays decoded
          out[id] = {traces: full.length,
                     points: full.reduce((n, t) => n + ((t.z || t.x || []).length || 0), 0),
                     heat: g.querySelectorAll('.heatmaplayer image').length,
                     bars: g.querySelectorAll('.bars path').length,
                     lines: g.querySelectorAll('.scatterlayer path.js-line').length,
                     canvas: g.querySelectorAll('canvas').length};
        }
        return out;""",
        list(GRAPHS),
    )
    print(f"[dashboard browser test] drawn: {drawn}")
    for gid, d in drawn.items():
        assert d["traces"] > 0 and d["points"] > 0, (gid, d)
    assert drawn["heatmap"]["heat"] >= 1
    assert drawn["timeline"]["lines"] >= 7  # SVG bars: one path per run of bars at least
    assert drawn["ratio-rank"]["bars"] >= 2
    assert drawn["ratio-steps"]["lines"] >= 1
    assert drawn["tensors"]["bars"] >= 2
    assert driver.find_elements(By.CSS_SELECTOR, "#straggler-table")
    _screenshot(driver, "dashboard_full.png", full=True)
    assert _severe(driver) == []

    # -- clicking a heat-map cell moves the timeline to that step ---------------------------------
    tl = _graph("timeline")
    before = driver.execute_script(
        f"const g={tl}; return [g.layout.title.text, g.layout.xaxis.range]"
    )
    steps = driver.execute_script(
        f"const g={_graph('heatmap')}; const x=g._fullData[0].x; return [x[0], x[x.length-1]]"
    )
    shown = int(driver.find_element(By.ID, "win-start").get_attribute("value"))
    target = int(steps[1]) - 1  # outside the first window (around the slowest step)
    if shown - 3 <= target <= shown + 5:  # a window of 3 around it would overlap this one
        target = int(steps[0]) + 1
    heat = driver.find_element(By.CSS_SELECTOR, "#heatmap .js-plotly-plot .nsewdrag")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", heat)
    _settled(driver, _graph("heatmap"))
    px = driver.execute_script(
        f"""const g={_graph("heatmap")}, xa=g._fullLayout.xaxis, ya=g._fullLayout.yaxis;
        const r=arguments[1].getBoundingClientRect();
        return [xa.l2p(arguments[0]) + xa._offset - (r.left - g.getBoundingClientRect().left),
                ya.l2p(1) + ya._offset - (r.top - g.getBoundingClientRect().top),
                r.width, r.height];""",
        target,
        heat,
    )
    dx, dy = px[0] - px[2] / 2, px[1] - px[3] / 2  # offsets from the element's centre
    ActionChains(driver).move_to_element_with_offset(heat, int(dx), int(dy)).click().perform()
    title = _wait(
        driver,
        f"const g={tl}; const t=g && g.layout.title.text; "
        f"return t && t !== arguments[0] && t.includes('step {target} highlighted') && t;",
        before[0],
        what=f"the timeline to open step {target}",
    )
    after = driver.execute_script(
        f"const g={tl}; return [g.layout.title.text, g.layout.xaxis.range]"
    )
    print(f"[dashboard browser test] clicked step {target}: {before} -> {after}")
    assert after[1] != before[1]
    win_start = driver.find_element(By.ID, "win-start").get_attribute("value")
    assert int(win_start) <= target < int(win_start) + 3, (win_start, title)
    step_spans = driver.execute_script(f"return {_BARS}({tl}).filter(b=>b.step==={target}).length")
    assert step_spans > 0
    _screenshot(driver, "dashboard_after_click.png")

    # -- the rank filter changes the rows of the timeline -----------------------------------------
    rows_before = driver.execute_script(f"return {tl}.layout.yaxis.ticktext")
    assert len(rows_before) >= 2
    dd = driver.find_element(By.ID, "rank-filter")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", dd)
    dd.click()
    option = _wait(
        driver,
        "return [...document.querySelectorAll('.dash-dropdown-content label.dash-dropdown-option')]"
        ".find(l => l.querySelector('input').value === '1')",
        what="the rank-filter options",
    )
    option.click()
    ActionChains(driver).send_keys(Keys.ESCAPE).perform()
    rows_after = _wait(
        driver,
        f"const t={tl}.layout.yaxis.ticktext; return t && t.length===1 && t",
        what="the timeline to show only rank 1",
    )
    print(f"[dashboard browser test] rank filter: rows {rows_before} -> {rows_after}")
    assert "1" in rows_after[0]
    ranks_in_hover = driver.execute_script(
        f"return [...new Set({_BARS}({tl}).map(b=>String(b.rank)))]"
    )
    assert ranks_in_hover == ["1"]
    _screenshot(driver, "dashboard_rank_filter.png")

    # -- changing the heat-map metric redraws it; still no console errors -------------------------
    heat_title = driver.execute_script(f"return {_graph('heatmap')}.layout.title.text")
    radios = driver.find_elements(By.CSS_SELECTOR, "#heat-metric input[type=radio]")
    other = next(r for r in radios if not r.is_selected())
    driver.execute_script("arguments[0].click()", other)
    _wait(
        driver,
        f"return {_graph('heatmap')}.layout.title.text !== arguments[0]",
        heat_title,
        what="the heat map to change metric",
    )
    assert _severe(driver) == []


@pytest.fixture(scope="module")
def big_server(tmp_path_factory):
    """``hvtrace dashboard`` on a synthetic 96-rank x 1,500-step run (1.3 M spans, Parquet)
    whose rank 40 is slowed by 20 ms in its forward."""
    run = tmp_path_factory.mktemp("big")
    synth_module().write_synth_run(run, ranks=96, steps=1500, tensors=2, slow_rank=40, slow_ms=20)
    log = tmp_path_factory.mktemp("big-log") / "server.log"
    with serve_dashboard(run, log, poll_s=0.3) as url:
        yield url


def test_big_run_is_binned_and_the_timeline_is_a_window(big_server, driver):
    """96 ranks x 1,500 steps: the heat map is binned and says so, the straggler stands out per
    rank, the timeline shows a window of 16 ranks, and a click on a binned cell opens the worst
    step of that bin, queried from the files."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver.set_window_size(1400, 1000)
    t0 = time.monotonic()
    driver.get(big_server)
    _wait(driver, ALL_DRAWN, list(GRAPHS), what="every graph to be drawn")
    print(f"[dashboard browser test] 96 x 1,500 run drawn {time.monotonic() - t0:.2f} s after nav")
    hm = _graph("heatmap")
    info = driver.execute_script(
        f"const g={hm}, t=g._fullData[0]; "
        "return [g.layout.title.text, t.z.length, t.z[0].length, g.layout.xaxis.title.text]"
    )
    assert "binned: mean of" in info[0] and info[1] == 96 and info[2] <= 500, info
    assert "steps per column" in info[3]
    per_rank = driver.execute_script(
        f"const t={_graph('ratio-rank')}._fullData[0]; return [t.name, Array.from(t.y)]"
    )
    assert per_rank[0] == "arrival lateness"
    late = per_rank[1]
    assert max(range(96), key=lambda r: late[r]) == 40
    tl = _graph("timeline")
    title = driver.execute_script(f"return {tl}.layout.title.text")
    assert "16 of 96 ranks (rank 0 and the latest to arrive" in title, title
    rows = driver.execute_script(f"return {tl}.layout.yaxis.ticktext")
    assert len(rows) == 16 and any(r.startswith("40 ") for r in rows), rows

    # a click on the straggler's row in a binned column opens that bin's worst step
    heat = driver.find_element(By.CSS_SELECTOR, "#heatmap .js-plotly-plot .nsewdrag")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", heat)
    _settled(driver, hm)
    col = 200
    px = driver.execute_script(
        f"""const g={hm}, xa=g._fullLayout.xaxis, ya=g._fullLayout.yaxis, t=g._fullData[0];
        const r=arguments[1].getBoundingClientRect(), gr=g.getBoundingClientRect();
        return [xa.l2p(t.x[arguments[0]]) + xa._offset - (r.left - gr.left),
                ya.l2p(40) + ya._offset - (r.top - gr.top), r.width, r.height,
                t.customdata[40][arguments[0]]];""",
        col,
        heat,
    )
    worst = int(px[4])
    ActionChains(driver).move_to_element_with_offset(
        heat, int(px[0] - px[2] / 2), int(px[1] - px[3] / 2)
    ).click().perform()
    title = _wait(
        driver,
        f"const t={tl}.layout.title.text; return t.includes('step {worst} highlighted') && t",
        what=f"the timeline to open step {worst}",
    )
    steps = driver.execute_script(f"return [...new Set({_BARS}({tl}).map(b=>b.step))]")
    assert worst in steps and all(abs(s - worst) <= 1 for s in steps), (title, steps)
    assert _severe(driver) == []
