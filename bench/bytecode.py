"""What cached bytecode saves each process that imports hvtrace.

Where ``PYTHONDONTWRITEBYTECODE=1`` is set (this machine's environment sets it), Python never
writes ``__pycache__``: every process that imports hvtrace from a source tree (each rank of a
traced job, each ``hvtrace analyze``, each test's subprocess) compiles hvtrace's sources anew.
``make setup`` now writes the tree's bytecode (``python -m compileall``). This benchmark copies
``hvtrace`` and ``hvtrace_boot`` twice into a temporary directory, compiles one copy, and times
the same commands against each copy, alternating, in fresh interpreters with the environment's
``PYTHONDONTWRITEBYTECODE=1``:

- ``import``: ``python -c "import hvtrace, hvtrace.cli, hvtrace.analysis"``;
- ``analyze``: ``python -m hvtrace.cli analyze sample_traces/balanced_2rank``.

Prints, per command and copy, the median wall time and CPU time (user + system) over the rounds,
and the ratio of the medians::

    .venv/bin/python bench/bytecode.py --rounds 7
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS: dict[str, list[str]] = {
    "import": ["-c", "import hvtrace, hvtrace.cli, hvtrace.analysis"],
    "analyze": ["-m", "hvtrace.cli", "analyze", str(REPO / "sample_traces" / "balanced_2rank")],
}


def copy_tree(dst: Path, compiled: bool) -> Path:
    """``hvtrace`` and ``hvtrace_boot`` copied into ``dst`` (no ``__pycache__``), compiled when
    ``compiled``."""
    ignore = shutil.ignore_patterns("__pycache__")
    for pkg in ("hvtrace", "hvtrace_boot"):
        shutil.copytree(REPO / pkg, dst / pkg, ignore=ignore)
    if compiled and not compileall.compile_dir(str(dst), quiet=1):
        raise SystemExit(f"bytecode.py: compileall failed in {dst}")
    return dst


def timed(root: Path, args: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh interpreter running ``args`` with ``root`` first on the
    path and bytecode writing off."""
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, *args], env=env, cwd=root, check=True, stdout=subprocess.DEVNULL
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvtrace-bytecode-") as tmp:
        roots = {
            "source only": copy_tree(Path(tmp) / "source", compiled=False),
            "bytecode": copy_tree(Path(tmp) / "compiled", compiled=True),
        }
        got: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            order = list(roots) if r % 2 == 0 else list(reversed(roots))
            for name, cmd in COMMANDS.items():
                for arm in order:
                    got.setdefault((name, arm), []).append(timed(roots[arm], cmd))
    print(f"{args.rounds} rounds, each command in a fresh interpreter, the copies alternating")
    print("| command | copy | wall s (median) | CPU s (median) |")
    print("| --- | --- | ---: | ---: |")
    for (name, arm), runs in got.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"| {name} | {arm} | {wall:.2f} | {cpu:.2f} |")
    for name in COMMANDS:
        src = statistics.median(w for w, _ in got[name, "source only"])
        pyc = statistics.median(w for w, _ in got[name, "bytecode"])
        print(f"{name}: without cached bytecode {src / pyc:.2f}x the wall ({src - pyc:+.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
