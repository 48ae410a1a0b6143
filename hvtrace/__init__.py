"""hvtrace: a profiler for Horovod training. Record every rank, merge, find the straggler.

Public API: :func:`DistributedOptimizer`, :class:`span`, :func:`scalar`, :func:`finish`,
:func:`load_run`, ``__version__``.
"""

from hvtrace.load import Run, TraceError, load_run
from hvtrace.record.optimizer import DistributedOptimizer, finish
from hvtrace.record.recorder import scalar, span

__version__ = "0.1.0"

__all__ = [
    "DistributedOptimizer",
    "Run",
    "TraceError",
    "__version__",
    "finish",
    "load_run",
    "scalar",
    "span",
]
