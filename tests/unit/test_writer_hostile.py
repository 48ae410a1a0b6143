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

from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import TraceFile
from hvtrace.schema import KIND_CODE


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
    monkeypatch.setattr(TraceFile, "append", lambda self, rows, status: stall.wait())
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        t0 = time.monotonic()
        rec.writer.close(timeout_s=0.5)
        took = time.monotonic() - t0
    stall.set()  # let the stuck helper thread go
    assert took < 3, took
    assert any("did not finish" in r.getMessage() for r in caplog.records)
