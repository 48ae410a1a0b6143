"""Clock offsets: barrier-interval estimation, interpolation, and alignment of loaded runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import make_header, row, status, write_rank_file

from hvtrace.clock import ClockEstimate, drift_ppm, estimate_offsets, offset_at
from hvtrace.load import load_run

RUN = "20240101-000000-c10c40"


def simulate_barrier(
    theta: np.ndarray,
    rounds: int,
    rng: np.random.Generator,
    arrive_us: float = 50.0,
    release_us: float = 10.0,
    leave_us: float = 30.0,
    step_at: int | None = None,
    step_rank: int = 1,
    step_ns: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Simulate barrier rounds; ``theta[i]`` is rank i's clock minus true time (ns).

    Each round: ranks arrive at random times, the barrier releases after the last arrival, every
    rank leaves a random latency later. With ``step_at`` the clock of ``step_rank`` jumps by
    ``step_ns`` from that round on (an inconsistent clock).
    """
    size = len(theta)
    enter = np.zeros((size, rounds), np.int64)
    exit_ = np.zeros((size, rounds), np.int64)
    t = 5 * 10**12
    for r in range(rounds):
        arrive = t + rng.exponential(arrive_us * 1e3, size).astype(np.int64)
        release = arrive.max() + int(rng.exponential(release_us * 1e3))
        leave = release + rng.exponential(leave_us * 1e3, size).astype(np.int64) + 1
        th = theta.copy()
        if step_at is not None and r >= step_at:
            th[step_rank] += step_ns
        enter[:, r] = arrive + th
        exit_[:, r] = leave + th
        t = int(leave.max()) + int(rng.integers(1_000, 200_000))
    return enter, exit_


@pytest.mark.parametrize("seed", range(8))
def test_true_offset_within_uncertainty(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size, rounds = 5, 8
    theta = rng.integers(-(10**12), 10**12, size)  # rank 0's clock is offset too
    enter, exit_ = simulate_barrier(theta, rounds, rng)
    ests = estimate_offsets(enter, exit_)
    assert len(ests) == size
    e0 = ests[0]
    assert (e0.offset_ns, e0.uncertainty_ns, e0.bounded, e0.rounds) == (0, 0, True, rounds)
    for i, e in enumerate(ests):
        true = int(theta[i] - theta[0])
        assert e.bounded
        assert e.rounds == rounds
        assert e.at_ns == exit_[i, -1]
        assert abs(e.offset_ns - true) <= e.uncertainty_ns, (i, e, true)
        # the rounds' intervals are intersected: never wider than the narrowest single round
        widths = (exit_[i] - enter[0]) - (enter[i] - exit_[0])
        assert e.uncertainty_ns <= (int(widths.min()) + 1) // 2
        assert isinstance(e.offset_ns, int) and isinstance(e.uncertainty_ns, int)


def test_more_rounds_do_not_widen_the_interval() -> None:
    rng = np.random.default_rng(42)
    theta = np.array([7, 3_000_000_123, -42_000_000_000])
    enter, exit_ = simulate_barrier(theta, 16, rng)
    prev = None
    for k in (1, 2, 4, 8, 16):
        ests = estimate_offsets(enter[:, :k], exit_[:, :k])
        u = [e.uncertainty_ns for e in ests[1:]]
        if prev is not None:
            assert all(a <= b for a, b in zip(u, prev))
        prev = u
        for i, e in enumerate(ests):
            assert abs(e.offset_ns - int(theta[i] - theta[0])) <= e.uncertainty_ns


def test_zero_offset_on_one_host() -> None:
    rng = np.random.default_rng(1)
    enter, exit_ = simulate_barrier(np.zeros(2, np.int64), 8, rng)
    e = estimate_offsets(enter, exit_)[1]
    assert e.bounded and abs(e.offset_ns) <= e.uncertainty_ns


def test_inconsistent_rounds_fall_back_to_median() -> None:
    rng = np.random.default_rng(3)
    theta = np.array([0, 1_000_000, 2_000_000_000])
    step = 50_000_000  # rank 1's clock jumps 50 ms after round 3: no common interval
    enter, exit_ = simulate_barrier(theta, 8, rng, step_at=3, step_rank=1, step_ns=step)
    ests = estimate_offsets(enter, exit_)
    e1 = ests[1]
    assert not e1.bounded
    assert e1.rounds == 8
    # the median of the per-round midpoints lies in the clock's later state (5 of 8 rounds), and
    # the reported spread covers both states
    assert abs(e1.offset_ns - (1_000_000 + step)) <= e1.uncertainty_ns
    assert abs(e1.offset_ns - 1_000_000) <= e1.uncertainty_ns
    assert e1.uncertainty_ns >= step // 2
    # the other ranks are unaffected
    assert ests[2].bounded
    assert abs(ests[2].offset_ns - 2_000_000_000) <= ests[2].uncertainty_ns
    assert ests[0].offset_ns == 0 and ests[0].uncertainty_ns == 0


@pytest.mark.parametrize("shape_a, shape_b", [((2, 3), (2, 4)), ((2, 0), (2, 0)), ((3,), (3,))])
def test_estimate_offsets_rejects_bad_shapes(shape_a, shape_b) -> None:
    with pytest.raises(ValueError):
        estimate_offsets(np.zeros(shape_a, np.int64), np.zeros(shape_b, np.int64))


def test_estimate_round_trips_through_dict() -> None:
    e = ClockEstimate(123, -456, 789, 8, bounded=False, method="round-trip")
    assert ClockEstimate.from_dict(e.to_dict()) == e
    d = e.to_dict()
    del d["bounded"], d["method"]  # older files: bounded by barrier rounds
    assert ClockEstimate.from_dict(d).bounded
    assert ClockEstimate.from_dict(d).method == "barrier"


# -- offset_at ------------------------------------------------------------------------------------
T0 = 10**15  # realistic monotonic ns magnitude: interpolation must keep ns precision


def test_offset_at_interpolates_between_estimates() -> None:
    ests = [ClockEstimate(T0, 1_000, 5, 8), ClockEstimate(T0 + 10**9, 3_000, 5, 8)]
    local = np.array([T0, T0 + 250_000_000, T0 + 500_000_000, T0 + 10**9, T0 + 10**9 - 1])
    got = offset_at(ests, local)
    assert got.dtype == np.int64
    assert got.tolist() == [1_000, 1_500, 2_000, 3_000, 3_000]
    # order of the estimates does not matter
    assert offset_at(ests[::-1], local).tolist() == got.tolist()


def test_offset_at_is_constant_outside_the_estimates() -> None:
    ests = [ClockEstimate(T0, -7_000, 5, 8), ClockEstimate(T0 + 10**9, 9_000, 5, 8)]
    local = np.array([0, T0 - 10**12, T0 - 1, T0 + 10**9 + 1, T0 + 10**13])
    assert offset_at(ests, local).tolist() == [-7_000, -7_000, -7_000, 9_000, 9_000]


def test_offset_at_single_and_no_estimate() -> None:
    local = np.array([0, T0, T0 * 2])
    assert offset_at([ClockEstimate(T0, 42, 1, 8)], local).tolist() == [42, 42, 42]
    assert offset_at([], local).tolist() == [0, 0, 0]


def test_drift_ppm() -> None:
    ests = [ClockEstimate(T0, 1_000, 5, 8), ClockEstimate(T0 + 10**9, 3_000, 5, 8)]
    assert drift_ppm(ests) == pytest.approx(2.0)
    assert drift_ppm(ests[:1]) is None


# -- alignment in load_run ------------------------------------------------------------------------
def _est(at: int, off: int, unc: int = 1_000) -> dict:
    return ClockEstimate(at, off, unc, 8).to_dict()


def test_load_run_aligns_shifted_rank(tmp_path: Path) -> None:
    """Rank 1's clock reads D ns more than rank 0's: spans at one true instant line up."""
    d = 123_456_789_012
    true_times = [T0 + k * 1_000_000 for k in range(20)]
    rows0 = [row("forward", "forward", t, t + 500 + k, step=k) for k, t in enumerate(true_times)]
    rows1 = [
        row("forward", "forward", t + d, t + d + 500 + k, step=k) for k, t in enumerate(true_times)
    ]
    write_rank_file(
        tmp_path / f"rank00000-{RUN}.arrows",
        make_header(0, 2, RUN, clock_start=_est(T0, 0, 0)),
        [rows0],
    )
    write_rank_file(
        tmp_path / f"rank00001-{RUN}.arrows",
        make_header(1, 2, RUN, clock_start=_est(T0 + d, d)),
        [rows1],
    )
    run = load_run(tmp_path)
    assert run.problems == []
    df = run.spans.sort_values(["rank", "step"])
    r0 = df[df["rank"] == 0]
    r1 = df[df["rank"] == 1]
    assert r0["start_ns"].tolist() == true_times  # rank 0 is the reference: unchanged
    assert r1["start_ns"].tolist() == r0["start_ns"].tolist()
    assert r1["end_ns"].tolist() == r0["end_ns"].tolist()
    # the file's own table stays on the rank's local clock
    assert run.files[1].table.column("start_ns").to_pylist() == [t + d for t in true_times]


def test_load_run_corrects_drift_between_estimates(tmp_path: Path) -> None:
    """Start estimate in the header, a later one in a batch status: offsets are interpolated."""
    d0, d1 = 5_000_000, 5_200_000  # rank 1 drifts 200 µs over 1 s (200 ppm)
    a0, a1 = T0, T0 + 10**9  # local times of the two estimates

    def offset(local: int) -> int:
        return d0 + (d1 - d0) * (local - a0) // (a1 - a0)

    locals1 = [a0 - 10**6, a0, a0 + 10**8, a0 + 5 * 10**8, a0 + 9 * 10**8, a1, a1 + 10**7]
    true_times = [loc - offset(min(max(loc, a0), a1)) for loc in locals1]
    rows0 = [row("wait", "synchronize", t, t, step=k) for k, t in enumerate(true_times)]
    rows1 = [row("wait", "synchronize", loc, loc, step=k) for k, loc in enumerate(locals1)]
    write_rank_file(
        tmp_path / f"rank00000-{RUN}.arrows",
        make_header(0, 2, RUN, clock_start=_est(a0 - d0, 0, 0)),
        [rows0],
    )
    write_rank_file(
        tmp_path / f"rank00001-{RUN}.arrows",
        make_header(1, 2, RUN, clock_start=_est(a0, d0)),
        [rows1[:3], rows1[3:]],
        statuses=[status(), status(final=True, clock=[_est(a1, d1)])],
    )
    run = load_run(tmp_path)
    assert run.problems == []
    assert len(run.files[1].clock) == 2
    df = run.spans.sort_values(["rank", "step"])
    got0 = df[df["rank"] == 0]["start_ns"].tolist()
    got1 = df[df["rank"] == 1]["start_ns"].tolist()
    assert got0 == true_times
    assert len(got1) == len(got0)
    for g1, g0 in zip(got1, got0):
        assert abs(g1 - g0) <= 1  # ns rounding of the interpolation
    # without the second estimate the late spans would be off by the drift (200 µs): make sure
    # the test distinguishes the two
    assert abs((locals1[-2] - d0) - true_times[-2]) > 100_000


def _two_ranks_with_offset(
    tmp_path: Path, boot0: str, boot1: str, d: int, ns0: str | None = None, ns1: str | None = None
) -> list[int]:
    """Rank 1's estimate says its clock reads ``d`` ns more; both record the same local times.
    ``ns0``/``ns1``: the ranks' time namespaces (None: not recorded, as in older files)."""
    times = [T0 + k * 1_000_000 for k in range(5)]
    for r, boot, off, ns in ((0, boot0, 0, ns0), (1, boot1, d, ns1)):
        extra = {} if ns is None else {"time_namespace": ns}
        write_rank_file(
            tmp_path / f"rank{r:05d}-{RUN}.arrows",
            make_header(r, 2, RUN, clock_start=_est(T0, off), boot_id=boot, **extra),
            [[row("update", "update", t, t + 10, step=k) for k, t in enumerate(times)]],
        )
    return times


def test_same_boot_id_means_offset_zero(tmp_path: Path) -> None:
    """One kernel, one CLOCK_MONOTONIC: the barrier estimate is kept only as a check."""
    d = 300_000  # a barrier estimate off by 0.3 ms (within its uncertainty on a busy host)
    times = _two_ranks_with_offset(tmp_path, "boot-A", "boot-A", d)
    run = load_run(tmp_path)
    f1 = run.files[1]
    assert f1.same_clock
    assert [e.offset_ns for e in f1.clock] == [0]
    assert [e.offset_ns for e in f1.clock_measured] == [d]
    r1 = run.spans[run.spans["rank"] == 1].sort_values("step")
    assert r1["start_ns"].tolist() == times  # not shifted by the estimate
    assert "same kernel and time namespace" in run.clock_summary()


def test_different_boot_id_uses_the_barrier_estimate(tmp_path: Path) -> None:
    d = 300_000
    times = _two_ranks_with_offset(tmp_path, "boot-A", "boot-B", d)
    run = load_run(tmp_path)
    f1 = run.files[1]
    assert not f1.same_clock
    assert [e.offset_ns for e in f1.clock] == [d]
    r1 = run.spans[run.spans["rank"] == 1].sort_values("step")
    assert r1["start_ns"].tolist() == [t - d for t in times]
    assert "barrier rounds" in run.clock_summary()


def test_same_kernel_in_another_time_namespace_uses_the_estimate(tmp_path: Path) -> None:
    """Processes in different time namespaces share the boot id but not CLOCK_MONOTONIC."""
    d = 7_300_000_000  # host 2's clock runs 7.3 s ahead
    _two_ranks_with_offset(tmp_path, "boot-A", "boot-A", d, "time:[1]", "time:[2]")
    run = load_run(tmp_path)
    assert not run.files[1].same_clock
    assert [e.offset_ns for e in run.files[1].clock] == [d]
    assert not run.problems


def test_a_same_clock_claim_the_barrier_contradicts_is_disbelieved(tmp_path: Path) -> None:
    """Files without the time namespace (or a namespace id reused): the boot ids match, but the
    barrier estimate is 7.3 s off, far beyond its uncertainty: the estimate is used, and said."""
    d = 7_300_000_000
    _two_ranks_with_offset(tmp_path, "boot-A", "boot-A", d)
    run = load_run(tmp_path)
    assert not run.files[1].same_clock
    assert [e.offset_ns for e in run.files[1].clock] == [d]
    assert any("barrier estimate is +7300.000 ms" in p for p in run.problems), run.problems
    r1 = run.spans[run.spans["rank"] == 1]
    assert r1["start_ns"].min() == T0 - d  # moved onto rank 0's clock by the estimate


@pytest.mark.parametrize("seed", range(5))
def test_round_trips_bound_the_true_offset(seed: int) -> None:
    from hvtrace.clock import estimate_from_round_trips

    rng = np.random.default_rng(seed)
    true = int(rng.integers(-(10**10), 10**10))
    t1 = np.cumsum(rng.integers(10_000, 100_000, 32))
    out = rng.integers(5_000, 200_000, 32)  # one-way delays, asymmetric
    back = rng.integers(5_000, 200_000, 32)
    t2 = t1 + out - true  # rank 0 stamps on its own clock
    t3 = t1 + out + back
    e = estimate_from_round_trips(t1, t2, t3)
    assert e.bounded and e.method == "round-trip" and e.rounds == 32
    assert abs(e.offset_ns - true) <= e.uncertainty_ns
    assert e.uncertainty_ns <= (out + back).min() // 2 + 1  # no wider than the fastest trip


def test_better_estimate_prefers_a_consistent_tighter_round_trip() -> None:
    from hvtrace.record.optimizer import better_estimate

    barrier = ClockEstimate(1, 7_300_000_000, 5_000_000, 8)
    tight = ClockEstimate(2, 7_301_000_000, 40_000, 32, method="round-trip")
    assert better_estimate(barrier, tight) is tight
    assert better_estimate(barrier, None) is barrier
    wrong = ClockEstimate(2, 7_400_000_000, 40_000, 32, method="round-trip")  # outside: refused
    assert better_estimate(barrier, wrong) is barrier
    loose = ClockEstimate(2, 7_300_000_000, 9_000_000, 32, method="round-trip")
    assert better_estimate(barrier, loose) is barrier


@pytest.mark.timeout(60)
def test_round_trips_over_loopback_find_offset_zero() -> None:
    """The real server and client on one clock: the offset is 0 within the stated uncertainty,
    and a round trip on loopback bounds it to well under a millisecond."""
    from hvtrace.clock import estimate_from_round_trips
    from hvtrace.record.clocksync import _ping, _Server

    server = _Server()
    try:
        times = _ping(["127.0.0.1"], server.port, 64)
    finally:
        server.stop()
    assert times is not None
    e = estimate_from_round_trips(times[:, 0], times[:, 1], times[:, 2])
    assert e.bounded and abs(e.offset_ns) <= e.uncertainty_ns < 1_000_000
    assert _ping(["127.0.0.1"], server.port, 4) is None  # stopped: nothing answers


def test_a_rank_that_cannot_reach_rank0_stops_trying(monkeypatch) -> None:
    """Round trips that fail once (a firewall) are not tried again at later estimates, so a
    resync never waits for the connect timeout twice; the collectives still run."""
    import socket

    from hvtrace.record import clocksync

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    calls = []

    class Rank1:  # the two collectives ping_rank0 runs, as seen from rank 1
        def rank(self) -> int:
            return 1

        def broadcast_object(self, obj, root_rank, name):
            calls.append(name)
            return (["127.0.0.1"], port)

        def allgather_object(self, obj, name):
            calls.append(name)
            return [True, obj]

    monkeypatch.setattr(clocksync, "_unreachable", False)
    assert clocksync.ping_rank0(Rank1(), 4, "t1") is None
    assert clocksync._unreachable
    monkeypatch.setattr(clocksync, "_ping", lambda *a: pytest.fail("tried again"))
    assert clocksync.ping_rank0(Rank1(), 4, "t2") is None
    assert calls == ["t1.addr", "t1.done", "t2.addr", "t2.done"]
