#!/usr/bin/env python
"""The CUDA path checked on a GPU (issue 38): hvtrace's CUDA-event spans against CUPTI, no device
synchronization added by tracing, and what tracing costs a GPU step (in-run A/B).

Run by ``scripts/gpu_check.sh`` (which builds Horovod with NCCL first); by hand::

    python scripts/gpu_check.py --out OUT [--dry-run] [--models resnet50,mlp]

Each model runs as one process of size 1 (``HOROVOD_ELASTIC=1``, so that Horovod's optimizer
allreduces at size 1) with ``hvtrace.DistributedOptimizer(model=...)`` on synthetic data:

1. **In-run A/B.** Blocks of ``--block-steps`` steps with recording switched off and on
   (``rec.enabled``, as ``bench/overhead.py`` does), in the order off, on, on, off, ... so that a
   drift hits both sides alike; each block timed by the host clock between two
   ``torch.cuda.synchronize()`` calls (outside the blocks' steps). The overhead is the median over
   pairs of (traced block / untraced block - 1).
2. **Sync debug.** One untraced and one traced block under ``torch.cuda.set_sync_debug_mode``
   ("warn"): the synchronizing PyTorch calls each made, counted.
3. **Profiled window.** ``torch.profiler`` (CPU and CUDA activities, so CUPTI) over
   ``--prof-steps`` untraced then as many traced steps, each step's parts marked with
   ``record_function`` (``gc.fwd.I``, ``gc.loss.I``, ``gc.bwd.I``, ``gc.opt.I``). The profile
   (Chrome trace), the hvtrace run and the steps' numbers are kept, and :func:`compare` reads
   them (also offline: ``--compare DIR``):

   * per traced step, each phase's device extent from CUPTI (the kernels, copies and sets on the
     compute stream launched inside the phase's marks, first start to last end) against
     hvtrace's span of that phase, on one clock (the profile's clock is tied to the host
     monotonic clock by a mark whose monotonic time is noted as it is entered);
   * the NCCL kernels and Horovod's copies (on Horovod's streams) launched during the step,
     against hvtrace's allreduce spans of that step (each kernel inside their union);
   * host-side synchronizing CUDA calls (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``,
     ``cudaEventSynchronize``) per step on the training thread, untraced against traced.

Without a GPU (``--dry-run``, or no CUDA) the same jobs run on the CPU with a small model: the A/B,
the profile and the hvtrace run are made and read, and the comparisons that need device activity
say so. Output: ``OUT/results.json``, ``OUT/summary.txt`` (the figures, also printed), and per
model ``OUT/gc_MODEL.tar.gz`` (profile + hvtrace run, for ``--compare``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Host-side CUDA calls that block the calling thread until the device (or part of it) is done.
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
#: What set_sync_debug_mode says of itself once (not a synchronizing call).
SYNC_DEBUG_NOTICE = "Synchronization debug mode is a prototype feature"
#: Profile categories of device activity.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: Phases compared: hvtrace span kind -> the marks whose launches make it on the device.
PHASES = {"forward": ("fwd",), "backward": ("bwd",), "update": ("opt",)}
#: Agreement of a phase's span with its device extent: within this share of the extent or this
#: many µs, whichever is larger (a CUDA event is recorded on the stream between kernels: it
#: completes when the kernel before it ends and the next starts a launch gap later).
TOL_SHARE, TOL_US = 0.02, 50.0
#: How far the profile's clock mark can be from the monotonic time noted inside it (and the
#: kernel tie from hvtrace's event after it).
CLOCK_MARK_NS = 10_000
#: The jobs of a device run: ResNet-50 at batch 64 (the issue's) and 256 (the device kept busy),
#: the demo's MLP (a 3 ms step); "@host": the same job timed on the host clock instead of CUDA
#: events (A/B only), to tell the CUDA timer's cost from the rest; "@ctypes" (not a default): the
#: writer's event queries and resolves through the CUDA runtime by ctypes, which releases the GIL
#: during each call (torch's hold it), to tell the GIL's part of the writer's cost from the calls'.
DEFAULT_MODELS = "resnet50,resnet50@host,resnet50:256,mlp,mlp@host"


# -- the job (one process per model) -------------------------------------------------------------
def _build(model_name: str, device: Any) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    if model_name.startswith("resnet50"):  # resnet50 (batch 64) or resnet50:BATCH
        import torchvision

        batch = int(model_name.partition(":")[2] or 64)
        model = torchvision.models.resnet50(weights=None)
        x = torch.randn(batch, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
    elif model_name == "mlp":  # a short step: the demo's MLP shape, batch 128
        from hvtrace.examples.train import MLP

        model = MLP(width=1024, layers=6)
        x = torch.randn(128, 256, device=device)
        y = torch.randint(0, 10, (128,), device=device)
    elif model_name == "tiny":  # the dry run's
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        x = torch.randn(32, 64, device=device)
        y = torch.randint(0, 10, (32,), device=device)
    else:
        raise SystemExit(f"unknown model {model_name!r}")
    return model.to(device), x, y


def run_job(args: argparse.Namespace) -> None:
    """One model's job (this process is the one rank); writes ``job.json`` in ``args.work``."""
    import horovod.torch as hvd
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import hvtrace

    work = Path(args.work)
    model_name, _, timing = args.job.partition("@")
    if timing == "host":  # the same job timed on the host clock (the CPU path's timer, polls)
        from hvtrace.record import opening
        from hvtrace.record.timers import HostTimer

        opening.make_timer = lambda device: HostTimer()
    hvd.init()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = (
        torch.device("cuda", hvd.local_rank() % max(1, torch.cuda.device_count()))
        if cuda
        else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model, x, y = _build(model_name, device)
    loss_fn = torch.nn.CrossEntropyLoss()
    opt = hvtrace.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        trace_dir=str(work / "run"),
        model=model,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    tracer = getattr(opt, "_hvtrace", None)
    out: dict[str, Any] = {
        "model": args.job,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "horovod_size": hvd.size(),
        "nccl_built": bool(hvd.nccl_built()),
        "traced": tracer is not None,
        "timing": "cuda_events" if tracer is not None and tracer.is_cuda else "host_monotonic",
    }
    if tracer is None:
        out["error"] = "hvtrace did not attach a tracer"
        (work / "job.json").write_text(json.dumps(out, indent=1))
        return
    rec = tracer.rec
    if timing == "ctypes":
        out["ctypes"] = _resolve_by_ctypes(tracer.timer) if tracer.is_cuda else "no CUDA timer"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(i: int | None = None) -> None:
        def mark(part: str) -> Any:  # a profile mark of step i's part (none outside the window)
            return record_function(f"gc.{part}.{i}") if i is not None else nullcontext()

        with mark("fwd"):
            out_ = model(x)
        with mark("loss"):
            loss = loss_fn(out_, y)
        with mark("bwd"):
            loss.backward()
        with mark("opt"):
            opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    sync()

    # 1. in-run A/B
    blocks: list[dict[str, Any]] = []
    order = []
    for p in range(args.ab_pairs):
        order += [False, True] if p % 2 == 0 else [True, False]
    writer = rec.writer
    parts: dict[str, list[float]] = {}
    if writer is not None:  # the writer's CPU over the A/B, per traced step (below)
        writer.flush(final=False)
        w0 = writer.cpu_s
        if os.environ.get("GC_WRITER_PARTS") == "1":  # where the writer thread's time goes
            parts = _time_writer_parts(tracer.timer, writer)
    for enabled in order:
        rec.enabled = enabled
        sync()
        t0 = time.perf_counter()
        for _ in range(args.block_steps):
            step()
        sync()
        blocks.append(
            {"traced": enabled, "ms_per_step": (time.perf_counter() - t0) * 1e3 / args.block_steps}
        )
    rec.enabled = True
    out["ab_blocks"] = blocks
    if writer is not None:  # what the writer thread spent on the traced blocks' spans
        sync()
        writer.flush(final=False)
        traced_steps = sum(args.block_steps for b in blocks if b["traced"])
        out["writer_cpu_us_per_step"] = (writer.cpu_s - w0) * 1e6 / max(1, traced_steps)
        if parts:
            out["writer_parts_us_per_step"] = {
                k: {
                    "calls": v[0] / traced_steps,
                    "cpu": v[1] / traced_steps * 1e6,
                    "wall": v[2] / traced_steps * 1e6,
                }
                for k, v in parts.items()
            }

    # 2. sync debug mode: synchronizing torch calls per block
    if cuda:
        counts = {}
        for enabled in (False, True):
            rec.enabled = enabled
            sync()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(args.block_steps):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sync()
            msgs = [str(w.message).splitlines()[0][:160] for w in caught]
            msgs = [x for x in msgs if not x.startswith(SYNC_DEBUG_NOTICE)]
            counts["traced" if enabled else "untraced"] = {"n": len(msgs), "first": msgs[:3]}
        rec.enabled = True
        out["sync_debug"] = counts

    if cuda:
        out["event_costs_us"] = _event_costs(torch, tracer, device)
    if args.prof_steps == 0:
        hvtrace.finish()
        (work / "job.json").write_text(json.dumps(out, indent=1))
        return
    # 3. profiled window: untraced steps, then traced steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    marks: list[dict[str, Any]] = []
    sync()
    tie: dict[str, int] = {}
    with profile(activities=acts) as prof:
        with record_function("gc.clock"):
            clock_mono_ns = time.monotonic_ns()
        if cuda:  # one kernel between two of hvtrace's own events, the device idle before it
            buf = torch.ones(1 << 26, device=device)
            sync()
            with record_function("gc.tie"):
                a = tracer.timer.now()
                buf.mul_(1.0001)
                b = tracer.timer.now()
            sync()
            tie = {"a_ns": tracer.timer.resolve(a), "b_ns": tracer.timer.resolve(b)}
        for i in range(2 * args.prof_steps):
            traced = i >= args.prof_steps
            rec.enabled = traced
            marks.append({"i": i, "traced": traced, "hv_step": int(rec.step)})
            with record_function(f"gc.step.{i}"):
                step(i)
        sync()
    rec.enabled = True
    out.update(clock_mono_ns=clock_mono_ns, marks=marks, tie=tie)
    if cuda:  # the CUDA timer against a new anchor, the run's length later: drift
        from hvtrace.record.timers import CudaTimer

        later = CudaTimer(device)
        t = tracer.timer
        raw = t.anchor_ns + round(t._anchor.elapsed_time(later._anchor) * 1e6)
        out["anchor_drift"] = {
            "after_s": (later.anchor_ns - t.anchor_ns) / 1e9,
            # the first anchor alone (as hvtrace resolved before it re-tied the clocks)
            "predicted_minus_measured_us": (raw - later.anchor_ns) / 1e3,
            # hvtrace's resolve: its newest tie and fitted rate
            "resolved_minus_measured_us": (t.resolve(later._anchor) - later.anchor_ns) / 1e3,
            "ties": len(getattr(t, "_ties", ())),
            "fitted_drift_ppm": getattr(t, "drift_ppm", None),
            "uncertainty_us": (t.anchor_uncertainty_ns + later.anchor_uncertainty_ns) / 1e3,
        }
    prof.export_chrome_trace(str(work / "profile.json"))
    for _ in range(2):  # a few more traced steps, so the profiled ones are flushed whole
        step()
    sync()
    hvtrace.finish()
    out["trace_files"] = [p.name for p in sorted((work / "run").glob("*"))]
    (work / "job.json").write_text(json.dumps(out, indent=1))


def cudart_path(maps: str) -> str | None:
    """The CUDA runtime library this process has loaded (torch's), from ``/proc/self/maps``."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        if len(fields) == 6 and "/libcudart.so" in fields[5]:
            return fields[5]
    return None


def _resolve_by_ctypes(timer: Any) -> str:
    """Make ``timer``'s ``ready`` and ``resolve`` call ``cudaEventQuery`` and
    ``cudaEventElapsedTime`` through ctypes on the events' raw handles (``torch.Event.event_id``,
    ``torch.cuda.Event.cuda_event``): ctypes releases the GIL during each call. Checked against
    torch's ``elapsed_time`` on the anchor first; returns what was done (or why not)."""
    import ctypes

    path = cudart_path(Path("/proc/self/maps").read_text())
    if path is None:
        return "no libcudart in this process"
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    query, elapsed = lib.cudaEventQuery, lib.cudaEventElapsedTime
    query.argtypes, query.restype = [ctypes.c_void_p], ctypes.c_int
    elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
    elapsed.restype = ctypes.c_int

    def handle(ev: Any) -> int:
        h = getattr(ev, "event_id", None)
        return int(h if h is not None else ev.cuda_event)

    ms = ctypes.c_float()
    probe = timer.now()
    import torch

    torch.cuda.synchronize()
    rc = elapsed(ctypes.byref(ms), handle(timer._tie), handle(probe))
    want = timer._tie.elapsed_time(probe)
    if rc != 0 or abs(ms.value - want) > 1e-3:
        return f"not used: rc {rc}, {ms.value} ms against torch's {want}"

    def ready(tok: Any) -> bool:
        return isinstance(tok, int) or query(handle(tok)) == 0

    def resolve(tok: Any) -> int:
        if isinstance(tok, int):
            return tok
        out = ctypes.c_float()
        if elapsed(ctypes.byref(out), handle(timer._tie), handle(tok)) != 0:
            raise RuntimeError("cudaEventElapsedTime failed")
        return timer._tie_ns + round(out.value * 1e6 * timer.rate)

    timer.ready, timer.resolve = ready, resolve
    return f"used ({path}; {ms.value:.4f} ms as torch's {want:.4f})"


def _time_writer_parts(timer: Any, writer: Any) -> dict[str, list[float]]:
    """Wrap the writer's parts (the timer's ready, resolve and keep_tied, the file's encode and
    write_batch, the status) with counters of calls, thread CPU and wall seconds."""
    parts: dict[str, list[float]] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)
        acc = parts.setdefault(label, [0, 0.0, 0.0])

        def timed(*a: Any, **k: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[0] += 1
                acc[1] += time.thread_time() - c0
                acc[2] += time.perf_counter() - w0

        setattr(obj, name, timed)

    for name in ("ready", "resolve", "keep_tied"):
        wrap(timer, name, name)
    wrap(writer.file, "encode", "encode")
    wrap(writer.file, "write_batch", "write_batch")
    wrap(writer, "_status", "status")
    wrap(writer, "_flush_locked", "flush")
    return parts


def _event_costs(torch: Any, tracer: Any, device: Any, n: int = 2000) -> dict[str, Any]:
    """What one CUDA-event timestamp costs the host, µs per call (median of 5 runs of ``n``):
    recording a ``torch.cuda.Event`` (Python stream object first), a ``torch.Event`` (C++), the
    timer's ``now()`` from its pool, then, on the writer's side, ``query()`` and the
    ``elapsed_time`` that resolves it. Errors are reported, never raised."""
    costs: dict[str, Any] = {}

    def per_call(fn: Any) -> float:
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(runs)

    timer = tracer.timer
    try:
        cev = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        it = iter(cev * 5)
        costs["cuda_event_record"] = per_call(lambda: next(it).record())
        if hasattr(torch, "Event"):
            gev = [torch.Event(device=device, enable_timing=True) for _ in range(n)]
            it2 = iter(gev * 5)
            costs["torch_event_record"] = per_call(lambda: next(it2).record())
        if not timer.is_cuda:  # a host-timed job: its timer reads the host clock
            costs["timer_now"] = per_call(timer.now)
            return costs
        warm = [timer.now() for _ in range(5 * n)]  # the pool filled: now() as in training
        torch.cuda.synchronize()
        for tok in warm:
            timer.release(tok)
        toks = []
        costs["timer_now"] = per_call(lambda: toks.append(timer.now()))
        torch.cuda.synchronize()
        it3 = iter(toks)
        costs["query"] = per_call(lambda: next(it3).query())
        it4 = iter(toks)
        costs["resolve"] = per_call(lambda: timer.resolve(next(it4)))
        for tok in toks:
            timer.release(tok)
        costs["event_type"] = type(timer._anchor).__module__ + "." + type(timer._anchor).__name__
    except Exception as exc:  # noqa: BLE001 - a figure missing, not the run
        costs["error"] = f"{type(exc).__name__}: {exc}"
    return costs


# -- the comparison (reads what the job left; offline too) ---------------------------------------
def _load_profile(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _x_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


def _corr(e: dict[str, Any]) -> Any:
    args = e.get("args") or {}
    return args.get("correlation", args.get("External id"))


def hvtrace_spans(run_dir: Path) -> list[dict[str, Any]]:
    """The rank's spans as dicts (step, kind, name, start_ns, end_ns, flags; local monotonic)."""
    sys.path.insert(0, str(ROOT))
    from hvtrace.format.read import find_trace_files, read_rank_file

    rows: list[dict[str, Any]] = []
    for path in find_trace_files(run_dir):
        rf = read_rank_file(path)
        t = rf.table.select(["step", "kind", "name", "start_ns", "end_ns", "flags"]).to_pylist()
        rows += t
    return rows


def launched_in(
    launches: list[dict[str, Any]], by_corr: dict[Any, list[dict[str, Any]]], mark: dict[str, Any]
) -> list[dict[str, Any]]:
    """The device work launched (any thread) while ``mark`` was open."""
    a, b = mark["ts"], mark["ts"] + mark["dur"]
    out: list[dict[str, Any]] = []
    for ev in launches:
        if a <= ev["ts"] <= b:
            out += by_corr.get(_corr(ev), [])
    return out


def hvtrace_headers(run_dir: Path) -> list[dict[str, Any]]:
    """The trace files' headers."""
    from hvtrace.format.read import find_trace_files, read_header

    return [read_header(p) for p in find_trace_files(run_dir)]


def _coverage(
    h: dict[str, Any],
    evs: list[dict[str, Any]],
    stream_ev: list[dict[str, Any]],
    mono: Any,
    tol_ns: float,
) -> dict[str, float]:
    """How one hvtrace phase span covers the phase's device work on the compute stream.

    ``outside_us``: the phase's device time outside the span (widened by ``tol_ns`` each side);
    ``foreign_us``: other device work on the stream inside the span (narrowed by ``tol_ns``);
    ``busy_us`` / ``idle_us``: the phase's device time inside the span, and the rest of it (the
    stream waiting for the host to launch: a CUDA event there fires when the host records it).
    """
    h0, h1 = h["start_ns"], h["end_ns"]
    ids = {id(e) for e in evs}
    outside = busy = foreign = 0.0
    for e in evs:
        k0, k1 = mono(e["ts"]), mono(e["ts"] + e["dur"])
        outside += max(0.0, (h0 - tol_ns) - k0) if k0 < h0 - tol_ns else 0.0
        outside += max(0.0, k1 - (h1 + tol_ns)) if k1 > h1 + tol_ns else 0.0
        busy += max(0.0, min(k1, h1) - max(k0, h0))
    for e in stream_ev:
        if id(e) in ids:
            continue
        k0, k1 = mono(e["ts"]), mono(e["ts"] + e["dur"])
        foreign += max(0.0, min(k1, h1 - tol_ns) - max(k0, h0 + tol_ns))
    return {
        "outside_us": outside / 1e3,
        "foreign_us": foreign / 1e3,
        "busy_us": busy / 1e3,
        "idle_us": max(0.0, (h1 - h0) - busy) / 1e3,
    }


def compare(work: Path) -> dict[str, Any]:
    """Compare one job's hvtrace spans with its profile (see the module docstring)."""
    job = json.loads((work / "job.json").read_text())
    prof_path = work / "profile.json"
    if not prof_path.exists():
        prof_path = work / "profile.json.gz"
    events = _x_events(_load_profile(prof_path))
    res: dict[str, Any] = {"model": job["model"], "device": job["device"], "timing": job["timing"]}

    ann = {
        e["name"]: e
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("gc.")
    }
    if "gc.clock" not in ann:
        res["error"] = "the profile has no gc.clock mark"
        return res
    # profile µs -> host monotonic ns, through the profiler's own tie of its clocks
    off_us = ann["gc.clock"]["ts"] - job["clock_mono_ns"] / 1e3

    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    by_corr: dict[Any, list[dict[str, Any]]] = {}
    for e in device:
        by_corr.setdefault(_corr(e), []).append(e)
    launched = partial(launched_in, launches, by_corr)
    tie = job.get("tie") or {}
    tie_mark = ann.get("gc.tie")
    tied = launched(tie_mark) if tie_mark and tie else []
    if tied:
        # profile µs -> hvtrace's CUDA times directly: the kernel between hvtrace's events a and
        # b ended just before b fired (b was recorded while it ran)
        k1_us = max(e["ts"] + e["dur"] for e in tied)
        tie_off_us = k1_us - tie["b_ns"] / 1e3
        res["clock_tie"] = {
            "by": "kernel between two hvtrace events",
            "kernel_us": sum(e["dur"] for e in tied),
            "a_before_kernel_us": (min(e["ts"] for e in tied) - tie_off_us) - tie["a_ns"] / 1e3,
            # what hvtrace's anchor and the profiler's CPU-GPU tie put between the two clocks
            "anchor_and_profiler_disagree_us": tie_off_us - off_us,
        }
        off_us = tie_off_us
    else:
        res["clock_tie"] = {"by": "profiler clock mark"}

    def mono(ts_us: float) -> float:
        return (ts_us - off_us) * 1e3

    res["profile_events"] = {
        "device": len(device),
        "launches": len(launches),
        "nccl_kernels": sum(1 for e in device if "nccl" in e["name"].lower()),
    }
    spans = hvtrace_spans(work / "run")
    by_step: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for s in spans:
        by_step.setdefault(s["step"], {}).setdefault(s["kind"], []).append(s)

    # the compute stream: where the forward kernels ran
    streams: dict[Any, int] = {}
    for m in job["marks"]:
        f = ann.get(f"gc.fwd.{m['i']}")
        for ev in launched(f) if f else []:
            s = (ev.get("args") or {}).get("stream")
            streams[s] = streams.get(s, 0) + 1
    compute_stream = max(streams, key=streams.get) if streams else None
    res["compute_stream"] = compute_stream
    #: what a phase's span is compared with: its device activity, or (no device activity: the
    #: CPU) its marks' host interval, which checks the step numbering and the clock tie alone
    res["against"] = "device" if compute_stream is not None else "host marks"

    phases: dict[str, list[dict[str, float]]] = {k: [] for k in PHASES}
    stream_ev = [e for e in device if (e.get("args") or {}).get("stream") == compute_stream]
    # what a boundary can be off by: the CUDA timer's anchor (its record-and-synchronize round
    # trip, as the trace header states it) and the profile's clock mark (a few µs)
    headers = hvtrace_headers(work / "run")
    anchor_ns = max((h.get("cuda_anchor_uncertainty_ns") or 0) for h in headers) if headers else 0
    clock_tol_ns = (0 if tied else anchor_ns) + CLOCK_MARK_NS
    res["clock_tolerance_us"] = clock_tol_ns / 1e3
    allreduce: list[dict[str, Any]] = []
    syncs: dict[str, list[int]] = {"untraced": [], "traced": []}
    all_syncs: dict[str, dict[str, int]] = {"untraced": {}, "traced": {}}
    main_tid = ann["gc.clock"].get("tid")  # the training thread, as the profile numbers it
    for m in job["marks"]:
        i = m["i"]
        whole = ann.get(f"gc.step.{i}")
        if whole is None:
            continue
        a, b = whole["ts"], whole["ts"] + whole["dur"]
        n_sync = sum(
            1
            for e in launches
            if e["name"] in SYNC_CALLS
            and a <= e["ts"] <= b
            and (main_tid is None or e.get("tid") == main_tid)
        )
        syncs["traced" if m["traced"] else "untraced"].append(n_sync)
        for e in launches:  # every thread's (Horovod's own wait on its events among them)
            if e["name"] in SYNC_CALLS and a <= e["ts"] <= b:
                d = all_syncs["traced" if m["traced"] else "untraced"]
                key = f"{e['name']}@{'train' if e.get('tid') == main_tid else 'other'}"
                d[key] = d.get(key, 0) + 1
        if not m["traced"]:
            continue
        hv = by_step.get(m["hv_step"], {})
        for kind, tags in PHASES.items():
            if compute_stream is None and kind == "update":  # its marks hold the wait too
                continue
            evs = []
            for t in tags:
                mk = ann.get(f"gc.{t}.{i}")
                if mk and compute_stream is None:  # no device activity (CPU): the marks themselves
                    evs.append(mk)
                elif mk:
                    evs += [
                        e
                        for e in launched(mk)
                        if (e.get("args") or {}).get("stream") == compute_stream
                    ]
            hs = hv.get(kind, [])
            if not evs or len(hs) != 1:
                phases[kind].append(
                    {"step": m["hv_step"], "missing": 1.0, "n_spans": float(len(hs))}
                )
                continue
            d0 = min(mono(e["ts"]) for e in evs)
            d1 = max(mono(e["ts"] + e["dur"]) for e in evs)
            h = hs[0]
            row = {
                "step": m["hv_step"],
                "device_us": (d1 - d0) / 1e3,
                "hvtrace_us": (h["end_ns"] - h["start_ns"]) / 1e3,
                "start_diff_us": (h["start_ns"] - d0) / 1e3,
                "end_diff_us": (h["end_ns"] - d1) / 1e3,
            }
            if compute_stream is not None:
                row.update(_coverage(h, evs, stream_ev, mono, clock_tol_ns))
            phases[kind].append(row)
        if compute_stream is None:
            continue
        # Horovod's device work of the step: everything not on the compute stream
        hvd_ev = [
            e
            for t in ("bwd", "opt")
            for e in (launched(ann[f"gc.{t}.{i}"]) if f"gc.{t}.{i}" in ann else [])
            if (e.get("args") or {}).get("stream") != compute_stream
        ]
        ars = hv.get("allreduce", [])
        inside = 0
        for e in hvd_ev:
            k0, k1 = mono(e["ts"]), mono(e["ts"] + e["dur"])
            if any(
                s["start_ns"] - TOL_US * 1e3 <= k0 and k1 <= s["end_ns"] + TOL_US * 1e3 for s in ars
            ):
                inside += 1
        allreduce.append(
            {
                "step": m["hv_step"],
                "hvtrace_allreduces": len(ars),
                "device_ops": len(hvd_ev),
                "nccl_kernels": sum(1 for e in hvd_ev if "nccl" in e["name"].lower()),
                "inside_spans": inside,
                "device_busy_us": sum(e["dur"] for e in hvd_ev),
                "hvtrace_span_us": (
                    (max(s["end_ns"] for s in ars) - min(s["start_ns"] for s in ars)) / 1e3
                )
                if ars
                else 0.0,
            }
        )
    res["phases"] = {k: _phase_summary(v) for k, v in phases.items()}
    res["phase_steps"] = phases
    res["allreduce"] = allreduce
    res["allreduce_summary"] = _allreduce_summary(allreduce)
    res["syncs_per_step"] = {k: (statistics.mean(v) if v else None) for k, v in syncs.items()}
    res["syncs_all_threads"] = all_syncs
    res["sync_ok"] = bool(syncs["traced"]) and max(syncs["traced"]) <= min(syncs["untraced"] or [0])
    return res


def _phase_summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Per phase: medians, and whether every step agreed.

    Against device work: the span holds all of the phase's device time and none of another
    phase's (each within the clock tolerance); the rest of the span is the stream waiting for the
    host (``idle``). Against host marks (no device): durations within ``TOL_SHARE`` / ``TOL_US``.
    """
    ok_rows = [r for r in rows if "device_us" in r]
    if not ok_rows:
        return {"steps": len(rows), "compared": 0}
    diffs = [abs(r["hvtrace_us"] - r["device_us"]) for r in ok_rows]
    if "outside_us" in ok_rows[0]:
        within = [r["outside_us"] == 0 and r["foreign_us"] == 0 for r in ok_rows]
    else:
        within = [
            abs(r["hvtrace_us"] - r["device_us"]) <= max(TOL_SHARE * r["device_us"], TOL_US)
            for r in ok_rows
        ]
    out = {
        "steps": len(rows),
        "compared": len(ok_rows),
        "device_median_us": statistics.median(r["device_us"] for r in ok_rows),
        "hvtrace_median_us": statistics.median(r["hvtrace_us"] for r in ok_rows),
        "abs_diff_median_us": statistics.median(diffs),
        "abs_diff_max_us": max(diffs),
        "start_diff_median_us": statistics.median(r["start_diff_us"] for r in ok_rows),
        "end_diff_median_us": statistics.median(r["end_diff_us"] for r in ok_rows),
        "within_tolerance": sum(within),
        "ok": all(within) and len(ok_rows) == len(rows),
    }
    for key in ("outside_us", "foreign_us", "busy_us", "idle_us"):
        if key in ok_rows[0]:
            out[
                f"{key[:-3]}_max_us"
                if key in ("outside_us", "foreign_us")
                else f"{key[:-3]}_median_us"
            ] = (
                max(r[key] for r in ok_rows)
                if key in ("outside_us", "foreign_us")
                else statistics.median(r[key] for r in ok_rows)
            )
    return out


def _allreduce_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"steps": 0}
    ops = sum(r["device_ops"] for r in rows)
    inside = sum(r["inside_spans"] for r in rows)
    return {
        "steps": len(rows),
        "device_ops": ops,
        "nccl_kernels": sum(r["nccl_kernels"] for r in rows),
        "inside_spans": inside,
        "hvtrace_allreduces_per_step": statistics.median(r["hvtrace_allreduces"] for r in rows),
        "ok": ops > 0 and inside == ops,
    }


def ab_summary(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over adjacent (untraced, traced) pairs of the traced block's extra time."""
    ratios = []
    for j in range(0, len(blocks) - 1, 2):
        a, b = blocks[j], blocks[j + 1]
        off, on = (a, b) if not a["traced"] else (b, a)
        ratios.append(on["ms_per_step"] / off["ms_per_step"] - 1)
    untraced = [b["ms_per_step"] for b in blocks if not b["traced"]]
    traced = [b["ms_per_step"] for b in blocks if b["traced"]]
    return {
        "pairs": len(ratios),
        "untraced_ms": statistics.median(untraced),
        "traced_ms": statistics.median(traced),
        "overhead_median": statistics.median(ratios),
        "overhead_min": min(ratios),
        "overhead_max": max(ratios),
    }


# -- the driver ----------------------------------------------------------------------------------
def _job(model: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gc_"))
    env = dict(os.environ, HOROVOD_ELASTIC="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    prof_steps = 0 if "@" in model else args.prof_steps  # the @ variants: A/B only
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--job", model, "--work", str(work),
        "--warmup", str(args.warmup), "--ab-pairs", str(args.ab_pairs),
        "--block-steps", str(args.block_steps), "--prof-steps", str(prof_steps),
    ]  # fmt: skip
    if args.dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.job_timeout)
    res: dict[str, Any] = {
        "model": model,
        "rc": p.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    (work / "job.log").write_text(p.stdout + p.stderr)
    res["log_tail"] = (p.stdout + p.stderr)[-2000:]
    if p.returncode != 0 or not (work / "job.json").exists():
        res["error"] = (p.stdout + p.stderr)[-3000:]
        _keep(work, model, out, ("job.log",))
        return res
    job = json.loads((work / "job.json").read_text())
    res["job"] = {k: v for k, v in job.items() if k not in ("marks",)}
    res["ab"] = ab_summary(job["ab_blocks"])
    if "marks" not in job:  # not profiled: results.json has it all
        return res
    try:
        res["compare"] = compare(work)
    except Exception as exc:  # noqa: BLE001 - reported, and the data kept for --compare
        res["compare"] = {"error": f"{type(exc).__name__}: {exc}"}
    rep = subprocess.run(
        [sys.executable, "-m", "hvtrace.cli", "analyze", str(work / "run")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (work / "report.txt").write_text(rep.stdout + rep.stderr)
    res["analyze_rc"], res["report"] = rep.returncode, (rep.stdout + rep.stderr)[-8000:]
    # the profile and the run, for offline comparison (kept small: gzip)
    with gzip.open(work / "profile.json.gz", "wb") as g:
        g.write((work / "profile.json").read_bytes())
    (work / "profile.json").unlink()
    _keep(work, model, out, ("job.json", "job.log", "report.txt", "profile.json.gz", "run"))
    return res


def _safe(model: str) -> str:
    """``model`` as the device tool's file names may hold it (letters, digits, '.', '_', '-')."""
    return model.replace(":", "_b").replace("@", "_")


def _keep(work: Path, model: str, out: Path, names: tuple[str, ...]) -> None:
    """One archive per model under ``out`` (the device tool brings back at most 8 files)."""
    safe = _safe(model)
    with tarfile.open(out / f"gc_{safe}.tar.gz", "w:gz") as tar:
        for name in names:
            if (work / name).exists():
                tar.add(work / name, arcname=f"gc_{safe}/{name}")


def _ok(flag: Any) -> str:
    return "OK" if flag else "MISMATCH"


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The figures as a short table (what is printed last)."""
    lines = [f"device: {results.get('device')}  torch {results.get('torch')}"]
    lines[0] += f"  dry_run={results['dry_run']}"
    for r in results["jobs"]:
        m = r["model"]
        if "error" in r:
            last = r["error"].strip().splitlines()[-1][:200] if r["error"].strip() else ""
            lines.append(f"{m}: FAILED rc={r['rc']}: {last}")
            continue
        ab = r["ab"]
        lines.append(
            f"{m}: timing={r['job']['timing']} untraced {ab['untraced_ms']:.3f} ms/step, "
            f"traced {ab['traced_ms']:.3f}; overhead median {100 * ab['overhead_median']:+.2f}% "
            f"[{100 * ab['overhead_min']:+.2f}..{100 * ab['overhead_max']:+.2f}] "
            f"over {ab['pairs']} pairs"
            + (
                f"; writer thread {r['job']['writer_cpu_us_per_step']:.0f} us CPU per traced step"
                if "writer_cpu_us_per_step" in r["job"]
                else ""
            )
        )
        if "ctypes" in r["job"]:
            lines.append(f"{m}: event calls by ctypes: {r['job']['ctypes']}")
        wp = r["job"].get("writer_parts_us_per_step")
        if wp:
            lines.append(
                f"{m}: writer per traced step (calls, us CPU, us wall): "
                + ", ".join(
                    f"{k} {v['calls']:.1f}/{v['cpu']:.0f}/{v['wall']:.0f}" for k, v in wp.items()
                )
            )
        sd = r["job"].get("sync_debug")
        if sd:
            n_off, n_on = sd["untraced"]["n"], sd["traced"]["n"]
            lines.append(f"{m}: sync-debug warnings per block: untraced {n_off}, traced {n_on}")
        costs = r["job"].get("event_costs_us")
        if costs:
            lines.append(
                f"{m}: host cost of one CUDA timestamp, us: "
                + ", ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in costs.items()
                )
            )
        drift = r["job"].get("anchor_drift")
        if drift:
            lines.append(
                f"{m}: CUDA clock vs host clock after {drift['after_s']:.1f} s: "
                f"{drift['predicted_minus_measured_us']:+.1f} us by the first anchor alone"
                + (
                    f", {drift['resolved_minus_measured_us']:+.1f} us as hvtrace resolves "
                    f"({drift['ties']} ties, fitted drift {drift['fitted_drift_ppm']:+.2f} ppm)"
                    if drift.get("fitted_drift_ppm") is not None
                    else ""
                )
                + f" (+-{drift['uncertainty_us']:.1f} us)"
            )
        c = r.get("compare")
        if c is None:  # an A/B-only job
            continue
        if "error" in c:
            lines.append(f"{m}: compare failed: {c['error']}")
            continue
        tie = c.get("clock_tie", {})
        if "anchor_and_profiler_disagree_us" in tie:
            lines.append(
                f"{m}: clocks tied by a kernel between hvtrace's events; hvtrace's anchor and the "
                f"profiler's own tie disagree by {tie['anchor_and_profiler_disagree_us']:+.1f} us"
            )
        for kind, s in c.get("phases", {}).items():
            if not s.get("compared"):
                lines.append(f"{m}: {kind}: not compared ({s.get('steps', 0)} steps)")
                continue
            line = (
                f"{m}: {kind}: device {s['device_median_us']:.1f} us, "
                f"hvtrace {s['hvtrace_median_us']:.1f} us; "
                f"start {s['start_diff_median_us']:+.1f} end {s['end_diff_median_us']:+.1f} us; "
            )
            if "outside_max_us" in s:
                line += (
                    f"phase work outside the span max {s['outside_max_us']:.1f} us, other work "
                    f"inside max {s['foreign_max_us']:.1f} us, stream idle in the span median "
                    f"{s['idle_median_us']:.1f} us; "
                )
            lines.append(line + f"{s['within_tolerance']}/{s['steps']} -> {_ok(s['ok'])}")
        a = c.get("allreduce_summary", {})
        if a.get("steps"):
            lines.append(
                f"{m}: allreduce: {a['device_ops']} Horovod device ops ({a['nccl_kernels']} NCCL "
                f"kernels) in {a['steps']} steps, {a['inside_spans']} inside hvtrace's allreduce "
                f"spans -> {_ok(a['ok'])}"
            )
        sp = c.get("syncs_per_step", {})
        verdict = "OK" if c.get("sync_ok") else "MORE WHEN TRACED"
        lines.append(
            f"{m}: host syncs per step on the training thread: untraced {sp.get('untraced')}, "
            f"traced {sp.get('traced')} -> {verdict}; all threads: {c.get('syncs_all_threads')}"
        )
        lines.append(f"{m}: hvtrace analyze rc={r.get('analyze_rc')}")
    return lines


def recompare(src: Path, out: Path) -> int:
    """Compare again what a device run brought back (``src``: its results.json and archives)."""
    results = json.loads((src / "results.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in results["jobs"]:
            safe = _safe(r["model"])
            archive = src / f"gc_{safe}.tar.gz"
            if "compare" not in r or not archive.exists():
                continue
            with tarfile.open(archive) as tar:
                tar.extractall(tmp, filter="data")
            r["compare"] = compare(Path(tmp) / f"gc_{safe}")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = summary_lines(results)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--dry-run", action="store_true", help="CPU only, small model, few steps")
    ap.add_argument("--models", default=None, help="comma-separated: resnet50, mlp (tiny: dry run)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--ab-pairs", type=int, default=None)
    ap.add_argument("--block-steps", type=int, default=None)
    ap.add_argument("--prof-steps", type=int, default=None)
    ap.add_argument("--job-timeout", type=int, default=300)
    ap.add_argument("--compare", metavar="DIR", help="compare a kept gc_MODEL folder, offline")
    ap.add_argument(
        "--recompare",
        metavar="DIR",
        help="a device run's output again (its gc_*.tar.gz) into --out",
    )
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    small = args.dry_run
    for name, full, dry in (
        ("warmup", 10, 3),
        ("ab_pairs", 8, 2),
        ("block_steps", 20, 4),
        ("prof_steps", 8, 3),
    ):
        if getattr(args, name) is None:
            setattr(args, name, dry if small else full)
    if args.job:
        run_job(args)
        return 0
    if args.compare:
        print(json.dumps(compare(Path(args.compare)), indent=1, default=str))
        return 0
    if args.recompare:
        return recompare(Path(args.recompare), Path(args.out))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    results: dict[str, Any] = {
        "dry_run": bool(args.dry_run),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "tolerance": {"share": TOL_SHARE, "us": TOL_US},
        "jobs": [],
    }
    models = (args.models or ("tiny,tiny@host" if args.dry_run else DEFAULT_MODELS)).split(",")
    for m in models:
        r = _job(m, args, out)
        results["jobs"].append(r)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = summary_lines(results)
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all("error" not in r for r in results["jobs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
