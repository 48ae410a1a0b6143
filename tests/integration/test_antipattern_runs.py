"""Set-up anti-patterns (issue 40) on real ``horovodrun -np 2 --gloo`` jobs of
``hvtrace.examples.train`` (a 3-layer, 256-wide MLP, 16 steps, checks every 5 steps: 0, 5, 10,
15), each fault injected alone, and its clean twin:

- ``--unsharded``: every rank draws the same batches (one seed for all, as without a
  ``DistributedSampler``): ``unsharded_data`` names ranks 0 and 1 from step 0, half the compute
  wasted; nothing else about the set-up is wrong, so no ``oversubscribed``;
- ``--torch-threads 2``: each of the 2 ranks asks torch for 2 threads on this host's cores
  (2 here: 4 threads on 2 cores), sharded data: ``oversubscribed`` names the host, both ranks and
  the numbers, with the run-queue wait measured; no ``unsharded_data``. On a host with 4 cores or
  more the same job is not oversubscribed: the test asks for as many threads as the host has
  cores instead;
- the default job (sharded per rank, torch threads = cores // ranks per host): neither.

The CUDA part (ranks on one GPU) needs GPUs: it is tested on crafted headers in
``tests/unit/test_antipatterns.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import analyze_cli, ran_steps, traced_scenario

from hvtrace.analysis.summary import analyze
from hvtrace.load import load_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(600)]

STEPS = 16
COMMON = ["--steps", str(STEPS), "--width", "256", "--layers", "3", "--batch-size", "64",
          "--consistency-every", "5"]  # fmt: skip
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
#: Threads per rank that oversubscribe this host with 2 ranks (all its cores, each).
THREADS = max(2, CORES)


UNSHARDED = traced_scenario("antipattern_unsharded", *COMMON, "--unsharded")
THREADED = traced_scenario("antipattern_threads", *COMMON, "--torch-threads", str(THREADS))
CLEAN = traced_scenario("antipattern_clean", *COMMON)


def _kinds(a: object, kind: str) -> list:
    return [f for f in a.findings if f.kind == kind]


@pytest.fixture(scope="module")
def unsharded(batched) -> tuple[Path, object]:
    trace = ran_steps(batched(UNSHARDED), STEPS)
    return trace, analyze(load_run(trace))


@pytest.fixture(scope="module")
def threads(batched) -> object:
    trace = ran_steps(batched(THREADED), STEPS)
    return analyze(load_run(trace))


@pytest.fixture(scope="module")
def clean(batched) -> object:
    return analyze(load_run(ran_steps(batched(CLEAN), STEPS)))


def test_unsharded_data_names_both_ranks_from_step_0(unsharded) -> None:
    _trace, a = unsharded
    (f,) = _kinds(a, "unsharded_data")
    assert f.severity == "warning"
    assert f.data["groups"] == [{"ranks": [0, 1], "first_step": 0}]
    assert f.data["steps"] == [0, 5, 10, 15] and f.data["checks"] == 4
    assert f.data["wasted_share"] == pytest.approx(0.5)
    assert f.message.startswith(
        "unsharded data: ranks 0, 1 trained on the same batches at every checked step "
        "(steps 0, 5, 10, 15: 4 checks)"
    ), f.message
    assert "The job did the work of 1 rank with 2: 50% of the compute" in f.message
    assert not _kinds(a, "oversubscribed"), [x.message for x in a.findings]
    assert not _kinds(a, "divergence")  # the same batches, the same model: still in agreement


def test_unsharded_data_is_at_the_top_of_the_report_and_in_json(unsharded, tmp_path) -> None:
    trace, _a = unsharded
    js = tmp_path / "a.json"
    p = analyze_cli(trace, "--json", js)
    assert p.returncode == 0, p.stderr
    head = p.stdout[: p.stdout.index("Where each step's time goes")]
    assert "! unsharded data: ranks 0, 1" in head, p.stdout
    doc = json.loads(js.read_text())
    assert doc["findings"][0]["kind"] == "unsharded_data"
    assert doc["batches"]["groups"] == [{"ranks": [0, 1], "first_step": 0}]
    assert doc["scale"]["size"] == 2 and doc["scale"]["groups"][0]["first_lr"] == 0.02


def test_more_threads_than_cores_names_the_host_ranks_and_numbers(threads) -> None:
    a = threads
    (f,) = _kinds(a, "oversubscribed")
    host = a.hosts[0]
    assert f.data["host"] == host and f.data["ranks"] == [0, 1]
    assert f.data["threads"] == {"0": THREADS, "1": THREADS}
    assert f.data["threads_total"] == 2 * THREADS and f.data["cores"] == CORES
    assert f.data["suggested_threads"] == max(1, CORES // 2)
    assert f.message.startswith(
        f"oversubscribed host {host}: ranks 0, 1 ask torch for {THREADS} intra-op threads each, "
        f"{2 * THREADS} in all, on {CORES} cores"
    ), f.message
    assert f"torch.set_num_threads({max(1, CORES // 2)})" in f.message
    assert f.data["runq_ms"] is not None and f.data["runq_ms"] > 0  # measured on this run
    assert "measured: its ranks waited a median" in f.message
    assert not _kinds(a, "unsharded_data"), [x.message for x in a.findings]


def test_a_job_set_up_right_has_neither(clean) -> None:
    a = clean
    assert not _kinds(a, "unsharded_data") and not _kinds(a, "oversubscribed"), [
        f.message for f in a.findings
    ]
    assert not _kinds(a, "shared_gpu")
    assert a.batches["checks"] == 4 and a.batches["groups"] == []
    (host,) = a.placement["hosts"]
    assert host["threads_total"] <= host["cores"] and not host["oversubscribed"]
