"""Timeline export benchmark: Perfetto protobuf (``.pftrace``) beside Chrome JSON, one run.

    python bench/export_bench.py                       # 10,000,000 spans (16 ranks, 16 tensors)
    python bench/export_bench.py --spans 1000000 --json export.json
    python bench/export_bench.py --run-dir runs/big --no-chrome   # reuse (or keep) the run

Writes a synthetic run of about ``--spans`` spans with :func:`bench.synth_run.write_synth_run`
(closed, compacted Parquet files, as a clean run leaves them), analyzes it once (the exports
render the analysis's per-step table), then runs each export in its own child process, so that
each peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of the child: the interpreter,
opening the run and the export) is its own. Prints, side by side: export wall time and CPU time
(the export call alone, after ``open_run``; ``open s`` is opening the run's files),
file size (all parts for Chrome JSON), bytes per span and peak RSS, with the goals for the
Perfetto export (<= 30 s and <= 25 bytes per span for 10 million spans). Progress goes to
stderr through ``logging``; the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

log = logging.getLogger("export_bench")

GOAL_S = 30.0
GOAL_BYTES_PER_SPAN = 25.0


def _child(kind: str, run_dir: Path, steps_path: Path, out: Path) -> dict[str, Any]:
    """Run one export (or the analysis) in this process; return its figures."""
    import pandas as pd

    from hvtrace.load import open_run

    t0, c0 = time.perf_counter(), time.process_time()
    run = open_run(run_dir)
    t1, c1 = time.perf_counter(), time.process_time()
    if kind == "analyze":
        from hvtrace.analysis import analyze

        a = analyze(run)
        a.steps.to_parquet(steps_path)
        files = [steps_path]
        spans = int(a.read.get("spans", 0))
    else:
        steps_df = pd.read_parquet(steps_path)
        spans = sum(f.spans for f in run.files.values())
        if kind == "perfetto":
            from hvtrace.export.perfetto import write_perfetto_trace

            files = [write_perfetto_trace(run, out, steps_df=steps_df).path]
        else:
            from hvtrace.export.chrome import write_chrome_trace

            files = write_chrome_trace(run, out, steps_df=steps_df)
    return {
        "kind": kind,
        "wall_s": time.perf_counter() - t1,
        "cpu_s": time.process_time() - c1,
        "open_s": t1 - t0,
        "open_cpu_s": c1 - c0,
        "bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
        "spans": spans,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _run_child(kind: str, run_dir: Path, steps_path: Path, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, str(run_dir), str(steps_path), str(out)]
    log.info("%s ...", kind)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    log.info("%s: %.1f s, %.1f MB", kind, res["wall_s"], res["bytes"] / 1e6)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=10_000_000, help="about this many spans")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="use the run there (written first when the directory has no rank files)",
    )
    p.add_argument("--no-chrome", action="store_true", help="skip the Chrome JSON export")
    p.add_argument("--chrome-suffix", default=".json", choices=[".json", ".json.gz"])
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--child", nargs=4, metavar=("KIND", "RUN", "STEPS", "OUT"),
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    if args.child:
        kind, run_dir, steps_path, out = args.child
        print(json.dumps(_child(kind, Path(run_dir), Path(steps_path), Path(out))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from bench.synth_run import write_synth_run

    work = Path(tempfile.mkdtemp(prefix="hvtrace-export-bench-"))
    try:
        run_dir = args.run_dir or work / "run"
        if not (run_dir.is_dir() and any(run_dir.glob("rank*"))):
            steps = math.ceil(args.spans / (args.ranks * (args.tensors + 7)))
            t = time.perf_counter()
            n = write_synth_run(run_dir, ranks=args.ranks, steps=steps, tensors=args.tensors)
            log.info("run: %s spans in %s (%.1f s)", f"{n:,}", run_dir, time.perf_counter() - t)
        steps_path = work / "steps.parquet"
        results = [_run_child("analyze", run_dir, steps_path, work / "unused")]
        results.append(_run_child("perfetto", run_dir, steps_path, work / "timeline.pftrace"))
        (work / "timeline.pftrace").unlink(missing_ok=True)
        if not args.no_chrome:
            out = work / "chrome" / f"timeline{args.chrome_suffix}"
            out.parent.mkdir()
            results.append(_run_child("chrome", run_dir, steps_path, out))
            shutil.rmtree(out.parent, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    spans = results[1]["spans"]
    print(f"\nTimeline export of {spans:,} spans ({args.ranks} ranks, {args.tensors} tensors)")
    head = (f"{'':24}{'wall s':>9}{'CPU s':>9}{'MB':>10}{'B/span':>9}{'peak RSS MB':>13}"
            f"{'files':>7}{'open s':>8}")  # fmt: skip
    print(head)
    label = {"analyze": "analysis (once)", "perfetto": "Perfetto .pftrace",
             "chrome": f"Chrome {args.chrome_suffix}"}  # fmt: skip
    for r in results:
        bps = "" if r["kind"] == "analyze" else f"{r['bytes'] / max(spans, 1):9.1f}"
        mb = "" if r["kind"] == "analyze" else f"{r['bytes'] / 1e6:10.1f}"
        print(f"{label[r['kind']]:24}{r['wall_s']:9.2f}{r['cpu_s']:9.2f}{mb:>10}{bps:>9}"
              f"{r['peak_rss_mb']:13.0f}{r['files']:7d}{r['open_s']:8.2f}")  # fmt: skip
    pf = results[1]
    scale = 10_000_000 / max(spans, 1)
    print(
        f"goals (Perfetto, 10M spans): <= {GOAL_S:.0f} s -> {pf['wall_s'] * scale:.1f} s "
        f"(scaled to 10M); <= {GOAL_BYTES_PER_SPAN:.0f} B/span -> "
        f"{pf['bytes'] / max(spans, 1):.1f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"spans": spans, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
