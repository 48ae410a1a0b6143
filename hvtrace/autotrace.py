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
- :func:`patch_plain` (with :func:`patch_horovod_torch`): a job that never builds Horovod's
  optimizer, and averages its gradients itself (``hvd.allreduce`` on each ``p.grad``, then a
  plain ``torch.optim`` optimizer), is traced through that plain optimizer: the one whose state
  the job broadcast (``hvd.broadcast_optimizer_state(opt, ...)``), else the first stepped that
  holds parameters the job broadcast (``hvd.broadcast_parameters(...)``). A broadcast is a
  collective every rank makes, so every rank has that optimizer and steps it; its tracer is
  attached at the end of its first ``step()`` (torch's global step post-hook; the clock
  handshake, a collective, runs there on every rank), and records from the next step on
  (:func:`attach_plain`, :mod:`hvtrace.record.plain`). Nothing happens once a Horovod optimizer
  is traced.

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
            if _plain.hook is not None and getattr(dist, "_hvtrace", None) is not None:
                _stop_watching()  # a Horovod optimizer is traced: no plain one will be
                remove_hook()
        return dist

    setattr(DistributedOptimizer, ORIGINAL_ATTR, original)
    hvd.DistributedOptimizer = DistributedOptimizer
    patch_plain(hvd)


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


# -- a plain optimizer: the job averages its gradients itself -----------------------------------
class _Plain:
    """What the broadcasts told of a plain optimizer to trace (see :func:`patch_plain`)."""

    def __init__(self) -> None:
        import weakref

        #: Plain optimizers whose state the job broadcast.
        self.optimizers: Any = weakref.WeakSet()
        #: The broadcast parameters' storage (``data_ptr()``) -> their names ("" when unnamed).
        self.params: dict[int, str] = {}
        #: torch's global step post-hook, once installed (until removed at a safe point).
        self.hook: Any = None
        #: The hook has done its part (it returns at once until it is removed: torch iterates
        #: the global hooks while it runs, so it cannot remove itself).
        self.done = False
        #: Inside ``hvd.broadcast_optimizer_state`` (whose own ``step()`` initializes the state).
        self.inside = 0


_plain = _Plain()


def patch_plain(hvd: Any) -> None:
    """Make ``hvd.broadcast_optimizer_state`` and ``hvd.broadcast_parameters`` (``hvd`` is
    ``horovod.torch``) note what a job without Horovod's optimizer trains with: after Horovod's
    broadcast, the optimizer (a plain one) or the parameters' storage and names; the first such
    note installs torch's global step post-hook (:func:`_first_step`). Horovod's arguments,
    results and errors pass through unchanged."""
    for fn_name in ("broadcast_optimizer_state", "broadcast_parameters"):
        original = getattr(hvd, fn_name, None)
        if not callable(original) or getattr(original, ORIGINAL_ATTR, None) is not None:
            continue
        wrapper = _broadcast_wrapper(original, fn_name == "broadcast_optimizer_state")
        setattr(wrapper, ORIGINAL_ATTR, original)
        setattr(hvd, fn_name, wrapper)


def _broadcast_wrapper(original: Any, of_state: bool) -> Any:
    @functools.wraps(original)
    def broadcast(*args: Any, **kwargs: Any) -> Any:
        if of_state:
            _plain.inside += 1
        try:
            out = original(*args, **kwargs)  # Horovod's errors, unchanged
        finally:
            if of_state:
                _plain.inside -= 1
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not caller.startswith(_TRACED_ELSEWHERE):
            first = args[0] if args else kwargs.get("optimizer" if of_state else "params")
            _note(first, of_state)
        return out

    return broadcast


def _note(what: Any, of_state: bool) -> None:
    """Note a broadcast optimizer (``of_state``) or parameters. Never raises."""
    try:
        from hvtrace.record.optimizer import tracing_enabled
        from hvtrace.record.recorder import running_tracer

        if not tracing_enabled() or running_tracer() is not None:
            return
        remove_hook()
        if _plain.done:
            return
        if of_state:
            if _is_horovod_optimizer(what):
                return
            _plain.optimizers.add(what)
        else:  # what Horovod accepts: a dict, or a list of tensors or (name, tensor) pairs
            items = list(what.items()) if isinstance(what, dict) else what
            for item in items if isinstance(items, list) else ():
                name, t = item if isinstance(item, tuple) and len(item) == 2 else ("", item)
                if hasattr(t, "data_ptr"):
                    _plain.params.setdefault(int(t.data_ptr()), str(name or ""))
        if _plain.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _plain.hook = register_optimizer_step_post_hook(_first_step)
    except Exception as exc:  # noqa: BLE001 - tracing never takes the job down
        log.warning(
            "hvtrace: could not look for a plain optimizer (%s: %s)", type(exc).__name__, exc
        )


def _is_horovod_optimizer(opt: Any) -> bool:
    return hasattr(opt, "_allreduce_grad_async") or getattr(opt, "_hvtrace", None) is not None


def _stop_watching() -> None:
    """The global hook has done its part: from now on it returns at once, until
    :func:`remove_hook` removes it outside torch's iteration of the hooks."""
    _plain.done = True


def remove_hook() -> None:
    """Remove torch's global step post-hook once it has done its part. Call it where torch is
    not iterating its global post-hooks (not from a post-hook): the next broadcast, Horovod's
    optimizer built, the traced plain optimizer's first step pre-hook."""
    if _plain.done and _plain.hook is not None:
        hook, _plain.hook = _plain.hook, None
        hook.remove()


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global step post-hook, until a tracer runs: the first plain optimizer the
    broadcasts named that finishes a ``step()`` is traced (:func:`attach_plain`)."""
    if _plain.done or _plain.inside:  # (inside: broadcast_optimizer_state's own step)
        return
    try:
        from hvtrace.record.optimizer import tracing_enabled
        from hvtrace.record.recorder import running_tracer

        if running_tracer() is not None or not tracing_enabled():
            _stop_watching()  # a Horovod optimizer is traced (or tracing is off): not needed
            return
        if _is_horovod_optimizer(optimizer):  # the job has Horovod's optimizer: not plain
            _stop_watching()
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        known = _plain.params
        if optimizer not in _plain.optimizers and not any(
            int(p.data_ptr()) in known for p in params
        ):
            return
        _stop_watching()
        names = {p: known[int(p.data_ptr())] for p in params if known.get(int(p.data_ptr()))}
        attach_plain(optimizer, names)
    except Exception as exc:  # noqa: BLE001
        _stop_watching()
        log.warning(
            "hvtrace: could not trace the plain optimizer (%s: %s)", type(exc).__name__, exc
        )


def attach_plain(optimizer: Any, names: dict[Any, str] | None = None) -> Any:
    """Trace ``optimizer``, a plain torch optimizer of a job without Horovod's (see the module
    doc), with the environment's settings and a :class:`ModelFinder`; ``names``: parameter ->
    name. A collective (the clock handshake): call it on every rank at the same point. Returns
    the tracer or None. Never raises."""
    try:
        import horovod.torch as hvd

        from hvtrace.record import plain
        from hvtrace.record.optimizer import trace_optimizer, tracing_enabled

        if not tracing_enabled() or getattr(optimizer, "_hvtrace", None) is not None:
            return getattr(optimizer, "_hvtrace", None)
        if not hvd.is_initialized():
            return None
        stand_in = plain.PlainOptimizer(optimizer, names)
        finder = ModelFinder(stand_in)
        tracer = trace_optimizer(stand_in, finder)
        if tracer is None:
            finder.close()
            return None
        plain.install(tracer, optimizer, first=remove_hook)
        if tracer.rec.enabled and hvd.rank() == 0:
            log.info(
                "hvtrace: tracing %s, a plain optimizer (no Horovod optimizer was built)",
                type(optimizer).__name__,
            )
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
