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

from hvtrace.analysis.consistency import divergence_findings
from hvtrace.analysis.links import link_words
from hvtrace.analysis.model import Analysis, Finding
from hvtrace.analysis.outside import split_name
from hvtrace.analysis.steps import analyzed_steps
from hvtrace.analysis.stragglers import StragglerConfig, median_of_others
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
#: this share of the median step.
OUTSIDE_STEP_SHARE: Final = 0.05
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
    "blocked": (
        "blocked, neither on a CPU nor waiting for one",
        "is blocked",
        "it sleeps or waits (I/O, a lock, a queue such as the DataLoader's): move blocking I/O "
        "off the training loop (prefetch, more DataLoader workers, checkpoints in another thread "
        "or every N steps)",
    ),
}


def make_findings(a: Analysis, config: StragglerConfig | None = None) -> list[Finding]:
    """Return the findings for an analysis, most important first."""
    out: list[Finding] = []
    out += _hangs(a)
    out += divergence_findings(a)  # ranks that stopped training the same model
    out += _run_state(a)
    rank0 = _rank0_blocking(a, config or StragglerConfig())
    out += _stragglers(a, skip_rank0=bool(rank0))
    out += rank0
    out += _contention(a)
    unexplained = _unexplained(a)
    out += unexplained
    out += _outside(a)
    out += _comm_bound(a)
    out += _small_allreduces(a)
    if a.stragglers.empty and a.slow_hosts.empty and len(a.ranks) > 1 and not unexplained:
        v = a.verdicts
        if len(v) and v["late_ms"].notna().any():
            top = v.loc[v["last_share"].idxmax()]
            out.append(
                Finding(
                    "balanced",
                    "info",
                    f"no straggler: no rank arrives last in a clear majority of steps with a "
                    f"lateness its own work explains (most often last: rank {int(top['rank'])}, "
                    f"{top['last_share']:.0%} of steps, median {top['late_ms']:.1f} ms late)",
                    float(top["late_ms"]),
                    "ms",
                )
            )
    return out


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
            head = f"{'contention' if cause == 'contention' else 'straggler'}: {who} "
            head += CAUSE_WORDS[cause][1]
        msg = (
            f"{head}{':' if cause else ' is'} last to be ready in {s['last_share']:.0%} of "
            f"steps, median {s['late_ms']:.1f} ms after the first rank; {where}"
        )
        if not vr["by_arrival"]:
            msg = (
                f"{head}: {where} in {vr['work_share']:.0%} of steps "
                f"(it is last in {s['last_share']:.0%}, median {s['late_ms']:.1f} ms late)"
            )
        costs, sev, cdata = _cost_words(s)
        msg += costs
        if cause:
            msg += f"; {CAUSE_WORDS[cause][2]}"
        elif r == 0 and s["phase"] in ("backward", "compute") and a.timing == "host_monotonic":
            msg += (
                " (on a CPU run rank 0 also runs Horovod's coordinator: with more busy threads "
                "than cores this alone slows its backward; give each rank more cores)"
            )
        data = {"rank": r, "phase": s["phase"], "phase_excess_ms": _f(s["phase_excess_ms"])}
        if cause:
            data["cause"] = cause
            data.update({f"{c}_ms": _f(s[f"{c}_ms"]) for c in ("work", "contention", "blocked")})
        data.update(cdata)
        out.append(
            Finding(
                "contention" if cause == "contention" else "straggler",
                sev,
                msg,
                float(s["late_ms"]),
                "ms",
                data,
            )
        )
    # the costliest first (stable: slow hosts before their ranks' peers when equal)
    return sorted(out, key=lambda f: -(f.data.get("lost_ms_per_step") or 0.0))


def cause_clause(s: pd.Series) -> str:
    """The part of a straggler's line that says why, for a row of ``Analysis.stragglers`` with a
    cause (", of which 11.8 ms waiting for a CPU on host vm (contention)"); "" without one."""
    cause = str(s.get("cause") or "")
    if not cause:
        return ""
    part = float(s[f"{cause}_ms"])
    host = f" on host {s['host']}" if cause == "contention" and s["host"] not in ("", "?") else ""
    return f", of which {part:.1f} ms {CAUSE_WORDS[cause][0]}{host} ({cause})"


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
    out = []
    for h in a.contention.itertuples():
        if not h.short:
            continue
        where = f"host {h.host}" if h.host != "?" else "this host"
        out.append(
            Finding(
                "contention",
                "warning",
                f"CPU contention on {where}: its ranks ({_list(h.ranks)}) wait a median "
                f"{h.runq_ms:.1f} ms per step runnable but without a CPU, {h.work_share:.0%} of "
                f"their {h.work_ms:.1f} ms outside synchronize (most: rank {h.worst_rank}, "
                f"{h.worst_runq_ms:.1f} ms)"
                + ("" if h.host in advised else "; " + CAUSE_WORDS["contention"][2]),
                h.runq_ms,
                "ms",
                {"host": h.host, "ranks": list(h.ranks), "work_share": h.work_share},
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
    """Rank 0 doing blocking work between steps (logging, checkpoints) while the others wait."""
    if 0 not in a.ranks or len(a.ranks) < 2:
        return []
    s = analyzed_steps(a.steps, a.skip_steps)
    if s.empty:
        return []
    wide = s.pivot_table(index="step", columns="rank", values="input_ns", aggfunc="sum")
    if 0 not in wide.columns or wide.shape[1] < 2:
        return []
    m = wide.to_numpy(dtype=np.float64)
    ex = (m - median_of_others(m))[:, list(wide.columns).index(0)]
    ex = ex[np.isfinite(ex)]
    if not len(ex):
        return []
    med_step = float(s["step_ns"].median())
    med_ex = float(np.median(ex))
    step0 = float(s.loc[s["rank"] == 0, "step_ns"].sum())
    share = float(np.clip(ex, 0, None).sum() / step0) if step0 > 0 else 0.0
    floor = max(RANK0_STEP_SHARE * med_step, cfg.min_floor_ns)
    if not (med_ex > floor or share >= RANK0_RUN_SHARE):
        return []
    pr = a.per_rank.set_index("rank")
    in0 = pr.loc[0, "input_ms"]
    others = pr.drop(index=0)["input_ms"].median()
    v0 = a.verdicts.set_index("rank").loc[0]
    last = (
        f" (it is last to be ready in {v0['last_share']:.0%} of steps, median "
        f"{v0['late_ms']:.1f} ms late)"
        if bool(v0["named"])
        else ""
    )
    msg = (
        f"rank 0 does blocking work between steps while the others wait{last}: its input gap is "
        f"{in0:.1f} ms vs {others:.1f} ms on the other ranks (median excess {med_ex / 1e6:.1f} ms "
        f"per step, {share:.0%} of its run time)"
    )
    up = a.user_per_rank
    if len(up):
        u0 = up[up["rank"] == 0].set_index("name")["mean_ms"]
        uo = up[up["rank"] != 0].groupby("name")["mean_ms"].median()
        diff = (u0 - uo.reindex(u0.index).fillna(0.0)).sort_values(ascending=False)
        if len(diff) and diff.iloc[0] > 0.3 * max(float(np.mean(np.clip(ex, 0, None))) / 1e6, 1e-9):
            msg += f"; user span '{diff.index[0]}' adds {diff.iloc[0]:.1f} ms per step on rank 0"
    msg += "; move it off the training loop (another thread, or every N steps)"
    return [
        Finding(
            "rank0_blocking",
            "warning",
            msg,
            med_ex / 1e6,
            "ms",
            {"input_ms_rank0": _f(in0), "input_ms_others": _f(others), "run_share": share},
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
    step_ms = float(p["step_ms"].median())
    ratio = float(p["comm_compute_ratio"].median())
    ov = float(p["overlap"].median())
    env = a.horovod_env
    msg = (
        f"communication-bound: in {share:.0%} of steps the last rank to be ready still waits "
        f"{exp_share:.0%} of the step for allreduces (median {exp_ms:.1f} of {step_ms:.1f} ms); "
        f"comm/compute {ratio:.1f}, {ov:.0%} of allreduce time hidden under backward. "
        f"Try: a larger batch per worker, hvd.Compression.fp16 (now: "
        f"{_compression(a.optimizer)}), {_knob(env, 'HOROVOD_FUSION_THRESHOLD')}, "
        f"{_knob(env, 'HOROVOD_CYCLE_TIME')}"
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
    """A collective outside the optimizer that blocks a large share of the step: either the
    ranks wait in it for one late rank (``collective_wait``), or it costs that much by itself
    (``collective_cost``)."""
    t = a.outside
    if t is None or t.empty:
        return []
    out = []
    for _, r in t.iterrows():
        share = float(r["step_share"])
        if not np.isfinite(share) or share < OUTSIDE_STEP_SHARE:
            continue
        what = _collective_words(r)
        data = {
            "op": str(r["op"]),
            "phase": str(r["phase"]),
            "name": str(r["name"]),
            "count_per_step": _f(r["count_per_step"]),
            "blocked_ms_per_step": _f(r["blocked_ms_per_step"]),
            "step_share": _f(share),
        }
        rank, late = int(r["late_rank"]), float(r["late_share"])
        need = 0.75 if int(r["ranks"]) == 2 else 0.5
        wait = float(r["wait_for_last_ms"])
        per_call = float(r["blocked_ms_per_step"]) / max(float(r["count_per_step"]), 1e-9)
        if rank >= 0 and np.isfinite(late) and late >= need and wait >= 0.5 * per_call:
            data |= {"rank": rank, "last_share": late, "wait_for_last_ms": wait}
            out.append(
                Finding(
                    "collective_wait",
                    "warning",
                    f"ranks wait {wait:.1f} ms per call in {what} for rank {rank}, the last to "
                    f"issue it in {late:.0%} of calls ({share:.0%} of each step blocked in it): "
                    f"rank {rank} is late before the call; the collective itself is not slow",
                    wait,
                    "ms",
                    data,
                )
            )
        else:
            out.append(
                Finding(
                    "collective_cost",
                    "warning",
                    f"{what} blocks {share:.0%} of each step "
                    f"({r['blocked_ms_per_step']:.1f} ms, {r['count_per_step']:.2g} calls per "
                    f"step): reduce metrics every N steps instead of every step, or issue them "
                    f"with the _async form and synchronize the handle where the result is needed",
                    float(r["blocked_ms_per_step"]),
                    "ms",
                    data,
                )
            )
    return out


def _collective_words(r: Any) -> str:
    """``hvd.allreduce (sum) 'loss' issued in backward`` for a row of ``Analysis.outside`` (or
    anything with ``op``, ``name`` and ``phase``)."""
    op = str(r["op"])
    fn, _, red = op.partition(".")
    name = f" {printable(r['name'])!r}" if r["name"] else ""
    return f"hvd.{printable(fn)}{f' ({printable(red)})' if red else ''}{name} issued in " + (
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
