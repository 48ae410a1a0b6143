"""What rank 0's live judge costs a window, side by side with another checkout of hvtrace.

    .venv/bin/python bench/judge_cost.py [--against DIR] [--rounds 6] [--shapes 100x2,350x2,2000x16]

The judge (:mod:`hvtrace.analysis.live`, a child process of rank 0 at the lowest CPU priority)
takes each window's gathered step matrices and decides its verdicts as the offline analysis
does (:func:`hvtrace.analysis.live.verdicts`). Its CPU per window is what live detection costs
the host beyond the training processes: at windows of 5 s (``HVTRACE_LIVE_S``), 50 ms a window
is 1 % of one core.

Windows are built like a real rank's (``bench/live_cost.py``'s rows of a 14-tensor model, one
rank 20 ms slow in its forward, so the judge names someone; shape ``STEPSxRANKS``). Each round
runs one child process per tree (this checkout, and ``--against`` where given: a ``git
worktree`` of an older commit, say), in alternating order, each timing ``verdicts()`` on every
shape (the median of ``--calls`` calls after one warm-up, CPU time of the process). Printed: per
shape and tree the median over rounds, and the ratio of the two trees per round (median and
range), so a change is read side by side, on this noisy machine, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CHILD = r"""
import json, sys, time
import numpy as np
from hvtrace.analysis import live
data = np.load(sys.argv[1])
calls = int(sys.argv[2])
out = {}
for key in data.files:
    g = data[key]
    size = int(key.split("x")[1])
    hosts = {r: "h" for r in range(size)}
    named = [v.get("rank") for v in live.verdicts(g, size, hosts)]  # warm-up
    ts = []
    for _ in range(calls):
        t0 = time.process_time()
        live.verdicts(g, size, hosts)
        ts.append(time.process_time() - t0)
    ts.sort()
    out[key] = {"ms": 1e3 * ts[len(ts) // 2], "named": named}
print(json.dumps(out))
"""


def windows(shapes: list[str]) -> dict[str, np.ndarray]:
    """The gathered window of each ``STEPSxRANKS`` shape, rank 1 slow in its forward."""
    sys.path.insert(0, str(HERE))
    from live_cost import MS, rank_rows, slow_window

    from hvtrace.record import live

    out = {}
    for shape in shapes:
        n, size = (int(x) for x in shape.split("x"))
        m = live.step_matrix([rank_rows(s, s * 40 * MS) for s in range(n)], 0)
        out[shape] = slow_window(m, size)
    return out


def run_child(tree: Path, path: str, calls: int) -> dict:
    """One child process on ``tree``'s hvtrace: its figures per shape."""
    env = dict(os.environ, PYTHONPATH=str(tree), HVTRACE="0")
    res = subprocess.run(
        [sys.executable, "-c", CHILD, path, str(calls)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tree,
    )  # fmt: skip
    if res.returncode:
        raise SystemExit(f"judge_cost: the child on {tree} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, help="another checkout of hvtrace to compare with")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=9, help="calls timed per shape and child")
    p.add_argument("--shapes", default="100x2,350x2,2000x16", help="STEPSxRANKS, comma-separated")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    trees = {"this": ROOT}
    if args.against:
        trees["against"] = args.against.resolve()
    figs: dict[str, dict[str, list[float]]] = {t: {s: [] for s in shapes} for t in trees}
    named: dict[str, dict[str, list]] = {t: {} for t in trees}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "windows.npz")
        np.savez(path, **windows(shapes))
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for t in order:
                got = run_child(trees[t], path, args.calls)
                for s in shapes:
                    figs[t][s].append(got[s]["ms"])
                    named[t][s] = got[s]["named"]
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"the live judge's CPU per window (median of {args.calls} calls; rounds: {args.rounds})")
    head = "| window (steps x ranks) | " + " | ".join(f"{t} ms" for t in trees)
    head += " | ratio this/against (median, range) |" if "against" in trees else " |"
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    for s in shapes:
        row = f"| {s} | " + " | ".join(f"{statistics.median(figs[t][s]):.1f}" for t in trees)
        if "against" in trees:
            ratios = [a / b for a, b in zip(figs["this"][s], figs["against"][s], strict=True)]
            row += f" | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        else:
            row += " |"
        print(row)
    for s in shapes:
        if "against" in trees and named["this"][s] != named["against"][s]:
            print(f"NOTE: {s}: the trees name {named['this'][s]} and {named['against'][s]}")
        else:
            print(f"{s}: named {named['this'][s]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
