"""The whole analysis of a run in one call: :func:`analyze` (a Run) or :func:`analyze_spans`.

Both return an :class:`Analysis` holding every table (pandas DataFrames, times in ns or ms as the
column names say), the straggler verdicts and the findings. Nothing here prints or plots; see
:mod:`hvtrace.export.report` for the terminal report and the JSON/CSV/Parquet outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hvtrace.analysis.bandwidth import (
    BANDWIDTH_CAVEAT,
    collective_table,
    comm_summary,
    step_comm_table,
    tensor_table,
)
from hvtrace.analysis.findings import Finding, make_findings
from hvtrace.analysis.steps import (
    analyzed_steps,
    rank_summary,
    step_table,
    user_summary,
    user_table,
)
from hvtrace.analysis.stragglers import (
    StragglerConfig,
    clock_uncertainty_ns,
    find_stragglers,
    mark_host_stragglers,
    slow_hosts,
    straggler_table,
)

#: A step counts as communication-bound when the last rank to arrive (which waited for nobody)
#: still spends at least this share of the step blocked in ``synchronize()``.
COMM_BOUND_SHARE = 0.25


@dataclass
class RankState:
    """How one rank's recording ended (from its file)."""

    rank: int
    complete: bool
    truncated: bool
    dropped: int
    last_step: int


@dataclass
class Analysis:
    """Everything :func:`analyze` computes. DataFrames are documented where they are made:

    - ``steps``: :func:`hvtrace.analysis.steps.step_table` (per rank and step, ns);
    - ``per_rank``: :func:`hvtrace.analysis.steps.rank_summary` plus ``host`` (ms);
    - ``users`` / ``user_per_rank``: :func:`~hvtrace.analysis.steps.user_table` (ns) /
      :func:`~hvtrace.analysis.steps.user_summary` (ms);
    - ``per_step``: :func:`step_summary` (one row per step, ms);
    - ``collectives`` / ``tensors`` / ``step_comm``: :mod:`hvtrace.analysis.bandwidth`;
    - ``verdicts``: :func:`hvtrace.analysis.stragglers.straggler_table` (every rank);
      ``stragglers``: the named ones; ``slow_hosts``: hosts whose ranks are all late;
    - ``findings``: short actionable lines, each with the number behind it.
    """

    run_id: str
    size: int
    ranks: list[int]
    hosts: dict[int, str]
    skip_steps: int
    step_range: tuple[int, int | None] | None
    steps: pd.DataFrame
    per_rank: pd.DataFrame
    users: pd.DataFrame
    user_per_rank: pd.DataFrame
    per_step: pd.DataFrame
    collectives: pd.DataFrame
    tensors: pd.DataFrame
    step_comm: pd.DataFrame
    comm: dict[str, float]
    verdicts: pd.DataFrame
    stragglers: pd.DataFrame
    slow_hosts: pd.DataFrame
    findings: list[Finding] = field(default_factory=list)
    clock: str = ""
    clock_uncertainty_ns: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rank_states: list[RankState] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    horovod_env: dict[str, str] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    timing: str = ""  # the header's timing: host_monotonic (CPU) or cuda_events
    run_dir: Path | None = None

    @property
    def analyzed(self) -> pd.DataFrame:
        """The rows of ``steps`` the statistics use (complete, after the warm-up)."""
        return analyzed_steps(self.steps, self.skip_steps)

    @property
    def analyzed_step_numbers(self) -> tuple[int, int, int]:
        """``(first, last, count)`` of the analyzed step numbers (-1, -1, 0 when none)."""
        s = self.analyzed["step"]
        if s.empty:
            return -1, -1, 0
        return int(s.min()), int(s.max()), int(s.nunique())


def step_summary(steps: pd.DataFrame, comm_bound_share: float = COMM_BOUND_SHARE) -> pd.DataFrame:
    """Return one row per step, across ranks (times in ms).

    Columns: ``step``, ``ranks`` (ranks with the complete step), ``step_ms`` (median over
    ranks), ``last_rank`` (the rank whose last gradient was ready last; -1 if unknown),
    ``spread_ms`` (its lateness: how long the first rank waited for it), and, for that last rank,
    which waited for nobody: ``exposed_ms`` (its ``synchronize()`` wait: communication not hidden),
    ``comm_ms`` (its allreduce union), ``model_ms``, ``comm_compute_ratio``, ``overlap``;
    ``exposed_share`` = exposed / step and ``comm_bound`` = exposed_share >= ``comm_bound_share``.
    """
    s = steps[steps["complete"]]
    cols = [
        "step",
        "ranks",
        "step_ms",
        "last_rank",
        "spread_ms",
        "exposed_ms",
        "comm_ms",
        "model_ms",
        "comm_compute_ratio",
        "overlap",
        "exposed_share",
        "comm_bound",
    ]
    if s.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    g = s.groupby("step", sort=True)
    out = pd.DataFrame({"ranks": g.size(), "step_ms": g["step_ns"].median() / 1e6})
    # the last rank of each step (largest lateness); steps without arrivals fall back to rank -1
    has = s[s["lateness_ns"].notna()]
    if len(has):
        idx = has.groupby("step")["lateness_ns"].idxmax()
        last = has.loc[idx.to_numpy()].set_index("step")
    else:
        last = pd.DataFrame(
            columns=["rank", "lateness_ns", "wait_ns", "allreduce_ns", "model_ns", "overlap"]
        )
    out["last_rank"] = last["rank"].reindex(out.index).fillna(-1).astype(np.int64)
    out["spread_ms"] = last["lateness_ns"].reindex(out.index) / 1e6
    ref = last.reindex(out.index)
    if len(has) < len(s):  # steps with no allreduce: use the rank medians
        med = g[["wait_ns", "allreduce_ns", "model_ns", "overlap"]].median()
        for c in med.columns:
            ref[c] = ref[c].astype("float64").fillna(med[c])
    out["exposed_ms"] = ref["wait_ns"].astype("float64") / 1e6
    out["comm_ms"] = ref["allreduce_ns"].astype("float64") / 1e6
    out["model_ms"] = ref["model_ns"].astype("float64") / 1e6
    out["comm_compute_ratio"] = out["comm_ms"] / out["model_ms"].where(out["model_ms"] > 0)
    out["overlap"] = ref["overlap"].astype("float64")
    out["exposed_share"] = out["exposed_ms"] / out["step_ms"].where(out["step_ms"] > 0)
    out["comm_bound"] = out["exposed_share"] >= comm_bound_share
    return out.reset_index()[cols]


def analyze_spans(
    spans: pd.DataFrame,
    *,
    size: int | None = None,
    hosts: dict[int, str] | None = None,
    clock_uncertainty: dict[int, int] | None = None,
    skip_steps: int = 1,
    steps: tuple[int, int | None] | None = None,
    config: StragglerConfig | None = None,
    run_id: str = "",
    horovod_env: dict[str, str] | None = None,
    optimizer: dict[str, Any] | None = None,
) -> Analysis:
    """Analyze a span table (as :func:`hvtrace.load_run` makes; times in ns on one clock).

    ``size``: ranks in the run (default: ranks present); ``hosts``: rank -> host;
    ``clock_uncertainty``: rank -> ns; ``skip_steps``: warm-up steps left out of statistics;
    ``steps``: ``(first, stop)`` keeps steps ``first .. stop-1`` only (``stop`` None: to the end).
    Raises ``ValueError`` when the selection holds no spans.
    """
    if steps is not None:
        lo, hi = steps
        sel = spans["step"] >= lo
        if hi is not None:
            sel &= spans["step"] < hi
        if not sel.any():
            have = spans["step"]
            rng = f"{int(have.min())}..{int(have.max())}" if len(have) else "none"
            raise ValueError(
                f"no spans in steps {lo}..{'end' if hi is None else hi - 1} (the run has {rng})"
            )
        spans = spans[sel]
    if spans.empty:
        raise ValueError("the run has no spans to analyze")
    ranks = sorted(int(r) for r in spans["rank"].unique())
    size = size or (max(ranks) + 1)
    hosts = dict(hosts or {})
    for r in ranks:
        hosts.setdefault(r, "?")
    st = step_table(spans)
    users = user_table(spans)
    per_rank = rank_summary(st, skip_steps)
    per_rank.insert(1, "host", [hosts.get(int(r), "?") for r in per_rank["rank"]])
    ups = user_summary(users, st, skip_steps)
    coll = collective_table(spans)
    tens = tensor_table(coll, size, skip_steps)
    sc = step_comm_table(st, size)
    verdicts = straggler_table(st, users, hosts, clock_uncertainty, skip_steps, config)
    hosts_df = slow_hosts(verdicts, st, skip_steps, config)
    verdicts = mark_host_stragglers(verdicts, hosts_df)
    a = Analysis(
        run_id=run_id,
        size=size,
        ranks=ranks,
        hosts=hosts,
        skip_steps=skip_steps,
        step_range=steps,
        steps=st,
        per_rank=per_rank,
        users=users,
        user_per_rank=ups,
        per_step=step_summary(st),
        collectives=coll,
        tensors=tens,
        step_comm=sc,
        comm=comm_summary(st, sc, coll, skip_steps),
        verdicts=verdicts,
        stragglers=find_stragglers(verdicts),
        slow_hosts=hosts_df,
        clock_uncertainty_ns=dict(clock_uncertainty or {}),
        horovod_env=dict(horovod_env or {}),
        optimizer=dict(optimizer or {}),
    )
    a.findings = make_findings(a, config)
    return a


def analyze(
    run: Any,
    steps: tuple[int, int | None] | None = None,
    skip_steps: int = 1,
    config: StragglerConfig | None = None,
) -> Analysis:
    """Analyze a loaded :class:`hvtrace.Run`; return an :class:`Analysis` with its findings.

    ``steps``: ``(first, stop)`` restricts the analysis to steps ``first .. stop-1``;
    ``skip_steps``: steps ``0 .. skip_steps-1`` (warm-up) are left out of medians and verdicts;
    ``config``: straggler thresholds (default: :meth:`StragglerConfig.for_timing` of the run's
    timing, so CPU-timed runs get a 2 ms noise floor). Raises :class:`hvtrace.TraceError` when
    the run (or the step selection) holds no spans.
    """
    from hvtrace.load import TraceError

    h0 = run.files[run.ranks[0]].header if run.files else {}
    if config is None:
        config = StragglerConfig.for_timing(h0.get("timing"))
    try:
        a = analyze_spans(
            run.spans,
            size=run.size,
            hosts=run.hosts,
            clock_uncertainty=clock_uncertainty_ns(run),
            skip_steps=skip_steps,
            steps=steps,
            config=config,
            run_id=run.run_id,
            horovod_env=h0.get("horovod_env") or {},
            optimizer=h0.get("optimizer") or {},
        )
    except ValueError as exc:
        raise TraceError(f"{run.run_dir}: {exc}") from None
    a.run_dir = Path(run.run_dir)
    a.timing = str(h0.get("timing") or "")
    a.clock = run.clock_summary()
    a.problems = list(run.problems)
    a.missing_ranks = list(run.missing_ranks)
    a.rank_states = [
        RankState(r, f.complete, f.truncated, int(f.dropped), int(f.last_step))
        for r, f in sorted(run.files.items())
    ]
    a.findings = make_findings(a, config)  # again, now with the run's state
    return a


__all__ = [
    "BANDWIDTH_CAVEAT",
    "COMM_BOUND_SHARE",
    "Analysis",
    "RankState",
    "analyze",
    "analyze_spans",
    "step_summary",
]
