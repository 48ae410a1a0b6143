"""Live straggler detection: the job names its straggler while it runs.

A window is ``HVTRACE_LIVE_EVERY`` steps (:func:`hvtrace.settings.live_every`, default 100), or
``HVTRACE_LIVE_S`` seconds (:func:`hvtrace.settings.live_window_s`, default 5) where that is more
steps (at most :data:`MAX_WINDOW_STEPS`): judging a window costs rank 0 about 30 ms of CPU (2
ranks) to 100 ms (16 ranks, 2,000 steps), mostly fixed whatever its steps (bench/judge_cost.py), a
tenth of a CPU at windows of 100 steps of 3 ms. The windows' length is agreed
on at the same step on every rank (:meth:`LiveMonitor._agree_length`: rank 0's mean step,
broadcast), so that every rank's window is the same steps. Each rank reduces its window to a small
matrix, one row per step (the phases' durations, the training thread's CPU time and run-queue wait
in them, and its arrival on rank 0's clock), a few steps at a time as they come (about
:data:`CHUNK_S`), on a background thread ("hvtrace-live"), never the training thread; the ranks
exchange their matrices with one asynchronous Horovod allgather per window, issued by the training
thread a chunk's worth of steps into the next window (:meth:`LiveMonitor._gather`: at the same step
on every rank, as every collective hvtrace issues: Horovod names a collective issued without a name
after a count of the process's collectives, so one issued from another thread would give the user's
unnamed collectives different names on different ranks) and waited for on the live thread (the
training loop never waits on it). Rank 0 then runs the offline analysis's own straggler decision on
that window, from a thread of its own ("hvtrace-judge", so that the live thread goes on reducing
while it waits; a judge that falls behind by :data:`JUDGE_BACKLOG` windows judges the newest;
within a CPU budget, ``HVTRACE_JUDGE_PCT`` of one core, windows that come sooner wait and are
judged together with the next: :meth:`LiveMonitor._judge_loop`) in a
child process (:mod:`hvtrace.analysis.live`: its pandas work never holds the training process's GIL)
(:func:`hvtrace.analysis.stragglers.straggler_table` on a step table built as
:func:`hvtrace.analysis.steps.finish_steps` builds it): one definition, so the live verdict and
``hvtrace analyze --steps`` of the same steps name the same rank and phase.

On rank 0, a rank named in :data:`PERSIST_WINDOWS` windows in a row logs one line (logger
``hvtrace``) with the last of them, for example::

    hvtrace: rank 1 (host b) late 38.2 ms/step over steps 80-99: input, blocked; ~27% of step time

and a logged rank that is then not named in as many windows in a row logs that it recovered; a
logged rank whose phase, cause or size changes (:func:`changed`) for as many windows logs the new
verdict. A host short of CPU logs one line when that begins and one when it ends, and no rank
is named for contention live (:func:`hvtrace.analysis.live.verdicts` says why).
Each verdict is also passed to the callbacks registered with :func:`on_straggler` (on rank 0's
judge thread, "hvtrace-judge"; an exception in one is logged, never raised), and written into
rank 0's trace file (batch status key ``live``), so the analysis shows when each was first seen.

Ranks out of lockstep (issue 44): each step's row also carries its counts (gradient allreduces,
the user's collectives outside the optimizer, forward and backward passes: counted on the live
thread from the step's entries, the collectives by :mod:`hvtrace.record.collectives` with one
increment each), which rank 0's judge compares with the offline check's rule
(:func:`hvtrace.analysis.live.lockstep_verdicts`); and each exchange has a presence allreduce
beside its allgather (:meth:`LiveMonitor._gather`), read by the training thread a chunk of steps
later, at the same step on every rank (:meth:`LiveMonitor._read_here`): a rank that joined is
absent there (it takes no part in an allgather but counts as zeros in an allreduce), and rank 0
asks there for a parameter fingerprint at the next step on every rank after a break. Each break
is an event ``lockstep`` (logged once, passed to the callbacks, kept in the trace).

Only host-timed runs (CPU): with CUDA timers the durations are device events that cannot be
read without synchronizing, and live detection is off (documented, not run on a GPU).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from hvtrace import settings
from hvtrace.format.lockstep_counts import COUNTS_FRAME_COLS, counts_agree
from hvtrace.format.schema import (
    KIND_CODE,
    LIVE_ARRIVAL_COL,
    LIVE_COLS,
    LIVE_COUNT_COL,
    LIVE_PHASES,
)
from hvtrace.format.status import live_line
from hvtrace.record.cpustat import deltas_columns
from hvtrace.record.native import hot_module
from hvtrace.record.rows import CPU_END, CPU_START, UNREAD, Allreduces
from hvtrace.record.threads import NamedThread

log = logging.getLogger("hvtrace")

#: A window's matrix layout (:data:`hvtrace.format.schema.LIVE_COLS`): phases in column order.
PHASES: Final[tuple[str, ...]] = LIVE_PHASES
_CODE = {KIND_CODE[p]: i for i, p in enumerate(PHASES)}
N_COLS: Final = LIVE_COLS
_ARRIVAL = LIVE_ARRIVAL_COL
_COUNT = LIVE_COUNT_COL
_K_FORWARD = KIND_CODE["forward"]
_K_BACKWARD = KIND_CODE["backward"]

#: A rank is logged late once named in this many windows in a row, and recovered once not
#: named in as many (one window of a few dozen steps can name a rank by chance on a busy host).
PERSIST_WINDOWS: Final = 2

#: A verdict is decided on at least this many steps (the last windows together, when a window
#: is shorter): fewer name noise on a busy host.
MIN_DECISION_STEPS: Final = 20

_callbacks: list[Callable[[dict[str, Any]], Any]] = []


def on_straggler(callback: Callable[[dict[str, Any]], Any]) -> None:
    """Call ``callback(verdict)`` on rank 0 when live detection names a straggler or sees one
    recover (off the training thread; exceptions are logged, never raised into training).

    A lockstep break is an event ``"lockstep"`` (``kind`` ``"stopped"`` or ``"sequence"``,
    ``rank``, ``ranks``, ``others``, ``message``; see :mod:`hvtrace.record.live`), on the rank
    that saw it (rank 0, or the lowest rank still training when rank 0 stopped).

    ``verdict``: a dict with ``event`` (``"late"``; ``"changed"`` when a logged rank's phase,
    cause or size changed for :data:`PERSIST_WINDOWS` windows; ``"recovered"``), ``rank``,
    ``host``,
    ``first_step`` / ``last_step`` (the window), ``late_ms`` (median lateness per step),
    ``phase`` and ``cause`` (as :func:`hvtrace.analysis.stragglers.straggler_table` names them),
    ``phase_excess_ms`` and ``step_share`` (lateness over the window's median step time).
    A host short of CPU is an event of its own (``"contended"``, then ``"uncontended"``; ``rank``
    None, ``work_share``: its ranks' run-queue wait over their time outside synchronize): no
    rank is named for contention live (see :func:`verdicts`).
    """
    _callbacks.append(callback)


def step_matrix(window: list[list], offset_ns: int) -> np.ndarray:
    """Reduce a window's per-step entry lists (what the tracer hands the recorder each step) to
    one row per step: see :data:`N_COLS`. Times on rank 0's clock (``local - offset_ns``).
    A step's entry list may come as ``(entries, n)``: ``n`` collectives issued outside the
    optimizer in the step (:meth:`LiveMonitor.on_step`). A step with entries gets its counts
    (:data:`hvtrace.format.schema.LIVE_COUNTS`: allreduced tensors, those collectives, forward and
    backward passes); a step without (not recorded) none: NaN, like its times.

    Runs on the live thread, holding the GIL the training thread needs: one pass of plain
    Python over the entries picks the phase rows; their durations and counters (the writer's
    :func:`~hvtrace.record.cpustat.deltas_columns`, each schedstat line parsed once) are then
    summed per step and phase with numpy. In one pass of C (``hvtrace.record._hot.window_into``)
    where the compiled hot path is built and on, else (or for entries it does not take)
    :func:`_step_matrix_py`: the same matrix."""
    into = getattr(hot_module(), "window_into", None)
    if into is not None and type(window) is list:
        out = np.full((len(window), N_COLS), np.nan)
        if into(window, out, _CODE, _K_FORWARD, _K_BACKWARD, Allreduces, int(offset_ns),
                _ARRIVAL, _COUNT):  # fmt: skip
            return out
    return _step_matrix_py(window, offset_ns)


def _step_matrix_py(window: list[list], offset_ns: int) -> np.ndarray:
    """:func:`step_matrix`'s Python form."""
    out = np.full((len(window), N_COLS), np.nan)
    code = _CODE
    steps: list[int] = []  # per phase row: its step's index in the window
    cols: list[int] = []  # ... its phase's column
    durations: list[int] = []
    readings: list[tuple[Any, Any]] = []
    for i, rows in enumerate(window):
        n_coll = 0
        if type(rows) is tuple:
            rows, n_coll = rows
        arrival = -1
        n_ar = n_fwd = n_bwd = 0
        for e in rows:
            if type(e) is tuple:
                j = code.get(e[2])
                if j is None:
                    continue
                if e[2] == _K_FORWARD:
                    n_fwd += 1
                elif e[2] == _K_BACKWARD:
                    n_bwd += 1
                steps.append(i)
                cols.append(1 + 3 * j)
                durations.append(e[5] - e[4])
                readings.append((e[CPU_START], e[CPU_END]) if len(e) > CPU_START else UNREAD)
                out[i, 0] = e[0]
            elif isinstance(e, Allreduces):
                meta = e.meta
                for t, key, _h in e.enqueued:
                    if type(t) is int and t > arrival:
                        arrival = t
                    m = meta.get(key)
                    n_ar += len(m[0]) if m is not None else 1
        if rows:
            out[i, _COUNT : _COUNT + 4] = (n_ar, n_coll, n_fwd, n_bwd)
        if arrival >= 0:
            out[i, _ARRIVAL] = arrival - offset_ns
    if steps:
        at, col = np.asarray(steps), np.asarray(cols)
        cpu, runq, cpu_ok, runq_ok = deltas_columns(readings)
        _add(out, at, col, np.asarray(durations, np.float64), None)
        _add(out, at, col + 1, cpu, cpu_ok)
        _add(out, at, col + 2, runq, runq_ok)
    return out


def _add(out: np.ndarray, rows: np.ndarray, cols: np.ndarray, values: Any, ok: Any) -> None:
    """Sum ``values`` (where ``ok``; None: all) into ``out``'s cells ``(rows, cols)``, which are
    NaN until a value reaches them."""
    if ok is not None:
        rows, cols, values = rows[ok], cols[ok], values[ok]
    if len(rows):
        out[rows, cols] = 0.0
        np.add.at(out, (rows, cols), values)


def changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a rank's verdict changed materially since it was logged: another phase or cause,
    or a lateness that moved by more than half (and by more than the host-timed noise floor)."""
    if (old.get("phase"), old.get("cause")) != (new.get("phase"), new.get("cause")):
        return True
    a, b = old.get("late_ms") or 0.0, new.get("late_ms") or 0.0
    floor_ms = 2.0  # stragglers.CPU_NOISE_FLOOR_NS, not imported on the training side
    return abs(b - a) > max(0.5 * max(a, b), floor_ms)


#: Steps whose entries the training thread hands to the live thread at a time, at least; the
#: live thread reduces them to matrix rows at once, so that no rank holds a whole window's
#: entries (a model's allreduces, step after step: about 7 MB per 100 steps of 152 tensors).
CHUNK_STEPS: Final = 10
#: ... and at most; between the two, :data:`CHUNK_S` of steps (fewer wake-ups of the live thread
#: when steps are short: at 5 ms steps its CPU was 2.9-3.2 ms a second with chunks of 50 ms and
#: 2.0-2.2 with 250 ms, 29 Nov 2026; a window is gathered a chunk into the next, so its verdict
#: comes that much later).
CHUNK_MAX_STEPS: Final = 100
CHUNK_S: Final = 0.25

#: Steps per window at most, however short the steps (the gathered window of every rank is
#: sent to every rank: 216 bytes a step and rank).
MAX_WINDOW_STEPS: Final = 2000

#: After the first windows (1, 2, 4, ...), the windows' length is agreed again every this many.
AGREE_EVERY_WINDOWS: Final = 64


def _steps_in(seconds: float, step_ns: float, lo: int, hi: int) -> int:
    """The steps that fill ``seconds`` at a mean step of ``step_ns``, within ``lo`` .. ``hi``
    (``lo`` wins where it is more); ``lo`` when ``seconds`` is 0 or the step unknown."""
    if not (seconds > 0 and step_ns > 0 and math.isfinite(step_ns)):
        return lo
    return max(lo, min(math.ceil(seconds * 1e9 / step_ns), hi))


def window_steps(step_ns: float, every: int, window_s: float) -> int:
    """Steps per window at a mean step of ``step_ns``: at least ``every`` and at least
    ``window_s`` seconds' worth, at most :data:`MAX_WINDOW_STEPS` (or ``every``, where that is
    more). ``every`` when ``window_s`` is 0 or the step unknown."""
    return _steps_in(window_s, step_ns, every, MAX_WINDOW_STEPS)


def chunk_steps(step_ns: float) -> int:
    """Steps handed to the live thread at a time at a mean step of ``step_ns``: about
    :data:`CHUNK_S`, within :data:`CHUNK_STEPS` .. :data:`CHUNK_MAX_STEPS`."""
    return _steps_in(CHUNK_S, step_ns, CHUNK_STEPS, CHUNK_MAX_STEPS)


#: Rank 0: functions given each window's per-step figures (a list of ``(step, {tag: value})``,
#: :func:`hvtrace.analysis.live.window_points`) on the live thread, as the judge process returns
#: them; :class:`hvtrace.lightning.HvtraceCallback` hands them to the Lightning logger.
_figure_listeners: list[Callable[[list[tuple[int, dict[str, float]]]], Any]] = []


def on_window_figures(callback: Callable[[list[tuple[int, dict[str, float]]]], Any]) -> None:
    """Call ``callback(points)`` on rank 0 with each live window's per-step figures (off the
    training thread; exceptions are logged). ``points``: ``(step, {tag: value})`` with the tags
    of :data:`hvtrace.format.tensorboard.SCALARS` a live window has."""
    _figure_listeners.append(callback)


#: How rank 0 starts its judge process: at the lowest CPU priority before anything is imported
#: (``python -m hvtrace.record.live_judge`` imports hvtrace, pyarrow and numpy first, 0.23 s of
#: CPU at the rank's priority, on a CPU the ranks may fill), free to run on any CPU this machine
#: lets it use (not only the cores rank 0 is pinned to, which its training thread needs), named
#: ``hvtrace-judge`` for the kernel (``top``, ``ps -o comm``: :mod:`hvtrace.record.threads`),
#: then the module as ``__main__``.
JUDGE_LAUNCH: Final = (
    "import os\n"
    "try:\n    os.nice(19)\nexcept OSError:\n    pass\n"
    "try:\n    os.sched_setaffinity(0, range(os.cpu_count() or 1))\n"
    "except (AttributeError, OSError, ValueError):\n    pass\n"
    "from hvtrace.record.threads import set_os_thread_name\n"
    "set_os_thread_name('hvtrace-judge')\n"
    "import runpy\n"
    "runpy.run_module('hvtrace.analysis.live', run_name='__main__', alter_sys=True)\n"
)

#: Rank 0: gathered windows that may wait for the judge thread; a newer one pushes the oldest out.
JUDGE_BACKLOG: Final = 4

#: Rank 0: the most the windows held for the judge's next judgment may take (bytes; the oldest
#: drops): at the default budget 2 ranks' windows of 5 s (0.7 MB each) are judged five or six at
#: a time, and 64 ranks' (23 MB) two.
JUDGE_HELD_BYTES: Final = 64 << 20

#: What the live thread's queue gives when nothing new came within its wait (a gathered window
#: is not done yet: it looks again).
_NOTHING_NEW: Final = object()

#: The live thread's looks at a gathered window that is not done yet: the first wait, then
#: doubling to the last (a window's verdict is not needed sooner).
WAIT_FIRST_S: Final = 0.0005
WAIT_MAX_S: Final = 0.01

#: How long the training thread waits, at a window's end, for the live thread to have reduced the
#: window before it (normally done a whole window earlier); past it, the rank's rows are sent
#: empty (NaN) for that window, which names nobody.
GATHER_WAIT_S: Final = 0.2


#: At :meth:`LiveMonitor.close`, how long the last exchange's presence is waited for, at most (it
#: completes once every rank issued it, at the same step: a rank that closes first waits for the
#: others' last step at most, or gives up).
CLOSE_WAIT_S: Final = 0.5
#: At the job's end (:meth:`LiveMonitor.drain`), how long rank 0 waits at most for the judge to
#: answer the windows already handed to it: its first answer takes the judge process's start
#: (pandas' import, seconds at the lowest priority), so a job of a few seconds would otherwise end
#: before any verdict, live or in its file.
DRAIN_WAIT_S: Final = 10.0


def _release(mpi_ops: Any, handle: Any) -> bool:
    """Release a gathered window nobody takes, if Horovod is done with it; whether it was."""
    try:
        if not mpi_ops.poll(handle):
            return False
        mpi_ops.synchronize(handle)
    except Exception:  # noqa: BLE001 - Horovod shut down: nothing left to release
        pass
    return True


def _join_ranks_rows(per_rank: list[np.ndarray]) -> np.ndarray:
    """Windows as ``(ranks, steps, cols)`` arrays, joined into one gathered matrix: each rank's
    rows of every window, in order, then the next rank's (as the allgather returns one)."""
    both = np.concatenate(per_rank, axis=1)
    return both.reshape(-1, both.shape[2])


def _merge_windows(windows: list[np.ndarray], size: int) -> np.ndarray:
    """Gathered windows of ``size`` ranks (each rank's rows in turn) as one."""
    return _join_ranks_rows([w.reshape(size, -1, w.shape[1]) for w in windows])


class LiveMonitor:
    """Collects the tracer's per-step entries into windows and runs the exchange on its thread.

    ``on_step(rows)`` is the only call on the training thread (a list append; every
    :data:`CHUNK_STEPS` steps a queue put of those steps' entries, which the live thread reduces
    to rows of the window's matrix; every ``every`` steps a put that has the window exchanged).
    """

    #: Collectives the user issued outside the optimizer since the last step
    #: (:mod:`hvtrace.record.collectives` counts them here; hvtrace's own not).
    collectives: int = 0
    #: The last exchange's presence allreduce (see :meth:`_gather`), read by the training thread
    #: ``_here_in`` steps after it was issued (:meth:`_read_here`): its handle, and the steps
    #: taken when it was issued; ``_here_steps``: the steps taken at the last exchange every rank
    #: took part in (None: none yet).
    _here: tuple[Any, int] | None = None
    _here_in: int = 0
    _here_steps: int | None = None
    #: Rank 0: a lockstep break was logged, and a parameter check is to be asked of every rank
    #: with the next exchange (see :meth:`_gather`).
    _want_check: bool = False
    #: A lockstep break was logged (one line per run: the first break).
    lockstep_logged: bool = False
    #: The steps at which parameter checks were asked after a break (the same on every rank).
    checks_asked: tuple[int, ...] = ()
    _counts: list[np.ndarray] | None = None
    #: Rank 0's judge within its CPU budget (see :meth:`_judge_loop`): the share of one core it
    #: may use (1: no limit; set from :func:`hvtrace.settings.judge_share`), the CPU (s) its last
    #: judgment took, judgments so far, when (monotonic s) the next may be, windows held for it.
    judge_share: float = 1.0
    judge_cpu_s: float = 0.0
    judgments: int = 0
    judge_next_s: float = 0.0
    judge_held: int = 0

    def __init__(
        self,
        tracer: Any,
        every: int,
        offset_ns: int,
        hosts: dict[int, str],
        index: int = 0,
        window_s: float = 0.0,
    ) -> None:
        """``every``: steps per window at least; ``window_s``: seconds per window at least (0:
        windows of ``every`` steps; see :meth:`_agree_length`), both rank 0's. ``index``: the
        tracer's set-up in this process, counted in the same order on every rank; it names
        this monitor's collectives apart from another tracer's (two traced optimizers in one
        process, as a GAN's). ``offset_ns``: this rank's start estimate; with that one
        estimate, the one alignment rule (:func:`hvtrace.clock.step_offsets`) moves every step
        by this constant, so the live windows are on the clock the analysis will use (but for
        drift, which the later estimates correct)."""
        self.tracer = tracer
        self.index = int(index)
        self.every = int(every)
        self.window_s = float(window_s)
        self.offset_ns = int(offset_ns)
        self.hosts = hosts
        self.window: list[list] = []  # entries of the steps not yet handed over
        self.in_window = 0  # steps of the current window so far
        self.windows_sent = 0
        self.prev_steps = 0  # steps of the window before the current one
        self.length = self.every  # steps of the current window (the same on every rank)
        #: The live thread's reduced windows, by number, until the training thread gathers them.
        self._matrices: dict[int, np.ndarray] = {}
        self._cond = threading.Condition()
        #: Gathered windows of a rank whose live thread stopped: released when done.
        self._orphans: list[Any] = []
        self.chunk_steps = CHUNK_STEPS  # steps handed over at a time
        #: The window to gather (:meth:`_gather`) once ``_due_in`` more steps have ended.
        self._due: int | None = None
        self._due_in = 0
        self.window_start_ns = time.monotonic_ns()
        self.init_verdicts()
        #: None: the judge process (:mod:`hvtrace.analysis.live`) decides; else a function with
        #: its ``verdicts`` signature, called here (tests).
        self.judge: Callable[[np.ndarray, int, dict[int, str]], list[dict[str, Any]]] | None = None
        self._judge_proc: Any = None
        #: Rank 0: the windows waiting for the judge thread (None: not started), and how many
        #: it skipped, falling behind (see :data:`JUDGE_BACKLOG`).
        self._judge_q: queue.Queue | None = None
        self._judge_thread: threading.Thread | None = None
        self.judge_skipped = 0
        self.judge_share = settings.judge_share()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        #: The live thread takes nothing more (closed, or failed on this rank).
        self._stopped = False
        #: Closed: on_step does nothing (see close).
        self._closed = False
        self._thread = NamedThread(target=self._run, name="hvtrace-live", daemon=True)
        self._thread.start()

    def init_verdicts(self) -> None:
        """The judge's memory of what it logged (rank 0), empty."""
        self.named: dict[int, dict[str, Any]] = {}  # ranks logged late, with what was logged
        self.streak: dict[int, int] = {}  # windows in a row a rank was named in
        self.clear: dict[int, int] = {}  # windows in a row it was not
        self.moved: dict[int, int] = {}  # windows in a row its verdict differed from the logged
        self.contended: dict[str, dict[str, Any]] = {}  # hosts logged short of CPU
        self.host_streak: dict[str, int] = {}
        self.host_clear: dict[str, int] = {}
        self.recent: deque[tuple[np.ndarray, int]] = deque()  # see _decided_on
        #: per rank, the steps at which it alone ran a forward with no backward (see _lockstep)
        self.lone_forwards: dict[int, list[int]] = {}
        #: the counts of the windows gathered since the judge last took them (see _take_counts)
        self._counts: list[np.ndarray] | None = []

    def on_step(self, rows: list) -> None:
        """Hot path: keep a reference to the step's entries; hand them over every
        ``chunk_steps`` steps and at the window's end, then the window; ``chunk_steps`` steps
        after a window's end, gather it (:meth:`_gather`); at a window's end, some windows,
        agree on the next windows' length (:meth:`_agree_length`). Nothing is handed over once
        the live thread has stopped (closed, or failed): nothing piles up in its queue."""
        if self._closed:
            return
        self.in_window += 1
        full = self.in_window >= self.length
        if not self._stopped:
            window = self.window
            n = self.collectives
            if n:
                self.collectives = 0
                rows = (rows, n)
            window.append(rows)
            if full or len(window) >= self.chunk_steps:
                self.window = []
                self._q.put(window)
            if full:
                self._q.put(self.windows_sent)
        if full:
            # the windows are counted, gathered and their length agreed on every rank until it
            # closes, even where live detection failed: those are collectives on the training
            # thread, which the other ranks would wait in for ever
            if self._due is not None:  # a window shorter than the gather's lag: gathered now
                self._gather(self._due)
            self.windows_sent += 1
            n = self.windows_sent
            self.prev_steps = self.in_window
            if self.window_s > 0 and (n & (n - 1) == 0 or n % AGREE_EVERY_WINDOWS == 0):
                self._agree_length()
            self.in_window = 0
            self.window_start_ns = time.monotonic_ns()
            # the window that just ended is gathered a chunk's worth of steps into the next
            # (its last chunk reduced by then), not at the next window's end: the verdict comes
            # a window sooner, and a job's last window is judged when a chunk of steps follows it
            self._due, self._due_in = n - 1, self.chunk_steps
        elif self._due is not None:
            self._due_in -= 1
            if self._due_in <= 0:
                self._gather(self._due)
        if self._here is not None:
            self._here_in -= 1
            if self._here_in <= 0:
                self._read_here()

    def _agree_length(self) -> None:
        """Lengthen the windows of short steps to ``window_s`` seconds (the judge's fixed cost,
        30-100 ms of CPU a window, mostly whatever its steps, is then a share of a CPU no larger
        than at steps of 50 ms; bench/judge_cost.py). Rank 0's mean step over the
        window that just ended is broadcast (one number, on the training thread, at the same
        step on every rank: the windows stay the same steps everywhere) and every rank sets
        the next windows' length from it (:func:`window_steps`) and the steps it hands over at
        a time (:func:`chunk_steps`). After windows 1, 2, 4, 8, ... and then every
        :data:`AGREE_EVERY_WINDOWS` windows. A failure stops live detection on this rank, as
        any on its thread."""
        import torch
        from horovod.torch import mpi_ops  # Horovod's own names: not recorded as the user's

        mean_ns = (time.monotonic_ns() - self.window_start_ns) / max(1, self.in_window)
        try:
            got = mpi_ops.broadcast(
                torch.tensor([mean_ns], dtype=torch.float64),
                root_rank=0,
                name=f"hvtrace.live.{self.index}.len.{self.windows_sent}",
            )
            step_ns = float(got[0])
        except Exception as exc:  # noqa: BLE001 - never into training
            log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)
            self.close()
            return
        self.length = window_steps(step_ns, self.every, self.window_s)
        self.chunk_steps = chunk_steps(step_ns)

    def _gather(self, k: int) -> None:
        """Training thread, ``chunk_steps`` steps into window ``k + 1`` (or at its end, if
        shorter): start window ``k``'s exchange, every
        rank's rows gathered on every rank (an asynchronous allgather; the live thread waits for
        it and rank 0 judges). Issued here, at the same step on every rank, never from the live
        thread: Horovod names a collective issued without a name after a count of this
        process's collectives, so one issued from another thread, at a moment that differs by
        rank, would give the user's unnamed collectives different names on different ranks (a
        hang, or Horovod reducing tensors of different shapes under one name). The window's
        rows come from the live thread, which had its last chunk as many steps ago; a rank whose
        live thread has not (or has stopped) sends NaN rows, which name nobody. A failure stops live
        detection on this rank (Horovod shut down: it fails on every rank)."""
        import torch
        from horovod.torch import mpi_ops  # Horovod's own names: not recorded as the user's

        self._due = None
        matrix = None
        if not self._stopped:
            with self._cond:
                self._cond.wait_for(
                    lambda: k in self._matrices or self._stopped, timeout=GATHER_WAIT_S
                )
                matrix = self._matrices.pop(k, None)
                for old in [j for j in self._matrices if j < k]:
                    del self._matrices[old]
        if matrix is None:
            matrix = np.full((self.prev_steps, N_COLS), np.nan)
        if self._here is not None:  # (a window shorter than the presence's lag)
            self._read_here()
            if self._closed:
                return
        try:
            size, rank = mpi_ops.size(), mpi_ops.rank()
            here = np.zeros(size + 1)
            here[rank] = 1.0
            if self._want_check:
                here[size] = 1.0
                self._want_check = False
            self._here = (
                mpi_ops.allreduce_async(
                    torch.from_numpy(here),
                    name=f"hvtrace.live.{self.index}.{k}.here",
                    op=mpi_ops.Sum,
                ),
                int(self.tracer.steps_done),
            )
            self._here_in = self.chunk_steps
            handle = mpi_ops.allgather_async(
                torch.from_numpy(matrix), name=f"hvtrace.live.{self.index}.{k}"
            )
            if self._stopped:  # nobody waits for it: released here once done
                with self._cond:
                    self._orphans = [h for h in self._orphans if not _release(mpi_ops, h)]
                    self._orphans.append(handle)
            else:
                self._q.put((k, handle))
        except Exception as exc:  # noqa: BLE001 - never into training
            log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)
            self.close()

    def close(self, read_presence: bool = True) -> None:
        """Stop: the live thread starts no exchange after this and ends (an exchange already in
        progress completes on every rank, which all hand over the same windows), and
        :meth:`on_step` does nothing more (every rank closes at the same point: its finish, an
        elastic reset, or a failed agreement, which fails on every rank). The last exchange's
        presence is read first where Horovod has it within :data:`CLOSE_WAIT_S` (a rank that
        stopped short and joined is named then: the job's end may be the first exchange it
        missed); not with ``read_presence`` False (at the interpreter's exit, where the script
        may have shut Horovod down already)."""
        if read_presence and self._here is not None and not self._closed:
            self._read_here(wait_s=CLOSE_WAIT_S)
        self._closed = True
        self._stopped = True
        self._q.put(None)

    def drain(self, timeout_s: float = DRAIN_WAIT_S) -> None:
        """After :meth:`close`, at the job's end: wait (``timeout_s`` at most, in all) for the
        live thread to end and for the judge to answer the windows already handed to it, so that
        their verdicts are logged and written into this rank's file before it closes. Not at an
        elastic reset: training goes on there."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        for t in (self._thread, self._judge_thread):
            if t is not None and t is not threading.current_thread():
                t.join(max(deadline - time.monotonic(), 0.0))

    def before_join(self) -> None:
        """Training thread, as this rank calls ``hvd.join()``: read the last exchange's presence
        (waiting :data:`CLOSE_WAIT_S` at most), while Horovod still runs (once every rank has
        joined, one may end the job and Horovod with it): a rank that joined before this one's
        last exchange is named here. Never raises."""
        try:
            if self._here is not None and not self._closed:
                self._read_here(wait_s=CLOSE_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - never into training
            log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)

    def _read_here(self, wait_s: float | None = None) -> None:
        """Training thread, ``chunk_steps`` steps after an exchange (or before the next one, or
        at close, waiting ``wait_s`` at most): read its presence allreduce (see :meth:`_gather`),
        the same result on every rank that took part, read at the same step.

        A rank that has joined (``hvd.join()``) takes no part in an allgather (Horovod fails it
        on the others: "Allgather is not supported with Join") but is counted in an allreduce
        as zeros: absent from the presence, it stopped taking the steps the others still take.
        Then the lowest rank present names it (:meth:`_stopped_ranks`) and every rank present
        closes live detection here, at the same step (no more exchanges). Else, where rank 0
        asked for it (a lockstep break its judge saw), every rank takes a parameter check at its
        next step (:meth:`_ask_check`)."""
        from horovod.torch import mpi_ops

        assert self._here is not None
        handle, steps = self._here
        self._here = None
        try:
            if wait_s is not None:
                end = time.monotonic() + wait_s
                while not mpi_ops.poll(handle):
                    if time.monotonic() > end:  # released when done, or never
                        with self._cond:
                            self._orphans.append(handle)
                        return
                    time.sleep(0.002)
            got = mpi_ops.synchronize(handle).numpy()
        except Exception as exc:  # noqa: BLE001 - never into training
            log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)
            if not self._closed:
                self.close()
            return
        size = len(got) - 1
        absent = [r for r in range(size) if got[r] < 0.5]
        if not absent:
            self._here_steps = steps
            if got[size] >= 0.5:
                self._ask_check()
            return
        present = [r for r in range(size) if r not in absent]
        if present and mpi_ops.rank() == present[0]:
            self._stopped_ranks(absent, present, steps)
        if not self._closed:
            self.close()

    def _ask_check(self) -> None:
        """Have the consistency checks fingerprint the parameters at this rank's next step (the
        same step on every rank: see :meth:`_read_here`)."""
        tr = self.tracer
        checks = getattr(tr, "checks", None)
        step = int(tr.rec.step)
        self.checks_asked = (*self.checks_asked, step)
        if checks is not None and hasattr(checks, "ask"):
            checks.ask(step)

    def _stopped_ranks(self, absent: list[int], present: list[int], steps: int) -> None:
        """Name the ranks that joined while the others took steps (``steps``: the steps this
        rank had taken at the exchange they missed), with the optimizer steps they skipped where
        rank 0's judge saw them alone run a forward with no backward (the offline rule's
        ``skipped_steps``, :func:`hvtrace.analysis.lockstep.lone_forwards`), on a thread of its
        own (the callbacks run off the training thread)."""
        lo = self._here_steps
        lone = self.lone_forwards  # (rank 0's judge keeps them)
        known = [sorted(lone.get(r, ())) for r in absent]
        skipped = known[0] if all(k == known[0] for k in known) else []
        e: dict[str, Any] = {
            "event": "lockstep",
            "kind": "stopped",
            "rank": absent[0],
            "ranks": absent,
            "others": present,
            "host": self.hosts.get(absent[0], "?"),
            # its last step: at least the last exchange's, before the one it missed
            "first_step": None if lo is None else lo - 1,
            "last_step": steps - 1,
            "joined": True,
            "skipped_steps": skipped,
        }
        e["message"] = stopped_message(e)
        self.lockstep_logged = True
        NamedThread(target=self._emit, args=([e],), name="hvtrace-judge", daemon=True).start()

    def _emit(self, events: list[dict[str, Any]]) -> None:
        """Log each event, write it into this rank's trace and pass it to the callbacks."""
        for e in events:
            log.warning("%s", live_line(e))
            rec = self.tracer.rec
            if rec.enabled:
                rec.live_events.append(e)
            for cb in list(_callbacks):
                try:
                    cb(dict(e))
                except Exception as exc:  # noqa: BLE001 - the user's callback
                    log.warning("hvtrace: on_straggler callback failed: %s: %s",
                                type(exc).__name__, exc)  # fmt: skip

    # -- the live thread ----------------------------------------------------------------------
    def _run(self) -> None:
        """Reduce every chunk as soon as it is handed over, keep each window's matrix for the
        training thread to gather (:meth:`_gather`), and take each gathered window when Horovod
        has it, in order (rank 0 hands it to the judge). This thread issues no collective.

        A gathered window is done when the slowest rank has gathered it (up to a step later);
        it is looked at between chunks, without blocking (``poll``, sleeping 0.5 ms doubling to
        10 ms while nothing comes): Horovod's ``synchronize`` waits by spinning, which would
        spend a CPU and pull the GIL away from the training thread."""
        from horovod.torch import mpi_ops

        reduced: list[np.ndarray] = []  # the current window's rows so far
        pending: deque[tuple[int, Any]] = deque()  # windows gathered, not yet done
        delay = WAIT_FIRST_S
        while True:
            try:
                item = self._q.get(timeout=delay) if pending else self._q.get()
            except queue.Empty:
                item = _NOTHING_NEW
            if self._stopped:  # closed (or failed): what was gathered is released, unjudged
                self._end(pending)
                return
            try:
                if type(item) is list:  # some steps' entries
                    reduced.append(step_matrix(item, self.offset_ns))
                elif type(item) is int:  # the window's end: its number
                    matrix = np.concatenate(reduced) if reduced else np.empty((0, N_COLS))
                    reduced = []
                    with self._cond:
                        self._matrices[item] = matrix
                        self._cond.notify_all()
                elif type(item) is tuple:  # a window the training thread gathered
                    pending.append(item)
                delay = WAIT_FIRST_S if item is not _NOTHING_NEW else min(2 * delay, WAIT_MAX_S)
                while pending and mpi_ops.poll(pending[0][1]):
                    _k, handle = pending.popleft()
                    self._gathered(mpi_ops, mpi_ops.synchronize(handle).numpy())
            except Exception as exc:  # noqa: BLE001 - never into training
                if "Join" in str(exc):  # a rank joined: the presence names it (_read_here)
                    log.info("hvtrace: live window exchange ended: %s", exc)
                else:
                    log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)
                self._stopped = True  # on_step hands nothing more over
                with self._cond:
                    self._cond.notify_all()
                self._end(pending)
                return

    def _end(self, pending: deque[tuple[int, Any]]) -> None:
        """The live thread's end: the windows gathered but not taken go to the training thread
        to release (they complete on every rank: every rank gathered them), and the judge
        stops."""
        with self._cond:
            self._orphans.extend(h for _, h in pending)
        pending.clear()
        self._stop_judge()

    def _gathered(self, mpi_ops: Any, gathered: np.ndarray) -> None:
        """A window's rows of every rank, gathered: rank 0 judges them."""
        if mpi_ops.rank() == 0:
            self._hand_to_judge(gathered, mpi_ops.size())

    def _stop_judge(self) -> None:
        """End the judge thread after the windows handed to it (it then closes the judge
        process); without one, close the judge process."""
        q, self._judge_q = self._judge_q, None
        if q is not None:
            self._skipped_put(q, None)
        else:
            self._close_judge_proc()

    def _close_judge_proc(self) -> None:
        p, self._judge_proc = self._judge_proc, None
        if p is not None:
            try:
                p.stdin.close()
                p.wait(timeout=5)
            except Exception:  # noqa: BLE001
                p.kill()

    def _start_judge_thread(self) -> queue.Queue:
        """The judge thread ("hvtrace-judge") and its queue."""
        q = self._judge_q = queue.Queue(JUDGE_BACKLOG)
        self._judge_thread = NamedThread(
            target=self._judge_loop, args=(q,), name="hvtrace-judge", daemon=True
        )
        self._judge_thread.start()
        return q

    def _hand_to_judge(self, gathered: np.ndarray, size: int) -> None:
        """Rank 0: hand the gathered window to the judge thread (started with the first
        window), which decides the windows' verdicts in order. The judge process's answer is
        waited for there, not on the live thread, which meanwhile reduces what the training
        thread hands over: the first answer takes the judge process's start (pandas' import:
        seconds on a CPU the rank's training shares). Not started sooner: starting it with the
        first steps, its start cost rank 0 about 17 ms of run-queue wait per step of a short
        job pinned to one core per rank (tests/integration/test_causes.py failed so)."""
        q = self._judge_q if self._judge_q is not None else self._start_judge_thread()
        per = gathered.reshape(size, -1, gathered.shape[1])[:, :, COUNTS_COLS]
        with _COUNTS_LOCK:  # every window's counts, even those the judge skips (see _take_counts)
            if self._counts is None:
                self._counts = []
            counts = self._counts
            if counts and counts[0].shape[0] != size:
                counts.clear()  # the world changed size (elastic)
            counts.append(per)
            if len(counts) > MAX_COUNT_WINDOWS:
                _trim_counts(counts)
        self._skipped_put(q, (gathered, size))

    def _take_counts(self) -> np.ndarray | None:
        """The counts (:data:`COUNTS_COLS`) of every window gathered since the judge last took
        them, stacked in rank order: the lockstep check sees every window, even where the judge
        fell behind and judges only the newest (a break happens once)."""
        with _COUNTS_LOCK:
            counts, self._counts = self._counts or [], []
        if not counts:
            return None
        return _join_ranks_rows(counts)

    def _skipped_put(self, q: queue.Queue, item: Any) -> None:
        """Put ``item``; where :data:`JUDGE_BACKLOG` windows already wait, the oldest is dropped
        (counted in ``judge_skipped``): a verdict on it would come late, and gathered windows of
        hundreds of ranks are megabytes each."""
        while True:
            try:
                q.put_nowait(item)
                return
            except queue.Full:
                try:
                    q.get_nowait()
                    self.judge_skipped += 1
                except queue.Empty:
                    pass

    def _judge_loop(self, q: queue.Queue) -> None:
        """The judge thread: the windows' verdicts, in order, until told to stop (None); then
        the judge process is closed. An error stops live detection, as on the live thread.

        Within a CPU budget (``judge_share`` of one core, :func:`hvtrace.settings.judge_share`):
        after a judgment that took ``c`` seconds of the judge's CPU, a window that ends sooner
        than ``c / judge_share`` later is held, and judged with the windows after it once that
        time has passed (their steps together: a judgment's cost is mostly fixed, so three
        windows cost about 1.6 times one). The first judgment's cost is not counted (the judge
        process's start: pandas' import and first calls). Held windows are at most
        :data:`JUDGE_HELD_BYTES` (the oldest then drops, counted in ``judge_skipped``); those
        held at the end are judged then."""
        held: list[np.ndarray] = []
        size = 0
        while True:
            item = q.get()
            try:
                if item is not None:
                    gathered, n = item
                    if held and n != size:  # the world changed size (elastic): those apart
                        self._judge_held(held, size)
                    held.append(gathered)
                    size = n
                    while len(held) > 1 and sum(h.nbytes for h in held) > JUDGE_HELD_BYTES:
                        held.pop(0)
                        self.judge_skipped += 1
                    if time.monotonic() < self.judge_next_s:
                        self.judge_held += 1
                        continue
                self._judge_held(held, size)
            except Exception as exc:  # noqa: BLE001 - never into training
                log.warning("hvtrace: live detection stopped: %s: %s", type(exc).__name__, exc)
                self._stopped = True  # on_step hands nothing more over
                self._close_judge_proc()
                return
            if item is None:
                self._close_judge_proc()
                return

    def _judge_held(self, held: list[np.ndarray], size: int) -> None:
        """Judge the windows ``held`` (of ``size`` ranks) as one, if any, and empty it."""
        if not held:
            return
        both = held[0] if len(held) == 1 else _merge_windows(held, size)
        windows = len(held)
        held.clear()
        self._judge(both, size, windows)
        self._after_judgment(time.monotonic())

    def _after_judgment(self, now_s: float) -> None:
        """When the next judgment may be (``judge_next_s``, monotonic s): after the judge's CPU
        for the last one (``judge_cpu_s``) at ``judge_share`` of a core; the first one's cost
        (the judge's start) is not counted."""
        self.judgments += 1
        if self.judgments > 1 and self.judge_share < 1.0:
            self.judge_next_s = now_s + self.judge_cpu_s / self.judge_share

    def _ask_judge(
        self, gathered: np.ndarray, size: int, counts: np.ndarray | None = None
    ) -> list[dict[str, Any]]:
        """The window's verdicts from the judge process (started on first use; see
        :mod:`hvtrace.analysis.live`): the pandas work never holds this process's GIL."""
        import json

        p = self._judge_proc if self._judge_proc is not None else self._spawn_judge()
        assert p.stdin is not None and p.stdout is not None
        g = np.ascontiguousarray(gathered, dtype=np.float64)
        meta = {
            "size": size,
            "hosts": self.hosts,
            "rows": g.shape[0],
            "cols": g.shape[1],
            "figures": bool(_figure_listeners),
        }
        c = np.ascontiguousarray(
            counts if counts is not None else np.empty((0, len(COUNTS_COLS))), dtype=np.float64
        )
        meta["count_rows"] = c.shape[0]
        p.stdin.write(json.dumps(meta).encode() + b"\n" + g.tobytes() + c.tobytes())
        p.stdin.flush()
        reply = p.stdout.readline()
        if not reply:
            raise RuntimeError("the live judge process ended")
        res = json.loads(reply)
        if "error" in res:
            raise RuntimeError(f"the live judge failed: {res.get('error')}")
        self.judge_cpu_s = max(0.0, float(res.get("cpu_s", 0.0)))
        points = [(int(st), dict(v)) for st, v in res.get("figures") or []]
        for cb in list(_figure_listeners) if points else ():
            try:
                cb(points)
            except Exception as exc:  # noqa: BLE001 - the listener's failure stays there
                log.warning(
                    "hvtrace: live figures listener failed: %s: %s", type(exc).__name__, exc
                )
        return res["verdicts"]

    def _spawn_judge(self) -> Any:
        """Start the judge process (:data:`JUDGE_LAUNCH`)."""
        import subprocess
        import sys

        self._judge_proc = subprocess.Popen(
            [sys.executable, "-c", JUDGE_LAUNCH],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        return self._judge_proc

    def _decided_on(self, gathered: np.ndarray, size: int) -> np.ndarray:
        """The steps a verdict is decided on: this window, and the windows just before it while
        it has fewer than :data:`MIN_DECISION_STEPS` steps (``HVTRACE_LIVE_EVERY=10`` decides
        on the last 20 steps every 10: over ten steps, one slow step on a busy host is a share
        of 10 %)."""
        recent = self.recent
        per = gathered.reshape(size, -1, gathered.shape[1])
        n = int(np.isfinite(per[:, :, 0]).sum(axis=1).max()) if per.size else 0
        if n == 0 or (recent and recent[-1][0].shape[0] != size):
            recent.clear()  # no steps (recording off), or the world changed size (elastic)
        if n == 0:
            return gathered
        recent.append((per, n))
        while len(recent) > 1 and sum(k for _, k in recent) - recent[0][1] >= MIN_DECISION_STEPS:
            recent.popleft()
        if len(recent) == 1:
            return gathered
        return _join_ranks_rows([p for p, _ in recent])

    def _judge(self, gathered: np.ndarray, size: int, windows: int = 1) -> None:
        """One window's verdicts into events, with hysteresis: a rank is logged late once named
        in :data:`PERSIST_WINDOWS` windows in a row, logged again (``changed``) when its phase,
        cause or size differs from what was logged in as many windows in a row, and recovered
        when not named in as many; a host likewise is logged short of CPU (``contended``) and
        then ``uncontended``. ``gathered`` holds ``windows`` windows (those the CPU budget held,
        judged together): a judgment of their steps together counts as that many windows in a
        row, so the lines come as they would with each window judged alone (counted once, a
        short job's held windows never made two in a row: the verdict matrix's 200-step jobs on
        a quiet host, 29 Nov 2026)."""
        gathered = self._decided_on(gathered, size)
        if self.judge is None:
            found = self._ask_judge(gathered, size, self._take_counts())
        else:  # in this process (tests): this thread's CPU
            c0 = time.thread_time()
            found = self.judge(gathered, size, self.hosts)
            self.judge_cpu_s = time.thread_time() - c0
        now = {v["rank"]: v for v in found if v.get("kind", "rank") == "rank"}
        hosts_now = {v["host"]: v for v in found if v.get("kind") == "host"}
        steps = gathered[:, 0]
        steps = steps[np.isfinite(steps)]  # no steps at all where no rank recorded (all NaN)
        first, last = (int(steps.min()), int(steps.max())) if steps.size else (None, None)
        events = []
        # ranks: named (or not) in PERSIST_WINDOWS windows in a row
        _count_windows(self.streak, self.clear, now, windows)
        for r in self.streak:
            moved = r in now and r in self.named and changed(self.named[r], now[r])
            self.moved[r] = self.moved.get(r, 0) + windows if moved else 0
        for r, v in now.items():
            if r not in self.named and self.streak[r] >= PERSIST_WINDOWS:
                self.named[r] = v
                events.append(dict(v, event="late"))
            elif r in self.named and self.moved[r] >= PERSIST_WINDOWS:
                self.named[r] = v
                self.moved[r] = 0
                events.append(dict(v, event="changed"))
        for r in [r for r in self.named if self.clear.get(r, 0) >= PERSIST_WINDOWS]:
            v = self.named.pop(r)
            events.append(
                dict(v, event="recovered", first_step=first, last_step=last, late_ms=None)
            )
        # hosts short of CPU: one line when it begins, one when it ends
        _count_windows(self.host_streak, self.host_clear, hosts_now, windows)
        for h, v in hosts_now.items():
            if h not in self.contended and self.host_streak[h] >= PERSIST_WINDOWS:
                self.contended[h] = v
                events.append(dict(v, event="contended", rank=None))
        for h in [h for h in self.contended if self.host_clear.get(h, 0) >= PERSIST_WINDOWS]:
            v = self.contended.pop(h)
            events.append(dict(v, event="uncontended", rank=None, first_step=first, last_step=last))
        events += self._lockstep(found, first, last)
        self._emit(events)

    def _lockstep(
        self, found: list[dict[str, Any]], first: int | None, last: int | None
    ) -> list[dict[str, Any]]:
        """The window's lockstep verdicts (:func:`hvtrace.analysis.live.lockstep_verdicts`): the
        first break is an event (once per run), and a parameter check is asked of every rank
        with the next exchange; the steps a rank alone ran a forward with no backward are kept
        (at most :data:`MAX_LONE_FORWARDS` per rank), to name the steps it skipped if it stops
        short."""
        for v in found:
            if v.get("kind") == "lone_forward":
                seen = self.lone_forwards.setdefault(int(v["rank"]), [])
                seen.extend(s for s in v["steps"] if s not in seen)
                del seen[MAX_LONE_FORWARDS:]
        lock = [v for v in found if v.get("kind") == "lockstep"]
        if not lock or self.lockstep_logged:
            return []
        self.lockstep_logged = True
        self._want_check = True
        b = lock[0]
        return [
            dict(b, event="lockstep", kind=b.get("rule", "sequence"), rank=b["ranks"][0],
                 host=self.hosts.get(b["ranks"][0], "?"), first_step=first, last_step=last)
        ]  # fmt: skip


#: The columns of a window's matrix the lockstep check reads (:func:`hvtrace.analysis.live.
#: counts_frame`): :data:`hvtrace.format.lockstep_counts.COUNTS_FRAME_COLS`, the step, backward
#: and compute time, and the counts.
COUNTS_COLS: Final[list[int]] = [
    0,
    1 + 3 * PHASES.index("backward"),
    1 + 3 * PHASES.index("compute"),
    *range(LIVE_COUNT_COL, LIVE_COLS),
]
#: Windows whose counts wait for the judge, at most: past it, those that can hold no lockstep
#: verdict are dropped first (:func:`_trim_counts`).
MAX_COUNT_WINDOWS: Final = 64
_COUNTS_LOCK = threading.Lock()


def _trim_counts(counts: list[np.ndarray]) -> None:
    """Bring the windows' counts waiting for the judge back to :data:`MAX_COUNT_WINDOWS`:
    first the oldest windows whose counts can hold no verdict
    (:func:`hvtrace.format.lockstep_counts.counts_agree`, the judge's own test), then the
    newest. The judge's first answer takes its process's start, at the lowest CPU priority on
    cores the ranks may fill: hundreds of steps (tests/integration/test_lockstep.py); a break
    in the first windows must still reach it (it is logged once, the first; the first lone
    forwards are the ones kept), not be pushed out by the windows in lockstep after it."""
    extra = len(counts) - MAX_COUNT_WINDOWS
    keep = []
    for c in counts:
        if extra > 0 and counts_agree(c.reshape(-1, c.shape[2]), c.shape[0], COUNTS_FRAME_COLS):
            extra -= 1
        else:
            keep.append(c)
    counts[:] = keep[:MAX_COUNT_WINDOWS]


#: Steps kept per rank at which it alone ran a forward with no backward (rank 0's judge).
MAX_LONE_FORWARDS: Final = 64


def stopped_message(e: dict[str, Any]) -> str:
    """The log line's message for ranks seen stopped and joined (:meth:`LiveMonitor.
    _stopped_ranks`), worded as the offline finding's (:func:`hvtrace.analysis.lockstep.
    describe`)."""

    def ranks(rs: list[int]) -> str:
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)

    who, others = ranks(e["ranks"]), ranks(e["others"])
    lo, hi = e.get("first_step"), e["last_step"]
    when = f"before step {hi}" if lo is None else f"after step {lo} and before step {hi}"
    skipped = e.get("skipped_steps") or []
    if skipped:
        at = ", ".join(str(s) for s in skipped)
        head = (
            f"ranks out of lockstep: {who} skipped an optimizer step at step {at} (a forward pass "
            f"with no backward and no update, where {others} took the step), so from then on its "
            f"allreduces paired with those of {others} a step ahead, and it stopped {when} and "
            f"joined (hvd.join) while {others} went on"
        )
    else:
        head = (
            f"ranks out of lockstep: {who} stopped training {when} and joined (hvd.join) while "
            f"{others} went on"
        )
    return (
        head + ": Horovod counts a joined rank's gradients as zeros, so the averaged gradients "
        "are divided among ranks that no longer compute, and the ranks end with different "
        "models. Every rank must take the same steps: decide on every rank from a value reduced "
        "across ranks, never on one rank's own view"
    )


def _count_windows(
    streak: dict[Any, int], clear: dict[Any, int], now: dict[Any, Any], windows: int = 1
) -> None:
    """Count, for every key seen so far, the windows in a row it was named in (``streak``) and
    the windows in a row it was not (``clear``); ``now``: the named keys of this judgment, of
    ``windows`` windows together."""
    for k in set(streak) | set(now):
        streak[k] = streak.get(k, 0) + windows if k in now else 0
        clear[k] = 0 if k in now else clear.get(k, 0) + windows
