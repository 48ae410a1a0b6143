"""Where a traced step's extra time goes, phase by phase: wall clock, CPU and context switches.

    .venv/bin/python bench/inrun_phases.py [--arms P,Q,T,C,N] [--seconds 25] [--warmup-s 8]
        [--size 3ms] [--gc-off] [--json PATH]

``bench/wallclock.py --inrun`` gives a traced step's cost as one ratio; this splits it. One job
under real ``horovodrun -np 2 --gloo`` (``wallclock.py``'s: each rank pinned to a core of its own,
``HOROVOD_CYCLE_TIME=0.1``, its model presets) with ``floor`` settings (the writer put off; live
detection, the consistency checks and the stall watchdog off: the training path alone) trains
several identical models, one per arm, their steps taking turns in a new random order every turn
(the same order on every rank):

- ``P``, ``Q``: Horovod's optimizer (``Q``, a second one: an A/A control, what the design reads
  as a difference where there is none);
- ``T``: hvtrace's, as shipped (the CPU counters on one step in k at short steps,
  ``$HVTRACE_COUNTERS_MS``);
- ``C``: hvtrace's, the CPU counters read on every step (five readings, ten system calls);
- ``K``: hvtrace's, the counters at the default before 29 Nov 2026 (``HVTRACE_COUNTERS_MS=20``:
  at 3-5 ms steps, one step in 4);
- ``N``: hvtrace's, the counters never read (its reading replaced by a call that returns None:
  not a configuration a user can choose);
- ``O``: hvtrace's, the in-flight allreduces not polled during the backward
  (``HVTRACE_POLL_US=1000000``);
- ``D``: ``T``'s model and optimizer with recording switched off on its turns (the hooks
  installed, returning at once: what they cost as mechanisms);
- ``H``: Horovod's, with no-op Python forward hooks on the model (PyTorch's hooked call path);
- ``Y``: ``T`` with three no-op Python calls more a step (a pre-hook with keyword arguments on the
  model, a Python method around ``step``, one around the recorder's ``extend``): what a Python
  frame at a step's boundaries costs;
- ``M``: hvtrace's without ``model=`` (no forward hooks: the step's compute is one span, not
  input, forward and backward).

Each step is timed at ``zero_grad``, forward with the loss, backward and ``step()``; within the
step, Horovod's ``synchronize`` (the wait for the allreduces) and the parts around it (``pre``:
before Horovod's ``step``; ``to_sync``: from there to its ``synchronize``; ``sync_to_end``: the
update after it; ``post``: after Horovod's ``step`` returned). Per part: wall time, the training
thread's CPU time (``time.thread_time_ns``) and its involuntary context switches
(``getrusage(RUSAGE_THREAD)``). Printed per rank: each arm's medians, and the median over turns
of each arm's difference from ``P``, part by part. ``--gc-off`` disables Python's collector in
the ranks (its collections fall on whichever arm allocates last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wallclock

WORKER = r"""
import json, os, random, resource, sys, time
import torch, horovod.torch as hvd

width, layers, batch, seconds, out = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
    float(sys.argv[4]), sys.argv[5])
arms = sys.argv[6].split(",")
hvd.init()
import gc
if os.environ.get("INRUN_GC_OFF") == "1":
    gc.disable()
torch.set_num_threads(1)


%(net)s

import hvtrace

TRACED = set("TCKNOMY")
models, opts = {}, {}
for a in arms:  # the arms made in the order given
    if a == "D":
        continue
    m = net()
    named = [(a + "." + n, p) for n, p in m.named_parameters()]
    sgd = torch.optim.SGD(m.parameters(), lr=0.001)
    if a in TRACED:
        if a == "O":
            os.environ["HVTRACE_POLL_US"] = "1000000"
        o = hvtrace.DistributedOptimizer(sgd, named_parameters=named,
                                         model=None if a == "M" else m,
                                         trace_dir=os.path.join(out, "trace" + a))
        os.environ.pop("HVTRACE_POLL_US", None)
        if a == "C":
            o._hvtrace._sample_counters(0)  # every step
        elif a == "K":
            o._hvtrace._sample_counters(20_000_000)  # the default until 29 Nov 2026
        elif a == "N":
            o._hvtrace.read = type(None)  # a compiled call that returns None: no reading
        elif a == "Y":
            import types
            m.register_forward_pre_hook(lambda mod, args, kwargs: None, with_kwargs=True)
            _step = o.step
            o.step = types.MethodType(lambda self, *x, **k: _step(*x, **k), o)
            _ext = o._hvtrace.rec.extend
            o._hvtrace.rec.extend = lambda entries: _ext(entries)
    else:
        o = hvd.DistributedOptimizer(sgd, named_parameters=named)
        if a == "H":
            m.register_forward_pre_hook(lambda mod, args: None)
            m.register_forward_hook(lambda mod, args, out: None)
    models[a], opts[a] = m, o
if "D" in arms:
    models["D"], opts["D"] = models["T"], opts["T"]
for m in models.values():
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)

pc, tt = time.perf_counter_ns, time.thread_time_ns
SYNC = [0, 0]  # wall, CPU in Horovod's synchronize this step
EV = {}  # CPU time at entry and exit of Horovod's step and synchronize


def timed(f, tag):
    def wrapper(*a, **k):
        EV[tag + "0"] = tt()
        t0, c0 = pc(), tt()
        try:
            return f(*a, **k)
        finally:
            if tag == "sync":
                SYNC[0] += pc() - t0
                SYNC[1] += tt() - c0
            EV[tag + "1"] = tt()
    return wrapper


for a, o in opts.items():
    tr = getattr(o, "_hvtrace", None)
    if tr is not None:
        if not getattr(tr, "_timed", False):  # (D shares T's)
            tr._orig_sync = timed(tr._orig_sync, "sync")
            tr._orig_step = timed(tr._orig_step, "step")
            tr._timed = True
    else:
        o.synchronize, o.step = timed(o.synchronize, "sync"), timed(o.step, "step")

x = torch.randn(batch, width)
y = torch.randint(0, 10, (batch,))
lossf = torch.nn.CrossEntropyLoss()
rng = random.Random(1)  # the same order on every rank
ru, RT = resource.getrusage, resource.RUSAGE_THREAD
rows = []
start = time.perf_counter()
stop = torch.zeros(1)
turn = 0
while True:
    order = arms[:]
    rng.shuffle(order)
    for a in order:
        model, opt = models[a], opts[a]
        if "D" in arms and a in ("T", "D"):
            opts["T"]._hvtrace.rec.enabled = a == "T"
        SYNC[0] = SYNC[1] = 0
        marks = []

        def mark():
            marks.append((pc(), tt(), ru(RT).ru_nivcsw))

        mark()
        opt.zero_grad()
        mark()
        loss = lossf(model(x), y)
        mark()
        loss.backward()
        mark()
        opt.step()
        mark()
        parts = [[marks[i + 1][j] - marks[i][j] for j in range(3)] for i in range(4)]
        parts.append([SYNC[0], SYNC[1], 0])
        parts.append([EV["step0"] - marks[3][1], EV["sync0"] - EV["step0"],
                      EV["step1"] - EV["sync1"], marks[4][1] - EV["step1"]])
        rows.append((turn, a, parts, time.perf_counter() - start))
    if "D" in arms:
        opts["T"]._hvtrace.rec.enabled = True
    turn += 1
    if turn % 20 == 0:  # rank 0 says when to stop, through an allreduce every rank takes
        stop[0] = 1.0 if (hvd.rank() == 0 and time.perf_counter() - start > seconds) else 0.0
        if float(hvd.allreduce(stop, op=hvd.Sum, name="inrun_phases.stop")) > 0:
            break
# each traced arm's counters at the end: one step in how many read them, and how many readings
counters = {a: {"every": o._hvtrace.counter_every, "steps": o._hvtrace.steps_done,
                "exact_reads": getattr(o._hvtrace.read, "exact_reads", None)}
            for a, o in opts.items() if a in TRACED}
if TRACED & set(arms):
    hvtrace.finish()
with open(os.path.join(out, f"rows{hvd.rank()}.json"), "w") as f:
    json.dump({"rows": rows, "counters": counters}, f)
"""

WORKER = WORKER.replace("%(net)s", wallclock.NET)

PHASES = ("zero_grad", "forward", "backward", "step", "sync")
STEP_PARTS = ("pre", "to_sync", "sync_to_end", "post")


def summarize(rows: list, arms: list[str], warmup_s: float) -> dict[str, Any]:
    """One rank's rows: per arm, each phase's medians (µs; switches: mean per step), and per arm
    but ``P`` the median over turns of its difference from ``P``, phase by phase."""
    turns: dict[int, dict[str, Any]] = {}
    for turn, arm, parts, t in rows:
        if t >= warmup_s:
            turns.setdefault(turn, {})[arm] = parts
    whole = [v for v in turns.values() if len(v) == len(arms)]
    out: dict[str, Any] = {"turns": len(whole), "arms": {}, "vs_P": {}}
    for a in arms:
        sel = [v[a] for v in whole]
        out["arms"][a] = {
            ph: {"wall_us": statistics.median(s[i][0] for s in sel) / 1e3,
                 "cpu_us": statistics.median(s[i][1] for s in sel) / 1e3,
                 "switches": statistics.fmean(s[i][2] for s in sel)}
            for i, ph in enumerate(PHASES)
        }  # fmt: skip
        out["arms"][a]["step_wall_us"] = (
            statistics.median(sum(s[i][0] for i in range(4)) for s in sel) / 1e3
        )
        if a == "P" or "P" not in arms:
            continue
        d: dict[str, Any] = {}
        for i, ph in enumerate(PHASES):
            d[ph] = {
                "wall_us": statistics.median(v[a][i][0] - v["P"][i][0] for v in whole) / 1e3,
                "cpu_us": statistics.median(v[a][i][1] - v["P"][i][1] for v in whole) / 1e3,
                "switches": statistics.fmean(v[a][i][2] - v["P"][i][2] for v in whole),
            }
        d["total"] = {
            k: statistics.median(sum(v[a][i][j] - v["P"][i][j] for i in range(4)) for v in whole)
            / 1e3
            for j, k in ((0, "wall_us"), (1, "cpu_us"))
        }
        d["step_parts_cpu_us"] = {
            p: statistics.median(v[a][5][j] - v["P"][5][j] for v in whole) / 1e3
            for j, p in enumerate(STEP_PARTS)
        }
        out["vs_P"][a] = d
    return out


def print_rank(r: int, s: dict[str, Any]) -> None:
    print(f"\nrank {r}: {s['turns']} turns; medians per step (µs; switches: involuntary, mean)")
    for a, c in s.get("counters", {}).items():
        print(f"  {a}: CPU counters on one step in {c['every']} at the end, {c['exact_reads']} "
              f"clock reads over {c['steps']} steps")  # fmt: skip
    print("| arm | " + " | ".join(PHASES) + " | step (wall) |")
    print("| --- |" + " --- |" * (len(PHASES) + 1))
    for a, ph in s["arms"].items():
        cells = [f"{ph[p]['wall_us']:.0f} w, {ph[p]['cpu_us']:.0f} c, {ph[p]['switches']:.2f} sw"
                 for p in PHASES]  # fmt: skip
        print(f"| {a} | " + " | ".join(cells) + f" | {ph['step_wall_us']:.0f} |")
    if not s["vs_P"]:
        return
    print("\ndifference from P, median over turns (µs; switches: mean)")
    print("| arm | " + " | ".join(PHASES) + " | step: wall, CPU | CPU in step: "
          + ", ".join(STEP_PARTS) + " |")  # fmt: skip
    print("| --- |" + " --- |" * (len(PHASES) + 2))
    for a, d in s["vs_P"].items():
        cells = [f"{d[p]['wall_us']:+.0f} w, {d[p]['cpu_us']:+.0f} c, {d[p]['switches']:+.2f} sw"
                 for p in PHASES]  # fmt: skip
        parts = ", ".join(f"{d['step_parts_cpu_us'][p]:+.1f}" for p in STEP_PARTS)
        print(
            f"| {a} | "
            + " | ".join(cells)
            + f" | {d['total']['wall_us']:+.0f}, {d['total']['cpu_us']:+.0f} | {parts} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arms", default="P,Q,T,C,K,N", help="of P, Q, T, C, K, N, O, D, H, M, Y (see above)"
    )
    ap.add_argument("--seconds", type=float, default=25.0, help="measured after --warmup-s")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--size", default="3ms", choices=sorted(wallclock.SIZES))
    ap.add_argument("--gc-off", action="store_true", help="Python's collector off in the ranks")
    ap.add_argument("--cycle-ms", type=float, default=0.1, help="HOROVOD_CYCLE_TIME")
    ap.add_argument("--mode", default="floor", choices=sorted(m for m, v in wallclock.MODES.items()
                                                              if v is not None),
                    help="wallclock.py's mode whose settings the traced arms run with (floor: "
                         "the training path alone; defaults: live detection, the writer and the "
                         "checks too: one traced arm, then)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in "PQTCKNODHMY" or len(a) != 1]
    if bad or len(set(arms)) != len(arms) or ("D" in arms and "T" not in arms):
        ap.error(f"--arms: letters of PQTCKNODHMY, each once (D needs T): {args.arms}")
    width, layers, batch = wallclock.SIZES[args.size]
    if args.mode != "floor" and len(set(arms) & set("TCKNOMY")) > 1:
        ap.error("--mode other than floor: one traced arm (live detection is one per process)")
    env = wallclock._env(args.cycle_ms, {**(wallclock.MODES[args.mode] or {}),
                                         "INRUN_GC_OFF": "1" if args.gc_off else "0"})  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hvtrace-inrun-phases-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        total = args.warmup_s + args.seconds
        wallclock._job(script, [str(width), str(layers), str(batch), str(total), tmp,
                                ",".join(arms)], env, True, total * 8 + 200,
                       "inrun_phases")  # fmt: skip
        ranks = [json.loads((Path(tmp) / f"rows{r}.json").read_text()) for r in (0, 1)]
    res = {f"rank{r}": summarize(d["rows"], arms, args.warmup_s) for r, d in enumerate(ranks)}
    for r, d in enumerate(ranks):
        res[f"rank{r}"]["counters"] = d["counters"]
    gc_note = ", collector off" if args.gc_off else ""
    print(f"{args.size} model, arms {','.join(arms)}, {args.mode} settings, "
          f"{args.seconds:g} s after {args.warmup_s:g} s{gc_note}")  # fmt: skip
    for r in (0, 1):
        print_rank(r, res[f"rank{r}"])
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
