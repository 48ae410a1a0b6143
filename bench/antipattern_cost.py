"""What the batch fingerprint costs (the unsharded-data check, issue 40:
:class:`hvtrace.record.consistency.BatchFingerprints`).

No Horovod needed: the hook runs on a real :class:`~hvtrace.record.recorder.Recorder` (its writer
thread running), installed on the demo model (``hvtrace.examples.train.MLP``, 6 x 1024) as the
traced optimizer installs it, and is timed the way the training loop meets it:

- ``per check``: the hook at a checked step (find the first tensor, 64 elements sampled at fixed
  positions, their CRC-32 with the shape, one scalar row), median over ``--checks`` calls, for
  the demo batch (128 x 256 float32) and an image batch (32 x 3 x 224 x 224 float32);
- ``per forward``: the hook on a step that is not checked (one comparison), median per call;
- the demo model's step (forward, backward, SGD update of a 128-sample batch, one process, no
  allreduce: a lower bound of a real step, so the share below is an upper bound).

It prints each, and the share of the step the check takes at a check every ``N`` of ``--every``
steps (one check per N steps plus the per-forward comparison; the default schedule is
``HVTRACE_CONSISTENCY_EVERY=100``). Run: ``.venv/bin/python bench/antipattern_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from types import SimpleNamespace


def measure(checks: int, steps: int, threads: int) -> dict[str, float]:
    """Median µs per batch check (two batch sizes), per unchecked forward, ms per demo step."""
    import torch
    from torch import nn

    from hvtrace.examples.train import MLP
    from hvtrace.record.consistency import BatchFingerprints, ConsistencyChecks
    from hvtrace.record.recorder import Recorder

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MLP(1024, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
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

    demo = torch.randn(128, 256, generator=gen)
    image = torch.randn(32, 3, 224, 224, generator=gen)
    out: dict[str, float] = {"step_ms": statistics.median(step_ms)}
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, {"rank": 0, "run_id": "bench", "size": 1})
        tracer = SimpleNamespace(rec=rec, dist=opt, is_cuda=False, fail=rec.fail, rows=[])
        batch = BatchFingerprints(ConsistencyChecks(tracer, every=1))
        for label, x in (("demo", demo), ("image", image)):
            args = (x,)
            times = []
            for i in range(checks + 1):  # the first: warm-up (the positions tensor of this size)
                rec.step = batch.target  # each call at a checked step
                t0 = time.perf_counter_ns()
                batch(model, args)
                if i:
                    times.append((time.perf_counter_ns() - t0) / 1e3)
            assert batch.recorded == (checks + 1) * (1 + (label == "image")), "a check was skipped"
            out[f"check_us_{label}"] = statistics.median(times)
            out[f"check_us_{label}_best"] = min(times)
        batch.target = 1 << 40  # no check due: the comparison alone
        times = []
        for _ in range(steps * 100):
            t0 = time.perf_counter_ns()
            batch(model, (demo,))
            times.append((time.perf_counter_ns() - t0) / 1e3)
        out["forward_us"] = statistics.median(times)
        rec.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--checks", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share)")
    p.add_argument("--every", default="1,10,100", help="N values to print the share for")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    r = measure(args.checks, args.steps, args.threads)
    step_us = r["step_ms"] * 1e3
    print(f"demo step: {r['step_ms']:.1f} ms (one process, {args.threads} thread(s), no allreduce)")
    for label, what in (("demo", "128 x 256 float32"), ("image", "32 x 3 x 224 x 224 float32")):
        print(
            f"per check, {what} batch: {r[f'check_us_{label}']:.1f} µs "
            f"(best {r[f'check_us_{label}_best']:.1f})"
        )
    print(f"per forward without a check: {r['forward_us']:.2f} µs")
    shares = {}
    for n in (int(x) for x in args.every.split(",")):
        share = (r["check_us_demo"] / n + r["forward_us"]) / step_us
        shares[n] = share
        print(f"  a check every {n:>4} steps: {share:.4%} of the demo step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, "share": shares}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
