"""`hvtrace analyze` on a large run: 64 ranks x 1,500 steps x ~104 spans (about 10 million spans).

The run is synthetic but written by hvtrace's own writer (``TraceFile``, via
``bench/dashboard_bench.py``'s ``write_run``: consistent clocks, allreduces that complete when the
last rank arrives, one slowed rank). Then, in a fresh child process each:

- the whole command ``hvtrace analyze RUN --json report.json`` (load, analysis, report, JSON):
  wall time and peak resident memory (goal: <= 20 s and <= 3 GB on this 2-core machine);
- the stages one by one (load_run, analyze, report, Parquet tables, Chrome timeline export), with
  spans per second for each;
- side by side: reading the same kind of spans as a Chrome JSON trace with ``json.loads`` (how trace
  analyzers commonly load), measured on a 1,000,000-span slice (a 10M-span JSON file would be
  about 1.6 GB), as spans per second.

    python bench/analyze_bench.py                      # about 3-5 minutes, most of it writing
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dashboard_bench import write_run

STAGES = r"""
import json, resource, sys, time
from pathlib import Path
run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
res = {}
t = time.perf_counter()
from hvtrace.load import load_run
run = load_run(run_dir)
res["spans"] = len(run.spans)
res["load_run"] = time.perf_counter() - t
t = time.perf_counter()
from hvtrace.analysis import analyze
a = analyze(run)
res["analyze"] = time.perf_counter() - t
t = time.perf_counter()
from hvtrace.export.report import format_report, write_json, write_tables
text = format_report(a)
write_json(a, out / "report.json")
res["report + JSON"] = time.perf_counter() - t
t = time.perf_counter()
write_tables(a, out / "tables", "parquet", run.spans)
res["Parquet tables"] = time.perf_counter() - t
res["stragglers"] = a.stragglers["rank"].tolist()
res["peak_rss_mb_before_chrome"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
from hvtrace.export.chrome import write_chrome_trace
parts = write_chrome_trace(run, out / "timeline.json.gz", steps_df=a.steps)
res["Chrome timeline (.json.gz)"] = time.perf_counter() - t
res["chrome_parts"] = len(parts)
res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(res))
"""

JSON_SLICE = r"""
import json, sys, time
from hvtrace.load import load_run
from hvtrace.export.chrome import write_chrome_trace
run = load_run(sys.argv[1])
df = run.spans
df = df[df["step"] < int(sys.argv[3])]
path = sys.argv[2]
write_chrome_trace(df, path, hosts=run.hosts, max_events=50_000_000, max_bytes=1 << 40)
import os
size = os.path.getsize(path)
t = time.perf_counter()
with open(path, "rb") as f:
    data = json.loads(f.read())
dt = time.perf_counter() - t
events = sum(1 for e in data["traceEvents"] if e.get("ph") == "X")
print(json.dumps({"spans": len(df), "x_events": events, "bytes": size, "json_loads_s": dt}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--dir", default=None, help="keep the run here (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvtrace-analyze-") as tmp:
        run_dir = Path(args.dir) if args.dir else Path(tmp) / "run"
        out = Path(tmp) / "out"
        out.mkdir()
        t = time.perf_counter()
        print(
            f"writing {args.ranks} ranks x {args.steps} steps x {args.tensors} tensors ...",
            flush=True,
        )
        write_run(
            run_dir,
            ranks=args.ranks,
            steps=args.steps,
            tensors=args.tensors,
            slow_rank=5,
            slow_ms=30.0,
            ranks_per_host=8,
        )
        print(f"  written in {time.perf_counter() - t:.0f} s", flush=True)
        hv = Path(sys.executable).parent / "hvtrace"
        t = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        done = subprocess.run(
            [str(hv), "analyze", str(run_dir), "--json", str(out / "r.json")],
            capture_output=True,
            text=True,
        )
        whole_s = time.perf_counter() - t
        whole_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if done.returncode != 0:
            print(done.stderr[-2000:])
            return 1
        stages = json.loads(
            subprocess.run(
                [sys.executable, "-c", STAGES, str(run_dir), str(out)],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        per_step = stages["spans"] / (args.ranks * args.steps)
        slice_steps = max(1, int(1_000_000 / (args.ranks * per_step)))
        js = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    JSON_SLICE,
                    str(run_dir),
                    str(out / "slice.json"),
                    str(slice_steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()[-1]
        )
    n = stages["spans"]
    print(f"\nrun: {args.ranks} ranks x {args.steps} steps, {n:,} spans")
    print(f"{'stage':<28} {'seconds':>8} {'spans/s':>12}")
    for k in (
        "load_run",
        "analyze",
        "report + JSON",
        "Parquet tables",
        "Chrome timeline (.json.gz)",
    ):
        print(f"{k:<28} {stages[k]:>8.2f} {n / stages[k]:>12,.0f}")
    print(
        f"{'json.loads of Chrome JSON':<28} {js['json_loads_s']:>8.2f} "
        f"{js['spans'] / js['json_loads_s']:>12,.0f}   (on {js['spans']:,} spans, "
        f"{js['bytes'] / js['spans']:.0f} B/span)"
    )
    print(
        f"\nwhole `hvtrace analyze RUN --json`: {whole_s:.1f} s, peak RSS "
        f"{max(whole_rss, before) / 1024 / 1024:.2f} GB  (goal: <= 20 s and <= 3 GB) -> "
        f"{'met' if whole_s <= 20 and whole_rss / 1024 / 1024 <= 3 else 'NOT met'}"
    )
    print(
        f"stages process peak RSS: {stages['peak_rss_mb_before_chrome'] / 1024:.2f} GB before "
        f"the Chrome export, {stages['peak_rss_mb'] / 1024:.2f} GB after it "
        f"({stages['chrome_parts']} part files)"
    )
    print(f"stragglers named: {stages['stragglers']} (rank 5 was slowed)")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"stages": stages, "json_slice": js, "whole_s": whole_s}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
