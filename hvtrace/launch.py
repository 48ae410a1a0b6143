"""``hvtrace run -- COMMAND...``: trace any launcher's command line, the training script untouched.

It runs ``COMMAND`` with ``$HVTRACE_DIR`` set (and the options' variables), so that hvtrace's
start-up hook (:mod:`hvtrace_boot`) traces every Horovod optimizer the job builds, under
``horovodrun``, ``mpirun``, Ray or any launcher that passes the environment on to its workers. When
this Python's site-packages lack the hook's ``.pth`` (an install that dropped it), the hook's
``sitecustomize`` is put first on ``$PYTHONPATH`` instead. ``mpirun`` does not pass the environment
on to ranks on other hosts: for Open MPI's and MPICH's (Hydra) the variables are added to its
command line (:func:`launcher_command`: ``-x NAME`` each, ``-genvlist NAMES``). At the end it says
where the run is and the one command that analyzes it, and exits with the command's exit code.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shlex
import signal
import site
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hvtrace.units import printable

log = logging.getLogger("hvtrace")

#: The start-up hook's file, installed at the root of site-packages.
PTH_NAME = "hvtrace-autotrace.pth"


def default_trace_dir(now: _dt.datetime | None = None) -> Path:
    """``hvtrace-runs/YYYYmmdd-HHMMSS`` under the current directory (a new one per run)."""
    now = now or _dt.datetime.now()
    return Path("hvtrace-runs") / now.strftime("%Y%m%d-%H%M%S")


def hook_installed() -> bool:
    """Whether this Python's site-packages hold the start-up hook's ``.pth``."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(Path(d, PTH_NAME).is_file() for d in dirs)


def boot_site_dir() -> Path:
    """The directory of the hook's fallback ``sitecustomize.py``."""
    import hvtrace_boot

    return Path(hvtrace_boot.__file__).parent / "site"


def traced_environment(
    base: Mapping[str, str],
    trace_dir: str | os.PathLike,
    *,
    horovod_timeline: bool = False,
    live_every: int | None = None,
    use_pth: bool | None = None,
) -> dict[str, str]:
    """``base`` with the variables that trace the command: ``$HVTRACE_DIR`` (absolute: the
    workers may start elsewhere), the options', and ``$PYTHONPATH`` led by the hook's
    ``sitecustomize`` unless ``use_pth`` (default: whether the ``.pth`` is installed here)."""
    env = dict(base)
    env["HVTRACE_DIR"] = str(Path(trace_dir).absolute())
    if horovod_timeline:
        env["HVTRACE_HOROVOD_TIMELINE"] = "1"
    if live_every is not None:
        env["HVTRACE_LIVE_EVERY"] = str(live_every)
    if use_pth is None:
        use_pth = hook_installed()
    if not use_pth:
        old = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(boot_site_dir()), old) if p)
    return env


#: Launchers that start ranks on other hosts without this environment unless told which variables.
MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun")


def launcher_command(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``command``, with the tracing variables of ``env`` (``HVTRACE*``, and ``PYTHONPATH`` where
    it carries the hook) passed on to every rank when the launcher is an ``mpirun`` that needs
    telling: Open MPI's gets ``-x NAME`` for each, MPICH's (Hydra) ``-genvlist NAME,...``; any
    other command is returned as it is (``horovodrun`` passes the environment on itself). An
    ``mpirun`` of neither kind is left as it is, with a warning saying what to pass."""
    cmd = list(command)
    if not cmd or Path(cmd[0]).name not in MPI_LAUNCHERS:
        return cmd
    names = sorted(k for k in env if k.startswith("HVTRACE"))
    if "PYTHONPATH" in env and str(boot_site_dir()) in env["PYTHONPATH"].split(os.pathsep):
        names.append("PYTHONPATH")
    try:
        out = subprocess.run(
            [cmd[0], "--version"], capture_output=True, text=True, timeout=20, env=dict(env)
        )
        version = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        version = ""
    if "Open MPI" in version or "OpenRTE" in version:
        extra = [a for n in names for a in ("-x", n)]
    elif "HYDRA" in version.upper():
        extra = ["-genvlist", ",".join(names)]
    else:
        log.warning(
            "hvtrace: %s is not Open MPI's or MPICH's: make it pass %s to ranks on other hosts",
            printable(cmd[0]),
            ", ".join(names),
        )
        return cmd
    return [cmd[0], *extra, *cmd[1:]]


def recorded_files(trace_dir: str | os.PathLike) -> list[Path]:
    """The rank files in ``trace_dir`` (:func:`hvtrace.format.read.find_trace_files`); none
    where it does not exist or holds none."""
    from hvtrace.errors import TraceError
    from hvtrace.format.read import find_trace_files

    try:
        return find_trace_files(trace_dir)
    except TraceError:
        return []


def run_traced(
    command: Sequence[str],
    trace_dir: str | os.PathLike,
    *,
    horovod_timeline: bool = False,
    live_every: int | None = None,
) -> int:
    """Run ``command`` traced into ``trace_dir``; report where the run is; return its exit code
    (128 + the signal's number when a signal ended it, as a shell does)."""
    if not command:
        raise ValueError("hvtrace run: no command given (hvtrace run [OPTIONS] -- COMMAND...)")
    env = traced_environment(
        os.environ, trace_dir, horovod_timeline=horovod_timeline, live_every=live_every
    )
    if env.get("HVTRACE", "").strip().lower() in ("0", "false", "off", "no"):
        log.warning("hvtrace: HVTRACE=%s turns tracing off; running untraced", env["HVTRACE"])
    where = printable(str(trace_dir))
    print(f"hvtrace: tracing into {where}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(launcher_command(command, env), env=env)
    except OSError as exc:
        print(f"hvtrace: cannot run {printable(command[0])}: {exc.strerror}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    # the launcher gets the signals the user sends (Ctrl-C reaches both from the terminal)
    handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handlers[sig] = signal.signal(sig, lambda num, _frame: proc.send_signal(num))
    try:
        rc = proc.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if rc < 0:
        rc = 128 - rc
    files = recorded_files(trace_dir)
    if files:
        print(
            f"hvtrace: {len(files)} rank file(s) in {where}; analyze with:\n"
            f"  hvtrace analyze {shlex.quote(where)}",
            file=sys.stderr,
        )
    else:
        print(
            f"hvtrace: nothing was recorded in {where}: the command built no Horovod "
            "DistributedOptimizer in a Python that has hvtrace installed",
            file=sys.stderr,
        )
    return rc
