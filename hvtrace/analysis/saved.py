"""Analyses kept on disk: a finished run is analyzed once, not again by the next command.

``hvtrace analyze`` (with its default options) and ``hvtrace dashboard`` save the analysis of a
finished run in the user's cache, and the dashboard reads it back instead of analyzing again: a
512-rank x 10,000-step run's page then starts in seconds, not in the minute its analysis takes,
and the server holds only what the page shows (:func:`load_analysis` with ``steps_columns``).

An entry is keyed by everything the analysis depends on: the run's files (real path, size,
modification time), hvtrace's analysis code (each module's size and modification time, so that
an edited checkout never reads an older analysis), and the options. A run still being written
is never saved. Where: ``$HVTRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvtrace/analyses``, else
``~/.cache/hvtrace/analyses``; ``HVTRACE_CACHE=0`` turns it off. The directory is created
``0700``; an entry is read only when it and its files belong to this user and nobody else can
write them (the entry holds a pickle: it is trusted as the user's own file), and is written to
a new directory renamed into place, so a reader never sees half of one. At most
:data:`MAX_ENTRIES` entries are kept (the oldest used go first).

An entry: ``analysis.pkl`` (the :class:`~hvtrace.analysis.model.Analysis` without its
per-(rank, step) tables) and ``steps.parquet`` (``Analysis.steps``, read column by column).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import stat
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis.model import Analysis

log = logging.getLogger("hvtrace")

#: Entries kept in the cache (the least recently used are removed past this).
MAX_ENTRIES = 16
#: What an entry's format is; a change makes every older entry a miss.
ENTRY_FORMAT = 1
_PICKLE = "analysis.pkl"
_STEPS = "steps.parquet"


def cache_root() -> Path | None:
    """The cache's directory (None: turned off with ``HVTRACE_CACHE=0``)."""
    if os.environ.get("HVTRACE_CACHE", "").strip().lower() in {"0", "false", "off", "no"}:
        return None
    explicit = os.environ.get("HVTRACE_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hvtrace" / "analyses"


#: hvtrace's packages that no analysis runs (an edit there changes no saved analysis).
_NOT_ANALYSIS = ("record", "export", "examples")


def _code_fingerprint() -> list[Any]:
    """The modules the analysis runs (name, size, modification time): an edited checkout is
    other code; the recorder, the renderers and the examples are left out."""
    root = Path(__file__).resolve().parents[1]
    out: list[Any] = []
    for p in sorted(root.rglob("*.py")):
        if p.relative_to(root).parts[0] in _NOT_ANALYSIS:
            continue
        try:
            st = p.stat()
        except OSError:
            continue
        out.append([str(p.relative_to(root)), st.st_size, st.st_mtime_ns])
    return out


def run_key(run: Any, **options: Any) -> str | None:
    """The cache key of analyzing ``run`` (:class:`hvtrace.load.Run`) with ``options``; None
    when the run cannot be keyed (a file that vanished)."""
    from hvtrace import __version__

    files = []
    for r, rf in sorted(run.files.items()):
        try:
            st = os.stat(rf.path)
        except OSError:
            return None
        files.append([int(r), os.path.realpath(rf.path), st.st_size, st.st_mtime_ns])
    doc = {
        "format": ENTRY_FORMAT,
        "version": __version__,
        "code": _code_fingerprint(),
        "run_dir": os.path.realpath(run.run_dir),
        "run_id": str(run.run_id),
        "files": files,
        "options": {k: repr(v) for k, v in sorted(options.items())},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def default_key(run: Any) -> str | None:
    """The key of analyzing ``run`` with the default options (every step, the first left out
    as warm-up, the run's own Horovod timeline if any): what ``hvtrace dashboard`` shows and
    ``hvtrace analyze`` without options computes."""
    from hvtrace.analysis.hvd_timeline import find_timeline

    timeline = None
    try:
        tl = find_timeline(Path(run.run_dir), str(run.run_id))
        if tl is not None:
            st = os.stat(tl)
            timeline = [os.path.realpath(tl), st.st_size, st.st_mtime_ns]
    except OSError:
        return None
    return run_key(run, steps=None, skip_steps=1, horovod_timeline=timeline)


def _own_and_private(path: Path) -> bool:
    """``path`` (not followed) belongs to this user, and no one else can write it."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        return False
    return not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _root(create: bool) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    if create:
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            log.debug("analysis cache %s: %s", root, exc)
            return None
    return root if _own_and_private(root) else None


def cache_dir() -> Path | None:
    """The cache's directory, made if missing; None when it is off or not this user's alone."""
    return _root(create=True)


def save_analysis(a: Analysis, key: str | None) -> Path | None:
    """Keep ``a`` under ``key`` (:func:`run_key`); return the entry, or None when the cache is
    off, the run was still being written, or the entry could not be written (never raises)."""
    if key is None or a.in_progress:
        return None
    root = _root(create=True)
    if root is None:
        return None
    final = root / key
    tmp: Path | None = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        a.steps.to_parquet(tmp / _STEPS, index=False)
        light = replace(a, steps=a.steps.iloc[:0], summaries=None)
        with open(tmp / _PICKLE, "wb") as f:
            pickle.dump(light, f, protocol=pickle.HIGHEST_PROTOCOL)
        if final.exists():
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        tmp = None
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is no cache
        log.debug("analysis cache: cannot save %s: %s", key, exc)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _trim(root)
    return final


def load_analysis(
    key: str | None,
    steps_columns: list[str] | None = None,
    steps_types: dict[str, Any] | None = None,
) -> Analysis | None:
    """The analysis kept under ``key``, or None (no such entry, the cache off, an entry that
    is not this user's alone, or one that cannot be read). ``steps_columns``: the columns of
    ``steps`` to read (None: all); ``steps_types``: numpy dtypes to read some of them as (a
    page that draws milliseconds needs no float64: half the memory of a big run's table), each
    column read and narrowed on its own."""
    if key is None:
        return None
    root = _root(create=False)
    if root is None:
        return None
    entry = root / key
    paths = (entry, entry / _PICKLE, entry / _STEPS)
    if not all(_own_and_private(p) for p in paths):
        return None
    try:
        with open(entry / _PICKLE, "rb") as f:
            a = pickle.load(f)  # this user's own file, checked above
        if not isinstance(a, Analysis):
            return None
        cols = list(a.steps.columns) if steps_columns is None else steps_columns
        cols = [c for c in cols if c in a.steps.columns]
        a = replace(a, steps=_read_steps(entry / _STEPS, cols, steps_types or {}))
        os.utime(entry)  # used now: trimmed last
    except Exception as exc:  # noqa: BLE001 - an unreadable entry is a miss
        log.debug("analysis cache: cannot read %s: %s", entry, exc)
        return None
    return a


def _read_steps(path: Path, columns: list[str], types: dict[str, Any]) -> pd.DataFrame:
    """``columns`` of the saved step table, one at a time, each narrowed to ``types`` if given
    (so the peak is the result plus one column)."""
    import pyarrow.parquet as pq

    if not columns or columns == [c for c in columns if c not in types]:
        return pd.read_parquet(path, columns=columns)
    f = pq.ParquetFile(path)
    out: dict[str, Any] = {}
    for c in columns:
        col = f.read(columns=[c]).column(0).to_pandas()
        out[c] = col.astype(types[c]) if c in types else col
        del col
    return pd.DataFrame(out)


def _trim(root: Path, keep: int = MAX_ENTRIES) -> None:
    """Remove the least recently used entries past ``keep`` (and stale temporary ones)."""
    try:
        entries = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return
    now = time.time()
    done = []
    for p in entries:
        if p.name.startswith("."):
            try:
                if now - p.stat().st_mtime > 3600:  # a writer killed an hour ago
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass
        else:
            done.append(p)
    done.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    for p in done[keep:]:
        shutil.rmtree(p, ignore_errors=True)
