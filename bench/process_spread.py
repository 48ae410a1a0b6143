"""How far identical separate processes differ: the noise floor of whole-process comparisons.

    .venv/bin/python bench/process_spread.py [--runs 3] [--steps 3000]

``overhead.py`` compares whole processes with hvtrace and without, because only that sees what
having hvtrace installed costs. This asks how precise such a comparison can be here: the same
one-rank Horovod job (a 2-tensor model, ``HOROVOD_CYCLE_TIME=0.01``, the main thread pinned to
one CPU and every other thread to the others, as in ``tracer_forms.py``) run as separate
processes, untraced and traced in turn, ``--runs`` of each. Each process prints its main thread's
CPU per step, inside Horovod's per-handle waits and outside them. The spread among the untraced
processes, which run the very same code, is what a whole-process difference must exceed to mean
anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, tempfile, time
os.environ.setdefault("HOROVOD_ELASTIC", "1")
os.environ.setdefault("HOROVOD_CYCLE_TIME", "0.01")
import horovod.torch as hvd, torch
import horovod.torch.optimizer as hopt
from torch import nn
wait_ns = [0]
_sync = hopt.synchronize
def timed(handle):
    t0 = time.thread_time_ns()
    try:
        return _sync(handle)
    finally:
        wait_ns[0] += time.thread_time_ns() - t0
hopt.synchronize = timed
hvd.init(); torch.set_num_threads(1)
mode, steps = sys.argv[1], int(sys.argv[2])
if "nogc" in sys.argv[3:]:
    import gc; gc.disable()
if "imported" in sys.argv[3:]:
    import hvtrace
if "exact" in sys.argv[3:]:
    import hvtrace.record.cpustat as cpustat; cpustat.MAX_DERIVED_NS = 0
model = nn.Sequential(nn.Linear(8, 8))
sgd = torch.optim.SGD(model.parameters(), lr=0.0)
if mode == "untraced":
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
else:
    import hvtrace
    opt = hvtrace.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), trace_dir=tempfile.mkdtemp(), model=model
    )
if mode != "untraced" and "off" in sys.argv[3:]:
    opt._hvtrace.rec.enabled = False
x = torch.randn(4, 8)
def step():
    opt.zero_grad(); model(x).sum().backward(); opt.step()
for _ in range(200): step()
from tracer_forms import pin_threads  # (bench/ is on PYTHONPATH)
pin_threads()
t0, w0 = time.thread_time_ns(), wait_ns[0]
for _ in range(steps): step()
total, wait = (time.thread_time_ns() - t0) / steps / 1e3, (wait_ns[0] - w0) / steps / 1e3
print(json.dumps({"mode": mode, "cpu_us": total, "wait_us": wait, "outside_us": total - wait}))
if mode != "untraced":
    hvtrace.finish(sync_clock=False)
"""


def main(argv: list[str] | None = None) -> int:
    """Run the processes in turn and print each, then the spreads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="processes of each mode")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument(
        "--variant",
        nargs="*",
        default=[],
        choices=["nogc", "exact", "imported", "off"],
        help="nogc: Python's garbage collector off in both modes; exact: no switch check; "
        "imported: the untraced process imports hvtrace too; off: the traced process switches "
        "recording off (its wrappers, writer and threads stay)",
    )
    args = p.parse_args(argv)
    out: dict[str, list[dict]] = {"untraced": [], "hvtrace": []}
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        # the child pins its threads as tracer_forms.py does (its pin_threads, from bench/)
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        for _ in range(args.runs):
            for mode in out:
                proc = subprocess.run(
                    [sys.executable, script, mode, str(args.steps), *args.variant],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    env=env,
                )
                if proc.returncode != 0:
                    raise SystemExit(f"{mode} child failed: {proc.stderr[-2000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                out[mode].append(res)
                print(
                    f"{mode:9s} main-thread CPU {res['cpu_us']:6.1f} µs/step: in waits "
                    f"{res['wait_us']:5.1f}, outside {res['outside_us']:6.1f}",
                    flush=True,
                )
    for mode, rs in out.items():
        o = [r["outside_us"] for r in rs]
        print(
            f"{mode}: outside the waits {min(o):.1f}-{max(o):.1f} µs/step over {len(o)} "
            f"processes (spread {100 * (max(o) - min(o)) / statistics.median(o):.0f} % of the "
            "median)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
