"""The recorder's hot path in Python, beside its compiled twin: one part per part of
``hvtrace/record/_hot.c``, in the same order, each naming its C twin.

Where :mod:`hvtrace.record._hot` is built and ``$HVTRACE_NATIVE`` is on
(:func:`~hvtrace.record.native.hot_module`), the compiled forms run; else these, which record
the same (tests/unit/test_phases.py, test_hot_path.py and test_cpustat.py run both forms through
the same steps; tests/integration/test_hot_path_horovod.py under real Horovod). Each is the
C twin's reference: a change to one is made to the other.

=================  ==========================================  ==================================
C part             compiled (``hvtrace.record._hot``)          Python twin (here)
=================  ==========================================  ==================================
``common.h``       ``struct Phases``: its fields               ``PHASES_FIELDS``, ``Phases``
``reader.c``       ``ThreadReader``                            ``schedstat_reader``
``enqueue.c``      ``Enqueue``, ``poll_done``                  ``TracerHooks._enqueue_wrapper``,
                                                               ``TracerHooks._poll_done``
``phases.c``       ``Phases``: ``c_fwd_pre``, ``c_fwd_post``,  ``TracerHooks``: ``_fwd_pre``,
                   ``c_synchronize``, ``c_step``, helpers      ``_fwd_post``, ``_synchronize``,
                                                               ``_step``, helpers
``lr_rows.c``      ``ph_lr_rows``                              ``LrRows.on_step``
``wait.c``         ``HandleWait``                              ``handle_wait``
``deltas.c``       ``deltas_into`` (off the hot path)          ``cpustat._deltas_py``
``module.c``       ``configure``                               ``configure``
=================  ==========================================  ==================================

(C parts under ``hvtrace/record/_hot/``.) ``TracerHooks`` is the base class of
:class:`hvtrace.record.optimizer.Tracer`, ``LrRows`` of
:class:`hvtrace.record.consistency.ConsistencyChecks`.

The modules that use them choose between the two forms, at set-up: ``cpustat._schedstat_reader``,
``Tracer.hooks`` and ``TracerHooks._enqueue_wrapper``, ``hvdpatch.wrap`` (``cpustat.deltas_columns``
at each call). Horovod's poll called
directly (``_hot.HorovodPoll``, in ``_hot/enqueue.c``) has no Python twin here: where it is not
built, Horovod's own pybind11 poll runs (:func:`hvtrace.record.opening.horovod_poll`).

The Python forms are methods of the classes that use them (the tracer, the consistency checks)
through these base classes, so each hook is one call, as before they lived here.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from hvtrace.format.schema import KIND_CODE
from hvtrace.record.native import _hot, hot_module
from hvtrace.record.rows import Allreduces
from hvtrace.record.timers import monotonic_ns

K_STEP = KIND_CODE["step"]
K_INPUT = KIND_CODE["input"]
K_FORWARD = KIND_CODE["forward"]
K_BACKWARD = KIND_CODE["backward"]
K_COMPUTE = KIND_CODE["compute"]
K_WAIT = KIND_CODE["wait"]
K_UPDATE = KIND_CODE["update"]
_K_SCALAR = KIND_CODE["scalar"]
_NAN = math.nan

# -- _hot/common.h: the Tracer's per-step state ----------------------------------------------------

#: The tracer's per-step state, declared once: the attributes that the compiled ``Phases``
#: (``_hot/common.h``'s struct, exposed by ``Phases_members`` in ``_hot/phases.c``, in this order)
#: holds as C fields and both forms of the hooks read and write; :class:`Phases` (the fallback)
#: has exactly these slots. tests/unit/test_hot_fields.py checks that the compiled type exposes
#: exactly these members: a field added on one side only fails it.
PHASES_FIELDS: tuple[str, ...] = (
    # objects (None until set)
    "rec",  # the Recorder
    "now",  # the timer's now() (time.monotonic_ns: the compiled hooks read the clock themselves)
    "read",  # the counter reading (a ThreadReader: the compiled hooks call it directly)
    "_grad_enabled",  # torch.is_grad_enabled
    "_orig_sync",  # Horovod's synchronize
    "_orig_step",  # Horovod's step
    "checks",  # the consistency checks, or None
    "live",  # live detection, or None
    "flags",  # span flags
    "ar_flags",  # allreduce span flags
    "step_start",
    "step_cpu",
    "fwd_start",
    "fwd_cpu",
    "bwd_start",
    "bwd_cpu",
    "sync_exit",
    "sync_cpu",
    "last_grad",
    "rows",
    "done_rows",
    "enqueued",
    "done",
    "meta",
    # counts (C: Py_ssize_t, long long; 0 until set)
    "fwd_count",
    "poll_idx",
    "grad_mark",
    "steps_done",
    "counter_every",  # CPU counters on the steps whose number this divides (a power of two)
    "counter_gap_ns",  # the most time between two steps that read them (0: every step)
    "counter_mark_ns",  # host ns at counter_every's last review
    # flags (C: bool; False until set)
    "compute_closed",
    "in_sync",
    "is_cuda",
    "has_model",
    "counters_off",  # the current step reads no CPU counters (its readings are None)
)


#: Steps between two reviews of how often the CPU counters are read, and the most steps between
#: two readings (C twins: ``COUNTER_REVIEW_STEPS``, ``COUNTER_MAX_EVERY`` in ``_hot/phases.c``).
COUNTER_REVIEW_STEPS = 64
COUNTER_MAX_EVERY = 64


class Phases:
    """The tracer's per-step state where :mod:`hvtrace.record._hot` is not built: the slots
    :data:`PHASES_FIELDS`, the fields of the compiled ``Phases`` (C twin: ``_hot/common.h``).
    Unlike the C fields, a slot not yet assigned raises AttributeError (the tracer assigns them
    all before its hooks are installed)."""

    __slots__ = PHASES_FIELDS


#: The tracer's base class under :class:`TracerHooks`: :class:`hvtrace.record._hot.Phases` where
#: it was built (whether or not ``$HVTRACE_NATIVE`` is on: it holds the per-step state either
#: way, and has the compiled hooks), else :class:`Phases`.
PhasesBase: type = _hot.Phases if _hot is not None else Phases


# -- _hot/reader.c: the counter reading ------------------------------------------------------------


def schedstat_reader(
    clock: Callable[[], int], fd: int, slack_ns: int
) -> Callable[[], tuple[int, bytes]]:
    """The training thread's counter reading as a closure: the CPU clock, and the schedstat line
    of ``fd`` when it may have changed by more than ``slack_ns`` since it was last read (else
    that line again; see :mod:`hvtrace.record.cpustat`). C twin: ``ThreadReader``
    (``_hot/reader.c``), which also has the switch check; ``cpustat._schedstat_reader`` picks."""
    pread, mono = os.pread, time.monotonic_ns
    # at the last pread: wall time minus CPU time (grows only while off a CPU), and the line
    off_cpu, raw = mono() - clock(), pread(fd, 64, 0)

    def read() -> tuple[int, bytes]:
        nonlocal off_cpu, raw
        t = mono()
        c = clock()
        if t - c - off_cpu > slack_ns:
            off_cpu, raw = t - c, pread(fd, 64, 0)
        return c, raw

    return read


# -- _hot/enqueue.c and _hot/phases.c: the tracer's hooks ------------------------------------------


class TracerHooks(PhasesBase):
    """The Python forms of the tracer's hot path (:class:`hvtrace.record.optimizer.Tracer` is a
    subclass): per allreduce (C twin: ``Enqueue``, ``_hot/enqueue.c``), per phase boundary and
    per step (C twins: ``Phases``'s ``c_*`` hooks and their helpers, ``_hot/phases.c``), on the
    fields of :data:`PHASES_FIELDS`. What they call that is Python's own (``fail``, ``_learn``,
    ``resync_clock``; ``poll_interval_ns`` and ``_poll``, set by the tracer) is the tracer's.
    ``_backward_called`` and ``_grad_ready`` have no C twin (they run from Python callers)."""

    def _clear_step(self) -> None:
        """The state a step begins from: no allreduce enqueued or done, no phase open, no
        forward counted (``grad_mark``: ``enqueued``'s length when the current backward pass
        began; its last gradient is the last allreduce enqueued after it, see ``_grad_end``).
        Set when the tracer is made, and again when an elastic reset drops a partial step."""
        self.enqueued, self.done, self.poll_idx, self.grad_mark = [], [], 0, 0
        self.fwd_start = self.fwd_cpu = self.bwd_start = self.bwd_cpu = None
        self.sync_exit = self.sync_cpu = self.last_grad = None
        self.fwd_count = 0
        self.compute_closed = self.in_sync = self.counters_off = False

    def _sample_counters(self, gap_ns: int) -> None:
        """Read the CPU counters on every step until the first reviews, then on one step in
        ``counter_every`` where steps are shorter than half of ``gap_ns`` (0: every step; see
        :meth:`_next_counters_off`). Set when the tracer is made."""
        self.counter_gap_ns, self.counter_every, self.counter_mark_ns = gap_ns, 1, 0

    # -- _hot/enqueue.c: per allreduce -------------------------------------------------------------
    # C twin: Enqueue (its vectorcall, note)
    def _enqueue_wrapper(self, orig: Any, key_of: Any) -> Any:
        """Horovod's ``orig`` (enqueues one allreduce: a tensor, or a group keyed by its ids).

        The compiled form (:mod:`hvtrace.record._hot`, where built and ``$HVTRACE_NATIVE`` is
        on) does what the closure below does, on the same attributes."""
        rec, meta, now, polls = self.rec, self.meta, self.now, not self.is_cuda
        interval = self.poll_interval_ns
        hot = hot_module()
        if hot is not None:
            poll, key = (self._poll if polls else None), (None if key_of is id else key_of)
            return hot.Enqueue(self, rec, orig, key, now, poll, interval)
        next_poll = 0  # host timer only: a gradient enqueued from then on looks

        def enqueue(arg: Any) -> Any:
            nonlocal next_poll
            if not rec.enabled:
                return orig(arg)
            t = now()
            out = orig(arg)
            try:
                key = key_of(arg)
                if key not in meta:
                    self._learn(key, arg, out)
                enqueued = self.enqueued
                enqueued.append((t, key, out))
                if len(enqueued) == 1:  # the step's first allreduce: its work has begun
                    rec.between_steps = False
                # a gradient became ready (not an allreduce Horovod sends late, in synchronize)
                if polls and t >= next_poll and not self.in_sync:  # CUDA tokens: no polling
                    next_poll = t + interval
                    self._poll_done()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
            return out

        return enqueue

    # C twin: poll_done
    def _poll_done(self) -> None:
        """Note the allreduces that completed since the last look, oldest first, as seen now."""
        enqueued, first, poll = self.enqueued, self.poll_idx, self._poll
        handles = []
        for i in range(first, len(enqueued)):
            h = enqueued[i][2]
            h = h[0] if type(h) is tuple else h
            if type(h) is not int or not poll(h):
                break
            handles.append(h)
        if handles:
            t = monotonic_ns()
            self.done += [(h, t) for h in handles]
            self.poll_idx = first + len(handles)

    # -- _hot/phases.c: per phase boundary, per step -----------------------------------------------
    # C twin: ph_span
    def _span(self, kind: int, name: str, start: Any, end: Any, c0: Any, c1: Any, flags: int):
        rec = self.rec
        self.rows.append((rec.step, rec.micro, kind, name, start, end, 0, 0, _NAN, flags, c0, c1))

    # C twin: Phases_fwd_pre (c_fwd_pre)
    def _fwd_pre(self, module: Any, args: Any) -> None:
        if self.rec.enabled:
            try:
                if not self._grad_enabled():
                    self.fwd_start = None  # evaluation: no step phase
                    return
                t, c = self.now(), self._read()
                if self.fwd_count == 0:
                    self._span(K_INPUT, "input", self.step_start, t, self.step_cpu, c, self.flags)
                else:  # another micro-step (backward_passes_per_step, or several forwards)
                    self._close_backward(t, c)
                    self.rec.micro = self.fwd_count
                self.rec.between_steps = False
                self.fwd_start, self.fwd_cpu = t, c
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    # C twin: Phases_fwd_post (c_fwd_post)
    def _fwd_post(self, module: Any, args: Any, output: Any) -> None:
        if self.rec.enabled and self.fwd_start is not None:
            try:
                t, c = self.now(), self._read()
                self._span(K_FORWARD, "forward", self.fwd_start, t, self.fwd_cpu, c, self.flags)
                self.bwd_cpu, self.fwd_start = c, None  # backward's counters start here
                self.fwd_count += 1
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    # (no C twin: called by hvtrace.record.torchpatch's wrapper)
    def _backward_called(self) -> None:
        """``torch.autograd.backward`` was called (:mod:`hvtrace.record.torchpatch`): the first
        call after a recorded forward begins that forward's backward pass."""
        if self.bwd_start is None and self.fwd_count and self.fwd_start is None:
            self.bwd_start = self.now()

    # (no C twin: a hook on the gradient accumulators, backward_passes_per_step > 1)
    def _grad_ready(self, *args: Any) -> None:
        if self.rec.enabled and not self.in_sync:
            try:
                self.last_grad = self.now()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    # C twin: Phases_synchronize (c_synchronize)
    def _synchronize(self) -> Any:
        if not self.rec.enabled:
            return self._orig_sync()
        try:
            t0, c0 = monotonic_ns(), self._read()
            self._close_compute(self.now() if self.is_cuda else t0, c0)
            # (no poll here: Horovod now waits for each handle in order, and hvdpatch notes
            # when each wait returns, as a poll would, oldest first, a few µs apart)
            self.in_sync, self.rec.between_steps, hvdpatch.observer = True, False, self
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return self._orig_sync()
        try:
            out = self._orig_sync()
        finally:
            self.in_sync, hvdpatch.observer = False, None
        try:
            t1, c1 = monotonic_ns(), self._read()
            end = self.now() if self.is_cuda else t1
            self._span(K_WAIT, "synchronize", t0, t1, c0, c1, 0)
            self.sync_exit, self.sync_cpu = end, c1
            rec, flags = self.rec, self.ar_flags
            ar = Allreduces(rec.step, rec.micro, flags, self.enqueued, self.done, end, self.meta)
            self.rows.append(ar)
            self.enqueued, self.done, self.poll_idx, self.grad_mark = [], [], 0, 0
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        return out

    # C twin: Phases_step (c_step)
    def _step(self, closure: Any = None) -> Any:
        if not self.rec.enabled:
            out = self._orig_step(closure)
            self._count_step()
            return out
        if self.checks is not None:  # learning rates; every N steps the weights (no raise)
            self.checks.on_step(self.rec.step)
        try:  # synchronize() already ran (the skip pattern): the update's counters start here
            ts, cs = self.now(), (self._read() if self.compute_closed else None)
            self.sync_exit = None  # set again if Horovod's step() synchronizes
        except Exception as exc:  # noqa: BLE001
            ts = cs = None
            self.fail(exc)
        out = self._orig_step(closure)
        self._after_update(ts, cs)
        return out

    def _after_update(self, ts: Any, cs: Any) -> None:
        """After the update that began at ``ts`` (CPU counters ``cs``; None: not timed): close
        the update and the step, count it, and start the next step's clock. Never raises."""
        if ts is not None and self.rec.enabled:
            try:
                self._end_step(ts, cs)
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        if self._count_step():
            try:
                self.step_start, self.step_cpu = self.now(), self._read()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    # -- phase bookkeeping (hot path, called above) ------------------------------------------------
    # C twin: ph_end_step
    def _end_step(self, ts: Any, cs: Any) -> None:
        """Close the update and the step (the optimizer's update ran from ``ts``)."""
        te = self.now()
        # the reading that ends this step and begins the next: taken if either reads counters
        next_off = self._next_counters_off()
        c = None if self.counters_off and next_off else self.read()
        if not self.compute_closed:  # step without synchronize (skip pattern, Adasum)
            self._close_compute(ts, None)
        if self.sync_exit is not None:  # the update ran from synchronize's exit
            ts, cs = self.sync_exit, self.sync_cpu
        self._span(K_UPDATE, "update", ts, te, cs, c, self.flags)
        self._span(K_STEP, "step", self.step_start, te, self.step_cpu, c, self.flags)
        rec, rows, self.rows = self.rec, self.rows, []
        rec.extend(rows)
        self.done_rows = rows  # the live window's, at _count_step
        rec.step += 1
        rec.micro = self.fwd_count = 0
        rec.between_steps = True
        self.step_start, self.step_cpu = te, c
        self.counters_off = next_off
        self.compute_closed = False
        self.bwd_start = self.last_grad = None

    # C twin: ph_read
    def _read(self) -> Any:
        """A counter reading, or None on a step that reads none (``counters_off``)."""
        return None if self.counters_off else self.read()

    # C twin: ph_next_counters_off
    def _next_counters_off(self) -> bool:
        """Whether the next step (number ``steps_done + 1``) reads no CPU counters. Every
        :data:`COUNTER_REVIEW_STEPS` steps, ``counter_every`` becomes the largest power of two (at
        most :data:`COUNTER_MAX_EVERY`) whose steps, at the mean step since the last review, last
        no longer than ``counter_gap_ns``; a step reads them when its number is a multiple of it:
        the same steps on every rank (a rank that chose a smaller power reads them on those and
        more). Two system calls a reading, five readings a step: a point or so of a 3 ms step."""
        n = self.steps_done + 1
        gap = self.counter_gap_ns
        if gap <= 0:
            self.counter_every = 1
            return False
        if n % COUNTER_REVIEW_STEPS == 0:
            now = monotonic_ns()
            if self.counter_mark_ns > 0:
                period, k = (now - self.counter_mark_ns) // COUNTER_REVIEW_STEPS, 1
                while period > 0 and k < COUNTER_MAX_EVERY and 2 * k * period <= gap:
                    k *= 2
                self.counter_every = k
            self.counter_mark_ns = now
        return self.counter_every > 1 and n % self.counter_every != 0

    # C twin: ph_grad_end
    def _grad_end(self, t: Any) -> Any:
        """When the backward pass that ends now (``t``) had its last gradient ready; the next pass
        begins. The gradient accumulators' hooks' last call where they are installed
        (``backward_passes_per_step`` > 1: they run after Horovod's), else the enqueue of the
        last allreduce since the pass began (the wrapper keeps no time of its own: a write per
        gradient costs more than this), else ``t``."""
        enqueued, mark = self.enqueued, self.grad_mark
        self.grad_mark = len(enqueued)
        if self.last_grad is not None:
            return self.last_grad
        return enqueued[-1][0] if len(enqueued) > mark else t

    # C twin: ph_close_backward
    def _close_backward(self, t: Any, c: Any) -> None:
        end = self._grad_end(t)
        if self.bwd_start is not None:
            self._span(K_BACKWARD, "backward", self.bwd_start, end, self.bwd_cpu, c, self.flags)
        self.bwd_start = self.last_grad = None

    # C twin: ph_close_compute
    def _close_compute(self, t: Any, c: Any) -> None:
        """At the first synchronize of a step: close backward (model) or the compute span."""
        if self.compute_closed:
            return
        self.compute_closed = True
        if self.fwd_count:
            self._close_backward(t, c)
        else:
            end = self._grad_end(t)
            self._span(K_COMPUTE, "compute", self.step_start, end, self.step_cpu, c, self.flags)

    # C twin: ph_count_step
    def _count_step(self) -> bool:
        """Count a step on every rank; run the scheduled clock collective. True if it ran.

        Live detection counts the step here too, with the step's entries when it was recorded
        (else none): its windows' collective stays in step on every rank, recording or not."""
        self.steps_done += 1
        s = self.steps_done
        if self.live is not None:
            rows, self.done_rows = self.done_rows, []
            self.live.on_step(rows)
        if s == _resync_first or (s > _resync_first and s % _resync_every == 0):
            self.resync_clock()
            return True
        return False


# -- _hot/lr_rows.c: the learning-rate rows --------------------------------------------------------


class LrRows:
    """The consistency checks' per-step hook (:class:`hvtrace.record.consistency.
    ConsistencyChecks` is a subclass). C twin: ``ph_lr_rows`` (``_hot/lr_rows.c``), the compiled
    step's own writing of the learning-rate rows in the common case (see :meth:`on_step`)."""

    #: A step at which the parameters are fingerprinted off the schedule (-1: none; set by
    #: :meth:`hvtrace.record.consistency.ConsistencyChecks.ask`).
    asked: int = -1

    # -- per step (hot path: one float and one row per param group) --------------------------------
    # C twin: ph_lr_rows (its common case; c_step calls this in any other)
    def on_step(self, step: int) -> None:
        """Record the learning rates of step ``step`` and, every ``every`` steps, the parameters'
        fingerprints (before the update). Never raises: a failure disables tracing.

        The learning-rate rows join the step's spans (``tracer.rows``), which the tracer hands to
        the recorder at the step's end: one list append per param group here, no call. The
        compiled step (``hvtrace.record._hot.Phases.c_step``) writes the same rows itself, without
        calling this, on steps where that is all there is to do (every learning rate a float, no
        fingerprints due or pending, no new param group): it reads ``every``, ``pending``,
        ``groups``, ``_n_groups`` and ``_lr_names``, which keep their meaning."""
        rec = self.rec
        if not rec.enabled:
            return
        try:
            groups = self.groups
            if len(groups) != self._n_groups:
                self._refresh()
            t = monotonic_ns()
            rows, micro = self.tracer.rows, rec.micro  # handed over with the step's spans
            for name, g in zip(self._lr_names, groups):
                lr = g.get("lr")
                if lr.__class__ is not float:
                    lr = None if lr is None else self._number(lr)
                    if lr is None:
                        continue
                rows.append((step, micro, _K_SCALAR, name, t, t, 0, 0, lr, 0))
            if self.pending:
                self.collect()
            if (self.every and step % self.every == 0) or step == self.asked:
                self.check_params(step)
        except Exception as exc:  # noqa: BLE001 - never into training
            self.tracer.fail(f"consistency check: {type(exc).__name__}: {exc}")


# -- _hot/wait.c: Horovod's synchronize(handle) ----------------------------------------------------


def handle_wait(orig: Any, patch: Any) -> Any:
    """Horovod's ``orig`` (``synchronize(handle)``), noting when each wait returns while
    ``patch.observer`` (``patch``: :mod:`hvtrace.record.hvdpatch`) is a tracer inside its own
    ``synchronize()``. C twin: ``HandleWait`` (``_hot/wait.c``); ``hvdpatch.wrap`` picks."""

    def synchronize(handle: Any) -> Any:
        out = orig(handle)
        obs = patch.observer
        if obs is not None:
            try:
                obs.done.append((handle, monotonic_ns()))
            except Exception as exc:  # noqa: BLE001 - never into training
                obs.fail(exc)
        return out

    synchronize.__wrapped__ = orig  # type: ignore[attr-defined]
    return synchronize


# -- _hot/module.c: what the hooks need from hvtrace's modules -------------------------------------

#: Set by :func:`configure`: :mod:`hvtrace.record.hvdpatch` (whose ``observer`` the tracer's
#: ``_synchronize`` sets; not imported here, for it imports this module), and the steps of the
#: clock collective (``TracerHooks._count_step``).
hvdpatch: Any = None
_resync_first = -1
_resync_every = 1


def configure(hvdpatch_module: Any, resync_first: int, resync_every: int) -> None:
    """What the per-step hooks need from hvtrace's modules, once (from
    :mod:`hvtrace.record.optimizer`, when it is imported): :mod:`hvtrace.record.hvdpatch` and
    the steps of the clock collective (at ``resync_first``, then every ``resync_every``), for
    both forms. C twin: ``configure`` (``_hot/module.c``), called here where it is built, with the
    span kinds and :class:`~hvtrace.record.rows.Allreduces` too (which the Python forms import)."""
    global hvdpatch, _resync_first, _resync_every
    if resync_every <= 0:
        raise ValueError("configure: resync_every must be positive")
    if _hot is not None:
        _hot.configure(KIND_CODE, Allreduces, hvdpatch_module, resync_first, resync_every)
    hvdpatch, _resync_first, _resync_every = hvdpatch_module, resync_first, resync_every
