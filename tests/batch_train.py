"""Run several jobs of ``hvtrace.examples.train`` one after another in one ``horovodrun`` launch.

Used by the integration tests (``tests/integration/conftest.py``, ``batched``): a launch costs
about 6 s on the 2-core CI machine before its first step (horovodrun's own checks, then every
rank importing torch and Horovod), more than most test jobs' steps. Each job ("scenario") is the
same ``main(argv)`` a launch of its own would run, in the same processes: Horovod initialized
once, each job's own optimizer, tracer and trace directory, ``hvtrace.finish()`` at its end.

Usage (under horovodrun): ``python tests/batch_train.py SPEC.json``. SPEC is a list of
``{"name", "module", "argv", "env", "cwd"}``: ``module`` is the script whose ``main(argv)`` runs
(``hvtrace.examples.train``, or ``hvtrace.examples.train_lightning``); ``env`` is set for that
job alone (hvtrace reads its settings when a tracer is made). Before each job every rank meets
the others (an allreduce outside any tracer), then prints ``@@batch begin NAME`` and after it
``@@batch end NAME rc=N`` on both outputs; the caller splits the outputs there. A job that raises
ends the launch (the other rank could be left waiting in a collective): the caller runs the jobs
left in a new one.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

MARK = "@@batch"


def _say(text: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        print(text, file=stream, flush=True)


def main(spec_path: str) -> int:
    import horovod.torch as hvd
    import torch

    from hvtrace.record import live

    with open(spec_path) as f:
        jobs = json.load(f)
    base_env = dict(os.environ)
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    hvd.init()
    for i, job in enumerate(jobs):
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(job.get("env") or {})
        os.chdir(job.get("cwd") or os.getcwd())
        live._callbacks.clear()  # a job's on_straggler callbacks are its own
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        hvd.allreduce(torch.zeros(1), name=f"hvtrace.batch.{i}")  # every rank starts together
        _say(f"{MARK} begin {job['name']}")
        try:
            script = importlib.import_module(job.get("module") or "hvtrace.examples.train")
            rc = script.main(list(job["argv"]))
        except BaseException:  # noqa: BLE001 - reported, then the launch ends
            traceback.print_exc()
            _say(f"{MARK} end {job['name']} rc=failed")
            os._exit(1)
        _say(f"{MARK} end {job['name']} rc={rc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
