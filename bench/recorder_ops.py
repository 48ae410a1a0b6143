"""How much Python the recorder runs on the training thread: bytecodes and frames per step and
per allreduce, counted (not timed), so the figure is the same on any machine and any load.

    .venv/bin/python bench/recorder_ops.py [--steps 200] [--tensors 2,20] [--json PATH]

A one-rank Horovod job in this process (``HOROVOD_ELASTIC=1`` makes Horovod register its gradient
hooks with one rank, as ``format_bench.py``'s child does) trains a model of ``Linear(8, 8)``
layers under ``hvtrace.DistributedOptimizer(model=...)``; after a warm-up, ``sys.settrace`` with
``f_trace_opcodes`` counts every bytecode executed in a frame of hvtrace's code, per function.
Two models (``--tensors``: gradient tensors each) give a line: its slope is the Python per
allreduce, its intercept the Python per step. hvtrace's compiled parts (the per-allreduce
wrapper, the counter reading) run no bytecode and are not counted; PyTorch's and Horovod's code
is not counted either.

Timing figures are ``format_bench.py`` (the added CPU, noisy: rounds spread 2-3x on a 2-core
machine) and ``recorder_floor.py`` (what the mechanisms under the recorder cost); this one tells
whether a change to the bookkeeping removed work, whatever the machine's noise (on the
development machine, about 12 ns of a real step per bytecode counted: bench/README.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HOROVOD_ELASTIC", "1")  # gradient hooks with one rank (before Horovod)
os.environ.setdefault("HOROVOD_CYCLE_TIME", "0.01")


def count(tensors: int, steps: int, trace_dir: str) -> dict[str, Any]:
    """Bytecodes and frames per step in hvtrace's code, in total and per function."""
    import torch
    from torch import nn

    import hvtrace

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(tensors // 2)])
    opt = hvtrace.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=[(f"m{tensors}.{n}", p) for n, p in model.named_parameters()],
        trace_dir=trace_dir,
        model=model,
    )
    x = torch.randn(4, 8)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    for _ in range(30):  # warm-up: first allreduces learn their tensors, clock round trips
        step()
    ops: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    root = os.path.dirname(os.path.abspath(hvtrace.__file__))

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not code.co_filename.startswith(root):
            return None
        key = f"{os.path.relpath(code.co_filename, root)}:{code.co_name}"
        if event == "call":
            frames[key] += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            ops[key] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(None)
    hvtrace.finish(sync_clock=False)
    return {
        "tensors": sum(1 for _ in model.parameters()),
        "ops_per_step": sum(ops.values()) / steps,
        "frames_per_step": sum(frames.values()) / steps,
        "by_function": {
            k: {"ops": v / steps, "frames": frames[k] / steps} for k, v in ops.most_common()
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="counted steps per model")
    p.add_argument("--tensors", default="2,20", help="gradient tensors of the two models")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    lo, hi = (int(t) for t in args.tensors.split(","))
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hvtrace-ops-") as tmp:
        a = count(lo, args.steps, os.path.join(tmp, "lo"))
        b = count(hi, args.steps, os.path.join(tmp, "hi"))
    per_ar = (b["ops_per_step"] - a["ops_per_step"]) / (b["tensors"] - a["tensors"])
    per_step = a["ops_per_step"] - per_ar * a["tensors"]
    frames_ar = (b["frames_per_step"] - a["frames_per_step"]) / (b["tensors"] - a["tensors"])
    print(
        f"hvtrace's Python on the training thread: {per_step:.0f} bytecodes per step "
        f"({a['frames_per_step'] - frames_ar * a['tensors']:.1f} frames) + {per_ar:.1f} per "
        f"allreduce ({frames_ar:.2f} frames)\n"
    )
    print(f"per function, {a['tensors']}-tensor model, per step:")
    print(f"| {'function':44s} | bytecodes | frames |")
    print(f"| {'-' * 44} | --------: | -----: |")
    for k, v in a["by_function"].items():
        print(f"| {k:44s} | {v['ops']:9.1f} | {v['frames']:6.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lo": a, "hi": b, "per_step": per_step, "per_allreduce": per_ar}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
