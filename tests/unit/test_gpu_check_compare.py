"""scripts/gpu_check.py's comparison parts that run only on a GPU, on made-up device activity:
how a phase span covers its kernels (issue 38), the A/B summary, launches matched to kernels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _k(ts_us: float, dur_us: float, corr: int = 0, stream: int = 7) -> dict:
    return {"ts": ts_us, "dur": dur_us, "args": {"correlation": corr, "stream": stream}}


def mono(ts_us: float) -> float:  # the profile's µs are the host's ns / 1000 here
    return ts_us * 1e3


def test_a_span_holding_its_kernels_and_idle_time_agrees(gc) -> None:
    """The stream idle before the first kernel (waiting for the host) is inside the span; no
    kernel of the phase outside it, no other phase's kernel inside it."""
    phase = [_k(200, 100), _k(300, 50)]
    other = [_k(0, 90), _k(400, 100)]  # the phase before (ends at 90) and after (from 400)
    span = {"start_ns": 100_000, "end_ns": 352_000}
    cov = gc._coverage(span, phase, phase + other, mono, tol_ns=5_000)
    assert cov["outside_us"] == 0 and cov["foreign_us"] == 0
    assert cov["busy_us"] == 150 and cov["idle_us"] == 102


def test_a_span_that_misses_kernels_or_takes_others_is_caught(gc) -> None:
    phase = [_k(200, 100), _k(300, 50)]
    other = [_k(100, 60)]  # another phase's kernel 100..160 inside the span
    late = {"start_ns": 100_000, "end_ns": 320_000}  # ends 30 µs before the phase's last kernel
    cov = gc._coverage(late, phase, phase + other, mono, tol_ns=5_000)
    assert cov["outside_us"] == pytest.approx(25)  # 350 - (320 + 5)
    assert cov["foreign_us"] == pytest.approx(55)  # 105..160
    summary = gc._phase_summary(
        [{"device_us": 150, "hvtrace_us": 220, "start_diff_us": -100, "end_diff_us": -30, **cov}]
    )
    assert summary["ok"] is False and summary["outside_max_us"] == pytest.approx(25)


def test_launches_are_matched_to_their_device_work_by_correlation(gc) -> None:
    mark = {"ts": 10, "dur": 20}
    launches = [{"ts": 12, "args": {"correlation": 1}}, {"ts": 40, "args": {"correlation": 2}}]
    k1, k2 = _k(50, 5, corr=1), _k(60, 5, corr=2)
    assert gc.launched_in(launches, {1: [k1], 2: [k2]}, mark) == [k1]


def test_the_ab_summary_pairs_each_untraced_block_with_its_traced_neighbour(gc) -> None:
    blocks = [
        {"traced": False, "ms_per_step": 10.0},
        {"traced": True, "ms_per_step": 11.0},
        {"traced": True, "ms_per_step": 10.2},
        {"traced": False, "ms_per_step": 10.0},
    ]
    ab = gc.ab_summary(blocks)
    assert ab["pairs"] == 2
    assert ab["overhead_min"] == pytest.approx(0.02) and ab["overhead_max"] == pytest.approx(0.1)
    assert ab["overhead_median"] == pytest.approx(0.06)


def test_the_event_cost_probe_reports_each_cost_or_its_error(gc) -> None:
    """The probe of what one CUDA timestamp costs, against a fake torch: every figure is there;
    an event type that fails is an error in the figures, not a failed run."""
    from types import SimpleNamespace

    from hvtrace.record.timers import HostTimer

    class Ev:
        def __init__(self, *a, **k) -> None:
            self.t = None

        def record(self, stream=None) -> None:
            self.t = 1.0

        def query(self) -> bool:
            return True

        def elapsed_time(self, other) -> float:
            return 0.5

    class Timer:
        is_cuda = True

        def __init__(self) -> None:
            self._anchor, self.pool = Ev(), []

        def now(self) -> Ev:
            e = self.pool.pop() if self.pool else Ev()
            e.record()
            return e

        def resolve(self, e: Ev) -> int:
            return 5

        def release(self, e: Ev) -> None:
            self.pool.append(e)

    torch = SimpleNamespace(cuda=SimpleNamespace(Event=Ev, synchronize=lambda: None), Event=Ev)
    costs = gc._event_costs(torch, SimpleNamespace(timer=Timer()), "cuda:0", n=20)
    assert {"cuda_event_record", "torch_event_record", "timer_now", "query", "resolve"} <= set(
        costs
    ), costs
    assert all(v >= 0 for k, v in costs.items() if k != "event_type")

    def broken(*a, **k):
        raise RuntimeError("no device")

    torch.Event = broken
    costs = gc._event_costs(torch, SimpleNamespace(timer=Timer()), "cuda:0", n=20)
    assert costs["error"] == "RuntimeError: no device" and "cuda_event_record" in costs

    # a host-timed job (its timer's tokens are ints): the host clock's cost, no events to query
    torch.Event = Ev
    host = gc._event_costs(torch, SimpleNamespace(timer=HostTimer()), "cuda:0", n=20)
    assert "error" not in host and "timer_now" in host and "query" not in host, host


def test_the_cuda_runtime_is_found_in_the_process_maps(gc) -> None:
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 456 "
        "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n"
    )
    assert gc.cudart_path(maps).endswith("/nvidia/cu13/lib/libcudart.so.13")
    assert gc.cudart_path(maps.splitlines()[0]) is None
