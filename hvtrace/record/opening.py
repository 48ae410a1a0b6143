"""A tracer's set-up, off its hot path: the options (:func:`trace_options`), then Horovod's
internals, the span timer, the counters, the header and the recorder (:func:`open_recording`).

:class:`hvtrace.record.optimizer.Tracer` takes what :func:`open_recording` returns, assigns its
state and installs its wrappers; the clock handshake (:mod:`hvtrace.record.clocksync`) and the
set-up collective (:func:`hvtrace.record.elastic.setup_gather`) run before, in
:func:`hvtrace.record.optimizer.trace_optimizer`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hvtrace import settings
from hvtrace.clock import ClockEstimate
from hvtrace.record.cpustat import ThreadCounters
from hvtrace.record.elastic import ElasticState, Membership
from hvtrace.record.header import build_header
from hvtrace.record.native import hot_module
from hvtrace.record.recorder import DEFAULT_BUFFER_SPANS, Recorder
from hvtrace.record.timers import make_timer, monotonic_ns

DEFAULT_TRACE_DIR = "hvtrace-trace"


def horovod_poll(mpi_ops: Any) -> Callable[[int], Any]:
    """Horovod's poll of one handle (nonzero once its op is done): its C++ ``PollHandle`` called
    directly where the compiled hot path can find it, else its pybind11 function, else
    ``mpi_ops.poll``."""
    lib = getattr(mpi_ops, "mpi_lib", None)
    hot, path = hot_module(), getattr(lib, "__file__", None)
    direct = hot.horovod_poll(path) if hot is not None and path else None
    return direct or getattr(lib, "horovod_torch_poll", None) or mpi_ops.poll


@dataclass(frozen=True)
class TraceOptions:
    """Where and how a rank records: arguments, else ``HVTRACE_*`` settings, else defaults."""

    trace_dir: str | os.PathLike
    flush_interval_s: float
    buffer_spans: int
    clock_rounds: int


def trace_options(
    trace_dir: str | os.PathLike | None,
    flush_interval_s: float | None,
    buffer_spans: int | None,
    clock_rounds: int,
) -> TraceOptions:
    """Resolve the options from the arguments and the environment (``hvtrace.settings``)."""
    return TraceOptions(
        settings.trace_dir(trace_dir, DEFAULT_TRACE_DIR),
        settings.flush_interval_s(flush_interval_s),
        settings.buffer_spans(buffer_spans),
        clock_rounds,
    )


@dataclass(frozen=True)
class Recording:
    """What a tracer records with, as :func:`open_recording` set it up."""

    #: The recorder (disabled, never None, when the file could not be opened).
    rec: Recorder
    #: The span timer (host or CUDA: :func:`hvtrace.record.timers.make_timer`).
    timer: Any
    #: The training thread's counter reader (:attr:`ThreadCounters.read`), taken after the
    #: recorder was created.
    read: Callable[[], Any]
    #: Elastic Horovod: this process's stable worker id and what it knows of the membership.
    elastic: ElasticState
    #: The first step's number (under Elastic Horovod a joining worker's goes on from the
    #: survivors'; else 0).
    start_step: int
    #: Horovod's map of in-flight handles (``mpi_ops._handle_map``): handle -> (tensors, ...).
    handle_map: dict
    #: Horovod's poll without its Python wrapper (:func:`horovod_poll`): nonzero once the
    #: handle's op is done.
    poll: Callable[[int], Any]


def open_recording(
    dist: Any,
    model: Any,
    hvd: Any,
    run_id: str,
    clock: ClockEstimate,
    opts: TraceOptions,
    membership: Membership | None = None,
    framework: dict[str, Any] | None = None,
) -> Recording:
    """Set up the recording of the optimizer ``dist`` on this rank: look up Horovod's internals,
    make the timer and the counters, build the header and create the :class:`Recorder`.

    ``membership``: what the set-up collective agreed (:func:`hvtrace.record.elastic.
    setup_gather`), else a membership of one generation with every rank as its own worker.
    ``framework``: the header's ``framework`` (:func:`hvtrace.record.header.build_header`).
    Raises what fails; a file that cannot be opened is not a failure (the recorder is disabled).
    """
    import torch
    from horovod.torch import mpi_ops

    handle_map = mpi_ops._handle_map
    poll = horovod_poll(mpi_ops)
    params = [p for g in dist.param_groups for p in g["params"] if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    timer = make_timer(device)
    counters = ThreadCounters()  # this thread trains: it calls step()
    header = build_header(
        hvd,
        dist,
        model,
        run_id,
        clock,
        params,
        device,
        timer,
        counters.mode,
        counters_derived_max_ns=counters.derived_max_ns,
        framework=framework,
    )
    rank = hvd.rank()
    if membership is None:
        membership = Membership(
            0, 0, 0, {rank: str(header.get("host"))}, {rank: rank}, None, hvd.size()
        )
    state = ElasticState.start(membership, rank, hvd.size())
    header["rank"] = header["worker"] = state.worker
    if membership.after_reset:  # the workers so far: ids 0 .. next_worker-1 (this one too)
        header["size"] = max(int(header["size"]), membership.next_worker, state.worker + 1)
    header["membership"] = membership.record(rank, monotonic_ns())
    rec = Recorder(
        opts.trace_dir,
        header,
        timer=timer,
        buffer_spans=opts.buffer_spans or DEFAULT_BUFFER_SPANS,
        flush_interval_s=opts.flush_interval_s,
        counters=counters,
    )
    # taken after the recorder: one that failed to start closed the counters, and their
    # reader is then a no-op (the old one would read a closed, perhaps reused, descriptor)
    read = counters.read
    return Recording(rec, timer, read, state, membership.start_step, handle_map, poll)
