"""Every Horovod collective a rank issues outside the traced optimizer, recorded.

:func:`install` wraps the public collectives of ``horovod.torch`` (``hvd.allreduce``,
``hvd.allgather_async``, ``hvd.broadcast_object``, ``hvd.join``, ...) and the names
``horovod.torch.sync_batch_norm`` imported from Horovod (``hvd.SyncBatchNorm`` issues an allgather
and allreduces inside the forward and backward passes). Each call becomes one span of kind
``collective`` (see ``docs/format.md``):

- ``name``: ``"<op>|<phase>|<tensor name>"``: the collective and its reduction (``allreduce.sum``,
  ``broadcast``, ``join``, ...), the step phase the training thread was in when it was issued
  (:meth:`hvtrace.record.optimizer.Tracer.phase_now`), and the name given to Horovod ("" when
  none; for a call Lightning's Horovod strategy makes for Lightning's own code, such as
  ``ModelCheckpoint``'s broadcast, ``lightning:`` and the Lightning function that asked for it:
  :func:`lightning_caller`);
- ``start_ns``: the call (the enqueue); ``end_ns``: the blocking call's return, or for an
  ``_async`` call the return of the ``hvd.synchronize(handle)`` that waited for it (an upper
  bound of its completion, flag ``FLAG_END_UPPER_BOUND``);
- ``value``: the ns the training thread was blocked in it (the whole call for a blocking
  collective, the ``synchronize(handle)`` for an async one);
- ``bytes``, ``dtype``: what this rank contributes (the input tensors; 0 where Horovod pickles an
  object, as ``broadcast_object`` does);
- ``cpu_ns`` / ``runq_ns``: the training thread's counters over the blocked part (when the call
  was made on that thread), so that the phase it fell in can be counted net of it;
- ``flags``: ``FLAG_OWN`` on hvtrace's own collectives (the clock handshake, names ``hvtrace.*``),
  which the analysis leaves out of the user's figures.

The optimizer's own gradient allreduces do not pass through these names (Horovod's optimizer
calls ``horovod.torch.mpi_ops`` directly): they are recorded as ``allreduce`` spans, as before.
Calls that a wrapped function makes to other wrapped names (``hvd.allreduce`` inside
``broadcast_optimizer_state``) are part of the outer one, not recorded again. A function imported
by name before hvtrace was set up (``from horovod.torch import allreduce``) is not seen.

Cost rules as on the hot path: no device synchronization, nothing raised into the user's code (a
failure disables tracing with one warning), bounded memory: at most :data:`MAX_PENDING` async
handles waiting for their ``synchronize``; beyond it the oldest is dropped and counted.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import threading
from collections import OrderedDict
from typing import Any

from hvtrace.format.schema import (
    DTYPE_CODE,
    FLAG_END_UPPER_BOUND,
    FLAG_OWN,
    KIND_CODE,
    LIGHTNING_PREFIX,
    dtype_name,
)
from hvtrace.record.recorder import running_tracer
from hvtrace.record.timers import monotonic_ns

_K_COLL = KIND_CODE["collective"]
_NAN = math.nan
#: Async handles kept until their ``synchronize``; the oldest is dropped past this.
MAX_PENDING = 4096
#: Longest tensor name kept (a longer one is cut: names are dictionary-encoded in the file).
MAX_NAME_CHARS = 200
#: Names of hvtrace's own collectives start with this.
OWN_PREFIX = "hvtrace."
_PL_DIR = f"{os.sep}pytorch_lightning{os.sep}"
_PL_STRATEGIES = f"{_PL_DIR}strategies{os.sep}"

#: Collectives wrapped in ``horovod.torch``: name -> (op family, blocking, how to read it).
#: ``reduce``: takes ``op=`` / ``average=``; ``grouped``: a list of tensors.
_TENSOR_OPS: dict[str, tuple[str, bool, str]] = {
    "allreduce": ("allreduce", True, "reduce"),
    "allreduce_": ("allreduce", True, "reduce"),
    "allreduce_async": ("allreduce", False, "reduce"),
    "allreduce_async_": ("allreduce", False, "reduce"),
    "grouped_allreduce": ("grouped_allreduce", True, "reduce_grouped"),
    "grouped_allreduce_": ("grouped_allreduce", True, "reduce_grouped"),
    "grouped_allreduce_async": ("grouped_allreduce", False, "reduce_grouped"),
    "grouped_allreduce_async_": ("grouped_allreduce", False, "reduce_grouped"),
    "allgather": ("allgather", True, "tensor"),
    "allgather_async": ("allgather", False, "tensor"),
    "grouped_allgather": ("grouped_allgather", True, "grouped"),
    "grouped_allgather_async": ("grouped_allgather", False, "grouped"),
    "broadcast": ("broadcast", True, "tensor"),
    "broadcast_": ("broadcast", True, "tensor"),
    "broadcast_async": ("broadcast", False, "tensor"),
    "broadcast_async_": ("broadcast", False, "tensor"),
    "alltoall": ("alltoall", True, "tensor"),
    "alltoall_async": ("alltoall", False, "tensor"),
    "reducescatter": ("reducescatter", True, "reduce"),
    "reducescatter_async": ("reducescatter", False, "reduce"),
    "grouped_reducescatter": ("grouped_reducescatter", True, "reduce_grouped"),
    "grouped_reducescatter_async": ("grouped_reducescatter", False, "reduce_grouped"),
    "broadcast_object": ("broadcast_object", True, "object"),
    "allgather_object": ("allgather_object", True, "object"),
    "broadcast_parameters": ("broadcast_parameters", True, "params"),
    "broadcast_optimizer_state": ("broadcast_optimizer_state", True, "none"),
    "join": ("join", True, "none"),
    "barrier": ("barrier", True, "none"),
}
#: Position of ``name`` among the positional arguments, per op family.
_NAME_POS = {
    "allreduce": 2,
    "grouped_allreduce": 2,
    "allgather": 1,
    "grouped_allgather": 1,
    "broadcast": 2,
    "alltoall": 2,
    "reducescatter": 1,
    "grouped_reducescatter": 1,
    "broadcast_object": 2,
    "allgather_object": 1,
}
#: Modules (besides ``horovod.torch``) whose imported collective names are wrapped too.
_OTHER_MODULES = ("horovod.torch.sync_batch_norm",)
#: Reduction names by Horovod's op constant.
_REDUCE_NAMES = ("Average", "Sum", "Adasum", "Min", "Max", "Product")

_lock = threading.Lock()
_installed = False


class _Local(threading.local):
    """Per thread: ``depth`` > 0 while inside a wrapped call (inner wrapped calls are part of the
    outer one). A class attribute default: reading it costs no exception on a new thread."""

    depth = 0


_local = _Local()
#: Async handles -> (start_ns, step, name, bytes, dtype, flags), oldest first.
_pending: OrderedDict[int, tuple] = OrderedDict()
_op_names: dict[int, str] = {}


def install(tracer: Any) -> None:
    """Wrap Horovod's collectives (once): they are recorded into the running tracer's recorder
    (:func:`hvtrace.record.recorder.running_tracer`: ``tracer``, until its finish)."""
    global _installed
    with _lock:
        if _installed:
            return
        import importlib

        import horovod.torch as hvd
        from horovod.torch import mpi_ops

        for r in _REDUCE_NAMES:
            if hasattr(mpi_ops, r):
                _op_names[getattr(mpi_ops, r)] = r.lower()
        modules = [hvd]
        for name in _OTHER_MODULES:
            try:
                modules.append(importlib.import_module(name))
            except Exception:  # noqa: BLE001 - an optional Horovod module
                continue
        for mod in modules:
            for fn_name, spec in _TENSOR_OPS.items():
                orig = getattr(mod, fn_name, None)
                if callable(orig) and not hasattr(orig, "__hvtrace__"):
                    setattr(mod, fn_name, _wrap(orig, fn_name, *spec))
            sync = getattr(mod, "synchronize", None)
            if callable(sync) and not hasattr(sync, "__hvtrace__"):
                mod.synchronize = _wrap_synchronize(sync)
        _installed = True


def release(tracer: Any) -> None:
    """At ``tracer``'s finish (it no longer runs: the wrappers pass calls straight through):
    forget the async handles still waiting."""
    _pending.clear()


def on_reset() -> None:
    """Forget the async handles still waiting: an elastic reset initialized Horovod again, and
    its handles start over."""
    _pending.clear()


def _depth() -> int:
    return _local.depth


def _wrap(orig: Any, fn_name: str, family: str, blocking: bool, how: str) -> Any:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tr = running_tracer()
        if tr is None or not tr.rec.enabled or _depth():
            return orig(*args, **kwargs)
        try:
            info = _describe(tr, fn_name, family, how, args, kwargs)
            live = tr.live
            if live is not None and not info[4] & FLAG_OWN:  # its count per step (lockstep)
                live.collectives += 1
                if family == "join":  # this rank leaves the steps: the last exchange read first
                    live.before_join()
            t0 = monotonic_ns()
            c0 = _read(tr) if blocking else None
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            tr.fail(f"recording {fn_name}: {type(exc).__name__}: {exc}")
            return orig(*args, **kwargs)
        _local.depth = 1
        if blocking:  # the stall watchdog names it if it never returns
            tr.in_collective = info[1]
        try:
            out = orig(*args, **kwargs)
        finally:
            _local.depth = 0
            if blocking:
                tr.in_collective = None
        try:
            if blocking:
                t1 = monotonic_ns()
                _record(tr, info, t0, t1, t1 - t0, c0, _read(tr) if c0 is not None else None)
            else:
                handle = out[0] if type(out) is tuple else out
                if type(handle) is int:
                    _pending[handle] = (t0, info)
                    if len(_pending) > MAX_PENDING:
                        _pending.popitem(last=False)
                        tr.rec.dropped += 1
        except Exception as exc:  # noqa: BLE001
            tr.fail(f"recording {fn_name}: {type(exc).__name__}: {exc}")
        return out

    wrapper.__hvtrace__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_synchronize(orig: Any) -> Any:
    @functools.wraps(orig)
    def synchronize(handle: Any) -> Any:
        if not _pending or type(handle) is not int or handle not in _pending:
            return orig(handle)
        tr = running_tracer()
        try:
            t0 = monotonic_ns()
            c0 = _read(tr) if tr is not None else None
        except Exception:  # noqa: BLE001 - counters are optional
            t0, c0 = monotonic_ns(), None
        item = _pending.get(handle)
        if tr is not None and item is not None:
            tr.in_collective = item[1][1]
        try:
            out = orig(handle)
        finally:
            if tr is not None:
                tr.in_collective = None
        try:
            item = _pending.pop(handle, None)
            if item is not None and tr is not None and tr.rec.enabled:
                t1 = monotonic_ns()
                c1 = _read(tr) if c0 is not None else None
                _record(tr, item[1], item[0], t1, t1 - t0, c0, c1)
        except Exception as exc:  # noqa: BLE001
            tr = running_tracer()
            if tr is not None:
                tr.fail(f"recording synchronize: {type(exc).__name__}: {exc}")
        return out

    synchronize.__hvtrace__ = True  # type: ignore[attr-defined]
    return synchronize


def _read(tr: Any) -> Any:
    """The training thread's counters now, when called on it (else None: not measured)."""
    counters = tr.rec.counters
    return counters.read() if threading.get_ident() == counters.ident else None


def _record(
    tr: Any, info: tuple, start: int, end: int, blocked_ns: int, c0: Any = None, c1: Any = None
) -> None:
    """Add the span; ``c0``/``c1``: the training thread's counters around the blocked part."""
    step, name, nbytes, dtype, flags = info
    tr.rec.add(
        _K_COLL,
        name,
        start,
        end,
        nbytes,
        dtype,
        float(blocked_ns),
        flags,
        step=step,
        cpu_start=c0,
        cpu_end=c1,
    )


def _describe(
    tr: Any, fn_name: str, family: str, how: str, args: tuple, kwargs: dict
) -> tuple[int, str, int, int, int]:
    """Return ``(step, span name, bytes, dtype code, flags)`` of one call (before it runs)."""
    tensors: Any = ()
    op = family
    if how in ("reduce", "reduce_grouped", "tensor", "grouped"):
        first = args[0] if args else kwargs.get("tensor", kwargs.get("tensors"))
        tensors = first if how in ("reduce_grouped", "grouped") else (first,)
        if how.startswith("reduce"):
            red = _reduce_name(family, args, kwargs)
            op = _ops.get((family, red)) or _ops.setdefault((family, red), f"{family}.{red}")
    elif how == "params":
        params = args[0] if args else kwargs.get("params")
        items = params.items() if hasattr(params, "items") else params
        tensors = [p for _, p in items]
    name = kwargs.get("name")
    pos = _NAME_POS.get(family)
    if name is None and pos is not None and len(args) > pos:
        name = args[pos]
    if name is None:  # Lightning's Horovod strategy names none of its calls: name its caller
        name = lightning_caller(sys._getframe(2))
    nbytes = 0
    dtype = 0
    for t in tensors:
        if hasattr(t, "element_size"):
            nbytes += t.numel() * t.element_size()
            if not dtype:
                dtype = _dtype_code(t.dtype)
    key = (op, tr.phase_now(), name)
    cached = _names.get(key)
    if cached is None:
        clean = "" if name is None else _clean(str(name))
        flags = FLAG_END_UPPER_BOUND | (FLAG_OWN if clean.startswith(OWN_PREFIX) else 0)
        cached = (f"{op}|{key[1]}|{clean}", flags)
        if len(_names) < MAX_NAMES:
            _names[key] = cached
    return tr.rec.step, cached[0], int(nbytes), dtype, cached[1]


def lightning_caller(frame: Any) -> str | None:
    """For an unnamed call made by Lightning's Horovod strategy (``HorovodStrategy.broadcast``:
    ``hvd.broadcast_object``; ``reduce``: ``hvd.join`` then ``hvd.allreduce``; ``join``) on behalf
    of Lightning's own code: ``lightning:`` and the qualified name of that code's function, the
    first frame above the strategies (``lightning:ModelCheckpoint.file_exists``,
    ``lightning:has_len_all_ranks``). None for any other caller, and when the user's own code
    called the strategy (``self.trainer.strategy.reduce(x)``). ``frame``: the frame that called
    the Horovod function. Costs a file-name test for unnamed calls from elsewhere."""
    if frame is None or _PL_STRATEGIES not in frame.f_code.co_filename:
        return None
    while frame is not None and _PL_STRATEGIES in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None or _PL_DIR not in frame.f_code.co_filename:
        return None
    code = frame.f_code
    return LIGHTNING_PREFIX + getattr(code, "co_qualname", code.co_name)


#: Span names (and flags) by (op, phase, name given), so that a collective called every step
#: pays for its name once; at most MAX_NAMES kept (a name that changes every call is rebuilt).
_names: dict[tuple, tuple[str, int]] = {}
MAX_NAMES = 4096
_dtypes: dict[Any, int] = {}
_ops: dict[tuple[str, str], str] = {}


def _dtype_code(torch_dtype: Any) -> int:
    code = _dtypes.get(torch_dtype)
    if code is None:
        code = _dtypes[torch_dtype] = DTYPE_CODE[dtype_name(torch_dtype)]
    return code


def _reduce_name(family: str, args: tuple, kwargs: dict) -> str:
    """The reduction of an allreduce-like call (Horovod's defaults: average)."""
    op = kwargs.get("op")
    if op is None and family.endswith("allreduce"):
        average = kwargs.get("average", args[1] if len(args) > 1 else None)
        if average is not None:
            return "average" if average else "sum"
        return "average"
    if op is None:
        return "average"
    return _op_names.get(op, str(op))


_UNSAFE = re.compile(r"[\x00-\x1f\x7f|]")


def _clean(name: str) -> str:
    """A tensor name as stored: control characters and ``|`` replaced, at most MAX_NAME_CHARS."""
    return _UNSAFE.sub("?", name[:MAX_NAME_CHARS])
