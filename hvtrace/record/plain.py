"""A plain PyTorch optimizer, traced: a Horovod job that averages its gradients itself.

Some Horovod jobs never build ``hvd.DistributedOptimizer``: after ``loss.backward()`` they call
``hvd.allreduce`` (or ``hvd.allreduce_async_`` and ``hvd.synchronize``) on each ``p.grad`` and
step a plain ``torch.optim`` optimizer. Tracing by environment traces them too
(:func:`hvtrace.autotrace.attach_plain` decides which optimizer, and when); this module is what
the tracer (:class:`hvtrace.record.optimizer.Tracer`, unchanged) is attached through:

- :class:`PlainOptimizer` stands in for Horovod's optimizer: the param groups (live), the
  parameters' names, no allreduce of its own (``distributed`` False in the file's header);
- :class:`PlainSteps`: torch's own step pre- and post-hooks on the user's optimizer
  (``register_step_pre_hook`` / ``register_step_post_hook``: the optimizer's ``step`` is not
  replaced, so an LR scheduler built on it later still finds a method) mark the update and the
  step's end, as the tracer's step hook does for Horovod's (the learning rates, the consistency
  checks before the update, the update and step spans, the step count); and the backward's
  return (:func:`hvtrace.record.torchpatch.observe_return`) marks the backward's end, where
  Horovod's optimizer has its last gradient's allreduce. The allreduces the job issues itself are
  recorded by the collectives' wrappers (:mod:`hvtrace.record.collectives`), in the phase and at
  the time they are issued: after the backward, for a job that averages by hand.

Costs: torch calls two Python hooks per step (a few microseconds: ``bench/antipattern_cost.py``);
nothing is added per gradient. A failure disables tracing with one warning, as anywhere.
"""

from __future__ import annotations

from typing import Any

from hvtrace.record import torchpatch


class PlainOptimizer:
    """What the tracer reads of a Horovod optimizer, for a plain torch ``optimizer``.

    ``names``: parameter -> name (from what the job broadcast; the others unnamed). Nothing here
    is called by the job: its own optimizer is stepped, and :class:`PlainSteps` tells the tracer.
    """

    #: Not Horovod's optimizer (the header's ``optimizer.distributed``).
    distributed = False
    backward_passes_per_step = 1
    sparse_as_dense = False
    gradient_predivide_factor = 1.0
    _groups = None
    _compression = None

    def __init__(self, optimizer: Any, names: dict[Any, str] | None = None) -> None:
        self.optimizer = optimizer
        self.header_class = type(optimizer).__name__
        self.param_groups = optimizer.param_groups  # the same list: groups added later are seen
        self._parameter_names = dict(names or {})
        self._handles: dict = {}
        self._grad_accs: list = []
        self.step = optimizer.step  # replaced on this stand-in by the tracer, never called

    def synchronize(self) -> None:
        """Nothing to wait for: a plain optimizer allreduces nothing."""

    def _allreduce_grad_async(self, p: Any) -> Any:  # pragma: no cover - never called
        raise RuntimeError("a plain optimizer allreduces nothing")


class PlainSteps:
    """The step boundary of a traced plain optimizer: torch's step pre-hook (:meth:`pre`) and
    post-hook (:meth:`post`), and the backward's return (:meth:`_backward_returned`), doing for
    ``tracer`` what its step hook does around Horovod's ``step()`` (the Python forms of
    :class:`hvtrace.record.hot.TracerHooks`, on the same fields)."""

    __slots__ = ("cs", "first", "tr", "ts")

    def __init__(self, tracer: Any, first: Any = None) -> None:
        self.tr = tracer
        self.ts: Any = None
        self.cs: Any = None
        #: Called once, at the first step's pre-hook (then None).
        self.first = first

    def pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before the update: the learning rates and the checks (before the weights change), then
        the update's start."""
        tr = self.tr
        self.ts = None
        if self.first is not None:
            first, self.first = self.first, None
            try:
                first()
            except Exception as exc:  # noqa: BLE001
                tr.fail(exc)
        if not tr.rec.enabled:
            return
        if tr.checks is not None:
            tr.checks.on_step(tr.rec.step)  # never raises
        try:
            self.ts, self.cs = tr.now(), (tr._read() if tr.compute_closed else None)
            tr.sync_exit = None
        except Exception as exc:  # noqa: BLE001 - never into training
            self.ts = None
            tr.fail(exc)

    def post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After the update: close the update and the step, count it (on every rank: the
        scheduled clock collective)."""
        ts, self.ts = self.ts, None
        self.tr._after_update(ts, self.cs)

    def _backward_returned(self) -> None:
        """A backward pass returned: its gradients are all there (the backward's end)."""
        tr = self.tr
        if tr.rec.enabled and tr.fwd_count and tr.bwd_start is not None:
            tr.last_grad = tr.now()

    def fail(self, exc: BaseException) -> None:
        self.tr.fail(exc)


def install(tracer: Any, optimizer: Any, first: Any = None) -> PlainSteps:
    """Hook ``optimizer`` (a plain torch optimizer) for ``tracer``, attached to a
    :class:`PlainOptimizer` of it: the step hooks and the backward's return, removed at the
    tracer's finish; ``optimizer._hvtrace`` is the tracer. ``first``: called once, before the
    first step traced (outside torch's iteration of its global post-hooks)."""
    steps = PlainSteps(tracer, first)
    tracer._hooks.append(optimizer.register_step_pre_hook(steps.pre))
    tracer._hooks.append(optimizer.register_step_post_hook(steps.post))
    tracer._hooks.append(torchpatch.observe_return(steps))
    optimizer._hvtrace = tracer
    return steps


__all__ = ["PlainOptimizer", "PlainSteps", "install"]
