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
- ``slow rank``: rank 3 (on host 2) sleeping in its forward: the ranks and hosts named;
- ``link``: host 2's link shaped (tbf) or not, a job of 34 MiB of allreduce per step with
  little compute: a raw TCP stream's goodput across that link, the rate hvtrace measured per
  link (from the ranks' TCP counters), the run's bus bandwidth against both and the nominal
  rate, and whether the communication-bound finding names the link and its host.

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


def train(run_dir: Path, steps: int, *extra: str, np_: int = 4, width: int = 256) -> float:
    """Train on the cluster (``np_`` ranks spread over the hosts); return the wall time."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "hvtrace.examples.train", "--steps", str(steps),
           "--width", str(width), "--trace-dir", str(run_dir), *extra]  # fmt: skip
    p = subprocess.run(
        ["bash", str(CLUSTER), "run", "--np", str(np_), "--", *cmd],
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


#: A raw TCP stream from one host to another, for the link's goodput: ``SERVER`` and ``CLIENT``.
_TCP_PROBE = """
import socket, sys, time
if sys.argv[1] == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5999)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0; t0 = None
    while b := c.recv(1 << 20):
        t0 = t0 or time.perf_counter(); n += len(b)
    print(n / (time.perf_counter() - t0))
else:
    c = socket.create_connection((sys.argv[2], 5999)); buf = b"x" * (1 << 20)
    for _ in range(int(sys.argv[3])): c.sendall(buf)
    c.close()
"""


def tcp_goodput_gbps(src: int, dst: int, mib: int = 40) -> float:
    """Bytes per second (as GB/s) a single TCP stream carries from host ``src`` to ``dst``."""
    ns = ["ip", "netns", "exec"]
    server = subprocess.Popen(
        [*ns, f"hvc{dst}", sys.executable, "-c", _TCP_PROBE, "server"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        subprocess.run(
            [*ns, f"hvc{src}", sys.executable, "-c", _TCP_PROBE, "client",
             f"10.231.0.{dst}", str(mib)],
            check=True, timeout=120,
        )  # fmt: skip
        out, _ = server.communicate(timeout=30)
        return float(out.strip()) / 1e9
    finally:
        server.kill()


def link_scenario(label: str, hosts: int, np_: int, mbit: int | None, steps: int,
                  work: Path) -> None:  # fmt: skip
    """A job that moves about 34 MiB of allreduce per step with little compute, on ``hosts``
    hosts with host 2's link shaped to ``mbit`` (None: unshaped): the raw TCP goodput across
    host 2's link, the rates hvtrace measured per link, the run's bus bandwidth, and what the
    communication-bound finding says."""
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    shape = ["--link-mbit", str(mbit), "--link-hosts", "2"] if mbit else []
    cluster("up", "--hosts", str(hosts), *shape)
    try:
        goodput = tcp_goodput_gbps(1, 2)
        wall = train(work, steps, "--layers", "3", "--batch-size", "4", np_=np_, width=2048)
    finally:
        cluster("down")
    a = analyze(open_run(work))
    nominal = f"{mbit} Mbit/s = {mbit / 8e3:.4f} GB/s" if mbit else "unshaped"
    print(f"\n{label} ({steps} steps, {wall:.0f} s): link {nominal}")
    print(f"  raw TCP stream hvc1->hvc2: {goodput:.4f} GB/s ({goodput * 8e3:.0f} Mbit/s)")
    for x in a.links.itertuples():
        r = x.rate_gbps
        rate = f"{r:.4f} GB/s ({r * 8e3:.0f} Mbit/s)" if r == r else "- (too little data)"
        print(f"  link {x.src_host}->{x.dst_host}: {rate}, {x.bytes / 2**20:.0f} MiB")
    busbw = a.comm["busbw_gbps"]
    lim = a.limiting_link or {}
    print(f"  run busbw: {busbw:.4f} GB/s ({busbw * 8e3:.0f} Mbit/s)", end="")
    if lim:
        print(f" = {lim['busbw_share']:.0%} of the slowest link's measured rate", end="")
    if mbit:
        print(f", {busbw / (mbit / 8e3):.0%} of the nominal rate, {busbw / goodput:.0%} of the raw"
              " TCP stream's", end="")  # fmt: skip
    print()
    print(f"  limiting link: limits={lim.get('limits')} host={lim.get('host')} "
          f"links={lim.get('links')}")  # fmt: skip
    for f in a.findings:
        if f.kind == "comm_bound":
            print(f"  finding: {f.message}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--scenarios",
        default="clock+7.3,clock-0.25,slow-host,slow-rank,cpu-host,"
        "link3x3@200,link2x2@200,link2x4@200,link3x3",
        help="comma-separated: clock+S / clock-S, slow-host, slow-rank, cpu-host, "
        "linkHxN@MBIT (H hosts, N ranks, host 2's link at MBIT Mbit/s; no @: unshaped)",
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
            elif sc.startswith("link"):  # link3x3@200: 3 hosts, 3 ranks, host 2 at 200 Mbit/s
                shape, _, mbit = sc[len("link") :].partition("@")
                h, _, n = shape.partition("x")
                label = f"link: {h} hosts, {n} ranks, host 2's link {mbit or 'unshaped'}"
                link_scenario(label, int(h), int(n), int(mbit) if mbit else None, 10, work)
            else:
                raise SystemExit(f"unknown scenario {sc!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
