"""Where a traced step's time goes inside hvtrace's compiled hooks: rank 0's training thread,
sampled by ``perf``.

    .venv/bin/python bench/hot_profile.py [--size 3ms] [--mode defaults] [--seconds 6]
        [--warmup-s 8] [--hz 2000] [--json PATH]

``bench/inrun_phases.py`` splits a traced step's extra time by phase, against Horovod's own
optimizer in the same job; between two identical arms its CPU figures spread by 20-50 µs a step,
about what one hook costs, so it cannot tell one hook's change. This counts the time spent in
hvtrace's compiled code directly: one job under real ``horovodrun -np 2 --gloo``
(``wallclock.py``'s: each rank pinned to a core, ``HOROVOD_CYCLE_TIME=0.1``, its model presets,
``--mode`` one of its modes' settings) trains one traced model; after ``--warmup-s``, ``perf
record -e cpu-clock --call-graph dwarf`` samples rank 0's training thread (``-t TID``) at
``--hz`` for ``--seconds``, stamped on the monotonic clock (``-k mono``: the steps counted are
those rank 0 ended between the first sample and the last). Each sample is walked from its leaf
towards the root and counted for the first frame that is hvtrace's compiled module
(``hvtrace.record._hot``: that function, with the Python C-API calls, allocations, system calls
and interrupts beneath it), Python's evaluation loop (Python code: not attributable by function
on Python 3.11) or PyTorch's and Horovod's native code. A sample stands for ``1/hz`` s of the
thread's CPU; divided by the steps rank 0 ended in the window, it gives µs a step per hook. The
job trains until the sampling is over (the parent leaves a file ``stop``): a thread that ends
while perf samples it ends perf's recording with SIGTERM.

What it does not see: hvtrace's work in Python (the backward wrapper, the recorder's
``extend``, live detection's ``on_step``, the consistency checks beyond their common step), the
slower path PyTorch takes through a module that has hooks, and what hvtrace's work costs the
code after it (caches, the scheduler): a lower bound on the training thread's cost, by hook. The
sampling itself disturbs the thread (``perf`` copies 8 kB of stack a sample): compare runs of
this script with each other, not with the in-run figures.

Needs ``perf`` (Debian: ``apt-get install linux-perf``) and a kernel that lets this user sample
another process's thread (root, or ``kernel.perf_event_paranoid`` <= 1).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wallclock

WORKER = r"""
import json, os, sys, threading, time
import torch, horovod.torch as hvd

width, layers, batch, total_s, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
    float(sys.argv[4]), sys.argv[5])
hvd.init()
torch.set_num_threads(1)
%(net)s
import hvtrace

model = net()
opt = hvtrace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                   named_parameters=model.named_parameters(), model=model,
                                   trace_dir=os.path.join(out, "trace"))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.randn(batch, width)
y = torch.randint(0, 10, (batch,))
lossf = torch.nn.CrossEntropyLoss()
if hvd.rank() == 0:  # the thread to sample
    with open(os.path.join(out, "tid.tmp"), "w") as f:
        f.write(str(threading.get_native_id()))
    os.replace(os.path.join(out, "tid.tmp"), os.path.join(out, "tid"))
ends = []  # per step: its end (CLOCK_MONOTONIC ns), the training thread's CPU ns then
stop = torch.zeros(1)
start = time.perf_counter()
mono, cpu = time.monotonic_ns, time.thread_time_ns
while True:
    opt.zero_grad()
    lossf(model(x), y).backward()
    opt.step()
    ends.append((mono(), cpu()))
    if len(ends) % 50 == 0:  # rank 0 says when to stop, through an allreduce every rank takes
        # (when the parent's sampling is over, or at the latest after total_s: a thread that ends
        # while perf samples it ends perf's recording with SIGTERM)
        done = os.path.exists(os.path.join(out, "stop")) or time.perf_counter() - start > total_s
        stop[0] = 1.0 if (hvd.rank() == 0 and done) else 0.0
        if float(hvd.allreduce(stop, op=hvd.Sum, name="hot_profile.stop")) > 0:
            break
hvtrace.finish()
if hvd.rank() == 0:
    with open(os.path.join(out, "steps.json"), "w") as f:
        json.dump(ends, f)
""".replace("%(net)s", wallclock.NET)

#: The shared object of hvtrace's compiled hot path, as ``perf script`` names it.
HOT_DSO = "hvtrace/record/_hot."


def classify(
    stacks: str,
) -> tuple[int, collections.Counter, collections.Counter, tuple[float, float] | None]:
    """``perf script -F time,ip,sym,dso`` output: the samples, the direct ones per hvtrace
    function (the first frame from the leaf that is hvtrace's compiled module), every sample's
    class (``hvtrace``, ``python``: Python's evaluation loop first, ``native``: PyTorch's or
    Horovod's native code first, ``other``), and the first and last sample's time (s; None
    without times)."""
    per_fn: collections.Counter = collections.Counter()
    classes: collections.Counter = collections.Counter()
    n = 0
    times: list[float] = []
    for block in stacks.split("\n\n"):
        frames = []
        for line in block.splitlines():
            text = line.strip()
            if text.endswith(":"):  # the sample's time
                try:
                    times.append(float(text[:-1]))
                except ValueError:
                    pass
                continue
            parts = text.split(None, 1)
            if len(parts) == 2:
                sym, _, dso = parts[1].rpartition(" (")
                frames.append((sym, dso.rstrip(")")))
        if not frames:
            continue
        n += 1
        what = "other"
        for sym, dso in frames:  # leaf first
            if HOT_DSO in dso:
                what = "hvtrace"
                per_fn[sym] += 1
                break
            if sym.startswith("_PyEval_EvalFrameDefault"):
                what = "python"
                break
            if any(k in dso for k in ("libtorch", "libc10", "mpi_lib", "libgomp", "libmkl")):
                what = "native"
                break
        classes[what] += 1
    return n, per_fn, classes, ((min(times), max(times)) if times else None)


def _tail(path: Path) -> str:
    """The last 2,000 characters of a log."""
    return path.read_text(errors="replace")[-2000:]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The job, sampled; the figures (see the module docstring)."""
    width, layers, batch = wallclock.SIZES[args.size]
    env = wallclock._env(args.cycle_ms, wallclock.MODES[args.mode])
    total = args.warmup_s + args.seconds + 120.0  # (it stops when told: the file "stop")
    with tempfile.TemporaryDirectory(prefix="hvtrace-hot-profile-") as tmp:
        out = Path(tmp)
        script = out / "worker.py"
        script.write_text(WORKER)
        cmd = wallclock.job_command(
            script, [str(width), str(layers), str(batch), str(total), str(out)], pin=True
        )
        with open(out / "job.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 120
                while not (out / "tid").exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the job did not start: {_tail(out / 'job.log')}")
                    time.sleep(0.1)
                tid = int((out / "tid").read_text())
                time.sleep(args.warmup_s)
                t0 = time.monotonic_ns()
                rec = subprocess.run(
                    ["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.hz), "-k", "mono",
                     "--call-graph", "dwarf,8192", "-t", str(tid), "-o", str(out / "perf.data"),
                     "--", "sleep", str(args.seconds)],
                    capture_output=True, text=True, timeout=args.seconds + 300,
                )  # fmt: skip
                t1 = time.monotonic_ns()
                (out / "stop").touch()
                if rec.returncode != 0:
                    said = (rec.stdout + rec.stderr).strip()[-500:]
                    raise RuntimeError(f"perf record failed ({rec.returncode}): {said}")
                proc.wait(timeout=total * 4 + 120)
            finally:
                if proc.poll() is None:
                    proc.kill()
        if proc.returncode != 0:
            raise RuntimeError(f"the job failed: {_tail(out / 'job.log')}")
        ends = json.loads((out / "steps.json").read_text())
        script_out = subprocess.run(
            [
                "perf",
                "script",
                "-i",
                str(out / "perf.data"),
                "--no-inline",
                "-F",
                "time,ip,sym,dso",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    n, per_fn, classes, span = classify(script_out.stdout)
    if span is not None:  # the samples' own window (perf starts after t0: seconds, at times)
        t0, t1 = int(span[0] * 1e9), int(span[1] * 1e9)
    inside = [(t, c) for t, c in ends if t0 <= t <= t1]
    steps = max(len(inside) - 1, 1)
    cpu_us = (inside[-1][1] - inside[0][1]) / 1e3 / steps if len(inside) > 1 else float("nan")
    us = 1e6 / args.hz / steps  # one sample, in µs a step
    return {
        "size": args.size,
        "mode": args.mode,
        "hz": args.hz,
        "steps": steps,
        "step_ms": (inside[-1][0] - inside[0][0]) / 1e6 / steps if len(inside) > 1 else None,
        "thread_cpu_us_per_step": cpu_us,
        "samples": n,
        "sampled_cpu_us_per_step": n * us,
        "classes_us_per_step": {k: v * us for k, v in classes.most_common()},
        "hvtrace_us_per_step": {k: v * us for k, v in per_fn.most_common()},
        "hvtrace_samples": {k: v for k, v in per_fn.most_common()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="3ms", choices=sorted(wallclock.SIZES))
    ap.add_argument("--mode", default="defaults",
                    choices=[m for m, e in wallclock.MODES.items() if e is not None])  # fmt: skip
    ap.add_argument("--seconds", type=float, default=6.0, help="sampled, after --warmup-s")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--hz", type=int, default=2000, help="samples a second of the thread's CPU")
    ap.add_argument("--cycle-ms", type=float, default=0.1, help="HOROVOD_CYCLE_TIME")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args(argv)
    if shutil.which("perf") is None:
        print("hot_profile: needs perf (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    res = run(args)
    print(
        f"{res['size']} model, mode {res['mode']}: {res['steps']} steps of {res['step_ms']:.2f} ms "
        f"sampled ({res['samples']} samples at {res['hz']} Hz); the training thread's CPU "
        f"{res['thread_cpu_us_per_step']:.0f} µs a step (sampled: "
        f"{res['sampled_cpu_us_per_step']:.0f})"
    )
    print("\n| first frame from the leaf | µs a step |\n| --- | --- |")
    for k, v in res["classes_us_per_step"].items():
        print(f"| {k} | {v:.1f} |")
    print("\n| hvtrace's compiled function (direct) | samples | µs a step |\n| --- | --- | --- |")
    for k, v in res["hvtrace_us_per_step"].items():
        print(f"| {k} | {res['hvtrace_samples'][k]} | {v:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
