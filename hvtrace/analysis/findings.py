"""Findings: a few short, actionable lines about a run, each with the number behind it.

:func:`make_findings` reads an :class:`hvtrace.analysis.model.Analysis` and returns a list of
:class:`~hvtrace.analysis.model.Finding` (defined with the Analysis, re-exported here), most
important first: a hang, ranks that stopped training the same model (``divergence``:
:mod:`hvtrace.analysis.consistency`), an incomplete run, stragglers (with the phase), rank 0
doing blocking work between steps, communication-bound steps (with the Horovod knobs that help
and their current values), many small allreduces, and lateness no phase explains.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pandas as pd

from hvtrace.analysis import framework
from hvtrace.analysis.antipatterns import (
    oversubscribed_findings,
    shared_gpu_findings,
    unsharded_findings,
)
from hvtrace.analysis.consistency import divergence_findings
from hvtrace.analysis.gradients import manual_findings, manual_sources, sparse_findings
from hvtrace.analysis.links import link_words
from hvtrace.analysis.lockstep import describe as describe_lockstep
from hvtrace.analysis.model import Analysis, Finding
from hvtrace.analysis.outside import split_name
from hvtrace.analysis.scaling import CYCLE_TIME_DEFAULT_MS, fusion_settings
from hvtrace.analysis.stragglers import (
    COORDINATOR_NOTE,
    StragglerConfig,
    median_of_others,
    split_cause,
)
from hvtrace.format.schema import LIGHTNING_PREFIX
from hvtrace.units import format_bytes, printable

#: A run is communication-bound when at least this share of its steps is (see step_summary).
COMM_BOUND_STEPS: Final = 0.5
#: "Many small allreduces": at least this many tensors per step, median size below SMALL_BYTES.
MANY_TENSORS: Final = 50
SMALL_BYTES: Final = 256 * 1024
#: A straggler or slow host that costs the job less than this share of the run (the what-if
#: replay: :mod:`hvtrace.analysis.whatif`) is reported as info, not as a warning.
STRAGGLER_WARN_SHARE: Final = 0.02
#: A collective outside the optimizer is reported when the ranks are blocked in it for at least
#: this share of the run's time (below it the cost is within the measurement's noise: no
#: finding), and as a warning from OUTSIDE_RUN_SHARE of the run on (an info note between).
OUTSIDE_NOISE_SHARE: Final = 0.01
OUTSIDE_RUN_SHARE: Final = 0.05
#: The ranks' blocked time in a collective is "waiting for rank R" (``collective_wait``) when
#: at least this share of it was waiting for the last rank to issue it (``wait_share``).
OUTSIDE_WAIT_SHARE: Final = 0.5
#: Rank 0's extra time between steps must be this share of the step (median) or of the run.
RANK0_STEP_SHARE: Final = 0.10
RANK0_RUN_SHARE: Final = 0.05
#: What each cause of a slow phase means, and what to do about it (see stragglers.split_cause).
CAUSE_WORDS: Final[dict[str, tuple[str, str, str]]] = {
    # cause: (what the part is, heading, advice)
    "work": (
        "more CPU time than the other ranks",
        "does more work",
        "it computes more than the others: give every rank the same work (equal data shards "
        "and batch sizes, the same model), or look at what this rank does in that phase",
    ),
    "contention": (
        "waiting for a CPU",
        "waits for a CPU (contention)",
        "it is runnable but has no CPU: run fewer busy threads than cores per rank "
        "(torch.set_num_threads / OMP_NUM_THREADS, fewer DataLoader workers), pin ranks to "
        "their own cores (horovodrun --binding-args, taskset), and keep other jobs off the host",
    ),
    "speed": (
        "the slowdown it shows in every phase",
        "runs slower throughout",
        "the same work takes this rank longer in every phase, the update too (the same optimizer "
        "step on every rank): its processor is slower or shared, not its work: on a VM a vCPU "
        "with steal time, a busy SMT sibling, a lower clock or thermal throttling; compare its "
        "host and core with the others' (steal in top or vmstat, clocks), or move the rank",
    ),
    "blocked": (
        "blocked, neither on a CPU nor waiting for one",
        "is blocked",
        "it sleeps or waits (I/O, a lock, a queue such as the DataLoader's): move blocking I/O "
        "off the training loop (prefetch, more DataLoader workers, checkpoints in another thread "
        "or every N steps)",
    ),
}


def make_findings(a: Analysis, config: StragglerConfig | None = None) -> list[Finding]:
    """Return the findings for an analysis: warnings before info notes, most important first
    within each."""
    out: list[Finding] = []
    out += _hangs(a)
    out += [  # ranks that stopped taking the same steps
        Finding("lockstep", "warning", describe_lockstep(b), float(b["step"]), "step", dict(b))
        for b in a.lockstep
    ]
    out += divergence_findings(a)  # ranks that stopped training the same model
    out += framework.findings(a)  # accumulation, Lightning's callbacks on one rank's view
    out += unsharded_findings(a)  # ranks that train on the same batches
    out += _run_state(a)
    rank0 = _rank0_blocking(a, config or StragglerConfig())
    out += _stragglers(a, skip_rank0=bool(rank0))
    out += rank0
    out += shared_gpu_findings(a)  # the placement of the ranks: GPUs, threads against cores
    out += oversubscribed_findings(a)
    out += _contention(a)
    unexplained = _unexplained(a)
    out += unexplained
    out += manual_findings(a)  # how the gradients are sent: by hand, dense with mostly zeros
    out += sparse_findings(a)
    out += _outside(a)
    out += _comm_bound(a)
    out += _small_allreduces(a)
    if a.stragglers.empty and a.slow_hosts.empty and len(a.ranks) > 1 and not unexplained:
        v = a.verdicts
        if len(v) and v["late_ms"].notna().any():
            top = v.loc[v["last_share"].idxmax()]
            why = (
                "no rank arrives last in a clear majority of steps with a lateness its own work "
                "explains"
                if not str(top["reason"]).startswith(COORDINATOR_NOTE)
                else "the rank most often last waits for a CPU on a host short of one (see the "
                "contention finding), as Horovod's coordinator"
            )
            out.append(
                Finding(
                    "balanced",
                    "info",
                    f"no straggler: {why} (most often last: rank {int(top['rank'])}, "
                    f"{top['last_share']:.0%} of steps, median {top['late_ms']:.1f} ms late)",
                    float(top["late_ms"]),
                    "ms",
                )
            )
    return order_findings(out, _median_step_ms(a))


#: Findings about whether the job is correct or complete: first, whatever their time cost.
CORRECTNESS_KINDS: Final = (
    "hang",
    "stall",
    "lockstep",
    "callback_decision",
    "best_checkpoint",
    "divergence",
    "unsharded_data",
    "incomplete",
    "dropped",
)


def finding_cost(f: Finding, step_ms: float) -> tuple[float | None, float | None]:
    """What a finding costs the job: (ms per step averaged over the run, share of the run), from
    the numbers it carries (None where it has no time cost: a hang, a divergence)."""
    d = f.data or {}
    ms = d.get("lost_ms_per_step")
    share = d.get("lost_share")
    if ms is None and f.kind in ("collective_cost", "collective_wait"):
        ms, share = d.get("blocked_ms_per_step"), d.get("run_share")
    elif ms is None and f.kind == "comm_bound":
        ms = d.get("exposed_ms")
    elif ms is None and f.kind in ("contention", "oversubscribed"):
        ms = d.get("runq_ms")
    if ms is not None and share is None and np.isfinite(step_ms) and step_ms > 0:
        share = float(ms) / step_ms
    return (_f(ms), _f(share))


def order_findings(out: list[Finding], step_ms: float) -> list[Finding]:
    """Warnings before info notes; within the warnings, the job's correctness first (hangs,
    divergence, an incomplete run), then the rest by what they cost, the costliest first. Each
    finding with a time cost carries it in ``data`` (``cost_ms_per_step``, ``cost_share``)."""
    costs = []
    for f in out:
        ms, share = finding_cost(f, step_ms)
        if ms is not None:
            f.data = {**(f.data or {}), "cost_ms_per_step": ms, "cost_share": share}
        costs.append(ms)

    def key(i: int) -> tuple[bool, bool, float]:
        f = out[i]
        return (f.severity != "warning", f.kind not in CORRECTNESS_KINDS, -(costs[i] or 0.0))

    return [out[i] for i in sorted(range(len(out)), key=key)]


def _median_step_ms(a: Analysis) -> float:
    s = a.analyzed
    return float(s["step_ns"].median()) / 1e6 if len(s) else float("nan")


# -- hangs -----------------------------------------------------------------------------------------
def _hangs(a: Analysis) -> list[Finding]:
    """A job that hung (or stalled and went on): who the others waited for, first."""
    out = []
    for h in a.hangs:
        waiting = f"rank{'s' if len(h['waiting_ranks']) > 1 else ''} {_list(h['waiting_ranks'])}"
        if h.get("skipped"):
            many = len(h["ranks"]) > 1
            few = f"rank{'s' if many else ''} {_list(h['ranks'])}"
            msg = (
                f"hang at step {h['step']}: {few} skipped {_span_words(h['tensor'])}: "
                f"{waiting} issued it and waited in it {h['waited_s']:.0f} s or more; "
                f"{'they' if many else 'it'} went on without it and "
                f"wait{'' if many else 's'} in synchronize for the others' gradients"
            )
            out.append(Finding("hang", "warning", msg, h["waited_s"], "s", dict(h)))
            continue
        what = f" for {h['tensor']}" if h["tensor"] else ""
        more = len(h["tensors"]) - 1
        if more > 0:
            what += f" (and {more} more tensor{'s' if more > 1 else ''})"
        if h["hung"]:
            who = (
                f"rank{'s' if len(h['ranks']) > 1 else ''} {_list(h['ranks'])} never arrived "
                "(stopped, deadlocked, or skipped a collective the others issued)"
                if h["ranks"]
                else "every rank waits: they issued different collectives (names, order)"
            )
            elsewhere = h.get("in_collective") or {}
            if elsewhere:
                who += "; " + "; ".join(
                    f"rank {r} waits in {_span_words(c)}, which the others did not issue"
                    for r, c in list(elsewhere.items())[:4]
                )
            msg = (
                f"hang at step {h['step']}: {waiting} waited {h['waited_s']:.0f} s or more in "
                f"synchronize{what}; {who}"
            )
            out.append(Finding("hang", "warning", msg, h["waited_s"], "s", dict(h)))
        else:
            msg = (
                f"stall at step {h['step']}: {waiting} waited {h['waited_s']:.0f} s in "
                f"synchronize{what}, then the job went on"
            )
            out.append(Finding("stall", "warning", msg, h["waited_s"], "s", dict(h)))
    return out


# -- run state -------------------------------------------------------------------------------------
def _run_state(a: Analysis) -> list[Finding]:
    out = []
    last_seen = a.steps.groupby("rank")["step"].max() if len(a.steps) else pd.Series(dtype=int)
    stopped = []
    for s in a.rank_states:
        if (s.complete or a.in_progress) and not s.truncated:
            continue  # closed cleanly, or still being written
        step = max(int(last_seen.get(s.rank, -1)), s.last_step)
        how = "file truncated: crashed or killed" if s.truncated else "file not closed cleanly"
        stopped.append((s.rank, step, how))
    if stopped:
        parts = ", ".join(f"rank {r} stopped at step {st} ({how})" for r, st, how in stopped[:4])
        more = f" and {len(stopped) - 4} more" if len(stopped) > 4 else ""
        out.append(
            Finding(
                "incomplete",
                "warning",
                f"run incomplete: {parts}{more}; the steps after that are missing",
                float(min(st for _, st, _ in stopped)),
                "step",
                {"stopped": [{"rank": r, "step": st, "why": how} for r, st, how in stopped]},
            )
        )
    if a.missing_ranks:
        m = a.missing_ranks
        out.append(
            Finding(
                "incomplete",
                "warning",
                f"no usable trace from rank(s) {_list(m)} of {a.size}; analyzing the others",
                float(len(m)),
                "ranks",
                {"missing_ranks": list(m)},
            )
        )
    dropped = [(s.rank, s.dropped) for s in a.rank_states if s.dropped]
    if dropped:
        total = sum(d for _, d in dropped)
        who = ", ".join(f"rank {r}: {d}" for r, d in dropped[:4])
        out.append(
            Finding(
                "dropped",
                "warning",
                f"{total} spans dropped by the recorder (writer fell behind; {who}): those "
                "ranks' numbers undercount",
                float(total),
                "spans",
            )
        )
    return out


# -- stragglers ------------------------------------------------------------------------------------
def _cost_words(row: pd.Series) -> tuple[str, str, dict[str, Any]]:
    """What a straggler or slow host costs: a clause, the finding's severity, and data."""
    lost, share = row.get("lost_ms_per_step"), row.get("lost_share")
    if lost is None or not np.isfinite(lost):
        return "", "warning", {}
    sev = "warning" if share >= STRAGGLER_WARN_SHARE else "info"
    small = "" if sev == "warning" else f", under {STRAGGLER_WARN_SHARE:.0%}: minor"
    upper = row.get("lost_bound") == "upper"
    bound = (
        "; at most: its host is short of CPU, and while this rank does not compute its "
        "neighbours get the CPU, which the replay cannot see"
        if upper
        else ""
    )
    return (
        f"; it costs the job {'up to ' if upper else ''}{lost:.1f} ms per step ({share:.1%} of "
        f"the run{small}{bound})",
        sev,
        {
            "lost_ms_per_step": _f(lost),
            "lost_share": _f(share),
            "lost_bound": str(row.get("lost_bound") or ""),
        },
    )


def _stragglers(a: Analysis, skip_rank0: bool = False) -> list[Finding]:
    """Slow hosts and stragglers with what each costs, the costliest first."""
    out = []
    for _, h in a.slow_hosts.iterrows():
        costs, sev, cdata = _cost_words(h)
        out.append(
            Finding(
                "slow_host",
                sev,
                f"host {h['host']} is slow: all its ranks ({_list(h['ranks'])}) arrive late, "
                f"median {h['late_ms']:.1f} ms; the last rank is on it in {h['last_share']:.0%} "
                f"of steps"
                + (f"; slow phase: {h['phase']}" if h["phase"] else "")
                + (f" ({CAUSE_WORDS[h['cause']][0]}: {h['cause']})" if h.get("cause") else "")
                + costs,
                float(h["late_ms"]),
                "ms",
                {
                    "host": h["host"],
                    "ranks": list(h["ranks"]),
                    "phase": h["phase"],
                    "cause": h.get("cause", ""),
                    **cdata,
                },
            )
        )
    v = a.verdicts.set_index("rank")
    on_slow_host = {int(r) for ranks in a.slow_hosts["ranks"] for r in ranks}
    oversubscribed = {
        int(r): e
        for e in (getattr(a, "placement", None) or {}).get("hosts") or []
        if e.get("oversubscribed")
        for r in e.get("ranks") or []
    }
    for _, s in a.stragglers.iterrows():
        r = int(s["rank"])
        if r in on_slow_host:
            continue  # named with its host, not one by one
        if r == 0 and skip_rank0 and _between_steps(s["phase"]):
            continue  # said by the rank-0 finding, more specifically
        vr = v.loc[r]
        where = _phase_words(s["phase"], vr) + cause_clause(s)
        who = f"rank {r}" + (f" ({s['host']})" if s["host"] not in ("", "?") else "")
        cause = str(s.get("cause") or "")
        head = f"straggler: {who}"
        if cause:
            head = f"{_CAUSE_HEADS.get(cause, 'straggler')}: {who} {CAUSE_WORDS[cause][1]}"
        msg = (
            f"{head}{':' if cause else ' is'} last to be ready in {s['last_share']:.0%} of "
            f"steps, median {s['late_ms']:.1f} ms after the first rank; {where}"
        )
        if not vr["by_arrival"]:
            msg = (
                f"{head}: {where} in {vr['work_share']:.0%} of steps "
                f"(it is last in {s['last_share']:.0%}, median {s['late_ms']:.1f} ms late)"
            )
        span = _episode_words(s)
        if span:
            msg = msg.replace(f"{head}", f"{head} {span}", 1)
        costs, sev, cdata = _cost_words(s)
        msg += costs
        threads_wait = cause == "blocked" and r in oversubscribed
        if threads_wait:
            # its training thread waits for its own intra-op threads, which wait for a CPU: on
            # the training thread's counters that is neither work nor its own run-queue wait
            e = oversubscribed[r]
            msg += (
                f"; its host is oversubscribed ({e.get('threads_total')} torch threads on "
                f"{e.get('cores')} cores: see that finding): a training thread that waits for "
                "its own intra-op threads, themselves waiting for a CPU, shows as blocked, so "
                "the likely cause is the threads, not I/O"
            )
        if cause == "contention" and not threads_wait:
            msg += f"; {contention_advice(a, str(s['host']))}"
        elif cause:
            msg += f"; {cause_advice('contention' if threads_wait else cause, a.controller)}"
        elif r == 0 and s["phase"] in ("backward", "compute") and a.timing == "host_monotonic":
            msg += (
                " (on a CPU run rank 0 also runs Horovod's coordinator: with more busy threads "
                "than cores this alone slows its backward; give each rank more cores)"
            )
        data = {"rank": r, "phase": s["phase"], "phase_excess_ms": _f(s["phase_excess_ms"])}
        if cause:
            data["cause"] = cause
            if threads_wait:
                data["oversubscribed_host"] = str(oversubscribed[r].get("host", ""))
            data.update({f"{c}_ms": _f(s[f"{c}_ms"]) for c in ("work", "contention", "blocked")})
            if cause == "speed":
                data.update(speed_ms=_f(s["speed_ms"]), speed_ratio=_f(s["speed_ratio"]))
        data.update(cdata)
        for c in ("from_step", "to_step"):
            if c in s and pd.notna(s[c]):
                data[c] = int(s[c])
        out.append(
            Finding(  # waiting for a CPU and a slower processor are the host's, said as such
                "contention"
                if cause == "contention"
                else "slow_processor"
                if cause == "speed"
                else "straggler",
                sev,
                msg,
                float(s["late_ms"]),
                "ms",
                data,
            )
        )
    # the costliest first (stable: slow hosts before their ranks' peers when equal)
    return sorted(out, key=lambda f: -(f.data.get("lost_ms_per_step") or 0.0))


def _episode_words(s: pd.Series) -> str:
    """ "from step 80" / "in steps 80-140" for a straggler slow in a stretch of the run only
    (``from_step`` / ``to_step`` of :func:`hvtrace.analysis.stragglers.merge_episodes`)."""
    a, b = s.get("from_step"), s.get("to_step")
    if a is None or pd.isna(a):
        return ""
    if b is None or pd.isna(b):
        return f"(from step {int(a)})"
    return f"(in steps {int(a)}-{int(b)})"


#: How a straggler's line begins, by its cause (its finding's kind, in words).
_CAUSE_HEADS: Final[dict[str, str]] = {"contention": "contention", "speed": "slow processor"}


def cause_clause(s: pd.Series) -> str:
    """The part of a straggler's line that says why, for a row of ``Analysis.stragglers`` with a
    cause (", of which 11.8 ms waiting for a CPU on host vm (contention)"); "" without one."""
    cause = str(s.get("cause") or "")
    if not cause:
        return ""
    part = float(s[f"{cause}_ms"])
    host = f" on host {s['host']}" if cause == "contention" and s["host"] not in ("", "?") else ""
    if cause == "speed":  # how much slower: the ratio of its other phases to the other ranks'
        host = f" ({float(s['speed_ratio']):.2f}x the other ranks' time)"
    return f", of which {part:.1f} ms {CAUSE_WORDS[cause][0]}{host} ({cause})"


def cause_advice(cause: str, controller: str = "") -> str:
    """What to do about a phase's excess of ``cause`` (:data:`CAUSE_WORDS`), for the launcher
    that was seen: under MPI (``controller`` ``"mpi"``) ranks are pinned by ``mpirun``'s own
    binding, which ``horovodrun --binding-args`` passes on."""
    advice = CAUSE_WORDS[cause][2]
    if controller == "mpi":
        advice = advice.replace(
            "(horovodrun --binding-args, taskset)",
            "(mpirun --bind-to core --map-by socket, or horovodrun --mpi --binding-args)",
        )
    return advice


def contention_advice(a: Analysis, host: str) -> str:
    """What to do about ``host``'s ranks waiting for a CPU: :func:`cause_advice`'s, but where
    every one of them is already pinned to exactly as many CPUs as it runs torch threads
    (:func:`hvtrace.analysis.antipatterns.placement`'s ``snug_ranks``), where fewer threads and
    pinning are what was done: whatever else runs on those CPUs (the rank's other threads,
    another job) takes its time from them."""
    for e in (getattr(a, "placement", None) or {}).get("hosts") or []:
        if str(e.get("host")) != host or not e.get("ranks") or e.get("oversubscribed"):
            continue
        if set(e["ranks"]) - set(e.get("snug_ranks") or []):
            break
        n = sorted(set((e.get("threads") or {}).values()))
        each = f"{n[0]} each" if len(n) == 1 else "each its own"
        wider = "mpirun binding" if a.controller == "mpi" else "taskset or --binding-args"
        do = (
            f"give each rank a second CPU (a wider {wider})"
            if n == [1]
            else f"leave each rank one CPU more than its torch threads (a wider {wider}, or "
            "torch.set_num_threads one lower)"
        )
        do = f"keep other jobs off those CPUs and {do}"
        cycle = _knob(a.horovod_env, "HOROVOD_CYCLE_TIME")
        short = fusion_settings(a.horovod_env)[1] < CYCLE_TIME_DEFAULT_MS
        return (
            f"each of its ranks is pinned to as many CPUs as it runs torch threads ({each}), so "
            "whatever else runs on those CPUs takes its time from them: the rank's other threads "
            f"(Horovod's background thread, which wakes every cycle, {cycle}; hvtrace's; "
            "DataLoader workers, which inherit the pinning) or other jobs' processes there; "
            f"{do}" + (", or a longer HOROVOD_CYCLE_TIME (fewer wake-ups)" if short else "")
        )
    return cause_advice("contention", a.controller)


def cause_line(s: pd.Series) -> str:
    """One line on why a straggler is slow: "rank 1: backward +12.4 ms, of which 11.8 ms
    waiting for a CPU on host vm (contention)", from a row of ``Analysis.stragglers``."""
    return (
        f"rank {int(s['rank'])}: {s['phase'] or 'no single phase'} "
        f"{float(s['phase_excess_ms']):+.1f} ms{cause_clause(s)}"
    )


def _contention(a: Analysis) -> list[Finding]:
    """Hosts whose ranks wait for a CPU a good share of every step (oversubscribed), straggler
    or not: on a balanced run the contention is the finding, not a phase."""
    st = a.stragglers
    advised = set(st.loc[st["cause"] == "contention", "host"]) if "cause" in st else set()
    # a host whose ranks ask for more threads than its cores: that finding says what to do
    over = {
        str(e.get("host"))
        for e in (getattr(a, "placement", None) or {}).get("hosts") or []
        if e.get("oversubscribed")
    }
    out = []
    v = a.verdicts
    coord = v[(v["rank"] == 0) & v["reason"].astype(str).str.startswith(COORDINATOR_NOTE)]
    for h in a.contention.itertuples():
        if not h.short:
            continue
        where = f"host {h.host}" if h.host != "?" else "this host"
        r0 = coord[coord["host"] == h.host]
        rank0 = (
            f"; rank 0, which also runs Horovod's coordinator (one more busy thread than any "
            f"other rank), waits most: last to be ready in {r0['last_share'].iloc[0]:.0%} of "
            f"steps, median {r0['late_ms'].iloc[0]:.1f} ms late"
            if len(r0)
            else ""
        )
        out.append(
            Finding(
                "contention",
                "warning",
                f"CPU contention on {where}: its ranks ({_list(h.ranks)}) wait a median "
                f"{h.runq_ms:.1f} ms per step runnable but without a CPU, {h.work_share:.0%} of "
                f"their {h.work_ms:.1f} ms outside synchronize (most: rank {h.worst_rank}, "
                f"{h.worst_runq_ms:.1f} ms){rank0}"
                + (
                    "; its ranks ask for more threads than it has cores (see the oversubscribed "
                    "finding)"
                    if h.host in over
                    else ""
                    if h.host in advised
                    else "; " + contention_advice(a, str(h.host))
                ),
                h.runq_ms,
                "ms",
                {
                    "host": h.host,
                    "ranks": list(h.ranks),
                    "work_share": h.work_share,
                    "runq_ms": _f(h.runq_ms),
                },
            )
        )
    return out  # host_contention's order: the most starved host first


def _phase_words(phase: str, vr: pd.Series) -> str:
    ex = vr["phase_excess_ms"]
    if not phase:
        return "no single phase explains it"
    builtin = vr["builtin_phase"]
    if phase != builtin and builtin:
        return (
            f"its user span '{phase}' takes {ex:+.1f} ms vs the other ranks' median "
            f"({builtin} {vr['builtin_excess_ms']:+.1f} ms)"
        )
    return f"its {phase} takes {ex:+.1f} ms vs the other ranks' median"


def _between_steps(phase: str) -> bool:
    """True for the input gap or a user span (work between steps), not a model phase."""
    return phase not in ("", "forward", "backward", "compute", "update", "other", "wait")


def _rank0_blocking(a: Analysis, cfg: StragglerConfig) -> list[Finding]:
    """Rank 0 doing blocking work between steps (logging, checkpoints) while the others wait.

    The evidence is rank 0's input gap minus the other ranks' median in the same step, over the
    analyzed steps. Its *mean* is what the work costs each step (work done every N steps has a
    median excess of zero and a mean of its length over N); it must stand out of the
    measurement's own noise (three standard errors of that mean: a correct job's excesses
    scatter around zero, so their mean does not) and cost at least
    :data:`RANK0_RUN_SHARE` of rank 0's run time."""
    if 0 not in a.ranks or len(a.ranks) < 2:
        return []
    s = a.analyzed
    if s.empty:
        return []
    wide = s.pivot_table(index="step", columns="rank", values="input_ns", aggfunc="sum")
    if 0 not in wide.columns or wide.shape[1] < 2:
        return []
    m = wide.to_numpy(dtype=np.float64)
    j0 = list(wide.columns).index(0)

    def excess0(w: np.ndarray) -> np.ndarray:
        """Rank 0's value of ``w`` (steps x ranks, as ``wide``) less the others' median."""
        return (w - median_of_others(w))[:, j0]

    ex = excess0(m)
    ok = np.isfinite(ex)
    ex, steps_ex = ex[ok], wide.index.to_numpy()[ok]
    if len(ex) < cfg.min_steps:
        return []
    mean_ex = float(ex.mean())
    noise = 3.0 * float(ex.std(ddof=1)) / np.sqrt(len(ex))
    med_step = float(s["step_ns"].median())
    step0 = s.loc[s["rank"] == 0, "step_ns"]
    mean_step = float(step0.mean()) if len(step0) else 0.0
    share = mean_ex / mean_step if mean_step > 0 else 0.0
    if not (mean_ex > noise and share >= RANK0_RUN_SHARE):
        return []
    why = {"cause": "", "work_ms": None, "contention_ms": None, "blocked_ms": None}
    if {"input_cpu_ns", "input_runq_ns"} <= set(s.columns):
        parts = []
        for col in ("input_cpu_ns", "input_runq_ns"):
            w = s.pivot_table(index="step", columns="rank", values=col, aggfunc="sum")
            e = excess0(w.reindex(index=wide.index, columns=wide.columns).to_numpy(np.float64))
            e = e[ok]
            parts.append(float(np.nanmean(e)) / 1e6 if np.isfinite(e).any() else float("nan"))
        margin = max(cfg.own_floor_frac * med_step, cfg.min_floor_ns) / 1e6
        why = split_cause(mean_ex / 1e6, parts[0], parts[1], margin)
        if why["cause"] == "contention":
            # rank 0 waits for a CPU between steps: on a host short of one, as the process
            # that also runs Horovod's coordinator; the contention finding says that
            return []
    in0 = float(np.nanmean(m[:, j0])) / 1e6
    others = float(np.nanmedian(np.delete(m, j0, axis=1).mean(axis=0))) / 1e6
    v0 = a.verdicts.set_index("rank").loc[0]
    last = (
        f" (it is last to be ready in {v0['last_share']:.0%} of steps, median "
        f"{v0['late_ms']:.1f} ms late)"
        if bool(v0["named"])
        else ""
    )
    floor = max(RANK0_STEP_SHARE * med_step, cfg.min_floor_ns)
    big = ex > floor
    every = ""
    if big.any() and big.mean() < 0.75:
        gaps = np.diff(steps_ex[big])
        if len(gaps):
            every = f", about every {float(np.median(gaps)):.0f} steps"
    msg = (
        f"rank 0 does blocking work between steps while the others wait{last}: its input gap "
        f"averages {in0:.1f} ms vs {others:.1f} ms on the other ranks{every}; it costs the job "
        f"{mean_ex / 1e6:.1f} ms per step ({share:.1%} of the run)"
        + (f"; {CAUSE_WORDS[why['cause']][0]} ({why['cause']})" if why["cause"] else "")
    )
    up = a.user_per_rank
    if len(up):
        u0 = up[up["rank"] == 0].set_index("name")["mean_ms"]
        uo = up[up["rank"] != 0].groupby("name")["mean_ms"].median()
        diff = (u0 - uo.reindex(u0.index).fillna(0.0)).sort_values(ascending=False)
        if len(diff) and diff.iloc[0] > 0.3 * mean_ex / 1e6:
            msg += f"; user span '{diff.index[0]}' adds {diff.iloc[0]:.1f} ms per step on rank 0"
    msg += "; move it off the training loop (another thread, or every N steps)"
    return [
        Finding(
            "rank0_blocking",
            "warning",
            msg,
            mean_ex / 1e6,
            "ms",
            {
                "rank": 0,
                "phase": "input",
                "cause": why["cause"],
                **{f"{c}_ms": _f(why[f"{c}_ms"]) for c in ("work", "contention", "blocked")},
                "input_ms_rank0": _f(in0),
                "input_ms_others": _f(others),
                "lost_ms_per_step": _f(mean_ex / 1e6),
                "lost_share": _f(share),
                "run_share": _f(share),
                "noise_ms": _f(noise / 1e6),
            },
        )
    ]


def _unexplained(a: Analysis) -> list[Finding]:
    """A rank that is regularly last but whose phases do not explain it (not named)."""
    out = []
    v = a.verdicts
    need = StragglerConfig().last_share_needed(len(a.ranks))
    cand = v[
        (~v["named"])
        & (v["last_share"] >= need)
        & (v["late_ms"] > v["late_floor_ms"])
        & (v["steps"] >= 3)
        & ~v["reason"].astype(str).str.startswith(COORDINATOR_NOTE)  # said by the host's finding
    ]
    unc = max(a.clock_uncertainty_ns.values(), default=0) / 1e6
    for _, r in cand.iterrows():
        head = (
            f"rank {int(r['rank'])} is last to be ready in {r['last_share']:.0%} of steps "
            f"(median {r['late_ms']:.1f} ms) but"
        )
        if r["explained_ms"] < 0.5 * r["late_ms"]:
            clocks = f" or the clocks are off (up to ±{unc:.1f} ms)" if unc >= 0.05 else ""
            why = (
                f"its own phases explain only {r['explained_ms']:.1f} ms of it: it starts its "
                "steps late (it saw the previous allreduce finish later, e.g. CPU contention)"
                + clocks
            )
        else:
            why = (
                f"its extra work ({r['builtin_phase']} {r['builtin_excess_ms']:+.1f} ms, "
                f"{r['explained_ms']:.1f} ms in all) is below the {r['work_floor_ms']:.1f} ms "
                "margin that noise on a balanced run reaches"
            )
        out.append(
            Finding("late_unexplained", "info", f"{head} {why}; not named a straggler",
                    float(r["late_ms"]), "ms")
        )  # fmt: skip
    return out


# -- communication ---------------------------------------------------------------------------------
def _knob(env: dict[str, str], key: str) -> str:
    v = env.get(key)
    return f"{key}={v}" if v else f"{key} (default)"


def _compression(opt: dict[str, Any]) -> str:
    c = str(opt.get("compression") or "")
    if not c:
        return "unknown"
    low = c.lower()
    if "fp16" in low:
        return "fp16"
    if "none" in low:
        return "none"
    return c


def _comm_bound(a: Analysis) -> list[Finding]:
    ps = a.per_step
    if ps.empty or len(a.ranks) < 2:
        return []
    first = a.skip_steps
    p = ps[ps["step"] >= first]
    p = p if len(p) else ps
    p = p[p["exposed_share"].notna()]
    if p.empty:
        return []
    share = float(p["comm_bound"].mean())
    if share < COMM_BOUND_STEPS:
        return []
    exp_share = float(p["exposed_share"].median())
    exp_ms = float(p["exposed_ms"].median())
    run = a.run_row
    step_ms = float("nan") if run["step_ms"] is None else run["step_ms"]
    ratio = float("nan") if run["comm_compute_ratio"] is None else run["comm_compute_ratio"]
    ov = float("nan") if run["overlap"] is None else run["overlap"]
    env = a.horovod_env
    by_hand = bool(((getattr(a, "gradients", None) or {}).get("manual") or {}).get("ranks"))
    msg = (
        f"communication-bound: in {share:.0%} of steps the last rank to be ready still waits "
        f"{exp_share:.0%} of the step for allreduces (median {exp_ms:.1f} of {step_ms:.1f} ms); "
        f"comm/compute {ratio:.1f}, {ov:.0%} of allreduce time hidden under backward. "
        + (
            "The gradients are averaged by hand after the backward: first let a distributed "
            "optimizer overlap and fuse their allreduces (see the manual-averaging finding)"
            if by_hand
            else f"Try: a larger batch per worker, hvd.Compression.fp16 (now: "
            f"{_compression(a.optimizer)}), {_knob(env, 'HOROVOD_FUSION_THRESHOLD')}, "
            f"{_knob(env, 'HOROVOD_CYCLE_TIME')}"
        )
    )
    lim = a.limiting_link
    if lim is not None and lim["limits"]:
        msg += (
            f". The network is the limit: {link_words(lim)} carried data at "
            f"{_rate(lim['rate_gbps'])} while busy, and the allreduces reached "
            f"{lim['busbw_share']:.0%} of that (bus bandwidth {_rate(a.comm['busbw_gbps'])}); "
            "a faster link there, or fewer bytes (fp16 compression), helps more than the knobs"
        )
    elif lim is not None and lim["cpu_short_hosts"]:
        msg += (
            f". The links carried data at {_rate(lim['rate_gbps'])} at the slowest while busy "
            f"(the allreduces reached {lim['busbw_share']:.0%} of that), but the hosts at the "
            f"slowest links' ends ({', '.join(lim['cpu_short_hosts'])}) wait for a CPU (see the "
            "contention findings), and TCP through a CPU-starved host is slow on any link: give "
            "the hosts CPU before blaming the network"
        )
    elif lim is not None and np.isfinite(lim["busbw_share"]):
        msg += (
            f". The links are not the limit: the slowest carried data at {_rate(lim['rate_gbps'])}"
            f" while busy, and the allreduces reached only {lim['busbw_share']:.0%} of that"
        )
    return [
        Finding(
            "comm_bound",
            "warning",
            msg,
            exp_share,
            "share of step",
            {
                "steps_share": share,
                "exposed_ms": exp_ms,
                "step_ms": step_ms,
                "comm_compute_ratio": _f(ratio),
                "overlap": _f(ov),
                "limiting_link": lim if lim is not None and lim["limits"] else None,
            },
        )
    ]


def _rate(gbps: float) -> str:
    """A link rate in GB/s and Gbit/s: "0.0236 GB/s (189 Mbit/s)"."""
    mbit = gbps * 8e3
    bits = f"{mbit / 1e3:.3g} Gbit/s" if mbit >= 1000 else f"{mbit:.3g} Mbit/s"
    return f"{gbps:.3g} GB/s ({bits})"


def _small_allreduces(a: Analysis) -> list[Finding]:
    n = a.comm.get("tensors_per_step", float("nan"))
    b = a.comm.get("tensor_bytes_median", float("nan"))
    if not (np.isfinite(n) and np.isfinite(b)) or n < MANY_TENSORS or b >= SMALL_BYTES:
        return []
    env = a.horovod_env
    groups = a.optimizer.get("groups")
    return [
        Finding(
            "small_allreduces",
            "info",
            f"many small allreduces: {n:.0f} tensors per step, median {format_bytes(b)}: each "
            f"costs a negotiation round; fuse more with "
            f"{_knob(env, 'HOROVOD_FUSION_THRESHOLD')} and "
            f"{_knob(env, 'HOROVOD_CYCLE_TIME')}, or group them (DistributedOptimizer groups=, "
            f"now {groups if groups is not None else 'none'})",
            float(n),
            "tensors",
            {"tensor_bytes_median": b},
        )
    ]


# -- collectives outside the optimizer -------------------------------------------------------------
def _outside(a: Analysis) -> list[Finding]:
    """A collective outside the optimizer that costs the run a share of its time worth naming:
    either the ranks wait in it for one late rank (``collective_wait``), or it costs that much by
    itself (``collective_cost``). The cost is stated per call and over the run (a call once
    every ten steps that blocks 40 % of the step it runs in costs about 4 % of the run); below
    :data:`OUTSIDE_NOISE_SHARE` of the run there is no finding, below :data:`OUTSIDE_RUN_SHARE`
    an info note. A collective Lightning issues for itself (``lightning:...``; in a Lightning
    run, an unnamed ``broadcast_object`` or ``join``, or a reduction of one integer) is named as
    Lightning's, with what the user can change (how often it runs), not a change to the call."""
    t = a.outside
    if t is None or t.empty:
        return []
    s = a.analyzed
    med_step = float(s["step_ns"].median()) / 1e6 if len(s) else float("nan")
    lightning = a.lightning is not None
    cont = a.contention
    short = bool(len(cont) and "short" in cont.columns and cont["short"].astype(bool).any())
    by_hand = manual_sources(a)  # the gradients' own allreduces: the manual-averaging finding's
    out = []
    for r in _merged_sources(t):
        if by_hand and f"{r['op']}|{r['phase']}|{r['name']}" in by_hand:
            continue
        share = float(r["step_share"])
        run_share = float(r.get("run_share", share))
        if not np.isfinite(run_share):
            run_share = share
        if not np.isfinite(run_share) or run_share < OUTSIDE_NOISE_SHARE:
            continue  # within the measurement's noise: not worth a line
        src = _lightning_source(r, lightning)
        what = _collective_words(r) + (f" ({src[0]})" if src else "")
        calls = float(r["count_per_step"])
        blocked = float(r["blocked_ms_per_step"])
        per_call = blocked / max(calls, 1e-9)
        cost = _outside_cost_words(r, per_call, med_step, run_share)
        data = {
            "op": str(r["op"]),
            "phase": str(r["phase"]),
            "name": str(r["name"]),
            "count": int(r["count"]),
            "count_per_step": _f(calls),
            "blocked_ms_per_step": _f(blocked),
            "blocked_ms_per_call": _f(per_call),
            "step_share": _f(share),
            "run_share": _f(run_share),
        }
        if src:
            data["issued_by"] = src[0]
        sev = "warning" if run_share >= OUTSIDE_RUN_SHARE and (not src or src[2]) else "info"
        rank, late = int(r["late_rank"]), float(r["late_share"])
        need = 0.75 if int(r["ranks"]) == 2 else 0.5
        wait = float(r["wait_for_last_ms"])
        waited = float(r.get("wait_share", float("nan")))
        if not np.isfinite(waited):  # a table without it: the median wait against a call
            waited = min(wait / per_call, 1.0) if per_call > 0 and np.isfinite(wait) else 0.0
        data["wait_share"] = _f(waited)
        if rank >= 0 and np.isfinite(late) and late >= need and waited >= OUTSIDE_WAIT_SHARE:
            data |= {"rank": rank, "last_share": late, "wait_for_last_ms": wait}
            out.append(
                Finding(
                    "collective_wait",
                    sev,
                    f"ranks wait {wait:.1f} ms per call in {what} for rank {rank}, the last to "
                    f"issue it in {late:.0%} of calls ({waited:.0%} of the waiting ranks' time "
                    f"in it is that wait; {cost}): rank {rank} is late before the call; the "
                    "collective itself is not slow",
                    wait,
                    "ms",
                    data,
                )
            )
            continue
        # the waiting for the last rank is not a cost of the call (without it, the same wait
        # moves to the next collective): a warning only for what the call costs by itself
        if run_share * (1 - min(max(waited, 0.0), 1.0)) < OUTSIDE_RUN_SHARE:
            sev = "info"
        if waited >= OUTSIDE_WAIT_SHARE:  # waiting, but for no one rank in particular
            advice = (
                f"the ranks mostly wait in it for the last one to issue it ({waited:.0%} of the "
                "waiting ranks' time in it), a different rank from call to call: the collective "
                "itself is cheap, the ranks' work before it is uneven"
            )

        else:
            advice = src[1] if src else _outside_advice(r, calls)
            if rank >= 0 and np.isfinite(late) and waited >= 0.2:
                advice = (
                    f"{waited:.0%} of the waiting ranks' time in it is waiting for the last rank "
                    f"to issue it (rank {rank} in {late:.0%} of calls); " + advice
                )
            if short:  # what blocks the ranks may be the CPU, not the call
                advice += (
                    "; the host is short of CPU (see the contention finding), which also delays "
                    "Horovod's background thread: measure again with CPU to spare first"
                )
        out.append(
            Finding(
                "collective_cost",
                sev,
                f"{what}: {cost}; {advice}",
                blocked,
                "ms",
                data,
            )
        )
    return out


def _merged_sources(t: pd.DataFrame) -> list[dict[str, Any]]:
    """The rows of ``Analysis.outside`` as dicts, most blocked first, those of one Lightning
    function (the same ``lightning:`` name and phase: ``hvd.join`` then ``hvd.allreduce``, which
    its strategy's ``reduce`` issues together) merged into one: ops joined by ``+``, per-step
    times and shares summed, the rest from the costlier."""
    rows = t.to_dict("records")
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for r in rows:
        name = str(r["name"])
        if not name.startswith(LIGHTNING_PREFIX):
            out.append(r)
            continue
        key = (name, str(r["phase"]))
        m = merged.get(key)
        if m is None:
            merged[key] = dict(r)
            out.append(merged[key])
            continue
        both = dict(m if m["blocked_ms_per_step"] >= r["blocked_ms_per_step"] else r)
        # in the order Lightning issues them: the join first
        both["op"] = "+".join(sorted((str(m["op"]), str(r["op"])), key=lambda o: o != "join"))
        for c in ("ms_per_step", "blocked_ms_per_step", "step_share", "run_share"):
            if c in m and c in r:
                both[c] = float(m[c]) + float(r[c])
        for c in ("count", "count_per_step", "bytes"):
            both[c] = max(m[c], r[c])
        m.clear()
        m.update(both)
    return sorted(out, key=lambda r: -float(r["blocked_ms_per_step"]))


def _outside_cost_words(r: Any, per_call: float, med_step: float, run_share: float) -> str:
    """What a collective outside the optimizer costs, honestly: per call, per step averaged
    over the run, and as a share of the run's time."""
    calls = float(r["count_per_step"])
    blocked = float(r["blocked_ms_per_step"])
    run = f"{run_share:.1%} of the run's time"
    if calls >= 0.95:
        return f"it blocks the ranks {blocked:.1f} ms per step ({calls:.2g} calls per step), {run}"
    ratio = per_call / med_step if med_step > 0 else float("nan")
    of_step = (
        f" ({ratio:.0%} of a median step)"
        if ratio < 2
        else f" ({ratio:.{1 if ratio < 10 else 0}f} median steps of {med_step:.1f} ms)"
        if np.isfinite(ratio)
        else ""
    )
    return (
        f"{int(r['count'])} call{'s' if int(r['count']) != 1 else ''}, about once every "
        f"{1 / max(calls, 1e-9):.0f} steps, each blocking the ranks {per_call:.1f} ms{of_step}: "
        f"{blocked:.2f} ms per step averaged over the run, {run}"
    )


#: Collectives Horovod offers in an ``_async`` form (the rest pickle objects or wait for ranks).
_ASYNC_FAMILIES: Final = (
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
)


def _outside_advice(r: Any, calls: float) -> str:
    """What to change about a costly collective of the user's own."""
    family = str(r["op"]).partition(".")[0]
    hide = (
        f"issue it with the _async form (hvd.{family}_async) and synchronize the handle where "
        "the result is needed"
        if family in _ASYNC_FAMILIES
        else "it has no _async form: call it outside the training loop"
    )
    if calls >= 0.95:
        return f"reduce metrics every N steps instead of every step, or {hide}"
    return f"it already runs less than once per step; to cut what each call blocks, {hide}"


#: Lightning functions (``lightning:QUALNAME``) whose collectives say what they are, and what
#: the user can change: (description, advice, worth a warning).
_LIGHTNING_CALLERS: Final[dict[str, tuple[str, str, bool]]] = {
    "ModelCheckpoint": (
        "Lightning's ModelCheckpoint callback",
        "Lightning issues it at each checkpoint check, not your code: to pay it less often, "
        "check less often (ModelCheckpoint(every_n_train_steps=N) or every_n_epochs=N, or "
        "validate less often: val_check_interval, check_val_every_n_epoch)",
        True,
    ),
    "EarlyStopping": (
        "Lightning's EarlyStopping callback",
        "Lightning issues it at each early-stopping check, not your code: to pay it less often, "
        "validate less often (val_check_interval, check_val_every_n_epoch)",
        True,
    ),
    "has_len_all_ranks": (
        "Lightning's check of the data loaders' lengths",
        "Lightning issues it when it sets up a data loader, not your code: nothing to change",
        False,
    ),
}


def _lightning_source(r: Any, lightning: bool) -> tuple[str, str, bool] | None:
    """``(description, advice, worth a warning)`` for a collective Lightning issued for itself,
    else None: a name ``lightning:QUALNAME`` (:func:`hvtrace.record.collectives.
    lightning_caller`), or, in a run known to be Lightning's, an unnamed ``broadcast_object`` or
    ``join`` or a reduction of one integer (8 bytes): what its Horovod strategy's ``broadcast``
    and ``reduce`` issue for ModelCheckpoint and EarlyStopping (traces recorded before the name)."""
    name = str(r["name"])
    if name.startswith(LIGHTNING_PREFIX):
        qual = name[len(LIGHTNING_PREFIX) :]
        key = qual.split(".", 1)[0]
        if key in _LIGHTNING_CALLERS:
            return _LIGHTNING_CALLERS[key]
        return (
            f"issued by Lightning itself ({printable(qual)})",
            "Lightning issues it, not your code: it runs as often as the Lightning feature that "
            "asks for it",
            False,
        )
    op = str(r["op"])
    small_sum = op == "allreduce.sum" and int(r["bytes"]) <= 8
    if lightning and not name and (op in ("broadcast_object", "join") or small_sum):
        return (
            "unnamed: most likely Lightning's own, its Horovod strategy's broadcast or reduce as "
            "ModelCheckpoint and EarlyStopping issue at each check",
            "if it is Lightning's, your code cannot change the call: check less often "
            "(ModelCheckpoint(every_n_train_steps=N) or every_n_epochs=N, val_check_interval)",
            True,
        )
    return None


def _collective_words(r: Any) -> str:
    """``hvd.allreduce (sum) 'loss' issued in backward`` for a row of ``Analysis.outside`` (or
    anything with ``op``, ``name`` and ``phase``)."""
    ops = []
    for op in str(r["op"]).split("+"):  # "join+allreduce.sum": merged (_merged_sources)
        fn, _, red = op.partition(".")
        ops.append(f"hvd.{printable(fn)}{f' ({printable(red)})' if red else ''}")
    name = f" {printable(r['name'])!r}" if r["name"] else ""
    return f"{' then '.join(ops)}{name} issued in " + (
        printable(r["phase"]) if r["phase"] != "outside" else "no step"
    )


def _span_words(span_name: str) -> str:
    """:func:`_collective_words` of a collective's span name (``op|phase|tensor``)."""
    op, phase, name = split_name(span_name)
    return _collective_words({"op": op, "phase": phase, "name": name})


# -- helpers ---------------------------------------------------------------------------------------
def _list(xs: Any) -> str:
    xs = [int(x) for x in xs]
    if len(xs) > 6:
        return ", ".join(map(str, xs[:6])) + f", ... ({len(xs)})"
    return ", ".join(map(str, xs))


def _f(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None
