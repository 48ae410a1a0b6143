"""``HvtraceCallback``: hvtrace for PyTorch Lightning's Horovod strategy.

Lightning (``Trainer(strategy="horovod")``, pytorch-lightning 1.9.x) builds the Horovod
distributed optimizer itself, so the one-line change is a callback::

    from hvtrace.lightning import HvtraceCallback

    trainer = pl.Trainer(strategy="horovod", callbacks=[HvtraceCallback(trace_dir="runs/exp1")])

At ``on_fit_start`` (every rank, after the strategy wrapped the optimizers) the callback attaches
hvtrace's optimizer tracer (:func:`hvtrace.record.optimizer.trace_optimizer`) to the Horovod
optimizer Lightning built, so the run records what :func:`hvtrace.DistributedOptimizer` records:
steps, input gap, forward, backward, one allreduce per tensor, the wait in ``synchronize()`` and
the update. Under automatic optimization the *forward* phase is the strategy's ``training_step``
(the module's forward and the loss, whatever the module calls inside it), and backward runs from
the loss's backward to the last gradient: Lightning runs both inside ``optimizer.step(closure)``,
and ``HorovodStrategy.post_backward`` synchronizes, so input, forward, backward, wait and update
still follow each other and tile the step. Under manual optimization the forward is the module's
own ``forward`` (as with ``model=`` on the optimizer).

Lightning's own phases are recorded as user spans (host clock, a few per step):

- ``validation``: from ``on_validation_start`` to ``on_validation_end`` (the sanity check too);
- ``checkpoint``: each ``Trainer.save_checkpoint`` (building the checkpoint, writing it on rank 0);
- ``callbacks``: each round of callback hooks outside a step's phases (``on_train_batch_start``,
  ``on_train_batch_end``, epoch and validation boundaries): every callback's hook, this one's
  included (the progress bar and ``ModelCheckpoint`` run there, on rank 0 only or not);
- ``log``: each ``LightningModule.log`` call. Under ``strategy="horovod"`` it is never a
  collective: in pytorch-lightning 1.9 ``LightningModule.log`` passes on
  ``sync_dist=sync_dist and _distributed_available()``, true only when ``torch.distributed`` is
  initialized, which Horovod does not do, so ``sync_dist=True`` reduces nothing (nor do
  torchmetrics' ``Metric`` objects sync: the same test). Average a value with
  ``hvd.allreduce(value, op=hvd.Average)`` before logging it (see ``docs/lightning.md``);
- ``logger``: each logger's ``log_metrics`` (writing metrics, on rank 0 only).

The file's header records ``framework`` (``{"name": "pytorch_lightning", "version": ...}``), so
that the analysis advises what works under Lightning. The collectives Lightning's strategy issues
for Lightning itself (``ModelCheckpoint``'s and ``EarlyStopping``'s broadcasts and reductions, the
data loaders' length check) are recorded under the Lightning function that asked for them
(``lightning:ModelCheckpoint.file_exists``: :func:`hvtrace.record.collectives.lightning_caller`).

Lightning's own state is recorded as a few scalar rows (:data:`hvtrace.format.schema.
LIGHTNING_ROWS`, read by :mod:`hvtrace.analysis.framework`): the Trainer's ``global_step`` where
it stops being hvtrace's step plus a constant (gradient accumulation, a resumed checkpoint), each
decision ``EarlyStopping`` or a monitored ``ModelCheckpoint`` asks Lightning to combine across
ranks (``strategy.reduce_boolean_decision``: the rank's own decision, the combined one, the value
its callback read), and each monitored ``ModelCheckpoint``'s best checkpoint when it changes.

Tracing never takes training down: an internal error disables it with one warning. ``HVTRACE=0``
makes the callback a no-op. The trace is finished (a last clock estimate, a collective, then the
file is closed) at ``on_fit_end``; after an exception the file is closed without it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

try:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import HorovodStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hvtrace.lightning needs pytorch-lightning 1.9.x (the last line with the Horovod "
        "strategy): pip install 'hvtrace[lightning]'"
    ) from exc

from hvtrace.format.schema import (
    BEST_CKPT_PREFIX,
    DECIDED_ON_PREFIX,
    DECISION_PREFIX,
    KIND_CODE,
    LIGHTNING_STEP,
    METRIC_PREFIX,
    MONITOR_PREFIX,
)
from hvtrace.record import live as _live
from hvtrace.record.consistency import record_agree
from hvtrace.record.optimizer import Tracer, trace_optimizer, tracing_enabled
from hvtrace.record.timers import monotonic_ns

log = logging.getLogger("hvtrace")


def _numpy2_compat() -> None:
    """Restore ``numpy.Inf`` (an alias of ``numpy.inf`` that numpy 2.0 removed), which
    pytorch-lightning 1.9.5's ``ModelCheckpoint`` and ``EarlyStopping`` use when created: without
    it ``Trainer()`` fails with checkpointing on (its default). Nothing else is changed."""
    import numpy as np

    if "Inf" not in vars(np):  # numpy 1.x has it
        np.Inf = np.inf  # type: ignore[attr-defined]


_numpy2_compat()

_K_USER = KIND_CODE["user"]
_K_SCALAR = KIND_CODE["scalar"]
#: The rounds of callback hooks after which a monitored ModelCheckpoint may have a new best
#: checkpoint (``on_train_batch_end`` too where one saves every N training steps).
_BEST_HOOKS = frozenset({"on_validation_end", "on_train_epoch_end"})

#: Callback hooks that run inside a step's phases (backward, update) or once per validation
#: batch: their time is the phase's, and they are not recorded as ``callbacks`` spans.
_IN_STEP_HOOKS = frozenset(
    {
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_exception",
        "on_fit_end",
        "teardown",
    }
)


class _Removable:
    """The handle :class:`_StepHooks` returns for a hook (``remove()``, as torch's handles)."""

    __slots__ = ("fn", "hooks")

    def __init__(self, hooks: list, fn: Callable) -> None:
        self.hooks, self.fn = hooks, fn

    def remove(self) -> None:
        if self.fn in self.hooks:
            self.hooks.remove(self.fn)


class _StepHooks:
    """The model as the tracer sees it under automatic optimization: its forward is the
    strategy's ``training_step``, whose wrapper (:meth:`HvtraceCallback._wrap_training_step`)
    calls the hooks the tracer registers here. Its class is named after the LightningModule's
    (the trace header records the model's class name)."""

    def __init__(self) -> None:
        self.pre: list[Callable] = []
        self.post: list[Callable] = []

    def register_forward_pre_hook(self, fn: Callable) -> _Removable:
        self.pre.append(fn)
        return _Removable(self.pre, fn)

    def register_forward_hook(self, fn: Callable) -> _Removable:
        self.post.append(fn)
        return _Removable(self.post, fn)

    @classmethod
    def named_after(cls, module: Any) -> _StepHooks:
        """Return hooks whose class name is ``module``'s class name."""
        return type(type(module).__name__, (cls,), {})()


class HvtraceCallback(pl.Callback):
    """Trace a Lightning ``Trainer(strategy="horovod")`` run with hvtrace (see the module doc).

    ``trace_dir`` (else ``$HVTRACE_DIR``, else ``./hvtrace-trace``) receives one file per rank;
    ``flush_interval_s``, ``buffer_spans``, ``clock_rounds`` and ``consistency_every`` are those
    of :func:`hvtrace.DistributedOptimizer`. Give it to the Trainer of every rank.

    Besides the optimizer's consistency rows (learning rates each step, parameter fingerprints
    every ``consistency_every`` steps), it records as values that must agree across ranks the
    logged metrics at each training epoch's end (``trainer.callback_metrics`` and
    ``logged_metrics``, as ``hvtrace.metric|NAME``) and the value a ``ReduceLROnPlateau``
    scheduler is stepped with (``hvtrace.monitor|NAME``, NAME the metric it monitors).
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike | None = None,
        *,
        flush_interval_s: float | None = None,
        buffer_spans: int | None = None,
        clock_rounds: int = 8,
        consistency_every: int | None = None,
    ) -> None:
        super().__init__()
        self.consistency_every = consistency_every
        self.trace_dir = trace_dir
        self.flush_interval_s = flush_interval_s
        self.buffer_spans = buffer_spans
        self.clock_rounds = clock_rounds
        #: The optimizer tracer while a fit is traced, else None.
        self.tracer: Tracer | None = None
        self._undo: list[Callable[[], None]] = []
        self._val: tuple[int, int] | None = None
        self._warned = False
        #: Rank 0, live detection on: each live window's per-step figures, put here by the live
        #: thread and logged to the Trainer's loggers on the training thread.
        self._figures: deque[tuple[int, dict[str, float]]] = deque()
        #: Lightning's global_step minus hvtrace's step at the last LIGHTNING_STEP row.
        self._step_offset: int | None = None
        #: Reads the Trainer's global_step (:func:`_global_step_reader`), from the first batch.
        self._global_step: Callable[[], int] | None = None
        #: Per monitored ModelCheckpoint (by id): the best checkpoint last recorded.
        self._best: dict[int, tuple[str, float | None]] = {}
        self._best_hooks: frozenset[str] = frozenset()

    # -- Lightning hooks -----------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach the tracer to the Horovod optimizer the strategy built (every rank)."""
        if not tracing_enabled() or self.tracer is not None:
            return
        try:
            self._start(trainer, pl_module)
        except Exception as exc:  # noqa: BLE001 - tracing never takes training down
            self._fail(exc)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Record Lightning's ``global_step`` beside hvtrace's step where it is not the last
        record's plus the steps since (:data:`hvtrace.format.schema.LIGHTNING_STEP`): one row
        per run without gradient accumulation, one per global step with it."""
        rec = self._recording()
        if rec is None:
            return
        try:
            read = self._global_step
            if read is None:
                read = self._global_step = _global_step_reader(trainer)
            step = rec.step  # the step this batch starts (or goes on with)
            offset = read() - step
            if offset != self._step_offset:
                self._step_offset = offset
                t = monotonic_ns()
                rec.add(_K_SCALAR, LIGHTNING_STEP, t, t, value=float(offset + step), step=step)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rec = self._recording()
        if rec is not None:
            self._val = (monotonic_ns(), rec.step)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rec, val, self._val = self._recording(), self._val, None
        if rec is not None and val is not None:
            rec.add(_K_USER, "validation", val[0], monotonic_ns(), step=val[1])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record the logged metrics as values that must agree across ranks (read once per
        epoch; a metric on a GPU is copied to the host here)."""
        rec = self._recording()
        if rec is None:
            return
        try:
            metrics: dict[str, Any] = {}
            for src in (trainer.callback_metrics, trainer.logged_metrics):
                for k, v in (src or {}).items():
                    metrics.setdefault(str(k), v)
            for k, v in sorted(metrics.items()):
                value = _metric_value(v)
                if value is not None:
                    record_agree(rec, METRIC_PREFIX + k, value)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """Rank 0: hand the live windows' per-step figures that came in to the Trainer's
        loggers (``hvtrace/step_ms``, ``hvtrace/late_rank``, ...: see
        :data:`hvtrace.format.tensorboard.SCALARS`), at their training steps."""
        figures = self._figures
        if not figures:
            return
        try:
            while figures:
                step, values = figures.popleft()
                for logger in trainer.loggers:
                    logger.log_metrics(dict(values), step=step)
        except Exception as exc:  # noqa: BLE001 - a logger's failure never ends training
            figures.clear()
            self._undo_figures()
            self._warn(f"hvtrace: live figures not logged any more: {type(exc).__name__}: {exc}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish the trace: a last clock estimate (collective, every rank), then close."""
        self._stop(sync_clock=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Close the trace without the clock collective (other ranks may be gone)."""
        self._stop(sync_clock=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Restore what was wrapped, if ``on_fit_end`` did not run."""
        self._stop(sync_clock=False)

    # -- set-up and shutdown -------------------------------------------------------------------
    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, HorovodStrategy):
            self._warn(
                f"hvtrace: HvtraceCallback traces Trainer(strategy='horovod') only, not "
                f"{type(strategy).__name__}; not tracing"
            )
            return
        dists = [o for o in trainer.optimizers if hasattr(o, "_allreduce_grad_async")]
        if not dists:
            self._warn("hvtrace: no Horovod optimizer in the trainer; not tracing")
            return
        manual = not pl_module.automatic_optimization
        if len(dists) > 1:
            self._warn(
                f"hvtrace: {len(dists)} optimizers; only the first is traced, and its compute "
                "is not split into forward and backward"
            )
            model: Any = None
        else:
            model = pl_module if manual else _StepHooks.named_after(pl_module)
        tracer = trace_optimizer(  # a collective: every rank gets here
            dists[0],
            model,
            self.trace_dir,
            flush_interval_s=self.flush_interval_s,
            buffer_spans=self.buffer_spans,
            clock_rounds=self.clock_rounds,
            consistency_every=self.consistency_every,
            framework={"name": "pytorch_lightning", "version": str(pl.__version__)},
        )
        if tracer is None:
            return
        self.tracer = tracer
        self._refresh_lightning_optimizers(strategy, dists[0])
        if isinstance(model, _StepHooks):
            self._wrap_training_step(strategy, pl_module, model)
        self._wrap(trainer, "save_checkpoint", self._timed("checkpoint", trainer.save_checkpoint))
        ckpts = [c for c in _checkpoints(trainer) if getattr(c, "monitor", None)]
        if ckpts:
            every = any(getattr(c, "_every_n_train_steps", 0) for c in ckpts)
            self._best_hooks = _BEST_HOOKS | ({"on_train_batch_end"} if every else set())
        self._wrap(trainer, "_call_callback_hooks", self._callback_hooks(trainer))
        self._wrap(pl_module, "log", self._timed("log", pl_module.log))
        for logger in trainer.loggers:
            if callable(getattr(logger, "log_metrics", None)):
                self._wrap(logger, "log_metrics", self._timed("logger", logger.log_metrics))
        if callable(getattr(pl_module, "lr_scheduler_step", None)):
            self._wrap(pl_module, "lr_scheduler_step", self._monitored(trainer, pl_module))
        if callable(getattr(strategy, "reduce_boolean_decision", None)):
            self._wrap(strategy, "reduce_boolean_decision", self._decisions(trainer, strategy))
        if tracer.live is not None and trainer.is_global_zero and trainer.loggers:
            _live.on_window_figures(self._figures.extend)
            self._undo.append(self._undo_figures)

    def _undo_figures(self) -> None:
        """Stop taking live figures (the listener is process-wide)."""
        listeners = _live._figure_listeners
        for cb in [cb for cb in listeners if getattr(cb, "__self__", None) is self._figures]:
            listeners.remove(cb)

    def _refresh_lightning_optimizers(self, strategy: Any, dist: Any) -> None:
        """Lightning's wrapper of the optimizer copied ``synchronize`` before the tracer wrapped
        it: point it at the traced one (a user calling ``opt.synchronize()`` on it)."""
        for lopt in getattr(strategy, "_lightning_optimizers", {}).values():
            if getattr(lopt, "_optimizer", None) is dist and "synchronize" in vars(lopt):
                self._wrap(lopt, "synchronize", dist.synchronize)

    def _stop(self, sync_clock: bool) -> None:
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort
                pass
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            try:
                tracer.finish(sync_clock=sync_clock)
            except Exception as exc:  # noqa: BLE001
                log.warning("hvtrace: finishing the trace failed: %s", exc)

    def _fail(self, exc: BaseException) -> None:
        """Disable tracing after an internal error (one warning); training goes on."""
        msg = f"HvtraceCallback: {type(exc).__name__}: {exc}"
        if self.tracer is not None:
            self.tracer.fail(msg)
        else:
            self._warn(f"hvtrace: {msg}; not tracing")

    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", msg)

    def _recording(self) -> Any:
        """The recorder when recording, else None."""
        tracer = self.tracer
        rec = tracer.rec if tracer is not None else None
        return rec if rec is not None and rec.enabled else None

    # -- wrappers (the per-step cost: a few per step) ------------------------------------------
    def _wrap(self, obj: Any, name: str, wrapper: Callable) -> None:
        """Set ``obj.name = wrapper`` on the instance; undone at the end of the fit."""
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, wrapper)

        def undo() -> None:
            if had:
                setattr(obj, name, old)
            elif name in vars(obj):
                delattr(obj, name)

        self._undo.append(undo)

    def _timed(self, name: str, fn: Callable) -> Callable:
        """``fn`` recorded as a user span ``name`` (its step: the one current at its start)."""
        rec = self.tracer.rec

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not rec.enabled:
                return fn(*args, **kwargs)
            t0, step = monotonic_ns(), rec.step
            try:
                return fn(*args, **kwargs)
            finally:
                if rec.enabled:
                    rec.add(_K_USER, name, t0, monotonic_ns(), step=step)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def _monitored(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable:
        """``pl_module.lr_scheduler_step``, recording the metric value a plateau scheduler is
        stepped with as ``hvtrace.monitor|NAME`` (a value that must agree across ranks)."""
        rec, orig = self.tracer.rec, pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            metric = args[1] if len(args) > 1 else kwargs.get("metric")
            if metric is not None and rec.enabled:
                try:
                    name = next(
                        (
                            c.monitor
                            for c in trainer.lr_scheduler_configs
                            if c.scheduler is scheduler and c.monitor
                        ),
                        "metric",
                    )
                    value = _metric_value(metric)
                    if value is not None:
                        record_agree(rec, MONITOR_PREFIX + str(name), value)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
            return orig(scheduler, *args, **kwargs)

        lr_scheduler_step.__wrapped__ = orig  # type: ignore[attr-defined]
        return lr_scheduler_step

    def _decisions(self, trainer: pl.Trainer, strategy: Any) -> Callable:
        """``strategy.reduce_boolean_decision``, recording for a callback's decision (its
        caller: EarlyStopping's stop, ModelCheckpoint's save) the rank's own decision, the
        combined one and the monitored value its callback read (the ``decision`` and
        ``decided_on`` rows of :data:`hvtrace.format.schema.LIGHTNING_ROWS`)."""
        rec, orig = self.tracer.rec, strategy.reduce_boolean_decision

        def reduce_boolean_decision(decision: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig(decision, *args, **kwargs)
            if rec.enabled:
                try:
                    self._record_decision(trainer, sys._getframe(1), decision, out)
                except Exception as exc:  # noqa: BLE001
                    self._fail(exc)
            return out

        reduce_boolean_decision.__wrapped__ = orig  # type: ignore[attr-defined]
        return reduce_boolean_decision

    def _record_decision(self, trainer: pl.Trainer, frame: Any, own: Any, out: Any) -> None:
        """One decision of a callback (the frame that asked for the reduction)."""
        cb = frame.f_locals.get("self") if frame is not None else None
        monitor = getattr(cb, "monitor", None)
        if not isinstance(cb, pl.Callback) or not monitor:
            return  # the user's own reduction, or an unmonitored one
        rec = self.tracer.rec
        step = rec.step - 1 if rec.between_steps and rec.step > 0 else rec.step
        key = f"{type(cb).__name__}|{monitor}"
        value = _metric_value(frame.f_locals.get("current"))
        t = monotonic_ns()
        g = int(trainer.global_step)
        code = float(bool(own)) + 2.0 * float(bool(out))
        rec.add(_K_SCALAR, DECISION_PREFIX + key, t, t, nbytes=g, value=code, step=step)
        if value is not None:
            rec.add(_K_SCALAR, DECIDED_ON_PREFIX + key, t, t, nbytes=g, value=value, step=step)

    def _record_best(self, trainer: pl.Trainer) -> None:
        """Each monitored ModelCheckpoint's best checkpoint, where it changed since recorded."""
        rec = self.tracer.rec
        for cb in _checkpoints(trainer):
            monitor = getattr(cb, "monitor", None)
            path = str(getattr(cb, "best_model_path", "") or "")
            if not monitor or not path:
                continue
            score = _metric_value(getattr(cb, "best_model_score", None))
            if self._best.get(id(cb)) == (path, score):
                continue
            self._best[id(cb)] = (path, score)
            step = rec.step - 1 if rec.between_steps and rec.step > 0 else rec.step
            name = f"{BEST_CKPT_PREFIX}{monitor}|{os.path.basename(path)}"
            value = score if score is not None else float("nan")
            t = monotonic_ns()
            rec.add(_K_SCALAR, name, t, t, nbytes=int(trainer.global_step), value=value, step=step)

    def _callback_hooks(self, trainer: pl.Trainer) -> Callable:
        """``Trainer._call_callback_hooks``, each round outside a step's phases recorded (and
        after the rounds where a monitored ModelCheckpoint may save, its best checkpoint)."""
        rec, orig, skip = self.tracer.rec, trainer._call_callback_hooks, _IN_STEP_HOOKS
        best = self._best_hooks

        def call_callback_hooks(hook_name: str, *args: Any, **kwargs: Any) -> Any:
            if not rec.enabled or hook_name in skip:
                return orig(hook_name, *args, **kwargs)
            t0, step = monotonic_ns(), rec.step
            try:
                return orig(hook_name, *args, **kwargs)
            finally:
                if rec.enabled:
                    rec.add(_K_USER, "callbacks", t0, monotonic_ns(), step=step)
                    if hook_name in best:
                        try:
                            self._record_best(trainer)
                        except Exception as exc:  # noqa: BLE001
                            self._fail(exc)

        return call_callback_hooks

    def _wrap_training_step(self, strategy: Any, module: Any, hooks: _StepHooks) -> None:
        """The strategy's ``training_step`` calls the tracer's forward hooks around it."""
        orig = strategy.training_step
        pre, post = hooks.pre, hooks.post

        def training_step(*args: Any, **kwargs: Any) -> Any:
            for h in pre:  # the tracer's hooks catch their own errors
                h(module, args)
            out = orig(*args, **kwargs)
            for h in post:
                h(module, args, out)
            return out

        training_step.__wrapped__ = orig  # type: ignore[attr-defined]
        self._wrap(strategy, "training_step", training_step)


def _global_step_reader(trainer: pl.Trainer) -> Callable[[], int]:
    """A function that returns ``trainer.global_step``: the counter it reads (the optimizer
    loop's progress tracker, updated in place) where it is found and agrees with the property now
    (about 0.1 us against the property's 1 us), else the property."""
    try:
        loop = trainer.fit_loop.epoch_loop.batch_loop
        if trainer.lightning_module.automatic_optimization:
            total = loop.optimizer_loop.optim_progress.optimizer.step.total
        else:
            total = loop.manual_loop.optim_step_progress.total
        if isinstance(total.completed, int) and total.completed == trainer.global_step:
            return partial(getattr, total, "completed")
    except Exception:  # noqa: BLE001 - another Lightning: the property
        pass
    return partial(getattr, trainer, "global_step")


def _checkpoints(trainer: pl.Trainer) -> list[Any]:
    """The Trainer's ModelCheckpoint callbacks."""
    return list(getattr(trainer, "checkpoint_callbacks", None) or [])


def _metric_value(v: Any) -> float | None:
    """A logged metric as a float (a one-element tensor or a number), else None."""
    if hasattr(v, "numel"):
        if v.numel() != 1:
            return None
        v = v.detach().cpu()
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


__all__ = ["HvtraceCallback"]
