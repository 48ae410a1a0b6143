"""The dashboard follows a running job (real ``horovodrun``, 2 ranks; headless Chromium).

The job runs while the page is open: rank 1 sleeps 60 ms in each forward, so the run lasts long
enough to watch. A step the ranks write after the page opened must be on the page (its heat map
and its live line) within 10 s; the timeline, left on the latest steps, follows them; and once the
job finishes and closes its files, the page says so and stops asking.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CHROMEDRIVER,
    CHROMIUM,
    REPO_ROOT,
    headless_chromium,
    horovod_unavailable_reason,
    horovodrun_path,
    job_env,
    serve_dashboard,
)

from hvtrace.follow import RunFollower

ARTIFACTS = REPO_ROOT / "tests" / "artifacts"
#: The job's steps: with rank 1's 60 ms each it runs about 22 s after its first steps. On this
#: 2-core VM at a load of 7 (the job, the browser, the dashboard and other work) the page opened
#: at step 152 (the browser started after the job's first steps, then) and the step it waited for
#: was on the page by step 221; 450 steps before the browser started with the job.
STEPS = 350

pytestmark = [
    pytest.mark.browser,
    pytest.mark.horovod,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed"),
    pytest.mark.skipif(not CHROMEDRIVER.exists(), reason=f"{CHROMEDRIVER} is not installed"),
    pytest.mark.timeout(600),
]

#: JS: the largest step on the heat map (its x values are steps: the run stays under the
#: binning limit), and the live line's text and class, and the timeline's title.
_PAGE = """
const g = document.querySelector('#heatmap .js-plotly-plot');
const xs = (g && g._fullData && g._fullData.length) ? Array.from(g._fullData[0].x) : [];
const t = document.querySelector('#timeline .js-plotly-plot');
const s = document.getElementById('live-status');
return {heat_last: xs.length ? Math.max(...xs) : -1,
        live: s ? s.textContent : null, cls: s ? s.className : null,
        timeline: (t && t.layout && t.layout.title) ? t.layout.title.text : ''};
"""


def _last_written_step(follower: RunFollower) -> int:
    """The last step every rank has written a ``step`` span for (what the page can show)."""
    run = follower.look().run
    last = []
    for rf in run.files.values():
        kinds = rf.table.column("kind").to_pylist()
        steps = rf.table.column("step").to_pylist()
        done = [s for k, s in zip(kinds, steps, strict=True) if k == "step"]
        last.append(max(done) if done else -1)
    return min(last) if len(last) == 2 else -1


def _wait(cond, timeout: float, what: str, poll: float = 0.2):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        val = cond()
        if val:
            return val, time.monotonic() - t0
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def driver(tmp_path: Path):
    """Headless Chromium, started before the job is: the page opens as soon as the job's first
    steps are on disk and the dashboard answers, and the job must still run well after that."""
    with headless_chromium(tmp_path / "profile") as d:
        yield d


def test_the_dashboard_follows_a_running_job(tmp_path: Path, driver) -> None:
    why = horovod_unavailable_reason()
    if why:
        pytest.skip(why)
    trace = tmp_path / "trace"
    cmd = [
        str(horovodrun_path()), "-np", "2", "-H", "localhost:2", "--gloo",
        sys.executable, "-m", "hvtrace.examples.train", "--trace-dir", str(trace),
        "--steps", str(STEPS), "--width", "64", "--layers", "2", "--batch-size", "16",
        "--slow-rank", "1", "--slow-ms", "60",
    ]  # fmt: skip
    job_log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - closed below
    job = subprocess.Popen(
        cmd,
        env=job_env({"OMP_NUM_THREADS": "1"}),
        cwd=str(tmp_path),
        stdin=subprocess.DEVNULL,
        stdout=job_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        follower = RunFollower(trace)

        def started() -> bool:
            try:
                return _last_written_step(follower) >= 5
            except Exception:  # noqa: BLE001 - no file yet
                return False

        _wait(started, 120, "the job's first steps")
        with serve_dashboard(trace, ARTIFACTS / "dashboard_live_server.log") as url:
            driver.get(url)
            first, _ = _wait(
                lambda: (p := driver.execute_script(_PAGE))["heat_last"] >= 0 and p,
                90,
                "the heat map",
            )
            assert first["live"] and "live" in first["live"] and "on" in first["cls"], first
            assert job.poll() is None, "the job ended before the page opened: make it longer"
            # a step written after the page opened ...
            _wait(lambda: _last_written_step(follower) > first["heat_last"] + 3, 30, "new steps")
            target = _last_written_step(follower)
            assert job.poll() is None, "the job ended too early to watch it"
            # ... is on the page within 10 s
            page, took = _wait(
                lambda: (p := driver.execute_script(_PAGE))["heat_last"] >= target and p,
                10,
                f"step {target} on the heat map",
            )
            print(
                f"\n[dashboard live] step {target} written, on the page {took:.1f} s later "
                f"(page opened at step {first['heat_last']})"
            )
            m = re.search(r"step (\d+)", page["live"])
            assert m and int(m.group(1)) >= target, page["live"]

            # the timeline, opened on the latest steps, follows them
            def timeline_last() -> int:
                title = driver.execute_script(_PAGE)["timeline"]
                m = re.search(r"steps? (\d+)(?:–(\d+))?", title)
                return int(m.group(2) or m.group(1)) if m else -1

            _wait(lambda: timeline_last() >= target - 1, 15, "the timeline to follow")
            driver.save_screenshot(str(ARTIFACTS / "dashboard_live.png"))
            # the job finishes: the page says so and stops asking
            assert job.wait(180) == 0, (tmp_path / "job.log").read_text()[-2000:]
            # (the live line comes with the timer's answer, the heat map one round trip later)
            done, _ = _wait(
                lambda: (
                    "finished" in ((p := driver.execute_script(_PAGE))["live"] or "")
                    and p["heat_last"] == STEPS - 1
                    and p
                ),
                30,
                "the page to say the run finished, with its last step",
            )
            assert "on" not in done["cls"].split(), done
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert severe == []
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        job_log.close()
