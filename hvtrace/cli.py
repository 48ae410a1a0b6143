"""The ``hvtrace`` command: ``info``, ``analyze`` and ``dashboard`` sub-commands.

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
