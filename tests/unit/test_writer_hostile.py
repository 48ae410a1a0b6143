"""The recorder's own files: a planted FIFO or link at its name is never opened or followed, and a
stalled file system cannot hold a rank at exit. (Issue "Hostile and broken input", classes 3, 5.)
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from helpers import make_header

from hvtrace.format.schema import KIND_CODE
from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import BackgroundWriter, TraceFile

BackgroundWriter.close.__defaults__ = (2.0,)  # the close bound (10 s in use): shorter, same path


def _name(header: dict) -> str:
    return f"rank{header['rank']:05d}-{header['run_id']}.arrows"


@pytest.mark.timeout(60)
def test_planted_fifo_or_link_disables_tracing_without_blocking(tmp_path: Path, caplog) -> None:
    header = make_header()
    fifo = tmp_path / "fifo" / _name(header)
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # opening it for writing would block forever with no reader
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "link" / _name(header)
    link.parent.mkdir()
    link.symlink_to(victim)
    for planted in (fifo, link):
        with caplog.at_level(logging.WARNING, logger="hvtrace"):
            t0 = time.monotonic()
            rec = Recorder(planted.parent, header, flush_interval_s=0.05)
            assert time.monotonic() - t0 < 5
        assert not rec.enabled
        assert any("cannot write trace file" in r.getMessage() for r in caplog.records)
        rec.add(KIND_CODE["forward"], "forward", 1, 2)  # a disabled recorder takes spans quietly
        rec.close()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert victim.read_text() == "precious"


@pytest.mark.timeout(60)
def test_a_stalled_file_system_cannot_hold_the_exit(tmp_path: Path, monkeypatch, caplog) -> None:
    rec = Recorder(tmp_path, make_header(), flush_interval_s=30)  # no flush before close
    assert rec.enabled
    rec.add(KIND_CODE["forward"], "forward", 1, 2)
    stall = threading.Event()
    monkeypatch.setattr(TraceFile, "write_batch", lambda self, batch, status: stall.wait())
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        t0 = time.monotonic()
        rec.writer.close(timeout_s=0.5)
        took = time.monotonic() - t0
    stall.set()  # let the stuck helper thread go
    assert took < 3, took
    assert any("did not finish" in r.getMessage() for r in caplog.records)


_STALLED_CHILD = r"""
import sys, threading, time
from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import BackgroundWriter, TraceFile
BackgroundWriter.close.__defaults__ = (2.0,)  # the close bound (10 s in use): shorter, same path
from hvtrace.format.schema import KIND_CODE
sys.path.insert(0, sys.argv[2])
from helpers import make_header

rec = Recorder(sys.argv[1], make_header(), flush_interval_s=0.05)
assert rec.enabled
stalled = threading.Event()
def stall(self, batch, status):  # a write that never returns, as on a hung NFS mount
    stalled.set()
    threading.Event().wait()
TraceFile.write_batch = stall
rec.add(KIND_CODE["forward"], "forward", 1, 2)
assert stalled.wait(10)
print("stalled", flush=True)
time.sleep(120)  # training goes on; the scheduler sends SIGTERM
print("SIGTERM did not end the rank", flush=True)
"""


@pytest.mark.timeout(90)
def test_sigterm_ends_a_rank_whose_trace_writes_are_stalled(tmp_path: Path) -> None:
    """The writer thread is stuck inside a write; SIGTERM (a scheduler ending the job) still ends
    the rank within the close bound, with a warning that the trace is incomplete."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED_CHILD, str(tmp_path), str(Path(__file__).parents[1])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "stalled"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, out, err)
    assert "did not end" not in out
    assert took < 7, took  # the close bound (2 s here, 10 s in use), inside any grace period
    assert "did not finish within 2 s" in err, err
