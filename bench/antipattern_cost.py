"""What the anti-patterns' recording costs (issue 40): the batch fingerprint (the unsharded-data
check, :class:`hvtrace.record.consistency.BatchFingerprints`), the zero rows of embedding
gradients (sparse gradients sent dense, :class:`hvtrace.record.consistency.ZeroRows`) and a
plain optimizer's step hooks (manual gradient averaging, :mod:`hvtrace.record.plain`).

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
``HVTRACE_CONSISTENCY_EVERY=100``).

The zero rows, timed as the parameter checks run them (:meth:`ZeroRows.measure` on real
gradients, one scalar row each): an ``nn.Embedding(20000, 32)``'s dense gradient (2.4 MiB: 256
rows sampled), a 100,000 x 128 one (49 MiB: the same 256 rows, each wider), and a sparse
gradient of 20000 x 32 with 1,024 rows looked up (Horovod's ``sparse_as_dense``: its rows
counted from the indices, a 20,000-byte mark); per check, and the share of the demo step at a
check every ``N`` steps.

A plain optimizer's step hooks (a job that averages its gradients itself, traced by
environment): the demo model's step with a plain SGD, with and without
:func:`hvtrace.record.plain.install`'s hooks (torch's step pre- and post-hooks calling
:class:`~hvtrace.record.plain.PlainSteps`, the backward's return), on a tracer over a real
Recorder, interleaved; and the per-step hooks alone, called directly (what they add to every
step, the torch hook dispatch aside). With Horovod's optimizer none of this runs; what every
traced job pays is the backward wrapper's second, empty loop (timed too).

Run: ``.venv/bin/python bench/antipattern_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def _demo(threads: int) -> tuple[Any, Any, Callable[[Any], None]]:
    """The demo model (``MLP(1024, 6)``) on ``threads`` torch threads, seeded, its data's
    generator, and ``step(opt)``: one step of ``opt`` over a 128-sample batch."""
    import torch
    from torch import nn

    from hvtrace.examples.train import MLP

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MLP(1024, 6)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)
    w_true = torch.randn(256, 10, generator=gen)

    def step(opt: Any) -> None:
        x = torch.randn(128, 256, generator=gen)
        y = (x @ w_true).argmax(dim=1)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return model, gen, step


def measure(checks: int, steps: int, threads: int) -> dict[str, float]:
    """Median µs per batch check (two batch sizes), per unchecked forward, ms per demo step."""
    import torch

    from hvtrace.record.consistency import BatchFingerprints, ConsistencyChecks
    from hvtrace.record.recorder import Recorder

    model, gen, step = _demo(threads)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for _ in range(3):
        step(opt)
    step_ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(opt)
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


def measure_zero_rows(checks: int) -> dict[str, float]:
    """Median µs of one zero-rows measurement (:meth:`ZeroRows.measure`) per gradient kind."""
    import torch

    from hvtrace.record.consistency import ConsistencyChecks, ZeroRows
    from hvtrace.record.recorder import Recorder

    out: dict[str, float] = {}
    cases = (
        ("emb_dense", 20000, 32, False, False),
        ("emb_dense_big", 100_000, 128, False, False),
        ("emb_sparse", 20000, 32, True, True),
    )
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, {"rank": 0, "run_id": "bench", "size": 1}, flush_interval_s=0.05)
        for label, rows, dim, sparse, as_dense in cases:
            emb = torch.nn.Embedding(rows, dim, sparse=sparse)
            emb(torch.randint(0, rows, (64, 16))).sum().backward()  # 1,024 rows looked up
            opt = torch.optim.SGD(emb.parameters(), lr=0.1)
            opt._parameter_names = {emb.weight: "emb.weight"}
            opt.sparse_as_dense = as_dense
            tracer = SimpleNamespace(rec=rec, dist=opt, is_cuda=False, fail=rec.fail, rows=[])
            tracer.model = emb
            cc = ConsistencyChecks(tracer, every=1)
            cc._refresh()  # the parameter list, as the first check builds it
            zero = ZeroRows(cc)
            times = []
            for i in range(checks + 1):  # the first: warm-up (the row positions)
                t0 = time.perf_counter_ns()
                zero.measure(i, t0)
                if i:
                    times.append((time.perf_counter_ns() - t0) / 1e3)
            assert zero.recorded == checks + 1, f"{label}: not measured"
            out[f"zero_us_{label}"] = statistics.median(times)
            out[f"zero_us_{label}_best"] = min(times)
        rec.close()
    return out


def measure_plain_steps(steps: int, threads: int) -> dict[str, float]:
    """A plain SGD step of the demo model with and without the plain optimizer's hooks
    (interleaved), and the hooks alone called directly; ms / µs."""
    import itertools

    import torch

    from hvtrace.record import plain, torchpatch
    from hvtrace.record.optimizer import Tracer
    from hvtrace.record.recorder import Recorder

    model, _gen, step = _demo(threads)
    plain_opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    traced_opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, {"rank": 0, "run_id": "bench", "size": 1}, flush_interval_s=0.5)
        tr = Tracer.__new__(Tracer)
        tr.now, tr.read = time.monotonic_ns, (lambda: None)  # counters: not measured here
        tr.rec, tr.flags, tr.ar_flags, tr.is_cuda, tr.has_model = rec, 0, 0, False, False
        tr._grad_enabled = torch.is_grad_enabled
        tr.meta, tr.rows, tr.done_rows, tr.steps_done = {}, [], [], 0
        tr._sample_counters(0)
        tr._clear_step()
        tr.step_start = tr.step_cpu = time.monotonic_ns()
        tr.checks = tr.live = None
        tr._hooks = []
        tr.resync_clock = lambda: None  # the scheduled clock collective: no Horovod here
        steps_obj = plain.install(tr, traced_opt)
        for _ in range(3):
            step(plain_opt)
            step(traced_opt)
        base, hooked = [], []
        for i in range(steps):
            for opt, into in ((plain_opt, base), (traced_opt, hooked))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                step(opt)
                into.append((time.perf_counter() - t0) * 1e3)
        out["plain_step_ms"] = statistics.median(base)
        out["plain_step_hooked_ms"] = statistics.median(hooked)
        assert rec.step >= steps, "the hooked steps were not recorded"
        # the hooks alone, called directly (as torch calls them, around an empty update)
        times = []
        for _ in range(steps * 200):
            t0 = time.perf_counter_ns()
            steps_obj.pre(traced_opt, (), {})
            steps_obj._backward_returned()
            steps_obj.post(traced_opt, (), {})
            times.append((time.perf_counter_ns() - t0) / 1e3)
        out["plain_hooks_us"] = statistics.median(times)
        assert rec.enabled, "recording stopped: the hooks were not timed recording"
        for h in tr._hooks:
            h.remove()
        rec.close()
    # what every traced job pays: the backward wrapper's loop over the (empty) return observers
    saved = torchpatch.returns
    torchpatch.returns = ()
    ns = []
    ret = torchpatch
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in itertools.repeat(None, 100_000):
            for obs in ret.returns:
                obs._backward_returned()
        ns.append((time.perf_counter_ns() - t0) / 100_000)
    torchpatch.returns = saved
    out["empty_returns_ns"] = min(ns)
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
    z = measure_zero_rows(args.checks)
    for label, what in (
        ("emb_dense", "nn.Embedding(20000, 32) dense gradient (2.4 MiB)"),
        ("emb_dense_big", "nn.Embedding(100000, 128) dense gradient (49 MiB)"),
        ("emb_sparse", "sparse 20000 x 32 gradient, 1,024 rows looked up (sparse_as_dense)"),
    ):
        print(
            f"zero rows, {what}: {z[f'zero_us_{label}']:.1f} µs per check "
            f"(best {z[f'zero_us_{label}_best']:.1f})"
        )
    for n in (int(x) for x in args.every.split(",")):
        share = z["zero_us_emb_dense_big"] / n / step_us
        shares[f"zero_{n}"] = share
        print(f"  the 49 MiB table checked every {n:>4} steps: {share:.5%} of the demo step")
    pl = measure_plain_steps(args.steps * 2, args.threads)
    added = pl["plain_step_hooked_ms"] - pl["plain_step_ms"]
    print(
        f"plain SGD step of the demo model: {pl['plain_step_ms']:.2f} ms untraced, "
        f"{pl['plain_step_hooked_ms']:.2f} ms with the plain optimizer's hooks "
        f"({added:+.3f} ms, medians of interleaved steps)"
    )
    print(
        f"  the hooks alone, called directly: {pl['plain_hooks_us']:.1f} µs per step, "
        f"{pl['plain_hooks_us'] / (pl['plain_step_ms'] * 1e3):.4%} of the step"
    )
    print(f"the backward wrapper's empty return loop: {pl['empty_returns_ns']:.0f} ns per backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**r, **z, **pl, "share": shares}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
