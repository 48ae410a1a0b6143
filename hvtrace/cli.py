"""The ``hvtrace`` command line, all of it: ``run``, ``info``, ``compact``, ``analyze``,
``diff``, ``scaling``, ``dashboard``.

Each sub-command is a parser here and a ``_cmd_*`` function that turns its arguments into calls
of the library (which never sees argparse), importing what it needs only when it runs: ``hvtrace
info`` never pays for DuckDB or Dash. ``main(argv)`` returns the exit code (0 ok, 2 unusable
input) so tests can call it directly. Errors in the input are printed as one line on stderr,
never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hvtrace import __version__
from hvtrace.errors import TraceError
from hvtrace.selection import SelectionError, StepRange, parse_ranks
from hvtrace.units import printable

log = logging.getLogger("hvtrace")

Command = Callable[[argparse.Namespace], int]


def _cmd_info(args: argparse.Namespace) -> int:
    from hvtrace.export.info import format_info
    from hvtrace.load import open_run

    run = open_run(args.run_dir, run_id=args.run_id)
    print(format_info(run))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from hvtrace.launch import default_trace_dir, run_traced

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("hvtrace run: no command given: hvtrace run [OPTIONS] -- COMMAND...", file=sys.stderr)
        return 2
    return run_traced(
        command,
        args.dir or default_trace_dir(),
        horovod_timeline=args.horovod_timeline,
        live_every=args.live_every,
    )


def _cmd_compact(args: argparse.Namespace) -> int:
    from hvtrace.format.compact import compact_run

    results = compact_run(args.run_dir, run_id=args.run_id, progress=_progress("compacting"))
    if not results:
        print(
            f"{printable(args.run_dir)}: nothing to compact (no .arrows files; closed files are "
            ".parquet)"
        )
        return 0
    before = after = spans = done = 0
    for r in results:
        if r.done:
            done += 1
            spans += r.spans
            before += r.bytes_before
            after += r.bytes_after
            state = ""
            if r.truncated:
                state = " (truncated: cut inside a batch, the rank crashed)"
            elif not r.final:
                state = " (not closed cleanly)"
            verb = "compacted" if r.action == "compacted" else "already compacted"
            if r.stale_bytes:
                state += f"; removed {r.stale_bytes:,} bytes an interrupted compaction left"
            print(
                f"{printable(r.source)} -> {printable(r.target.name)}: {verb}, {r.spans:,} spans, "
                f"{r.bytes_before:,} -> {r.bytes_after:,} bytes{state}"
            )
        else:
            print(f"{printable(r.source)}: left as is: {printable(r.reason)}")
    ratio = f" ({after / before:.0%} of the size)" if before else ""
    print(
        f"total: {done} of {len(results)} file(s) compacted, {spans:,} spans, "
        f"{before:,} -> {after:,} bytes{ratio}"
    )
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from hvtrace.analysis import analyze
    from hvtrace.analysis.engine import parse_size, span_tables
    from hvtrace.export.jsondoc import write_json
    from hvtrace.export.output import check_output, check_table_dir
    from hvtrace.export.report import WIDTH, format_report, wrap
    from hvtrace.export.tables import write_tables
    from hvtrace.export.timeline import write_timeline
    from hvtrace.format.read import find_trace_files
    from hvtrace.load import open_run, span_sources

    if args.skip_steps < 0:
        raise TraceError(f"--skip-steps must be >= 0, not {args.skip_steps}")
    memory = None
    if args.memory_limit:
        try:
            memory = parse_size(args.memory_limit)
        except ValueError as exc:
            raise TraceError(f"--memory-limit: {exc}") from None
        if memory < 64 << 20:
            raise TraceError(f"--memory-limit {args.memory_limit} is too small (at least 64MiB)")
    if args.dask is not None:
        from hvtrace.analysis.cluster import check_spec

        try:
            check_spec(args.dask)
        except ValueError as exc:
            raise TraceError(str(exc)) from None
    steps = args.steps
    # every trace file there, opened or not: an output never replaces one (checked before the
    # analysis, so that a bad output path costs nothing)
    inputs = find_trace_files(args.run_dir)
    for out in (args.json, args.timeline, args.html):
        if out and out != "-":
            check_output(out, inputs)
    if args.html:
        write_html = _html_writer()
    for opt, d in (
        ("--csv", args.csv),
        ("--parquet", args.parquet),
        ("--tensorboard", args.tensorboard),
    ):
        if d:
            check_table_dir(opt, d, args.run_dir)
    run = open_run(
        args.run_dir, run_id=args.run_id, ranks=args.ranks, progress=_progress("opening files")
    )
    with _RankProgress("analyzing ranks") as progress:
        a = analyze(
            run, steps=steps, skip_steps=args.skip_steps, memory_limit_bytes=memory,
            progress=progress, dask=args.dask, horovod_timeline=args.horovod_timeline,
        )  # fmt: skip
    if steps is None and args.skip_steps == 1 and args.horovod_timeline is None:
        # kept, so that the dashboard of this run opens without analyzing it again
        from hvtrace.analysis.saved import default_key, save_analysis

        save_analysis(a, default_key(run))
    to_stdout = args.json == "-"
    notes = []
    if args.json:
        p = write_json(a, args.json, inputs)
        if not to_stdout:
            notes.append(f"summary: {p}")
    for fmt, d in (("csv", args.csv), ("parquet", args.parquet)):
        if d:
            # the run's spans rank by rank through the engine, never as one table
            spans = span_tables(span_sources(run, steps), steps)
            files = write_tables(a, d, fmt, spans=spans, inputs=inputs)
            notes.append(f"{fmt} tables: {len(files)} files in {d}")
    if args.timeline:
        notes.append(write_timeline(run, a, args.timeline, steps, inputs))
    if args.tensorboard:
        from hvtrace.export.tensorboard import write_tensorboard

        tb = write_tensorboard(a, args.tensorboard)
        notes.append(f"tensorboard: per-step scalars in {tb} (tensorboard --logdir {tb})")
    if args.html:
        html_path = write_html(run, a, args.html, inputs)
        notes.append(f"html report: {html_path} (one file, opens offline)")
    if not to_stdout:
        print(format_report(a))
        if notes:
            print()
            for n in notes:
                print("\n".join(wrap(n, WIDTH)))
    else:
        for n in notes:
            print(n, file=sys.stderr)
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    from hvtrace.analysis.diff import diff_runs
    from hvtrace.export.diff import diff_to_dict, format_diff

    dirs = [args.run_a, args.run_b]
    analyses, inputs = _analyze_runs(dirs, ["A", "B"], args.json, args.steps, args.skip_steps)
    d = diff_runs(*analyses)
    return _print_or_json(format_diff(d), args.json, lambda: diff_to_dict(d), inputs)


def _analyze_runs(
    dirs: list[str], labels: list[str], json_out: str | None, steps: Any, skip_steps: int
) -> tuple[list[Any], list[Any]]:
    """Analyze each run directory as ``hvtrace analyze`` does (``labels`` name them in the
    progress bars), after checking that ``json_out`` would replace none of their files; return
    the analyses and those files."""
    from hvtrace.analysis import analyze
    from hvtrace.export.output import check_output
    from hvtrace.format.read import find_trace_files
    from hvtrace.load import open_run

    if skip_steps < 0:
        raise TraceError(f"--skip-steps must be >= 0, not {skip_steps}")
    inputs = [f for d in dirs for f in find_trace_files(d)]
    if json_out and json_out != "-":
        check_output(json_out, inputs)
    analyses = []
    for label, run_dir in zip(labels, dirs, strict=True):
        run = open_run(run_dir, progress=_progress(f"opening run {label}"))
        with _RankProgress(f"analyzing run {label}") as progress:
            analyses.append(analyze(run, steps=steps, skip_steps=skip_steps, progress=progress))
    return analyses, inputs


def _print_or_json(
    text: str, json_out: str | None, doc: Callable[[], dict[str, Any]], inputs: list[Any]
) -> int:
    """Print ``text``; with ``json_out`` also write the JSON document ``doc()`` there, never
    over one of ``inputs`` (``-``: the JSON alone, on stdout)."""
    if json_out:
        from hvtrace.export.jsondoc import write_json_doc

        p = write_json_doc(doc(), json_out, inputs)
        if json_out == "-":
            return 0
        text += f"\n\nsummary: {p}"
    print(text)
    return 0


def _add_compare_options(p: argparse.ArgumentParser, runs: str) -> None:
    """The options ``diff`` and ``scaling`` share: ``--skip-steps`` (of ``runs``) and
    ``--json``."""
    p.add_argument(
        "--skip-steps",
        metavar="N",
        type=int,
        default=1,
        help=f"leave steps 0..N-1 (warm-up) out of {runs} (default 1)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write the comparison as JSON ('-': stdout)"
    )


def _cmd_scaling(args: argparse.Namespace) -> int:
    from hvtrace.analysis.scaling import scaling
    from hvtrace.export.scaling import format_scaling, scaling_to_dict

    if len(args.runs) < 2:
        raise TraceError("scaling needs two runs or more (of one job at different world sizes)")
    labels = [str(k) for k in range(1, len(args.runs) + 1)]
    analyses, inputs = _analyze_runs(args.runs, labels, args.json, None, args.skip_steps)
    s = scaling(analyses)
    return _print_or_json(format_scaling(s), args.json, lambda: scaling_to_dict(s), inputs)


def _add_scaling(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scaling",
        help="runs of one job at different world sizes: the efficiency of each and where the "
        "rest went",
        description="Compare runs of one job at different world sizes (for example 1, 2 and 4 "
        "ranks, the same batch per rank): each run's efficiency against the smallest, the time "
        "lost per step in parts that add up (exposed communication, waiting for the last rank, "
        "compute by cause, input, update, other), and the step predicted at twice the largest "
        "size from a per-message latency and bus bandwidth fitted to the runs' allreduces "
        "(a ring's bytes alone where the fit cannot be trusted), with its assumptions. The same "
        "as a page: hvtrace dashboard RUN --scaling RUN...",
    )
    p.add_argument("runs", metavar="RUN", nargs="+", help="run directories (two or more)")
    _add_compare_options(p, "every run")
    p.set_defaults(func=_cmd_scaling)


def _add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="what changed between two runs, and where: step time, phases, causes, "
        "stragglers, tensors, configuration",
        description="Compare run B with run A (the baseline): the change in step time with its "
        "confidence interval, the phases it went to (they add up), why (CPU time, waiting for "
        "a CPU, blocked), stragglers that appeared or went, each tensor's allreduce, and the "
        "configuration each run recorded. Each run is analyzed as by 'hvtrace analyze'.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="the baseline run's directory")
    p.add_argument("run_b", metavar="RUN_B", help="the run to compare with it")
    p.add_argument(
        "--steps",
        metavar="A:B",
        type=_step_range,
        default=None,
        help="compare steps A..B-1 of each run only",
    )
    _add_compare_options(p, "both runs")
    p.set_defaults(func=_cmd_diff)


def _html_writer() -> Any:
    """The HTML report's writer (it draws the dashboard's charts: plotly is needed)."""
    try:
        from hvtrace_dashboard.report_html import write_html_report
    except ImportError as exc:
        raise TraceError(
            f"--html needs Dash and plotly ({exc}); install them with "
            "pip install 'hvtrace[dashboard]'"
        ) from None
    return write_html_report


def _cmd_dashboard(args: argparse.Namespace) -> int:
    try:  # Dash is imported only here, so no other sub-command pays for it
        from hvtrace_dashboard.app import serve
    except ImportError as exc:
        raise TraceError(
            f"the dashboard needs Dash and plotly ({exc}); install them with "
            "pip install 'hvtrace[dashboard]'"
        ) from None
    run_dir, scaling = args.run_dir, args.scaling
    if scaling is not None:  # the runs of a scaling page: RUN_DIR (if given) and the others
        runs = ([run_dir] if run_dir else []) + list(scaling)
        if len(runs) < 2:
            raise TraceError(
                "--scaling needs two runs or more (of one job at different world sizes)"
            )
        run_dir, scaling = runs[0], runs[1:]
    return serve(
        run_dir,
        args.host,
        args.port,
        run_id=args.run_id,
        verbose=args.verbose,
        compare=args.compare,
        scaling=scaling,
    )


def _step_range(text: str) -> StepRange:
    """argparse type of ``--steps``."""
    try:
        return StepRange.parse(text)
    except SelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rank_list(text: str) -> frozenset[int]:
    """argparse type of ``--ranks``."""
    try:
        return parse_ranks(text)
    except SelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _RankProgress:
    """A rich progress bar over ranks on stderr (when it is a terminal); gives a callback."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Callable[[int, int], None] | None:
        if not sys.stderr.isatty():
            return None
        from rich.console import Console
        from rich.progress import Progress

        self._bar = Progress(console=Console(stderr=True), transient=True)
        self._bar.__enter__()
        self._task = self._bar.add_task(self.label, total=None)
        return self._update

    def _update(self, done: int, total: int) -> None:
        self._bar.update(self._task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


def _progress(label: str) -> Callable[[list], object] | None:
    """A rich progress bar over files, on stderr, when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import track

    console = Console(stderr=True)
    return lambda files: track(list(files), description=label, console=console, transient=True)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with every sub-command."""
    p = argparse.ArgumentParser(
        prog="hvtrace", description="Profile Horovod training: record, merge, find the straggler."
    )
    p.add_argument("--version", action="version", version=f"hvtrace {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    _add_run(sub)

    info = sub.add_parser("info", help="show what each rank recorded and where the files are")
    info.add_argument("run_dir", metavar="RUN_DIR", help="directory of rank trace files")
    info.add_argument("--run-id", default=None, help="run to read when the directory holds several")
    info.set_defaults(func=_cmd_info)

    compact = sub.add_parser(
        "compact",
        help="compact a run's leftover .arrows streams (killed ranks) into .parquet files",
        description="Rewrite each .arrows stream of a run as a .parquet file beside it and remove "
        "the stream, as a rank does itself when it closes cleanly. Files of crashed ranks stay "
        "marked as truncated or not closed cleanly.",
    )
    compact.add_argument("run_dir", metavar="RUN_DIR", help="directory of rank trace files")
    compact.add_argument("--run-id", default=None, help="compact only this run's files")
    compact.set_defaults(func=_cmd_compact)
    _add_analyze(sub)
    _add_diff(sub)
    _add_scaling(sub)
    _add_dashboard(sub)
    return p


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="trace a Horovod job without changing it: hvtrace run -- horovodrun -np 4 python ...",
        description="Run COMMAND (horovodrun, mpirun, a Ray or Spark driver: any launcher that "
        "passes the environment on) with tracing on by environment: every Horovod "
        "DistributedOptimizer the job builds (PyTorch, or Lightning's Horovod strategy) is "
        "traced, the script unchanged. Then prints where the run is and the command that "
        "analyzes it; exits with COMMAND's exit code.",
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        default=None,
        help="trace directory (default: hvtrace-runs/YYYYmmdd-HHMMSS)",
    )
    p.add_argument(
        "--horovod-timeline",
        action="store_true",
        help="also record Horovod's own timeline (HVTRACE_HOROVOD_TIMELINE=1)",
    )
    p.add_argument(
        "--live-every",
        metavar="N",
        type=int,
        default=None,
        help="steps per live straggler window at least (HVTRACE_LIVE_EVERY; 0: off)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND...",
        help="the job's command line, after --: horovodrun -np 4 python train.py",
    )
    p.set_defaults(func=_cmd_run)


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="where each step's time goes, communication, and which rank holds the others back",
        description="Analyze a run: per-rank step breakdown, allreduce time and bandwidth, "
        "stragglers and findings. Prints a report; optionally writes JSON, CSV/Parquet tables "
        "and the merged timeline. Runs of any size: each rank's file is reduced on DuckDB "
        "(only the row groups of --steps and the files of --ranks are read), within "
        "--memory-limit.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory of rank trace files")
    p.add_argument(
        "-o",
        "--timeline",
        metavar="PATH",
        default=None,
        help="also write the merged timeline: PATH.pftrace (Perfetto's protobuf format, one "
        "file for a run of any size), or PATH.json / PATH.json.gz (Chrome JSON, also for "
        "chrome://tracing)",
    )
    p.add_argument(
        "--steps",
        metavar="A:B",
        type=_step_range,
        default=None,
        help="analyze steps A..B-1 only (A: to the end, :B from the start)",
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
        help="memory the query engine may use before spilling to disk, e.g. 2GB (default: a "
        "quarter of this machine's memory); it also sizes the groups of spans reduced at once "
        "(limit / 512 bytes, 100 k to 4 M spans; a larger rank is read a window of steps at a "
        "time), which stay within about two thirds of it. Not bounded by it: about 110 MB of "
        "libraries and what the cross-rank pass keeps, about 300 bytes per step and tensor at "
        "its peak (docs/scale.md has the figures)",
    )
    p.add_argument(
        "--dask",
        metavar="ADDRESS",
        default=None,
        help="run the per-rank pass as tasks on a Dask cluster: its scheduler's address "
        "(tcp://HOST:8786; every worker must see RUN_DIR at the same path), or local:N for N "
        "local worker processes (needs pip install 'hvtrace[dask]')",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="write the summary as JSON ('-': stdout)"
    )
    p.add_argument(
        "--html",
        metavar="PATH",
        default=None,
        help="write the report as one self-contained HTML file (tables, heat maps, charts and a "
        "timeline around the slowest step; opens from disk, no server, no network)",
    )
    p.add_argument(
        "--csv", metavar="DIR", default=None, help="write spans and per-step tables as CSV"
    )
    p.add_argument(
        "--parquet", metavar="DIR", default=None, help="write spans and per-step tables as Parquet"
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write per-step scalars (step time, the late rank and its lateness, exposed "
        "allreduce, comm/compute, hidden share) as TensorBoard events into DIR (needs pip "
        "install 'hvtrace[tensorboard]')",
    )
    p.add_argument(
        "--skip-steps",
        metavar="N",
        type=int,
        default=1,
        help="leave steps 0..N-1 (warm-up) out of medians and verdicts (default 1)",
    )
    p.add_argument(
        "--horovod-timeline",
        metavar="FILE",
        default=None,
        help="Horovod timeline (HOROVOD_TIMELINE) to merge (default: the run directory's own)",
    )
    p.add_argument("--run-id", default=None, help="run to read when the directory holds several")
    p.set_defaults(func=_cmd_analyze)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve a web page to explore a run: heat map, timeline, stragglers (or two runs "
        "compared, or runs at several world sizes)",
        description="Serve a Dash page for one run, for two runs compared (--compare) or for "
        "runs of one job at several world sizes (--scaling), bound to 127.0.0.1 unless --host "
        "is given.",
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
    other = p.add_mutually_exclusive_group()
    other.add_argument(
        "--compare",
        metavar="RUN_B",
        default=None,
        help="serve RUN_DIR (A) and RUN_B side by side: what changed and where (as hvtrace diff)",
    )
    other.add_argument(
        "--scaling",
        metavar="RUN",
        nargs="+",
        default=None,
        help="serve RUN_DIR and these runs of the same job at other world sizes as one page: "
        "the efficiency curve with the next size's prediction, and the time lost in parts that "
        "add up (as hvtrace scaling)",
    )
    p.set_defaults(func=_cmd_dashboard)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hvtrace`` command line; return the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="hvtrace: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # the commands print the loader's problems in their own output
        logging.getLogger("hvtrace.load").setLevel(logging.ERROR)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a full or closed stdout fails here, not at exit
        return rc
    except TraceError as exc:
        print(f"hvtrace: error: {printable(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hvtrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # the output side: standard output on a full device, say
        if exc.filename is None:
            print(
                f"hvtrace: error: cannot write the output ({exc.strerror or exc})", file=sys.stderr
            )
            with contextlib.suppress(OSError):  # nothing more can reach a failed stdout
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaced for exit only
            return 2
        log.debug("internal error", exc_info=True)
        print(f"hvtrace: error: {exc.filename}: {printable(exc.strerror or exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        log.debug("internal error", exc_info=True)
        print(
            f"hvtrace: internal error: {type(exc).__name__}: {printable(exc)} "
            "(run with -v for details; please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
