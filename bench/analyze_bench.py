"""`hvtrace analyze` on a run of any size, whole and in a `--steps` window.

The run is synthetic but written by hvtrace's own writer and closed as a clean close would
(``bench/synth_run.py``: Parquet files, consistent clocks, allreduces that complete when the last
rank arrives, one slowed rank). Then, each in a fresh child process, side by side in one
invocation:

- ``engine``: the whole command ``hvtrace analyze RUN --json report.json`` (open, per-rank pass
  on DuckDB, cross-rank pass, report, JSON);
- ``engine --steps``: the same with a ``--steps`` window of ``--window`` (100) steps;
- ``dask local:2`` (``--dask``; ``--dask ''`` leaves it out): the whole command on a Dask
  LocalCluster of 2 worker processes (``hvtrace analyze RUN --dask local:2``), the same
  per-rank pass as tasks. Its memory is the client's and the workers' (their peaks summed).

(Until the analysis ran on the engine only, a third case ran the old whole-frame path beside
these: ``load_run`` into one DataFrame + the pandas/numpy analysis. Its figures, measured side by
side at 20 M spans, are in the README.)

For each: wall time, peak resident memory (``peak MB``: the largest process, from
``getrusage``; ``client MB`` / ``workers MB``: sampled every 20 ms from /proc, the analyzing
process and the sum of its worker processes' peaks), spans per second, and the straggler it named
with its phase (the slowed rank must be named). Goals (``--goal-s``, ``--goal-mb``) are
printed next to the figures.

    python bench/analyze_bench.py --ranks 128 --steps 1500 --tensors 96        # 20 M spans
    python bench/analyze_bench.py --ranks 512 --steps 4000 --tensors 96 \\
        --goal-s 180 --goal-mb 3072                                          # 200 M spans

``--memory-limits LIST`` runs instead the whole command at each ``--memory-limit`` of LIST
(``default``: none given) and prints the spans per group the engine cut the run into beside the
peak RSS: what the limit bounds, measured (docs/scale.md quotes it).

    python bench/analyze_bench.py --ranks 1 --steps 37000 --tensors 96 \\
        --memory-limits 64MiB,256MiB,1GiB,default                           # 3.8 M spans, 1 rank
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth_run import write_synth_run

#: Runs ``argv`` in a child and prints its wall time and peak RSS (this wrapper's children only);
#: a sampler thread follows the child's process tree: its own RSS and its descendants' peaks.
MEASURE = r"""
import json, resource, subprocess, sys, threading, time
import psutil
t = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
root, peaks, stop = psutil.Process(p.pid), {}, threading.Event()
def sample():
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for q in procs:
            try:
                peaks[q.pid] = max(peaks.get(q.pid, 0), q.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.02)
th = threading.Thread(target=sample, daemon=True)
th.start()
out, err = p.communicate()
dt = time.perf_counter() - t
stop.set()
th.join()
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
client = peaks.pop(p.pid, 0) / 2**20
print(json.dumps({"rc": p.returncode, "wall_s": dt, "peak_mb": rss, "client_mb": client,
                  "workers_mb": sum(peaks.values()) / 2**20, "stderr": err[-2000:]}))
"""


def measure(argv: list[str]) -> dict:
    """Run ``argv`` in a fresh child; return rc, wall_s, peak_mb."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def named(report_json: Path) -> str:
    """``rank (phase)`` of each straggler in a JSON report."""
    try:
        data = json.loads(report_json.read_text())
    except (OSError, ValueError):
        return "?"
    s = [f"{d['rank']} ({d['phase']})" for d in data.get("stragglers", [])]
    return ", ".join(s) or "none"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=128)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--slow-rank", type=int, default=None, help="default: ranks // 3")
    p.add_argument("--slow-phase", default="forward")
    p.add_argument("--window", type=int, default=100, help="steps in the --steps window")
    p.add_argument("--dir", default=None, help="write (or reuse) the run here")
    p.add_argument("--goal-s", type=float, default=10.0)
    p.add_argument("--goal-mb", type=float, default=1536.0)
    p.add_argument("--goal-window-s", type=float, default=5.0)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--dask", default="local:2", help="the Dask case's --dask ('': none)")
    p.add_argument(
        "--memory-limits",
        default=None,
        metavar="LIST",
        help="instead of the cases above: the whole command at each --memory-limit of LIST "
        "(comma-separated sizes; 'default' for none given), its peak RSS beside the limit",
    )
    args = p.parse_args(argv)
    slow = args.ranks // 3 if args.slow_rank is None else args.slow_rank
    tmp = Path(tempfile.mkdtemp(prefix="hvtrace-analyze-"))
    try:
        run_dir = Path(args.dir) if args.dir else tmp / "run"
        marker = run_dir / ".synth-params.json"
        params = {k: getattr(args, k) for k in ("ranks", "steps", "tensors", "slow_phase")}
        params["slow_rank"] = slow
        if not (marker.exists() and json.loads(marker.read_text()) == params):
            if run_dir.exists() and args.dir:
                shutil.rmtree(run_dir)
            t = time.perf_counter()
            n = write_synth_run(
                run_dir, args.ranks, args.steps, args.tensors, slow, slow_phase=args.slow_phase
            )
            marker.write_text(json.dumps(params))
            print(f"wrote {n:,} spans in {time.perf_counter() - t:.1f} s", flush=True)
        spans = args.ranks * args.steps * (args.tensors + 7)
        size = sum(f.stat().st_size for f in run_dir.iterdir() if f.suffix == ".parquet")
        print(
            f"run: {args.ranks} ranks x {args.steps} steps x {args.tensors} tensors = {spans:,} "
            f"spans, {size / 1e6:.0f} MB Parquet; slowed: rank {slow} ({args.slow_phase})",
            flush=True,
        )
        hv = [sys.executable, "-m", "hvtrace.cli", "analyze", str(run_dir)]
        if args.memory_limits:
            return _memory_limits(args, hv, tmp, spans, params)
        lo = max(1, args.steps // 2)
        cases = [
            ("engine", [*hv, "--json", str(tmp / "engine.json")], tmp / "engine.json", spans),
            (
                f"engine --steps {lo}:{lo + args.window}",
                [*hv, "--steps", f"{lo}:{lo + args.window}", "--json", str(tmp / "window.json")],
                tmp / "window.json",
                args.ranks * min(args.window, args.steps - lo) * (args.tensors + 7),
            ),
        ]
        if args.dask:
            cases.append(
                (
                    f"dask {args.dask}",
                    [*hv, "--dask", args.dask, "--json", str(tmp / "dask.json")],
                    tmp / "dask.json",
                    spans,
                )
            )
        rows = []
        for label, cmd, out, n in cases:
            print(f"running {label} ...", file=sys.stderr, flush=True)
            m = measure(cmd)
            if m["rc"] != 0:
                print(f"{label}: exit {m['rc']}: {m['stderr']}", file=sys.stderr)
            rows.append({"case": label, "spans": n, **m, "named": named(out)})
        print()
        print(
            f"{'case':<28} {'wall s':>8} {'peak MB':>8} {'client MB':>9} {'workers MB':>10} "
            f"{'M spans/s':>10}  stragglers named"
        )
        print(f"{'-' * 28} {'-' * 8} {'-' * 8} {'-' * 9} {'-' * 10} {'-' * 10}  {'-' * 24}")
        for r in rows:
            rate = r["spans"] / r["wall_s"] / 1e6 if r["wall_s"] > 0 else float("nan")
            print(
                f"{r['case']:<28} {r['wall_s']:8.2f} {r['peak_mb']:8.0f} {r['client_mb']:9.0f} "
                f"{r['workers_mb']:10.0f} {rate:10.2f}  {r['named']}"
            )
        eng, win = rows[0], rows[1]
        want = f"{slow} ({args.slow_phase})"

        def goal(text: str, ok: bool) -> None:
            print(f"  goal: {text:<52} {'ok' if ok else 'MISSED'}")

        print()
        goal(f"engine <= {args.goal_s:g} s", eng["wall_s"] <= args.goal_s)
        goal(f"engine peak <= {args.goal_mb:g} MB", eng["peak_mb"] <= args.goal_mb)
        goal(f"--steps window <= {args.goal_window_s:g} s", win["wall_s"] <= args.goal_window_s)
        goal(f"slowed rank named with its phase: {want}", eng["named"] == want)
        if args.dask:
            dk = rows[2]
            goal(f"dask names the same: {want}", dk["named"] == want)
            print(
                f"  dask / local: {dk['wall_s'] / eng['wall_s']:.2f}x the time; client "
                f"{dk['client_mb']:.0f} MB + workers {dk['workers_mb']:.0f} MB vs "
                f"{eng['client_mb']:.0f} MB"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"params": params, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _memory_limits(
    args: argparse.Namespace, hv: list[str], tmp: Path, spans: int, params: dict
) -> int:
    """The whole command at each limit of ``--memory-limits``: wall time and peak RSS (the
    analyzing process: its ``getrusage`` peak), and the groups the engine cut the spans into."""
    from hvtrace.analysis.engine import GROUP_SPANS, group_spans, parse_size

    rows = []
    for limit in (x.strip() for x in args.memory_limits.split(",") if x.strip()):
        out = tmp / f"limit-{limit}.json"
        cmd = [*hv, "--json", str(out)]
        if limit != "default":
            cmd += ["--memory-limit", limit]
        print(f"running --memory-limit {limit} ...", file=sys.stderr, flush=True)
        m = measure(cmd)
        if m["rc"] != 0:
            print(f"{limit}: exit {m['rc']}: {m['stderr']}", file=sys.stderr)
        per_group = group_spans(None if limit == "default" else parse_size(limit))
        rows.append({"limit": limit, "group_spans": per_group, **m, "named": named(out)})
    print()
    print(f"{'--memory-limit':<15} {'group spans':>12} {'wall s':>8} {'peak MB':>8}  stragglers")
    print(f"{'-' * 15} {'-' * 12} {'-' * 8} {'-' * 8}  {'-' * 10}")
    for r in rows:
        print(
            f"{r['limit']:<15} {r['group_spans']:>12,} {r['wall_s']:8.2f} {r['peak_mb']:8.0f}  "
            f"{r['named']}"
        )
    print(f"\n({spans:,} spans; a group holds at most {GROUP_SPANS:,} spans)")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": params, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
