"""Horovod's module-level ``synchronize(handle)``, wrapped once to see when each handle's wait
returns.

``horovod.torch.optimizer.synchronize`` is the name Horovod's optimizers call, once per handle,
inside their ``synchronize()``. The wrapper calls Horovod's function unchanged; while a traced
optimizer is inside its own ``synchronize()`` (and only then: untraced optimizers pay one global
lookup), it appends ``(handle, monotonic_ns())`` to that optimizer's list of observed completions:
the host clock also under the CUDA timer, since what is noted is when the host saw the wait
return (an event recorded there would fire only when the stream reached it, later where the
device is behind, and would cost a record per tensor). Where
:mod:`hvtrace.record._hot` is built (and ``$HVTRACE_NATIVE`` is on when the first tracer starts)
the wrapper is its ``HandleWait``, which does the same in one compiled call; else its Python
twin, :func:`hvtrace.record.hot.handle_wait`.
"""

from __future__ import annotations

import sys
from typing import Any

from hvtrace.record.hot import handle_wait
from hvtrace.record.native import hot_module

#: The traced optimizer's tracer while it is inside its own ``synchronize()``, else None. (Not a
#: registry: the active tracer is :func:`hvtrace.record.recorder.active_tracer`.)
observer: Any = None
_patched = False


def patch_module_synchronize() -> None:
    """Install the wrapper (idempotent)."""
    global _patched
    if _patched:
        return
    import horovod.torch.optimizer as hopt

    hopt.synchronize = wrap(hopt.synchronize)
    _patched = True


def wrap(orig: Any) -> Any:
    """Horovod's ``orig`` (``synchronize(handle)``), noting when each wait returns: the compiled
    wrapper where :func:`~hvtrace.record.native.hot_module` has it, else its Python twin's closure
    (:func:`hvtrace.record.hot.handle_wait`, reading this module's :data:`observer`): the same."""
    hot = hot_module()
    if hot is not None:
        return hot.HandleWait(orig)

    return handle_wait(orig, sys.modules[__name__])
