"""What an analysis produces: the :class:`Analysis` of a run, the :class:`RankState` of each
rank's recording and the :class:`Finding` lines.

Data only: :mod:`hvtrace.analysis.summary` fills an Analysis, :mod:`hvtrace.analysis.findings`
reads it to make its findings, and the renderers (report, dashboard) show it. So the imports run
one way, model <- findings <- summary, and none of them needs the other at type-checking time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from hvtrace.analysis.steps import analyzed_steps
from hvtrace.format.schema import LIGHTNING_PREFIX
from hvtrace.selection import StepRange


@dataclass
class Finding:
    """One line of advice. ``kind`` names the check (``hang``, ``divergence``, ``incomplete``,
    ``dropped``, ``straggler``, ``slow_host``, ``rank0_blocking``, ``comm_bound``,
    ``small_allreduces``, ``late_unexplained``, ``balanced``); ``severity`` is ``warning`` or
    ``info``; ``value`` is the number behind the line, in ``unit``; ``data`` holds the other
    numbers (JSON-ready)."""

    kind: str
    severity: str
    message: str
    value: float | None = None
    unit: str = ""
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the finding as a JSON-ready dict."""
        return asdict(self)


@dataclass
class RankState:
    """How one rank's recording ended (from its file)."""

    rank: int
    complete: bool
    truncated: bool
    dropped: int
    last_step: int


#: The run-level figures (:attr:`Analysis.run_row`): medians over the analyzed steps of these
#: columns of ``per_step``.
RUN_FIGURES = ("step_ms", "comm_compute_ratio", "overlap", "exposed_ms", "exposed_share")


@dataclass
class Analysis:
    """Everything :func:`hvtrace.analysis.analyze` computes. DataFrames are documented where
    they are made:

    - ``steps``: :func:`hvtrace.analysis.steps.step_table` (per rank and step, ns);
    - ``per_rank``: :func:`hvtrace.analysis.steps.rank_summary` plus ``host`` (ms);
    - ``users`` / ``user_per_rank``: :func:`~hvtrace.analysis.engine.user_table` (ns) /
      :func:`~hvtrace.analysis.steps.user_summary` (ms);
    - ``per_step``: :func:`hvtrace.analysis.summary.step_summary` (one row per step, ms);
    - ``collectives`` / ``tensors`` / ``step_comm``: :mod:`hvtrace.analysis.bandwidth`;
    - ``verdicts``: :func:`hvtrace.analysis.stragglers.straggler_table` (every rank);
      ``stragglers``: the named ones; ``slow_hosts``: hosts whose ranks are all late (both with
      what they cost the job: ``lost_ms_per_step``, ``lost_share``, see
      :mod:`hvtrace.analysis.whatif`);
    - ``links`` / ``limiting_link``: :mod:`hvtrace.analysis.links` (host-to-host rates from the
      ranks' TCP counters; empty / None for a frame or a run on one host);
    - ``findings``: short actionable lines, each with the number behind it.

    ``step_range``: the steps selected (None: the whole run).
    """

    run_id: str
    size: int
    ranks: list[int]
    hosts: dict[int, str]
    skip_steps: int
    step_range: StepRange | None
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
    #: Per rank: offset_ns, uncertainty_ns, method, estimates, drift_ppm
    #: (:meth:`hvtrace.load.Run.clock_table`); empty for a frame.
    clock_ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    rank_states: list[RankState] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    horovod_env: dict[str, str] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    timing: str = ""  # the header's timing: host_monotonic (CPU) or cuda_events
    run_dir: Path | None = None
    #: What the engine read: ``spans`` (spans read), ``spans_total`` (in the files opened),
    #: ``files`` (files opened), ``files_total`` (rank files of the run), ``row_groups`` /
    #: ``row_groups_total`` (Parquet row groups read / in the files opened); empty for a frame.
    read: dict[str, int] = field(default_factory=dict)
    #: The engine that ran the per-rank pass: ``{"name": "duckdb"}`` (this process) or
    #: ``{"name": "dask", "scheduler", "tasks", "tasks_by_worker"}``; empty for a frame.
    engine: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.stragglers.host_contention` (empty without the cause counters).
    contention: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: :func:`hvtrace.analysis.hangs.find_hangs` (empty for a frame or a run without stalls).
    hangs: list[dict[str, Any]] = field(default_factory=list)
    #: :func:`hvtrace.analysis.whatif.whatif_summary` (empty when it cannot be replayed).
    whatif: dict[str, Any] = field(default_factory=dict)
    links: pd.DataFrame = field(default_factory=pd.DataFrame)
    limiting_link: dict[str, Any] | None = None
    #: :func:`hvtrace.analysis.outside.outside_table`: collectives issued outside the optimizer,
    #: per source (empty when none).
    outside: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: :func:`hvtrace.analysis.consistency.check`: what was compared across ranks (parameter
    #: fingerprints, learning rates, values that must agree) and the divergences found.
    consistency: dict[str, Any] = field(default_factory=dict)
    #: :func:`hvtrace.analysis.hvd_timeline.run_section`: Horovod's own timeline, merged (empty
    #: when the run has none).
    horovod_timeline: dict[str, Any] = field(default_factory=dict)
    #: Live straggler verdicts the job logged while it ran (:mod:`hvtrace.record.live`, from rank
    #: 0's file), in order: ``event`` (late / recovered), ``rank``, ``first_step``, ...
    live: list[dict[str, Any]] = field(default_factory=list)
    #: Elastic Horovod: the membership epochs, each with its own analysis, when the run had
    #: more than one (:mod:`hvtrace.analysis.membership`; empty otherwise). The resets are
    #: ``reset`` findings.
    membership: list[dict[str, Any]] = field(default_factory=list)
    #: The per-(rank, step) summaries the metrics were computed from
    #: (:class:`hvtrace.analysis.engine.Summaries`; None for a frame): what a later analysis of
    #: the same, grown run reuses for the steps that can no longer change (``analyze(prior=)``).
    summaries: Any = field(default=None, repr=False)
    #: The run was being written when analyzed (:attr:`hvtrace.load.Run.live`): a rank whose file
    #: is still open is in progress, not stopped.
    in_progress: bool = False
    #: The training framework that built the optimizer, from the header (``{"name":
    #: "pytorch_lightning", "version": "1.9.5"}``; empty for a plain Horovod script or a frame).
    framework: dict[str, Any] = field(default_factory=dict)

    @property
    def lightning(self) -> str | None:
        """The run was traced under PyTorch Lightning: its version (the header's ``framework``),
        ``""`` when only the trace shows it (the logged metrics or a plateau scheduler's value
        that only :mod:`hvtrace.lightning` records, a collective Lightning issued for itself),
        None when the run is not known to be Lightning's."""
        fw = self.framework if isinstance(self.framework, dict) else {}
        if str(fw.get("name") or "") == "pytorch_lightning":
            return str(fw.get("version") or "")
        c = self.consistency if isinstance(self.consistency, dict) else {}
        if c.get("metrics") or any(
            d.get("what") == "metrics" or d.get("monitored")
            for d in c.get("divergences") or []
            if isinstance(d, dict)
        ):
            return ""
        t = self.outside
        names = t["name"] if t is not None and len(t) and "name" in t.columns else ()
        if len(names) and names.astype(str).str.startswith(LIGHTNING_PREFIX).any():
            return ""
        return None

    @property
    def run_steps(self) -> pd.DataFrame:
        """The rows of ``per_step`` the run-level figures are medians of: the steps after the
        warm-up (all of them when the run has no other)."""
        ps = self.per_step
        after = ps[ps["step"] >= self.skip_steps] if len(ps) else ps
        return after if len(after) else ps

    @property
    def run_row(self) -> dict[str, float | None]:
        """The run-level figures, defined once: the report, the findings, the dashboard's header
        and the elastic epoch table read them here. Each of :data:`RUN_FIGURES` is the median
        over :attr:`run_steps` of that per-step column (None without a value);
        ``busbw_gbps`` is the run's bus bandwidth (``comm``)."""
        p = self.run_steps
        out: dict[str, float | None] = {}
        for c in RUN_FIGURES:
            col = p[c] if c in p.columns else pd.Series(dtype=float)
            col = col.astype("float64")
            out[c] = float(col.median()) if col.notna().any() else None
        bus = self.comm.get("busbw_gbps") if isinstance(self.comm, dict) else None
        out["busbw_gbps"] = float(bus) if bus is not None and bus == bus else None
        return out

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


__all__ = ["Analysis", "Finding", "RankState"]
