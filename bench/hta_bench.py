"""hvtrace side by side with Holistic Trace Analysis (HTA) on the same spans.

HTA (PyPI ``HolisticTraceAnalysis``) analyzes PyTorch-profiler (Kineto) traces: one JSON file per
rank. This benchmark writes one synthetic run (``bench/synth_run.py``: hvtrace's Parquet rank
files) and the same spans as per-rank Kineto-style JSON traces (each span an ``X`` event:
compute phases as ``cpu_op``, allreduces as NCCL ``kernel`` events on a stream, each step a
``ProfilerStep#N`` annotation, ``distributedInfo.rank`` set), then, each in a fresh child and side
by side in one invocation:

- ``hta load``: ``TraceAnalysis(trace_dir=...)`` (HTA parses every rank's trace into its
  DataFrames; its parser uses a process pool);
- ``hta load + overlap``: the same, then ``get_comm_comp_overlap`` (one of its analyses);
- ``hvtrace analyze``: the whole command on the Parquet files (open, per-rank pass, cross-rank
  pass, report, JSON).

Wall time and peak memory of each: ``peak MB`` is the largest process (``getrusage``), ``total
MB`` the process and its children's peaks summed (sampled every 20 ms), as HTA works in several
processes. HTA runs from a virtualenv of its own (``--hta-python``; created under
``~/.cache/hvtrace/hta-venv`` on first use, since its pins are not ours). Goals: hvtrace at least
5x faster and using at least 10x less memory than HTA's load.

    python bench/hta_bench.py                                  # 8 ranks x ~1 M spans
    python bench/hta_bench.py --steps 600 --tensors 24         # small, to try it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analyze_bench import measure
from synth_run import write_synth_run

HTA_VENV = Path.home() / ".cache" / "hvtrace" / "hta-venv"

#: What the HTA child runs: load the traces (and optionally one analysis).
HTA_SCRIPT = r"""
import logging, sys
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
n = sum(len(a.t.get_trace(r)) for r in a.t.traces)
if sys.argv[2] == "overlap":
    a.get_comm_comp_overlap(visualize=False)
print(n)
"""


def hta_python(path: str | None) -> Path:
    """The HTA virtualenv's interpreter (created with HolisticTraceAnalysis when absent)."""
    py = Path(path) if path else HTA_VENV / "bin" / "python"
    if path or py.exists():
        return py
    print(f"creating {HTA_VENV} with HolisticTraceAnalysis ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(HTA_VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "HolisticTraceAnalysis"], check=True)
    return py


def write_kineto(run_dir: Path, out_dir: Path) -> int:
    """Write each rank file of ``run_dir`` as a Kineto-style JSON trace in ``out_dir``; return
    the events written. Times in µs on the rank's own clock, as Kineto writes them."""
    import numpy as np

    from hvtrace.load import open_run

    run = open_run(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for r, rf in sorted(run.files.items()):
        t = rf.read_table(columns=["step", "kind", "name", "start_ns", "end_ns", "bytes"])
        kind = np.asarray(t.column("kind").to_pylist(), dtype=object)
        name = t.column("name").to_pylist()
        step = t.column("step").to_numpy()
        ts = t.column("start_ns").to_numpy() / 1e3
        dur = (t.column("end_ns").to_numpy() - t.column("start_ns").to_numpy()) / 1e3
        nbytes = t.column("bytes").to_numpy()
        events = []
        for i in range(len(kind)):
            k = kind[i]
            if k == "allreduce":
                ev = {
                    "ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                    "pid": 0, "tid": 20, "ts": ts[i], "dur": dur[i],
                    "args": {"stream": 20, "device": 0, "correlation": i, "External id": i,
                             "In msg nelems": int(nbytes[i]) // 4, "dtype": "Float",
                             "Collective name": "allreduce", "Group size": run.size,
                             "tensor": name[i]},
                }  # fmt: skip
            elif k == "step":
                ev = {
                    "ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{int(step[i])}",
                    "pid": 1, "tid": 1, "ts": ts[i], "dur": dur[i], "args": {"External id": i},
                }  # fmt: skip
            elif k in ("scalar", "clock"):
                continue
            else:
                ev = {
                    "ph": "X", "cat": "cpu_op", "name": f"{k}:{name[i]}", "pid": 1, "tid": 1,
                    "ts": ts[i], "dur": dur[i], "args": {"External id": i},
                }  # fmt: skip
            events.append(ev)
        doc = {
            "schemaVersion": 1,
            "distributedInfo": {"backend": "nccl", "rank": int(r), "world_size": run.size},
            "deviceProperties": [],
            "traceEvents": events,
        }
        with open(out_dir / f"rank-{int(r)}.json", "w") as f:
            json.dump(doc, f)
        total += len(events)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=9700, help="with 96 tensors: ~1 M spans a rank")
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--hta-python", default=None, help="an interpreter with HTA installed")
    p.add_argument("--dir", default=None, help="write (or reuse) the runs here")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    py = hta_python(args.hta_python)
    tmp = Path(tempfile.mkdtemp(prefix="hvtrace-hta-"))
    base = Path(args.dir) if args.dir else tmp
    run_dir, kineto = base / "run", base / "kineto"
    try:
        marker = base / ".params.json"
        params = {"ranks": args.ranks, "steps": args.steps, "tensors": args.tensors}
        if not (marker.exists() and json.loads(marker.read_text()) == params):
            for d in (run_dir, kineto):
                shutil.rmtree(d, ignore_errors=True)
            t = time.perf_counter()
            n = write_synth_run(run_dir, args.ranks, args.steps, args.tensors, args.ranks // 3)
            print(f"wrote {n:,} spans (hvtrace Parquet) in {time.perf_counter() - t:.1f} s")
            t = time.perf_counter()
            ev = write_kineto(run_dir, kineto)
            print(f"wrote {ev:,} events (Kineto JSON) in {time.perf_counter() - t:.1f} s")
            marker.write_text(json.dumps(params))
        sizes = {
            d.name: sum(f.stat().st_size for f in d.iterdir() if f.is_file())
            for d in (run_dir, kineto)
        }
        print(
            f"run: {args.ranks} ranks x {args.steps} steps x {args.tensors} tensors; "
            f"Parquet {sizes['run'] / 1e6:.0f} MB, Kineto JSON {sizes['kineto'] / 1e6:.0f} MB",
            flush=True,
        )
        hv = [sys.executable, "-m", "hvtrace.cli", "analyze", str(run_dir)]
        cases = [
            ("hvtrace analyze", [*hv, "--json", str(tmp / "hv.json")]),
            ("hta load", [str(py), "-c", HTA_SCRIPT, str(kineto), "load"]),
            ("hta load + overlap", [str(py), "-c", HTA_SCRIPT, str(kineto), "overlap"]),
        ]
        rows = []
        env_note = f"cpus: {os.cpu_count()}"
        for label, cmd in cases:
            print(f"running {label} ...", file=sys.stderr, flush=True)
            m = measure(cmd)
            if m["rc"] != 0:
                print(f"{label}: exit {m['rc']}: {m['stderr']}", file=sys.stderr)
            m["total_mb"] = m["client_mb"] + m["workers_mb"]
            rows.append({"case": label, **m})
        print(f"\n{'case':<20} {'wall s':>8} {'peak MB':>8} {'total MB':>9}   ({env_note})")
        print(f"{'-' * 20} {'-' * 8} {'-' * 8} {'-' * 9}")
        for r in rows:
            print(f"{r['case']:<20} {r['wall_s']:8.2f} {r['peak_mb']:8.0f} {r['total_mb']:9.0f}")
        hv_row, hta = rows[0], rows[1]
        speed = hta["wall_s"] / hv_row["wall_s"]
        mem = hta["total_mb"] / max(hv_row["total_mb"], 1)
        print()
        print(f"  hvtrace vs HTA load: {speed:.1f}x faster, {mem:.1f}x less memory (total)")
        print(f"  goal: >= 5x faster {'ok' if speed >= 5 else 'MISSED'}")
        print(f"  goal: >= 10x less memory {'ok' if mem >= 10 else 'MISSED'}")
        if args.json:
            Path(args.json).write_text(json.dumps({"params": params, "rows": rows}, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
