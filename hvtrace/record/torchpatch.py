"""PyTorch's ``torch.autograd.backward``, wrapped once to see when a backward pass begins.

``loss.backward()`` (``Tensor.backward``) and Lightning's backward both call
``torch.autograd.backward`` by its module attribute, so one wrapper there sees every backward pass
from its call. It calls PyTorch's function unchanged; while a tracer with ``model=`` is active it
first calls ``observer._backward_called()``, which notes the time once per backward phase (after
the model's forward, see :meth:`hvtrace.record.optimizer.Tracer._backward_called`). Other callers
pay one global lookup.

This replaced a pre-hook registered on the output's autograd node at every forward: measured in
``bench/recorder_floor.py``, the pre-hook costs about 10 µs per step (registering it and the
autograd engine calling into Python), the wrapper under 2 µs. The difference in what is timed:
the wrapper's time is when ``backward()`` is called, before the engine prepares the graph; the
pre-hook's was when the engine ran the output's node, after it.
"""

from __future__ import annotations

import functools
from typing import Any

#: The active tracer that times backward passes (one traced with ``model=``), else None.
observer: Any = None
_patched = False


def patch_backward() -> None:
    """Install the wrapper (idempotent)."""
    global _patched
    if _patched:
        return
    import torch.autograd

    orig = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        obs = observer
        if obs is not None:
            try:
                obs._backward_called()
            except Exception as exc:  # noqa: BLE001 - never into training
                obs.fail(exc)
        return orig(*args, **kwargs)

    torch.autograd.backward = functools.update_wrapper(backward, orig)
    _patched = True
