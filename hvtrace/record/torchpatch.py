"""PyTorch's ``torch.autograd.backward``, wrapped once to see when a backward pass begins.

``loss.backward()`` (``Tensor.backward``) and Lightning's backward both call
``torch.autograd.backward`` by its module attribute, so one wrapper there sees every backward pass
from its call. It calls PyTorch's function unchanged; first it calls ``_backward_called()`` of
each tracer with ``model=`` in :data:`observers`, which notes the time once per backward phase
after that tracer's model's forward (:meth:`hvtrace.record.optimizer.Tracer._backward_called`):
with two traced optimizers (a GAN's), each sees the backward after its own model's forward.
Without a tracer it costs a global lookup and an empty loop.

A plain optimizer's tracer (:mod:`hvtrace.record.plain`: no Horovod optimizer, whose first
allreduce would mark the backward's end) also needs to know when the backward *returns*: the
objects in :data:`returns` (:func:`observe_return`) get ``_backward_returned()`` after PyTorch's
function. Without one that is a second global lookup and empty loop per backward call.

This replaced a pre-hook registered on the output's autograd node at every forward: measured in
``bench/recorder_floor.py`` on the 2-core development machine, the pre-hook cost about 15 µs per
step (registering it on a fresh node at every forward, and the autograd engine calling into
Python mid-backward), the wrapper about 0.5 µs. The difference in what is timed:
the wrapper's time is when ``backward()`` is called, before the engine prepares the graph; the
pre-hook's was when the engine ran the output's node, after it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

#: The tracers that time backward passes (those traced with ``model=``, until their finish).
observers: tuple = ()
#: What is told when a backward pass returns (a plain optimizer's step hooks, until its finish).
returns: tuple = ()
_patched = False


def observe(tracer: Any) -> None:
    """Tell ``tracer`` of every backward call from now on (installs the wrapper)."""
    global observers
    patch_backward()
    if tracer not in observers:
        observers = (*observers, tracer)


def unobserve(tracer: Any) -> None:
    """No more calls for ``tracer`` (its finish)."""
    global observers
    observers = tuple(o for o in observers if o is not tracer)


class _Returned:
    """The handle :func:`observe_return` returns: ``remove()`` stops the calls."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def remove(self) -> None:
        global returns
        returns = tuple(o for o in returns if o is not self.obj)


def observe_return(obj: Any) -> _Returned:
    """Call ``obj._backward_returned()`` after every backward call from now on (``obj.fail(exc)``
    if it raises); returns a handle whose ``remove()`` stops it."""
    global returns
    patch_backward()
    if obj not in returns:
        returns = (*returns, obj)
    return _Returned(obj)


def patch_backward() -> None:
    """Install the wrapper (idempotent)."""
    global _patched
    if _patched:
        return
    import torch.autograd

    orig = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        for obs in observers:
            try:
                obs._backward_called()
            except Exception as exc:  # noqa: BLE001 - never into training
                obs.fail(exc)
        out = orig(*args, **kwargs)
        for obs in returns:
            try:
                obs._backward_returned()
            except Exception as exc:  # noqa: BLE001 - never into training
                obs.fail(exc)
        return out

    torch.autograd.backward = functools.update_wrapper(backward, orig)
    _patched = True


#: The audit event an inert copy of hvtrace's module hook raises (:class:`ModuleHook`): nothing
#: happens unless the process installed audit hooks (``sys.addaudithook``), which then see it.
INERT_HOOK_EVENT = "hvtrace.inert_hook"


def inert_hook() -> functools.partial:
    """What a copy or a pickle of a module gets in place of hvtrace's hook: a callable that takes
    any arguments and returns None (``sys.audit`` of :data:`INERT_HOOK_EVENT`), made of the
    standard library alone, so a module saved whole (``torch.save(model)``) loads where hvtrace
    is not installed."""
    return functools.partial(sys.audit, INERT_HOOK_EVENT)


class ModuleHook(functools.partial):
    """A hook that hvtrace puts on a user's module (``register_forward_pre_hook``,
    ``register_forward_hook``): calls ``fn`` as it is called (``functools.partial``'s call, in
    C). torch keeps a module's hooks in the module's own dicts, so ``copy.deepcopy(model)`` (an
    EMA or ``torch.optim.swa_utils.AveragedModel``) and ``torch.save(model)`` copy or pickle
    them, and hvtrace's hooks hold the tracer, which neither can: both raised ``TypeError:
    cannot pickle 'Tracer' object`` where Horovod's optimizer lets them work. A copy (deep or
    pickled) of this hook is :func:`inert_hook` instead: the copied module is not traced (its
    forward is not the training model's) and needs nothing of hvtrace."""

    def __reduce__(self) -> tuple:
        # inert_hook's partial spelled out, not a reference to inert_hook: a pickle that named
        # hvtrace.record.torchpatch would need hvtrace installed to load
        return (functools.partial, (sys.audit, INERT_HOOK_EVENT))

    def __deepcopy__(self, memo: dict) -> functools.partial:
        return inert_hook()

    def __copy__(self) -> ModuleHook:
        return self
