"""The whole analysis of a run in one call: :func:`analyze` (a Run) or :func:`analyze_spans`.

Both return an :class:`Analysis` holding every table (pandas DataFrames, times in ns or ms as the
column names say), the straggler verdicts and the findings. Nothing here prints or plots; see
:mod:`hvtrace.export.report` for the terminal report, :mod:`hvtrace.export.jsondoc` and
:mod:`hvtrace.export.tables` for the JSON/CSV/Parquet outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis import antipatterns, consistency, framework, gradients, hvd_timeline
from hvtrace.analysis.bandwidth import (
    BANDWIDTH_CAVEAT,
    comm_summary,
    step_comm_table,
    tensor_table,
)
from hvtrace.analysis.findings import make_findings
from hvtrace.analysis.hangs import find_hangs
from hvtrace.analysis.links import connection_rows, limiting_link, link_table
from hvtrace.analysis.lockstep import lockstep_breaks
from hvtrace.analysis.model import Analysis, Finding, RankState
from hvtrace.analysis.outside import merge_partials, outside_table
from hvtrace.analysis.steps import (
    COMM_BOUND_SHARE,
    analyzed_steps,
    rank_summary,
    step_summary,
    user_summary,
)
from hvtrace.analysis.stragglers import (
    StragglerConfig,
    clock_uncertainty_ns,
    coordinator_contention,
    find_stragglers,
    host_contention,
    mark_host_stragglers,
    merge_episodes,
    slow_hosts,
    straggler_episodes,
    straggler_table,
)
from hvtrace.analysis.whatif import add_costs, step_model, whatif_summary
from hvtrace.selection import StepRange


def implausible_problems(counts: dict[int, dict[str, int]]) -> list[str]:
    """One problem line per rank and kind of implausible span the engine left out or corrected
    (:func:`hvtrace.analysis.engine.plausible`)."""
    from hvtrace.analysis.engine import IMPLAUSIBLE

    return [
        f"rank {r}: {counts[r][what]} {words}"
        for r in sorted(counts)
        for what, words in IMPLAUSIBLE.items()
        if counts[r].get(what)
    ]


def analyze_tables(
    st: pd.DataFrame,
    users: pd.DataFrame,
    coll: pd.DataFrame,
    *,
    size: int | None = None,
    hosts: dict[int, str] | None = None,
    clock_uncertainty: dict[int, int] | None = None,
    skip_steps: int = 1,
    steps: StepRange | None = None,
    config: StragglerConfig | None = None,
    run_id: str = "",
    horovod_env: dict[str, str] | None = None,
    optimizer: dict[str, Any] | None = None,
    outside: pd.DataFrame | None = None,
) -> Analysis:
    """Analyze a run from its summaries: the cross-rank half of every metric.

    ``st``: the step table (:func:`hvtrace.analysis.steps.step_table`, or
    :func:`~hvtrace.analysis.steps.finish_steps` of the engine's per-rank pass), ``users``: user
    time per (rank, step, name), ``coll``: :func:`hvtrace.analysis.engine.collective_table`.
    ``outside``: the collectives outside the optimizer per (step, name, occurrence)
    (:class:`hvtrace.analysis.engine.Summaries`' ``outside``; None: none).
    Other arguments as for :func:`analyze_spans`. Raises ``ValueError`` when ``st`` is empty.
    """
    if st.empty:
        raise ValueError("the run has no spans to analyze")
    ranks = sorted(int(r) for r in st["rank"].unique())
    size = size or (max(ranks) + 1)
    hosts = dict(hosts or {})
    for r in ranks:
        hosts.setdefault(r, "?")
    per_rank = rank_summary(st, skip_steps)
    per_rank.insert(1, "host", [hosts.get(int(r), "?") for r in per_rank["rank"]])
    ups = user_summary(users, st, skip_steps)
    tens = tensor_table(coll, size, skip_steps)
    sc = step_comm_table(st, size)
    verdicts = straggler_table(st, users, hosts, clock_uncertainty, skip_steps, config)
    episodes = straggler_episodes(st, users, hosts, clock_uncertainty, skip_steps, config)
    verdicts = merge_episodes(verdicts, episodes, st, skip_steps)
    hosts_df = slow_hosts(verdicts, st, skip_steps, config)
    verdicts = mark_host_stragglers(verdicts, hosts_df)
    cont = host_contention(st, skip_steps, hosts)
    verdicts = coordinator_contention(verdicts, cont)
    named = find_stragglers(verdicts)
    model = step_model(st, skip_steps)
    short = set(cont.loc[cont["short"], "host"]) if len(cont) else set()
    named, hosts_df = add_costs(model, named, short), add_costs(model, hosts_df, short)
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
        stragglers=named,
        slow_hosts=hosts_df,
        whatif=whatif_summary(model, named, hosts_df),
        contention=cont,
        outside=outside_table(
            merge_partials([outside]), analyzed_steps(st, skip_steps), len(ranks)
        ),
        clock_uncertainty_ns=dict(clock_uncertainty or {}),
        horovod_env=dict(horovod_env or {}),
        optimizer=dict(optimizer or {}),
    )
    a.accumulation = framework.accumulation(a)
    a.findings = make_findings(a, config)
    return a


def analyze_spans(
    spans: pd.DataFrame,
    *,
    size: int | None = None,
    hosts: dict[int, str] | None = None,
    clock_uncertainty: dict[int, int] | None = None,
    skip_steps: int = 1,
    steps: StepRange | tuple[int, int | None] | None = None,
    config: StragglerConfig | None = None,
    run_id: str = "",
    horovod_env: dict[str, str] | None = None,
    optimizer: dict[str, Any] | None = None,
) -> Analysis:
    """Analyze a span table (as :func:`hvtrace.load_run` makes; times in ns on one clock).

    The frame goes through the same engine as a run's files (:func:`analyze`); it is in memory
    already, so this suits small runs and hand-made tables.
    ``size``: ranks in the run (default: ranks present); ``hosts``: rank -> host;
    ``clock_uncertainty``: rank -> ns; ``skip_steps``: warm-up steps left out of statistics;
    ``steps``: a :class:`~hvtrace.selection.StepRange` (or a ``(first, stop)`` tuple) keeps steps
    ``first .. stop-1`` only (``stop`` None: to the end).
    Raises ``ValueError`` when the selection holds no spans.
    """
    from hvtrace.analysis.engine import frame_summaries

    steps = StepRange.of(steps)
    if spans.empty:
        raise ValueError("the run has no spans to analyze")
    summ = frame_summaries(spans, steps)
    if summ.steps.empty:
        have = spans["step"]
        rng = f"{int(have.min())}..{int(have.max())}"
        what = f"no spans in steps {steps.label()}" if steps is not None else "no step spans"
        raise ValueError(f"{what} (the run has {rng})")
    a = analyze_tables(
        summ.steps,
        summ.users,
        summ.collectives,
        size=size or (int(spans["rank"].max()) + 1),
        hosts=hosts,
        clock_uncertainty=clock_uncertainty,
        skip_steps=skip_steps,
        steps=steps,
        config=config,
        run_id=run_id,
        horovod_env=horovod_env,
        optimizer=optimizer,
        outside=summ.outside,
    )
    a.consistency = consistency.check_frame(spans, steps)
    a.batches = antipatterns.batch_check_frame(spans, steps)
    a.trainer = framework.scan_frame(spans, steps)
    a.accumulation = framework.accumulation(a)
    if a.consistency.get("divergences") or a.batches.get("groups") or len(a.trainer["rows"]):
        a.findings = make_findings(a, config)
    return a


def analyze(
    run: Any,
    steps: StepRange | tuple[int, int | None] | None = None,
    skip_steps: int = 1,
    config: StragglerConfig | None = None,
    *,
    memory_limit_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    dask: str | None = None,
    horovod_timeline: str | Path | None = None,
    prior: tuple[Any, int] | None = None,
    membership: bool = True,
) -> Analysis:
    """Analyze an opened :class:`hvtrace.Run` on the engine; return an :class:`Analysis`.

    The run's spans are never loaded as one frame: :mod:`hvtrace.analysis.engine` reduces each
    rank's file (only the row groups of ``steps``) to summaries on DuckDB, and the cross-rank
    metrics are computed from those (:func:`analyze_tables`).
    ``steps``: a :class:`~hvtrace.selection.StepRange` (or ``(first, stop)``) restricts the
    analysis to steps ``first .. stop-1``; ``skip_steps``: steps ``0 .. skip_steps-1`` (warm-up)
    are left out of medians and verdicts; ``config``: straggler thresholds (default:
    :meth:`StragglerConfig.for_timing` of the run's timing, so CPU-timed runs get a 2 ms noise
    floor); ``memory_limit_bytes``: DuckDB's memory limit (default a quarter of the machine's);
    ``progress(done, total)``: called as ranks are done; ``dask``: run the per-rank pass as
    tasks on a Dask cluster (``local:N`` or a scheduler address, see
    :mod:`hvtrace.analysis.cluster`) instead of in this process; ``horovod_timeline``: a Horovod
    timeline file to merge (default: the run's own, if any: :mod:`hvtrace.analysis.hvd_timeline`);
    ``prior``: ``(summaries, stop)``: the :attr:`Analysis.summaries` of an earlier analysis of
    the same run, whose steps before ``stop`` can no longer change (a run followed while it
    grows, :mod:`hvtrace.follow`): only steps from ``stop`` on are read again;
    ``membership``: for an Elastic Horovod run whose workers changed, also analyze each
    membership epoch on its own and report the resets (:mod:`hvtrace.analysis.membership`).
    Raises
    :class:`hvtrace.TraceError` when the run (or the step selection) holds no spans.
    """
    from hvtrace.analysis.engine import EngineError, summarize
    from hvtrace.errors import TraceError
    from hvtrace.format.read import salvage
    from hvtrace.load import RankSource, span_sources

    steps = StepRange.of(steps)
    h0 = run.files[run.ranks[0]].header if run.files else {}
    if config is None:
        config = StragglerConfig.for_timing(h0.get("timing"))
    sources = span_sources(run, steps)
    read_steps = steps
    if prior is not None:  # only the steps that may have changed since
        first = max(int(prior[1]), steps.first if steps is not None else 0)
        read_steps = StepRange(first, steps.stop if steps is not None else None)
    salvaged: list[str] = []

    def repair(group: list[RankSource]) -> list[RankSource]:
        """Read a group that DuckDB could not with the careful reader, keeping what it can."""
        out = []
        for s in group:
            rf = run.files.get(s.rank) if s.rank is not None else None
            if s.parquet is None or rf is None:
                out.append(s)
                continue
            msg = salvage(rf)
            if msg:
                salvaged.append(msg)
            n_groups = len(rf.row_group_steps)  # the careful reader read them all
            out.append(
                RankSource(
                    s.rank,
                    rf.table.num_rows,
                    table=rf.table,
                    clock=s.clock,
                    row_groups_read=n_groups,
                    row_groups_total=n_groups,
                )
            )
        return out

    try:
        if dask:
            from hvtrace.analysis.cluster import summarize_dask

            summ = summarize_dask(
                sources,
                read_steps,
                dask=dask,
                n_ranks=len(sources),
                memory_limit_bytes=memory_limit_bytes,
                progress=progress,
                repair=repair,
            )
        else:
            summ = summarize(
                sources,
                read_steps,
                n_ranks=len(sources),
                memory_limit_bytes=memory_limit_bytes,
                progress=progress,
                repair=repair,
            )
    except EngineError as exc:
        where = "the Dask engine" if dask else "the query engine"
        raise TraceError(f"{run.run_dir}: {where} failed: {exc}") from None
    if prior is not None:
        summ = prior[0].before(read_steps.first).then(summ)
    if summ.steps.empty:
        last = max((int(f.last_step) for f in run.files.values()), default=-1)
        what = f"no spans in steps {steps.label()}" if steps is not None else "no spans"
        raise TraceError(f"{run.run_dir}: {what} (the ranks stopped by step {last})")
    try:
        a = analyze_tables(
            summ.steps,
            summ.users,
            summ.collectives,
            size=run.size,
            hosts=run.hosts,
            clock_uncertainty=clock_uncertainty_ns(run),
            skip_steps=skip_steps,
            steps=steps,
            config=config,
            run_id=run.run_id,
            horovod_env=h0.get("horovod_env") or {},
            optimizer=h0.get("optimizer") or {},
            outside=summ.outside,
        )
    except ValueError as exc:
        raise TraceError(f"{run.run_dir}: {exc}") from None
    a.read = {
        "spans": summ.spans_read,
        "spans_total": sum(int(f.n_spans) for f in run.files.values()),
        "files": len(sources),
        "files_total": int(run.size),
        "row_groups": summ.row_groups_read,
        "row_groups_total": summ.row_groups_total,
    }
    a.engine = dict(summ.engine)
    a.summaries = summ
    a.run_dir = Path(run.run_dir)
    a.timing = str(h0.get("timing") or "")
    fw = h0.get("framework")
    a.framework = dict(fw) if isinstance(fw, dict) else {}
    ctl = h0.get("controller")
    a.controller = ctl if ctl in ("mpi", "gloo") else ""
    gpu = h0.get("gpu_operations")
    a.gpu_operations = gpu if gpu in ("nccl", "host") else ""
    a.versions = {
        k: (str(h0[f"{k}_version"]) if h0.get(f"{k}_version") is not None else None)
        for k in ("torch", "horovod", "hvtrace")
    }
    a.clock = run.clock_summary()
    a.clock_ranks = run.clock_table()
    a.hangs = find_hangs(run.files, run.expected_ranks)
    a.consistency = consistency.check(sources, steps)
    if a.lightning is not None:  # Lightning's own rows: only HvtraceCallback records them
        a.trainer = framework.scan(sources, steps)
        a.accumulation = framework.accumulation(a)
    a.batches, a.scale, zero_rows = antipatterns.scan(sources, run.size, steps)
    headers = {r: f.header for r, f in run.files.items()}
    a.placement = antipatterns.placement(headers)
    a.gradients = {
        "manual": (
            gradients.manual_check(sources, headers, steps)
            if gradients.may_average_by_hand(a.outside)
            else gradients.empty_manual()
        ),
        "zero_rows": gradients.zero_rows_summary(zero_rows),
    }
    a.links = link_table(connection_rows(run.files, run.hosts))
    cont = a.contention
    a.limiting_link = limiting_link(
        a.links,
        a.comm.get("busbw_gbps", float("nan")),
        dict(zip(cont["host"], cont["work_share"].astype(float))),
    )
    a.problems = list(run.problems) + salvaged + implausible_problems(summ.implausible)
    if a.consistency.get("error"):
        a.problems.append(f"consistency checks not read: {a.consistency['error']}")
    if a.trainer.get("error"):
        a.problems.append(f"Lightning's records not read: {a.trainer['error']}")
    if a.batches.get("error"):
        a.problems.append(f"batch fingerprints not read: {a.batches['error']}")
    if a.gradients["manual"].get("error"):
        a.problems.append(f"manual averaging not checked: {a.gradients['manual']['error']}")
    a.horovod_timeline = hvd_timeline.run_section(run, sources, horovod_timeline)
    a.live = [e for _r, f in sorted(run.files.items()) for e in getattr(f, "live", [])]
    a.missing_ranks = list(run.missing_ranks)
    a.rank_states = [
        RankState(r, f.complete, f.truncated, int(f.dropped), int(f.last_step))
        for r, f in sorted(run.files.items())
    ]
    a.in_progress = bool(getattr(run, "live", False))
    if not a.in_progress:  # a run being written has ranks at different steps by nature
        from hvtrace.analysis.membership import epochs

        a.lockstep = lockstep_breaks(
            summ.steps,
            summ.outside,
            a.rank_states,
            elastic=len(epochs(run)[0]) > 1,
        )
        framework.annotate_lockstep(a.lockstep, a.trainer)
    a.findings = make_findings(a, config)  # again, now with the run's state
    if membership:
        from hvtrace.analysis import membership as _membership

        def analyze_epoch(sub: Any, epoch_steps: StepRange, skip: int) -> Analysis:
            if steps is not None:  # the epoch within the selection
                first = max(epoch_steps.first, steps.first)
                stops = [s for s in (epoch_steps.stop, steps.stop) if s is not None]
                stop = min(stops) if stops else None
                if stop is not None and stop <= first:
                    raise ValueError("outside the selected steps")
                epoch_steps = StepRange(first, stop)
            return analyze(
                sub, epoch_steps, skip, config, memory_limit_bytes=memory_limit_bytes,
                dask=dask, horovod_timeline=None, membership=False,
            )  # fmt: skip

        _membership.attach(a, run, analyze_epoch, skip_steps)
    return a


__all__ = [
    "BANDWIDTH_CAVEAT",
    "COMM_BOUND_SHARE",
    "Analysis",
    "Finding",
    "RankState",
    "analyze",
    "analyze_spans",
    "analyze_tables",
    "step_summary",
]
