"""The ``hvtrace`` command: ``info``, ``compact``, ``analyze`` and ``dashboard`` sub-commands.

``main(argv)`` returns the exit code (0 ok, 2 unusable input) so tests can call it directly.
Errors in the input are printed as one line on stderr, never as a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from hvtrace import __version__
from hvtrace.load import TraceError

log = logging.getLogger("hvtrace")

Command = Callable[[argparse.Namespace], int]


def _cmd_info(args: argparse.Namespace) -> int:
    from hvtrace.export.info import format_info
    from hvtrace.load import load_run

    run = load_run(args.run_dir, run_id=args.run_id)
    print(format_info(run))
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    from hvtrace.record.writer import compact_run

    results = compact_run(args.run_dir, run_id=args.run_id, progress=_progress("compacting"))
    if not results:
        print(f"{args.run_dir}: nothing to compact (no .arrows files; closed files are .parquet)")
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
            print(
                f"{r.source} -> {r.target.name}: {verb}, {r.spans:,} spans, "
                f"{r.bytes_before:,} -> {r.bytes_after:,} bytes{state}"
            )
        else:
            print(f"{r.source}: left as is: {r.reason}")
    ratio = f" ({after / before:.0%} of the size)" if before else ""
    print(
        f"total: {done} of {len(results)} file(s) compacted, {spans:,} spans, "
        f"{before:,} -> {after:,} bytes{ratio}"
    )
    return 0


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
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    _add_optional_commands(sub)
    return p


def _add_optional_commands(sub: argparse._SubParsersAction) -> None:
    """Register the sub-commands that live in their own modules (imported lazily when run)."""
    from hvtrace.export import commands

    commands.register(sub)


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
        return int(args.func(args) or 0)
    except TraceError as exc:
        print(f"hvtrace: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hvtrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:
        log.debug("internal error", exc_info=True)
        print(
            f"hvtrace: internal error: {type(exc).__name__}: {exc} (run with -v for details; "
            "please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
