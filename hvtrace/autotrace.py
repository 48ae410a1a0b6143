"""Tracing by environment: the patches :mod:`hvtrace_boot` applies to an unmodified job.

With ``$HVTRACE_DIR`` set (or ``HVTRACE=1``), the start-up hook calls these right after the module
they patch has loaded:

- :func:`patch_horovod_torch`: ``horovod.torch.DistributedOptimizer`` builds Horovod's optimizer
  exactly as before (same arguments, same errors) and then attaches hvtrace's tracer to it
  (:func:`hvtrace.record.optimizer.trace_optimizer`). The script gives no model, so a
  :class:`ModelFinder` stands in for it: it finds the model at its first forward (the first
  module called that holds one of the optimizer's parameters) and splits compute into input,
  forward and backward from then on, as ``model=`` does. An optimizer built by Lightning's Horovod
  strategy is left to hvtrace's Lightning callback, and ``hvtrace.DistributedOptimizer`` builds
  with Horovod's own function: a job is traced once.
- :func:`patch_lightning`: a ``Trainer(strategy="horovod")`` without
  :class:`hvtrace.lightning.HvtraceCallback` in its callbacks gets one.

Every patch passes Horovod's and Lightning's own exceptions through unchanged and catches its own:
a failure disables tracing with one warning, and the job runs as it would without hvtrace.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from hvtrace.record.optimizer import ORIGINAL_ATTR

log = logging.getLogger("hvtrace")

#: Calls of the global forward hook after which a model never found is given up (the hook is
#: removed): a script whose optimizer's parameters are in no module called.
FIND_MODEL_CALLS = 100_000

#: Modules whose calls of ``hvd.DistributedOptimizer`` are traced elsewhere (the Lightning
#: callback, which knows the LightningModule and the framework).
_TRACED_ELSEWHERE = ("pytorch_lightning.",)


def patch_horovod_torch(hvd: Any) -> None:
    """Make ``hvd.DistributedOptimizer`` (``hvd`` is ``horovod.torch``) trace what it builds."""
    original = hvd.DistributedOptimizer
    if getattr(original, ORIGINAL_ATTR, None) is not None:
        return  # patched already

    @functools.wraps(original)
    def DistributedOptimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        dist = original(optimizer, *args, **kwargs)  # Horovod's errors, unchanged
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith(_TRACED_ELSEWHERE):
            attach(dist)
        return dist

    setattr(DistributedOptimizer, ORIGINAL_ATTR, original)
    hvd.DistributedOptimizer = DistributedOptimizer


def attach(dist: Any) -> Any:
    """Trace ``dist`` (an optimizer Horovod built) with the environment's settings and a
    :class:`ModelFinder`; return the tracer or None. Never raises."""
    try:
        import horovod.torch as hvd

        from hvtrace.record.optimizer import trace_optimizer, tracing_enabled

        if not tracing_enabled() or getattr(dist, "_hvtrace", None) is not None:
            return getattr(dist, "_hvtrace", None)
        if not hvd.is_initialized():  # Horovod built it, so this is unlikely; never raise here
            log.warning("hvtrace: the optimizer was built before hvd.init(); not tracing")
            return None
        finder = ModelFinder(dist)
        tracer = trace_optimizer(dist, finder)
        if tracer is None:
            finder.close()
        return tracer
    except Exception as exc:  # noqa: BLE001 - tracing never takes the job down
        log.warning("hvtrace: could not trace by environment (%s: %s)", type(exc).__name__, exc)
        return None


class _Handle:
    """What :meth:`ModelFinder.register_forward_pre_hook` returns: ``remove()`` as torch's."""

    __slots__ = ("finder", "fn", "pre")

    def __init__(self, finder: ModelFinder, fn: Any, pre: bool) -> None:
        self.finder, self.fn, self.pre = finder, fn, pre

    def remove(self) -> None:
        self.finder._remove(self.fn, self.pre)


class ModelFinder:
    """The model, for a tracer whose script named none: the first module whose forward is called
    and that holds one of the optimizer's parameters (the outermost one: an outer module's forward
    begins before its children's). Until it is found, a global forward pre-hook of torch looks at
    each module called once (by id); then the tracer's hooks move onto that module and the global
    hook is removed. A model called in two parts by the script (an encoder, then a decoder) is
    seen as its first part: forward ends where that part ends."""

    #: The trace header's model name: not known when the header is written.
    header_name = None

    def __init__(self, dist: Any) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._params = {id(p) for group in dist.param_groups for p in group["params"]}
        self._seen: set[int] = set()
        self._calls = 0
        self.pre: list[Any] = []
        self.post: list[Any] = []
        self._moved: list[Any] = []  # the handles on the model found
        self.model: Any = None
        self._global = register_module_forward_pre_hook(self._look)

    def register_forward_pre_hook(self, fn: Any) -> _Handle:
        """Keep ``fn`` for the model's forward pre-hook (installed when it is found)."""
        self.pre.append(fn)
        return _Handle(self, fn, True)

    def register_forward_hook(self, fn: Any) -> _Handle:
        """Keep ``fn`` for the model's forward hook (installed when it is found)."""
        self.post.append(fn)
        return _Handle(self, fn, False)

    def _remove(self, fn: Any, pre: bool) -> None:
        hooks = self.pre if pre else self.post
        if fn in hooks:
            hooks.remove(fn)
        if not self.pre and not self.post:
            self.close()

    def close(self) -> None:
        """Remove every hook this finder installed."""
        if self._global is not None:
            self._global.remove()
            self._global = None
        for handle in self._moved:
            handle.remove()
        self._moved = []

    def _look(self, module: Any, args: Any) -> None:
        try:
            self._calls += 1
            key = id(module)
            if key in self._seen:
                if self._calls > FIND_MODEL_CALLS:
                    log.info("hvtrace: no module holding the optimizer's parameters was called")
                    self.close()
                return
            self._seen.add(key)
            if not any(id(p) in self._params for p in module.parameters()):
                return
            self._found(module, args)
        except Exception as exc:  # noqa: BLE001
            log.warning("hvtrace: could not find the model (%s); compute is not split", exc)
            self.close()

    def _found(self, module: Any, args: Any) -> None:
        self.model = module
        self.close()
        # torch ran this call's own pre-hooks' list already (it was read before the global hook
        # ran): call ours for this call; the forward hooks are read after forward, so they run
        for fn in self.pre:
            self._moved.append(module.register_forward_pre_hook(fn))
            fn(module, args)
        for fn in self.post:
            self._moved.append(module.register_forward_hook(fn))
        log.debug("hvtrace: the model is %s", type(module).__name__)


def patch_lightning(pl: Any) -> None:
    """Give every ``pl.Trainer(strategy="horovod")`` hvtrace's callback (``pl`` is
    ``pytorch_lightning``), unless its callbacks have one."""
    trainer_cls = pl.Trainer
    original = trainer_cls.__init__
    if getattr(original, ORIGINAL_ATTR, None) is not None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            args, kwargs = _with_callback(signature, self, args, kwargs)
        except Exception as exc:  # noqa: BLE001
            log.warning("hvtrace: could not add the Lightning callback (%s); not tracing", exc)
        original(self, *args, **kwargs)

    setattr(__init__, ORIGINAL_ATTR, original)
    trainer_cls.__init__ = __init__


def _with_callback(
    signature: inspect.Signature, trainer: Any, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """The Trainer's arguments with hvtrace's callback added when its strategy is Horovod's."""
    try:
        bound = signature.bind_partial(trainer, *args, **kwargs)
    except TypeError:  # Lightning will say what is wrong with them
        return args, kwargs
    strategy = bound.arguments.get("strategy")
    if not _is_horovod(strategy):
        return args, kwargs
    from hvtrace.lightning import HvtraceCallback

    callbacks = bound.arguments.get("callbacks")
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, list | tuple):
        callbacks = [callbacks]
    if any(isinstance(cb, HvtraceCallback) for cb in callbacks):
        return args, kwargs
    bound.arguments["callbacks"] = [*callbacks, HvtraceCallback()]
    return bound.args[1:], bound.kwargs


def _is_horovod(strategy: Any) -> bool:
    if isinstance(strategy, str):
        return strategy.strip().lower() == "horovod"
    try:
        from pytorch_lightning.strategies import HorovodStrategy
    except ImportError:
        return False
    return isinstance(strategy, HorovodStrategy)
