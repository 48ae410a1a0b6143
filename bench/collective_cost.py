"""What recording a collective outside the optimizer costs: ``hvd.allreduce`` of a metric.

``--micro`` times hvtrace's wrapper alone (no Horovod: around a function that returns at once),
which is what it adds to each call. Otherwise run it under horovodrun (the collectives are real):

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python bench/collective_cost.py

Each rank builds a traced optimizer (so hvtrace's collective wrappers are installed), then times
``--calls`` blocking ``hvd.allreduce`` calls of a one-element tensor (a metric) per round,
alternating rounds with recording on and off (``Recorder.enabled``: the wrappers pass straight
through when it is off), for ``--rounds`` rounds. Rank 0 prints the median µs per call of each
and the difference: the cost hvtrace adds to each collective, measured side by side. A Gloo
allreduce on one host takes tens of µs, so the difference is small against the noise; the
median over rounds is the figure, and the spread is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def micro(calls: int, rounds: int) -> dict[str, float]:
    """The wrapper's own cost, without Horovod: hvtrace's wrapper around a function that returns
    at once, called like ``hvd.allreduce(tensor, name=...)``, against the bare function; the
    spans go into a real Recorder (whose writer thread runs). Best and median ns per call."""
    import types

    import torch

    from hvtrace.record import collectives
    from hvtrace.record.cpustat import ThreadCounters
    from hvtrace.record.recorder import Recorder

    with tempfile.TemporaryDirectory() as d:
        counters = ThreadCounters()
        rec = Recorder(d, {"rank": 0, "run_id": "bench", "size": 1}, counters=counters)
        tracer = types.SimpleNamespace(rec=rec, phase_now=lambda: "input", fail=rec.fail)
        tracer.in_collective = None
        collectives._target = tracer

        def bare(tensor, average=None, name=None, op=None):
            return tensor

        wrapped = collectives._wrap(bare, "allreduce", "allreduce", True, "reduce")
        x = torch.ones(1)
        out: dict[str, list[float]] = {"bare": [], "traced": []}
        for _ in range(rounds):
            for label, fn in (("bare", bare), ("traced", wrapped)):
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    fn(x, name="metric")
                out[label].append((time.perf_counter_ns() - t0) / calls)
                rec._buf.clear()
        collectives._target = None
        rec.close()
    res = {f"{k}_ns_best": min(v) for k, v in out.items()}
    res |= {f"{k}_ns_median": statistics.median(v) for k, v in out.items()}
    res["added_ns_median"] = res["traced_ns_median"] - res["bare_ns_median"]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--micro",
        action="store_true",
        help="time the wrapper around a function that returns at once (no Horovod, no "
        "horovodrun): what hvtrace adds to each call, without the collective's noise",
    )
    args = p.parse_args(argv)
    if args.micro:
        res = micro(args.calls, args.rounds)
        print(f"hvtrace's wrapper, {args.rounds} rounds of {args.calls} calls:")
        for k in ("bare", "traced"):
            med, best = res[f"{k}_ns_median"] / 1e3, res[f"{k}_ns_best"] / 1e3
            print(f"  {k:<7} {med:7.2f} µs/call (best {best:.2f})")
        print(f"  added   {res['added_ns_median'] / 1e3:7.2f} µs/call")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0

    import horovod.torch as hvd
    import torch

    import hvtrace

    hvd.init()
    model = torch.nn.Linear(4, 4)
    with tempfile.TemporaryDirectory() as d:
        opt = hvtrace.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            trace_dir=d,
        )
        tracer = opt._hvtrace
        x = torch.ones(1)
        per_call: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * args.rounds):
            on = i % 2 == 0
            tracer.rec.enabled = on
            hvd.allreduce(x, name="warm")  # every rank switches before timing
            t0 = time.perf_counter_ns()
            for _ in range(args.calls):
                hvd.allreduce(x, name="metric")
            per_call[on].append((time.perf_counter_ns() - t0) / args.calls / 1e3)
            tracer.rec._buf.clear()  # nothing accumulates between rounds
        tracer.rec.enabled = True
        hvtrace.finish()
    if hvd.rank() == 0:
        on, off = statistics.median(per_call[True]), statistics.median(per_call[False])
        out = {
            "ranks": hvd.size(),
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "traced_us_per_call": on,
            "untraced_us_per_call": off,
            "added_us_per_call": on - off,
            "traced_spread_us": [min(per_call[True]), max(per_call[True])],
            "untraced_spread_us": [min(per_call[False]), max(per_call[False])],
        }
        print(f"hvd.allreduce of 1 float, {hvd.size()} ranks, {args.rounds} rounds each:")
        for label, key in (("traced  ", True), ("untraced", False)):
            xs = per_call[key]
            med = statistics.median(xs)
            print(f"  {label} {med:8.2f} µs/call (rounds {min(xs):.2f}..{max(xs):.2f})")
        print(f"  added    {on - off:8.2f} µs/call")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
