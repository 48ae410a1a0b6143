"""The floor under the recorder's per-step cost: what the mechanisms hvtrace needs to see a
step's phases cost the training thread before it records anything.

    .venv/bin/python bench/recorder_floor.py [--steps 4000] [--rounds 3] [--json PATH]

Per step, with ``model=``, hvtrace needs: the model's forward start and end (two forward hooks),
the backward's start (since this benchmark was written, a wrapper of ``torch.autograd.backward``,
:mod:`hvtrace.record.torchpatch`; before, a pre-hook on the output's autograd node registered at
every forward), and five readings of the training thread's counters (issue 20's section 1:
forward's start and end, synchronize's entry and exit, the step's end; one CPU-clock system
call each, plus a ``pread`` of schedstat when the thread was off a CPU for long enough:
:mod:`hvtrace.record.cpustat`).

No Horovod here and no recording: one tiny model per variant (``Linear(8, 8)``, batch 4, one
torch thread), forward + backward + SGD update, the variants' steps alternating (order reversed
every step), each step timed with ``time.thread_time_ns``; a variant's figure is the median over
steps of its step minus the plain model's step of the same turn. Readings are taken where
hvtrace takes them: in the hooks, after the backward (synchronize's entry and exit), after the
update. The hooks do nothing else. The floor is forward hooks + the backward's start + five
readings: hvtrace's per-step cost cannot go below it, whatever its bookkeeping costs.

Variants, each against the plain model:

- ``forward hooks``: no-op forward pre- and post-hooks;
- ``+ backward node pre-hook``: and a no-op pre-hook on the output's ``grad_fn`` per forward;
- ``+ backward wrapper``: and hvtrace's ``torch.autograd.backward`` wrapper timing the start;
- ``+ backward wrapper + 5 readings``: and hvtrace's own reading (``ThreadCounters.read``) at
  the five boundaries: the floor; the reading is the compiled one where ``hvtrace.record._hot``
  is built (``ThreadReader``), else the closure;
- ``the same, readings by the closure``: the pure-Python reading, for comparison;
- ``5 CPU-clock reads`` / ``5 schedstat preads`` (no hooks): one system call of each kind in
  place, five times, to show what a reading is made of.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("recorder_floor")

#: The goal of issue 20 for hvtrace's whole per-step cost, readings included (µs).
GOAL_PER_STEP_US = 15.0


class Variant:
    """One model and what is attached to it; :meth:`step` returns the step's CPU time (ns)."""

    def __init__(
        self,
        torch: Any,
        hooks: bool = False,
        backward: str = "none",
        reader: Callable[[], Any] | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 8)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.x = torch.randn(4, 8)
        self.backward, self.read = backward, reader
        self.bwd_start: int | None = None
        self.fwd_count = 0
        if hooks:
            self.model.register_forward_pre_hook(self._pre)
            self.model.register_forward_hook(self._post)

    def _pre(self, module: Any, args: Any) -> None:
        if self.read is not None:
            self.read()

    def _post(self, module: Any, args: Any, out: Any) -> None:
        if self.read is not None:
            self.read()
        self.fwd_count += 1
        if self.backward == "prehook":
            out.grad_fn.register_prehook(self._node_prehook)

    def _node_prehook(self, grad: Any) -> None:
        if self.bwd_start is None:
            self.bwd_start = time.monotonic_ns()

    def _backward_called(self) -> None:  # the torchpatch observer's method
        if self.bwd_start is None and self.fwd_count:
            self.bwd_start = time.monotonic_ns()

    def step(self) -> int:
        from hvtrace.record import torchpatch

        torchpatch.observers = (self,) if self.backward == "wrapper" else ()
        read = self.read
        t0 = time.thread_time_ns()
        self.opt.zero_grad()
        self.model(self.x).sum().backward()
        if read is not None:
            read()  # synchronize's entry
            read()  # and exit
        self.opt.step()
        if read is not None:
            read()  # the step's end
        t1 = time.thread_time_ns()
        torchpatch.observers = ()
        self.bwd_start, self.fwd_count = None, 0
        return t1 - t0


def make_variants(torch: Any) -> tuple[dict[str, Variant], str]:
    """The plain model and the variants (see the module), and what hvtrace's reading reads."""
    from hvtrace.record import cpustat

    counters = cpustat.ThreadCounters()
    clock = time.pthread_getcpuclockid(threading.get_ident())
    gettime = time.clock_gettime_ns
    fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    pread = os.pread
    # the same reading as the closure (HVTRACE_NATIVE=0, or where _hot is not built)
    closure = cpustat._schedstat_reader(lambda: gettime(clock), os.dup(fd), cpustat.RUNQ_SLACK_NS)

    def cpu_clock() -> int:
        return gettime(clock)

    def schedstat() -> bytes:
        return pread(fd, 64, 0)

    variants = {
        "plain": Variant(torch),
        "forward hooks": Variant(torch, hooks=True),
        "+ backward node pre-hook": Variant(torch, hooks=True, backward="prehook"),
        "+ backward wrapper": Variant(torch, hooks=True, backward="wrapper"),
        "+ backward wrapper + 5 readings": Variant(
            torch, hooks=True, backward="wrapper", reader=counters.read
        ),
        "the same, readings by the closure": Variant(
            torch, hooks=True, backward="wrapper", reader=closure
        ),
        "5 CPU-clock reads": Variant(torch, reader=cpu_clock),
        "5 schedstat preads": Variant(torch, reader=schedstat),
    }
    mode = f"{counters.mode} ({type(counters.read).__name__})"
    return variants, mode


def measure(steps: int, rounds: int) -> dict[str, Any]:
    """Per variant: the added CPU per step (µs) in each round and their median."""
    import torch

    from hvtrace.record import torchpatch

    torch.set_num_threads(1)
    torchpatch.patch_backward()  # every variant runs through it (untraced: an empty loop)
    variants, mode = make_variants(torch)
    names = list(variants)
    added: dict[str, list[float]] = {n: [] for n in names}
    plain_us: list[float] = []
    for r in range(rounds):
        times: dict[str, list[int]] = {n: [] for n in names}
        for i in range(steps + 50):
            for n in names if i % 2 == 0 else names[::-1]:
                ns = variants[n].step()
                if i >= 50:  # warm-up
                    times[n].append(ns)
        plain = times["plain"]
        plain_us.append(statistics.median(plain) / 1e3)
        for n in names:
            added[n].append(statistics.median(a - b for a, b in zip(times[n], plain)) / 1e3)
        log.info("round %d/%d done", r + 1, rounds)
    return {
        "steps": steps,
        "rounds": rounds,
        "plain_step_cpu_us": statistics.median(plain_us),
        "added_us": {n: statistics.median(v) for n, v in added.items() if n != "plain"},
        "added_us_rounds": {n: v for n, v in added.items() if n != "plain"},
        "reading_mode": mode,
    }


def print_rows(res: dict[str, Any], label: str, width: int) -> None:
    """A markdown table of ``res["added_us"]`` (µs/step per variant) and its rounds."""
    print(f"| {label:{width}s} | µs/step | rounds |")
    print(f"| {'-' * width} | ------: | ------ |")
    for n, v in res["added_us"].items():
        rounds = ", ".join(f"{x:.1f}" for x in res["added_us_rounds"][n])
        print(f"| {n:{width}s} | {v:7.1f} | {rounds} |")


def print_table(res: dict[str, Any]) -> None:
    """The figures, and the floor against issue 20's per-step goal."""
    print(
        f"\nAdded main-thread CPU per step (µs), median of paired differences against the plain "
        f"model ({res['plain_step_cpu_us']:.1f} µs/step), {res['steps']} steps x "
        f"{res['rounds']} rounds; readings: {res['reading_mode']}\n"
    )
    print_rows(res, "variant", 34)
    floor = res["added_us"]["+ backward wrapper + 5 readings"]
    verdict = "below" if floor <= GOAL_PER_STEP_US else "above"
    print(
        f"\nFloor (forward hooks + backward wrapper + 5 readings): {floor:.1f} µs/step, {verdict} "
        f"the goal of {GOAL_PER_STEP_US:.0f} µs for hvtrace's whole per-step cost."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    res = measure(args.steps, args.rounds)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
