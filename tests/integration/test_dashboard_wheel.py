"""``hvtrace dashboard`` with no RUN_DIR from an installed wheel, outside the checkout.

The wheel is built from a copy of the sources (nothing is written into the checkout), installed
with ``--no-deps`` into a fresh virtual environment whose dependencies (Dash, plotly, DuckDB,
...) come from the test's own environment through a ``.pth`` line (no package index needed;
the editable install of the checkout is not activated there: a ``.pth`` line adds a path, it
does not run that directory's ``.pth`` files). The command is run from an empty directory, so
the only sample run it can find is the one the wheel carries; the page and its layout are
fetched over HTTP. About 20 s.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_without_run_dir_from_an_installed_wheel(tmp_path: Path) -> None:
    pytest.importorskip("dash")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "hvtrace-autotrace.pth", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("hvtrace", "hvtrace_boot", "dashboard"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(src)],
        check=True, cwd=tmp_path, capture_output=True, timeout=240,
    )  # fmt: skip
    (wheel,) = wheels.glob("hvtrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert sum(n.startswith("hvtrace_dashboard/sample/rank") for n in names) == 2, names
    assert "hvtrace_dashboard/static/plotly-cartesian.min.js" in names
    # tracing by environment: the start-up hook at the root of site-packages, and its module
    assert {"hvtrace-autotrace.pth", "hvtrace_boot/__init__.py"} <= set(names), names
    assert "hvtrace_boot/site/sitecustomize.py" in names, names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = _free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [str(venv / "bin" / "hvtrace"), "dashboard", "--port", str(port)],
            cwd=elsewhere,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(base, timeout=5) as r:
                    page = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        with urllib.request.urlopen(base + "_dash-layout", timeout=30) as r:
            layout = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait(30)
    out = log.read_text()
    # the wheel's own modules and its sample, not the checkout's
    assert f"({site}/hvtrace_dashboard/sample)" in out, out
    assert str(REPO) not in out
    assert (site / "hvtrace-autotrace.pth").is_file()
    assert "<title>hvtrace · 20261122-053616-2f908c</title>" in page
    assert "/_hvtrace/plotly-cartesian-" in page  # the vendored bundle travelled too
    text = json.dumps(layout)
    for gid in ("heatmap", "timeline", "ratio-rank", "ratio-steps", "tensors"):
        assert f'"id": "{gid}"' in text
    assert "rank 1" in text and "forward" in text  # the sample's straggler and its phase
