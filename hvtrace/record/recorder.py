"""Per-rank recorder: the append-only buffer that the hot path writes spans into.

``Recorder.add`` appends one tuple to a bounded deque (thread-safe without locks: autograd hooks
may run on other threads). When the buffer is full the span is dropped and counted, never waited
for. The background writer drains the buffer; any failure disables the recorder with one warning.

This module also holds the process's one registry of what is being traced (:func:`active`): the
recorder, and through its ``tracer`` attribute the optimizer tracer that owns it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import signal
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from threading import get_ident
from typing import Any, TypeVar

from hvtrace import settings
from hvtrace.clock import ClockEstimate
from hvtrace.format.schema import DTYPE_CODE, FILE_SUFFIX, FLAG_AGREE, KIND_CODE
from hvtrace.record.cpustat import ThreadCounters
from hvtrace.record.netstat import ConnectionSampler
from hvtrace.record.rows import span_count
from hvtrace.record.stall import StallWatch
from hvtrace.record.threads import NamedThread
from hvtrace.record.timers import HostTimer, monotonic_ns
from hvtrace.record.writer import BackgroundWriter

log = logging.getLogger("hvtrace")

F = TypeVar("F", bound=Callable[..., Any])

_K_USER = KIND_CODE["user"]
_K_SCALAR = KIND_CODE["scalar"]
_FLAG_AGREE = FLAG_AGREE
_NAN = math.nan

#: Default bound of the in-memory buffer (spans); beyond it spans are dropped and counted.
DEFAULT_BUFFER_SPANS = settings.BUFFER_SPANS.default


class Recorder:
    """One rank's recorder: current step, the span buffer and its background writer.

    Attributes read on the hot path: ``enabled``, ``step``, ``micro``, ``counters`` (the
    training thread's CPU and run-queue counters: the thread that creates the recorder). ``add()``
    and ``extend()`` are the methods the hot path calls. ``tracer`` is the optimizer tracer that
    owns this recorder (None for a bare recorder).
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        header: dict[str, Any],
        timer: Any = None,
        buffer_spans: int = DEFAULT_BUFFER_SPANS,
        flush_interval_s: float = settings.FLUSH_S.default,
        counters: ThreadCounters | None = None,
    ) -> None:
        self.enabled = False
        self.step = 0
        self.micro = 0
        #: True between a step's update and the next step's first forward or gradient: a scalar
        #: recorded then (the loss, after ``opt.step()``) belongs to the step just finished.
        self.between_steps = False
        self.dropped = 0
        self.tracer: Any = None
        self.counters = counters if counters is not None else ThreadCounters()
        self.timer = timer if timer is not None else HostTimer()
        self.header = header
        self._cap = buffer_spans
        self._buf: deque = deque()
        self._clock_new: list[ClockEstimate] = []
        #: Live straggler verdicts not yet written (:mod:`hvtrace.record.live`, rank 0).
        self.live_events: list[dict[str, Any]] = []
        #: Membership records not yet written (Elastic Horovod, :mod:`hvtrace.record.elastic`).
        self.membership_events: list[dict[str, Any]] = []
        self._tcp = ConnectionSampler()
        self._stall = StallWatch(settings.stall_s())
        self._reported_dropped = 0
        self._failed = False
        self._pid = os.getpid()
        self.writer: BackgroundWriter | None = None
        trace_dir = Path(trace_dir)
        self.path = trace_dir / f"rank{header['rank']:05d}-{header['run_id']}{FILE_SUFFIX}"
        try:
            trace_dir.mkdir(parents=True, exist_ok=True)
            self.writer = BackgroundWriter(
                self.path,
                header,
                self._buf,
                self.timer,
                self._status,
                self._on_writer_error,
                flush_interval_s,
            )
        except Exception as exc:  # noqa: BLE001 - tracing must never take training down
            self.counters.close()
            self.fail(f"cannot write trace file {self.path}: {exc}")
            return
        self.enabled = True
        atexit.register(self._close_at_exit)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)
        _install_signal_handlers(self)

    # -- hot path ------------------------------------------------------------------------------
    def add(
        self,
        kind: int,
        name: str,
        start: Any,
        end: Any,
        nbytes: int = 0,
        dtype: int = 0,
        value: float = _NAN,
        flags: int = 0,
        step: int | None = None,
        cpu_start: Any = None,
        cpu_end: Any = None,
    ) -> None:
        """Append one span (kind code, name, start/end tokens, and the counter readings at start
        and end, see :mod:`hvtrace.record.cpustat`). Never blocks, never raises."""
        buf = self._buf
        if len(buf) >= self._cap:
            self.dropped += 1
            return
        step = self.step if step is None else step
        buf.append(
            (
                step,
                self.micro,
                kind,
                name,
                start,
                end,
                nbytes,
                dtype,
                value,
                flags,
                cpu_start,
                cpu_end,
            )
        )

    def extend(self, entries: list) -> None:
        """Append buffer entries (rows, or :class:`~hvtrace.record.rows.Allreduces`), or drop
        them all and count their spans when the buffer is full (an entry counts as one against
        ``buffer_spans``: a synchronize's allreduces are one entry)."""
        buf = self._buf
        if len(buf) + len(entries) > self._cap:
            self.dropped += span_count(entries)
            return
        buf.extend(entries)

    # -- state shared with the writer ----------------------------------------------------------
    def add_clock(self, estimate: ClockEstimate) -> None:
        """Queue a clock-offset estimate for the next batch's status."""
        self._clock_new.append(estimate)

    def _status(self, final: bool) -> dict[str, Any]:
        clock, self._clock_new = self._clock_new, []
        dropped = self.dropped
        changed = bool(clock) or dropped != self._reported_dropped
        self._reported_dropped = dropped
        status = {
            "dropped": dropped,
            "clock": [c.to_dict() for c in clock],
            "last_step": self.step,
            "final": final,
            "changed": changed,
        }
        if self.live_events:
            live, self.live_events = self.live_events, []
            status["live"] = live
            status["changed"] = True
        if self.membership_events:
            members, self.membership_events = self.membership_events, []
            status["membership"] = members
            status["changed"] = True
        tcp = self._tcp(final)  # runs on the writer thread, like this method
        if tcp:
            status["tcp"] = tcp
            status["changed"] = True
        try:
            stall = self._stall(self.tracer, self.step, self.micro)
        except Exception:  # noqa: BLE001 - the watchdog never costs the spans
            stall = None
        if stall is not None:
            status["stall"] = stall
            status["changed"] = True
            log.warning(
                "hvtrace: rank %s has waited %.0f s in synchronize at step %d for %s",
                self.header.get("rank"),
                stall["waited_s"],
                stall["step"],
                ", ".join(stall["pending"][:3]) or "its allreduces",
            )
        return status

    # -- failure and shutdown ------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Disable recording with one warning; training goes on untraced."""
        self.enabled = False
        if not self._failed:
            self._failed = True
            # One line through logging (no handler configured: Python prints it on stderr).
            log.warning("hvtrace: tracing disabled on rank %s: %s", self.header.get("rank"), reason)

    def _on_writer_error(self, exc: BaseException) -> None:
        self.fail(
            f"writing {self.path} failed ({type(exc).__name__}: {exc}); spans up to the "
            "last flush are kept"
        )

    def _after_fork(self) -> None:
        # A forked child (DataLoader worker) has no writer thread: record nothing there.
        self.enabled = False
        self.writer = None
        self.counters.close()  # the parent's thread: no readings here
        if _TermWatch.active is not None:
            # the wakeup fd is the parent's pipe: a signal to this child must not reach the
            # parent's watch (which would take it for its own SIGTERM)
            try:
                signal.set_wakeup_fd(-1)
            except (ValueError, OSError):
                pass
        if _active is self:
            _set_active(None)

    def flush(self) -> None:
        """Write what is buffered now (normally the writer thread does this on its own)."""
        if self.writer is not None and os.getpid() == self._pid:
            self.writer.flush(final=False)

    def _close_at_exit(self) -> None:
        """At the interpreter's exit (a script that never calls ``hvtrace.finish()``, such as one
        traced by environment): live detection is closed as ``finish()`` closes it, its last
        windows' verdicts waited for (:meth:`hvtrace.record.live.LiveMonitor.drain`: the judge is a
        child process, not Horovod, which the script may have shut down), then the file."""
        tracer = self.tracer
        live = getattr(tracer, "live", None)
        if live is not None and self.writer is not None and os.getpid() == self._pid:
            try:
                live.close(read_presence=False)
                live.drain()
            except Exception as exc:  # noqa: BLE001 - the file is what matters here
                log.warning("hvtrace: closing live detection at exit failed: %s", exc)
        self.close()

    def close(self) -> None:
        """Flush everything, mark the file final and close it. Idempotent; safe at exit."""
        if self.writer is None or os.getpid() != self._pid:
            return
        self.enabled = False
        writer, self.writer = self.writer, None
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001
            log.warning("hvtrace: closing %s failed: %s", self.path, exc)
        self.counters.close()


# -- the process-wide registry: the active recorder (and its tracer) ---------------------------
#: The recorder of this process (set by DistributedOptimizer). It stays registered when recording
#: fails or the file is closed (``enabled`` says whether to record), so that ``hvtrace.finish()``
#: still finds the tracer, whose clock collective every rank must run; a forked child clears it.
_active: Recorder | None = None
_active_lock = threading.Lock()


def _set_active(rec: Recorder | None) -> None:
    global _active
    with _active_lock:
        _active = rec


def active_recorder() -> Recorder | None:
    """Return the recorder of this process, or None when not tracing (none, or disabled)."""
    rec = _active
    return rec if rec is not None and rec.enabled else None


def active_tracer() -> Any:
    """Return the optimizer tracer of this process, or None."""
    rec = _active
    return rec.tracer if rec is not None else None


def running_tracer() -> Any:
    """Return the optimizer tracer of this process until its ``finish()``, else None: what the
    wrappers of Horovod's collectives and elastic state report to (one registry for all)."""
    rec = _active
    tr = rec.tracer if rec is not None else None
    return tr if tr is not None and not tr._finished else None


class span:
    """Record a user span around a block or a function: ``with hvtrace.span("data"):``.

    Also a decorator: ``@hvtrace.span("checkpoint")``. Times use the host monotonic clock; the
    span belongs to the optimizer step current at its start. A no-op when not tracing.
    """

    __slots__ = ("_cpu", "_rec", "_start", "_step", "name")

    def __init__(self, name: str) -> None:
        self.name = _name(name, "span")
        self._start = 0
        self._rec: Recorder | None = None
        self._step = 0
        self._cpu: Any = None

    def __enter__(self) -> span:
        rec = _active
        if rec is not None and rec.enabled:
            self._rec = rec
            self._step = rec.step
            self._start = monotonic_ns()
            # the training thread's counters (read just after the time, as at a phase boundary),
            # only when the span is on that thread
            counters = rec.counters
            try:
                self._cpu = counters.read() if get_ident() == counters.ident else None
            except Exception as e:  # noqa: BLE001
                self._rec = None
                rec.fail(f"recording span {self.name!r}: {e}")
        return self

    def __exit__(self, *exc: object) -> None:
        rec, self._rec = self._rec, None
        if rec is not None and rec.enabled:
            try:
                end = monotonic_ns()
                c0 = self._cpu
                c1 = rec.counters.read() if c0 is not None else None
                rec.add(
                    _K_USER, self.name, self._start, end, step=self._step, cpu_start=c0, cpu_end=c1
                )
            except Exception as e:  # noqa: BLE001
                rec.fail(f"recording span {self.name!r}: {e}")

    def __call__(self, fn: F) -> F:
        name = self.name

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def scalar(name: str, value: Any, agree: bool = False) -> None:
    """Record a per-step scalar (such as the loss) on this rank. A no-op when not tracing.

    ``agree=True`` marks a value that must be equal on every rank (a learning rate, an epoch
    number, a metric averaged across ranks): ``hvtrace analyze`` compares it across ranks per
    step and reports a ``divergence`` (the step, the ranks and their values) where it differs
    (flag bit 3 of the row, :data:`hvtrace.format.schema.FLAG_AGREE`). Compare exactly: record a
    value every rank computes the same way (``float(hvd.allreduce(x))``), not a rank's own loss.

    The value belongs to the step in progress; recorded after ``opt.step()`` and before the next
    step's forward, it belongs to the step just finished.

    ``value`` may be a number or a one-element tensor; a CPU tensor is read at once, a CUDA tensor
    is never read in the training loop (that would synchronize): pass ``loss.item()`` only where
    your loop already synchronizes, or record CPU values.
    """
    rec = _active
    if rec is None or not rec.enabled:
        return
    try:
        if getattr(value, "is_cuda", False):
            _warn_once(
                "hvtrace.scalar() got a CUDA tensor and did not record it (reading it "
                "would synchronize the device); pass a Python number instead"
            )
            return
        number = _number(value)
        if number is None:
            _warn_once(
                f"hvtrace.scalar() got a {type(value).__name__}, not a number nor a one-element "
                "tensor, and did not record it (recording goes on)"
            )
            return
        t = monotonic_ns()
        step = rec.step - 1 if rec.between_steps and rec.step > 0 else rec.step
        flags = _FLAG_AGREE if agree else 0
        rec.add(_K_SCALAR, _name(name, "scalar"), t, t, value=number, flags=flags, step=step)
    except Exception as e:  # noqa: BLE001
        rec.fail(f"recording scalar {name!r}: {e}")


def _number(value: Any) -> float | None:
    """``value`` as a float (a number, a numpy scalar, a one-element CPU tensor or array), else
    None: a value of the user's that cannot be stored is dropped, never a reason to stop."""
    try:
        if hasattr(value, "detach"):
            value = value.detach()
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            value = value.item()
        if isinstance(value, (str, bytes)):
            return None
        return float(value)
    except Exception:  # noqa: BLE001 - whatever the user's __float__ raises: the value dropped
        return None


#: What a name that cannot be made a string is stored as.
UNNAMED = "<unprintable name>"


def _name(name: Any, call: str) -> str:
    """``str(name)``, or :data:`UNNAMED` with one warning when the user's ``__str__`` raises: a
    name that cannot be printed is not a reason to lose the record or stop recording."""
    if isinstance(name, str):
        return name
    try:
        return str(name)
    except Exception as e:  # noqa: BLE001
        _warn_once(
            f"hvtrace.{call}() got a name of type {type(name).__name__} that cannot be made a "
            f"string ({type(e).__name__}): recorded as {UNNAMED!r} (recording goes on)"
        )
        return UNNAMED


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def dtype_code(name: str) -> int:
    """Return the dtype code for a dtype name of the format."""
    return DTYPE_CODE.get(name, DTYPE_CODE["other"])


def _install_signal_handlers(rec: Recorder) -> None:
    """Make termination keep the trace: SIGTERM flushes and closes the file, then goes on as before.

    Also ignores SIGXFSZ when it has its default action, so that a file-size limit makes the
    writer's ``write`` fail with EFBIG (tracing stops with a warning) instead of killing training.
    Only possible from the main thread; elsewhere nothing is changed.

    A Python signal handler runs only when the main thread runs Python code: a rank hung inside
    Horovod's wait (a C++ loop) would never run it, and would no longer die of SIGTERM as it does
    without hvtrace. So where SIGTERM had its default action, :class:`_TermWatch` also sees the
    signal arrive (Python's wakeup fd, written by its C-level handler in whatever thread takes
    it) and, if the main thread has not handled it within :data:`TERM_GRACE_S`, closes the file
    and terminates the process with SIGTERM's default action itself.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if hasattr(signal, "SIGXFSZ") and signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return

    watch = _TermWatch.start(rec) if previous == signal.SIG_DFL else None

    def on_sigterm(signum: int, frame: Any) -> None:
        if watch is not None:
            watch.handled.set()
        rec.close()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # default action: terminate, as the signal would have without hvtrace
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass
    if watch is not None:
        watch.handler = on_sigterm


#: How long a SIGTERM may wait for the main thread's handler before :class:`_TermWatch` acts.
TERM_GRACE_S = 2.0


class _TermWatch:
    """A daemon thread that reads Python's signal wakeup fd and, when SIGTERM arrived but the
    main thread did not handle it within :data:`TERM_GRACE_S` (it is stuck in C code, such as
    Horovod's wait on a hung collective), closes the trace and ends the process with SIGTERM's
    default action, as it would have ended without hvtrace.

    Not started when another wakeup fd is set already (asyncio's, say): that one is left alone.
    Does nothing once the job has installed a SIGTERM handler of its own after hvtrace's.
    """

    #: The watch of this process, if one was started.
    active: _TermWatch | None = None

    def __init__(self, rec: Recorder, read_fd: int) -> None:
        self.rec = rec
        #: hvtrace's SIGTERM handler (the watch acts only while it is the installed one).
        self.handler: Any = None
        self.read_fd = read_fd
        self.handled = threading.Event()

    @classmethod
    def start(cls, rec: Recorder) -> _TermWatch | None:
        """Set the wakeup fd and start the thread (main thread only); None if not possible."""
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return None
        if old != -1:  # someone else's: put it back
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return None
        watch = cls(rec, r)
        cls.active = watch
        NamedThread(target=watch._run, name="hvtrace-sigterm", daemon=True).start()
        return watch

    def _run(self) -> None:
        try:
            while True:
                data = os.read(self.read_fd, 64)
                if not data:
                    return
                # only while SIGTERM is still hvtrace's: a handler the job installed later
                # (a framework's graceful shutdown) owns the signal, however long it takes
                if (
                    signal.SIGTERM in data
                    and signal.getsignal(signal.SIGTERM) is self.handler
                    and not self.handled.wait(TERM_GRACE_S)
                    and signal.getsignal(signal.SIGTERM) is self.handler
                ):
                    self._terminate()
                    return
        except Exception:  # noqa: BLE001 - never into training; the Python handler remains
            return

    def _terminate(self) -> None:
        """Close the trace, restore SIGTERM's default action at the C level and re-raise it."""
        try:
            self.rec.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.signal(int(signal.SIGTERM), None)  # SIG_DFL: signal.signal() is main-only
            os.kill(os.getpid(), signal.SIGTERM)
        except Exception:  # noqa: BLE001
            pass
        os._exit(128 + int(signal.SIGTERM))  # if the signal could not be re-raised
