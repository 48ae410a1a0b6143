"""Why a rank is late, on real ``horovodrun`` jobs: blocked, more work, or waiting for a CPU.

Three jobs of the demo trainer (2 ranks, Gloo), each with rank 1 slowed a different way:

- it **sleeps** 50 ms in its forward (``--slow-kind sleep``): blocked (the job is the slowed
  one of ``test_compare_runs.py``, 60 steps, shared: ``slow_sleep_run`` in ``conftest.py``);
- it **computes** 25 ms more in its forward (``--slow-kind compute``: matrix products on the
  training thread for 25 ms of its CPU time): more work;
- nothing is injected into the job; each rank is pinned to its own core (``--pin-cores``) and a
  busy process outside the job is pinned to rank 1's core: rank 1 waits for its CPU (contention).

The analyzer must name rank 1 with that cause, from the CPU time and run-queue wait the recorder
measured (``/proc/self/task/TID/schedstat``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import SLOW_SLEEP_MS, ran_steps, run_train, tail, traced_scenario

from hvtrace.analysis.summary import analyze
from hvtrace.load import load_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(900)]

COMMON = ["--steps", "40", "--width", "512", "--layers", "4", "--batch-size", "64"]
#: The extra work rank 1's forward computes in the compute case (ms of its thread's CPU time).
COMPUTE_MS = 25


def _analyze(tmp_path: Path, *args: str, steps: int = 40):
    trace = tmp_path / "trace"
    run_args = [*COMMON, "--steps", str(steps), "--trace-dir", str(trace), *args]
    proc = run_train(*run_args, cwd=tmp_path)
    assert f"rank 0: {steps} steps" in proc.stdout, tail(proc.stderr)
    return analyze(load_run(trace))


COMPUTE = traced_scenario(
    "causes_compute", *COMMON, "--slow-rank", "1", "--slow-ms", str(COMPUTE_MS),
    "--slow-phase", "forward", "--slow-kind", "compute",
)  # fmt: skip


def _the_straggler(a) -> dict:
    s = a.stragglers
    assert list(s["rank"]) == [1], (s.to_dict("records"), [f.message for f in a.findings])
    return s.iloc[0].to_dict()


@pytest.mark.parametrize(
    "kind, cause", [("sleep", "blocked"), ("compute", "work")], ids=["sleep", "compute"]
)
def test_an_injected_delay_is_named_with_its_cause(
    request: pytest.FixtureRequest, batched, kind: str, cause: str
) -> None:
    if kind == "sleep":
        # the sleeping rank's job is test_compare_runs.py's (``helpers.SLOW_SLEEP_JOB``: the
        # same model, 60 steps, live detection off), recorded once a session
        a = analyze(load_run(request.getfixturevalue("slow_sleep_run").trace))
        injected_ms = SLOW_SLEEP_MS
    else:
        a = analyze(load_run(ran_steps(batched(COMPUTE), 40)))
        injected_ms = COMPUTE_MS
    s = _the_straggler(a)
    assert s["phase"] == "forward" and s["cause"] == cause, s
    # the part of that cause is most of what was injected (the compute is 25 ms of the
    # thread's CPU time: 24.96-25.19 ms measured as work in 5 runs), the others small. But a
    # rank that computes longer beside the other rank's wait (Horovod's wait spins on a CPU) also
    # waits for a CPU meanwhile on this 2-core machine: 3.2-9.7 ms of contention in those runs,
    # 24.8 ms once with other work on the machine, 33.4 ms (work 25.8) beside a busy process
    # (`make test-busy`, where rank 1's core is shared three ways). That is real and reported as
    # such: it has to stay below the work part, or below what that work waits for at the rate
    # rank 1 waited for a CPU in its backward (the phase nobody slowed) of the same run
    assert 0.72 * injected_ms <= s[f"{cause}_ms"] <= 1.28 * injected_ms, s  # 18..32 for 25 ms
    for other in {"work", "contention", "blocked"} - {cause}:
        if kind == "compute" and other == "contention":
            r1 = a.analyzed[(a.analyzed["rank"] == 1) & (a.analyzed["step"] >= 1)]
            rate = float((r1["backward_runq_ns"] / r1["backward_cpu_ns"]).median())
            assert s["contention_ms"] < s["work_ms"] * max(1.0, 2.0 * rate), (s, rate)
        else:
            assert abs(s[f"{other}_ms"]) < 8.0, s
    finding = next(f for f in a.findings if f.data.get("rank") == 1)
    assert f"({cause})" in finding.message


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs 2 cores and CPU affinity",
)
def test_a_busy_neighbour_on_the_ranks_core_is_contention(tmp_path: Path) -> None:
    core = sorted(os.sched_getaffinity(0))[1]  # --pin-cores puts local rank 1 here
    spin = f"import os; os.sched_setaffinity(0, {{{core}}}); x = 0\nwhile True:\n    x += 1"
    # three busy processes on rank 1's core (a quarter of it left to rank 1), so that the signal
    # outlasts other work on the machine: with one (half of the core) and a test run beside it
    # on the other core, rank 0 waited for a CPU as long as rank 1 and nobody was named (CI,
    # 28 Nov 2026: rank 1 last in 53 % of the steps, 0.2 ms late)
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    try:
        # 80 steps: at 40, one CI run in four named nobody (rank 1's lateness was put down to
        # starting its steps late, not to its own phases): too few steps for this noise
        a = _analyze(tmp_path, "--pin-cores", steps=80)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    s = _the_straggler(a)
    assert s["cause"] == "contention", s
    assert s["contention_ms"] >= 0.5 * s["phase_excess_ms"] > 0, s
    kinds = {f.kind for f in a.findings}
    assert "contention" in kinds and "straggler" not in kinds, [f.message for f in a.findings]
    # rank 1 waited for its CPU longer per step than rank 0, which shares its own core with its
    # Horovod and writer threads only, or with whatever else runs on the machine: 8.5 vs 32.5 ms
    # per step in a quiet run with one busy process; with two and a busy neighbour free to move
    # (`make test-busy`), 8.5 vs 12.0 ms: rank 0 waits too then, so the margin is in ms, not a
    # ratio
    st = a.steps[a.steps["step"] >= 1]
    runq = st.groupby("rank")["step_runq_ns"].median() / 1e6
    assert runq[1] > runq[0] + 2.0, runq.to_dict()
