"""What the writer thread spends per step turning a rank's buffer into a record batch.

    .venv/bin/python bench/writer_cost.py [--tensors 14,152] [--steps 200] [--reps 7]

The training thread hands the writer, per step, its phase rows (tuples with counter readings)
and one unexpanded entry per ``synchronize()`` holding its allreduces
(:class:`hvtrace.record.rows.Allreduces`). The writer thread's CPU is part of what hvtrace costs
a rank (``bench/overhead.py`` reports it per step), on a core the job may need. Two ways of
encoding the same entries, side by side in one process, best of ``--reps``:

- ``tuples``: :func:`hvtrace.record.rows.expand` makes one tuple per allreduced tensor, and the
  encoder transposes the tuples into columns (what the CUDA path did until its tokens were
  resolved per entry, 2026-11-28);
- ``columns``: the encoder takes the allreduces as they are and builds their columns directly,
  reusing the last synchronize's tensor columns (names, bytes, dtypes) when its tensors are the
  same, in Python around compiled parts (``rows_into``, ``syncs_into``: what every rank did
  until 29 Nov 2026, and does where a batch's synchronizes are not the last one's);
- ``one pass``: the same columns in one pass of C over the whole batch
  (``_hot.entries_into``), what an encoder that has seen the model's synchronize does (every
  flush after a rank's first); where the compiled hot path is not built, it is not timed.

The ``columns`` and ``one pass`` encoders have encoded the batch once before they are timed
(as a rank's writer has, from its second flush on). The batches are compared column by column
before any figure is printed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import pyarrow as pa

from hvtrace.format.schema import KIND_CODE
from hvtrace.record.native import hot_module
from hvtrace.record.rows import Allreduces, expand
from hvtrace.record.writer import BatchEncoder

PHASES = ("input", "forward", "backward", "wait", "update", "step")


def entries_of(tensors: int, steps: int) -> list:
    """A buffer's entries for ``steps`` steps of a model with ``tensors`` gradient tensors."""
    names = [f"layer.{i}.weight" for i in range(tensors)]
    meta = {k: ([names[k]], [4096], [1]) for k in range(tensors)}
    out: list = []
    for s in range(steps):
        t = 10**12 + s * 10**7
        for p, kind in enumerate(PHASES):
            r0, r1 = (1000 + p, b"1 2 3\n"), (1100 + p, b"1 5 3\n")
            out.append((s, 0, KIND_CODE[kind], kind, t + p, t + p + 100, 0, 0, math.nan, 0, r0, r1))
        enq = [(t + 10 + k, k, (k + 1, None)) for k in range(tensors)]
        done = [(k + 1, t + 500 + k) for k in range(tensors)]
        out.append(Allreduces(s, 0, 2, enq, done, t + 9999, meta))
    return out


def check_same(a: pa.RecordBatch, b: pa.RecordBatch) -> None:
    """The two batches hold the same rows (names as strings, NaN equal to NaN)."""
    if a.num_rows != b.num_rows:
        raise SystemExit(f"row counts differ: {a.num_rows} vs {b.num_rows}")
    for name in a.schema.names:
        x, y = a.column(name), b.column(name)
        if pa.types.is_dictionary(x.type):
            x, y = x.cast(x.type.value_type), y.cast(y.type.value_type)
        nx, ny = x.to_numpy(zero_copy_only=False), y.to_numpy(zero_copy_only=False)
        same = np.array_equal(nx, ny, equal_nan=True) if name == "value" else x.equals(y)
        if not same:
            raise SystemExit(f"column {name} differs between the two encodings")


def main(argv: list[str] | None = None) -> int:
    """Time the encodings per model size and print µs per step."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="14,152", help="gradient tensors, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="steps per batch (a flush's worth)")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    one_pass = hasattr(hot_module(), "entries_into")
    print("| tensors | tuples µs/step | columns µs/step | one pass µs/step | tuples / one pass |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for tensors in (int(t) for t in args.tensors.split(",")):
        entries = entries_of(tensors, args.steps)
        ways = ["tuples", "columns", *(["one pass"] if one_pass else [])]
        best = dict.fromkeys(ways, math.inf)
        batches = {}
        for _ in range(args.reps):
            for way in ways:
                enc = BatchEncoder()
                if way == "columns":  # the Python form around its compiled parts
                    enc._compiled_columns = lambda entries: None
                if way != "tuples":  # a rank's writer after its first flush
                    enc.encode(entries)
                t0 = time.perf_counter()
                b = enc.encode(expand(entries, []) if way == "tuples" else entries)
                best[way] = min(best[way], time.perf_counter() - t0)
                batches[way] = b
        for way in ways[1:]:
            check_same(batches["tuples"], batches[way])
        us = {w: 1e6 * best[w] / args.steps for w in ways}
        last = us.get("one pass", us["columns"])
        cells = " | ".join(f"{us[w]:.1f}" if w in us else "—" for w in
                           ("tuples", "columns", "one pass"))  # fmt: skip
        print(f"| {tensors} | {cells} | {us['tuples'] / last:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
