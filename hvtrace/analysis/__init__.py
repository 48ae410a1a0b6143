"""hvtrace's analysis: where each step's time goes, communication, and who holds the others back.

Pure functions, DataFrame (or :class:`hvtrace.Run`) in, DataFrame out; times in ns or ms as the
column names say (``_ns``, ``_ms``), bandwidth in GB/s (``_gbps``), shares in 0..1.

The one-call entry points: :func:`analyze` (an opened Run, read file by file on the DuckDB engine
of :mod:`hvtrace.analysis.engine`) and :func:`analyze_spans` (a span DataFrame, through the same
engine), both returning an :class:`Analysis`; :func:`analyze_tables` does the cross-rank half from
the engine's summaries. The building blocks, for a dashboard or a notebook:

- :func:`step_table` (per rank and step), :func:`rank_summary` (per rank), :func:`user_table`,
  :func:`user_summary`, :func:`step_summary` (per step, across ranks);
- :func:`collective_table`, :func:`tensor_table`, :func:`step_comm_table` (allreduce bandwidth);
- :func:`straggler_table`, :func:`find_stragglers`, :func:`slow_hosts`, :func:`arrival_table`;
- :func:`connection_rows`, :func:`link_table`, :func:`limiting_link` (links between hosts, from
  the ranks' TCP counters);
- :func:`make_findings`;
- :func:`union_ns`, :func:`intersection_ns`, :func:`merge_intervals` (vectorized intervals).
"""

from hvtrace.analysis.bandwidth import (
    BANDWIDTH_CAVEAT,
    bus_factor,
    comm_summary,
    step_comm_table,
    tensor_table,
)
from hvtrace.analysis.engine import collective_table, user_table
from hvtrace.analysis.findings import Finding, make_findings
from hvtrace.analysis.links import connection_rows, limiting_link, link_table
from hvtrace.analysis.overlap import intersection_ns, merge_intervals, union_ns
from hvtrace.analysis.steps import (
    PHASES,
    analyzed_steps,
    rank_summary,
    step_table,
    user_summary,
)
from hvtrace.analysis.stragglers import (
    StragglerConfig,
    arrival_table,
    clock_uncertainty_ns,
    find_stragglers,
    median_of_others,
    slow_hosts,
    straggler_table,
)
from hvtrace.analysis.summary import (
    Analysis,
    analyze,
    analyze_spans,
    analyze_tables,
    step_summary,
)

__all__ = [
    "BANDWIDTH_CAVEAT",
    "PHASES",
    "Analysis",
    "Finding",
    "StragglerConfig",
    "analyze",
    "analyze_spans",
    "analyze_tables",
    "analyzed_steps",
    "arrival_table",
    "bus_factor",
    "clock_uncertainty_ns",
    "collective_table",
    "comm_summary",
    "connection_rows",
    "find_stragglers",
    "intersection_ns",
    "limiting_link",
    "link_table",
    "make_findings",
    "median_of_others",
    "merge_intervals",
    "rank_summary",
    "slow_hosts",
    "step_comm_table",
    "step_summary",
    "step_table",
    "straggler_table",
    "tensor_table",
    "union_ns",
    "user_summary",
    "user_table",
]
