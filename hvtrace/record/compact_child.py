"""``python -m hvtrace.record.compact_child PATH``: compact one closed ``.arrows`` stream into
Parquet and print what was done as one JSON object (see
:func:`hvtrace.record.writer.compact_in_child`, which runs it when a rank closes its file)."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    """Compact ``argv[0]`` (a stream its rank has closed); print the result's fields as JSON."""
    from hvtrace.format.compact import compact

    res = compact(argv[0], live_check=False)
    fields = {k: v for k, v in vars(res).items() if k != "source"}
    fields["target"] = str(fields["target"])
    sys.stdout.write(json.dumps(fields))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
