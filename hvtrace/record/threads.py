"""hvtrace's background threads, named for the operating system as they are for Python.

Python names a thread for itself only (``threading.Thread(name=...)``); the kernel calls every
thread of the process by the program's name ("python"). So ``top -H``, ``ps -L``, ``perf`` and
``/proc/PID/task/*/comm`` could not tell hvtrace's writer from PyTorch's or Horovod's threads,
and a user who wants to see what hvtrace costs a rank could not find it. :class:`NamedThread`
gives the kernel the thread's Python name (its first 15 bytes, the kernel's limit) as the thread
starts, where the platform lets it (Linux's ``prctl(PR_SET_NAME)``); elsewhere, or where that
fails, nothing happens.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Any, Final

#: ``prctl``'s option that names the calling thread (linux/prctl.h).
PR_SET_NAME: Final = 15
#: The kernel keeps a thread's name in 16 bytes, the last a NUL.
OS_NAME_BYTES: Final = 15


@functools.cache
def _libc_prctl() -> Any:
    """libc's ``prctl`` (None off Linux, or where it cannot be found), looked up once, among
    the symbols the process already has (``dlopen(NULL)``): no search for the library, which
    would start ``ldconfig`` in a subprocess from a training process."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_os_thread_name(name: str) -> bool:
    """Give the calling thread ``name`` (its first 15 bytes in UTF-8) as the kernel's name for
    it; False where it could not (not Linux, no ``prctl``, or the call failed). Never raises."""
    prctl = _libc_prctl()
    if prctl is None:
        return False
    raw = name.encode("utf-8", "replace")[:OS_NAME_BYTES]
    try:
        return prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - a name is never worth an error
        return False


class NamedThread(threading.Thread):
    """A :class:`threading.Thread` that gives the kernel its name as it starts (see the module
    doc): hvtrace's writer, live and judge threads show as ``hvtrace-writer``, ``hvtrace-live``
    and ``hvtrace-judge`` in ``top -H``."""

    def run(self) -> None:
        set_os_thread_name(self.name)
        super().run()
