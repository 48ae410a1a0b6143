"""Sub-commands registered by later parts of hvtrace (analyze, dashboard).

Each registers its parser here and imports its heavy modules only when run, so ``hvtrace info``
never pays for Dash or the analysis.
"""

from __future__ import annotations

import argparse

from hvtrace.selection import SelectionError, StepRange


def register(sub: argparse._SubParsersAction) -> None:
    """Add the optional sub-commands to ``sub``."""
    _register_analyze(sub)
    _register_dashboard(sub)


# -- analyze (hvtrace.analysis + hvtrace.export.report) ------------------------------------------
def _cmd_analyze(args: argparse.Namespace) -> int:
    from hvtrace.export.report import analyze_command  # pandas/numpy only when run

    return analyze_command(args)


def parse_steps(text: str) -> StepRange:
    """Parse ``--steps``: ``A:B`` (steps A..B-1), ``A:`` (A to the end), ``:B`` or ``A`` (step A).

    Returns a :class:`~hvtrace.selection.StepRange`; a bad range is an argparse usage error.
    """
    try:
        return StepRange.parse(text)
    except SelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rank_list(text: str) -> frozenset[int]:
    from hvtrace.selection import SelectionError, parse_ranks

    try:
        return parse_ranks(text)
    except SelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _register_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="where each step's time goes, communication, and which rank holds the others back",
        description="Analyze a run: per-rank step breakdown, allreduce time and bandwidth, "
        "stragglers and findings. Prints a report; optionally writes JSON, CSV/Parquet tables "
        "and the merged timeline.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory of rank trace files")
    p.add_argument(
        "-o",
        "--timeline",
        metavar="PATH",
        default=None,
        help="also write the merged timeline for Perfetto / chrome://tracing "
        "(PATH.json, or PATH.json.gz compressed)",
    )
    p.add_argument(
        "--steps",
        metavar="A:B",
        type=parse_steps,
        default=None,
        help="analyze steps A..B-1 only (A: to the end, :B from the start)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write the summary as JSON ('-': stdout)"
    )
    p.add_argument(
        "--csv", metavar="DIR", default=None, help="write spans and per-step tables as CSV"
    )
    p.add_argument(
        "--parquet", metavar="DIR", default=None, help="write spans and per-step tables as Parquet"
    )
    p.add_argument(
        "--skip-steps",
        metavar="N",
        type=int,
        default=1,
        help="leave steps 0..N-1 (warm-up) out of medians and verdicts (default 1)",
    )
    p.add_argument(
        "--ranks",
        metavar="LIST",
        type=_rank_list,
        default=None,
        help="analyze these ranks only, e.g. 0,4-7 (other ranks' files are not opened)",
    )
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        default=None,
        help="memory the query engine may use before spilling to disk, e.g. 2GB "
        "(default: a quarter of this machine's memory)",
    )
    p.add_argument("--run-id", default=None, help="run to read when the directory holds several")
    p.set_defaults(func=_cmd_analyze)


# -- dashboard (hvtrace_dashboard, installed from dashboard/) -------------------------------------
def _cmd_dashboard(args: argparse.Namespace) -> int:
    try:  # Dash is imported only here, so no other sub-command pays for it
        from hvtrace_dashboard.app import run_command
    except ImportError as exc:
        from hvtrace.errors import TraceError

        raise TraceError(
            f"the dashboard needs Dash and plotly ({exc}); install them with "
            "pip install 'hvtrace[dashboard]'"
        ) from None
    return run_command(args)


def _register_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve a web page to explore a run: heat map, timeline, stragglers",
        description="Serve a Dash page for one run (bound to 127.0.0.1 unless --host is given).",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="?",
        default=None,
        help="directory of rank trace files (default: the built-in sample run)",
    )
    p.add_argument("--run-id", default=None, help="run to read when the directory holds several")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port to listen on (default 8050)")
    p.set_defaults(func=_cmd_dashboard)
