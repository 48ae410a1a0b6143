"""Sub-commands registered by later parts of hvtrace (analyze, dashboard).

Each registers its parser here and imports its heavy modules only when run, so ``hvtrace info``
never pays for Dash or the analysis.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the optional sub-commands to ``sub``."""
    _register_analyze(sub)
    _register_dashboard(sub)


# -- analyze (hvtrace.analysis + hvtrace.export.report) ------------------------------------------
def _cmd_analyze(args: argparse.Namespace) -> int:
    from hvtrace.export.report import analyze_command  # pandas/numpy only when run

    return analyze_command(args)


def parse_steps(text: str) -> tuple[int, int | None]:
    """Parse ``A:B`` (steps A..B-1), ``A:`` (A to the end), ``:B`` or ``A`` (just step A)."""
    t = text.strip()
    try:
        if ":" in t:
            lo_s, hi_s = t.split(":", 1)
            lo = int(lo_s) if lo_s.strip() else 0
            hi = int(hi_s) if hi_s.strip() else None
        else:
            lo = int(t)
            hi = lo + 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step range: use A:B (steps A to B-1), A: or :B"
        ) from None
    if lo < 0 or (hi is not None and hi <= lo):
        raise argparse.ArgumentTypeError(f"{text!r} selects no step (need 0 <= A < B)")
    return lo, hi


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
    p.add_argument("--run-id", default=None, help="run to read when the directory holds several")
    p.set_defaults(func=_cmd_analyze)


# -- dashboard (hvtrace_dashboard, installed from dashboard/) -------------------------------------
def _cmd_dashboard(args: argparse.Namespace) -> int:
    try:  # Dash is imported only here, so no other sub-command pays for it
        from hvtrace_dashboard.app import run_command
    except ImportError as exc:
        from hvtrace.load import TraceError

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
