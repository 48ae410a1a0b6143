"""What hvtrace reports across real host boundaries, against what was injected.

Each scenario brings up a namespace cluster (``scripts/cluster.sh up``: hosts with their own
network, hostname and CLOCK_MONOTONIC), runs the built-in model under the real ``horovodrun``
across it (``scripts/cluster.sh run``), analyzes the trace and prints, beside what was injected:

- ``clock +S``: host 2's clock offset by S seconds: each rank's reported offset, its stated
  uncertainty, whether the truth lies within it, the method, and the drift between the start and
  finish estimates (a time namespace offsets a clock, it does not skew it: expect about 0);
- ``slow-host``: every rank of host 2 spending 40 ms more in its forward: the slow host named,
  and the ranks named one by one (should be none);
- ``cpu-host``: host 2's processes limited to 40 % of one CPU (a cgroup quota): what is named
  (its Horovod threads are starved too, so much of the cost shows as everyone's wait);
- ``slow rank``: rank 3 (on host 2) sleeping in its forward: the ranks and hosts named.

Needs root (namespaces); takes about a minute per scenario on 2 cores.

    sudo python bench/cluster_truth.py
    sudo python bench/cluster_truth.py --scenarios clock+7.3,clock-0.25
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "cluster.sh"
sys.path.insert(0, str(ROOT))


def cluster(*args: str) -> None:
    """``scripts/cluster.sh ARGS`` (raises with its output when it fails)."""
    p = subprocess.run(["bash", str(CLUSTER), *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"cluster.sh {' '.join(args)} failed:\n{p.stdout}{p.stderr}")


def train(run_dir: Path, steps: int, *extra: str) -> float:
    """Train on the cluster (4 ranks, 2 per host); return the wall time."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hvtrace.examples.train", "--steps", str(steps),
           "--width", "256", "--trace-dir", str(run_dir), *extra]  # fmt: skip
    p = subprocess.run(
        ["bash", str(CLUSTER), "run", "--np", "4", "--", *cmd],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if p.returncode != 0:
        raise SystemExit(f"training failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return time.perf_counter() - t


def clock_scenario(offset_s: float, steps: int, work: Path) -> None:
    from hvtrace.load import open_run

    cluster("up", "--hosts", "2", "--clock-offset-s", str(offset_s))
    try:
        wall = train(work, steps)
    finally:
        cluster("down")
    run = open_run(work)
    table = run.clock_table()
    print(f"\nclock: host 2 offset {offset_s:+g} s ({steps} steps, {wall:.0f} s)")
    print(f"{'rank':>4} {'host':<6} {'injected ms':>12} {'reported ms':>14} {'±ms':>7} "
          f"{'error ms':>9} {'within':>6}  {'method':<10} {'drift ppm':>14}")  # fmt: skip
    for r, c in table.items():
        host = run.hosts[r]
        inj = offset_s * 1e3 if host == "hvc2" else 0.0
        got = c["offset_ns"] / 1e6
        unc = c["uncertainty_ns"] / 1e6
        err = got - inj
        drift = (
            f"{c['drift_ppm']:+.1f} ±{c['drift_uncertainty_ppm']:.1f}"
            if c["drift_ppm"] is not None
            else "-"
        )
        ok = "yes" if abs(err) <= unc + 1e-9 else "NO"
        print(
            f"{r:>4} {host:<6} {inj:12.3f} {got:14.3f} {unc:7.3f} {err:+9.3f} {ok:>6}  "
            f"{c['method']:<10} {drift:>14}"
        )


def naming_scenario(label: str, up_args: list[str], train_args: list[str], steps: int,
                    work: Path) -> None:  # fmt: skip
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    cluster("up", "--hosts", "2", *up_args)
    try:
        wall = train(work, steps, *train_args)
    finally:
        cluster("down")
    a = analyze(open_run(work))
    hosts = ", ".join(
        f"{h.host} (ranks {list(h.ranks)}, {h.late_ms:.1f} ms late, last in {h.last_share:.0%})"
        for h in a.slow_hosts.itertuples()
    )
    ranks = [int(r) for r in a.stragglers["rank"]]
    alone = [f.message for f in a.findings if f.kind == "straggler"]
    print(f"\n{label} ({steps} steps, {wall:.0f} s)")
    print(f"  slow hosts named: {hosts or 'none'}")
    print(f"  ranks in the straggler table: {ranks or 'none'}")
    print(f"  ranks named one by one in the findings: {len(alone)}")
    for m in alone:
        print(f"    {m}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--scenarios", default="clock+7.3,clock-0.25,slow-host,slow-rank,cpu-host",
        help="comma-separated: clock+S / clock-S, slow-host, slow-rank, cpu-host",
    )  # fmt: skip
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hvtrace-cluster-truth-") as tmp:
        for i, sc in enumerate(args.scenarios.split(",")):
            work = Path(tmp) / f"run{i}"
            if sc.startswith("clock"):
                clock_scenario(float(sc[len("clock") :]), args.steps, work)
            elif sc == "slow-host":
                label = "slow host: every rank of host 2 +40 ms in forward"
                slow = ["--slow-host", "hvc2", "--slow-ms", "40"]
                naming_scenario(label, [], slow, args.steps, work)
            elif sc == "cpu-host":
                label = "CPU-starved host: host 2's processes share 40% of one CPU (cgroup)"
                naming_scenario(label, ["--cpu-pct", "2=40"], [], args.steps, work)
            elif sc == "slow-rank":
                label = "slow rank: rank 3 (host 2) +40 ms in forward"
                slow = ["--slow-rank", "3", "--slow-ms", "40"]
                naming_scenario(label, [], slow, args.steps, work)
            else:
                raise SystemExit(f"unknown scenario {sc!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
