"""SIGTERM with a recorder: the file is closed and the process ends as it would without hvtrace,
and a SIGTERM handler the job installs later keeps the signal (the watch thread that backs
hvtrace's handler for a main thread stuck in C never overrides it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import make_header

SCRIPT = """
import json, signal, sys, time
from hvtrace.record.recorder import Recorder
rec = Recorder(sys.argv[1], json.loads(sys.argv[4]))
if sys.argv[2] == "own":
    def graceful(signum, frame):  # a framework's checkpoint-on-SIGTERM, slower than the grace
        time.sleep(3.5)
        open(sys.argv[3], "w").write("saved")
        sys.exit(0)
    signal.signal(signal.SIGTERM, graceful)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _start(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    argv = [str(script), str(tmp_path / "trace"), mode, str(tmp_path / "marker")]
    p = subprocess.Popen(
        [sys.executable, *argv, json.dumps(make_header())],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_sigterm_closes_the_file_and_ends_the_process_as_without_hvtrace(tmp_path: Path) -> None:
    p = _start(tmp_path, "default")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    from hvtrace.format.read import read_rank_file

    (f,) = sorted((tmp_path / "trace").iterdir())[:1]
    assert read_rank_file(f).complete


def test_a_handler_the_job_installed_later_keeps_sigterm(tmp_path: Path) -> None:
    p = _start(tmp_path, "own")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0  # not ended by hvtrace's watch after its 2 s grace
    assert time.monotonic() - t0 >= 3.0
    assert (tmp_path / "marker").read_text() == "saved"
