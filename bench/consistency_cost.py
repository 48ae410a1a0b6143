"""What the consistency checks across ranks cost (:mod:`hvtrace.record.consistency`).

No Horovod needed: the checks run on a real :class:`~hvtrace.record.recorder.Recorder` (its writer
thread running) around the demo model (``hvtrace.examples.train.MLP``, 6 x 1024, 5.5 M float32
parameters, 22 MB) and a plain SGD optimizer, as the traced optimizer calls them in ``step()``:

- ``per check``: one parameter fingerprint of every tensor (CRC-32 of its bytes on the CPU), with
  its rows and span, median over ``--checks`` checks;
- ``per step``: the learning rate of each param group (every step), median per call;
- the demo model's step (forward, backward, SGD update of a 128-sample batch, one process, no
  allreduce: a lower bound of a real step, so the share below is an upper bound), median over
  ``--steps`` steps.

It prints each, and the share of the step time the checks take at every ``N`` of ``--every``
(one check per N steps plus the per-step lr rows): the default of ``HVTRACE_CONSISTENCY_EVERY``
was chosen from it. Run: ``.venv/bin/python bench/consistency_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from types import SimpleNamespace


def measure(checks: int, steps: int, threads: int) -> dict[str, float]:
    """Median µs per parameter check, per lr record, and ms per demo step."""
    import torch
    from torch import nn

    from hvtrace.examples.train import MLP
    from hvtrace.record.consistency import ConsistencyChecks
    from hvtrace.record.recorder import Recorder

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MLP(1024, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    opt._parameter_names = {p: n for n, p in model.named_parameters()}  # as Horovod's optimizer
    n_params = sum(p.numel() for p in model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(256, 10, generator=gen)

    def step() -> None:
        x = torch.randn(128, 256, generator=gen)
        y = (x @ w_true).argmax(dim=1)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    step_ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        step_ms.append((time.perf_counter() - t0) * 1e3)

    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, {"rank": 0, "run_id": "bench", "size": 1})
        tracer = SimpleNamespace(rec=rec, dist=opt, is_cuda=False, fail=rec.fail, rows=[])
        c = ConsistencyChecks(tracer, every=1)
        c.on_step(0)  # warm-up (and the parameter list)
        check_us, lr_us = [], []
        for i in range(checks):
            t0 = time.perf_counter_ns()
            c.check_params(i)
            check_us.append((time.perf_counter_ns() - t0) / 1e3)
        c.every = 0  # learning rates only
        for i in range(steps):
            t0 = time.perf_counter_ns()
            c.on_step(i)
            lr_us.append((time.perf_counter_ns() - t0) / 1e3)
        rec.close()
    return {
        "params": float(n_params),
        "tensors": float(len(list(model.parameters()))),
        "check_us": statistics.median(check_us),
        "check_us_best": min(check_us),
        "lr_us": statistics.median(lr_us),
        "step_ms": statistics.median(step_ms),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checks", type=int, default=30)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share)")
    p.add_argument("--every", default="1,10,100,1000", help="N values to print the share for")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    r = measure(args.checks, args.steps, args.threads)
    step_us = r["step_ms"] * 1e3
    print(
        f"demo model: {int(r['tensors'])} tensors, {r['params'] / 1e6:.1f} M parameters "
        f"({r['params'] * 4 / 1e6:.0f} MB), step {r['step_ms']:.1f} ms "
        f"(one process, {args.threads} thread(s), no allreduce)"
    )
    print(
        f"per check: {r['check_us']:.0f} µs (best {r['check_us_best']:.0f}; "
        f"{r['params'] * 4 / r['check_us'] / 1e3:.2f} GB/s)"
    )
    print(f"per step (learning rates): {r['lr_us']:.2f} µs")
    shares = {}
    for n in (int(x) for x in args.every.split(",")):
        share = (r["check_us"] / n + r["lr_us"]) / step_us
        shares[n] = share
        print(f"  every {n:>5} steps: {share:.3%} of the step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "share": shares}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
