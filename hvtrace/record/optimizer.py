"""``hvtrace.DistributedOptimizer``: Horovod's distributed optimizer, instrumented.

It builds the optimizer with ``hvd.DistributedOptimizer`` (so every Horovod option behaves as it
always does) and then wraps four seams of that one instance:

- ``_allreduce_grad_async`` / ``_grouped_allreduce_grad_async``: a gradient became ready and its
  allreduce was enqueued (this rank's arrival);
- ``synchronize``: the time blocked waiting for the allreduces (exposed communication);
- ``step``: the base optimizer's update, and the step boundary;
- Horovod's module-level ``synchronize(handle)``: when each handle's result was observed.

With ``model=`` it also hooks the model's forward so compute splits into input gap, forward and
backward. Every wrapper records only after the wrapped call has done its work, and catches
everything of its own: a failure inside hvtrace disables tracing with one warning; exceptions of
Horovod or of the user's code pass through unchanged.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from hvtrace import settings
from hvtrace.clock import ClockEstimate, estimate_offsets
from hvtrace.record import recorder as _recmod
from hvtrace.record.clocksync import ping_rank0
from hvtrace.record.recorder import DEFAULT_BUFFER_SPANS, Recorder
from hvtrace.record.timers import make_timer, monotonic_ns
from hvtrace.schema import (
    DTYPE_CODE,
    FLAG_END_UPPER_BOUND,
    FORMAT_NAME,
    FORMAT_VERSION,
    KIND_CODE,
    dtype_name,
)

log = logging.getLogger("hvtrace")

K_STEP = KIND_CODE["step"]
K_INPUT = KIND_CODE["input"]
K_FORWARD = KIND_CODE["forward"]
K_BACKWARD = KIND_CODE["backward"]
K_COMPUTE = KIND_CODE["compute"]
K_ALLREDUCE = KIND_CODE["allreduce"]
K_WAIT = KIND_CODE["wait"]
K_UPDATE = KIND_CODE["update"]
K_USER = KIND_CODE["user"]
_SEQ = (list, tuple)  # a tuple of types: isinstance() with it is cheaper than with list | tuple

#: While gradients are being enqueued, in-flight allreduces are polled for completion at most this
#: often (host timer): a completion is seen within about this long of happening, or at
#: ``synchronize``, and a model with hundreds of small tensors does not poll once per tensor.
POLL_MIN_INTERVAL_NS = 200_000

#: Steps after which the clock offsets are estimated again (then every CLOCK_RESYNC_EVERY steps).
CLOCK_RESYNC_FIRST = 1000
CLOCK_RESYNC_EVERY = 5000
DEFAULT_TRACE_DIR = "hvtrace-trace"


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
    **horovod_kwargs: Any,
) -> Any:
    """Return ``hvd.DistributedOptimizer(optimizer, named_parameters, **horovod_kwargs)``, traced.

    ``trace_dir`` (else ``$HVTRACE_DIR``, else ``./hvtrace-trace``) receives one ``.arrows`` file
    per rank. ``model`` (optional) splits compute into input gap, forward and backward.
    ``HVTRACE=0`` returns Horovod's optimizer untouched. ``flush_interval_s`` (else
    ``$HVTRACE_FLUSH_S``, else 0.5 s) is how often the writer thread appends to the file;
    ``buffer_spans`` (else ``$HVTRACE_BUFFER_SPANS``, else 2**20) bounds the in-memory buffer:
    when the writer falls that far behind, new spans are dropped and counted, never waited for.
    Must be called on every rank, after ``hvd.init()``: it runs a short clock collective.

    Raises ``RuntimeError`` if Horovod is not initialized. Never raises because of tracing: if the
    trace cannot be written, a warning is logged and the optimizer works untraced.
    """
    import horovod.torch as hvd

    if not hvd.is_initialized():
        raise RuntimeError(
            "hvtrace.DistributedOptimizer() was called before hvd.init(): call hvd.init() first"
        )
    dist = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, **horovod_kwargs)
    if not tracing_enabled():
        return dist
    if not hasattr(dist, "_allreduce_grad_async") or not hasattr(dist, "_handles"):
        _warn(f"hvtrace: {type(dist).__name__} from Horovod is not supported; not tracing")
        return dist
    trace_dir = settings.trace_dir(trace_dir, DEFAULT_TRACE_DIR)
    flush_interval_s = settings.flush_interval_s(flush_interval_s)
    buffer_spans = settings.buffer_spans(buffer_spans)
    try:
        run_id, clock = _handshake(hvd, clock_rounds)
    except Exception as exc:  # noqa: BLE001
        _warn(f"hvtrace: clock synchronisation failed ({exc}); not tracing")
        return dist
    try:
        tracer = Tracer(
            dist, model, hvd, trace_dir, run_id, clock, flush_interval_s, clock_rounds, buffer_spans
        )
    except Exception as exc:  # noqa: BLE001
        _warn(f"hvtrace: could not start tracing ({type(exc).__name__}: {exc}); not tracing")
        return dist
    if tracer.rec.enabled and hvd.rank() == 0:
        log.info("hvtrace: recording run %s into %s", run_id, Path(trace_dir).resolve())
    return dist


def _warn(msg: str) -> None:
    log.warning("%s", msg)


_sync_counter = 0


def sync_clocks(hvd: Any, rounds: int) -> ClockEstimate:
    """Run ``rounds`` barrier rounds on every rank; return this rank's offset to rank 0.

    A collective: every rank must call it at the same point. See :mod:`hvtrace.clock`.
    """
    import torch

    global _sync_counter
    _sync_counter += 1
    tag = f"hvtrace.clock.{_sync_counter}"
    x = torch.zeros(1)
    hvd.allreduce(x, name=f"{tag}.warm", op=hvd.Sum)
    enter = np.empty(rounds, np.int64)
    exit_ = np.empty(rounds, np.int64)
    for r in range(rounds):
        enter[r] = monotonic_ns()
        hvd.allreduce(x, name=f"{tag}.{r}", op=hvd.Sum)
        exit_[r] = monotonic_ns()
    mine = torch.from_numpy(np.concatenate([enter, exit_])).unsqueeze(0)
    everyone = hvd.allgather(mine, name=f"{tag}.gather").numpy()
    barrier = estimate_offsets(everyone[:, :rounds], everyone[:, rounds:])[hvd.rank()]
    trips = ping_rank0(hvd, PING_ROUNDS, tag)
    return better_estimate(barrier, trips)


#: TCP round trips per clock estimate (tens of microseconds each; see hvtrace.record.clocksync).
PING_ROUNDS = 32


def better_estimate(barrier: ClockEstimate, trips: ClockEstimate | None) -> ClockEstimate:
    """The round-trip estimate when it is bounded, tighter than the barrier's and consistent
    with it (both are bounds on the same offset: their intervals must meet); else the barrier's."""
    if trips is None or not trips.bounded or trips.uncertainty_ns >= barrier.uncertainty_ns:
        return barrier
    gap = abs(trips.offset_ns - barrier.offset_ns)
    if barrier.bounded and gap > trips.uncertainty_ns + barrier.uncertainty_ns:
        log.debug("hvtrace: clock round trips %s contradict the barrier %s", trips, barrier)
        return barrier
    return trips


def _handshake(hvd: Any, rounds: int) -> tuple[str, ClockEstimate]:
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    run_id = hvd.broadcast_object(run_id, root_rank=0, name="hvtrace.run_id")
    return str(run_id), sync_clocks(hvd, rounds)


def _boot_id() -> str | None:
    """Return the kernel's boot id: ranks with equal boot ids share one CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _time_namespace() -> str | None:
    """Return this process's time namespace (``time:[4026531834]``): processes under one kernel
    share CLOCK_MONOTONIC only when they share it too (a time namespace offsets the clock)."""
    try:
        return os.readlink("/proc/self/ns/time")
    except OSError:
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


class _Pending:
    """An allreduce in flight: enqueued tensor(s), its handle, and when it was seen done."""

    __slots__ = ("dtypes", "end", "handle", "names", "nbytes", "polled", "start", "step")

    def __init__(self, handle: Any, names: list, nbytes: list, dtypes: list, start: Any, step: int):
        self.handle = handle
        self.names = names
        self.nbytes = nbytes
        self.dtypes = dtypes
        self.start = start
        self.end: Any = None
        self.step = step
        self.polled = False


class Tracer:
    """Attaches a :class:`Recorder` to one Horovod distributed optimizer instance."""

    def __init__(
        self,
        dist: Any,
        model: Any,
        hvd: Any,
        trace_dir: str | os.PathLike,
        run_id: str,
        clock: ClockEstimate,
        flush_interval_s: float,
        clock_rounds: int,
        buffer_spans: int = DEFAULT_BUFFER_SPANS,
    ) -> None:
        import torch
        from horovod.torch import mpi_ops

        self.dist = dist
        self.hvd = hvd
        self._handle_map = mpi_ops._handle_map
        self._poll = mpi_ops.poll
        self.clock_rounds = clock_rounds
        params = [p for g in dist.param_groups for p in g["params"] if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.timer = make_timer(device)
        self.is_cuda = bool(self.timer.is_cuda)
        self.dev_flags = self.timer.flags
        self.now = self.timer.now
        self.rec = Recorder(
            trace_dir,
            self._header(dist, model, run_id, clock, params, device),
            timer=self.timer,
            buffer_spans=buffer_spans,
            flush_interval_s=flush_interval_s,
        )
        # Even when the file could not be opened (recording disabled), the wrappers are installed:
        # they count steps so that the scheduled clock collectives stay in step on every rank.
        self.steps_done = 0
        self._finished = False
        # per-step state
        self.step_start: Any = self.now()
        self.fwd_start: Any = None
        self.fwd_count = 0
        self.bwd_start: Any = None
        self.last_grad: Any = None
        self.compute_closed = False
        self.in_sync = False
        self.sync_exit: Any = None
        self.pending: list[_Pending] = []
        self.poll_idx = 0
        self.last_poll_ns = 0
        self.by_handle: dict[Any, _Pending] = {}
        self._meta: dict[tuple, tuple[list, list, list]] = {}  # (params, dtype) -> tensor metadata
        self._install(dist, model)
        if self.rec.enabled:
            _recmod._set_active(self.rec)
        global _active_tracer
        _active_tracer = self

    # -- header ----------------------------------------------------------------------------------
    def _header(self, dist, model, run_id, clock, params, device) -> dict[str, Any]:
        hvd = self.hvd
        mono = monotonic_ns()
        wall = time.time_ns()
        groups = getattr(dist, "_groups", None)
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "run_id": run_id,
            "rank": hvd.rank(),
            "size": hvd.size(),
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(),
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "time_namespace": _time_namespace(),
            "pid": os.getpid(),
            "device": str(device),
            "timing": "cuda_events" if self.timer.is_cuda else "host_monotonic",
            "torch_version": _version("torch"),
            "horovod_version": _version("horovod"),
            "horovod_env": {
                k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")
            },
            "optimizer": {
                "class": type(dist).__mro__[1].__name__,
                "backward_passes_per_step": getattr(dist, "backward_passes_per_step", 1),
                "compression": getattr(getattr(dist, "_compression", None), "__name__", None)
                or type(getattr(dist, "_compression", None)).__name__,
                "op": str(getattr(dist, "op", None)),
                "gradient_predivide_factor": getattr(dist, "gradient_predivide_factor", 1.0),
                "groups": groups if isinstance(groups, int | None) else f"list[{len(groups)}]",
                "sparse_as_dense": getattr(dist, "sparse_as_dense", False),
                "tensors": len(params),
                "grad_bytes": int(sum(p.numel() * p.element_size() for p in params)),
            },
            "model": type(model).__name__ if model is not None else None,
            "mono_anchor_ns": mono,
            "wall_anchor_ns": wall,
            "clock": {
                "method": "barrier-interval",
                "reference_rank": 0,
                "start": clock.to_dict(),
            },
            "cuda_anchor_uncertainty_ns": getattr(self.timer, "anchor_uncertainty_ns", None),
        }

    # -- installation --------------------------------------------------------------------------
    def _install(self, dist: Any, model: Any) -> None:
        _patch_module_synchronize()
        self._orig_allreduce = dist._allreduce_grad_async
        self._orig_sync = dist.synchronize
        self._orig_step = dist.step
        dist._allreduce_grad_async = self._allreduce_grad_async
        if hasattr(dist, "_grouped_allreduce_grad_async"):
            self._orig_grouped = dist._grouped_allreduce_grad_async
            dist._grouped_allreduce_grad_async = self._grouped_allreduce_grad_async
        dist.synchronize = self._synchronize
        dist.step = self._step
        dist._hvtrace = self
        self._hooks = []
        if getattr(dist, "backward_passes_per_step", 1) > 1:
            # Each backward pass ends when its last gradient is ready; Horovod only enqueues on the
            # last pass, so listen on the gradient accumulators Horovod already holds.
            for acc in getattr(dist, "_grad_accs", []):
                self._hooks.append(acc.register_hook(self._grad_ready))
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._fwd_pre))
            self._hooks.append(model.register_forward_hook(self._fwd_post))

    def fail(self, exc: BaseException | str) -> None:
        """Disable tracing after an internal error (one warning); training goes on."""
        self.rec.fail(exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")

    # -- hooks (hot path) -----------------------------------------------------------------------
    def _grad_ready(self, *args: Any) -> None:
        if self.rec.enabled and not self.in_sync:
            try:
                self.last_grad = self.now()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    def _fwd_pre(self, module: Any, args: Any) -> None:
        rec = self.rec
        if not rec.enabled:
            return
        try:
            import torch

            if not torch.is_grad_enabled():
                self.fwd_start = None
                return
            t = self.now()
            rec.between_steps = False
            if self.fwd_count == 0:
                rec.add(K_INPUT, "input", self.step_start, t, flags=self.dev_flags)
            else:
                self._close_backward(t)
                rec.micro = self.fwd_count
            self.fwd_start = t
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def _fwd_post(self, module: Any, args: Any, output: Any) -> None:
        rec = self.rec
        if not rec.enabled or self.fwd_start is None:
            return
        try:
            t = self.now()
            rec.add(K_FORWARD, "forward", self.fwd_start, t, flags=self.dev_flags)
            self.fwd_start = None
            self.fwd_count += 1
            out = _first_grad_tensor(output)
            if out is not None:
                out.register_hook(self._bwd_start_hook)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)

    def _bwd_start_hook(self, grad: Any) -> None:
        if self.rec.enabled and self.bwd_start is None:
            try:
                self.bwd_start = self.now()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)

    def _close_backward(self, fallback_end: Any) -> None:
        if self.bwd_start is not None:
            end = self.last_grad if self.last_grad is not None else fallback_end
            self.rec.add(K_BACKWARD, "backward", self.bwd_start, end, flags=self.dev_flags)
        self.bwd_start = None
        self.last_grad = None

    def _close_compute(self, t: Any) -> None:
        """At the first synchronize of a step: close backward (model) or the compute span."""
        if self.compute_closed:
            return
        self.compute_closed = True
        if self.fwd_count:
            self._close_backward(t)
        else:
            end = self.last_grad if self.last_grad is not None else t
            self.rec.add(K_COMPUTE, "compute", self.step_start, end, flags=self.dev_flags)

    def _enqueued(self, handle_ctx: Any, params: tuple, t: Any) -> None:
        handle = handle_ctx[0] if isinstance(handle_ctx, tuple) else handle_ctx
        polled = type(handle) is int  # sparse allreduces return a callable instead
        sent = self._handle_map.get(handle) if polled else None
        sent = sent[0] if sent is not None else None  # the (compressed) tensor(s) Horovod reduces
        first = sent[0] if isinstance(sent, _SEQ) else sent
        key = (params, first.dtype if first is not None else None)
        meta = self._meta.get(key)
        if meta is None:
            meta = self._meta[key] = self._tensor_meta(params, sent)
        entry = _Pending(handle, meta[0], meta[1], meta[2], t, self.rec.step)
        self.pending.append(entry)
        if polled:
            self.by_handle[handle] = entry
        if not self.in_sync:
            self.rec.between_steps = False
            self.last_grad = t
            if not self.is_cuda and t - self.last_poll_ns >= POLL_MIN_INTERVAL_NS:
                self.last_poll_ns = t
                self._poll_done()

    def _tensor_meta(self, params: tuple, sent: Any) -> tuple[list, list, list]:
        """Return (names, bytes, dtype codes) of the tensors one allreduce sends (cached)."""
        names = self.dist._parameter_names
        if sent is None:
            tensors = [p.grad for p in params]
        else:
            tensors = list(sent) if isinstance(sent, _SEQ) else [sent]
        nbytes = [int(x.numel() * x.element_size()) if x is not None else 0 for x in tensors]
        dtypes = [DTYPE_CODE[dtype_name(x.dtype)] if x is not None else 0 for x in tensors]
        return [names.get(p, "?") for p in params], nbytes, dtypes

    def _poll_done(self) -> None:
        """Mark allreduces that completed since the last look (oldest first; host timer only)."""
        pending, i = self.pending, self.poll_idx
        while i < len(pending):
            e = pending[i]
            if e.end is None:
                if callable(e.handle) or not self._poll(e.handle):
                    break
                e.end = self.now()
                e.polled = True
            i += 1
        self.poll_idx = i

    def _allreduce_grad_async(self, p: Any) -> Any:
        if not self.rec.enabled:
            return self._orig_allreduce(p)
        t = self.now()
        out = self._orig_allreduce(p)
        try:
            self._enqueued(out, (p,), t)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        return out

    def _grouped_allreduce_grad_async(self, ps: Any) -> Any:
        if not self.rec.enabled:
            return self._orig_grouped(ps)
        t = self.now()
        out = self._orig_grouped(ps)
        try:
            self._enqueued(out, tuple(ps), t)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        return out

    def on_handle_done(self, handle: Any) -> None:
        """Called by the patched ``synchronize(handle)`` right after a handle's wait returned."""
        e = self.by_handle.get(handle)
        if e is not None and e.end is None:
            e.end = self.now()

    def _synchronize(self) -> Any:
        rec = self.rec
        if not rec.enabled:
            return self._orig_sync()
        try:
            t0 = monotonic_ns()
            self._close_compute(self.now() if self.is_cuda else t0)
            if not self.is_cuda:
                self._poll_done()
            self.in_sync = True
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return self._orig_sync()
        try:
            out = self._orig_sync()
        finally:
            self.in_sync = False
        try:
            t1 = monotonic_ns()
            rec.add(K_WAIT, "synchronize", t0, t1)
            end_tok = self.now() if self.is_cuda else t1
            self.sync_exit = end_tok
            flags = self.dev_flags | FLAG_END_UPPER_BOUND
            groups = [
                (e.step, e.start, end_tok if e.end is None else e.end, e.names, e.nbytes, e.dtypes)
                for e in self.pending
            ]
            rec.add_groups(K_ALLREDUCE, groups, flags)
            self.pending = []
            self.by_handle.clear()
            self.poll_idx = 0
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        return out

    def _step(self, closure: Any = None) -> Any:
        rec = self.rec
        if not rec.enabled:
            out = self._orig_step(closure)
            self._count_step()
            return out
        try:
            ts = self.now()
            self.sync_exit = None
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            out = self._orig_step(closure)
            self._count_step()
            return out
        out = self._orig_step(closure)
        try:
            te = self.now()
            if not self.compute_closed:  # step without synchronize (single process, skip pattern)
                self._close_compute(ts)
            start = self.sync_exit if self.sync_exit is not None else ts
            rec.add(K_UPDATE, "update", start, te, flags=self.dev_flags)
            rec.add(K_STEP, "step", self.step_start, te, flags=self.dev_flags)
            rec.step += 1
            rec.micro = 0
            rec.between_steps = True
            self.step_start = te
            self.fwd_count = 0
            self.compute_closed = False
            self.bwd_start = None
            self.last_grad = None
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
        if self._count_step():
            try:
                self.step_start = self.now()
            except Exception as exc:  # noqa: BLE001
                self.fail(exc)
        return out

    def _count_step(self) -> bool:
        """Count a step on every rank; run the scheduled clock collective. True if it ran."""
        self.steps_done += 1
        s = self.steps_done
        if s == CLOCK_RESYNC_FIRST or (s > CLOCK_RESYNC_FIRST and s % CLOCK_RESYNC_EVERY == 0):
            self.resync_clock()
            return True
        return False

    # -- clock and shutdown ----------------------------------------------------------------------
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

    def finish(self, sync_clock: bool = True) -> None:
        """Estimate the clocks a last time (collective), then flush and close the trace file."""
        if sync_clock and not self._finished:
            self.resync_clock()
        self._finished = True
        for h in self._hooks:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooks = []
        self.rec.close()


def _first_grad_tensor(output: Any) -> Any:
    """Return the first tensor of a model output that requires grad (for the backward hook)."""
    import torch

    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, _SEQ):
        for o in output:
            t = _first_grad_tensor(o)
            if t is not None:
                return t
    return None


_active_tracer: Tracer | None = None
_patched = False


def _patch_module_synchronize() -> None:
    """Wrap ``horovod.torch.optimizer.synchronize`` once, to see when each handle's wait returns.

    The wrapper calls Horovod's function unchanged and then tells the active tracer; it adds one
    dict lookup per handle and changes nothing else.
    """
    global _patched
    if _patched:
        return
    import horovod.torch.optimizer as hopt

    orig = hopt.synchronize

    def synchronize(handle: Any) -> Any:
        out = orig(handle)
        tr = _active_tracer
        if tr is not None and tr.rec.enabled:
            try:
                tr.on_handle_done(handle)
            except Exception as exc:  # noqa: BLE001
                tr.fail(exc)
        return out

    synchronize.__wrapped__ = orig  # type: ignore[attr-defined]
    hopt.synchronize = synchronize
    _patched = True


def finish(sync_clock: bool = True) -> None:
    """Finish this process's trace: a last clock estimate (collective, on every rank), then close.

    Optional: without it the file is closed cleanly at exit, with only the start-of-run clock
    estimate (and any scheduled ones). Safe to call when not tracing.
    """
    tr = _active_tracer
    if tr is not None:
        tr.finish(sync_clock=sync_clock)
