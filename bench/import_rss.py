#!/usr/bin/env python
"""What ``import hvtrace`` adds to a rank's resident memory, and why it depends on the page cache.

    .venv/bin/python bench/import_rss.py [--runs 3]

A rank that has imported torch and Horovod then imports hvtrace (which loads pyarrow's shared
libraries). Most of what that adds to its RSS is *file-backed*: pages of those libraries mapped
into the process (shared with every other process on the host that maps them, and dropped under
memory pressure), not memory hvtrace allocates. How many pages one touch maps depends on how the
kernel holds the file in its page cache: a file read whole with ``read()`` sits there in larger
folios, and a fault maps the whole folio; a file faulted in through the mapping itself is read
ahead in smaller pieces. ``ru_maxrss`` counts every mapped
page, so the same import adds different peak RSS from one machine state to the next.

Each case runs in fresh processes (``--runs`` each, median), the libraries' pages set up first:

* ``evicted``: pyarrow's shared libraries dropped from the page cache
  (``posix_fadvise(DONTNEED)``; a page another process maps stays), so the import faults them in;
* ``read``: the libraries read whole with ``read()`` after eviction, as a backup or a scan does;
* ``written``: a fresh copy of the pyarrow package (in a temporary directory, ``--tmp``) imported
  in place of the installed one, its files still in the page cache as they were written. Meant
  to reproduce the state right after ``pip install``, where ``import hvtrace`` once added
  +51.5 MB; on the development machine it measured like ``evicted`` instead, so that state's
  cause is not known.

Prints, per case, the RSS added by ``import hvtrace`` and its file-backed and anonymous parts,
and leaves the libraries evicted (the ``read`` and ``written`` cases read them whole, which would
inflate the next benchmark's peak RSS: ``overhead.py`` saw ``import hvtrace`` at +47.6 MB after
a run of this, +29.1 MB before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssFile", "RssAnon"):
                out[key] = int(rest.split()[0]) / 1024.0
    return out
import torch, horovod.torch  # noqa: F401  (a rank has these before hvtrace)
if len(sys.argv) > 1:  # a copy of pyarrow to import instead of the installed one
    sys.path.insert(0, sys.argv[1])
a = status()
import hvtrace  # noqa: F401
b = status()
print(json.dumps({k: b[k] - a[k] for k in a}))
"""


def libraries() -> list[Path]:
    """pyarrow's shared libraries (the bulk of what ``import hvtrace`` maps)."""
    import importlib.util

    spec = importlib.util.find_spec("pyarrow")
    if spec is None or spec.origin is None:
        raise SystemExit("import_rss: pyarrow is not installed")
    root = Path(spec.origin).parent
    return sorted(p for p in root.iterdir() if ".so" in p.name and p.is_file())


def evict(paths: list[Path]) -> None:
    """Drop the files' clean, unmapped pages from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_whole(paths: list[Path]) -> None:
    """Read the files whole with ``read()``, as a copy or a backup does."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass


def write_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` with plain ``write()`` calls of 64 kB, as pip extracts a wheel (no
    in-kernel copy, which fills the page cache differently)."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(1 << 16):
            fo.write(chunk)
    shutil.copymode(src, dst)


def measure(pyarrow_parent: Path | None = None) -> dict[str, float]:
    """RSS (MB) that ``import hvtrace`` adds in a fresh process: total, file-backed, anonymous
    (pyarrow imported from ``pyarrow_parent`` when given)."""
    cmd = [sys.executable, "-c", CHILD, *([str(pyarrow_parent)] if pyarrow_parent else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Measure each case and print the medians."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="fresh processes per case (median)")
    p.add_argument("--tmp", default=None, help="where the 'written' case copies pyarrow")
    args = p.parse_args(argv)
    libs = libraries()
    mb = sum(x.stat().st_size for x in libs) / 2**20
    print(f"pyarrow: {len(libs)} shared libraries, {mb:.0f} MB on disk")
    print(f"{'case':<10} {'RSS added MB':>13} {'file-backed':>12} {'anonymous':>10}  (medians)")
    for case in ("evicted", "read", "written"):
        got = []
        for _ in range(args.runs):
            evict(libs)
            if case == "read":
                read_whole(libs)
            if case != "written":
                got.append(measure())
                continue
            tmp = Path(tempfile.mkdtemp(prefix="hvtrace-import-rss-", dir=args.tmp))
            try:
                shutil.copytree(libs[0].parent, tmp / "pyarrow", copy_function=write_copy)
                got.append(measure(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        med = {k: statistics.median(g[k] for g in got) for k in ("VmRSS", "RssFile", "RssAnon")}
        rss, file_mb, anon = med["VmRSS"], med["RssFile"], med["RssAnon"]
        print(f"{case:<10} {rss:>+13.1f} {file_mb:>+12.1f} {anon:>+10.1f}")
    # the cases read the libraries whole: leave them evicted, as a rank that faults them in
    # finds them, not in large folios that would inflate the next benchmark's peak RSS
    evict(libs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
