"""How a job sends its gradients (issue 40) on real ``horovodrun -np 2 --gloo`` jobs of
``hvtrace.examples.train`` (a 3-layer, 256-wide MLP, 16 steps, checks every 5 steps), each
anti-pattern injected alone, and its clean twin:

- ``--manual-average blocking`` / ``async``: no distributed optimizer; after each backward every
  gradient is averaged with ``hvd.allreduce`` (one blocking call each) or
  ``hvd.allreduce_async_`` + ``hvd.synchronize``, then a plain SGD steps. The job calls nothing
  of hvtrace's tracing: it is traced by environment (``HVTRACE_DIR``), through its plain
  optimizer, from the end of its first step. ``manual_averaging`` names ranks 0 and 1 from
  step 0 (hvtrace's first), with the 8 gradients' sizes, the communication after the backward
  and what a distributed optimizer would hide of it. Its clean twin, the same job with
  ``hvd.DistributedOptimizer`` (traced by environment too), gets nothing;
- ``--embedding 20000``: an ``nn.Embedding(20000, 32)`` (2.4 MiB) in front of the MLP, of which
  a step's 64 x 16 lookups touch at most 1,024 rows per rank: allreduced dense by Horovod's
  optimizer, mostly zeros: ``sparse_as_dense`` names ``emb.weight`` at the checked steps 0, 5,
  10, 15 with the bytes that carried zeros; with ``--sparse-embedding --sparse-as-dense`` the
  same, with the advice to leave ``sparse_as_dense`` out; with ``--sparse-embedding`` alone
  (Horovod's sparse allgather) nothing is measured and nothing named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import analyze_cli, ran_steps, run_train, tail, traced_scenario

from hvtrace.analysis.summary import analyze
from hvtrace.load import load_run

pytestmark = [pytest.mark.horovod, pytest.mark.timeout(900)]

STEPS = 16
COMMON = ["--steps", str(STEPS), "--width", "256", "--layers", "3", "--batch-size", "64",
          "--consistency-every", "5"]  # fmt: skip
#: The MLP's gradients: 3 blocks of 256 x 256 (the first's input is 256) and a 10-way head.
PARAM_BYTES = 3 * (256 * 256 + 256) * 4 + (256 * 10 + 10) * 4
EMB = ["--embedding", "20000"]
EMB_BYTES = 20000 * 32 * 4


def _env_job(tmp_path_factory, name: str, *args: str) -> Path:
    """The demo traced by environment alone (``HVTRACE_DIR``; the script traces nothing)."""
    base = tmp_path_factory.mktemp(name)
    trace = base / "trace"
    proc = run_train(*COMMON, *args, env={"HVTRACE_DIR": str(trace)}, cwd=base)
    assert f"rank 0: {STEPS} steps" in proc.stdout, tail(proc.stderr)
    assert "hvtrace: could not" not in proc.stderr, tail(proc.stderr)
    return trace


def _kinds(a: object, kind: str) -> list:
    return [f for f in a.findings if f.kind == kind]


@pytest.fixture(scope="module")
def manual(tmp_path_factory) -> tuple[Path, object]:
    trace = _env_job(tmp_path_factory, "manual", "--manual-average", "blocking")
    return trace, analyze(load_run(trace))


@pytest.fixture(scope="module")
def manual_async(tmp_path_factory) -> object:
    return analyze(load_run(_env_job(tmp_path_factory, "async", "--manual-average", "async")))


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> object:
    return analyze(load_run(_env_job(tmp_path_factory, "distributed", "--no-trace")))


DENSE = traced_scenario("gradients_dense", *COMMON, *EMB)
SPARSE_AS_DENSE = traced_scenario(
    "gradients_sad", *COMMON, *EMB, "--sparse-embedding", "--sparse-as-dense"
)
SPARSE = traced_scenario("gradients_sparse", *COMMON, *EMB, "--sparse-embedding")


def _dense_job(batched, sc) -> tuple[Path, object]:
    trace = ran_steps(batched(sc), STEPS)
    return trace, analyze(load_run(trace))


@pytest.fixture(scope="module")
def dense(batched) -> tuple[Path, object]:
    return _dense_job(batched, DENSE)


@pytest.fixture(scope="module")
def sparse_as_dense(batched) -> object:
    return _dense_job(batched, SPARSE_AS_DENSE)[1]


@pytest.fixture(scope="module")
def sparse(batched) -> object:
    return _dense_job(batched, SPARSE)[1]


# -- manual gradient averaging ---------------------------------------------------------------------
def test_a_plain_optimizer_is_traced_by_environment(manual) -> None:
    trace, a = manual
    run = load_run(trace)
    opt = run.files[0].header["optimizer"]
    assert opt["class"] == "SGD" and opt["distributed"] is False
    assert sum(opt["param_bytes"]) == PARAM_BYTES and opt["tensors"] == 8
    assert a.ranks == [0, 1]
    # traced from the end of the job's first step: hvtrace's steps 0 .. 14, each split
    assert sorted(a.steps["step"].unique().tolist()) == list(range(STEPS - 1))
    pr = a.per_rank.set_index("rank")
    assert (pr["forward_ms"] > 0).all() and (pr["backward_ms"] > 0).all()


def test_gradients_averaged_by_hand_are_named_at_both_ranks_from_step_0(manual) -> None:
    _trace, a = manual
    (f,) = _kinds(a, "manual_averaging")
    d = f.data
    assert d["ranks"] == [0, 1] and d["step"] == 0, f.message
    assert d["steps_seen"] == {"0": STEPS - 1, "1": STEPS - 1} == d["steps"]
    assert d["tensors"] == 8 and d["bytes"] == PARAM_BYTES and d["one_at_a_time"]
    assert d["backward_ms"] > 0 and d["comm_ms"] > 0
    assert 0 < d["hidden_ms"] <= min(d["backward_ms"], d["comm_ms"])
    # 8 blocking calls, one at a time: sent together they would pay one negotiation
    assert d["fused_ms"] > 0 and d["shortest_ms"] > 0
    assert d["lost_ms_per_step"] == pytest.approx(min(d["hidden_ms"] + d["fused_ms"], d["comm_ms"]))
    assert not d["averaged_twice"]
    assert f.message.startswith(
        "manual gradient averaging: ranks 0, 1 allreduce their gradients themselves after the "
        "backward (8 allreduces of 781.0 KiB a step whose sizes match the model's 8 gradients "
        "(781.0 KiB), from step 0, in every step with a backward) and step a plain optimizer"
    ), f.message
    assert "Use hvd.DistributedOptimizer(optimizer, named_parameters=" in f.message
    # the gradients' own allreduces are not priced again as the user's collectives
    assert not [x for x in a.findings if x.kind.startswith("collective") and "grad." in x.message]


def test_manual_averaging_is_in_the_report_and_the_json(manual, tmp_path) -> None:
    trace, _a = manual
    js = tmp_path / "a.json"
    p = analyze_cli(trace, "--json", js)
    assert p.returncode == 0, p.stderr
    assert "manual gradient averaging: ranks 0, 1" in " ".join(p.stdout.split())
    assert (
        "gradients: allreduced by the job itself after the backward on ranks 0-1, in 30 of "
        "their 30 steps from step 0 (median 8 tensors, 781.0 KiB"
    ) in " ".join(p.stdout.split())
    doc = json.loads(js.read_text())
    assert doc["gradients"]["manual"]["ranks"] == [0, 1]
    assert [x["kind"] for x in doc["findings"]].count("manual_averaging") == 1


def test_async_averaging_by_hand_is_named_too(manual_async) -> None:
    (f,) = _kinds(manual_async, "manual_averaging")
    assert f.data["ranks"] == [0, 1] and f.data["step"] == 0 and f.data["tensors"] == 8
    assert not f.data["one_at_a_time"]  # enqueued together, waited for in turn: fused
    assert f.data["fused_ms"] == 0 and f.data["lost_ms_per_step"] == f.data["hidden_ms"] > 0


def test_the_same_job_with_a_distributed_optimizer_is_quiet(distributed) -> None:
    a = distributed
    assert a.optimizer.get("distributed") is True
    assert not _kinds(a, "manual_averaging") and not _kinds(a, "sparse_as_dense"), [
        f.message for f in a.findings
    ]
    assert not a.gradients["manual"].get("ranks") and a.gradients["zero_rows"] == []


# -- sparse gradients sent dense -------------------------------------------------------------------
def test_a_dense_embedding_gradient_of_mostly_zeros_is_named(dense) -> None:
    trace, a = dense
    (t,) = a.gradients["zero_rows"]
    assert (t["name"], t["how"], t["bytes"]) == ("emb.weight", "dense", EMB_BYTES)
    assert t["steps"] == [0, 5, 10, 15] and t["ranks"] == [0, 1]
    # at most 2 x 1,024 of 20,000 rows used by the two ranks: 90 % zero at least (sampled)
    assert t["share"] >= 0.85 and t["min_share"] >= 0.8, t
    (f,) = _kinds(a, "sparse_as_dense")
    d = f.data
    assert d["name"] == "emb.weight" and d["ranks"] == [0, 1] and d["step"] == 0
    assert d["zero_bytes_per_step"] == pytest.approx(t["share"] * EMB_BYTES)
    assert d["bytes_per_step"] == EMB_BYTES + PARAM_BYTES + 32 * 256 * 4  # the MLP's input is wider
    assert d["zero_ms"] is not None and 0 < d["zero_ms"] < d["comm_ms"]
    assert f.message.startswith(
        "sparse gradient sent dense: emb.weight (an embedding's dense gradient, 2.4 MiB) is "
        "allreduced dense every step, but a median"
    ), f.message
    assert "at 4 checks (steps 0, 5, 10, 15) on ranks 0, 1" in f.message
    assert "Make the embedding sparse, nn.Embedding(..., sparse=True)" in f.message
    doc_p = analyze_cli(trace)
    assert doc_p.returncode == 0 and "sparse gradient sent dense: emb.weight" in doc_p.stdout


def test_sparse_as_dense_is_named_with_its_own_advice(sparse_as_dense) -> None:
    a = sparse_as_dense
    (f,) = _kinds(a, "sparse_as_dense")
    assert f.data["how"] == "sparse_as_dense" and f.data["ranks"] == [0, 1]
    assert f.data["step"] == 0 and f.data["zero_share"] >= 0.9
    assert "because the DistributedOptimizer has sparse_as_dense=True" in f.message
    assert "Leave out sparse_as_dense=True" in f.message


def test_a_sparse_embedding_sent_sparse_is_quiet(sparse) -> None:
    a = sparse
    assert a.gradients["zero_rows"] == [] and not _kinds(a, "sparse_as_dense"), [
        f.message for f in a.findings
    ]
    assert not _kinds(a, "manual_averaging")
    assert a.optimizer.get("sparse_as_dense") is False
