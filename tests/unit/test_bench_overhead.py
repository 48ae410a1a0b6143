"""The in-run A/B arithmetic of bench/overhead.py, on step times with a known cost."""

from __future__ import annotations

import importlib.util
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
