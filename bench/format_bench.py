#!/usr/bin/env python
"""Benchmark hvtrace's trace format: bytes per span, read speed, and the hot-path cost of a span.

For each configuration (gradient tensors per step x simulated step time) it synthesizes a run of
``--spans`` spans with the mix hvtrace records on a real CPU run: per step one ``input``,
``forward``, ``backward``, ``wait``, ``update`` and ``step`` span, and one ``allreduce`` span per
gradient tensor (names like ``net.3.weight``, real byte counts, float32), with nanosecond
timestamps drawn with jitter. It then measures, side by side in one process:

* bytes per span on disk, written through hvtrace's own ``Recorder`` + ``BackgroundWriter`` (the
  real writer path; flushes happen at the real flush interval on the *simulated* clock, so batches
  hold exactly the spans a real run would put in one batch; the file measured is the Parquet file
  the writer compacts the closed stream into), through ``TraceFile`` directly with the same
  batches (the live ``.arrows`` stream a crashed rank leaves), and through ``TraceFile`` with large
  batches;
* read speed of ``hvtrace.load.load_run`` on one core, best of ``--read-repeats``;
* the same spans as a Chrome JSON trace (``json.dump`` / ``json.loads``), bytes per span and
  spans per second, so the ratio to hvtrace is visible;
* the host cost of one span on the hot path: ``Recorder.add()`` per call in a tight loop, and a
  ``with hvtrace.span(...)`` block; and, in child processes with a one-rank Horovod, the main
  thread's CPU that the real ``Tracer`` adds per allreduce and per step.

Usage: ``python bench/format_bench.py [--spans 2000000] [--configs 14x20,14x100,100x100]
[--json F]``. Only the Tracer cost, this tree's side by side with an older tree's (a git worktree):
``python bench/format_bench.py --tracer-only --baseline-src /tmp/hvtrace-base --tracer-rounds 3``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from hvtrace.format.schema import (
    DTYPE_CODE,
    FLAG_END_UPPER_BOUND,
    FORMAT_NAME,
    FORMAT_VERSION,
    KIND_CODE,
    KINDS,
    PARQUET_SUFFIX,
    TRACE_SUFFIXES,
)
from hvtrace.load import load_run
from hvtrace.record import recorder as recmod
from hvtrace.record.recorder import Recorder
from hvtrace.record.writer import TraceFile

log = logging.getLogger("format_bench")

#: Goals the figures are checked against.
GOAL_BYTES_PER_SPAN = 48.0
GOAL_READ_SPANS_PER_S = 2_000_000.0

#: The writer's flush interval as a traced run gets it: ``$HVTRACE_FLUSH_S``, else the Recorder's
#: default (read from its signature so the bench follows hvtrace).
DEFAULT_FLUSH_S: float = float(
    os.environ.get(
        "HVTRACE_FLUSH_S", inspect.signature(Recorder).parameters["flush_interval_s"].default
    )
)

K_STEP, K_INPUT, K_FORWARD, K_BACKWARD, K_ALLREDUCE, K_WAIT, K_UPDATE = (
    KIND_CODE[k] for k in ("step", "input", "forward", "backward", "allreduce", "wait", "update")
)
F32 = DTYPE_CODE["float32"]
NAN = math.nan
#: Large batches for the "best case" row (what the columns cost without per-batch overhead).
BIG_BATCH_SPANS = 65_536

Row = tuple  # (step, micro, kind, name, start_ns, end_ns, bytes, dtype, value, flags)


# -- synthetic runs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One synthetic run: ``tensors`` gradient tensors per step, ``step_ms`` per step."""

    tensors: int
    step_ms: float

    @property
    def spans_per_step(self) -> int:
        """Spans recorded per step (six per-step spans plus one per tensor)."""
        return 6 + self.tensors

    @property
    def label(self) -> str:
        """Short name used in the tables."""
        return f"{self.tensors}t/{self.step_ms:g}ms"

    @classmethod
    def parse(cls, text: str) -> Config:
        """Parse ``TENSORSxSTEP_MS`` (for example ``14x20``)."""
        try:
            k, ms = text.lower().split("x")
            cfg = cls(int(k), float(ms))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad config {text!r}: expected TENSORSxSTEP_MS like 14x20"
            ) from None
        if cfg.tensors < 1 or cfg.step_ms <= 0:
            raise argparse.ArgumentTypeError(f"bad config {text!r}: need tensors>=1, step_ms>0")
        return cfg


def tensor_table(tensors: int, width: int = 1024, in_dim: int = 256) -> list[tuple[str, int]]:
    """Return (name, bytes) of an MLP's gradient tensors in the order gradients become ready.

    Names follow ``nn.Sequential`` of Linear+ReLU blocks (``net.0.weight``, ``net.0.bias``,
    ``net.2.weight``, ...); the last layer's gradients are ready first.
    """
    out: list[tuple[str, int]] = []
    layer = 0
    while len(out) < tensors:
        fan_in = in_dim if layer == 0 else width
        out.append((f"net.{2 * layer}.weight", fan_in * width * 4))
        if len(out) < tensors:
            out.append((f"net.{2 * layer}.bias", width * 4))
        layer += 1
    return out[::-1]


def synth_steps(cfg: Config, n_spans: int, seed: int = 0) -> Iterator[tuple[int, list[Row]]]:
    """Yield ``(step_end_ns, rows)`` per step, rows in the order the Tracer records them.

    Times are ns on a monotonic clock with per-phase jitter; allreduces start during backward
    (one per gradient) and end when observed (by ``synchronize`` at the latest), as on the CPU.
    Stops after exactly ``n_spans`` rows.
    """
    rng = np.random.default_rng(seed)
    tensors = tensor_table(cfg.tensors)
    k = cfg.tensors
    step_ns = cfg.step_ms * 1e6
    frac = np.array([0.03, 0.25, 0.45, 0.15, 0.12])  # input, forward, backward, wait, update
    t = int(1.7e12) + int(rng.integers(0, 10**9))  # a monotonic clock some minutes after boot
    left = n_spans
    step = 0
    while left > 0:
        d = (frac * step_ns * rng.uniform(0.9, 1.1, 5)).astype(np.int64)
        t_in, t_fw, t_bw, t_sync, t_up = np.cumsum(d) + t
        ready = np.sort(rng.uniform(0.0, 1.0, k)) * (t_bw - t_fw) + t_fw
        done = ready + rng.uniform(0.05, 0.6, k) * step_ns
        starts = ready.astype(np.int64).tolist()
        ends = np.minimum(done.astype(np.int64), t_sync).tolist()
        t_in, t_fw, t_bw, t_sync, t_up = int(t_in), int(t_fw), int(t_bw), int(t_sync), int(t_up)
        rows: list[Row] = [
            (step, 0, K_INPUT, "input", t, t_in, 0, 0, NAN, 0),
            (step, 0, K_FORWARD, "forward", t_in, t_fw, 0, 0, NAN, 0),
            (step, 0, K_BACKWARD, "backward", t_fw + int(d[2]) // 50, starts[-1], 0, 0, NAN, 0),
            (step, 0, K_WAIT, "synchronize", t_bw, t_sync, 0, 0, NAN, 0),
        ]
        flags = FLAG_END_UPPER_BOUND
        rows += [
            (step, 0, K_ALLREDUCE, name, s, e, nb, F32, NAN, flags)
            for (name, nb), s, e in zip(tensors, starts, ends)
        ]
        rows.append((step, 0, K_UPDATE, "update", t_sync, t_up, 0, 0, NAN, 0))
        rows.append((step, 0, K_STEP, "step", t, t_up, 0, 0, NAN, 0))
        if len(rows) > left:
            rows = rows[:left]
        left -= len(rows)
        yield t_up, rows
        t = t_up
        step += 1


def make_header(run_id: str) -> dict[str, Any]:
    """Return a header like the Tracer's (same fields, realistic size) for rank 0 of 1."""
    mono, wall = time.monotonic_ns(), time.time_ns()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "run_id": run_id,
        "rank": 0,
        "size": 1,
        "local_rank": 0,
        "local_size": 1,
        "cross_rank": 0,
        "cross_size": 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": "cpu",
        "timing": "host_monotonic",
        "torch_version": None,
        "horovod_version": None,
        "horovod_env": {},
        "optimizer": {"class": "SGD", "backward_passes_per_step": 1, "tensors": 0},
        "model": "MLP",
        "mono_anchor_ns": mono,
        "wall_anchor_ns": wall,
        "clock": {
            "method": "barrier-interval",
            "reference_rank": 0,
            "start": {
                "at_ns": mono,
                "offset_ns": 0,
                "uncertainty_ns": 0,
                "rounds": 8,
                "bounded": True,
            },
        },
    }


class Progress:
    """Logs ``label: NN%`` at most every ``every_s`` seconds while a long pass runs."""

    def __init__(self, label: str, total: int, every_s: float = 5.0) -> None:
        self.label = label
        self.total = max(1, total)
        self.every_s = every_s
        self._last = time.monotonic()

    def update(self, done: int) -> None:
        """Report progress if ``every_s`` passed since the last report."""
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            log.info("%s: %3.0f%%", self.label, 100 * min(done / self.total, 1.0))


# -- writing -------------------------------------------------------------------------------------
def write_with_recorder(cfg: Config, n: int, out_dir: Path, flush_s: float) -> dict[str, Any]:
    """Write a run through Recorder.add + BackgroundWriter; return bytes/span and writer cost.

    The writer thread's own timer is set far out; instead ``Recorder.flush()`` (the very call the
    thread makes) runs whenever the simulated clock passes another ``flush_s``, so every batch
    holds what a real run of this configuration would flush at that interval. The flushes' CPU
    time (``time.thread_time_ns``: encode, compress, write) is the writer's cost per span.
    """
    rec = Recorder(out_dir, make_header("recorder"), buffer_spans=1 << 24, flush_interval_s=1e6)
    if not rec.enabled:
        raise RuntimeError(f"recorder could not open {rec.path}")
    add = rec.add
    interval = int(flush_s * 1e9)
    next_flush: int | None = None
    flush_ns = 0
    batches = 0
    done = 0
    prog = Progress(f"[{cfg.label}] recorder write", n)
    for end, rows in synth_steps(cfg, n):
        if next_flush is None:
            next_flush = rows[0][4] + interval
        for r in rows:
            add(r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[0])
        done += len(rows)
        if end >= next_flush:
            t0 = time.thread_time_ns()
            rec.flush()
            flush_ns += time.thread_time_ns() - t0
            batches += 1
            while next_flush <= end:
                next_flush += interval
            prog.update(done)
    t0 = time.thread_time_ns()
    rec.close()
    flush_ns += time.thread_time_ns() - t0
    if recmod.active_recorder() is rec:
        recmod._set_active(None)
    # a cleanly closed file is compacted into Parquet beside the stream (which is removed)
    compacted = rec.path.with_suffix(PARQUET_SUFFIX)
    path = compacted if compacted.exists() else rec.path
    if path != compacted:
        log.warning("[%s] the closed file was not compacted: measuring the stream", cfg.label)
    size = path.stat().st_size
    return {
        "bytes": size,
        "bytes_per_span": size / n,
        "format": "parquet" if path == compacted else "arrows",
        "batches": batches + 1,
        "spans_per_batch": n / (batches + 1),
        "writer_us_per_span": flush_ns / 1e3 / n,
        "path": str(path),
    }


def write_with_tracefile(
    cfg: Config, n: int, path: Path, flush_s: float | None, batch_spans: int | None = None
) -> dict[str, Any]:
    """Write a run through ``TraceFile.append`` directly, one batch per ``flush_s`` of simulated
    time (or per ``batch_spans`` spans); return bytes/span and the encode+write CPU cost."""
    tf = TraceFile(path, make_header("tracefile"))
    interval = int(flush_s * 1e9) if flush_s else None
    next_flush: int | None = None
    pending: list[Row] = []
    written = 0
    batches = 0
    append_ns = 0

    def emit(step: int, final: bool) -> None:
        nonlocal pending, written, batches, append_ns
        written += len(pending)
        status = {"dropped": 0, "clock": [], "last_step": step, "final": final, "spans": written}
        t0 = time.thread_time_ns()
        tf.append(pending, status)
        append_ns += time.thread_time_ns() - t0
        batches += 1
        pending = []

    step = 0
    done = 0
    prog = Progress(f"[{cfg.label}] TraceFile write ({path.name})", n)
    for end, rows in synth_steps(cfg, n):
        step = rows[0][0]
        pending.extend(rows)
        done += len(rows)
        prog.update(done)
        if interval is not None:
            if next_flush is None:
                next_flush = rows[0][4] + interval
            if end >= next_flush:
                emit(step, False)
                while next_flush <= end:
                    next_flush += interval
        elif batch_spans is not None and len(pending) >= batch_spans:
            emit(step, False)
    emit(step, True)
    tf.close()
    size = path.stat().st_size
    return {
        "bytes": size,
        "bytes_per_span": size / n,
        "batches": batches,
        "spans_per_batch": n / batches,
        "writer_us_per_span": append_ns / 1e3 / n,
    }


# -- reading -------------------------------------------------------------------------------------
def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Return the fastest of ``repeats`` runs of ``fn()`` as (wall s, process CPU s).

    Wall time (``time.perf_counter``) is the figure; CPU time (``time.process_time``) is shown
    beside it because it is less disturbed by other processes on a busy machine.
    """
    best_wall = best_cpu = math.inf
    for _ in range(repeats):
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        del out
        best_wall, best_cpu = min(best_wall, dt), min(best_cpu, dc)
    return best_wall, best_cpu


def read_speed(run_dir: Path, n: int, repeats: int) -> dict[str, float]:
    """Spans/s of ``load_run`` (the full loader: validation, clock alignment, DataFrame) and of
    a bare pyarrow read of the same file (Parquet once compacted, else the Arrow IPC stream),
    both on one core, best of ``repeats``."""
    import pyarrow.parquet as pq

    files = sorted(p for p in run_dir.iterdir() if p.suffix in TRACE_SUFFIXES)

    def arrow_only() -> list[pa.Table]:
        out = []
        for f in files:
            if f.suffix == PARQUET_SUFFIX:
                out.append(pq.read_table(f, memory_map=True))
                continue
            with pa.memory_map(str(f)) as src:
                out.append(pa.ipc.open_stream(src).read_all())
        return out

    run = load_run(run_dir)
    if len(run.spans) != n:
        raise RuntimeError(f"load_run read {len(run.spans)} spans from {run_dir}, expected {n}")
    del run
    t_load, c_load = best_of(lambda: load_run(run_dir), repeats)
    t_arrow, c_arrow = best_of(arrow_only, repeats)
    return {
        "load_run_s": t_load,
        "load_run_spans_per_s": n / t_load,
        "load_run_spans_per_cpu_s": n / c_load,
        "arrow_read_spans_per_s": n / t_arrow,
        "arrow_read_spans_per_cpu_s": n / c_arrow,
    }


# -- Chrome JSON -------------------------------------------------------------------------------
def chrome_json(cfg: Config, n: int, path: Path, repeats: int) -> dict[str, float]:
    """Write the same spans as Chrome trace events with ``json.dump``, read them back with
    ``json.loads``; return bytes/span, write and read spans/s (read: best of ``repeats``)."""
    prog = Progress(f"[{cfg.label}] chrome events", n)
    events: list[dict[str, Any]] = []
    for _, rows in synth_steps(cfg, n):
        for step, _micro, kind, name, s, e, nb, dt, _v, _f in rows:
            args: dict[str, Any] = {"kind": KINDS[kind], "step": step}
            if kind == K_ALLREDUCE:
                args["bytes"] = nb
                args["dtype"] = "float32" if dt == F32 else str(dt)
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "ts": s / 1e3,
                    "dur": (e - s) / 1e3,
                    "pid": 0,
                    "tid": 0,
                    "args": args,
                }
            )
        prog.update(len(events))
    log.info("[%s] Chrome JSON: json.dump of %d events", cfg.label, len(events))
    t0 = time.perf_counter()
    with open(path, "w") as f:
        json.dump(events, f)
    t_write = time.perf_counter() - t0
    del events
    gc.collect()
    size = path.stat().st_size

    def read() -> Any:
        return json.loads(path.read_bytes())

    log.info("[%s] Chrome JSON: json.loads, 1 + %d times", cfg.label, repeats)
    loaded = read()
    if len(loaded) != n:
        raise RuntimeError(f"json.loads read {len(loaded)} events, expected {n}")
    del loaded
    t_read, c_read = best_of(read, repeats)
    return {
        "bytes": size,
        "bytes_per_span": size / n,
        "write_spans_per_s": n / t_write,
        "read_spans_per_s": n / t_read,
        "read_spans_per_cpu_s": n / c_read,
    }


# -- hot path ------------------------------------------------------------------------------------
def _time_loop(
    fn: Callable[[int], int], calls: int, repeats: int, reset: Callable[[], None]
) -> tuple[float, float]:
    """Run ``fn(calls)`` (returns ns) ``repeats`` times; return (best, median) ns per call."""
    per_call = []
    for _ in range(repeats):
        reset()
        gc.collect()
        gc.disable()
        try:
            per_call.append(fn(calls) / calls)
        finally:
            gc.enable()
    reset()
    return min(per_call), statistics.median(per_call)


def hot_path(out_dir: Path, calls: int, repeats: int) -> dict[str, float]:
    """Host cost (µs) of recording one span: ``Recorder.add`` per call, ``hvtrace.span``.

    Each figure is a tight loop of ``calls`` iterations timed with ``time.perf_counter_ns`` (loop
    overhead included; the empty loop is reported alongside), repeated ``repeats`` times: best and
    median per call. The buffer is emptied between repeats, outside the timing, so no span is
    ever dropped (a dropped span would be cheaper).
    """
    rec = Recorder(out_dir, make_header("hotpath"), buffer_spans=1 << 24, flush_interval_s=1e6)
    buf = rec._buf
    name = "net.4.weight"
    start, end = 1_700_000_000_000, 1_700_000_123_456

    def empty(n: int) -> int:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        return time.perf_counter_ns() - t0

    def add_allreduce(n: int) -> int:
        add = rec.add
        t0 = time.perf_counter_ns()
        for _ in range(n):  # the Tracer's call for one allreduce span
            add(K_ALLREDUCE, name, start, end, 4_194_304, F32, flags=FLAG_END_UPPER_BOUND, step=7)
        return time.perf_counter_ns() - t0

    def add_simple(n: int) -> int:
        add = rec.add
        t0 = time.perf_counter_ns()
        for _ in range(n):  # the Tracer's call for a forward/update/step span
            add(K_FORWARD, "forward", start, end, flags=0)
        return time.perf_counter_ns() - t0

    def user_span(n: int) -> int:
        span = recmod.span
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with span("data"):
                pass
        return time.perf_counter_ns() - t0

    def reset() -> None:
        buf.clear()

    loops = {"empty_loop": empty, "add_allreduce": add_allreduce, "add_simple": add_simple}
    out: dict[str, float] = {}

    def measure(key: str, fn: Callable[[int], int]) -> None:
        best, med = _time_loop(fn, calls, repeats, reset)
        out[f"{key}_us"], out[f"{key}_median_us"] = best / 1e3, med / 1e3

    for key, fn in loops.items():
        measure(key, fn)
    recmod._set_active(rec)
    try:
        measure("span", user_span)
    finally:
        recmod._set_active(None)
    measure("span_not_tracing", user_span)
    if rec.dropped:
        raise RuntimeError(f"hot-path loop dropped {rec.dropped} spans; results invalid")
    rec.close()
    return out


#: Horovod cycle time (ms) in the Tracer child. The main thread spin-waits in ``synchronize`` for
#: Horovod's background cycle, so its CPU time per step is quantized by the cycle (1 ms by
#: default); a short cycle makes the difference between the arms hvtrace's own work.
CHILD_CYCLE_TIME_MS = "0.01"


def _run_tracer_child(
    tensors: int,
    steps: int,
    trace_dir: Path,
    timeout_s: float,
    src: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> dict:
    """Run :func:`_tracer_child` in a child process (one-rank Horovod); return its figures.

    ``src``: a source tree whose ``hvtrace`` the child imports (first on ``PYTHONPATH``), to
    measure another version of the Tracer (``--baseline-src``) with the same child code.
    ``extra_env``: settings for the child (``HVTRACE_POLL_US``, ``HVTRACE_NATIVE``, ...).
    """
    spec = {"tensors": tensors, "steps": steps, "trace_dir": str(trace_dir)}
    cmd = [sys.executable, os.path.abspath(__file__), "--_tracer-child", json.dumps(spec)]
    env = dict(
        os.environ,
        HOROVOD_ELASTIC="1",
        HOROVOD_CYCLE_TIME=CHILD_CYCLE_TIME_MS,
        PYTHONWARNINGS="ignore",
    )
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), env.get("PYTHONPATH", "")])
    env.update(extra_env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"tracer child failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if src is not None and not out["hvtrace_file"].startswith(str(Path(src).resolve())):
        raise RuntimeError(f"the child imported {out['hvtrace_file']}, not the tree {src}")
    return out


def _cost(lo: dict, hi: dict, key: str = "added_per_step_us") -> tuple[float, float]:
    """(per allreduce, per step) µs: slope and intercept of the added cost over tensor count."""
    slope = (hi[key] - lo[key]) / (hi["tensors"] - lo["tensors"])
    return slope, lo[key] - slope * lo["tensors"]


def tracer_cost(
    tensors_lo: int,
    tensors_hi: int,
    steps: int,
    trace_dir: Path,
    timeout_s: float,
    baseline_src: str | None = None,
    rounds: int = 1,
    baseline_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The real Tracer's added main-thread CPU, split into per-allreduce and per-step parts.

    Runs :func:`_tracer_child` with two models (``tensors_lo`` and ``tensors_hi`` gradient
    tensors); the added cost per step is a line in the number of tensors: its slope is the cost
    per allreduce, its intercept the cost per step (the step/input/forward/backward/wait/update
    spans, hooks and per-step bookkeeping). With ``baseline_src`` the same children also run
    with the ``hvtrace`` of that tree, alternating with this tree's in each of ``rounds`` rounds;
    the figures are the medians over the rounds. ``baseline_env``: the baseline arm's settings
    (with ``baseline_src`` this tree: ``HVTRACE_POLL_US`` large, the cost of polling itself;
    ``HVTRACE_NATIVE=0``, the compiled wrapper against the pure-Python one).
    """
    arms = (
        {"current": None} if baseline_src is None else {"current": None, "baseline": baseline_src}
    )
    per: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    runs: dict[str, list] = {k: [] for k in arms}
    excl: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    for r in range(rounds):
        order = list(arms.items())
        for name, src in order if r % 2 == 0 else order[::-1]:
            d = trace_dir / f"{name}{r}"
            env = baseline_env if name == "baseline" else None
            lo = _run_tracer_child(tensors_lo, steps, d / "lo", timeout_s, src, env)
            hi = _run_tracer_child(tensors_hi, steps, d / "hi", timeout_s, src, env)
            runs[name].append([lo, hi])
            per[name].append(_cost(lo, hi))
            excl[name].append(_cost(lo, hi, "added_excl_wait_us"))
    out: dict[str, Any] = {"horovod_cycle_time_ms": float(CHILD_CYCLE_TIME_MS), "rounds": rounds}
    for name in arms:
        slopes, icepts = zip(*per[name])
        fig = {
            "runs": runs[name][-1],
            "per_allreduce_us": statistics.median(slopes),
            "per_step_us": statistics.median(icepts),
            "per_allreduce_us_rounds": list(slopes),
            "per_step_us_rounds": list(icepts),
        }
        slopes, icepts = zip(*excl[name])
        fig["excl_wait"] = {
            "per_allreduce_us": statistics.median(slopes),
            "per_step_us": statistics.median(icepts),
            "per_allreduce_us_rounds": list(slopes),
            "per_step_us_rounds": list(icepts),
        }
        if name == "current":
            out.update(fig)
        else:
            out["baseline"] = dict(fig, src=str(baseline_src), env=baseline_env or {})
    return out


def _tracer_child(spec: dict[str, Any]) -> dict[str, float]:
    """Main-thread CPU per step with and without hvtrace's Tracer, in a one-rank Horovod job.

    Two identical models of ``tensors`` tiny gradient tensors, one under
    ``hvd.DistributedOptimizer``, one under ``hvtrace.DistributedOptimizer(model=...)``; steps
    alternate one by one. ``HOROVOD_ELASTIC=1`` makes Horovod register its gradient hooks
    with one rank, so every gradient goes through the real enqueue/poll/synchronize path. The
    figure is the main thread's CPU time (``time.thread_time_ns``; Horovod's background thread
    and hvtrace's writer thread excluded): the median of the paired per-step differences, traced
    minus untraced. The parent sets a short ``HOROVOD_CYCLE_TIME`` (see
    :data:`CHILD_CYCLE_TIME_MS`).
    """
    import horovod.torch as hvd
    import torch
    from torch import nn

    import hvtrace

    hvd.init()
    torch.set_num_threads(1)
    k, steps = int(spec["tensors"]), int(spec["steps"])
    # The main thread's CPU inside Horovod's per-handle waits (a spin whose length follows how
    # soon Horovod's background thread gets a core: on a busy machine it swamps the rest). This
    # wrapper goes in before hvtrace wraps the same function, so hvtrace's own work around the
    # wait stays outside it: both arms, both trees alike.
    import horovod.torch.optimizer as hopt

    wait_ns = [0]
    horovod_sync = hopt.synchronize

    def timed_synchronize(handle: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return horovod_sync(handle)
        finally:
            wait_ns[0] += time.thread_time_ns() - t0

    hopt.synchronize = timed_synchronize

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(8, 8) for _ in range(k // 2)]
        return nn.Sequential(*layers)

    m_plain, m_traced = model(), model()
    o_plain = hvd.DistributedOptimizer(
        torch.optim.SGD(m_plain.parameters(), lr=0.0),
        named_parameters=[(f"plain.{n}", p) for n, p in m_plain.named_parameters()],
    )
    o_traced = hvtrace.DistributedOptimizer(
        torch.optim.SGD(m_traced.parameters(), lr=0.0),
        named_parameters=[(f"traced.{n}", p) for n, p in m_traced.named_parameters()],
        trace_dir=spec["trace_dir"],
        model=m_traced,
    )
    x = torch.randn(4, 8)
    tensors = sum(1 for _ in m_traced.parameters())

    waits: dict[str, list[int]] = {"plain": [], "traced": []}

    def one_step(m: nn.Module, opt: Any) -> int:
        wait_ns[0] = 0
        t0 = time.thread_time_ns()
        opt.zero_grad()
        m(x).sum().backward()
        opt.step()
        cpu = time.thread_time_ns() - t0
        waits["traced" if opt is o_traced else "plain"].append(wait_ns[0])
        return cpu

    samples: dict[str, list[int]] = {"plain": [], "traced": []}
    for _ in range(20):  # warm-up
        one_step(m_plain, o_plain)
        one_step(m_traced, o_traced)
    # One step of each in turn, the order swapped every step; the figure is the median of the
    # paired differences (a busy machine's slow drift cancels out of each pair).
    diffs: list[int] = []
    excl: list[int] = []
    for i in range(steps):
        if i % 2 == 0:
            a = one_step(m_plain, o_plain)
            b = one_step(m_traced, o_traced)
        else:
            b = one_step(m_traced, o_traced)
            a = one_step(m_plain, o_plain)
        samples["plain"].append(a)
        samples["traced"].append(b)
        diffs.append(b - a)
        # the same pair without the CPU spent inside Horovod's waits
        excl.append((b - waits["traced"][-1]) - (a - waits["plain"][-1]))
    hvtrace.finish(sync_clock=False)
    plain = statistics.median(samples["plain"]) / 1e3
    traced = statistics.median(samples["traced"]) / 1e3
    added = statistics.median(diffs) / 1e3
    return {
        "hvtrace_file": str(Path(hvtrace.__file__).resolve()),
        "tensors": tensors,
        "steps": len(samples["plain"]),
        "plain_step_cpu_us": plain,
        "traced_step_cpu_us": traced,
        "added_per_step_us": added,
        "added_per_allreduce_us": added / tensors,
        "added_excl_wait_us": statistics.median(excl) / 1e3,
        "plain_wait_cpu_us": statistics.median(waits["plain"][20:]) / 1e3,
    }


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--spans", type=int, default=2_000_000, help="spans per configuration")
    p.add_argument(
        "--configs",
        type=lambda s: [Config.parse(c) for c in s.split(",")],
        default=[Config(14, 20.0), Config(14, 100.0), Config(100, 100.0)],
        help="comma-separated TENSORSxSTEP_MS configurations (default 14x20,14x100,100x100)",
    )
    p.add_argument(
        "--flush-s", type=float, default=DEFAULT_FLUSH_S, help="writer flush interval (s)"
    )
    p.add_argument("--read-repeats", type=int, default=3, help="read timings, best taken")
    p.add_argument("--no-chrome", action="store_true", help="skip the Chrome JSON comparison")
    p.add_argument("--calls", type=int, default=500_000, help="calls per hot-path timing loop")
    p.add_argument("--call-repeats", type=int, default=7, help="hot-path loops, median taken")
    p.add_argument(
        "--hook-steps",
        type=int,
        default=400,
        help="steps per arm for the Tracer per-allreduce cost (0: skip)",
    )
    p.add_argument(
        "--hook-tensors",
        type=int,
        default=100,
        help="gradient tensors of the larger hook model",
    )
    p.add_argument(
        "--hook-tensors-lo",
        type=int,
        default=10,
        help="gradient tensors of the smaller hook model (even, >= 2): the per-step figure is the "
        "line's value at 0 tensors, so a smaller model carries less of the slope's noise into it",
    )
    p.add_argument(
        "--tracer-only",
        action="store_true",
        help="measure only the Tracer cost (no format, read or hot-path figures)",
    )
    p.add_argument(
        "--baseline-src",
        default=None,
        metavar="DIR",
        help="also measure the Tracer of the hvtrace in this source tree (a git worktree of an "
        "older commit), alternating with this one's: both figures in one table",
    )
    p.add_argument(
        "--tracer-rounds", type=int, default=1, help="Tracer cost rounds (median over rounds)"
    )
    p.add_argument(
        "--baseline-poll-ns",
        type=int,
        default=None,
        help="the baseline arm's Tracer polls in-flight allreduces at most this often (ns, "
        "as $HVTRACE_POLL_US; at most 10**9); with --baseline-src . and 10**9: what polling costs",
    )
    p.add_argument(
        "--baseline-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the baseline arm's children (repeatable); with --baseline-src . and "
        "HVTRACE_NATIVE=0: the compiled per-allreduce wrapper against the pure-Python one",
    )
    p.add_argument("--workdir", default=None, help="where to write files (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--_tracer-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    lo, hi = args.hook_tensors_lo, args.hook_tensors
    if lo < 2 or lo % 2 or hi <= lo:
        p.error(f"--hook-tensors-lo {lo}: an even number >= 2, below --hook-tensors ({hi})")
    return args


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(
        h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))
    )
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    return "\n".join(out)


def _ok(passed: bool) -> str:
    return "ok" if passed else "MISSED"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement; return the figures (also printed as tables)."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    n = args.spans
    results: dict[str, Any] = {
        "spans": n,
        "flush_s": args.flush_s,
        "read_repeats": args.read_repeats,
        "calls": args.calls,
        "call_repeats": args.call_repeats,
        "codec": next((c for c in ("zstd", "lz4") if pa.Codec.is_available(c)), None),
        "pyarrow": pa.__version__,
        "python": sys.version.split()[0],
        "configs": [],
    }
    with tempfile.TemporaryDirectory(prefix="hvtrace-fmt-", dir=args.workdir) as tmp:
        root = Path(tmp)
        for i, cfg in enumerate([] if args.tracer_only else args.configs):
            log.info("config %d/%d: %s, %d spans", i + 1, len(args.configs), cfg.label, n)
            d = root / f"c{i}"
            rec_dir = d / "recorder"
            r: dict[str, Any] = {
                "tensors": cfg.tensors,
                "step_ms": cfg.step_ms,
                "spans_per_step": cfg.spans_per_step,
                "recorder": write_with_recorder(cfg, n, rec_dir, args.flush_s),
            }
            r["tracefile"] = write_with_tracefile(cfg, n, d / "tf.arrows", args.flush_s)
            r["tracefile_big"] = write_with_tracefile(
                cfg, n, d / "tf_big.arrows", None, BIG_BATCH_SPANS
            )
            log.info("[%s] reading with load_run (best of %d)", cfg.label, args.read_repeats)
            r["read"] = read_speed(rec_dir, n, args.read_repeats)
            if not args.no_chrome:
                r["chrome"] = chrome_json(cfg, n, d / "trace.json", args.read_repeats)
            results["configs"].append(r)
            for f in d.rglob("*"):
                if f.is_file():
                    f.unlink()
        if not args.tracer_only:
            log.info("hot path: %d calls x %d loops", args.calls, args.call_repeats)
            results["hot_path"] = hot_path(root / "hot", args.calls, args.call_repeats)
        if args.hook_steps > 0:
            log.info("Tracer cost: %d steps per arm in a one-rank Horovod child", args.hook_steps)
            try:
                results["tracer"] = tracer_cost(
                    args.hook_tensors_lo,
                    args.hook_tensors,
                    args.hook_steps,
                    root / "tracer",
                    timeout_s=1800,
                    baseline_src=args.baseline_src,
                    rounds=args.tracer_rounds,
                    baseline_env=_baseline_env(args),
                )
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                log.warning("Tracer per-allreduce cost not measured: %s", exc)
    return results


def _baseline_env(args: argparse.Namespace) -> dict[str, str]:
    """The baseline arm's settings: ``--baseline-env`` pairs and ``--baseline-poll-ns``."""
    env = {}
    for pair in args.baseline_env:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--baseline-env {pair!r}: expected NAME=VALUE")
        env[name] = value
    if args.baseline_poll_ns is not None:
        env["HVTRACE_POLL_US"] = f"{args.baseline_poll_ns / 1e3:g}"
    return env


def _label(c: dict[str, Any]) -> str:
    return f"{c['tensors']}t/{c['step_ms']:g}ms"


def _mps(x: float) -> str:
    return f"{x / 1e6:.2f} M/s"


def print_tables(res: dict[str, Any]) -> None:
    """Print the figures as tables, with the goals next to them."""
    configs = res["configs"]
    if not configs and "hot_path" not in res:  # --tracer-only
        if res.get("tracer"):
            print_tracer(res["tracer"])
        return
    print(
        f"\nhvtrace format benchmark: {res['spans']:,} spans per configuration; config = "
        f"gradient tensors per step / simulated step time;\nwriter flushes every "
        f"{res['flush_s']:g} s of simulated time; codec {res['codec']}; pyarrow {res['pyarrow']}"
    )
    print(f"\nBytes per span on disk (goal <= {GOAL_BYTES_PER_SPAN:g}) and writer CPU per span")
    rows = [
        [
            _label(c),
            f"{c['recorder']['spans_per_batch']:,.0f}",
            f"{c['recorder']['bytes_per_span']:.1f}",
            _ok(c["recorder"]["bytes_per_span"] <= GOAL_BYTES_PER_SPAN),
            f"{c['tracefile']['bytes_per_span']:.1f}",
            f"{c['tracefile_big']['bytes_per_span']:.1f}",
            f"{c['recorder']['writer_us_per_span']:.2f}",
        ]
        for c in configs
    ]
    headers = [
        "config",
        "spans/batch",
        "Recorder+Writer (.parquet)",
        "goal",
        "TraceFile",
        f"TraceFile {BIG_BATCH_SPANS // 1024}k-batches",
        "flush µs/span",
    ]
    print(_table(headers, rows))
    print(
        f"\nRead speed, spans/s on one core, best of {res['read_repeats']} (CPU-time rate in "
        "parentheses: less disturbed by a busy machine)"
    )
    rows = []
    for c in configs:
        rd, ch = c["read"], c.get("chrome")
        rows.append(
            [
                _label(c),
                f"{_mps(rd['load_run_spans_per_s'])} ({_mps(rd['load_run_spans_per_cpu_s'])})",
                _ok(rd["load_run_spans_per_s"] >= GOAL_READ_SPANS_PER_S),
                f"{_mps(rd['arrow_read_spans_per_s'])}",
                f"{_mps(ch['read_spans_per_s'])}" if ch else "-",
                f"{rd['load_run_spans_per_s'] / ch['read_spans_per_s']:.1f}x" if ch else "-",
            ]
        )
    headers = [
        "config",
        f"load_run (goal >= {GOAL_READ_SPANS_PER_S / 1e6:g} M/s)",
        "goal",
        "bare pyarrow read",
        "Chrome json.loads",
        "load_run/json",
    ]
    print(_table(headers, rows))
    if any("chrome" in c for c in configs):
        print("\nThe same spans as a Chrome JSON trace (json.dump / json.loads, wall time)")
        rows = [
            [
                _label(c),
                f"{c['chrome']['bytes_per_span']:.1f}",
                f"{c['recorder']['bytes_per_span']:.1f}",
                f"{c['chrome']['bytes_per_span'] / c['recorder']['bytes_per_span']:.1f}x",
                _mps(c["chrome"]["write_spans_per_s"]),
                _mps(c["chrome"]["read_spans_per_s"]),
            ]
            for c in configs
            if "chrome" in c
        ]
        headers = ["config", "JSON B/span", "hvtrace B/span", "JSON/hvtrace", "dump", "loads"]
        print(_table(headers, rows))
    hp = res["hot_path"]
    print(
        f"\nHost cost of one span on the hot path, µs per call ({res['calls']:,} calls per loop, "
        f"{res['call_repeats']} loops; loop overhead included)"
    )
    items = [
        ("Recorder.add(), allreduce span", "add_allreduce"),
        ("Recorder.add(), forward/update/step span", "add_simple"),
        ("with hvtrace.span(...): (tracing)", "span"),
        ("with hvtrace.span(...): (not tracing)", "span_not_tracing"),
        ("empty loop iteration (reference)", "empty_loop"),
    ]
    rows = [[t, f"{hp[k + '_us']:.3f}", f"{hp[k + '_median_us']:.3f}"] for t, k in items]
    print(_table(["what", "best", "median"], rows))
    tr = res.get("tracer")
    if tr:
        print_tracer(tr)


def print_tracer(tr: dict[str, Any]) -> None:
    """Print the Tracer cost (and the baseline's, when measured)."""
    base = tr.get("baseline")
    name = "baseline"
    if base is not None and base.get("env"):
        name += " (" + ", ".join(f"{k}={v}" for k, v in base["env"].items()) + ")"
    arms = [("this tree", tr)] + ([(name, base)] if base is not None else [])
    hi = tr["runs"][1]
    print(
        f"\nReal Tracer path, one-rank Horovod (cycle time {tr['horovod_cycle_time_ms']:g} "
        f"ms), {hi['steps']} steps per arm: main-thread CPU per step, median, µs"
        + (f" (last of {tr['rounds']} rounds)" if tr["rounds"] > 1 else "")
    )
    rows = [
        [
            f"{name}, {r['tensors']} gradient tensors",
            f"{r['plain_step_cpu_us']:.0f}",
            f"{r['traced_step_cpu_us']:.0f}",
            f"{r['added_per_step_us']:.0f}",
        ]
        for name, a in arms
        for r in a["runs"]
    ]
    print(_table(["model", "hvd optimizer", "hvtrace optimizer", "added (paired median)"], rows))
    rounds = f", median of {tr['rounds']} rounds" if tr["rounds"] > 1 else ""
    print(f"\nhvtrace's added main-thread CPU{rounds} (goal <= 2 µs/allreduce, <= 15 µs/step):")
    rows = [
        [
            name,
            f"{a['per_allreduce_us']:.2f}",
            f"{a['per_step_us']:.1f}",
            " ".join(f"{x:.2f}" for x in a["per_allreduce_us_rounds"]),
            " ".join(f"{x:.1f}" for x in a["per_step_us_rounds"]),
        ]
        for name, a in arms
    ]
    print(_table(["hvtrace", "µs/allreduce", "µs/step", "rounds: µs/ar", "µs/step"], rows))
    if all("excl_wait" in a for _, a in arms):
        print(
            "\nThe same, without the main thread's CPU inside Horovod's per-handle waits (a spin "
            "as long as Horovod's\nbackground thread takes to get a core: on a busy machine it "
            "swamps hvtrace's own cost):"
        )
        rows = [
            [
                name,
                f"{a['excl_wait']['per_allreduce_us']:.2f}",
                f"{a['excl_wait']['per_step_us']:.1f}",
                " ".join(f"{x:.2f}" for x in a["excl_wait"]["per_allreduce_us_rounds"]),
                " ".join(f"{x:.1f}" for x in a["excl_wait"]["per_step_us_rounds"]),
            ]
            for name, a in arms
        ]
        print(_table(["hvtrace", "µs/allreduce", "µs/step", "rounds: µs/ar", "µs/step"], rows))


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args._tracer_child is not None:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(_tracer_child(json.loads(args._tracer_child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("hvtrace").setLevel(logging.WARNING)
    res = run(args)
    print_tables(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        log.info("figures written to %s", args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
