"""Does the what-if replay predict the job without its straggler? Checked against reality.

For each configuration (ranks x slowed phase) the built-in demo job is run twice under the real
``horovodrun`` in one invocation, in alternating order over ``--rounds`` rounds: once with one
rank slowed (``--slow-rank 1 --slow-ms MS --slow-phase PHASE``, asleep) and once without. The
slowed run's analysis predicts the step time without its straggler
(``whatif.step_ms_without_stragglers``); the clean run's analysis measures it (``whatif.step_ms``:
the same definition of a step, the median over steps of the time between leaving
``synchronize``). Printed per configuration: both, their ratio, the straggler named, the time
lost it reports, and whether the prediction is within the goal (10 %) of the measurement.

    .venv/bin/python bench/whatif.py                         # 2 and 4 ranks, input and backward
    .venv/bin/python bench/whatif.py --np 2 --phases input --rounds 1 --steps 40
    .venv/bin/python bench/whatif.py --np 2 --pin            # each rank on its own core

On this 2-core machine 4 ranks share 2 cores: a sleeping straggler frees a core for the others,
so the slowed run's other ranks may be faster than in the clean run (the replay cannot know).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
log = logging.getLogger("whatif")
GOAL = 0.10


def horovodrun() -> str:
    """The venv's ``horovodrun`` (next to this Python), else the one on PATH."""
    here = Path(sys.executable).parent / "horovodrun"
    found = str(here) if here.exists() else shutil.which("horovodrun")
    if not found:
        raise SystemExit("horovodrun not found (run `make setup`, or use the venv's python)")
    return found


#: ``--pin``: each rank runs under ``taskset`` on core ``local rank % cores`` (its Horovod
#: background thread too), so that a rank's spinning wait cannot take another rank's core.
PIN = 'exec taskset -c "$((HOROVOD_LOCAL_RANK % {cores}))" "$0" "$@"'


def run_job(out: Path, np_: int, steps: int, width: int, extra: list[str], timeout: float,
            pin: bool = False) -> None:  # fmt: skip
    """Train the demo model traced into ``out`` (raises with the output's tail on failure)."""
    pinned = ["sh", "-c", PIN.format(cores=os.cpu_count() or 1)] if pin else []
    cmd = [horovodrun(), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *pinned,
           sys.executable, "-m", "hvtrace.examples.train", "--steps", str(steps),
           "--width", str(width), "--trace-dir", str(out), *extra]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"horovodrun exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")


def analyzed(run_dir: Path) -> dict:
    from hvtrace.analysis import analyze
    from hvtrace.load import open_run

    a = analyze(open_run(run_dir))
    st = a.stragglers
    return {
        "whatif": a.whatif,
        "stragglers": [int(r) for r in st["rank"]],
        "phase": [str(p) for p in st["phase"]],
        "lost_ms_per_step": [float(x) for x in st["lost_ms_per_step"]],
        "late_max_ms": float(a.per_rank["lateness_ms"].max()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4", help="comma-separated rank counts (default 2,4)")
    p.add_argument("--phases", default="input,backward", help="slowed phases (default both)")
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="slowed/clean pairs per configuration")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--pin", action="store_true", help="run each rank on its own core (taskset)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="hvtrace-whatif-") as tmp:
        for np_ in [int(x) for x in args.np.split(",")]:
            for phase in args.phases.split(","):
                pred, meas, named, lost, measured_slow, spread = [], [], [], [], [], []
                for rnd in range(args.rounds):
                    order = ["slow", "clean"] if rnd % 2 == 0 else ["clean", "slow"]
                    for kind in order:
                        d = Path(tmp) / f"{np_}-{phase}-{rnd}-{kind}"
                        extra = (
                            ["--slow-rank", "1", "--slow-ms", str(args.slow_ms),
                             "--slow-phase", phase]
                            if kind == "slow" else []
                        )  # fmt: skip
                        t = time.perf_counter()
                        run_job(d, np_, args.steps, args.width, extra, args.timeout, args.pin)
                        r = analyzed(d)
                        log.info("%d ranks, %s, round %d, %s: %.0f s", np_, phase, rnd, kind,
                                 time.perf_counter() - t)  # fmt: skip
                        if kind == "slow":
                            pred.append(r["whatif"]["step_ms_without_stragglers"])
                            measured_slow.append(r["whatif"]["step_ms"])
                            named.append(list(zip(r["stragglers"], r["phase"])))
                            lost.append(r["lost_ms_per_step"][:1] or [float("nan")])
                        else:
                            meas.append(r["whatif"]["step_ms"])
                            spread.append(r["late_max_ms"])
                        shutil.rmtree(d, ignore_errors=True)
                res = {
                    "np": np_,
                    "phase": phase,
                    "slow_ms": args.slow_ms,
                    "step_ms_slowed": statistics.median(measured_slow),
                    "predicted_ms": statistics.median(pred),
                    "measured_clean_ms": statistics.median(meas),
                    "predicted_rounds": pred,
                    "measured_rounds": meas,
                    "lost_ms_per_step": statistics.median(x[0] for x in lost),
                    "clean_late_max_ms": statistics.median(spread),
                    "named": named,
                }
                res["error"] = res["predicted_ms"] / res["measured_clean_ms"] - 1
                results.append(res)
    print(f"\nWhat-if replay vs the job run without its straggler (rank 1 asleep "
          f"{args.slow_ms:g} ms in the phase; medians of {args.rounds} round(s), "
          f"{args.steps} steps, width {args.width}"
          f"{'; each rank pinned to a core' if args.pin else ''})")  # fmt: skip
    print("clean late ms: in the clean run, the latest rank's median lateness behind each step's"
          " first arrival (per_rank lateness_ms): a spread the replay, which sets the straggler to"
          " the other ranks' median, does not keep")  # fmt: skip
    print(f"{'ranks':>5} {'phase':<9} {'slowed ms':>9} {'lost ms':>8} {'predicted':>9} "
          f"{'clean ms':>9} {'error':>7}  goal ±{GOAL:.0%}  {'clean late':>10}  named")  # fmt: skip
    for r in results:
        ok = "ok" if abs(r["error"]) <= GOAL else "MISSED"
        named = "; ".join(",".join(f"{k} {ph}" for k, ph in n) or "none" for n in r["named"])
        print(f"{r['np']:>5} {r['phase']:<9} {r['step_ms_slowed']:9.1f} "
              f"{r['lost_ms_per_step']:8.1f} {r['predicted_ms']:9.1f} "
              f"{r['measured_clean_ms']:9.1f} {r['error']:+7.1%}  {ok:<9} "
              f"{r['clean_late_max_ms']:10.1f}  {named}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
