#!/usr/bin/env python
"""Benchmark the recording overhead of hvtrace on real training, against the alternatives.

Runs the demo training (``horovodrun -np 2 -H localhost:2 --gloo python -m
hvtrace.examples.train``) in several modes, interleaved over rounds in one invocation (round-robin,
rotating which mode goes first each round, so slow drifts of the machine hit every mode alike):

* ``untraced``: ``hvd.DistributedOptimizer`` as is (``--no-trace``), the baseline;
* ``hvtrace``: ``hvtrace.DistributedOptimizer(model=...)`` writing its trace files;
* ``timeline``: untraced optimizer, Horovod's own timeline (``HOROVOD_TIMELINE=<file>``);
* ``torch_profiler``: untraced optimizer, the loop under ``torch.profiler`` (CPU activity),
  one Chrome trace exported per rank.

Each rank times every step with ``time.perf_counter`` (``--step-times``). Per run: the per-step
mean over ranks, first ``--warmup`` steps skipped, median over steps ("run median"). Per mode:
the median over rounds of the run medians; the overhead is the per-round ratio to the same
round's untraced run (median over rounds, with min..max over rounds as the spread); bytes per
step are all files the mode wrote (all ranks) divided by the steps. Each run also reports its
ranks' process CPU time over the loop per step, a figure less disturbed by other load.

Separate processes differ by several percent from run to run on a small shared machine (where
each rank lands, how Gloo's threads interleave), which hides a 1% effect even over many rounds.
So the benchmark also runs an **in-run A/B** per model (``--ab-steps``): one hvtrace run in which
recording is switched off and on every ``--ab-every`` steps on all ranks (the demo's
``--ab-every``), and compares each untraced block with the traced block after it. That measures
what recording adds (hot-path work, the writer thread) in the same processes; the cost of
merely having the wrappers installed (one attribute test per call while switched off) stays on
both sides. hvtrace's writer thread also reports its own CPU time.

Because the in-run A/B cannot see what having hvtrace installed costs (its imports, the clock
round trips at start, the writer thread, the compaction at the end, the wrappers), the rounds
also give **whole-process** figures per rank, untraced vs hvtrace: process CPU time per step over
the loop, CPU time of the whole job, and peak RSS (``ru_maxrss``), each as per-round paired
differences (median over rounds, with a distribution-free 95% interval of that median). Every
rank runs under a small launcher (:data:`RANK_CHILD`) that measures it from the inside; in the
untraced modes it replaces ``hvtrace`` by a stub, so the baseline is a rank without hvtrace at
all (mode ``imported``: hvtrace imported, Horovod's optimizer, to separate the import's share).

Usage: ``python bench/overhead.py [--model small,large,deep|both|all] [--rounds 10]
[--steps 200]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("overhead")

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "hvtrace" / "examples" / "train.py"
#: Every mode; ``imported`` (hvtrace imported, Horovod's optimizer) and ``installed`` (hvtrace's
#: optimizer with recording switched off from the start) only when asked for.
MODES: tuple[str, ...] = (
    "untraced",
    "hvtrace",
    "timeline",
    "torch_profiler",
    "imported",
    "installed",
)
DEFAULT_MODES: tuple[str, ...] = ("untraced", "hvtrace", "timeline", "torch_profiler")
#: Modes whose ranks see a stub instead of hvtrace: the demo runs as if it were not installed.
STUBBED = ("untraced", "timeline", "torch_profiler")

#: Model sizes. ``small`` and ``large``: the demo's MLP (``layers`` hidden layers, 2 * layers + 2
#: gradient tensors). ``deep``: a residual stack of small blocks (LayerNorm + Linear, built by
#: the rank launcher in place of the demo's MLP; 4 * layers + 4 gradient tensors), for the
#: per-tensor costs. On the 2-core development machine with 2 ranks (one torch thread each),
#: quiet, "small" measured 14-20 ms per step, "large" about 100 ms and "deep" 30-35 ms (Horovod's
#: per-tensor work dominates: its forward and backward alone take 8-9 ms); the measured step
#: time is always reported next to the figures.
MODELS: dict[str, dict[str, Any]] = {
    "small": {"width": 384, "layers": 6, "batch_size": 64, "net": "mlp"},
    "large": {"width": 1024, "layers": 6, "batch_size": 96, "net": "mlp"},
    "deep": {"width": 32, "layers": 37, "batch_size": 16, "net": "deep"},
}

#: hvtrace's overhead goals per model (percent of the untraced step time).
GOAL_OVERHEAD_PCT = {"small": 3.0, "large": 1.0, "deep": 3.0}
#: Whole-process goals, untraced vs hvtrace (issue 20): added process CPU time per step over the
#: loop (percent, at ~15 ms steps), and added peak RSS per rank (MB).
GOAL_CPU_PCT = 1.5
GOAL_RSS_MB = 35.0
#: Modes compared with ``untraced`` in the whole-process table.
WHOLE_MODES = ("hvtrace", "imported", "installed")


def grad_tensors(model: str) -> int:
    """Return the number of gradient tensors of ``model`` (what Horovod allreduces per step)."""
    size = MODELS[model]
    if size["net"] == "deep":
        return 4 * size["layers"] + 4
    return 2 * size["layers"] + 2


#: The rank launcher: horovodrun runs ``python rank_child.py SPEC`` (written into the work
#: directory) on every rank; it runs the demo's ``main`` and writes what it measured.
RANK_CHILD = r'''"""hvtrace overhead benchmark: one rank of the demo training, measured inside.

Written by bench/overhead.py into its work directory and run by horovodrun on every rank as
``python rank_child.py SPEC_JSON`` (SPEC: train.py's path, its argv, where to write, whether to
replace hvtrace by a stub, which network). It imports nothing heavy of its own (no numpy): what
it measures is torch, Horovod, the demo and, in the traced modes, hvtrace.
"""

import json
import os
import resource
import sys
import threading
import time
import types

T0 = time.perf_counter()
SPEC = json.loads(sys.argv[1])
MARKS = []
if SPEC.get("pin"):  # each rank (every thread it starts from here on) on one CPU of its own
    _cpus = sorted(os.sched_getaffinity(0))
    _local = int(os.environ.get("HOROVOD_LOCAL_RANK", "0")) + SPEC.get("cpu_offset", 0)
    os.sched_setaffinity(0, {_cpus[_local % len(_cpus)]})


def _status_mb(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return -1.0


TICK = os.sysconf("SC_CLK_TCK")


WAIT_CPU = [0.0]  # the main thread's CPU time inside Horovod's per-handle waits (s)


def _task_cpu_s(tid):
    """A thread's CPU time (s): schedstat's first field (ns; it lags a running thread by up to a
    tick), else /proc's stat in ticks (10 ms: too coarse for hvtrace's threads' few ms a run);
    None when the thread has ended."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread ended meanwhile
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu():
    """CPU time (s) per kind of thread: the main thread (its own clock; and the part of it spent
    inside Horovod's waits), hvtrace's threads (writer, live detection, stall watch: named
    ``hvtrace-*``), all others."""
    writers = {t.native_id for t in threading.enumerate() if t.name.startswith("hvtrace-")}
    out = {"main": time.thread_time(), "writer": 0.0, "other": 0.0, "wait": WAIT_CPU[0]}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        if int(tid) == os.getpid():
            continue
        cpu = _task_cpu_s(tid)
        if cpu is not None:
            out["writer" if int(tid) in writers else "other"] += cpu
    return out


def mark(tag):
    """Record peak RSS, current RSS, process CPU and threads at this point of the rank's life."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    MARKS.append(
        {
            "at": tag,
            "maxrss_mb": ru.ru_maxrss / 1024.0,
            "rss_mb": _status_mb("VmRSS"),
            "rss_file_mb": _status_mb("RssFile"),
            "cpu_s": ru.ru_utime + ru.ru_stime,
            "wall_s": time.perf_counter() - T0,
            "threads": threading.active_count(),
            "thread_cpu_s": thread_cpu(),
        }
    )


mark("start")
import torch  # noqa: E402
from torch import nn  # noqa: E402

mark("import torch")
import horovod.torch as hvd  # noqa: E402
import horovod.torch.optimizer as _hopt  # noqa: E402

mark("import horovod")
# Horovod's optimizer waits for each handle in ``synchronize(handle)``; its C++ wait spins
# (release the GIL, sched_yield, take it back, poll), so the main thread's CPU there is about the
# wall time it waits. Timed here, before hvtrace wraps the same name (its own work stays outside).
_horovod_sync = _hopt.synchronize


def _timed_sync(handle):
    t0 = time.thread_time()
    try:
        return _horovod_sync(handle)
    finally:
        WAIT_CPU[0] += time.thread_time() - t0


_hopt.synchronize = _timed_sync


class _NoSpan:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stub():
    """A stand-in ``hvtrace`` module: the demo runs as if hvtrace were not installed."""
    m = types.ModuleType("hvtrace")
    m.span = _NoSpan
    m.scalar = lambda *a, **k: None
    m.finish = lambda *a, **k: None

    def no_optimizer(*a, **k):
        raise RuntimeError("hvtrace is stubbed out in this run (untraced mode)")

    m.DistributedOptimizer = no_optimizer
    return m


if SPEC["stub"]:
    hvt = sys.modules["hvtrace"] = _stub()
else:
    if SPEC["repo"] not in sys.path:
        sys.path.insert(0, SPEC["repo"])
    import hvtrace as hvt

    mark("import hvtrace")


def _around(owner, name, before, after):
    inner = getattr(owner, name)

    def wrapped(*a, **k):
        mark(before)
        try:
            return inner(*a, **k)
        finally:
            mark(after)

    setattr(owner, name, wrapped)


# the optimizer the demo builds: hvtrace's (which calls Horovod's inside), else Horovod's
traced = "--no-trace" not in SPEC["argv"]
if SPEC.get("recording_off"):  # mode installed: hvtrace's wrappers and writer, recording off
    _build = hvt.DistributedOptimizer

    def _built_off(*a, **k):
        opt = _build(*a, **k)
        opt._hvtrace.rec.enabled = False
        return opt

    hvt.DistributedOptimizer = _built_off
_around(hvt if traced else hvd, "DistributedOptimizer", "optimizer", "optimizer built")
_around(hvt, "finish", "loop end", "finish")
STEP_CPU = []  # the main thread's CPU time at each step's end: the demo's one scalar per step
STEP_WAIT = []  # ... and the part of it inside Horovod's waits so far
_scalar = hvt.scalar


def _timed_scalar(*a, **k):
    out = _scalar(*a, **k)
    STEP_CPU.append(time.thread_time())
    STEP_WAIT.append(WAIT_CPU[0])
    return out


hvt.scalar = _timed_scalar
# the demo's last call before its loop
_around(hvd, "broadcast_optimizer_state", "parameters broadcast", "loop start")


class DeepNet(nn.Module):
    """A residual stack of small blocks (LayerNorm + Linear): 4 + 4 * layers gradient tensors."""

    def __init__(self, width=64, layers=37, in_dim=256):
        super().__init__()
        self.inp = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + torch.relu(b(x))
        return self.head(x)


import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location("hvtrace_demo_train", SPEC["train"])
train = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = train
spec.loader.exec_module(train)
if SPEC["net"] == "deep":
    train.MLP = DeepNet
mark("ready")
code = train.main(SPEC["argv"])
mark("end")
ru = resource.getrusage(resource.RUSAGE_SELF)
rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
pool = None
if "pyarrow" in sys.modules:
    pa = sys.modules["pyarrow"]
    pool = {
        "backend": pa.default_memory_pool().backend_name,
        "allocated_mb": pa.total_allocated_bytes() / 2**20,
        "max_mb": pa.default_memory_pool().max_memory() / 2**20,
    }
heavy = ("numpy", "pyarrow", "pyarrow.parquet", "pyarrow.compute", "pandas", "hvtrace.load")
record = {
    "rank": rank,
    "maxrss_mb": ru.ru_maxrss / 1024.0,
    "hwm_mb": _status_mb("VmHWM"),
    "cpu_s": ru.ru_utime + ru.ru_stime,
    "user_s": ru.ru_utime,
    "sys_s": ru.ru_stime,
    "wall_s": time.perf_counter() - T0,
    "marks": MARKS,
    "modules": [m for m in heavy if m in sys.modules],
    "n_modules": len(sys.modules),
    "arrow_pool": pool,
    "step_cpu_s": [b - a for a, b in zip(STEP_CPU, STEP_CPU[1:])],
    "step_wait_s": [b - a for a, b in zip(STEP_WAIT, STEP_WAIT[1:])],
}
with open(SPEC["out"].replace("{rank}", str(rank)), "w") as f:
    json.dump(record, f)
sys.exit(code)
'''


@dataclass
class RunResult:
    """One training run: its mode, per-step times (mean over ranks, s) and what it wrote."""

    model: str
    mode: str
    round: int
    step_s: list[float]
    bytes: int
    files: int
    finish_s: float
    wall_s: float
    cpu_s_per_step: float
    checks: list[str] = field(default_factory=list)
    #: Per step: was hvtrace recording (rank 0's view; all ranks switch at the same step).
    traced: list[bool] = field(default_factory=list)
    #: CPU time of hvtrace's writer threads over the loop, all ranks, per step (s); None: none.
    writer_cpu_s_per_step: float | None = None
    #: Whole process, per rank (from the rank launcher): CPU time (s) from start to exit...
    job_cpu_s: list[float] = field(default_factory=list)
    #: ...peak RSS (MB, ``ru_maxrss``)...
    maxrss_mb: list[float] = field(default_factory=list)
    #: ...and rank 0's marks (peak RSS, RSS, CPU, threads at each stage of its life)
    marks: list[dict[str, Any]] = field(default_factory=list)
    #: rank 0: heavy modules loaded at exit, and pyarrow's memory pool (None: not imported)
    modules: list[str] = field(default_factory=list)
    arrow_pool: dict[str, Any] | None = None
    #: Per rank, the loop (loop start to loop end): CPU time (s) of the main thread, of
    #: hvtrace's writer thread and of all other threads (Horovod's, Gloo's, torch's)
    loop_thread_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    #: Per step: the main thread's CPU time (s), mean over ranks (the first step has none: the
    #: second's is repeated); empty when not measured
    step_cpu_s: list[float] = field(default_factory=list)
    #: Per step: the part of ``step_cpu_s`` inside Horovod's waits (s), the same way
    step_wait_s: list[float] = field(default_factory=list)

    def median_ms(self, warmup: int) -> float:
        """Median step time (ms) after skipping ``warmup`` steps."""
        return 1e3 * statistics.median(self.step_s[warmup:])


def describe(model: str, batch_size: int = 0) -> str:
    """One line saying what ``model`` is (``batch_size``: the per-rank batch, 0: the model's)."""
    size = MODELS[model]
    net = (
        "residual LayerNorm+Linear blocks"
        if size["net"] == "deep"
        else "MLP (the demo's), hidden layers"
    )
    return (
        f"{net} x {size['layers']}, width {size['width']}, "
        f"batch {batch_size or size['batch_size']} per rank, "
        f"{grad_tensors(model)} gradient tensors"
    )


def horovodrun() -> str:
    """Return the ``horovodrun`` next to this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / "horovodrun"
    if here.exists():
        return str(here)
    found = shutil.which("horovodrun")
    if found is None:
        raise SystemExit("horovodrun not found (run `make setup`, or use the venv's python)")
    return found


def _dir_bytes(path: Path) -> tuple[int, int]:
    """Return (total bytes, number of files) under ``path`` (0, 0 if it does not exist)."""
    if not path.exists():
        return 0, 0
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files), len(files)


def rank_child(work: Path) -> Path:
    """The rank launcher's file in ``work`` (written there by the first call)."""
    child = work / "rank_child.py"
    if not child.exists():
        child.write_text(RANK_CHILD)
    return child


def run_once(
    model: str,
    mode: str,
    rnd: int,
    args: argparse.Namespace,
    work: Path,
    ab_every: int = 0,
    ab_toggle: str = "hvtrace",
    cpu_offset: int = 0,
) -> RunResult:
    """Run the demo training once in ``mode``; return its step times and bytes written.

    ``ab_every`` > 0 (mode hvtrace only): recording is switched off and on every that many steps
    inside the run (``--ab-every`` of the demo), for the in-run A/B comparison; with
    ``ab_toggle="horovod-timeline"`` it is Horovod's own timeline that is switched (started by
    hvtrace, ``HVTRACE_HOROVOD_TIMELINE=1``), while hvtrace records throughout. With ``--pin``,
    local rank r runs on the ``(r + cpu_offset)``-th CPU (``--concurrent`` runs two jobs at once,
    one on each CPU).
    """
    d = work / f"{model}-{mode}{'-ab-' + ab_toggle if ab_every else ''}-r{rnd}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    size = MODELS[model]
    argv = [
        "--steps",
        str(args.steps),
        "--width",
        str(size["width"]),
        "--layers",
        str(size["layers"]),
        "--batch-size",
        str(args.batch_size or size["batch_size"]),
        "--step-times",
        str(d / "steps-{rank}.json"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_TIMELINE", "HVTRACE")}
    env["PYTHONWARNINGS"] = "ignore"
    if args.np == 1:  # Horovod's optimizer allreduces nothing at one rank unless told it is elastic
        env["HOROVOD_ELASTIC"] = "1"
    out: Path
    if mode in ("untraced", "imported"):
        argv.append("--no-trace")
        out = d / "none"
    elif mode in ("hvtrace", "installed"):
        out = d / "trace"
        argv += ["--trace-dir", str(out)]
        if ab_every:
            argv += ["--ab-every", str(ab_every), "--ab-toggle", ab_toggle]
            if ab_toggle == "horovod-timeline":
                env["HVTRACE_HOROVOD_TIMELINE"] = "1"
    elif mode == "timeline":
        out = d / "timeline.json"
        argv.append("--no-trace")
        env["HOROVOD_TIMELINE"] = str(out)
    elif mode == "torch_profiler":
        out = d / "profiler"
        argv += ["--no-trace", "--torch-profiler", str(out)]
    else:
        raise ValueError(f"unknown mode {mode!r}")
    spec = {
        "repo": str(REPO),
        "train": str(TRAIN),
        "argv": argv,
        "stub": mode in STUBBED,
        "net": size["net"],
        "out": str(d / "rank-{rank}.json"),
        "recording_off": mode == "installed",
        "pin": args.pin,
        "cpu_offset": cpu_offset,
    }
    child = rank_child(work)
    cmd = [
        horovodrun(),
        "-np",
        str(args.np),
        "-H",
        f"localhost:{args.np}",
        "--gloo",
        sys.executable,
        str(child),
        json.dumps(spec),
    ]
    t0 = time.perf_counter()
    with open(d / "output.log", "w") as logf:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=args.timeout
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (d / "output.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"{model}/{mode} round {rnd}: horovodrun exited {proc.returncode}:\n{tail}"
        )

    def ranks_json(stem: str) -> list[dict[str, Any]]:
        out = []
        for r in range(args.np):
            f = d / f"{stem}-{r}.json"
            if not f.exists():
                raise RuntimeError(f"{model}/{mode} round {rnd}: rank {r} wrote no {f.name}")
            out.append(json.loads(f.read_text()))
        return out

    per_rank = ranks_json("steps")
    steps = [statistics.fmean(ts) for ts in zip(*(pr["step_s"] for pr in per_rank))]
    nbytes, nfiles = _dir_bytes(out)
    res = RunResult(
        model,
        mode,
        rnd,
        steps,
        nbytes,
        nfiles,
        max(pr.get("finish_s", 0.0) for pr in per_rank),
        wall,
        sum(pr.get("loop_cpu_s", 0.0) for pr in per_rank) / args.steps,
    )
    res.traced = [bool(x) for x in per_rank[0].get("traced", [])]
    procs = ranks_json("rank")
    res.job_cpu_s = [p["cpu_s"] for p in procs]
    res.maxrss_mb = [p["maxrss_mb"] for p in procs]
    res.marks, res.modules = procs[0]["marks"], procs[0]["modules"]
    res.arrow_pool = procs[0]["arrow_pool"]
    res.loop_thread_cpu_s = loop_thread_cpu([p["marks"] for p in procs])
    for key in ("step_cpu_s", "step_wait_s"):
        per_step = [p.get(key, []) for p in procs]
        if all(len(c) == len(steps) - 1 > 0 for c in per_step):
            cpu = [statistics.fmean(x) for x in zip(*per_step)]
            setattr(res, key, [cpu[0], *cpu])
    wcpu = [pr.get("writer_cpu_s") for pr in per_rank]
    if all(w is not None for w in wcpu):
        res.writer_cpu_s_per_step = sum(wcpu) / args.steps
    res.checks = _check_mode(mode, per_rank, out, nbytes, nfiles, args.np)
    for problem in res.checks:
        log.warning("%s/%s round %d: %s", model, mode, rnd, problem)
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return res


def loop_thread_cpu(marks_per_rank: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per kind of thread, each rank's CPU time (s) from "loop start" to "loop end"."""
    out: dict[str, list[float]] = {}
    for marks in marks_per_rank:
        at = {m["at"]: m for m in marks}
        if "loop start" not in at or "loop end" not in at:
            return {}
        a, b = at["loop start"]["thread_cpu_s"], at["loop end"]["thread_cpu_s"]
        for kind in b:
            out.setdefault(kind, []).append(b[kind] - a[kind])
    return out


def _check_mode(
    mode: str, per_rank: list[dict[str, Any]], out: Path, nbytes: int, nfiles: int, np_: int
) -> list[str]:
    """Return problems showing that a mode did not really record what it should (else [])."""
    problems = []
    active = [bool(pr.get("profiler_active")) for pr in per_rank]
    if mode == "torch_profiler":
        if not all(active):
            problems.append(f"torch profiler not recording on ranks {active}")
        if nfiles < np_ or nbytes == 0:
            problems.append(f"expected {np_} profiler traces, found {nfiles} ({nbytes} bytes)")
    elif any(active):
        problems.append("torch profiler unexpectedly active")
    if mode == "hvtrace" and (nfiles < np_ or nbytes == 0):
        problems.append(f"expected {np_} hvtrace files, found {nfiles} ({nbytes} bytes)")
    if mode == "timeline":
        text = out.read_text(errors="replace") if out.exists() else ""
        if '"ph"' not in text:
            problems.append(f"Horovod timeline {out.name} has no events ({nbytes} bytes)")
    if mode == "untraced" and nbytes:
        problems.append(f"untraced run wrote {nbytes} bytes")
    return problems


def summarize(runs: list[RunResult], args: argparse.Namespace) -> dict[str, Any]:
    """Per model and mode: step time, overhead vs untraced (per-round ratios), bytes per step."""
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r.model for r in runs):
        untraced = [r for r in runs if r.model == model and r.mode == "untraced"]
        base = {r.round: r.median_ms(args.warmup) for r in untraced}
        base_cpu = {r.round: r.cpu_s_per_step for r in untraced}
        per_mode: dict[str, Any] = {}
        for mode in args.modes:
            rs = [r for r in runs if r.model == model and r.mode == mode]
            if not rs:
                continue
            meds = [r.median_ms(args.warmup) for r in rs]
            pooled = [1e3 * s for r in rs for s in r.step_s[args.warmup :]]
            cpu_ms = [1e3 * r.cpu_s_per_step for r in rs]
            cpu_ratios = [
                100.0 * (r.cpu_s_per_step / base_cpu[r.round] - 1.0)
                for r in rs
                if base_cpu.get(r.round)
            ]
            ratios = [
                100.0 * (r.median_ms(args.warmup) / base[r.round] - 1.0)
                for r in rs
                if r.round in base
            ]
            per_mode[mode] = {
                "rounds": len(rs),
                "step_ms": statistics.median(meds),
                "step_ms_runs": meds,
                "pooled_step_ms": statistics.median(pooled),
                "overhead_pct": statistics.median(ratios) if ratios else None,
                "overhead_pct_min": min(ratios) if ratios else None,
                "overhead_pct_max": max(ratios) if ratios else None,
                "overhead_pct_rounds": ratios,
                "cpu_ms_per_step": statistics.median(cpu_ms),
                "cpu_overhead_pct": statistics.median(cpu_ratios) if cpu_ratios else None,
                "bytes_per_step": statistics.median(r.bytes / args.steps for r in rs),
                "finish_s": statistics.median(r.finish_s for r in rs),
                "problems": sorted({p for r in rs for p in r.checks}),
            }
        out[model] = per_mode
    return out


def median_ci(values: list[float], conf: float = 0.95) -> tuple[float, float, float]:
    """Return (lo, hi, coverage): a distribution-free interval for the median of ``values``.

    The order statistics x(k) <= x(n+1-k) with the largest k whose two-sided binomial tail
    (Binomial(n, 1/2) below k, times 2) is at most ``1 - conf``: no assumption on the
    distribution (rounds on a noisy machine are skewed). ``coverage`` is the interval's exact
    confidence; with too few values for ``conf`` (n < 6 at 95%) the range (min, max) is
    returned with its own, lower, coverage (1 - 2 / 2**n).
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci of no values")
    cdf, k = 0.0, 0  # cdf = P(B <= k - 1), B ~ Binomial(n, 1/2)
    while True:
        nxt = cdf + math.comb(n, k) / 2**n
        if 2 * nxt > 1.0 - conf or k + 1 > n - k:
            break
        cdf, k = nxt, k + 1
    k = max(k, 1)
    cover = 1.0 - 2.0 * sum(math.comb(n, j) for j in range(k)) / 2**n
    return xs[k - 1], xs[n - k], cover


def paired(
    runs: list[RunResult], model: str, mode: str, value: Any, relative: bool
) -> dict[str, Any] | None:
    """Per-round paired differences of ``value(run)`` between ``mode`` and ``untraced``.

    ``relative``: percent of the untraced value, else absolute. Returns the medians of both
    modes over rounds, the differences per round, their median and its 95% interval
    (:func:`median_ci`); None when no round has both runs.
    """
    base = {r.round: value(r) for r in runs if r.model == model and r.mode == "untraced"}
    other = {r.round: value(r) for r in runs if r.model == model and r.mode == mode}
    rounds = sorted(set(base) & set(other))
    if not rounds:
        return None
    diffs = [100.0 * (other[k] / base[k] - 1.0) if relative else other[k] - base[k] for k in rounds]
    lo, hi, cover = median_ci(diffs)
    return {
        "untraced": statistics.median(base[k] for k in rounds),
        mode: statistics.median(other[k] for k in rounds),
        "diff": statistics.median(diffs),
        "ci": (lo, hi),
        "coverage": cover,
        "rounds": len(rounds),
        "diffs": diffs,
    }


def _main_ms(r: RunResult) -> float:
    """Main-thread CPU (ms) per step over the loop, all ranks (hvtrace's writer thread added)."""
    t = r.loop_thread_cpu_s
    if not t:
        return float("nan")
    return 1e3 * (sum(t["main"]) + sum(t.get("writer", []))) / len(r.step_s)


def whole_summary(runs: list[RunResult], args: argparse.Namespace) -> dict[str, Any]:
    """Whole-process figures per model and traced mode, paired with the same round's untraced.

    ``cpu``: all ranks' process CPU time over the loop per step (ms; difference in %);
    ``job_cpu``: CPU time of a whole rank, start to exit, mean over ranks (s; difference in s);
    ``main_cpu``: like ``cpu``, the main thread and hvtrace's writer only; ``rss``: peak RSS of a
    rank, mean over ranks (MB; difference in MB); ``rss_max``: the same for the larger rank.
    ``stages``: median over rounds of rank 0's increments at each mark; ``threads``: loop CPU
    (ms) per step, all ranks, by kind of thread, median over rounds.
    """
    out: dict[str, Any] = {}
    for model in dict.fromkeys(r.model for r in runs):
        per: dict[str, Any] = {}
        for mode in WHOLE_MODES:
            if not any(r.model == model and r.mode == mode and r.maxrss_mb for r in runs):
                continue
            per[mode] = {
                "cpu": paired(runs, model, mode, lambda r: 1e3 * r.cpu_s_per_step, True),
                "job_cpu": paired(
                    runs, model, mode, lambda r: statistics.fmean(r.job_cpu_s), False
                ),
                "main_cpu": paired(runs, model, mode, _main_ms, True),
                "rss": paired(runs, model, mode, lambda r: statistics.fmean(r.maxrss_mb), False),
                "rss_max": paired(runs, model, mode, lambda r: max(r.maxrss_mb), False),
            }
        stages: dict[str, Any] = {}
        for mode in ("untraced", *WHOLE_MODES):
            rs = [r for r in runs if r.model == model and r.mode == mode and r.marks]
            if rs:
                stages[mode] = stage_increments([r.marks for r in rs])
        threads: dict[str, Any] = {}
        for mode in ("untraced", *WHOLE_MODES):
            rs = [r for r in runs if r.model == model and r.mode == mode and r.loop_thread_cpu_s]
            if rs:  # all ranks, per step, median over rounds
                threads[mode] = {
                    k: statistics.median(
                        1e3 * sum(r.loop_thread_cpu_s.get(k, [0.0])) / len(r.step_s) for r in rs
                    )
                    for k in ("main", "wait", "writer", "other")
                }
        out[model] = {"modes": per, "stages": stages, "threads": threads}
    return out


def stage_increments(marks_per_run: list[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Median over runs of each stage's increments of peak RSS, RSS (MB) and CPU time (s).

    A stage runs from the previous mark to the one that names it ("import torch": from the
    launcher's start to torch imported; "loop end": the training loop, from the demo's last
    broadcast to ``finish`` called; "finish": ``hvtrace.finish()``, compaction included).
    """
    incs: dict[str, dict[str, list[float]]] = {}
    for marks in marks_per_run:
        for prev, cur in itertools.pairwise(marks):
            d = incs.setdefault(cur["at"], {k: [] for k in (*_INCREMENTS, "threads")})
            for key in _INCREMENTS:  # (marks written before a key was added lack it)
                d[key].append(cur.get(key, math.nan) - prev.get(key, math.nan))
            d["threads"].append(cur["threads"])
    return {at: {key: statistics.median(v) for key, v in d.items()} for at, d in incs.items()}


_INCREMENTS = ("maxrss_mb", "rss_mb", "rss_file_mb", "cpu_s", "wall_s")


def ab_blocks(
    values: Any, traced: Any, every: int, warmup: int, seed: int = 0
) -> tuple[float, float, float, tuple[float, float], int]:
    """Return (traced median, untraced median, overhead %, its 95% CI, pairs) of an A/B run.

    Steps are cut into blocks of ``every`` (recording switched at each block's end); each
    untraced block and the traced block after it form a pair. The overhead is the ratio of the
    median traced value to the median untraced value (medians: one slow hiccup does not move
    them); its 95% interval comes from 2,000 bootstrap resamples of the pairs, so slow drifts of
    the machine, which hit both blocks of a pair alike, are resampled together.
    """
    t = np.asarray(values, dtype=np.float64)
    on = np.asarray(traced, dtype=bool)
    keep = np.arange(len(t)) >= warmup
    blocks = np.arange(len(t)) // every
    pairs = []
    for b in range(int(blocks.max()) + 1):
        a, c = blocks == b, blocks == b + 1
        whole = a.sum() == c.sum() == every and keep[a].all()  # no warm-up step, no short block
        if whole and not on[a].any() and on[c].all():
            pairs.append((t[a], t[c]))
    if len(pairs) < 2:
        raise RuntimeError(f"in-run A/B: only {len(pairs)} block pair(s); run more steps")
    off = np.stack([p[0] for p in pairs])  # pairs x steps per block
    on_ = np.stack([p[1] for p in pairs])
    on_v, off_v = float(np.median(on_)), float(np.median(off))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), (2000, len(pairs)))
    boot = np.array([np.median(on_[i]) / np.median(off[i]) for i in idx])
    lo, hi = np.quantile(100.0 * (boot - 1.0), [0.025, 0.975])
    return on_v, off_v, 100.0 * (on_v / off_v - 1.0), (float(lo), float(hi)), len(pairs)


def ab_summary(
    res: RunResult, every: int, warmup: int, seed: int = 0, target: str = "hvtrace"
) -> dict[str, Any]:
    """Summarize an in-run A/B run: traced vs untraced steps of the same processes.

    Wall time per step (:func:`ab_blocks`), and the same for the main thread's CPU time per
    step when the run measured it (``cpu_*``, else None).
    """
    on = np.asarray(res.traced, dtype=bool)
    on_ms, off_ms, pct, ci, pairs = ab_blocks(np.asarray(res.step_s) * 1e3, on, every, warmup, seed)
    out = {
        "target": target,
        "model": res.model,
        "steps": len(res.step_s),
        "every": every,
        "pairs": pairs,
        "on_ms": on_ms,
        "off_ms": off_ms,
        "overhead_pct": pct,
        "ci95_pct": ci,
        "writer_cpu_ms_per_step": None
        if res.writer_cpu_s_per_step is None
        # the writer only works while recording: per traced step
        else 1e3 * res.writer_cpu_s_per_step * len(res.step_s) / max(int(on.sum()), 1),
        "cpu_on_ms": None,
        "cpu_off_ms": None,
        "cpu_overhead_pct": None,
        "cpu_ci95_pct": None,
        "outside_on_ms": None,  # the main thread's CPU outside Horovod's waits, the same way
        "outside_off_ms": None,
        "outside_ci95_pct": None,
    }
    if len(res.step_cpu_s) == len(res.step_s):
        c_on, c_off, c_pct, c_ci, _ = ab_blocks(
            np.asarray(res.step_cpu_s) * 1e3, on, every, warmup, seed
        )
        out.update(cpu_on_ms=c_on, cpu_off_ms=c_off, cpu_overhead_pct=c_pct, cpu_ci95_pct=c_ci)
    if len(res.step_wait_s) == len(res.step_s) == len(res.step_cpu_s):
        outside = np.asarray(res.step_cpu_s) - np.asarray(res.step_wait_s)
        o_on, o_off, _, o_ci, _ = ab_blocks(outside * 1e3, on, every, warmup, seed)
        out.update(outside_on_ms=o_on, outside_off_ms=o_off, outside_ci95_pct=o_ci)
    return out


def by_parts(
    summary: dict[str, Any], whole: dict[str, Any], abs_: list[dict[str, Any]], n_ranks: int
) -> dict[str, Any]:
    """Per model: what hvtrace costs a rank per step, counted by its parts, against the untraced
    process's CPU per step (``summary``): the training thread's added CPU outside Horovod's
    waits from the in-run A/B (its 95% interval carried over), plus the CPU of hvtrace's own
    threads (writer, live detection, stall watch: the whole-process hvtrace runs' median, else
    the A/B's writer).

    Separate processes here differ by more than the goal, so the whole-process difference
    cannot resolve it; the parts can. Horovod's waits are left out of the training thread's
    part: they spin for as long as the other ranks take, which in the A/B swings by more than a
    millisecond either way (``main_ms``, for the record). The parts also leave out what
    recording moves to a later step (the A/B's untraced blocks pay it too) and what hvtrace's
    threads do to the training thread's caches: a lower bound, next to the whole-process
    figure."""
    out: dict[str, Any] = {}
    for ab in abs_:
        model = ab["model"]
        if ab.get("target", "hvtrace") != "hvtrace" or ab.get("cpu_on_ms") is None:
            continue
        base = summary.get(model, {}).get("untraced", {}).get("cpu_ms_per_step")
        if not base:
            continue
        base /= n_ranks  # per rank
        if ab.get("outside_on_ms") is not None:
            on, off, (lo_pct, hi_pct) = (
                ab["outside_on_ms"],
                ab["outside_off_ms"],
                ab["outside_ci95_pct"],
            )
            what = "outside Horovod's waits"
        else:  # an older run: the main thread's CPU as a whole
            on, off, (lo_pct, hi_pct) = ab["cpu_on_ms"], ab["cpu_off_ms"], ab["cpu_ci95_pct"]
            what = "waits included"
        hooks, hooks_lo, hooks_hi = on - off, off * lo_pct / 100, off * hi_pct / 100
        threads = whole.get(model, {}).get("threads", {}).get("hvtrace", {}).get("writer")
        source = "whole-process runs"
        if threads is None:
            threads, source = ab["writer_cpu_ms_per_step"] or 0.0, "in-run A/B, writer only"
        threads /= n_ranks
        out[model] = {
            "untraced_cpu_ms": base,
            "hooks_ms": hooks,
            "hooks_ci_ms": (hooks_lo, hooks_hi),
            "hooks_measured": what,
            "main_ms": ab["cpu_on_ms"] - ab["cpu_off_ms"],
            "threads_ms": threads,
            "threads_from": source,
            "pct": 100 * (hooks + threads) / base,
            "pct_ci": (100 * (hooks_lo + threads) / base, 100 * (hooks_hi + threads) / base),
        }
    return out


def print_by_parts(parts: dict[str, Any]) -> None:
    """Print :func:`by_parts` and the CPU goal judged on it."""
    if not parts:
        return
    print(
        "\nBy parts, per rank and step: the training thread's added CPU outside Horovod's waits "
        "(in-run A/B) + hvtrace's threads' CPU,\nagainst the untraced process's CPU per step (a "
        "lower bound: see by_parts in this file)."
    )
    for model, b in parts.items():
        lo, hi = b["hooks_ci_ms"]
        plo, phi = b["pct_ci"]
        verdict = "ok" if phi <= GOAL_CPU_PCT else "MISSED" if plo > GOAL_CPU_PCT else "not shown"
        print(
            f"  {model}: training thread {1e3 * b['hooks_ms']:+.0f} µs "
            f"[{1e3 * lo:+.0f}..{1e3 * hi:+.0f}] ({b['hooks_measured']}; with the waits "
            f"{1e3 * b['main_ms']:+.0f} µs), hvtrace's threads {1e3 * b['threads_ms']:.0f} µs "
            f"({b['threads_from']}), of {b['untraced_cpu_ms']:.2f} ms: {b['pct']:.2f}% "
            f"[{plo:.2f}..{phi:.2f}]  goal <= {GOAL_CPU_PCT}%: {verdict}"
        )


def ab_goal(ab: dict[str, Any]) -> tuple[str, bool, str]:
    """Return (goal, met?, note) judged on the in-run A/B estimate and its interval."""
    limit = GOAL_OVERHEAD_PCT[ab["model"]]
    est, ci = ab["overhead_pct"], ab["ci95_pct"]
    note = ""
    if ci is not None and ci[0] <= limit < ci[1]:
        note = f"within noise: 95% CI {ci[0]:+.2f}..{ci[1]:+.2f}%"
    return (f"hvtrace overhead <= {limit:g}% (in-run A/B)", est <= limit, note)


def print_ab(abs_: list[dict[str, Any]]) -> None:
    """Print the in-run A/B table and its goals."""
    if not abs_:
        return
    print(
        "\nIn-run A/B: one hvtrace run per model, recording switched off and on every N steps "
        "(all ranks at the same step);\nsame processes, so run-to-run noise cancels. overhead = "
        "median traced step / median untraced step, with a 95% interval from bootstrapping "
        "the\n(untraced block, next traced block) pairs. writer CPU = hvtrace's background "
        "writer, all ranks, per traced step.\nmain-thread CPU = the training thread's CPU time "
        "per step (mean over ranks; thread_time at each step's end), compared the same way."
    )
    rows = []
    for ab in abs_:
        ci = ab["ci95_pct"]
        w = ab["writer_cpu_ms_per_step"]
        rows.append(
            [
                ab.get("target", "hvtrace"),
                ab["model"],
                f"{ab['steps']} / {ab['every']}",
                f"{ab['on_ms']:.1f}",
                f"{ab['off_ms']:.1f}",
                f"{ab['overhead_pct']:+.2f}% [{ci[0]:+.2f}..{ci[1]:+.2f}]",
                str(ab["pairs"]),
                "-" if w is None else f"{w:.3f}",
                "-"
                if ab["cpu_overhead_pct"] is None
                else f"{ab['cpu_on_ms']:.2f} / {ab['cpu_off_ms']:.2f}  "
                f"{ab['cpu_overhead_pct']:+.2f}% [{ab['cpu_ci95_pct'][0]:+.2f}.."
                f"{ab['cpu_ci95_pct'][1]:+.2f}]",
            ]
        )
    print(
        _table(
            [
                "switched",
                "model",
                "steps / N",
                "on ms",
                "off ms",
                "overhead [95% CI]",
                "pairs",
                "writer CPU ms/step",
                "main-thread CPU ms/step traced / untraced  overhead [95% CI]",
            ],
            rows,
        )
    )
    for ab in abs_:
        if ab.get("target", "hvtrace") != "hvtrace":
            continue  # Horovod's timeline has no goal here: its cost is stated
        text, met, why = ab_goal(ab)
        print(f"  {ab['model']}: goal: {text:<38} {'ok' if met else 'MISSED':<6}  {why}".rstrip())


def goals(model: str, per_mode: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Return (goal, met?, note) for hvtrace on ``model``; met is judged on the medians.

    The note says when the per-round spread straddles the limit (the verdict is within noise).
    """
    hv = per_mode.get("hvtrace")
    if hv is None or hv["overhead_pct"] is None:
        return []

    def note(lo: float, hi: float, limit: float) -> str:
        return f"inconclusive: rounds range {lo:+.1f}..{hi:+.1f}%" if lo <= limit < hi else ""

    limit = GOAL_OVERHEAD_PCT[model]
    lo, hi = hv["overhead_pct_min"], hv["overhead_pct_max"]
    res = [(f"hvtrace overhead <= {limit:g}%", hv["overhead_pct"] <= limit, note(lo, hi, limit))]
    for alt in ("timeline", "torch_profiler"):
        a = per_mode.get(alt)
        if a is None or a["overhead_pct"] is None:
            continue
        diffs = [h - x for h, x in zip(hv["overhead_pct_rounds"], a["overhead_pct_rounds"])]
        res.append(
            (
                f"hvtrace overhead < {alt}",
                hv["overhead_pct"] < a["overhead_pct"],
                note(min(diffs), max(diffs), 0.0) if diffs else "",
            )
        )
        res.append(
            (
                f"hvtrace bytes/step < {alt}",
                hv["bytes_per_step"] < a["bytes_per_step"],
                f"{a['bytes_per_step'] / max(hv['bytes_per_step'], 1):.0f}x fewer",
            )
        )
    return res


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def _bytes(n: float) -> str:
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def print_tables(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one table per model and the goals."""
    print(
        f"\nRecording overhead: demo training, {args.np} ranks (horovodrun --gloo), {args.steps} "
        f"steps per run, first {args.warmup} skipped, {args.rounds} round(s) interleaved"
    )
    print(
        "step ms = median over rounds of each run's median step time (per-step mean over ranks); "
        "pooled = median of all steps of all rounds;\noverhead = per-round ratio to the same "
        "round's untraced run, median [min..max] over rounds; bytes = all ranks' files / steps;\n"
        "CPU ms/step = all ranks' process CPU time over the loop / steps, median over rounds "
        "(vs untraced, per-round ratio): less disturbed by other load than wall time"
    )
    for model, per_mode in summary.items():
        print(f"\nmodel {model}: {describe(model, args.batch_size)}")
        rows = []
        for mode, m in per_mode.items():
            if m["overhead_pct"] is None:
                ovh = "-"
            elif mode == "untraced":
                ovh = "(baseline)"
            else:
                ovh = (
                    f"{m['overhead_pct']:+.1f}% [{m['overhead_pct_min']:+.1f}.."
                    f"{m['overhead_pct_max']:+.1f}]"
                )
            cpu = f"{m['cpu_ms_per_step']:.1f}"
            if mode != "untraced" and m["cpu_overhead_pct"] is not None:
                cpu += f" ({m['cpu_overhead_pct']:+.1f}%)"
            rows.append(
                [
                    mode,
                    f"{m['step_ms']:.1f}",
                    f"{m['pooled_step_ms']:.1f}",
                    ovh,
                    cpu,
                    _bytes(m["bytes_per_step"]) if m["bytes_per_step"] else "0",
                    f"{m['finish_s']:.2f}",
                    "; ".join(m["problems"]) or "ok",
                ]
            )
        print(
            _table(
                [
                    "mode",
                    "step ms",
                    "pooled ms",
                    "overhead",
                    "CPU ms/step",
                    "bytes/step",
                    "finish s",
                    "checks",
                ],
                rows,
            )
        )
        for text, met, why in goals(model, per_mode):
            print(f"  goal: {text:<36} {'ok' if met else 'MISSED':<6}  {why}".rstrip())


def whole_goals(per_mode: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Return (goal, met?, note) for hvtrace's whole-process cost; met is judged on the medians.

    The note gives the 95% interval of the median paired difference when it straddles the limit.
    """
    hv = per_mode.get("hvtrace")
    if hv is None:
        return []
    res = []
    for key, limit, text, unit in (
        ("cpu", GOAL_CPU_PCT, f"CPU/step added <= {GOAL_CPU_PCT:g}%", "%"),
        ("rss", GOAL_RSS_MB, f"peak RSS added <= {GOAL_RSS_MB:g} MB/rank", " MB"),
    ):
        p = hv[key]
        if p is None:
            continue
        lo, hi = p["ci"]
        note = ""
        if lo <= limit < hi:
            note = f"within noise: {100 * p['coverage']:.0f}% CI {lo:+.1f}..{hi:+.1f}{unit}"
        res.append((text, p["diff"] <= limit, note))
    return res


def _diff(p: dict[str, Any] | None, fmt: str, unit: str) -> str:
    if p is None:
        return "-"
    lo, hi = p["ci"]
    return f"{p['diff']:{fmt}}{unit} [{lo:{fmt}}..{hi:{fmt}}]"


def print_whole(whole: dict[str, Any], summary: dict[str, Any]) -> None:
    """Print the whole-process table (paired with untraced), its goals and the stage breakdown."""
    if not any(w["modes"] for w in whole.values()):
        return
    print(
        "\nWhole process, per rank, vs the same round's untraced run (hvtrace stubbed out: no "
        "import, no wrappers): per-round paired\ndifferences, median over rounds [distribution-"
        "free 95% interval of that median; with < 6 rounds: min..max].\nCPU/step = all ranks' "
        "process CPU time over the loop / steps; job CPU = one rank's CPU time from start to "
        "exit\n(imports, init, clock round trips, loop, finish/compaction); main+writer = the "
        "CPU/step of the main thread and hvtrace's writer only\n(Horovod's and Gloo's threads, "
        "whose waits partly spin and so grow with other load, left out); peak RSS = ru_maxrss "
        "of a rank, mean over ranks\n(max rank in the JSON)."
    )
    rows = []
    for model, w in whole.items():
        for mode, m in w["modes"].items():
            step = summary.get(model, {}).get(mode, {}).get("step_ms")
            cpu, job, rss, main = m["cpu"], m["job_cpu"], m["rss"], m["main_cpu"]
            rows.append(
                [
                    model,
                    mode,
                    "-" if step is None else f"{step:.1f}",
                    "-" if cpu is None else str(cpu["rounds"]),
                    "-" if cpu is None else f"{cpu['untraced']:.2f} / {cpu[mode]:.2f}",
                    _diff(cpu, "+.1f", "%"),
                    _diff(main, "+.1f", "%"),
                    "-" if job is None else f"{job['untraced']:.2f} / {job[mode]:.2f}",
                    _diff(job, "+.2f", " s"),
                    "-" if rss is None else f"{rss['untraced']:.0f} / {rss[mode]:.0f}",
                    _diff(rss, "+.1f", " MB"),
                ]
            )
    print(
        _table(
            [
                "model",
                "mode",
                "step ms",
                "rounds",
                "CPU ms/step",
                "CPU/step added",
                "main+writer added",
                "job CPU s",
                "job CPU added",
                "peak RSS MB",
                "peak RSS added",
            ],
            rows,
        )
    )
    for model, w in whole.items():
        for text, met, why in whole_goals(w["modes"]):
            print(f"  {model}: goal: {text:<30} {'ok' if met else 'MISSED':<6}  {why}".rstrip())
    print(
        "\nWhere it goes: rank 0's increments per stage, median over rounds: peak RSS MB / RSS MB "
        "(of which file-backed: mapped library pages, shared with the host's other ranks and as "
        "large as the page cache's folios make them) / CPU s (threads after)"
    )
    for model, w in whole.items():
        modes = list(w["stages"])
        # in the order of the mode with the most stages (each run's marks are in time order)
        longest = max(modes, key=lambda m: len(w["stages"][m]))
        stages = list(
            dict.fromkeys([*w["stages"][longest], *(a for m in modes for a in w["stages"][m])])
        )
        rows = []
        for at in stages:
            row = [at]
            for m in modes:
                st = w["stages"][m].get(at)
                row.append(
                    "-"
                    if st is None
                    else f"{st['maxrss_mb']:+.1f} / {st['rss_mb']:+.1f} "
                    f"({st.get('rss_file_mb', math.nan):+.1f}) / {st['cpu_s']:.3f} "
                    f"({st['threads']:.0f})"
                )
            rows.append(row)
        th = w.get("threads", {})
        rows.append(
            [
                "loop: main (wait)/writer/other CPU ms/step",
                *(
                    " / ".join(f"{th[m][k]:.2f}" for k in ("main", "wait", "writer", "other"))
                    if m in th
                    else "-"
                    for m in modes
                ),
            ]
        )
        print(f"model {model}:")
        print(_table(["stage", *modes], rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
        help=f"comma-separated modes, of {', '.join(MODES)}",
    )
    p.add_argument("--rounds", type=int, default=10, help="rounds (each runs every mode once)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps of a run not counted")
    p.add_argument(
        "--model",
        default="both",
        help=f"comma-separated models, of {', '.join(MODELS)}; 'both': small,large; 'all': every "
        "model",
    )
    p.add_argument("--np", type=int, default=2, help="ranks (all on localhost)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="per-rank batch size instead of the model's (to reach a step time; 0: the model's)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="each rank and all its threads on one CPU (local rank r: the r-th CPU), as the "
        "seeds advise for real jobs; without it ranks float over all CPUs",
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="with --np 1: each round runs its modes at the same time, each on a CPU of its own "
        "(implies --pin; the CPUs change hands every round), so that the machine's slow "
        "episodes, which hit both CPUs alike, hit both modes of a round alike",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    p.add_argument(
        "--no-warmup-run",
        action="store_true",
        help="skip the uncounted short run that warms caches before the first round",
    )
    p.add_argument(
        "--ab-steps",
        type=int,
        default=1000,
        help="steps of the in-run A/B run per model (0: skip it)",
    )
    p.add_argument(
        "--ab-every", type=int, default=4, help="in-run A/B: switch recording every N steps"
    )
    p.add_argument(
        "--ab-horovod-timeline",
        action="store_true",
        help="also an in-run A/B of Horovod's own timeline (switched every N steps, hvtrace "
        "recording throughout): its cost beside hvtrace's",
    )
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep every run's files and logs")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    named = {"both": "small,large", "all": ",".join(MODELS)}.get(args.model, args.model)
    args.models = [m.strip() for m in named.split(",") if m.strip()]
    bad_models = [m for m in args.models if m not in MODELS]
    if bad_models or not args.models:
        p.error(f"unknown model(s) {args.model!r}; choose from {', '.join(MODELS)}, both, all")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if "untraced" not in args.modes:
        log.info("adding mode 'untraced': the overhead is measured against it")
        args.modes.insert(0, "untraced")
    if args.concurrent:
        if args.np != 1 or len(args.modes) > len(os.sched_getaffinity(0)):
            p.error("--concurrent needs --np 1 and at most one mode per CPU")
        args.pin = True
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    return args


def _round_runs(
    model: str, order: list[str], rnd: int, args: argparse.Namespace, work: Path
) -> list[tuple[str, RunResult | BaseException]]:
    """Run each mode of ``order`` once for round ``rnd``: one after the other, or, with
    ``--concurrent``, all at once, mode i on CPU ``(rnd + i) % CPUs`` (so each mode has every
    CPU in turn). A failed run gives its exception in place of a result."""
    if not args.concurrent:
        out: list[tuple[str, RunResult | BaseException]] = []
        for mode in order:
            try:
                out.append((mode, run_once(model, mode, rnd, args, work)))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                out.append((mode, exc))
        return out
    rank_child(work)  # once, before two runs would write it at the same time
    modes = sorted(order, key=args.modes.index)
    with ThreadPoolExecutor(len(modes)) as pool:
        futures = [
            pool.submit(run_once, model, m, rnd, args, work, cpu_offset=rnd + i)
            for i, m in enumerate(modes)
        ]
    results: list[tuple[str, RunResult | BaseException]] = []
    for mode, fut in zip(modes, futures):
        exc = fut.exception()
        if exc is not None and not isinstance(exc, (RuntimeError, subprocess.TimeoutExpired)):
            raise exc  # a failure of the benchmark itself, as one after the other
        results.append((mode, exc if exc is not None else fut.result()))
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    models = args.models
    work = Path(tempfile.mkdtemp(prefix="hvtrace-overhead-", dir=args.workdir))
    runs: list[RunResult] = []
    failed: list[str] = []
    done = 0
    total = args.rounds * len(models) * len(args.modes)
    abs_: list[dict[str, Any]] = []
    try:
        if not args.no_warmup_run:
            log.info("warm-up run (not counted)")
            warm = argparse.Namespace(**{**vars(args), "steps": args.warmup + 2, "keep": False})
            try:
                run_once(models[0], "untraced", -1, warm, work)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log.warning("warm-up run failed: %s", exc)
        t_start = time.perf_counter()
        for rnd in range(args.rounds):
            for model in models:
                k = rnd % len(args.modes)
                order = args.modes[k:] + args.modes[:k]
                for mode, res in _round_runs(model, order, rnd, args, work):
                    done += 1
                    if isinstance(res, BaseException):
                        log.error("run %d/%d failed, left out: %s", done, total, res)
                        failed.append(f"{model}/{mode} round {rnd + 1}: {res}".splitlines()[0])
                        continue
                    runs.append(res)
                    elapsed = time.perf_counter() - t_start
                    eta = elapsed / done * (total - done)
                    log.info(
                        "run %d/%d  round %d  %s/%-14s median step %7.1f ms  %9s/step  "
                        "(%.0f s; ETA %.0f s)",
                        done,
                        total,
                        rnd + 1,
                        model,
                        mode,
                        res.median_ms(args.warmup),
                        _bytes(res.bytes / args.steps) if res.bytes else "0 B",
                        res.wall_s,
                        eta,
                    )
        if args.ab_steps:
            ab_args = argparse.Namespace(**{**vars(args), "steps": args.ab_steps})
            for model in models:
                log.info("in-run A/B: %s, %d steps, switching every %d", model, args.ab_steps,
                         args.ab_every)  # fmt: skip
                try:
                    res = run_once(model, "hvtrace", 0, ab_args, work, ab_every=args.ab_every)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    failed.append(f"{model}/in-run A/B: {exc}".splitlines()[0])
                    continue
                try:
                    abs_.append(ab_summary(res, args.ab_every, args.warmup))
                except RuntimeError as exc:
                    failed.append(f"{model}/in-run A/B: {exc}")
                if not args.ab_horovod_timeline:
                    continue
                log.info("in-run A/B of Horovod's timeline: %s", model)
                try:
                    res = run_once(
                        model, "hvtrace", 0, ab_args, work, args.ab_every, "horovod-timeline"
                    )
                    abs_.append(
                        ab_summary(res, args.ab_every, args.warmup, target="horovod timeline")
                    )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    msg = f"{model}/in-run A/B of Horovod's timeline: {exc}"
                    failed.append(msg.splitlines()[0])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.info("run files kept in %s", work)
    summary = summarize(runs, args)
    whole = whole_summary(runs, args)
    print_tables(summary, args)
    print_whole(whole, summary)
    print_ab(abs_)
    parts = by_parts(summary, whole, abs_, args.np)
    print_by_parts(parts)
    for f in failed:
        print(f"FAILED (left out): {f}")
    if args.json:
        doc = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "workdir", "keep")},
            "models": {m: MODELS[m] for m in models},
            "summary": summary,
            "whole_process": whole,
            "in_run_ab": abs_,
            "by_parts": parts,
            "goals": {
                m: [{"goal": t, "met": ok, "note": why} for t, ok, why in goals(m, per)]
                for m, per in summary.items()
            },
            "whole_process_goals": {
                m: [{"goal": t, "met": ok, "note": why} for t, ok, why in whole_goals(w["modes"])]
                for m, w in whole.items()
            },
            "runs": [asdict(r) for r in runs],
            "failed": failed,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        log.info("figures written to %s", args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
