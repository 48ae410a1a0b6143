#!/usr/bin/env python3
"""Run a command in a new time namespace whose CLOCK_MONOTONIC is offset by OFFSET_S seconds.

    timens.py OFFSET_S -- COMMAND ARGS...

``unshare --time --monotonic=N`` takes whole seconds only; this takes any offset (7.3, -0.25):
it unshares the time namespace, writes the offset (seconds and nanoseconds) to
/proc/self/timens_offsets, then forks COMMAND into the namespace and waits for it (the offset
applies to processes started in the namespace, not to the caller). Needs root (CAP_SYS_ADMIN).
The command's exit status is returned; signals are passed on to it.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys

CLONE_NEWTIME = 0x80


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    offset_s = float(argv[0])
    if not math.isfinite(offset_s):
        print("timens.py: OFFSET_S must be a finite number of seconds", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWTIME) != 0:
        err = ctypes.get_errno()
        print(f"timens.py: unshare(CLONE_NEWTIME): {os.strerror(err)}", file=sys.stderr)
        return 1
    total_ns = round(offset_s * 1e9)
    secs, nsecs = divmod(total_ns, 1_000_000_000)  # nanoseconds in [0, 1e9): -0.25 = -1 + 0.75
    with open("/proc/self/timens_offsets", "w") as f:
        f.write(f"monotonic {secs} {nsecs}\nboottime {secs} {nsecs}\n")
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[2], argv[2:])
        except OSError as exc:
            print(f"timens.py: {argv[2]}: {exc.strerror}", file=sys.stderr)
            os._exit(127)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as sh does


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
