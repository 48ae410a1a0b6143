"""Write ``tests/unit/slow_tests.txt``: the unit tests that ``make unit`` (the quick loop) leaves
out, from a measured run.

    .venv/bin/python -m pytest tests/unit -n 2 --timing-tests=skip --durations=0 > unit.log
    .venv/bin/python -m pytest tests/unit --timing-tests=only --durations=0 >> unit.log
    .venv/bin/python scripts/slow_tests.py unit.log [--min-s 1.0]

A test is slow when its setup, call and teardown took ``--min-s`` seconds or more together, all of
its parametrizations summed (they are listed, and left out, together). ``make test`` runs every
test; ``pytest --quick`` (``make unit``) deselects the listed ones (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "unit" / "slow_tests.txt"
#: A line of pytest's ``--durations`` table: seconds, phase, node id.
LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(tests/unit/\S+)$")


def durations(text: str) -> dict[str, float]:
    """Seconds per test (``path::name``, parametrizations summed) in a ``--durations`` log."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if m:
            test = m.group(2).split("[", 1)[0]
            out[test] = out.get(test, 0.0) + float(m.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="pytest output with --durations=0")
    p.add_argument("--min-s", type=float, default=1.0, help="slow from this many seconds")
    p.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    args = p.parse_args(argv)
    try:
        seconds = durations(args.log.read_text(errors="replace"))
    except OSError as exc:
        print(f"slow_tests: {args.log}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not seconds:
        print(f"slow_tests: {args.log}: no --durations lines of tests/unit", file=sys.stderr)
        return 2
    slow = sorted(t for t, s in seconds.items() if s >= args.min_s)
    total = sum(seconds.values())
    kept = total - sum(seconds[t] for t in slow)
    head = [
        "# The unit tests that `make unit` (pytest --quick) leaves out; `make test` runs them.",
        f"# Written by scripts/slow_tests.py --min-s {args.min_s:g} from a --durations=0 run:",
        f"# {len(slow)} of {len(seconds)} tests, {total - kept:.0f} of {total:.0f} s of test time.",
    ]
    args.out.write_text("\n".join([*head, *slow]) + "\n")
    print(f"{args.out}: {len(slow)} slow tests ({total - kept:.0f} s); "
          f"{len(seconds) - len(slow)} kept ({kept:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
