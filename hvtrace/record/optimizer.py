"""``hvtrace.DistributedOptimizer``: Horovod's distributed optimizer, instrumented.

It builds the optimizer with ``hvd.DistributedOptimizer`` (so every Horovod option behaves as it
always does) and then wraps four seams of that one instance:

- ``_allreduce_grad_async`` / ``_grouped_allreduce_grad_async``: a gradient became ready and its
  allreduce was enqueued (this rank's arrival);
- ``synchronize``: the time blocked waiting for the allreduces (exposed communication);
- ``step``: the base optimizer's update, and the step boundary;
- Horovod's module-level ``synchronize(handle)``: when each handle's result was observed
  (:mod:`hvtrace.record.hvdpatch`).

With ``model=`` it also hooks the model's forward so compute splits into input gap, forward and
backward, and sees the backward's start where ``loss.backward()`` calls ``torch.autograd.backward``
(:mod:`hvtrace.record.torchpatch`).

At each phase boundary the training thread's CPU and run-queue counters are read once
(:mod:`hvtrace.record.cpustat`, one or two system calls), shared by the span that ends and the
span that starts there: five readings per step with ``model=`` (the step's end, forward's start
and end, synchronize's entry and exit), three without. The phases' counter intervals therefore
tile the step: input, forward, backward (or compute), wait and update add up to the step's. Their
times are each span's own, except that backward's counters run from forward's end (they include
the loss computation before ``backward()`` is called) to synchronize's entry (they include
host work after the last gradient), so backward's ``cpu_ns`` may exceed its wall time slightly.
A step whose optimizer never synchronizes (Adasum) has no counters for compute and update; with
the ``synchronize()`` + ``skip_synchronize()`` pattern, the update's counters start in ``step()``
(one more reading) and the host work between synchronize and step is in no phase.

The hot path only stores timer tokens and raw readings: a step's phase spans are collected in a
list and handed to the recorder once per step, and a ``synchronize()``'s allreduces as one
:class:`~hvtrace.record.rows.Allreduces` entry that the writer thread expands into one span per
tensor (names, bytes and dtype are looked up once per tensor, on its first allreduce). Every
wrapper records only after the wrapped call has done its work, and catches everything of its
own: a failure inside hvtrace disables tracing with one warning; exceptions of Horovod or of the
user's code pass through unchanged.

The set-up is elsewhere: the options, Horovod's internals, the timer, the header and the recorder
in :mod:`hvtrace.record.opening`, the clock handshake in :mod:`hvtrace.record.clocksync`, the
membership under Elastic Horovod in :mod:`hvtrace.record.elastic`. The hot path itself (per
allreduce, per phase boundary, per step) is in :mod:`hvtrace.record.hot` (the Python forms, the
base class :class:`~hvtrace.record.hot.TracerHooks`) beside its compiled twin
(``hvtrace/record/_hot.c`` and its parts), part by part. :class:`Tracer` has its lifecycle
together (set-up, start, finish), then what its hooks call off the hot path.
"""

from __future__ import annotations

import itertools
import logging
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvtrace import settings
from hvtrace.format.schema import DTYPE_CODE, FLAG_END_UPPER_BOUND, KIND_CODE, dtype_name
from hvtrace.record import collectives, consistency, elastic, hot, hvdpatch, torchpatch
from hvtrace.record import recorder as _recmod
from hvtrace.record.clocksync import better_estimate, handshake, sync_clocks  # noqa: F401
from hvtrace.record.hot import TracerHooks
from hvtrace.record.native import hot_module
from hvtrace.record.opening import Recording, open_recording, trace_options
from hvtrace.record.rows import handle_of
from hvtrace.record.timers import monotonic_ns

log = logging.getLogger("hvtrace")

K_USER = KIND_CODE["user"]
_SEQ = (list, tuple)  # a tuple of types: isinstance() with it is cheaper than with list | tuple
#: Tracers set up in this process so far (past the set-up collective: the same count on every
#: rank); live detection's collectives carry the number.
_SETUPS = itertools.count()

#: Steps after which the clock offsets are estimated again (then every CLOCK_RESYNC_EVERY steps).
CLOCK_RESYNC_FIRST = 1000
CLOCK_RESYNC_EVERY = 5000

# what the per-step hooks, both forms, need from hvtrace's modules (hvtrace.record.hot)
hot.configure(hvdpatch, CLOCK_RESYNC_FIRST, CLOCK_RESYNC_EVERY)


def tracing_enabled() -> bool:
    """Return False when the environment turns recording off (``HVTRACE=0``)."""
    return settings.tracing_enabled()


def DistributedOptimizer(
    optimizer: Any,
    named_parameters: Any = None,
    trace_dir: str | os.PathLike | None = None,
    model: Any = None,
    *,
    flush_interval_s: float | None = None,
    buffer_spans: int | None = None,
    clock_rounds: int = 8,
    horovod_timeline: bool | None = None,
    consistency_every: int | None = None,
    **horovod_kwargs: Any,
) -> Any:
    """Return ``hvd.DistributedOptimizer(optimizer, named_parameters, **horovod_kwargs)``, traced.

    ``trace_dir`` (else ``$HVTRACE_DIR``, else ``./hvtrace-trace``) receives one ``.arrows`` file
    per rank. ``model`` (optional) splits compute into input gap, forward and backward.
    ``HVTRACE=0`` returns Horovod's optimizer untouched. ``flush_interval_s`` (else
    ``$HVTRACE_FLUSH_S``, else 1 s) is how often the writer thread appends to the file;
    ``buffer_spans`` (else ``$HVTRACE_BUFFER_SPANS``, else 2**20) bounds the in-memory buffer:
    when the writer falls that far behind, new spans are dropped and counted, never waited for.
    ``horovod_timeline`` (else ``$HVTRACE_HOROVOD_TIMELINE``, else off) also starts Horovod's own
    timeline into ``trace_dir`` (``horovod-timeline-RUNID.json``, written by rank 0), which
    ``hvtrace analyze`` merges (see :mod:`hvtrace.analysis.hvd_timeline`); Horovod allows it only
    with ``HOROVOD_TIMELINE=DYNAMIC`` set before ``hvd.init()``, which importing hvtrace does when
    ``$HVTRACE_HOROVOD_TIMELINE`` is on.
    ``consistency_every`` (else ``$HVTRACE_CONSISTENCY_EVERY``, else 100; 0: never) is how many
    steps apart each rank records a fingerprint of its parameters (and at step 0); the learning
    rates are recorded every step (:mod:`hvtrace.record.consistency`).
    Must be called on every rank, after ``hvd.init()``: it runs a short clock collective.
    Under ``hvd.elastic.run``, call it once, outside the elastic function: recording goes on
    across resets, and a worker that joins later finds the run's id and steps
    (:mod:`hvtrace.record.elastic`).

    Accepts and rejects what ``hvd.DistributedOptimizer`` does, with Horovod's own errors (it
    builds Horovod's optimizer first: before ``hvd.init()`` that raises Horovod's ``ValueError``).
    Never raises because of tracing: where tracing cannot start (the trace cannot be written, an
    optimizer hvtrace cannot trace), a warning is logged and the optimizer works untraced.
    """
    import horovod.torch as hvd

    build = horovod_optimizer_factory(hvd)  # Horovod's own, if tracing by environment patched it
    dist = build(optimizer, named_parameters=named_parameters, **horovod_kwargs)
    if not hvd.is_initialized():  # Horovod accepted it uninitialized: so does hvtrace, untraced
        _warn("hvtrace: DistributedOptimizer() was called before hvd.init(); not tracing")
        return dist
    trace_optimizer(
        dist,
        model,
        trace_dir,
        flush_interval_s=flush_interval_s,
        buffer_spans=buffer_spans,
        clock_rounds=clock_rounds,
        horovod_timeline=horovod_timeline,
        consistency_every=consistency_every,
    )
    return dist


#: The attribute of a patched ``hvd.DistributedOptimizer`` (tracing by environment,
#: :mod:`hvtrace.autotrace`) that holds Horovod's own function.
ORIGINAL_ATTR = "_hvtrace_original"


def horovod_optimizer_factory(hvd: Any) -> Any:
    """Horovod's own ``DistributedOptimizer`` function, whether or not tracing by environment
    patched ``hvd`` (``horovod.torch``)."""
    fn = hvd.DistributedOptimizer
    return getattr(fn, ORIGINAL_ATTR, fn)


def trace_optimizer(
    dist: Any,
    model: Any = None,
    trace_dir: str | os.PathLike | None = None,
    *,
    flush_interval_s: float | None = None,
    buffer_spans: int | None = None,
    clock_rounds: int = 8,
    horovod_timeline: bool | None = None,
    consistency_every: int | None = None,
    framework: dict[str, Any] | None = None,
) -> Tracer | None:
    """Attach a :class:`Tracer` to ``dist``, a Horovod distributed optimizer built already.

    What :func:`DistributedOptimizer` does after building Horovod's optimizer, for code that
    builds it elsewhere (PyTorch Lightning's Horovod strategy, :mod:`hvtrace.lightning`): the
    clock handshake (a collective: call it on every rank, at the same point), then the tracer.
    The options are those of :func:`DistributedOptimizer`; ``model`` is anything with
    ``register_forward_pre_hook`` / ``register_forward_hook`` (a module), or None; ``framework``
    names the framework that built ``dist`` in the file's header (``{"name":
    "pytorch_lightning", "version": "1.9.5"}``), so that the analysis advises what works there.

    Returns the tracer, the one already attached if ``dist`` is traced, or None when not tracing
    (``HVTRACE=0``, Horovod not initialized, an optimizer hvtrace cannot trace, a failed handshake
    or set-up: each but the first with one warning).
    """
    import horovod.torch as hvd

    if not tracing_enabled():
        return None
    if not hvd.is_initialized():
        _warn("hvtrace: tracing was asked for before hvd.init(); not tracing")
        return None
    existing = getattr(dist, "_hvtrace", None)
    if existing is not None:
        return existing
    if not hasattr(dist, "_allreduce_grad_async") or not hasattr(dist, "_handles"):
        _warn(f"hvtrace: {type(dist).__name__} from Horovod is not supported; not tracing")
        return None
    opts = trace_options(trace_dir, flush_interval_s, buffer_spans, clock_rounds)
    try:
        run_id, clock = handshake(hvd, clock_rounds)
    except Exception as exc:  # noqa: BLE001
        _warn(f"hvtrace: clock synchronisation failed ({exc}); not tracing")
        return None
    # the set-up collective, right after the handshake on every rank (before anything that could
    # fail on one rank only): rank 0's live window, the hosts, and under Elastic Horovod the
    # survivors' state when this worker joins a running job (hvtrace.record.elastic)
    try:
        membership = elastic.setup_gather(hvd, None)
    except Exception as exc:  # noqa: BLE001
        _warn(f"hvtrace: set-up collective failed ({type(exc).__name__}: {exc}); not tracing")
        return None
    setup_index = next(_SETUPS)  # every rank has come this far, as many times
    if membership.run_id is not None:  # joining a running elastic job: its run, its steps
        run_id = membership.run_id
    recording = None
    try:
        recording = open_recording(
            dist, model, hvd, run_id, clock, opts, membership, framework=framework
        )
        tracer = Tracer(dist, model, hvd, recording, opts.clock_rounds)
    except Exception as exc:  # noqa: BLE001
        _warn(f"hvtrace: could not start tracing ({type(exc).__name__}: {exc}); not tracing")
        if recording is not None:  # the file stays, closed, with what was written
            try:
                recording.rec.close()
            except Exception:  # noqa: BLE001
                pass
        return None
    if tracer.rec.enabled and hvd.rank() == 0:
        log.info("hvtrace: recording run %s into %s", run_id, Path(opts.trace_dir).resolve())
    if tracer.rec.enabled and settings.horovod_timeline(horovod_timeline):
        tracer.start_horovod_timeline(Path(opts.trace_dir), run_id)
    if not membership.after_reset:  # after a reset live detection is off on every rank
        _start_live(tracer, membership, clock, setup_index)
    try:
        every = settings.consistency_every(consistency_every)
        tracer.checks = consistency.make_checks(tracer, every)
    except Exception as exc:  # noqa: BLE001
        tracer.fail(exc)
    # the batch each rank trains on, on the same schedule (this check alone if it fails)
    batch = consistency.make_batch_check(tracer.checks, model)
    if batch is not None:
        tracer._hooks.append(batch.handle)
    return tracer


def _warn(msg: str) -> None:
    log.warning("%s", msg)


def finish(sync_clock: bool = True) -> None:
    """Finish this process's trace: a last clock estimate (collective, on every rank), then close.

    Optional: without it the file is closed cleanly at exit, with only the start-of-run clock
    estimate (and any scheduled ones). Safe to call when not tracing.
    """
    tr = _recmod.active_tracer()
    if tr is not None:
        tr.finish(sync_clock=sync_clock)


def _step_method(hook: Callable[..., Any], dist: Any) -> Any:
    """``hook`` (the compiled ``c_step`` or the tracer's ``_step``) as a method of the optimizer
    ``dist``: what PyTorch expects ``optimizer.step`` to be. An LR scheduler built on the
    optimizer rebinds ``optimizer.step.__func__`` to the optimizer (torch's
    ``LRScheduler.__init__``); a builtin has no ``__func__`` and the tracer's own method would be
    called with the optimizer as its ``self``."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs)

    step.__doc__ = getattr(getattr(type(dist), "step", None), "__doc__", None)
    return types.MethodType(step, dist)


class Tracer(TracerHooks):
    """Attaches a :class:`~hvtrace.record.recorder.Recorder` to one Horovod distributed optimizer
    instance (set up by :func:`~hvtrace.record.opening.open_recording`).

    Its hot path is its base classes': the per-step state (the fields
    :data:`hvtrace.record.hot.PHASES_FIELDS`: the timer tokens and counter readings of the phase
    boundaries, the step's spans so far, the allreduces of the current ``synchronize()``) and the
    per-step hooks, compiled (:class:`hvtrace.record._hot.Phases`, where built: ``c_fwd_pre``,
    ``c_fwd_post``, ``c_synchronize``, ``c_step``) and in Python
    (:class:`hvtrace.record.hot.TracerHooks`: ``_fwd_pre``, ``_fwd_post``, ``_synchronize``,
    ``_step``, the enqueue wrapper), the same steps on the same fields; the compiled ones are
    installed unless ``$HVTRACE_NATIVE`` is off. Here: its lifecycle, then what the hooks call.

    Lifecycle, in the order of the methods below:

    1. built by :func:`trace_optimizer` (after the clock handshake and the set-up collective):
       :meth:`__init__` assigns the per-step state from what ``open_recording`` set up, and
       :meth:`_install` wraps Horovod's optimizer (enqueue, ``synchronize``, ``step``, the module's
       ``synchronize(handle)``), its collectives and the model's forward, with the hooks
       :meth:`hooks` picks;
    2. started by :func:`trace_optimizer`: Horovod's timeline (:meth:`start_horovod_timeline`),
       live detection (``live``) and the consistency checks (``checks``);
    3. each step, the hooks; they call :meth:`fail` (an error of hvtrace's: tracing off, training
       goes on), :meth:`_learn` (an allreduce's first time) and :meth:`resync_clock` (the
       scheduled clock collective); an elastic reset calls :meth:`drop_partial_step`;
    4. :meth:`finish` (``hvtrace.finish()``): the last clock estimate, then Horovod's timeline
       stopped, the hooks removed, the checks closed, the last spans flushed, live detection and
       the recorder closed. Without it the recorder closes the file at exit.
    """

    # -- 1. set-up: state, wrappers, hooks ---------------------------------------------------------
    def __init__(
        self, dist: Any, model: Any, hvd: Any, recording: Recording, clock_rounds: int
    ) -> None:
        """Trace ``dist`` (and ``model``, or None) with what :func:`open_recording` set up."""
        import torch

        self.dist, self.hvd, self.clock_rounds = dist, hvd, clock_rounds
        self._handle_map, self._poll = recording.handle_map, recording.poll
        self._grad_enabled = torch.is_grad_enabled
        self.timer = recording.timer
        self.is_cuda = bool(self.timer.is_cuda)
        self.flags = self.timer.flags
        self.ar_flags = self.flags | FLAG_END_UPPER_BOUND
        self.now = self.timer.now
        #: Elastic Horovod: this process's stable worker id (the key of its file) and what it
        #: knows of the membership (:class:`hvtrace.record.elastic.ElasticState`).
        self.elastic = recording.elastic
        self.worker = self.elastic.worker
        self.rec, self.read = recording.rec, recording.read
        # Even when the file could not be opened (recording disabled), the wrappers are installed:
        # they count steps so that the scheduled clock collectives stay in step on every rank.
        self.steps_done = recording.start_step
        self.rec.step = recording.start_step
        # the training thread's CPU counters: on one step in ``counter_every`` where steps are
        # short (``$HVTRACE_COUNTERS_MS``; reviewed as the steps go: hot.py's _next_counters_off)
        self._sample_counters(settings.counters_gap_ns())
        self._finished = False
        self.meta: dict[Any, tuple[list, list, list]] = {}  # allreduce key -> names, bytes, dtypes
        self.rows: list = []
        self._clear_step()
        #: While gradients are being enqueued, in-flight allreduces are polled for completion at
        #: most this often (host timer; ``$HVTRACE_POLL_US``, default 200 µs): a completion is
        #: seen within about this long of happening (or at ``synchronize``), and a model with
        #: hundreds of small tensors does not poll once per tensor.
        self.poll_interval_ns = settings.poll_interval_ns()
        self.step_start, self.step_cpu = self.now(), self.read()
        self.has_model = model is not None
        #: The model (a module, the stand-in that finds it: :class:`hvtrace.autotrace.
        #: ModelFinder`, or None): the consistency checks look for its embeddings.
        self.model = model
        #: The span name of the collective outside the optimizer this rank is blocked in, if any
        #: (:mod:`hvtrace.record.collectives`; read by the stall watchdog).
        self.in_collective: str | None = None
        #: Live straggler detection (:mod:`hvtrace.record.live`), set by trace_optimizer.
        self.live: Any = None
        self.done_rows: list = []
        #: Horovod's timeline file, when hvtrace started it (stopped at :meth:`finish`).
        self.horovod_timeline: Path | None = None
        #: The consistency checks (:mod:`hvtrace.record.consistency`), set by trace_optimizer.
        self.checks: consistency.ConsistencyChecks | None = None
        self._install(dist, model)
        self.rec.tracer = self
        _recmod._set_active(self.rec)

    def _install(self, dist: Any, model: Any) -> None:
        hvdpatch.patch_module_synchronize()
        self._orig_sync = dist.synchronize
        self._orig_step = dist.step
        dist._allreduce_grad_async = self._enqueue_wrapper(dist._allreduce_grad_async, id)
        if hasattr(dist, "_grouped_allreduce_grad_async"):
            dist._grouped_allreduce_grad_async = self._enqueue_wrapper(
                dist._grouped_allreduce_grad_async, _group_key
            )
        hooks = self.hooks()
        dist.synchronize, dist.step = hooks["synchronize"], _step_method(hooks["step"], dist)
        dist._hvtrace = self
        collectives.install(self)
        elastic.install(self)
        self._hooks = []
        if getattr(dist, "backward_passes_per_step", 1) > 1:
            # Each backward pass ends when its last gradient is ready; Horovod only enqueues on the
            # last pass, so listen on the gradient accumulators Horovod already holds.
            for acc in getattr(dist, "_grad_accs", []):
                self._hooks.append(acc.register_hook(self._grad_ready))
        if model is not None:
            self._hook_model(model)
            torchpatch.observe(self)

    def _hook_model(self, model: Any) -> None:
        """Put the forward hooks on ``model`` (their handles in ``_hooks``), each a
        :class:`~hvtrace.record.torchpatch.ModuleHook`: a copy or a pickle of the model
        (``copy.deepcopy``, ``torch.save(model)``) gets an inert hook, not the tracer."""
        hooks, wrap = self.hooks(), torchpatch.ModuleHook
        self._hooks.append(model.register_forward_pre_hook(wrap(hooks["fwd_pre"])))
        self._hooks.append(model.register_forward_hook(wrap(hooks["fwd_post"])))

    def hooks(self) -> dict[str, Any]:
        """The per-step hooks to install: the compiled ones (:mod:`hvtrace.record._hot`'s
        ``Phases``) where built and ``$HVTRACE_NATIVE`` is on, else the Python methods."""
        if hot_module() is not None:
            return {
                "fwd_pre": self.c_fwd_pre,
                "fwd_post": self.c_fwd_post,
                "synchronize": self.c_synchronize,
                "step": self.c_step,
            }
        return {
            "fwd_pre": self._fwd_pre,
            "fwd_post": self._fwd_post,
            "synchronize": self._synchronize,
            "step": self._step,
        }

    # -- 2. start, 4. finish -----------------------------------------------------------------------
    def start_horovod_timeline(self, trace_dir: Path, run_id: str) -> None:
        """Start Horovod's timeline into ``trace_dir/horovod-timeline-RUNID.json`` (Horovod's
        rank 0 writes it); a warning, never an error, when Horovod refuses. Only rank 0 starts
        it: Horovod's coordinator writes the file, with every rank's readiness in it."""
        if self.hvd.rank() != 0:
            return
        path = trace_dir / horovod_timeline_name(run_id)
        if os.path.lexists(path):  # never replace a file hvtrace did not create
            _warn(f"hvtrace: {path} exists; not starting Horovod's timeline")
            return
        try:
            self.hvd.start_timeline(str(path), mark_cycles=settings.horovod_timeline_cycles())
        except Exception as exc:  # noqa: BLE001 - Horovod's timeline is optional
            _warn(
                f"hvtrace: Horovod's timeline not started ({exc}); set HOROVOD_TIMELINE=DYNAMIC "
                "before hvd.init() (HVTRACE_HOROVOD_TIMELINE=1 does it when hvtrace is imported "
                "first)"
            )
            return
        self.horovod_timeline = path

    def finish(self, sync_clock: bool = True) -> None:
        """Estimate the clocks a last time (collective), then flush and close the trace file."""
        if sync_clock and not self._finished:
            self.resync_clock()
        self._finished = True
        if self.horovod_timeline is not None:
            try:
                self.hvd.stop_timeline()  # Horovod closes the JSON array
            except Exception:  # noqa: BLE001
                pass
            self.horovod_timeline = None
        for h in self._hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooks = []
        torchpatch.unobserve(self)
        if self.checks is not None:
            self.checks.close()
        if self.rec.enabled:
            self._flush_rows()
        if self.live is not None:
            self.live.close()
            self.live.drain()  # the verdicts on the last windows, into the log and the file
        self.rec.close()
        collectives.release(self)

    def _flush_rows(self) -> None:
        """Hand the step's spans to the recorder (one call per step)."""
        rows, self.rows = self.rows, []
        if rows:
            self.rec.extend(rows)

    # -- 3. what the hooks call, off the hot path; the phase now; an elastic reset -----------------
    def fail(self, exc: BaseException | str) -> None:
        """Disable tracing after an internal error (one warning); training goes on."""
        self.rec.fail(exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")

    def _learn(self, key: Any, arg: Any, handle_ctx: Any) -> None:
        """Note the names, bytes and dtypes of the tensors an allreduce sends (its first time)."""
        params = tuple(arg) if type(key) is tuple else (arg,)
        handle = handle_of(handle_ctx)
        sent = self._handle_map.get(handle) if type(handle) is int else None
        sent = sent[0] if sent is not None else None  # the (compressed) tensor(s) Horovod reduces
        self.meta[key] = tensor_meta(params, sent, self.dist._parameter_names)

    def resync_clock(self) -> None:
        """Estimate the clock offsets again.

        A collective: every rank runs it at the same step, whether or not its own recording is
        still enabled, so that a rank whose tracing failed never leaves the others waiting.
        """
        t0 = monotonic_ns()
        try:
            est = sync_clocks(self.hvd, self.clock_rounds)
        except Exception as exc:  # noqa: BLE001 - never raise into the training loop
            self.fail(f"clock synchronisation failed ({type(exc).__name__}: {exc})")
            return
        if self.rec.enabled:
            self.rec.add_clock(est)
            self.rec.add(K_USER, "hvtrace.clock_sync", t0, monotonic_ns())

    def phase_now(self) -> str:
        """The step phase the training thread is in now, for a collective issued now:
        ``outside`` (before the first step's work), ``input``, ``forward``, ``backward`` (up to
        ``synchronize``), ``compute`` (without ``model=``), ``wait`` or ``update`` (after the
        gradients were synchronized)."""
        if self.in_sync:
            return "wait"
        if self.fwd_start is not None:
            return "forward"
        if self.compute_closed:
            return "update"
        if self.fwd_count:
            return "backward"
        started = self.enqueued or self.last_grad is not None or self.rec.between_steps
        if self.rec.step == 0 and not started:
            return "outside"
        if not self.has_model:
            return "compute"
        return "input"

    def drop_partial_step(self) -> None:
        """Forget the step an elastic reset interrupted (its spans and allreduce handles)."""
        self.rows, self.done_rows = [], []
        self._clear_step()
        self.in_collective = None
        self.rec.micro = 0
        self.rec.between_steps = False


def _start_live(tracer: Tracer, membership: Any, clock: Any, index: int = 0) -> None:
    """Attach live detection (:mod:`hvtrace.record.live`) to the tracer, on every rank whether
    or not it records (its windows' collective must stay in step on all ranks; see
    :meth:`Tracer._count_step`), with rank 0's window (``membership``: the
    :class:`~hvtrace.record.elastic.Membership` every rank agreed on). Off with CUDA timers.
    ``index``: the tracer's set-up in this process (names its windows' collective apart from
    another tracer's)."""
    from hvtrace.record.live import LiveMonitor

    if membership.live_every > 0 and not tracer.is_cuda:
        tracer.live = LiveMonitor(
            tracer,
            membership.live_every,
            clock.offset_ns,
            membership.hosts,
            index,
            window_s=membership.live_s,
        )


def horovod_timeline_name(run_id: str) -> str:
    """The name of the Horovod timeline hvtrace starts for run ``run_id``."""
    return f"horovod-timeline-{run_id}.json"


def _group_key(params: Any) -> tuple:
    """The key of a grouped allreduce: its tensors' ids."""
    return tuple(map(id, params))


def tensor_meta(params: tuple, sent: Any, names: dict) -> tuple[list, list, list]:
    """Return (names, bytes, dtype codes) of the tensors one allreduce sends.

    ``sent``: the tensor(s) Horovod reduces (after compression), else None (the gradients).
    """
    if sent is None:
        tensors = [p.grad for p in params]
    else:
        tensors = list(sent) if isinstance(sent, _SEQ) else [sent]
    nbytes = [int(x.numel() * x.element_size()) if x is not None else 0 for x in tensors]
    dtypes = [DTYPE_CODE[dtype_name(x.dtype)] if x is not None else 0 for x in tensors]
    return [names.get(p, "?") for p in params], nbytes, dtypes
