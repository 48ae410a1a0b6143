"""The HTML report (``hvtrace analyze RUN --html report.html``) in real Chromium, from disk.

The page is opened from a ``file://`` URL with the browser's network switched off (DevTools'
offline emulation) and must draw every chart, make no request, and show a hostile tensor name
and run id from a trace file as text. Skipped only where Chromium, its driver or selenium is
missing (``scripts/setup_browser.sh`` installs them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import CHROMEDRIVER, CHROMIUM, headless_chromium, synth_module

from hvtrace.cli import main

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
EVIL = 'w</script><script>window.pwned=1</script><img src=x onerror="window.pwned=2">'

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
    pytest.mark.skipif(not CHROMEDRIVER.exists(), reason=f"{CHROMEDRIVER} is not installed"),
    pytest.mark.timeout(600),
]

#: JS: the ids of the page's chart containers, and those plotly drew (data and an SVG).
DRAWN = (
    "const ids=[...document.querySelectorAll('script[data-fig]')].map(s=>s.dataset.fig);"
    "const drawn=ids.filter(id=>{const g=document.getElementById(id);"
    "return g && g.data && g.data.length>0 && g._fullLayout && g.querySelector('.main-svg');});"
    "return [ids, drawn];"
)


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> Path:
    """A 4-rank run, rank 1 slowed in its forward, whose tensor names and run id are markup."""
    from helpers import rewrite_header as _rewrite_header

    synth = synth_module()
    out = tmp_path_factory.mktemp("hostile")
    names = synth.tensor_names
    synth.tensor_names = lambda n: [EVIL + str(i) if i == 0 else x for i, x in enumerate(names(n))]
    try:
        synth.write_synth_run(out, ranks=4, steps=30, tensors=6, ranks_per_host=2, slow_ms=20.0,
                              compact_files=False)  # fmt: skip
    finally:
        synth.tensor_names = names
    for p in out.iterdir():
        _rewrite_header(p, lambda h: {**h, "run_id": EVIL})
    return out


def test_html_report_draws_offline_and_shows_names_as_text(hostile_run: Path, tmp_path: Path):
    page = tmp_path / "report.html"
    assert main(["analyze", str(hostile_run), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "<script>window.pwned" not in text and "<img src=x" not in text
    assert text.count("Plotly.newPlot") == 1  # plotly.js once, the drawing code once
    with headless_chromium(tmp_path / "profile", "1400,1000") as drv:
        drv.execute_cdp_cmd("Network.enable", {})
        drv.execute_cdp_cmd(
            "Network.emulateNetworkConditions",
            {"offline": True, "latency": 0, "downloadThroughput": 0, "uploadThroughput": 0},
        )
        drv.get(page.as_uri())
        t0 = time.monotonic()
        ids, drawn = drv.execute_script(DRAWN)
        while len(drawn) < len(ids) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
            ids, drawn = drv.execute_script(DRAWN)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        drv.save_screenshot(str(ARTIFACTS / "html_report.png"))
        assert len(ids) >= 6 and drawn == ids, f"charts not drawn: {set(ids) - set(drawn)}"
        # no request left the page: every resource it loaded is the page itself
        res = drv.execute_script(
            "return performance.getEntriesByType('resource').map(e=>e.name)"
            ".concat(performance.getEntriesByType('navigation').map(e=>e.name))"
        )
        assert all(u.startswith("file://") for u in res), res
        assert drv.execute_script("return window.pwned === undefined")
        body = drv.execute_script("return document.body.innerText")
        assert EVIL in body  # the run id in the header, as text
        assert EVIL + "0" in body  # the tensor's name in the tensor table, as text
        # the tensor chart got the name as data, not as markup
        names = drv.execute_script(
            "const g=document.getElementById('fig-tensors');"
            "return g.data.flatMap(t=>[].concat(t.y||[], t.x||[], t.text||[])).map(String)"
        )
        assert any("&lt;/script&gt;" in n or "</script>" in n for n in names), names[:5]
        # the straggler and its figures are those of the analysis
        assert "rank 1" in drv.execute_script(
            "return document.querySelector('section table').innerText"
        )
        severe = [e["message"] for e in drv.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe


def test_html_report_of_the_sample_matches_its_json(tmp_path: Path):
    """The page renders the analysis: its straggler row and findings are the JSON report's."""
    sample = REPO / "sample_traces" / "slow_rank2_input_4rank"
    page, js = tmp_path / "r.html", tmp_path / "r.json"
    assert main(["analyze", str(sample), "--html", str(page), "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    text = page.read_text(encoding="utf-8")
    for f in report["findings"]:
        assert f["message"].replace("'", "&#x27;") in text
    s = report["stragglers"][0]
    assert f'<td class="t">rank {s["rank"]}</td>' in text
    assert len(text.encode()) < 5 << 20
