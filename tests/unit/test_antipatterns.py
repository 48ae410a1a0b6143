"""Set-up anti-patterns (issue 40), analysis side, on hand-made rank files and frames.

- unsharded data: ranks whose batch fingerprints (``hvtrace.batch|input``) are equal at every
  checked step after the first (two checks at least) are named in groups, with the share of the
  compute wasted (``1 - groups / ranks``); sharded ranks, one check, or duplicates at some steps
  only give nothing;
- placement, from the headers: a host whose ranks ask torch for more threads than its cores
  (``oversubscribed``, with the run-queue wait measured there), ranks of one host on one CUDA
  device (``shared_gpu``); a job set up right gives neither;
- the learning rates beside the world size, as information.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_frames import synth_spans
from helpers import make_header, write_rank_file

from hvtrace.analysis import antipatterns
from hvtrace.analysis.model import FINDING_KINDS
from hvtrace.analysis.summary import analyze, analyze_spans
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.format.schema import BATCH_NAME, KIND_CODE
from hvtrace.load import open_run
from hvtrace.selection import StepRange

STEPS, EVERY = 20, 5


def _row(step: int, kind: str, name: str, t: int, end: int, value: float = np.nan) -> tuple:
    return (step, 0, KIND_CODE[kind], name, t, end, 0, 0, value, 0)


def _write_run(
    path,
    batch: dict[int, object],
    ranks: int = 4,
    headers: dict[int, dict] | None = None,
    lr: float = 0.1,
) -> None:
    """A run of ``ranks`` ranks, ``STEPS`` steps; at step 0 and every ``EVERY`` steps each rank
    records the batch fingerprint ``batch[rank](step)`` (a function of the step; None: none)."""
    for rank in range(ranks):
        rows = []
        for s in range(STEPS):
            t = 10**12 + s * 10_000_000
            rows.append(_row(s, "forward", "forward", t + 1000, t + 4_000_000))
            rows.append(_row(s, "step", "step", t, t + 9_000_000))
            rows.append(_row(s, "scalar", "hvtrace.lr|0", t + 8_000_000, t + 8_000_000, lr))
            fp = batch[rank](s) if s % EVERY == 0 else None
            if fp is not None:
                rows.append(_row(s, "scalar", BATCH_NAME, t + 500, t + 500, float(fp)))
        h = make_header(rank=rank, size=ranks, **((headers or {}).get(rank) or {}))
        write_rank_file(path / f"rank{rank:05d}-{h['run_id']}.arrows", h, [rows])


def _report(a: object) -> str:
    """The report as one line (its wrapping left out)."""
    return " ".join(format_report(a).split())


def _kind(a: object, kind: str) -> list:
    return [f for f in a.findings if f.kind == kind]


def own(rank: int):
    return lambda s: 1000 * rank + s + 1


def same(group: int = 0):
    return lambda s: 10**6 * (group + 1) + s


# -- unsharded data --------------------------------------------------------------------------------
def test_every_rank_on_the_same_batches_is_named_with_the_waste(tmp_path) -> None:
    _write_run(tmp_path, {r: same() for r in range(4)})
    a = analyze(open_run(tmp_path))
    (f,) = _kind(a, "unsharded_data")
    assert f.severity == "warning"
    assert f.data["groups"] == [{"ranks": [0, 1, 2, 3], "first_step": 0}]
    assert f.data["wasted_share"] == pytest.approx(0.75) and f.data["distinct"] == 1
    assert f.data["steps"] == [0, 5, 10, 15] and f.data["step"] == 0
    assert f.message.startswith(
        "unsharded data: ranks 0-3 trained on the same batches at every checked step "
        "(steps 0, 5, 10, 15: 4 checks)"
    ), f.message
    assert "The job did the work of 1 rank with 4: 75% of the compute" in f.message
    assert "DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())" in f.message
    assert "set_epoch" in f.message and "likely cause" in f.message
    text = format_report(a)
    head = text[: text.index("Where each step's time goes")]
    assert "! unsharded data: ranks 0-3" in head  # at the top of the report
    assert "Set-up: data, threads, devices" in text
    doc = analysis_to_dict(a)
    assert doc["batches"]["groups"] == [{"ranks": [0, 1, 2, 3], "first_step": 0}]
    assert doc["findings"][0]["kind"] == "unsharded_data"


def test_two_groups_of_equal_ranks_and_a_first_step_after_the_first_check(tmp_path) -> None:
    # ranks 0, 1 draw the same batches from step 5 on (their step 0 differs); ranks 2, 3 always
    batch = {
        0: lambda s: 1 if s == 0 else 10**6 + s,
        1: lambda s: 2 if s == 0 else 10**6 + s,
        2: same(1),
        3: same(1),
    }
    _write_run(tmp_path, batch)
    (f,) = _kind(analyze(open_run(tmp_path)), "unsharded_data")
    assert f.data["groups"] == [
        {"ranks": [0, 1], "first_step": 5},
        {"ranks": [2, 3], "first_step": 0},
    ]
    assert f.data["wasted_share"] == pytest.approx(0.5) and f.data["step"] == 0
    assert "ranks 0, 1 (from step 5); ranks 2, 3 trained on the same batches" in f.message
    assert "work of 2 ranks with 4: 50%" in f.message


def test_one_rank_on_its_own_and_the_others_together(tmp_path) -> None:
    _write_run(tmp_path, {0: own(0), 1: same(), 2: same(), 3: same()})
    (f,) = _kind(analyze(open_run(tmp_path)), "unsharded_data")
    assert f.data["groups"] == [{"ranks": [1, 2, 3], "first_step": 0}]
    assert f.data["distinct"] == 2 and f.data["wasted_share"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "batch",
    [
        {r: own(r) for r in range(4)},  # sharded
        # equal at one checked step only (a coincidence, or a shared first batch): not every step
        {r: (lambda s, r=r: 7 if s == 10 else 1000 * r + s + 1) for r in range(4)},
        # equal at step 0 only (the same first batch, then sharded)
        {r: (lambda s, r=r: 7 if s == 0 else 1000 * r + s + 1) for r in range(4)},
    ],
    ids=["sharded", "one-step-equal", "only-step-0-equal"],
)
def test_sharded_ranks_give_no_finding(tmp_path, batch) -> None:
    _write_run(tmp_path, batch)
    a = analyze(open_run(tmp_path))
    assert _kind(a, "unsharded_data") == [], [f.message for f in a.findings]
    assert a.batches["checked"] and a.batches["checks"] == 4 and a.batches["groups"] == []
    assert "the ranks' batches differ (sharded)" in _report(a)


def test_one_check_is_not_enough_to_judge(tmp_path) -> None:
    _write_run(tmp_path, {r: (lambda s: 5 if s == 0 else None) for r in range(2)}, ranks=2)
    a = analyze(open_run(tmp_path))
    assert _kind(a, "unsharded_data") == [] and a.batches["checks"] == 1
    assert "too few checks to judge" in _report(a)


def test_a_run_without_fingerprints_says_nothing(tmp_path) -> None:
    _write_run(tmp_path, {r: (lambda s: None) for r in range(2)}, ranks=2)
    a = analyze(open_run(tmp_path))
    assert a.batches == {"checked": False, "groups": []} and not _kind(a, "unsharded_data")


def test_the_step_selection_applies(tmp_path) -> None:
    # equal batches from step 10 on only: the whole run is not judged unsharded (step 5
    # differs), steps 10.. are
    batch = {r: (lambda s, r=r: 99 + s if s >= 10 else 1000 * r + s + 1) for r in range(2)}
    _write_run(tmp_path, batch, ranks=2)
    run = open_run(tmp_path)
    assert not _kind(analyze(run), "unsharded_data")
    (f,) = _kind(analyze(run, steps=StepRange(10, None)), "unsharded_data")
    assert f.data["steps"] == [10, 15] and f.data["groups"] == [{"ranks": [0, 1], "first_step": 10}]


def test_a_span_frame_is_judged_the_same(tmp_path) -> None:
    spans = synth_spans(ranks=2, steps=20, tensors=2).astype(
        {"kind": str, "name": str, "dtype": str}
    )
    extra = []
    for r in range(2):
        for s in range(0, 20, 5):
            t = int(spans["start_ns"].min()) + s * 1000 + r
            extra.append({"rank": r, "step": s, "micro": 0, "kind": "scalar", "name": BATCH_NAME,
                          "start_ns": t, "end_ns": t, "bytes": 0, "dtype": "", "value": 3.0 + s,
                          "flags": 0})  # fmt: skip
    a = analyze_spans(pd.concat([spans, pd.DataFrame(extra)]).reset_index(drop=True))
    (f,) = _kind(a, "unsharded_data")
    assert f.data["groups"] == [{"ranks": [0, 1], "first_step": 0}]


# -- placement: threads against cores, GPUs --------------------------------------------------------
def _cpu(threads: int, affinity: list[int] | None = None, count: int = 4) -> dict:
    return {"cpu": {"cpu_count": count, "affinity": affinity or list(range(count)),
                    "torch_threads": threads, "torch_interop_threads": threads,
                    "omp_num_threads": None}}  # fmt: skip


def test_ranks_asking_for_more_threads_than_cores_are_named(tmp_path) -> None:
    headers = {r: {**_cpu(4), "host": "nodeA"} for r in range(2)}
    headers |= {r: {**_cpu(2), "host": "nodeB"} for r in (2, 3)}  # 2 x 2 on 4 cores: right
    _write_run(tmp_path, {r: own(r) for r in range(4)}, headers=headers)
    a = analyze(open_run(tmp_path))
    (f,) = _kind(a, "oversubscribed")
    assert f.data["host"] == "nodeA" and f.data["ranks"] == [0, 1]
    assert f.data["threads_total"] == 8 and f.data["cores"] == 4
    assert f.data["suggested_threads"] == 2
    assert f.message.startswith(
        "oversubscribed host nodeA: ranks 0, 1 ask torch for 4 intra-op threads each, 8 in all, "
        "on 4 cores"
    ), f.message
    assert "torch.set_num_threads(2)" in f.message
    hosts = {e["host"]: e for e in a.placement["hosts"]}
    assert not hosts["nodeB"]["oversubscribed"] and hosts["nodeA"]["oversubscribed"]
    assert "host nodeA: ranks 0-1, 4 torch thread(s) each, 8 on 4 core(s) (oversubscribed" in (
        _report(a)
    )


def test_a_rank_pinned_to_fewer_cores_than_its_threads(tmp_path) -> None:
    headers = {r: {**_cpu(2, affinity=[r]), "host": "n"} for r in range(2)}  # 2 threads, 1 core
    _write_run(tmp_path, {r: own(r) for r in range(2)}, ranks=2, headers=headers)
    (f,) = _kind(analyze(open_run(tmp_path)), "oversubscribed")
    assert f.data["cores"] == 2 and f.data["threads_total"] == 4
    assert "on 2 cores (their CPU affinity; the host has 4)" in f.message


def test_a_job_set_up_right_or_without_the_fields_gives_nothing(tmp_path) -> None:
    headers = {r: {**_cpu(2, count=4), "host": "n"} for r in range(2)}
    _write_run(tmp_path, {r: own(r) for r in range(2)}, ranks=2, headers=headers)
    a = analyze(open_run(tmp_path))
    assert not _kind(a, "oversubscribed") and not _kind(a, "shared_gpu")
    old = tmp_path / "old"
    old.mkdir()
    _write_run(old, {r: own(r) for r in range(2)}, ranks=2)  # headers without cpu / cuda
    b = analyze(open_run(old))
    assert b.placement == {"hosts": [], "shared_gpus": []} and not _kind(b, "oversubscribed")


def test_measured_contention_is_the_cost_and_little_of_it_is_a_note() -> None:
    a = analyze_spans(synth_spans(ranks=2, steps=10, tensors=2), hosts={0: "h", 1: "h"})
    a.placement = antipatterns.placement({r: {"host": "h", **_cpu(2, count=2)} for r in range(2)})
    a.contention = pd.DataFrame(
        [{"host": "h", "ranks": [0, 1], "runq_ms": 3.0, "work_ms": 12.0, "work_share": 0.25,
          "worst_rank": 0, "worst_runq_ms": 3.5, "short": True}]
    )  # fmt: skip
    (f,) = antipatterns.oversubscribed_findings(a)
    assert f.severity == "warning" and f.data["runq_ms"] == 3.0
    assert "waited a median 3.0 ms per step runnable but without a CPU, 25% of their 12.0 ms" in (
        f.message
    )
    a.contention.loc[0, ["runq_ms", "work_share"]] = [0.1, 0.008]
    (g,) = antipatterns.oversubscribed_findings(a)
    assert g.severity == "info" and "little contention in this run" in g.message


def _cuda(uuid: str, index: int = 0, visible: int = 4) -> dict:
    return {"cuda": {"index": index, "uuid": uuid, "pci_bus_id": f"0000:{index + 0x1b:02x}:00",
                     "name": "NVIDIA H100", "visible": visible}}  # fmt: skip


def test_ranks_on_one_gpu_are_named_per_host(tmp_path) -> None:
    headers = {
        0: {"host": "a", **_cuda("GPU-0000")},
        1: {"host": "a", **_cuda("GPU-0000")},  # hard-coded cuda:0 on host a
        2: {"host": "b", **_cuda("GPU-1111", 0)},
        3: {"host": "b", **_cuda("GPU-2222", 1)},  # set_device(local_rank) on host b
    }
    _write_run(tmp_path, {r: own(r) for r in range(4)}, headers=headers)
    a = analyze(open_run(tmp_path))
    (f,) = _kind(a, "shared_gpu")
    assert f.data["ranks"] == [0, 1] and f.data["host"] == "a" and f.data["device"] == "GPU-0000"
    assert f.message.startswith(
        "ranks 0, 1 on host a share one GPU (cuda:0, NVIDIA H100, GPU-0000)"
    ), f.message
    assert "torch.cuda.set_device(hvd.local_rank())" in f.message
    assert "sees 4 GPUs, so 3 of them may idle" in f.message
    assert "GPU GPU-0000 on a: shared by ranks 0-1" in _report(a)


def test_the_same_device_index_on_two_hosts_is_not_shared() -> None:
    p = antipatterns.placement(
        {0: {"host": "a", **_cuda("GPU-A")}, 1: {"host": "b", **_cuda("GPU-B")}}
    )
    assert p["shared_gpus"] == []
    # no UUID recorded: the PCI bus id tells the devices apart
    p = antipatterns.placement(
        {r: {"host": "a", "cuda": {"index": 0, "uuid": None, "pci_bus_id": "0000:1b:00"}}
         for r in range(2)}
    )  # fmt: skip
    assert [g["ranks"] for g in p["shared_gpus"]] == [[0, 1]]


# -- learning rate beside world size, and the documentation ----------------------------------------
def test_learning_rates_are_reported_beside_the_world_size(tmp_path) -> None:
    _write_run(tmp_path, {r: own(r) for r in range(4)}, lr=0.4)
    a = analyze(open_run(tmp_path))
    assert a.scale["size"] == 4
    (g,) = a.scale["groups"]
    assert (g["group"], g["first_lr"], g["last_lr"], g["last_step"]) == (0, 0.4, 0.4, STEPS - 1)
    assert "learning rate (param group 0, rank 0): 0.4, with 4 ranks" in _report(a)
    assert analysis_to_dict(a)["scale"]["groups"][0]["first_lr"] == 0.4
    assert not [f for f in a.findings if "learning rate" in f.message]  # information, no finding


def test_every_new_kind_is_documented() -> None:
    for kind in ("unsharded_data", "oversubscribed", "shared_gpu"):
        k = FINDING_KINDS[kind]
        assert k.means and k.cost and k.action


def test_rank_words() -> None:
    assert antipatterns.rank_words([3, 0, 1, 2]) == "0-3"
    assert antipatterns.rank_words([0, 1]) == "0, 1"
    assert antipatterns.rank_words([0, 2, 3, 4, 9]) == "0, 2-4, 9"


def _contended(headers: dict, env: dict | None = None) -> str:
    """The contention finding's message for host h, short of CPU, with these rank headers."""
    from hvtrace.analysis.findings import _contention

    a = analyze_spans(synth_spans(ranks=2, steps=10, tensors=2), hosts={0: "h", 1: "h"})
    a.placement = antipatterns.placement(headers)
    a.horovod_env = env or {}
    a.contention = pd.DataFrame(
        [{"host": "h", "ranks": [0, 1], "runq_ms": 0.5, "work_ms": 4.1, "work_share": 0.12,
          "worst_rank": 0, "worst_runq_ms": 0.5, "short": True}]
    )  # fmt: skip
    (f,) = _contention(a)
    return f.message


def test_contention_on_ranks_pinned_to_their_torch_threads_is_not_told_to_pin_them() -> None:
    """Each rank pinned to one CPU with one torch thread (a correct 2-rank job here, under a
    0.1 ms Horovod cycle, waited 12 % of its time outside synchronize): pinning and fewer threads
    are what was done; its own other threads, or another job there, take the CPU. Anywhere else,
    the usual advice."""
    pinned = {r: {"host": "h", **_cpu(1, affinity=[r])} for r in range(2)}
    msg = _contended(pinned, {"HOROVOD_CYCLE_TIME": "0.1"})
    assert "pinned to as many CPUs as it runs torch threads (1 each)" in msg
    assert "Horovod's background thread, which wakes every cycle, HOROVOD_CYCLE_TIME=0.1" in msg
    assert "or other jobs' processes there; keep other jobs off those CPUs" in msg
    assert "give each rank a second CPU" in msg and "a longer HOROVOD_CYCLE_TIME" in msg
    assert "pin ranks to their own cores" not in msg
    two = {r: {"host": "h", **_cpu(2, affinity=[2 * r, 2 * r + 1], count=8)} for r in range(2)}
    msg = _contended(two)  # the default cycle: not told to lengthen it
    assert "(2 each)" in msg and "torch.set_num_threads one lower" in msg
    assert "HOROVOD_CYCLE_TIME (default)" in msg and "longer HOROVOD_CYCLE_TIME" not in msg
    free = {r: {"host": "h", **_cpu(1)} for r in range(2)}  # may run on all 4 CPUs
    one = {0: pinned[0], 1: free[1]}  # one rank pinned, one not
    for headers in (free, one):
        msg = _contended(headers)
        assert "pin ranks to their own cores" in msg and "pinned to as many" not in msg
