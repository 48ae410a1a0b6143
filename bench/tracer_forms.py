"""The tracer's per-step hooks, compiled against Python, side by side in one process.

    .venv/bin/python bench/tracer_forms.py [--steps 4000] [--rounds 5] [--tensors 2] [--parts]
        [--no-pin] [--seed N] [--json PATH]

``format_bench.py --tracer-only`` gives hvtrace's whole added cost per step and per allreduce,
but each of its figures comes from separate processes whose medians spread 2-4x from one to the
next (one process's memory layout and cores against another's), so a change of a few µs per
step hides in it. Here three optimizers train three identical models in one one-rank Horovod job
(``HOROVOD_ELASTIC=1`` makes Horovod register its gradient hooks with one rank, as in
``format_bench.py``'s child), their steps taken in turn, in a new random order every turn (in a
fixed rotation, the arm that always came right after the untraced one measured 1-6 µs more than
an identical arm placed elsewhere, in four invocations; in a random order the two agree within
1 µs):

- ``plain``: ``hvd.DistributedOptimizer``, untraced;
- ``compiled``: ``hvtrace.DistributedOptimizer(model=...)`` as shipped (the per-step hooks of
  :class:`hvtrace.record._hot.Phases`, the compiled enqueue and reading);
- ``python``: the same, with the Python forms of the per-step hooks installed in their place
  (``Tracer._fwd_pre``, ``_fwd_post``, ``_synchronize``, ``_step``: what ``$HVTRACE_NATIVE=0``
  installs), the enqueue wrapper and the counter reading still compiled, so that only the hooks
  differ.

With ``--parts``, more compiled arms take one piece away each, to show where the per-step cost
goes (not configurations a user can choose), beside a control:

- ``no readings``: the counter reading replaced by a compiled call that returns None (not
  measured), so the five readings per step are gone and the rest is the same;
- ``exact readings``: the counter reading without the switch check (every reading reads the
  thread's CPU clock: a system call), as where Linux allows no perf event;
- ``no lr rows``: the consistency checks detached (no learning-rate rows, no fingerprints);
- ``compiled again``: a second arm exactly like ``compiled``: how far two identical arms differ
  is the bias that the other arms' differences carry (the order the arms are made in is
  shuffled per invocation too, ``--seed``);
- ``recording off``: recording switched off after the warm-up (the hooks installed, returning at
  once): what the hooks and wrappers cost as mechanisms.

Unless ``--no-pin``, the main thread is pinned to one CPU and every other thread of the process
(Horovod's background thread, spinning at its 10 µs cycle; the tracers' writer threads) to the
others, once the arms are built, so that the main thread never shares its CPU with them and
each invocation places them alike.

Each step is timed with ``time.thread_time_ns`` (the main thread's CPU); an arm's figure is the
median over steps of its step minus the plain step of the same turn: hvtrace's added CPU per step
with ``--tensors`` gradient tensors (their allreduces included: about 2 µs each). Both traced arms
share the ``torch.autograd.backward`` wrapper, which the plain arm's steps run through too (an
empty loop for the others' tracers); the learning-rate row, live detection's hand-over and the
recorder's writer thread are each tracer's own, as in a real job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recorder_floor import print_rows

os.environ.setdefault("HOROVOD_ELASTIC", "1")  # gradient hooks with one rank (before Horovod)
os.environ.setdefault("HOROVOD_CYCLE_TIME", "0.01")

log = logging.getLogger("tracer_forms")

#: Issue 20's goal for hvtrace's whole per-step cost (µs).
GOAL_PER_STEP_US = 15.0


def python_hooks(opt: Any, model: Any) -> None:
    """Install the tracer's Python per-step hooks in place of the compiled ones."""
    tr = opt._hvtrace
    for h in tr._hooks[-2:]:  # the model's forward pre- and post-hook, registered last
        h.remove()
    tr._hooks[-2:] = [
        model.register_forward_pre_hook(tr._fwd_pre),
        model.register_forward_hook(tr._fwd_post),
    ]
    opt.synchronize, opt.step = tr._synchronize, tr._step


def pin_threads() -> dict[str, Any] | None:
    """Pin the calling (main) thread to the last CPU this process may use and every other
    thread of the process to the rest; None (nothing pinned) with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    main_cpu, rest = cpus[-1], set(cpus[:-1])
    me = threading.get_native_id()
    others = [int(t) for t in os.listdir("/proc/self/task") if int(t) != me]
    for tid in others:
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(tid, rest)
    os.sched_setaffinity(0, {main_cpu})  # 0: the calling thread
    return {"main_cpu": main_cpu, "other_cpus": sorted(rest), "other_threads": len(others)}


PARTS = ("no readings", "exact readings", "no lr rows", "compiled again", "recording off")


def cpu_stat() -> tuple[int, int]:
    """(all CPU ticks, steal ticks) of this machine so far (/proc/stat; zeros where missing):
    what a hypervisor took from the VM, which the figures move with."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), (fields[7] if len(fields) > 7 else 0)


def measure(
    steps: int,
    rounds: int,
    tensors: int,
    trace_dir: str,
    parts: bool = False,
    pin: bool = True,
    seed: int = 0,
    evict_kb: int = 0,
) -> dict[str, Any]:
    """Per traced arm: the added main-thread CPU per step (µs), per round and their median."""
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvtrace
    from hvtrace.record.cpustat import ThreadCounters
    from hvtrace.record.native import hot_module

    if hot_module() is None:
        raise SystemExit("hvtrace.record._hot is not built here (or HVTRACE_NATIVE is off)")
    hvd.init()
    torch.set_num_threads(1)

    def arm(name: str) -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(tensors // 2)])
        named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
        sgd = torch.optim.SGD(model.parameters(), lr=0.0)
        if name == "plain":
            return model, hvd.DistributedOptimizer(sgd, named_parameters=named)
        opt = hvtrace.DistributedOptimizer(
            sgd,
            named_parameters=named,
            trace_dir=os.path.join(trace_dir, name.replace(" ", "_")),
            model=model,
        )
        if name == "python":
            python_hooks(opt, model)
        elif name == "no readings":
            opt._hvtrace.read = type(None)  # a compiled call returning None: not measured
        elif name == "exact readings":
            opt._hvtrace.read = ThreadCounters(derive=False).read  # this (the training) thread
        elif name == "no lr rows":
            opt._hvtrace.checks = None
        return model, opt

    names = ["plain", "compiled", "python", *(PARTS if parts else ())]
    made = list(names)
    random.Random(seed).shuffle(made)  # the order the arms are made in: see the module
    arms = {n: arm(n) for n in made}
    arms = {n: arms[n] for n in names}
    hooks = {n: type(arms[n][1].step).__name__ for n in arms}
    pinned = pin_threads() if pin else None
    log.info("pinned: %s", pinned)
    x = torch.randn(4, 8)

    # a real model's forward and backward stream megabytes through the caches between two of
    # hvtrace's hooks: the hooks then find their code and data evicted. Writing this buffer
    # before each timed step (outside the timing) does the same to every arm alike.
    evict = torch.zeros(evict_kb * 256) if evict_kb else None

    def one_step(name: str) -> int:
        model, opt = arms[name]
        if evict is not None:
            evict.add_(1.0)
        t0 = time.thread_time_ns()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        return time.thread_time_ns() - t0

    added: dict[str, list[float]] = {n: [] for n in names if n != "plain"}
    plain_us: list[float] = []
    if "recording off" in arms:  # recorded at first (its tensors learned), then switched off
        for _ in range(50):
            one_step("recording off")
        arms["recording off"][1]._hvtrace.rec.enabled = False
    turn, rng = list(names), random.Random(seed + 1)
    stat0 = cpu_stat()
    for r in range(rounds):
        times: dict[str, list[int]] = {n: [] for n in names}
        for i in range(steps + 50):
            rng.shuffle(turn)  # a new order every turn: no arm always follows the same one
            for n in turn:
                ns = one_step(n)
                if i >= 50:  # warm-up
                    times[n].append(ns)
        plain = times["plain"]
        plain_us.append(statistics.median(plain) / 1e3)
        for n in added:
            added[n].append(statistics.median(a - b for a, b in zip(times[n], plain)) / 1e3)
        log.info("round %d/%d done", r + 1, rounds)
    failed = [n for n in added if n != "recording off" and not arms[n][1]._hvtrace.rec.enabled]
    if failed:  # a tracer that failed stopped recording: its figures are not hvtrace's cost
        raise SystemExit(f"recording failed in arm(s) {failed}: the figures would be wrong")
    stat1 = cpu_stat()
    ticks = stat1[0] - stat0[0]
    switch_check = {
        n: getattr(arms[n][1]._hvtrace.read, "switch_check", None) for n in added
    }  # (still on at the end: see hvtrace/record/cpustat.py)
    hvtrace.finish(sync_clock=False)
    return {
        "steps": steps,
        "rounds": rounds,
        "tensors": tensors,
        "evict_kb": evict_kb,
        "step_types": hooks,
        "pinned": pinned,
        "made_in_order": made,
        "switch_check_on_at_end": switch_check,
        "plain_step_cpu_us": statistics.median(plain_us),
        "steal_pct": 100.0 * (stat1[1] - stat0[1]) / ticks if ticks > 0 else None,
        "added_us": {n: statistics.median(v) for n, v in added.items()},
        "added_us_rounds": added,
    }


def print_table(res: dict[str, Any]) -> None:
    """The figures, and the difference between the forms."""
    print(
        f"\nAdded main-thread CPU per step (µs), {res['tensors']} gradient tensors, median of "
        f"paired differences against the plain optimizer ({res['plain_step_cpu_us']:.1f} µs/step),"
        f" {res['steps']} steps x {res['rounds']} rounds, one process"
        + (f", {res['evict_kb']} KB written before each step" if res.get("evict_kb") else "")
        + "\n"
    )
    pin = res.get("pinned")
    where = (
        f"main thread on CPU {pin['main_cpu']}, {pin['other_threads']} other threads on "
        f"{pin['other_cpus']}"
        if pin
        else "threads not pinned"
    )
    steal = res.get("steal_pct")
    print(f"({where}; arms made in the order {', '.join(res['made_in_order'])})")
    if steal is not None:
        print(f"(the hypervisor took {steal:.1f}% of this machine's CPU time meanwhile)")
    print_rows(res, "per-step hooks", 14)
    on = [n for n, v in res["switch_check_on_at_end"].items() if v]
    print(f"switch check still on at the end in: {', '.join(on) or 'none'}")
    diffs = [
        p - c for c, p in zip(res["added_us_rounds"]["compiled"], res["added_us_rounds"]["python"])
    ]
    print(
        f"\nThe compiled hooks save {statistics.median(diffs):.1f} µs per step (rounds: "
        f"{', '.join(f'{d:.1f}' for d in diffs)}); goal for the whole per-step cost: "
        f"{GOAL_PER_STEP_US:.0f} µs (allreduces included here: see format_bench.py for the split)."
    )


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print it (and write JSON with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000, help="steps per arm per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tensors", type=int, default=2, help="gradient tensors (even, >= 2)")
    p.add_argument(
        "--parts", action="store_true", help="also the arms that take one piece away each"
    )
    p.add_argument(
        "--no-pin", action="store_true", help="leave the threads where the scheduler puts them"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="the order the arms are made in (default: random)"
    )
    p.add_argument(
        "--evict-kb",
        type=int,
        default=0,
        help="write this many KB before each step (outside the timing): the caches as a real "
        "model's forward and backward leave them (0: warm caches, the hooks' best case)",
    )
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.tensors < 2 or args.tensors % 2:
        p.error("--tensors: an even number >= 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="hvtrace-forms-") as d:
        res = measure(
            args.steps,
            args.rounds,
            args.tensors,
            d,
            parts=args.parts,
            pin=not args.no_pin,
            seed=random.randrange(2**31) if args.seed is None else args.seed,
            evict_kb=args.evict_kb,
        )
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
