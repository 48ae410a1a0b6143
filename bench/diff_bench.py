"""`hvtrace diff` of two runs timed beside `hvtrace analyze` of one (issue 36: no more than twice).

Two synthetic runs of the same shape (``bench/synth_run.py``, written by hvtrace's own writer):
A with one rank slowed in its forward, B with another rank slowed in its backward. Each command
runs in a fresh child (``analyze_bench.measure``: wall time, peak memory), side by side in one
invocation, ``--rounds`` times alternating; printed: the medians, their ratio against the goal
(2), and what the diff named (the straggler that went and the one that came must be named).

    python bench/diff_bench.py --ranks 128 --steps 1500 --tensors 96      # two 20 M-span runs
    python bench/diff_bench.py --ranks 8 --steps 200 --tensors 16         # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analyze_bench import measure
from synth_run import write_synth_run


def _write(run_dir: Path, params: dict, **kw) -> None:
    """Write the run unless ``run_dir`` already holds one of these parameters."""
    marker = run_dir / ".synth-params.json"
    want = {**params, **kw}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    t = time.perf_counter()
    n = write_synth_run(run_dir, **want)
    marker.write_text(json.dumps(want))
    print(f"wrote {run_dir.name}: {n:,} spans in {time.perf_counter() - t:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=128)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="write (or reuse) the two runs here")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hvtrace-diff-"))
    try:
        root = Path(args.dir) if args.dir else tmp
        shape = {"ranks": args.ranks, "steps": args.steps, "tensors": args.tensors}
        slow_a, slow_b = args.ranks // 3, 2 * args.ranks // 3
        run_a, run_b = root / "run_a", root / "run_b"
        _write(run_a, shape, slow_rank=slow_a, slow_phase="forward", seed=0)
        _write(run_b, shape, slow_rank=slow_b, slow_phase="backward", seed=1)
        spans = args.ranks * args.steps * (args.tensors + 7)
        print(f"two runs of {args.ranks} ranks x {args.steps} steps x {args.tensors} tensors = "
              f"{spans:,} spans each; A slows rank {slow_a} (forward), B rank {slow_b} "
              "(backward)", flush=True)  # fmt: skip
        hv = [sys.executable, "-m", "hvtrace.cli"]
        cases = {
            "analyze A": [*hv, "analyze", str(run_a), "--json", str(tmp / "a.json")],
            "diff A B": [*hv, "diff", str(run_a), str(run_b), "--json", str(tmp / "d.json")],
        }
        got: dict[str, list[dict]] = {k: [] for k in cases}
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for name in order:
                m = measure(cases[name])
                if m["rc"] != 0:
                    print(f"{name} failed: {m['stderr']}", file=sys.stderr)
                    return 1
                got[name].append(m)
                print(f"round {r + 1}: {name}: {m['wall_s']:.1f} s, {m['peak_mb']:.0f} MB",
                      flush=True)  # fmt: skip
        wall = {k: statistics.median(m["wall_s"] for m in v) for k, v in got.items()}
        peak = {k: max(m["peak_mb"] for m in v) for k, v in got.items()}
        ratio = wall["diff A B"] / wall["analyze A"]
        d = json.loads((tmp / "d.json").read_text())
        named = {(s["rank"], s["status"]) for s in d["stragglers"]}
        right = named == {(slow_a, "gone"), (slow_b, "new")}
        print(f"\n| command | wall s (median of {args.rounds}) | peak MB |\n|---|---|---|")
        for k in cases:
            print(f"| `hvtrace {k}` | {wall[k]:.1f} | {peak[k]:.0f} |")
        print(f"\ndiff / analyze: {ratio:.2f} (goal <= 2: {'met' if ratio <= 2 else 'NOT met'}); "
              f"stragglers named: {sorted(named)} ({'right' if right else 'WRONG'}); "
              f"step change {d['step']['delta_ms']:+.2f} ms, significant "
              f"{d['step']['significant']}")  # fmt: skip
        if args.json:
            Path(args.json).write_text(
                json.dumps({"wall_s": wall, "peak_mb": peak, "ratio": ratio, "named": right})
            )
        return 0 if right else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
