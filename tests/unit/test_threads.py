"""hvtrace's background threads carry their names to the kernel (hvtrace/record/threads.py)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from hvtrace.record import threads
from hvtrace.record.threads import NamedThread, set_os_thread_name
from hvtrace.record.timers import HostTimer
from hvtrace.record.writer import BackgroundWriter

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def _name_seen_by_kernel(name: str) -> tuple[str, str]:
    """Run a NamedThread called ``name``; return the kernel's name for it and for this thread."""
    seen: dict[str, str] = {}

    def look() -> None:
        seen["comm"] = _comm(threading.get_native_id())

    t = NamedThread(target=look, name=name, daemon=True)
    t.start()
    t.join(10)
    return seen["comm"], _comm(threading.get_native_id())


@linux_only
def test_a_named_thread_is_called_by_its_name_in_proc_and_the_caller_is_not_renamed() -> None:
    comm, caller = _name_seen_by_kernel("hvtrace-writer")
    assert comm == "hvtrace-writer"
    assert caller != "hvtrace-writer"


@linux_only
def test_a_long_or_non_ascii_name_is_cut_to_the_kernels_fifteen_bytes() -> None:
    comm, _ = _name_seen_by_kernel("hvtrace-a-very-long-thread-name")
    assert comm == "hvtrace-a-very-"
    comm, _ = _name_seen_by_kernel("hvtrace-ü")
    assert comm == "hvtrace-ü"


def test_without_prctl_naming_does_nothing_and_the_thread_still_runs(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_libc_prctl", lambda: None)
    assert set_os_thread_name("hvtrace-x") is False
    ran = []
    t = NamedThread(target=lambda: ran.append(1), name="hvtrace-x", daemon=True)
    t.start()
    t.join(10)
    assert ran == [1]


def test_a_failing_prctl_is_not_an_error(monkeypatch) -> None:
    def boom(*args):
        raise OSError("no")

    monkeypatch.setattr(threads, "_libc_prctl", lambda: boom)
    assert set_os_thread_name("hvtrace-x") is False


@linux_only
def test_the_writers_thread_shows_as_hvtrace_writer(tmp_path) -> None:
    w = BackgroundWriter(
        tmp_path / "r0.arrows",
        {"rank": 0},
        deque(),
        HostTimer(),
        lambda final: {"dropped": 0, "clock": [], "last_step": 0, "final": final},
        lambda exc: None,
        flush_interval_s=0.05,
    )
    try:
        deadline = time.monotonic() + 10  # the thread names itself as it starts
        while _comm(w._thread.native_id) != "hvtrace-writer" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _comm(w._thread.native_id) == "hvtrace-writer"
    finally:
        w.compact_on_close = False
        w.close()
