"""The recorder's compiled hot path (:mod:`hvtrace.record._hot`), where it was built.

An optional extension (pyproject.toml): the per-allreduce wrapper, Horovod's poll called
directly, the counter reading, and the per-step hooks (``Phases``, the base class of the tracer:
its per-step state as C fields, which the Python forms read and write as attributes). Where it
is missing, or ``$HVTRACE_NATIVE`` is off, the pure-Python forms run and record the same: they
are in :mod:`hvtrace.record.hot`, part by part beside the C parts (``hvtrace/record/_hot/``),
with the tracer's base class (``hot.PhasesBase``).
"""

from __future__ import annotations

from typing import Any

from hvtrace import settings

try:
    from hvtrace.record import _hot
except ImportError:  # not built here (no C/C++ compiler at install time)
    _hot = None
if _hot is not None and getattr(_hot, "__file__", None) is None:
    # not built, in a source tree: the C sources' folder (``_hot/``) imports as a namespace
    # package, with none of the extension's types
    _hot = None


def hot_module() -> Any:
    """:mod:`hvtrace.record._hot` where it was built and ``$HVTRACE_NATIVE`` is on, else None
    (the pure-Python forms then run: the same records)."""
    return _hot if _hot is not None and settings.native_hot_path() else None
