"""Every ``HVTRACE_*`` setting, parsed in one place with its bounds.

A value that cannot be parsed or is out of bounds gives one warning (logger ``hvtrace``) naming the
setting, the value and the default used instead; it never stops training and never makes the
writer spin (``HVTRACE_FLUSH_S=0``) or record nothing (``HVTRACE_BUFFER_SPANS=0``). Explicit
arguments (``hvtrace.DistributedOptimizer(flush_interval_s=...)``) go through the same checks.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Final

log = logging.getLogger("hvtrace")


@dataclass(frozen=True)
class Setting:
    """One setting: its environment variable, default and bounds (inclusive)."""

    env: str
    default: Any
    lo: float | None = None
    hi: float | None = None
    doc: str = ""


FLUSH_S: Final = Setting(
    "HVTRACE_FLUSH_S", 1.0, 0.01, 60.0, "seconds between the writer's appends to the file"
)
BUFFER_SPANS: Final = Setting(
    "HVTRACE_BUFFER_SPANS", 1 << 20, 16, 1 << 26, "spans buffered before new ones are dropped"
)
STALL_S: Final = Setting(
    "HVTRACE_STALL_S",
    60.0,
    0.5,
    86400.0,
    "seconds a rank waits in synchronize before its file notes a stall (Horovod's stall check)",
)
CONSISTENCY_EVERY: Final = Setting(
    "HVTRACE_CONSISTENCY_EVERY",
    100,
    0,
    1e9,
    "optimizer steps between fingerprints of the parameters (0: none; learning rates every step)",
)
LIVE_EVERY: Final = Setting(
    "HVTRACE_LIVE_EVERY",
    100,
    0,
    1e9,
    "steps per window of live straggler detection at least (0: off); rank 0's value is used by all",
)
LIVE_S: Final = Setting(
    "HVTRACE_LIVE_S",
    5.0,
    0.0,
    3600.0,
    "seconds per window of live straggler detection at least (0: windows of exactly "
    "HVTRACE_LIVE_EVERY steps); rank 0's value is used by all",
)
JUDGE_PCT: Final = Setting(
    "HVTRACE_JUDGE_PCT",
    0.25,
    0.01,
    100.0,
    "percent of one CPU core rank 0's live judge may use on average: windows that end sooner "
    "after a judgment than its CPU time allows wait and are judged with the next (100: each "
    "window as it comes); rank 0's value",
)
POLL_US: Final = Setting(
    "HVTRACE_POLL_US",
    200.0,
    0.0,
    1e6,
    "µs between looks at the in-flight allreduces while gradients arrive (larger: cheaper, an "
    "allreduce that completes during the backward is dated later; 0: at every gradient)",
)
COUNTERS_MS: Final = Setting(
    "HVTRACE_COUNTERS_MS",
    250.0,
    0.0,
    1e6,
    "ms between two steps whose CPU counters are read, at most: steps shorter than half of it "
    "read them on one step in 2, 4, ... 64 (the same steps on every rank); 0: every step",
)
#: Every numeric setting, by environment variable (the on/off ones and ``HVTRACE_DIR`` are
#: parsed below).
SETTINGS: Final = {
    s.env: s
    for s in (
        FLUSH_S,
        BUFFER_SPANS,
        STALL_S,
        CONSISTENCY_EVERY,
        LIVE_EVERY,
        LIVE_S,
        JUDGE_PCT,
        POLL_US,
        COUNTERS_MS,
    )
}
#: The on/off and path settings, with what each does (parsed by the functions below; the
#: documentation's settings page is generated from this and :data:`SETTINGS`).
SWITCHES: Final = {
    "HVTRACE": "0 (or false, off, no) turns recording off with no code change: "
    "hvtrace.DistributedOptimizer returns Horovod's optimizer untouched, the start-up hook and "
    "the Lightning callback do nothing (default on)",
    "HVTRACE_DIR": "the trace directory when the code gives none; set, it also asks the start-up "
    "hook to trace a job with no code change (hvtrace run sets it)",
    "HVTRACE_HOROVOD_TIMELINE": "1 also records Horovod's own timeline into the trace directory "
    "(rank 0 writes it; the start-up hook sets HOROVOD_TIMELINE=DYNAMIC before hvd.init()) "
    "(default off)",
    "HVTRACE_HOROVOD_TIMELINE_CYCLES": "1 marks Horovod's background-thread cycles in that "
    "timeline (default off)",
    "HVTRACE_TENSORBOARD": "a directory: rank 0's live detection writes each window's per-step "
    "figures there as TensorBoard scalars (step time, the late rank and its lateness, exposed "
    "wait), from its judge process, off the training process (needs tensorboardX; default none)",
    "HVTRACE_NATIVE": "0 runs the pure-Python forms of the compiled hot path (the same records; "
    "for comparison, or if the compiled one is suspected) (default on)",
    "HVTRACE_CACHE": "0 keeps no analysis on disk: hvtrace analyze and hvtrace dashboard save "
    "the analysis of a finished run (with the default options) so that the dashboard opens it "
    "without analyzing it again (default on; hvtrace.analysis.saved)",
    "HVTRACE_CACHE_DIR": "where saved analyses go (default $XDG_CACHE_HOME/hvtrace/analyses, else "
    "~/.cache/hvtrace/analyses; made 0700, at most 16 entries kept)",
}

_OFF: Final = {"0", "false", "off", "no"}
_ON: Final = {"", "1", "true", "on", "yes"}
_warned: set[tuple[str, str]] = set()


def _warn_once(name: str, value: object, why: str, default: object) -> None:
    key = (name, repr(value))
    if key not in _warned:
        _warned.add(key)
        log.warning("hvtrace: %s=%r %s; using %r", name, value, why, default)


def _number(setting: Setting, raw: object, cast: type) -> Any:
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        _warn_once(setting.env, raw, "is not a number", setting.default)
        return setting.default
    if not math.isfinite(value) or (cast is int and value != int(value)):
        kind = "a whole number" if cast is int else "a finite number"
        _warn_once(setting.env, raw, f"is not {kind}", setting.default)
        return setting.default
    if (setting.lo is not None and value < setting.lo) or (
        setting.hi is not None and value > setting.hi
    ):
        bounds = f"{setting.lo:g}..{setting.hi:g}"
        _warn_once(setting.env, raw, f"is outside {bounds}", setting.default)
        return setting.default
    return cast(value)


def _value(setting: Setting, explicit: Any, cast: type) -> Any:
    """``explicit``, else the setting's environment variable, else its default; checked."""
    raw = explicit if explicit is not None else os.environ.get(setting.env)
    return setting.default if raw is None else _number(setting, raw, cast)


def _flag(env: str, default: bool, explicit: bool | None = None) -> bool:
    """An on/off setting: ``explicit``, else ``$env`` (0/1, off/on, false/true, no/yes; blank is
    on), else ``default``; an unknown value warns and keeps the default."""
    if explicit is not None:
        return bool(explicit)
    raw = os.environ.get(env)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _OFF:
        return False
    if v in _ON:
        return True
    _warn_once(
        env, raw, "is not one of 0/1, off/on, false/true, no/yes", "on" if default else "off"
    )
    return default


def flush_interval_s(explicit: float | None = None) -> float:
    """The writer's flush interval in seconds: ``explicit``, else ``$HVTRACE_FLUSH_S``, else
    1 (0.5 until 29 Nov 2026: each append has a fixed cost, about 0.3-0.7 ms of CPU, that a
    job pays per second whatever its step, bench/README.md); bounded to 0.01..60 s."""
    return _value(FLUSH_S, explicit, float)


def buffer_spans(explicit: int | None = None) -> int:
    """The span buffer's bound: ``explicit``, else ``$HVTRACE_BUFFER_SPANS``, else 2**20;
    bounded to 16..2**26."""
    return _value(BUFFER_SPANS, explicit, int)


def stall_s(explicit: float | None = None) -> float:
    """Seconds in ``synchronize`` after which the writer notes a stall: ``explicit``, else
    ``$HVTRACE_STALL_S``, else 60 (Horovod's stall check); bounded to 0.5 s..1 day."""
    return _value(STALL_S, explicit, float)


def tracing_enabled() -> bool:
    """False when ``$HVTRACE`` turns recording off (0, false, off, no); an unknown value warns
    and keeps recording on."""
    return _flag("HVTRACE", True)


def trace_dir(explicit: str | os.PathLike | None, default: str) -> str | os.PathLike:
    """The trace directory: ``explicit``, else ``$HVTRACE_DIR`` (if not blank), else ``default``."""
    if explicit:
        return explicit
    env = os.environ.get("HVTRACE_DIR", "")
    return env if env.strip() else default


def horovod_timeline(explicit: bool | None = None) -> bool:
    """Whether hvtrace starts Horovod's own timeline into the trace directory: ``explicit``,
    else ``$HVTRACE_HOROVOD_TIMELINE`` (1/on/true/yes; default off)."""
    return _flag("HVTRACE_HOROVOD_TIMELINE", False, explicit)


def horovod_timeline_cycles() -> bool:
    """Whether Horovod's timeline (when hvtrace starts it) marks each background-thread cycle:
    ``$HVTRACE_HOROVOD_TIMELINE_CYCLES`` (1/on; default off; blank is on, as for every flag)."""
    return _flag("HVTRACE_HOROVOD_TIMELINE_CYCLES", False)


def enable_dynamic_horovod_timeline() -> None:
    """With ``$HVTRACE_HOROVOD_TIMELINE`` on and no ``$HOROVOD_TIMELINE`` of the user's, set
    ``HOROVOD_TIMELINE=DYNAMIC``: Horovod reads it at ``hvd.init()`` and only then lets a
    timeline be started later (:func:`hvtrace.DistributedOptimizer` starts it). Called when
    hvtrace is imported, which is before ``hvd.init()`` in a training script."""
    if "HOROVOD_TIMELINE" not in os.environ and horovod_timeline():
        os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"


def consistency_every(explicit: int | None = None) -> int:
    """Optimizer steps between parameter fingerprints (:mod:`hvtrace.record.consistency`):
    ``explicit``, else ``$HVTRACE_CONSISTENCY_EVERY``, else 100; 0 turns them off (learning
    rates are still recorded each step); bounded to 0..10**9."""
    return _value(CONSISTENCY_EVERY, explicit, int)


def live_every(explicit: int | None = None) -> int:
    """Steps per window of live straggler detection (:mod:`hvtrace.record.live`) at least:
    ``explicit``, else ``$HVTRACE_LIVE_EVERY``, else 100; 0 turns it off; bounded to 0..10**9."""
    return _value(LIVE_EVERY, explicit, int)


def live_window_s(explicit: float | None = None) -> float:
    """Seconds per window of live straggler detection at least (windows of short steps are
    lengthened to it, see :mod:`hvtrace.record.live`): ``explicit``, else ``$HVTRACE_LIVE_S``,
    else 5; 0: windows of exactly :func:`live_every` steps; bounded to 0..3600."""
    return _value(LIVE_S, explicit, float)


def judge_share(explicit: float | None = None) -> float:
    """The share of one CPU core (0..1) rank 0's live judge may use on average
    (:meth:`hvtrace.record.live.LiveMonitor._judge_loop`): ``explicit`` (percent), else
    ``$HVTRACE_JUDGE_PCT``, else 0.25 %; bounded to 0.01..100 %."""
    return _value(JUDGE_PCT, explicit, float) / 100.0


def poll_interval_ns(explicit: float | None = None) -> int:
    """How often (ns) the tracer looks at the in-flight allreduces while gradients arrive:
    ``explicit`` (µs), else ``$HVTRACE_POLL_US``, else 200 µs; bounded to 0..1 s. The looks cost
    the training thread time per allreduce (``bench/format_bench.py --baseline-poll-ns``); an
    allreduce that completes during the backward is dated at the first gradient after it, the
    looks no closer together than this (at ``synchronize()`` when this is longer)."""
    return int(_value(POLL_US, explicit, float) * 1000)


def counters_gap_ns(explicit: float | None = None) -> int:
    """The most time (ns) between two steps whose training-thread CPU counters are read
    (:mod:`hvtrace.record.cpustat`): ``explicit`` (ms), else ``$HVTRACE_COUNTERS_MS``, else 250 ms;
    0 reads them on every step; bounded to 0..1000 s. A reading costs the training thread two
    system calls, five a step, and each system call is a point where the kernel may switch to a
    thread that has woken meanwhile (Horovod's background thread wakes every cycle): on a rank
    that shares its core with Horovod's threads, a step that read the counters cost 0.1-0.3 ms
    more than one that did not (``bench/inrun_phases.py``: 112-136 µs of wall at 7.4 ms steps).
    Steps shorter than half of this read them on one step in ``k`` (a power of two up to 64: the
    largest whose ``k`` steps last no longer than this, reviewed every 64 steps), the steps whose
    number ``k`` divides, so that the ranks read them on the same steps: at least every 250 ms
    by default, whatever the step, and every step of the first 128."""
    return int(_value(COUNTERS_MS, explicit, float) * 1_000_000)


def native_hot_path() -> bool:
    """Whether the tracer's per-allreduce wrapper is the compiled one (``hvtrace.record._hot``)
    when it was built: ``$HVTRACE_NATIVE`` (default on; 0/off: the pure-Python closure, same
    records, for comparison or if the compiled one is suspected)."""
    return _flag("HVTRACE_NATIVE", True)


#: The mimalloc option :func:`arrow_memory_on_demand` sets (``mi_option_arena_eager_commit``).
MIMALLOC_EAGER_ENV: Final = "MIMALLOC_ARENA_EAGER_COMMIT"


def arrow_memory_on_demand() -> None:
    """Let pyarrow's allocator commit memory as it is used, not a whole arena at once.

    pyarrow's default memory pool is mimalloc, which commits a 4 MB arena at its first
    allocation (in a rank, the writer's first batch): about 5 MB of resident memory that the
    recorder's few hundred kB of batches never use (bench/README.md, peak RSS per rank). Called
    by ``import hvtrace`` before pyarrow is loaded, it sets ``$MIMALLOC_ARENA_EAGER_COMMIT=0``
    unless the variable is set already or pyarrow (so mimalloc) was loaded before hvtrace: the
    allocator, its pools and its speed stay what they were; only the arena's pages are committed
    when touched. Processes started by this one inherit the variable, as any environment.
    """
    import sys

    if "pyarrow" not in sys.modules:
        os.environ.setdefault(MIMALLOC_EAGER_ENV, "0")
