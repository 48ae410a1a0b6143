"""Elastic Horovod: who is in the job, agreed by every rank at start and after each reset.

Under ``hvd.elastic.run`` workers leave (a failure, a host removed) and join (a host added); each
change is a *reset*: the surviving workers shut Horovod down, initialize it again with the new
set of workers (their rank and the size may change), call ``State.on_reset()`` and then
``State.sync()``; a new worker runs the script from the top (``hvd.init()``, the model, the
optimizer) and then ``State.sync()``. Every collective hvtrace issues must therefore be issued by
the survivors too, in the same order, before ``sync()``: :func:`install` wraps
``horovod.common.elastic.State.on_reset`` so that the surviving ranks run the same sequence a new
worker runs in :func:`hvtrace.record.optimizer.trace_optimizer` (the clock handshake, then
:func:`setup_gather`), before the job's own reset callbacks.

:func:`setup_gather` is one ``allgather_object`` (``hvtrace.setup``): each rank sends rank 0's
live window setting, its host name and, when it has recorded already (a survivor), its worker id,
step count, last membership generation and run id. From it every rank derives the same
:class:`Membership`:

- ``worker``: a stable id per process, the key of its trace file (``rank{worker:05d}-RUNID``):
  the initial members' ranks, then, for each worker that joins, the next unused id (in the order
  of their new ranks). A file is never shared by two processes, and a process keeps its one file
  across resets whatever its rank becomes;
- ``start_step``: the step numbering goes on from the largest step count of the survivors, so that
  step numbers stay unique per file and aligned across workers (the replayed steps, redone from
  the last commit, get new numbers; how many were replayed is recorded);
- ``gen``: the membership generation (0 at start, +1 per reset).

Each file records the memberships it saw: the first in its header (``membership``), each later
one in a batch status (``membership``, a list; see docs/format.md). After a reset, live straggler
detection is off (its windows could not stay in step with a new worker's); the consistency checks
(local), the collectives' recording and the scheduled clock estimates go on.

Also wrapped: ``State.commit`` (the step of the last commit: how many steps a restore replays)
and ``ObjectState.restore`` (a restore happened: the job failed, and goes back to the commit).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Final

from hvtrace import settings

log = logging.getLogger("hvtrace")

#: The name of the set-up collective (every rank, at start and after each reset).
SETUP_NAME: Final = "hvtrace.setup"
#: Most workers listed per membership record.
MAX_MEMBERS: Final = 100_000

_lock = threading.Lock()
_installed = False


@dataclass
class Membership:
    """What every rank derives from one :func:`setup_gather` (equal on every rank)."""

    gen: int
    start_step: int
    live_every: int
    #: rank -> host name, rank -> worker id (ranks ``0 .. size-1``).
    hosts: dict[int, str]
    workers: dict[int, int]
    #: The run id of the survivors (None at the first start: the handshake's is used).
    run_id: str | None = None
    next_worker: int = 0
    #: True when some rank had recorded before (this is a reset, not the start).
    after_reset: bool = False
    #: rank -> the host as horovodrun names it (``HOROVOD_HOSTNAME``; else the host name).
    hvd_hosts: dict[int, str] | None = None
    #: Rank 0's seconds per live window at least (:func:`hvtrace.settings.live_window_s`).
    live_s: float = 0.0

    @property
    def size(self) -> int:
        """Ranks in this membership."""
        return len(self.workers)

    def record(self, rank: int, at_ns: int, reset: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON record of this membership as rank ``rank`` saw it (see docs/format.md)."""
        return {
            "gen": self.gen,
            "start_step": self.start_step,
            "size": self.size,
            "rank": int(rank),
            "worker": int(self.workers.get(rank, -1)),
            "members": [[w, r, h, (self.hvd_hosts or {}).get(r, h)] for w, r, h in self.members()],
            "at_ns": int(at_ns),
            "reset": reset,
        }

    def members(self) -> list[tuple[int, int, str]]:
        """``(worker, rank, host)`` of every rank, in rank order."""
        return [(self.workers[r], r, self.hosts.get(r, "?")) for r in sorted(self.workers)]


@dataclass
class ElasticState:
    """What a tracer knows of the elastic job it is in: its stable ``worker`` id, the membership
    generation, the next free worker id, its rank and the size now, the step of the last commit,
    whether the state was restored to it, and when the job was interrupted (None: not now)."""

    worker: int
    gen: int
    next_worker: int
    rank: int
    size: int
    last_commit_step: int
    restored: bool = False
    interrupted_ns: int | None = None

    @classmethod
    def start(cls, m: Membership, rank: int, size: int) -> ElasticState:
        """The state of a tracer that starts in membership ``m``."""
        return cls(int(m.workers.get(rank, rank)), m.gen, m.next_worker, rank, size, m.start_step)


def local_info(tracer: Any) -> dict[str, Any] | None:
    """What this rank sends to :func:`setup_gather`: None before it recorded (a new worker)."""
    if tracer is None:
        return None
    return {
        "run_id": str(tracer.rec.header.get("run_id")),
        "worker": int(tracer.elastic.worker),
        "step": int(tracer.steps_done),
        "gen": int(tracer.elastic.gen),
        "next_worker": int(tracer.elastic.next_worker),
    }


def setup_gather(hvd: Any, info: dict[str, Any] | None) -> Membership:
    """The set-up collective (``allgather_object``, issued by every rank at the same point):
    returns the :class:`Membership` every rank derives alike (see the module doc). Raises what
    Horovod raises."""
    from horovod.torch.functions import allgather_object  # not hvd's: not recorded as the user's

    hvd_host = os.environ.get("HOROVOD_HOSTNAME")  # the host as horovodrun names it
    everyone = allgather_object(
        ((settings.live_every(), settings.live_window_s()), socket.gethostname(), info, hvd_host),
        name=SETUP_NAME,
    )
    return agree(everyone)


def agree(everyone: list[Any]) -> Membership:
    """Derive the membership from the gathered ``(live, host, info, hvd_host)`` of every rank
    (in rank order; ``live``: ``(live_every, live_s)``, or ``live_every`` alone). Values are
    checked: a malformed entry counts as a new worker, a malformed ``live`` turns live
    detection off."""
    hosts: dict[int, str] = {}
    hvd_hosts: dict[int, str] = {}
    prior: dict[int, dict[str, Any]] = {}
    for r, item in enumerate(everyone):
        try:
            _every, host, info, hvd_host = item
        except (TypeError, ValueError):
            host, info, hvd_host = "?", None, None
        hosts[r] = str(host)[:256]
        hvd_hosts[r] = str(hvd_host if hvd_host else host)[:256]
        if isinstance(info, dict):
            try:
                prior[r] = {
                    "run_id": str(info["run_id"])[:200],
                    "worker": int(info["worker"]),
                    "step": int(info["step"]),
                    "gen": int(info["gen"]),
                    "next_worker": int(info["next_worker"]),
                }
            except (KeyError, TypeError, ValueError):
                pass
    live_every, live_s = _live_setting(everyone)
    size = len(everyone)
    if not prior:
        workers = {r: r for r in range(size)}
        return Membership(
            0, 0, live_every, hosts, workers, None, size, False, hvd_hosts, live_s=live_s
        )
    workers = {}
    used: set[int] = set()
    for r in sorted(prior):
        w = prior[r]["worker"]
        if w not in used:
            workers[r] = w
            used.add(w)
    nxt = max(
        max(p["next_worker"] for p in prior.values()),
        max(used, default=-1) + 1,
    )
    for r in range(size):
        if r not in workers:
            workers[r] = nxt
            nxt += 1
    return Membership(
        gen=max(p["gen"] for p in prior.values()) + 1,
        start_step=max(p["step"] for p in prior.values()),
        live_every=live_every,
        hosts=hosts,
        workers=workers,
        run_id=prior[min(prior)]["run_id"],
        next_worker=nxt,
        after_reset=True,
        hvd_hosts=hvd_hosts,
        live_s=live_s,
    )


def _live_setting(everyone: list[Any]) -> tuple[int, float]:
    """Rank 0's live window (steps, seconds) from the gathered set-up; (0, 0.0) if malformed."""
    try:
        live = everyone[0][0]
        every, live_s = live if isinstance(live, (tuple, list)) else (live, 0.0)
        every, live_s = int(every), float(live_s)
    except (TypeError, ValueError, IndexError):
        return 0, 0.0
    if every < 0 or not 0.0 <= live_s <= 3600.0:  # also NaN
        return 0, 0.0
    return every, live_s


def install(tracer: Any) -> None:
    """Route Horovod's elastic resets, commits and restores to the running tracer
    (:func:`hvtrace.record.recorder.running_tracer`: ``tracer``, until its finish; wraps once, a
    no-op where Horovod has no elastic module)."""
    global _installed
    with _lock:
        if _installed:
            return
        try:
            from horovod.common import elastic as hvd_elastic
        except Exception:  # noqa: BLE001 - no elastic support: nothing to follow
            return
        state_cls = getattr(hvd_elastic, "State", None)
        object_cls = getattr(hvd_elastic, "ObjectState", None)
        if state_cls is None:
            return
        _wrap_method(state_cls, "on_reset", _on_reset)
        _wrap_method(state_cls, "commit", _on_commit)
        if object_cls is not None:
            _wrap_method(object_cls, "restore", _on_restore)
        _installed = True


def _running() -> Any:
    """The running tracer (:func:`hvtrace.record.recorder.running_tracer`; imported here: the
    recorder's writer imports this module)."""
    from hvtrace.record.recorder import running_tracer

    return running_tracer()


def _wrap_method(cls: type, name: str, before: Any) -> None:
    orig = cls.__dict__.get(name)
    if orig is None or getattr(orig, "__hvtrace__", False):
        return

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return before(orig, self, *args, **kwargs)

    wrapper.__hvtrace__ = True  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    setattr(cls, name, wrapper)


def _on_reset(orig: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    """``State.on_reset``: hvtrace's re-synchronisation first (never raises), then Horovod's
    (which runs the job's reset callbacks)."""
    tr = _running()
    if tr is not None:
        try:
            on_reset(tr)
        except Exception as exc:  # noqa: BLE001 - never into the elastic loop (a Ctrl-C goes on)
            log.warning("hvtrace: following the elastic reset failed: %s", exc)
    return orig(state, *args, **kwargs)


def _on_commit(orig: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    """``State.commit``: note the step the state was saved at, then commit (which may raise
    ``HostsUpdatedInterrupt``: the membership changes, a reset follows)."""
    tr = _running()
    if tr is not None:
        try:
            tr.elastic.last_commit_step = tr.steps_done  # the state is saved at this step
            tr.elastic.restored = False
        except Exception:  # noqa: BLE001
            pass
    try:
        return orig(state, *args, **kwargs)
    except BaseException:
        if tr is not None:
            try:
                on_interrupt(tr, restored=False)
            except Exception:  # noqa: BLE001
                pass
        raise


def _on_restore(orig: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    """``ObjectState.restore``: the job failed and goes back to its last commit."""
    tr = _running()
    if tr is not None:
        try:
            on_interrupt(tr, restored=True)
        except Exception:  # noqa: BLE001
            pass
    return orig(state, *args, **kwargs)


def on_interrupt(tr: Any, restored: bool) -> None:
    """The job was interrupted (a failure: ``restored``; or hosts changed at a commit): stop the
    tracer's live detection at once (its next exchange would not match after the reset)."""
    from hvtrace.record.timers import monotonic_ns

    st = tr.elastic
    if st.interrupted_ns is None:
        st.interrupted_ns = monotonic_ns()
    st.restored = st.restored or restored
    live, tr.live = tr.live, None
    if live is not None:
        live.close()
        log.warning("hvtrace: live straggler detection is off after an elastic reset")


def on_reset(tr: Any) -> None:
    """``State.on_reset()``, after Horovod was initialized again with the new workers: run the
    collectives a joining worker runs (the clock handshake, the set-up gather), on every rank
    whether or not it still records, then go on at the agreed step with a membership record
    (and a ``hvtrace.reset`` user span from the end of the last step to now). Never raises: a
    failure disables tracing with one warning."""
    from hvtrace.format.schema import KIND_CODE
    from hvtrace.record import collectives
    from hvtrace.record.clocksync import handshake
    from hvtrace.record.timers import monotonic_ns

    on_interrupt(tr, restored=False)
    st = tr.elastic
    t_last = tr.step_start  # the end of the last completed step (host timer token)
    step_at_reset = tr.steps_done
    prev_rank, prev_size = st.rank, st.size
    tr.drop_partial_step()
    collectives.on_reset()
    try:
        _run_id, est = handshake(tr.hvd, tr.clock_rounds)
        m = setup_gather(tr.hvd, local_info(tr))
    except Exception as exc:  # noqa: BLE001 - Horovod failed again: the next reset retries
        tr.fail(f"re-synchronising after an elastic reset: {type(exc).__name__}: {exc}")
        return
    rank, size = tr.hvd.rank(), tr.hvd.size()
    replayed = max(0, step_at_reset - st.last_commit_step) if st.restored else 0
    reset = {
        "prev_rank": prev_rank,
        "prev_size": prev_size,
        "step": step_at_reset,
        "commit_step": st.last_commit_step,
        "restored": bool(st.restored),
        "replayed_steps": replayed,
        "last_step_end_ns": t_last if type(t_last) is int else None,
        "interrupted_ns": st.interrupted_ns,
    }
    st.gen, st.next_worker, st.rank, st.size = m.gen, m.next_worker, rank, size
    tr.steps_done = st.last_commit_step = m.start_step
    st.restored, st.interrupted_ns = False, None
    try:
        now = monotonic_ns()
        rec = tr.rec
        rec.step = m.start_step
        if rec.enabled:
            if st.worker != m.workers.get(rank, st.worker):
                log.warning("hvtrace: worker ids disagree after the reset")
            rec.membership_events.append(m.record(rank, now, reset))
            if prev_rank == 0 and rank == 0:  # the same reference clock as before
                rec.add_clock(est)
            if type(t_last) is int:
                rec.add(KIND_CODE["user"], "hvtrace.reset", t_last, now, step=m.start_step)
        tr.step_start, tr.step_cpu = tr.now(), tr.read()
    except Exception as exc:  # noqa: BLE001
        tr.fail(exc)
    if rank == 0:
        log.info(
            "hvtrace: elastic reset: size %d -> %d, going on at step %d", prev_size, size,
            m.start_step,
        )  # fmt: skip
