"""Long-run memory: does the recorder stay bounded over 200,000 recorded steps?

Runs a tiny model under real ``horovodrun -np 2 --gloo`` for ``--steps`` optimizer steps, traced by
hvtrace, and prints each rank's resident memory (VmRSS) after the warm-up and at the end, and the
growth. The same training untraced runs beside it (``--compare``), so the growth that torch and
Horovod show on their own is visible next to hvtrace's. Goal: growth <= 50 MB with hvtrace.

    python bench/long_run.py --steps 200000            # about 5-10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, time
import torch, horovod.torch as hvd
import hvtrace

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")

steps, warm, traced, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if traced:
    opt = hvtrace.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       trace_dir=os.path.join(out, "trace"), model=model)
else:
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
x = torch.randn(8, 16)
y = torch.randint(0, 4, (8,))
lossf = torch.nn.CrossEntropyLoss()
rss = {}
t0 = time.perf_counter()
for s in range(steps):
    opt.zero_grad()
    lossf(model(x), y).backward()
    opt.step()
    if s + 1 == warm:
        rss["warm"] = rss_mb()
        t_warm = time.perf_counter()
rss["end"] = rss_mb()
hvtrace.finish()
res = {"rank": hvd.rank(), "rss_warm_mb": rss["warm"], "rss_end_mb": rss["end"],
       "steps": steps, "s_per_step": (time.perf_counter() - t_warm) / max(1, steps - warm)}
with open(os.path.join(out, f"rss{hvd.rank()}.json"), "w") as f:
    json.dump(res, f)
"""


def run(steps: int, warm: int, traced: bool, out: Path) -> list[dict]:
    """Run the worker under horovodrun; return one result dict per rank."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "worker.py"
    script.write_text(WORKER)
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}:{os.environ.get('PATH', '')}")
    # a tiny model's step is mostly Horovod's cycle time: shorten it so 200k steps take minutes
    env.setdefault("HOROVOD_CYCLE_TIME", "0.1")
    cmd = [
        str(bindir / "horovodrun"),
        "-np",
        "2",
        "-H",
        "localhost:2",
        "--gloo",
        sys.executable,
        str(script),
        str(steps),
        str(warm),
        "1" if traced else "0",
        str(out),
    ]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return [json.loads((out / f"rss{r}.json").read_text()) for r in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--warmup", type=int, default=1_000)
    p.add_argument("--compare", action="store_true", help="also run untraced for reference")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvtrace-long-") as tmp:
        modes = [("hvtrace", True)] + ([("untraced", False)] if args.compare else [])
        for mode, traced in modes:
            t = time.perf_counter()
            res = run(args.steps, args.warmup, traced, Path(tmp) / mode)
            wall = time.perf_counter() - t
            spans = None
            if traced:
                import hvtrace

                spans = len(hvtrace.load_run(Path(tmp) / mode / "trace").spans)
            for r in res:
                rows.append(
                    {
                        "mode": mode,
                        **r,
                        "growth_mb": r["rss_end_mb"] - r["rss_warm_mb"],
                        "wall_s": wall,
                        "spans_recorded": spans,
                    }
                )
    print(
        f"{'mode':<9} {'rank':>4} {'steps':>8} {'RSS@warm MB':>11} {'RSS@end MB':>10} "
        f"{'growth MB':>9} {'ms/step':>7} {'spans':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<9} {r['rank']:>4} {r['steps']:>8} {r['rss_warm_mb']:>11.1f} "
            f"{r['rss_end_mb']:>10.1f} {r['growth_mb']:>9.1f} {r['s_per_step'] * 1e3:>7.2f} "
            f"{r['spans_recorded'] or '-':>9}"
        )
    worst = max(r["growth_mb"] for r in rows if r["mode"] == "hvtrace")
    print(
        f"goal: resident memory growth <= 50 MB with hvtrace: worst rank {worst:.1f} MB -> "
        f"{'met' if worst <= 50 else 'NOT met'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
