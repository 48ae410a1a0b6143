"""The in-run A/B arithmetic of bench/overhead.py, on step times with a known cost."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest


def _overhead_module():
    path = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"
    spec = importlib.util.spec_from_file_location("overhead_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _run(mod, cost: float, steps: int = 2000, every: int = 4, seed: int = 1):
    """Noisy step times with a slow drift; traced steps cost ``cost`` (fraction) more."""
    rng = np.random.default_rng(seed)
    i = np.arange(steps)
    traced = (i // every) % 2 == 1  # recording switched at the end of every block, off first
    base = 100.0 * (1 + 0.2 * np.sin(i / 150.0))  # the machine drifts by +-20%
    step_ms = base * rng.lognormal(0.0, 0.15, steps) * np.where(traced, 1 + cost, 1.0)
    return mod.RunResult(
        "large", "hvtrace", 0, list(step_ms / 1e3), 0, 2, 0.0, 0.0, 0.0,
        traced=list(traced), writer_cpu_s_per_step=1e-4,
    )  # fmt: skip


@pytest.mark.parametrize("cost", [0.0, 0.02, 0.10])
def test_ab_summary_recovers_a_known_cost_within_its_interval(cost):
    mod = _overhead_module()
    ab = mod.ab_summary(_run(mod, cost), every=4, warmup=10)
    lo, hi = ab["ci95_pct"]
    assert lo < 100 * cost < hi
    assert abs(ab["overhead_pct"] - 100 * cost) < 2.5
    assert ab["pairs"] == (2000 - 12) // 8  # blocks 3.. (warm-up cut), each off block + next on
    assert ab["writer_cpu_ms_per_step"] == pytest.approx(0.2)  # per traced step: half the steps
    met = mod.ab_goal(ab)[1]
    assert met == (ab["overhead_pct"] <= 1.0)


def test_ab_summary_needs_pairs():
    mod = _overhead_module()
    with pytest.raises(RuntimeError, match="block pair"):
        mod.ab_summary(_run(mod, 0.0, steps=12), every=4, warmup=10)


@pytest.mark.parametrize("n", [1, 3, 5, 6, 10, 25])
def test_median_ci_is_the_binomial_order_statistic_interval(n):
    mod = _overhead_module()
    values = [float(v) for v in range(n, 0, -1)]  # unsorted on purpose
    lo, hi, cover = mod.median_ci(values)
    assert lo <= np.median(values) <= hi
    if n >= 6:  # enough values: the exact coverage reaches 95%, and is the tightest that does
        assert cover >= 0.95
        k = int(lo)  # values are 1..n, so x(k) == k
        assert hi == n + 1 - k
        tighter = 1 - 2 * sum(math.comb(n, j) for j in range(k + 1)) / 2**n
        assert tighter < 0.95
    else:  # too few: the range, with its own coverage
        assert (lo, hi) == (1.0, float(n))
        assert cover == pytest.approx(max(0.0, 1 - 2 / 2**n))
    if n == 10:
        assert (lo, hi) == (2.0, 9.0)
        assert cover == pytest.approx(1 - 22 / 1024)


def test_median_ci_covers_the_true_median_about_as_often_as_it_says():
    mod = _overhead_module()
    rng = np.random.default_rng(3)
    hits = 0
    for _ in range(2000):
        xs = rng.lognormal(0.0, 1.0, 10)  # skewed, true median 1
        lo, hi, cover = mod.median_ci(list(xs))
        hits += lo <= 1.0 <= hi
    assert abs(hits / 2000 - cover) < 0.02


def _proc_run(mod, mode, rnd, cpu_ms, rss, job=5.0):
    marks = [
        {
            "at": "start",
            "maxrss_mb": 10.0,
            "rss_mb": 10.0,
            "cpu_s": 0.0,
            "wall_s": 0.0,
            "threads": 1,
        },
        {
            "at": "loop end",
            "maxrss_mb": rss,
            "rss_mb": rss,
            "cpu_s": job,
            "wall_s": 9.0,
            "threads": 2,
        },
    ]
    return mod.RunResult(
        "small", mode, rnd, [0.015] * 20, 0, 0, 0.0, 0.0, cpu_ms / 1e3,
        job_cpu_s=[job, job], maxrss_mb=[rss, rss + 2.0], marks=marks,
        loop_thread_cpu_s={"main": [cpu_ms * 0.01, cpu_ms * 0.01], "writer": [0.0, 0.0],
                           "other": [cpu_ms * 0.01 / 2, cpu_ms * 0.01 / 2]},
    )  # fmt: skip


def test_whole_summary_pairs_rounds_and_judges_the_goals():
    mod = _overhead_module()
    runs = []
    for rnd in range(10):
        drift = 1.0 + 0.3 * (rnd % 3)  # rounds differ a lot; pairs share the drift
        runs.append(_proc_run(mod, "untraced", rnd, 30.0 * drift, 300.0 + rnd))
        runs.append(_proc_run(mod, "hvtrace", rnd, 30.0 * drift * 1.01, 320.0 + rnd, job=5.5))
    args = mod.parse_args(["--model", "small", "--modes", "untraced,hvtrace"])
    whole = mod.whole_summary(runs, args)["small"]
    hv = whole["modes"]["hvtrace"]
    assert hv["cpu"]["diff"] == pytest.approx(1.0)  # percent, paired per round
    assert hv["cpu"]["ci"] == pytest.approx((1.0, 1.0))
    assert hv["rss"]["diff"] == pytest.approx(20.0)  # MB per rank (mean over ranks)
    assert hv["rss_max"]["diff"] == pytest.approx(20.0)
    assert hv["job_cpu"]["diff"] == pytest.approx(0.5)
    assert hv["cpu"]["rounds"] == 10 and hv["cpu"]["coverage"] > 0.95
    assert hv["main_cpu"]["diff"] == pytest.approx(1.0)
    assert whole["threads"]["untraced"]["other"] == pytest.approx(39.0 / 2)  # median round
    assert whole["stages"]["hvtrace"]["loop end"]["maxrss_mb"] == pytest.approx(314.5)
    assert whole["stages"]["hvtrace"]["loop end"]["threads"] == 2
    goals = {text: met for text, met, _ in mod.whole_goals(whole["modes"])}
    assert goals == {"CPU/step added <= 1.5%": True, "peak RSS added <= 35 MB/rank": True}
    # a round without its untraced partner is left out of the pairs
    hv2 = mod.whole_summary(runs[1:], args)["small"]["modes"]["hvtrace"]
    assert hv2["cpu"]["rounds"] == 9


def test_whole_goals_note_when_the_interval_straddles_the_limit():
    mod = _overhead_module()
    p = {"diff": 1.0, "ci": (-2.0, 4.0), "coverage": 0.98}
    goals = mod.whole_goals({"hvtrace": {"cpu": p, "rss": {**p, "diff": 40.0, "ci": (38, 42)}}})
    (_, cpu_met, cpu_note), (_, rss_met, rss_note) = goals
    assert cpu_met and "within noise" in cpu_note
    assert not rss_met and rss_note == ""


def test_models_option_accepts_lists_and_the_old_names():
    mod = _overhead_module()
    assert mod.parse_args(["--model", "both"]).models == ["small", "large"]
    assert mod.parse_args(["--model", "small"]).models == ["small"]
    assert mod.parse_args(["--model", "all"]).models == list(mod.MODELS)
    assert mod.parse_args(["--model", "small,deep"]).models == ["small", "deep"]
    assert mod.parse_args([]).modes == list(mod.DEFAULT_MODES)
    with pytest.raises(SystemExit):
        mod.parse_args(["--model", "huge"])
    assert mod.grad_tensors("deep") >= 150
    assert mod.grad_tensors("small") == 14


def test_loop_thread_cpu_takes_the_loop_from_each_ranks_marks():
    mod = _overhead_module()

    def marks(main0, main1, writer1):
        return [
            {"at": "loop start", "thread_cpu_s": {"main": main0, "writer": 0.0, "other": 1}},
            {"at": "loop end", "thread_cpu_s": {"main": main1, "writer": writer1, "other": 3}},
        ]

    got = mod.loop_thread_cpu([marks(1.0, 4.0, 0.5), marks(2.0, 3.0, 0.25)])
    assert got == {"main": [3.0, 1.0], "writer": [0.5, 0.25], "other": [2, 2]}
    assert mod.loop_thread_cpu([marks(1.0, 4.0, 0.5)[:1]]) == {}


def test_ab_summary_compares_main_thread_cpu_when_measured():
    mod = _overhead_module()
    run = _run(mod, 0.05)
    assert mod.ab_summary(run, every=4, warmup=10)["cpu_overhead_pct"] is None
    run.step_cpu_s = [0.5 * s for s in run.step_s]  # CPU: half of each step, same cost
    ab = mod.ab_summary(run, every=4, warmup=10)
    assert ab["cpu_overhead_pct"] == pytest.approx(ab["overhead_pct"])
    assert ab["cpu_on_ms"] == pytest.approx(0.5 * ab["on_ms"])
    lo, hi = ab["cpu_ci95_pct"]
    assert lo < 5.0 < hi


def test_by_parts_adds_the_training_threads_and_hvtraces_threads_cost_per_rank():
    """A run whose traced steps' main-thread CPU is 0.1 ms more (outside Horovod's waits), with
    hvtrace's threads at 0.06 ms per step for two ranks, against 10 ms of untraced CPU per rank:
    about 1.3%, its interval around that; the verdict follows the interval."""
    mod = _overhead_module()
    run = _run(mod, 0.0)
    on = np.asarray(run.traced)
    rng = np.random.default_rng(5)
    cpu = 5.0 + rng.normal(0.0, 0.2, len(on)) + np.where(on, 0.1, 0.0)  # ms
    wait = np.full(len(on), 1.0)
    run.step_cpu_s, run.step_wait_s = list(cpu / 1e3), list(wait / 1e3)
    ab = mod.ab_summary(run, every=4, warmup=10)
    summary = {"large": {"untraced": {"cpu_ms_per_step": 20.0}}}  # two ranks
    whole = {"large": {"threads": {"hvtrace": {"writer": 0.06}}}}
    parts = mod.by_parts(summary, whole, [ab], 2)["large"]
    assert parts["hooks_ms"] == pytest.approx(0.1, abs=0.04)
    assert parts["main_ms"] == pytest.approx(0.1, abs=0.04)
    assert parts["hooks_measured"] == "outside Horovod's waits"
    assert parts["threads_ms"] == pytest.approx(0.03)
    assert parts["threads_from"] == "whole-process runs"
    assert parts["pct"] == pytest.approx(100 * (parts["hooks_ms"] + 0.03) / 10.0)
    lo, hi = parts["pct_ci"]
    assert lo < 1.3 < hi
    without = mod.by_parts(summary, {}, [ab], 2)["large"]  # no whole-process runs: A/B's writer
    assert without["threads_ms"] == pytest.approx(ab["writer_cpu_ms_per_step"] / 2)
    assert without["threads_from"] == "in-run A/B, writer only"
    assert mod.by_parts({}, whole, [ab], 2) == {}  # no untraced runs: nothing to compare with


def test_concurrent_rounds_run_their_modes_at_once_on_cpus_that_change_hands(tmp_path):
    mod = _overhead_module()
    args = mod.parse_args(["--np", "1", "--concurrent", "--modes", "untraced,hvtrace"])
    assert args.pin  # --concurrent pins each job to its CPU
    import threading

    both_started = threading.Barrier(2, timeout=10)

    def fake_run_once(model, mode, rnd, a, work, cpu_offset=0):
        both_started.wait()  # raises BrokenBarrierError unless the other mode runs meanwhile
        if mode == "hvtrace" and rnd == 1:
            raise RuntimeError("rank 0 wrote no steps-0.json")
        return f"{mode}@{cpu_offset}"

    mod.run_once = fake_run_once
    got = [mod._round_runs("small", ["hvtrace", "untraced"], rnd, args, tmp_path) for rnd in (0, 1)]
    assert got[0] == [("untraced", "untraced@0"), ("hvtrace", "hvtrace@1")]
    assert got[1][0] == ("untraced", "untraced@1")  # the CPUs change hands each round
    assert got[1][1][0] == "hvtrace" and isinstance(got[1][1][1], RuntimeError)
    assert (tmp_path / "rank_child.py").read_text() == mod.RANK_CHILD


def test_concurrent_needs_one_rank():
    mod = _overhead_module()
    with pytest.raises(SystemExit):
        mod.parse_args(["--np", "2", "--concurrent"])
