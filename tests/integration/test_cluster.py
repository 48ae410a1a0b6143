"""Real Horovod across real host boundaries made of namespaces (``scripts/cluster.sh``).

Each host is a network namespace with its own address, hostname and CLOCK_MONOTONIC (a time
namespace offset by a known amount) and an sshd; ``horovodrun -H`` launches the ranks over ssh and
Gloo carries the allreduces between the namespaces. What hvtrace reports is checked against what
was injected.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO_ROOT, horovodrun_path, run_on_cluster

from hvtrace.load import open_run

CLUSTER = REPO_ROOT / "scripts" / "cluster.sh"


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (network and time namespaces)"
    if not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")):
        return "no sshd (scripts/setup.sh installs openssh-server)"
    if horovodrun_path() is None:
        return "no horovodrun"
    return None


pytestmark = [
    pytest.mark.skipif(_why_not() is not None, reason=_why_not() or ""),
    pytest.mark.timeout(600),
]


def cluster(*args: str) -> None:
    """Run ``scripts/cluster.sh ARGS``; fail the test with its output when it fails."""
    p = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        pytest.fail(f"cluster.sh {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}", pytrace=False)


@pytest.fixture
def hosts():
    """Bring a cluster up with the given ``cluster.sh up`` arguments; always take it down."""
    made = []

    def up(*args: str) -> None:
        made.append(True)
        cluster("up", *args)

    try:
        yield up
    finally:
        if made:
            subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=120)


def _train(run_dir: Path, np_: int = 4, steps: int = 20, *extra: str) -> None:
    run_on_cluster(
        [sys.executable, "-m", "hvtrace.examples.train", "--steps", str(steps), "--width", "256",
         "--trace-dir", str(run_dir), *extra],
        np=np_,
    )  # fmt: skip


def _recorded(tmp_path_factory: pytest.TempPathFactory, name: str, up: list[str], *train: str):
    """Bring a cluster up with ``up``, record the demo job (4 ranks, 20 steps, ``train`` added)
    on it, take the cluster down; return the run directory."""
    run_dir = tmp_path_factory.mktemp(name) / "run"
    try:
        cluster("up", *up)
        _train(run_dir, 4, 20, *train)
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, timeout=120)
    return run_dir


# Two recorded runs serve two tests each: the clock offset injected into the cluster and the
# delay injected into the job are independent (a test of each asserts on the same run), so each
# scenario of host 2 or rank 3 slowed also runs on offset clocks, one ahead and one behind.
@pytest.fixture(scope="module")
def slow_host_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Host 2's clock 7.3 s ahead; every rank of host 2 40 ms more in its forward."""
    up = ["--hosts", "2", "--clock-offset-s", "7.3"]
    return _recorded(tmp_path_factory, "slow-host", up, "--slow-host", "hvc2", "--slow-ms", "40")


@pytest.fixture(scope="module")
def slow_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Host 2's clock 0.25 s behind; rank 3 (host 2) alone 40 ms more in its forward."""
    up = ["--hosts", "2", "--clock-offset-s", "-0.25"]
    return _recorded(tmp_path_factory, "slow-rank", up, "--slow-rank", "3", "--slow-ms", "40")


@pytest.mark.parametrize(
    "scenario, offset_s", [("slow_host_run", 7.3), ("slow_rank_run", -0.25)], ids=["7.3", "-0.25"]
)
def test_clock_offsets_across_hosts_are_what_was_injected(
    request: pytest.FixtureRequest, scenario: str, offset_s: float
) -> None:
    """Host 2's CLOCK_MONOTONIC runs ``offset_s`` from host 1's: every rank of host 2 reports that
    offset within the uncertainty it states (<= 0.5 ms), host 1's rank shares rank 0's clock, and
    each allreduce, aligned, completes after the last rank enqueued it (causality holds)."""
    run = open_run(request.getfixturevalue(scenario))
    assert run.hosts == {0: "hvc1", 1: "hvc1", 2: "hvc2", 3: "hvc2"}
    assert not run.problems, run.problems
    injected = round(offset_s * 1e9)
    assert run.files[1].same_clock
    for r in (2, 3):
        f = run.files[r]
        assert not f.same_clock and f.clock, r
        for e in f.clock:
            assert e.bounded and e.method == "round-trip", e
            assert abs(e.offset_ns - injected) <= e.uncertainty_ns, (r, e, injected)
            assert e.uncertainty_ns <= 500_000, e
    # merged timeline: no rank sees an allreduce finish before the last rank enqueued it
    s = run.spans
    ar = s[s["kind"] == "allreduce"]
    g = ar.groupby(["step", "name"])
    first_end = g["end_ns"].min()
    last_start = g["start_ns"].max()
    unc = max(run.clock_uncertainty_ns(r) for r in run.ranks)
    assert ((first_end - last_start) >= -unc).mean() >= 0.99
    # ... and ranks on the two hosts see it finish close together (not 7.3 s apart)
    ends = ar.pivot_table(index=["step", "name"], columns="rank", values="end_ns")
    gap_ms = np.abs(ends[2] - ends[0]).median() / 1e6
    assert gap_ms < 20, gap_ms


def _analyzed(run_dir: Path):
    from hvtrace.analysis import analyze

    return analyze(open_run(run_dir))


def test_a_slow_host_is_named_not_its_ranks(slow_host_run: Path) -> None:
    """Every rank of host 2 spends 40 ms more in its forward: the host is named, with both its
    ranks, and the findings do not list its ranks one by one."""
    a = _analyzed(slow_host_run)
    assert list(a.slow_hosts["host"]) == ["hvc2"], a.verdicts
    assert sorted(a.slow_hosts["ranks"].iloc[0]) == [2, 3]
    kinds = [f.kind for f in a.findings]
    assert "slow_host" in kinds and "straggler" not in kinds, [f.message for f in a.findings]
    assert not set(a.stragglers["rank"]) & {0, 1}
    assert a.slow_hosts["cause"].iloc[0] == "blocked"  # its ranks sleep


def test_one_slow_rank_on_host_2_is_named_not_its_host(slow_rank_run: Path) -> None:
    """Only rank 3 (host 2) is slowed, by 40 ms in its forward: that rank is named, with its
    phase, and its host is not."""
    a = _analyzed(slow_rank_run)
    assert a.slow_hosts.empty, a.slow_hosts
    assert list(a.stragglers["rank"]) == [3], a.verdicts
    assert a.stragglers["phase"].iloc[0] == "forward"


def test_a_host_short_of_cpu_is_named_for_contention(hosts, tmp_path: Path) -> None:
    """Host 2's processes together get 40 % of one CPU (a cgroup quota), nothing is injected
    into the job: the first contention finding is host 2's, its ranks waiting for a CPU most of
    their time outside synchronize, and no rank of host 1 is named a straggler. Host 1's two
    ranks wait too, less: they share this machine's two cores with host 2's ranks and every
    rank's threads (usually under half host 2's share; in 2 CI runs of 9, one with nothing else
    running, half of it or more, host 2's being 71 % and 94 %)."""
    hosts("--hosts", "2", "--cpu-pct", "2=40")
    _train(tmp_path / "run", 4, 20)
    a = _analyzed(tmp_path / "run")
    msgs = [f.message for f in a.findings]
    found = [f for f in a.findings if f.kind == "contention" and "host" in f.data]
    assert found and found[0].data["host"] == "hvc2", msgs
    assert sorted(found[0].data["ranks"]) == [2, 3]
    assert found[0].data["work_share"] >= 0.5, msgs
    others = [f.data["work_share"] for f in found[1:]]
    assert all(s < found[0].data["work_share"] for s in others), msgs
    assert not set(a.stragglers["rank"]) & {0, 1}, a.verdicts


def _train_bytes(run_dir: Path, np_: int, steps: int = 10) -> None:
    """The built-in model with 2048-wide layers and 4 samples per batch: about 34 MiB of
    allreduce per step and little compute, so the links carry the step."""
    run_on_cluster(
        [sys.executable, "-m", "hvtrace.examples.train", "--steps", str(steps), "--width", "2048",
         "--layers", "3", "--batch-size", "4", "--trace-dir", str(run_dir)],
        np=np_,
    )  # fmt: skip


LINK_MBIT = 200


def test_a_slow_link_is_named_with_its_host(hosts, tmp_path: Path) -> None:
    """Three hosts, one rank each; host 2's link shaped to 200 Mbit/s in both directions. The
    links that cross it are measured below that rate and the unshaped one far above; the run's
    bus bandwidth is within 15 % of the best of the slow links' measured rates (host 2's link in
    and out: a quiet CI run read them 0.68 and 0.76 of 200 Mbit/s and the bus bandwidth 1.16 times
    the lower, 29 Nov 2026); and the communication-bound finding says the network is the limit
    and names host 2.

    Beside a busy process (``make test-busy``) it fails, and no threshold tells that run from
    the unshaped one below: the shaped links read 0.6-0.67 of their rate and the bus bandwidth
    above 1.15 times that (links.PLAUSIBLE_SHARE; 1.17-1.28 with the link at 100 or 50 Mbit/s),
    the unshaped link as low as 0.071 GB/s (3x nominal asserted: 0.075). At 100 and 50 Mbit/s
    the bus bandwidth read 1.13-1.19 times the shaped rate even on a quiet machine, so the link
    stays at 200 (28 Nov 2026)."""
    hosts("--hosts", "3", "--link-mbit", str(LINK_MBIT), "--link-hosts", "2")
    _train_bytes(tmp_path / "run", 3, steps=6)  # ~2 s a step through the shaped link
    a = _analyzed(tmp_path / "run")
    msgs = [f.message for f in a.findings]
    lim = a.limiting_link
    assert lim is not None and lim["limits"] and lim["host"] == "hvc2", (lim, a.links)
    nominal_gbps = LINK_MBIT / 8e3
    measured = a.links[a.links["rate_gbps"].notna()]
    through_2 = (measured["src_host"] == "hvc2") | (measured["dst_host"] == "hvc2")
    assert through_2.any() and (~through_2).any(), a.links
    slow = measured.loc[through_2, "rate_gbps"]
    assert slow.between(0.5 * nominal_gbps, 1.05 * nominal_gbps).all(), a.links
    assert measured.loc[~through_2, "rate_gbps"].min() > 3 * nominal_gbps, a.links
    busbw = a.comm["busbw_gbps"]
    assert abs(busbw / lim["rate_gbps"] - 1) <= 0.15, (busbw, lim)
    found = [f for f in a.findings if f.kind == "comm_bound"]
    assert found and "network is the limit" in found[0].message, msgs
    assert "host hvc2's link" in found[0].message, msgs
    assert found[0].data["limiting_link"]["host"] == "hvc2"


def test_unshaped_links_are_not_named_the_limit(hosts, tmp_path: Path) -> None:
    """The same job on three unshaped hosts: every link is measured, none is named the limit.

    Beside a busy process, TCP through the starved hosts read hvc2's links at 0.053-0.059 GB/s
    and the third at 0.298 (5.6x apart by chance), the bus bandwidth 1.41 times the slowest,
    every host's ranks waiting for a CPU 72-85 % of the step: links.PLAUSIBLE_SHARE (1.15) is
    what keeps that from being named the limit (28 Nov 2026)."""
    hosts("--hosts", "3")
    _train_bytes(tmp_path / "run", 3)
    a = _analyzed(tmp_path / "run")
    assert a.links["rate_gbps"].notna().sum() >= 3, a.links
    assert a.limiting_link is not None and not a.limiting_link["limits"], a.limiting_link
    assert not any("network is the limit" in f.message for f in a.findings)
