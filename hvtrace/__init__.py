"""hvtrace: a profiler for Horovod training. Record every rank, merge, find the straggler.

Public API: :func:`DistributedOptimizer`, :class:`span`, :func:`scalar`, :func:`finish`,
:func:`on_straggler`,
:func:`load_run`, ``__version__``.

``import hvtrace`` loads the recorder only (numpy, pyarrow): ``load_run`` and ``Run`` are imported
on first use, so a training rank never pays for pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hvtrace import settings as _settings

_settings.arrow_memory_on_demand()  # before pyarrow is loaded (below): see its docstring

from hvtrace.errors import TraceError  # noqa: E402
from hvtrace.record.live import on_straggler  # noqa: E402
from hvtrace.record.optimizer import DistributedOptimizer, finish  # noqa: E402
from hvtrace.record.recorder import scalar, span  # noqa: E402

if TYPE_CHECKING:
    from hvtrace.load import Run, load_run

__version__ = "0.1.0"

_settings.enable_dynamic_horovod_timeline()  # before hvd.init(): see HVTRACE_HOROVOD_TIMELINE

#: Names imported on first use: the reader needs pandas, which a training rank never loads.
_LAZY = {"Run": "hvtrace.load", "load_run": "hvtrace.load"}


def __getattr__(name: str) -> Any:
    """Import ``load_run`` and ``Run`` (and with them pandas) only when first asked for."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """Return the module's names, the lazy ones included."""
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DistributedOptimizer",
    "Run",
    "TraceError",
    "__version__",
    "finish",
    "load_run",
    "on_straggler",
    "scalar",
    "span",
]
