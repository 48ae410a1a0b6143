"""Writing an output file without harming what is already there.

Every file ``hvtrace analyze`` writes (``-o``, ``--json``, ``--csv``, ``--parquet``) goes through
:func:`open_output`:

- a regular file (or a new one) is written to a temporary file created exclusively beside it
  (``mkstemp``: an unpredictable name, never a planted link followed), synced, and renamed over
  the path only when complete, so the path holds the old content or the whole new one, never a
  part; a symlink at the path is replaced, not followed;
- a character device or a FIFO (``/dev/null``, ``/dev/stdout``, a pipe) is written through, never
  replaced; a write error there (``/dev/full``) is reported;
- anything else (a directory, a socket, a block device) is refused, and so is any path that is an
  input of the analysis (one of the run's trace files): one line, exit 2, nothing changed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from hvtrace.errors import TraceError


def output_kind(path: Path) -> str:
    """``"new"`` (nothing there), ``"regular"``, ``"stream"`` (char device or FIFO: written
    through) or ``"special"`` (refused). A symlink counts as ``"regular"``: it is replaced."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "new"
    except OSError as exc:
        raise TraceError(f"{path}: cannot use as output ({exc.strerror or exc})") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.stat(path)
        except OSError:
            return "regular"  # a dangling link: replaced by the new file
        if stat.S_ISCHR(target.st_mode) or stat.S_ISFIFO(target.st_mode):
            return "stream"  # /dev/stdout and friends
        return "regular" if stat.S_ISREG(target.st_mode) else "special"
    if stat.S_ISREG(st.st_mode):
        return "regular"
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return "stream"
    return "special"


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> str:
    """Raise :class:`TraceError` (one line) when ``path`` may not be written; return its kind.

    Refused: a directory, socket or block device, and any path that is one of ``inputs`` (the
    same file, through any name or link)."""
    p = Path(path)
    kind = output_kind(p)
    if kind == "special":
        what = "a directory" if p.is_dir() else "not a regular file, a device or a FIFO"
        raise TraceError(f"{p}: cannot write the output there ({what})")
    if kind != "new":
        for src in inputs:
            try:
                same = os.path.samefile(p, src)
            except OSError:
                continue
            if same:
                raise TraceError(
                    f"{p}: is an input of this analysis ({Path(src).name}); "
                    "choose another output path"
                )
    return kind


@contextlib.contextmanager
def open_output(
    path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[BinaryIO]:
    """``with open_output(path, inputs) as f``: a binary file to write ``path``'s content into.

    See the module docstring for what happens to what is there. On an error inside the block,
    or when writing fails, the temporary file is removed and ``path`` is untouched; write errors
    become :class:`TraceError` naming ``path``.
    """
    p = Path(path)
    kind = check_output(p, inputs)
    if kind == "stream":
        try:
            with open(p, "wb") as f:  # no O_CREAT race: it exists and is a device or FIFO
                yield f
        except OSError as exc:
            raise TraceError(f"{p}: cannot write ({exc.strerror or exc})") from None
        return
    parent = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise TraceError(f"{p}: cannot write ({exc.strerror or exc})") from None
    done = False
    try:
        os.fchmod(fd, output_mode(p))  # mkstemp makes 0600; the output gets what a new file would
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        done = True
    except OSError as exc:
        raise TraceError(f"{p}: cannot write ({exc.strerror or exc})") from None
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def output_mode(path: Path) -> int:
    """The permissions of the file being replaced, else those of a new file (0666 & ~umask)."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def check_table_dir(option: str, path: str | os.PathLike, run_dir: str | os.PathLike) -> Path:
    """Before an analysis: create the tables' directory ``path`` now (:func:`make_output_dir`)
    and refuse the run directory itself for Parquet tables, whose files every later analysis of
    the run would take for damaged trace files (one-line :class:`TraceError`)."""
    d = make_output_dir(path)
    try:
        same = os.path.samefile(d, run_dir)
    except OSError:
        same = False
    if same and option == "--parquet":
        raise TraceError(
            f"{option} {d}: that is the run directory; its Parquet files would be taken for "
            "trace files by every later analysis: choose another directory"
        )
    return d


def make_output_dir(path: str | os.PathLike) -> Path:
    """Create the output directory ``path`` (and parents) if needed; refuse anything else that
    is there (one-line :class:`TraceError`)."""
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise TraceError(f"{d}: exists and is not a directory") from None
    except OSError as exc:
        raise TraceError(f"{d}: cannot create ({exc.strerror or exc})") from None
    return d
