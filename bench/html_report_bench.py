"""What the one-file HTML report costs against the text report: its size and the time to build it.

A synthetic run (``bench/synth_run.py``: hvtrace's own writer, files compacted to Parquet, one
rank slowed 20 ms in its forward; 64 ranks x 2,000 steps x 16 tensors by default), reused from
``--dir`` when given. Then, in fresh processes and interleaved (``--rounds`` times, the order
alternating each round), ``hvtrace analyze RUN`` (the text report) and ``hvtrace analyze RUN
--html PAGE``; each process's wall time. Prints the size of the page, the median times and the
median of the per-round ratio, against the goals of issue 37 (at most 5 MB, at most 2x the text
report's time).

    python bench/html_report_bench.py                      # 64 ranks x 2,000 steps
    python bench/html_report_bench.py --ranks 8 --steps 200 --rounds 2   # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _synth() -> object:
    spec = importlib.util.spec_from_file_location("synth_run", HERE / "synth_run.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _time(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="reuse (or write) the run here")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hvtrace-html-bench-"))
    run = args.dir or tmp / "run"
    if not run.exists() or not any(run.iterdir()):
        run.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        n = _synth().write_synth_run(
            run, ranks=args.ranks, steps=args.steps, tensors=args.tensors, slow_rank=args.ranks // 3
        )
        print(f"wrote {n:,} spans in {time.perf_counter() - t0:.1f} s: {run}")
    page = tmp / "report.html"
    base = [sys.executable, "-m", "hvtrace.cli", "analyze", str(run)]
    arms = {"text": base, "html": [*base, "--html", str(page)]}
    times: dict[str, list[float]] = {k: [] for k in arms}
    ratios = []
    for i in range(args.rounds):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        got = {k: _time(arms[k]) for k in order}
        for k, v in got.items():
            times[k].append(v)
        ratios.append(got["html"] / got["text"])
        print(f"round {i + 1}: text {got['text']:.2f} s, html {got['html']:.2f} s")
    size = page.stat().st_size
    ratio = statistics.median(ratios)
    print()
    print(f"run: {args.ranks} ranks x {args.steps} steps x {args.tensors} tensors")
    print(f"text report  median {statistics.median(times['text']):.2f} s")
    print(f"html report  median {statistics.median(times['html']):.2f} s, {size / 1e6:.2f} MB")
    print(f"ratio html/text: median {ratio:.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"  goal: page <= 5 MB        {'ok' if size <= 5e6 else 'MISSED'}")
    print(f"  goal: time <= 2x text     {'ok' if ratio <= 2.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
