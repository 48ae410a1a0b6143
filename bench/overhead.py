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

Usage: ``python bench/overhead.py [--model small|large|both] [--rounds 5] [--steps 200]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("overhead")

REPO = Path(__file__).resolve().parent.parent
MODES: tuple[str, ...] = ("untraced", "hvtrace", "timeline", "torch_profiler")

#: Demo-model sizes (14 gradient tensors each). On the 2-core development machine with 2 ranks
#: (one torch thread each), quiet, "small" measured 14-20 ms per step and "large" about 100 ms;
#: the measured step time is always reported next to the figures.
MODELS: dict[str, dict[str, int]] = {
    "small": {"width": 384, "layers": 6, "batch_size": 64},
    "large": {"width": 1024, "layers": 6, "batch_size": 96},
}

#: hvtrace's overhead goals per model (percent of the untraced step time).
GOAL_OVERHEAD_PCT = {"small": 3.0, "large": 1.0}


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

    def median_ms(self, warmup: int) -> float:
        """Median step time (ms) after skipping ``warmup`` steps."""
        return 1e3 * statistics.median(self.step_s[warmup:])


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


def run_once(
    model: str,
    mode: str,
    rnd: int,
    args: argparse.Namespace,
    work: Path,
    ab_every: int = 0,
) -> RunResult:
    """Run the demo training once in ``mode``; return its step times and bytes written.

    ``ab_every`` > 0 (mode hvtrace only): recording is switched off and on every that many steps
    inside the run (``--ab-every`` of the demo), for the in-run A/B comparison.
    """
    d = work / f"{model}-{mode}{'-ab' if ab_every else ''}-r{rnd}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    size = MODELS[model]
    cmd = [
        horovodrun(),
        "-np",
        str(args.np),
        "-H",
        f"localhost:{args.np}",
        "--gloo",
        sys.executable,
        "-m",
        "hvtrace.examples.train",
        "--steps",
        str(args.steps),
        "--width",
        str(size["width"]),
        "--layers",
        str(size["layers"]),
        "--batch-size",
        str(size["batch_size"]),
        "--step-times",
        str(d / "steps-{rank}.json"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_TIMELINE", "HVTRACE")}
    env["PYTHONWARNINGS"] = "ignore"
    out: Path
    if mode == "untraced":
        cmd.append("--no-trace")
        out = d / "none"
    elif mode == "hvtrace":
        out = d / "trace"
        cmd += ["--trace-dir", str(out)]
        if ab_every:
            cmd += ["--ab-every", str(ab_every)]
    elif mode == "timeline":
        out = d / "timeline.json"
        cmd.append("--no-trace")
        env["HOROVOD_TIMELINE"] = str(out)
    elif mode == "torch_profiler":
        out = d / "profiler"
        cmd += ["--no-trace", "--torch-profiler", str(out)]
    else:
        raise ValueError(f"unknown mode {mode!r}")
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
    per_rank = []
    for r in range(args.np):
        f = d / f"steps-{r}.json"
        if not f.exists():
            raise RuntimeError(f"{model}/{mode} round {rnd}: rank {r} wrote no {f.name}")
        per_rank.append(json.loads(f.read_text()))
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
    wcpu = [pr.get("writer_cpu_s") for pr in per_rank]
    if all(w is not None for w in wcpu):
        res.writer_cpu_s_per_step = sum(wcpu) / args.steps
    res.checks = _check_mode(mode, per_rank, out, nbytes, nfiles, args.np)
    for problem in res.checks:
        log.warning("%s/%s round %d: %s", model, mode, rnd, problem)
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return res


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


def ab_summary(res: RunResult, every: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """Summarize an in-run A/B run: traced vs untraced steps of the same processes.

    Steps are cut into blocks of ``every`` (recording switched at each block's end); each
    untraced block and the traced block after it form a pair. The overhead is the ratio of the
    median traced step to the median untraced step (medians: one slow hiccup does not move
    them); its 95% interval comes from 2,000 bootstrap resamples of the pairs, so slow drifts of
    the machine, which hit both blocks of a pair alike, are resampled together.
    """
    t = np.asarray(res.step_s, dtype=np.float64) * 1e3
    on = np.asarray(res.traced, dtype=bool)
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
    on_ms, off_ms = float(np.median(on_)), float(np.median(off))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), (2000, len(pairs)))
    boot = np.array([np.median(on_[i]) / np.median(off[i]) for i in idx])
    lo, hi = np.quantile(100.0 * (boot - 1.0), [0.025, 0.975])
    return {
        "model": res.model,
        "steps": len(t),
        "every": every,
        "pairs": len(pairs),
        "on_ms": on_ms,
        "off_ms": off_ms,
        "overhead_pct": 100.0 * (on_ms / off_ms - 1.0),
        "ci95_pct": (float(lo), float(hi)),
        "writer_cpu_ms_per_step": None
        if res.writer_cpu_s_per_step is None
        # the writer only works while recording: per traced step
        else 1e3 * res.writer_cpu_s_per_step * len(t) / max(int(on.sum()), 1),
    }


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
        "writer, all ranks, per traced step."
    )
    rows = []
    for ab in abs_:
        ci = ab["ci95_pct"]
        w = ab["writer_cpu_ms_per_step"]
        rows.append(
            [
                ab["model"],
                f"{ab['steps']} / {ab['every']}",
                f"{ab['on_ms']:.1f}",
                f"{ab['off_ms']:.1f}",
                f"{ab['overhead_pct']:+.2f}% [{ci[0]:+.2f}..{ci[1]:+.2f}]",
                str(ab["pairs"]),
                "-" if w is None else f"{w:.3f}",
            ]
        )
    print(
        _table(
            [
                "model",
                "steps / N",
                "traced ms",
                "untraced ms",
                "overhead [95% CI]",
                "pairs",
                "writer CPU ms/step",
            ],
            rows,
        )
    )
    for ab in abs_:
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
        size = MODELS[model]
        print(
            f"\nmodel {model}: MLP width {size['width']}, {size['layers']} layers, batch "
            f"{size['batch_size']} per rank"
        )
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
        help="comma-separated modes",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds (each runs every mode once)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps of a run not counted")
    p.add_argument("--model", choices=["small", "large", "both"], default="both")
    p.add_argument("--np", type=int, default=2, help="ranks (all on localhost)")
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
    p.add_argument("--workdir", default=None, help="where runs write (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep every run's files and logs")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if "untraced" not in args.modes:
        log.info("adding mode 'untraced': the overhead is measured against it")
        args.modes.insert(0, "untraced")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    models = ["small", "large"] if args.model == "both" else [args.model]
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
                for mode in args.modes[k:] + args.modes[:k]:
                    done += 1
                    try:
                        res = run_once(model, mode, rnd, args, work)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        log.error("run %d/%d failed, left out: %s", done, total, exc)
                        failed.append(f"{model}/{mode} round {rnd + 1}: {exc}".splitlines()[0])
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
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log.info("run files kept in %s", work)
    summary = summarize(runs, args)
    print_tables(summary, args)
    print_ab(abs_)
    for f in failed:
        print(f"FAILED (left out): {f}")
    if args.json:
        doc = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "workdir", "keep")},
            "models": {m: MODELS[m] for m in models},
            "summary": summary,
            "in_run_ab": abs_,
            "goals": {
                m: [{"goal": t, "met": ok, "note": why} for t, ok, why in goals(m, per)]
                for m, per in summary.items()
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
