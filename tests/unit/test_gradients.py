"""How a job sends its gradients (issue 40), analysis side, on hand-made rank files:

- manual gradient averaging: allreduces recorded outside the optimizer, issued after the
  backward, whose sizes match the header's ``optimizer.param_bytes``, in most steps: named with
  the ranks, the first step, the communication after the backward and what a distributed
  optimizer would hide of it (:func:`hvtrace.analysis.gradients.hidden_ms`, checked against
  hand-computed cases); the same allreduces issued during the backward (a job that overlaps
  them itself), a small metric allreduce, a file without the parameters' sizes: nothing; with
  Horovod's optimizer as well: averaged twice. The per-tensor ``collective_cost`` findings do
  not price the gradients again;
- sparse gradients sent dense: the ``hvtrace.zero_rows|HOW|NAME`` rows of a tensor mostly zero
  are named with the bytes that carried zeros and their share of the allreduce time; a tensor
  with few zero rows is not; the advice depends on how it was sent and on the ranks.
"""

from __future__ import annotations

import json

import pytest
from helpers import make_header, row, write_rank_file

from hvtrace.analysis import gradients
from hvtrace.analysis.model import FINDING_KINDS
from hvtrace.analysis.summary import analyze
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.format.schema import FLAG_END_UPPER_BOUND
from hvtrace.load import open_run

MS = 1_000_000
STEPS = 10
#: The gradients' bytes, in the optimizer's order (two layers: weight, bias).
SIZES = [4096, 64, 4096, 64]


def _opt(distributed: bool = False, sizes: list[int] | None = SIZES) -> dict:
    o = {"class": "SGD", "distributed": distributed, "tensors": len(SIZES)}
    if sizes is not None:
        o["param_bytes"] = list(sizes)
    return o


def _write_manual(
    path,
    ranks: int = 2,
    during_backward: bool = False,
    metric_only: bool = False,
    by_hand_steps: set[int] | None = None,
    optimizer: dict | None = None,
    with_optimizer_allreduce: bool = False,
) -> None:
    """``ranks`` ranks, ``STEPS`` steps of 10 ms: forward 1 ms, backward 2 ms (from 1.5 ms), then
    one blocking allreduce per gradient of 1 ms each (from 3.6 ms: 4 ms in all) and a metric
    allreduce of 4 bytes after the update. ``during_backward``: the gradients' allreduces are
    issued inside the backward instead (from 1.6 ms, 0.4 ms apart); ``metric_only``: none;
    ``by_hand_steps``: the steps with them (default all)."""
    for rank in range(ranks):
        rows = []
        for s in range(STEPS):
            t = 10**12 + s * 10 * MS
            rows.append(row("step", "step", t, t + 9 * MS, step=s))
            rows.append(row("forward", "forward", t + MS // 2, t + 3 * MS // 2, step=s))
            rows.append(row("backward", "backward", t + 3 * MS // 2, t + 7 * MS // 2, step=s))
            by_hand = not metric_only and (by_hand_steps is None or s in by_hand_steps)
            for i, nbytes in enumerate(SIZES if by_hand else []):
                # after the backward: one after the other; during it: as each gradient is ready
                a0 = (
                    t + (16 + 4 * i) * MS // 10 if during_backward else t + (36 + 10 * i) * MS // 10
                )
                rows.append(
                    row("collective", f"allreduce.average|backward|grad.{i}", a0, a0 + MS,
                        step=s, nbytes=nbytes, dtype="float32", value=float(MS),
                        flags=FLAG_END_UPPER_BOUND)
                )  # fmt: skip
            if with_optimizer_allreduce:
                rows.append(
                    row("allreduce", "net.0.weight", t + 8 * MS, t + 8 * MS + MS // 2, step=s,
                        nbytes=4096, dtype="float32")
                )  # fmt: skip
            rows.append(row("update", "update", t + 77 * MS // 10, t + 8 * MS, step=s))
            m0 = t + 8 * MS + MS // 10
            rows.append(
                row("collective", "allreduce.average|input|metric.loss", m0, m0 + MS // 2,
                    step=s, nbytes=4, dtype="float32", value=float(MS // 2),
                    flags=FLAG_END_UPPER_BOUND)
            )  # fmt: skip
        h = make_header(rank=rank, size=ranks, optimizer=optimizer or _opt())
        write_rank_file(path / f"rank{rank:05d}-{h['run_id']}.arrows", h, [rows])


def _kind(a: object, kind: str) -> list:
    return [f for f in a.findings if f.kind == kind]


def _report(a: object) -> str:
    return " ".join(format_report(a).split())


# -- the model of what a distributed optimizer hides -----------------------------------------------
def test_hidden_ms_by_hand_computed_cases() -> None:
    # two equal gradients, B = C = 2: the first is ready at 1 and sent by 2; the second, ready at
    # 2, is sent by 3: 1 ms exposed, 1 hidden
    assert gradients.hidden_ms(2.0, 2.0, [8, 8]) == pytest.approx(1.0)
    # little communication: only the last gradient's half stays exposed
    assert gradients.hidden_ms(2.0, 0.1, [8, 8]) == pytest.approx(0.05)
    # much more communication than backward: it starts at the first gradient (at 1) and runs on,
    # so what is hidden is the backward after that first gradient
    assert gradients.hidden_ms(2.0, 10.0, [8, 8]) == pytest.approx(1.0)
    # the gradients are produced last first: a big first layer (ready last) hides less
    assert gradients.hidden_ms(2.0, 1.0, [24, 8]) == pytest.approx(0.25)
    assert gradients.hidden_ms(2.0, 1.0, [8, 24]) == pytest.approx(0.5)
    # SIZES: hand-computed max_k (B F_k + C (1 - F_{k-1})) = 4.969 with B=2, C=4
    f = [64 / 8320, 4096 / 8320, 64 / 8320, 4096 / 8320]
    end = max(
        2 * sum(f[: k + 1]) + 4 * (1 - sum(f[:k])) for k in range(4)
    )  # the formula, written out
    assert gradients.hidden_ms(2.0, 4.0, SIZES) == pytest.approx(4.0 - (end - 2.0))
    assert gradients.hidden_ms(0.0, 4.0, SIZES) == 0.0 and gradients.hidden_ms(2.0, 0, SIZES) == 0


# -- manual gradient averaging ---------------------------------------------------------------------
def test_gradients_allreduced_after_the_backward_are_named(tmp_path) -> None:
    _write_manual(tmp_path)
    a = analyze(open_run(tmp_path))
    (f,) = _kind(a, "manual_averaging")
    assert f.severity == "warning"  # 4 ms after the backward of a 9 ms step
    d = f.data
    assert d["ranks"] == [0, 1] and d["step"] == 0
    assert d["steps_seen"] == {"0": STEPS, "1": STEPS} == d["steps"]
    assert d["tensors"] == 4 and d["bytes"] == sum(SIZES)
    assert d["backward_ms"] == pytest.approx(2.0) and d["comm_ms"] == pytest.approx(4.0)
    assert d["hidden_ms"] == pytest.approx(gradients.hidden_ms(2.0, 4.0, SIZES))
    # 4 blocking calls one at a time, the shortest 1 ms: 3 ms fewer sent together, capped at
    # what overlap leaves exposed (here all of the 4 ms is saved)
    assert d["one_at_a_time"] and d["shortest_ms"] == pytest.approx(1.0)
    assert d["fused_ms"] == pytest.approx(4.0 - d["hidden_ms"])
    assert d["lost_ms_per_step"] == pytest.approx(4.0) and not d["averaged_twice"]
    assert f.message.startswith(
        "manual gradient averaging: ranks 0, 1 allreduce their gradients themselves after the "
        "backward (4 allreduces of 8.1 KiB a step whose sizes match the model's 4 gradients "
        "(8.1 KiB), from step 0, in every step with a backward) and step a plain optimizer; "
        "they take a median 4.0 ms a step after a 2.0 ms backward, all of it exposed"
    ), f.message
    assert (
        "in 4 calls made one at a time (each blocks), each with its own negotiation (the "
        "shortest took a median 1.0 ms). A distributed optimizer would save at least about 4.0 "
        "ms of the 4.0 ms"
    ) in f.message
    assert f"which would hide about {d['hidden_ms']:.1f} ms under the backward" in f.message
    assert f"at least about {d['fused_ms']:.1f} ms less (3 calls fewer" in f.message
    assert "Use hvd.DistributedOptimizer(optimizer, named_parameters=" in f.message
    # the gradients' allreduces are priced here only: no per-tensor collective finding for them
    assert not [x for x in a.findings if x.kind.startswith("collective") and "grad." in x.message]
    # ... and the comm-bound finding points here instead of Horovod's knobs
    for x in _kind(a, "comm_bound"):
        assert "see the manual-averaging finding" in x.message
    assert (
        "gradients: allreduced by the job itself after the backward on ranks 0-1, in 20 of "
        "their 20 steps from step 0 (median 4 tensors, 8.1 KiB, 4.0 ms after a 2.0 ms backward"
    ) in _report(a)
    doc = json.loads(json.dumps(analysis_to_dict(a)))
    assert doc["gradients"]["manual"]["ranks"] == [0, 1]
    assert [x for x in doc["findings"] if x["kind"] == "manual_averaging"]


def test_from_the_first_step_it_was_seen(tmp_path) -> None:
    _write_manual(tmp_path, by_hand_steps=set(range(3, STEPS)))
    (f,) = _kind(analyze(open_run(tmp_path)), "manual_averaging")
    assert f.data["step"] == 3 and f.data["steps_seen"] == {"0": 7, "1": 7}
    assert "from step 3, in 7 to 7 of each rank's 10 to 10 steps" in f.message


def test_allreduces_issued_during_the_backward_are_not_manual_averaging(tmp_path) -> None:
    # a job that starts each gradient's allreduce from a hook during the backward overlaps them
    _write_manual(tmp_path, during_backward=True)
    a = analyze(open_run(tmp_path))
    assert not _kind(a, "manual_averaging"), [f.message for f in a.findings]
    assert a.gradients["manual"]["checked"] and a.gradients["manual"]["ranks"] == []


def test_a_metric_allreduce_alone_is_not_manual_averaging(tmp_path) -> None:
    _write_manual(tmp_path, metric_only=True)
    a = analyze(open_run(tmp_path))
    assert not _kind(a, "manual_averaging") and a.gradients["manual"]["ranks"] == []


def test_few_steps_by_hand_are_not_named(tmp_path) -> None:
    _write_manual(tmp_path, by_hand_steps={2, 5, 8})
    assert not _kind(analyze(open_run(tmp_path)), "manual_averaging")


def test_files_without_the_parameters_sizes_are_not_judged(tmp_path) -> None:
    _write_manual(tmp_path, optimizer=_opt(sizes=None))
    a = analyze(open_run(tmp_path))
    assert a.gradients["manual"] == {"checked": False, "ranks": []}
    assert not _kind(a, "manual_averaging")


def test_with_horovods_optimizer_too_the_gradients_are_averaged_twice(tmp_path) -> None:
    _write_manual(tmp_path, optimizer=_opt(distributed=True), with_optimizer_allreduce=True)
    (f,) = _kind(analyze(open_run(tmp_path)), "manual_averaging")
    assert f.data["averaged_twice"] and f.data["lost_ms_per_step"] == pytest.approx(4.0)
    assert f.message.startswith("gradients averaged twice: ranks 0, 1 allreduce")
    assert "remove the manual allreduces" in f.message


# -- sparse gradients sent dense -------------------------------------------------------------------
def _write_sparse(path, share: float = 0.95, how: str = "dense", ranks: int = 2) -> None:
    """``ranks`` ranks, 10 steps of 40 ms, each with the optimizer's allreduces of 3,000,000
    bytes for 10 ms (the embedding's 2,560,000 among them); its zero-row share at steps 0 and 5."""
    for rank in range(ranks):
        rows = []
        for s in range(STEPS):
            t = 10**12 + s * 40 * MS
            rows.append(row("step", "step", t, t + 40 * MS, step=s))
            rows.append(row("compute", "compute", t, t + 25 * MS, step=s))
            rows.append(row("wait", "synchronize", t + 25 * MS, t + 35 * MS, step=s))
            for name, nbytes in (("emb.weight", 2_560_000), ("mlp.w", 440_000)):
                rows.append(
                    row("allreduce", name, t + 25 * MS, t + 35 * MS, step=s, nbytes=nbytes,
                        dtype="float32", flags=FLAG_END_UPPER_BOUND)
                )  # fmt: skip
            rows.append(row("update", "update", t + 35 * MS, t + 40 * MS, step=s))
            if s % 5 == 0:
                rows.append(
                    row("scalar", f"hvtrace.zero_rows|{how}|emb.weight", t + 35 * MS,
                        t + 35 * MS, step=s, nbytes=2_560_000, dtype="float32", value=share)
                )  # fmt: skip
        h = make_header(rank=rank, size=ranks, optimizer=_opt(distributed=True))
        write_rank_file(path / f"rank{rank:05d}-{h['run_id']}.arrows", h, [rows])


def test_an_embedding_sent_dense_with_mostly_zero_rows_is_named(tmp_path) -> None:
    _write_sparse(tmp_path)
    a = analyze(open_run(tmp_path))
    (t,) = a.gradients["zero_rows"]
    assert (t["name"], t["how"], t["bytes"], t["checks"], t["steps"]) == (
        "emb.weight", "dense", 2_560_000, 2, [0, 5]
    )  # fmt: skip
    (f,) = _kind(a, "sparse_as_dense")
    d = f.data
    assert f.severity == "warning" and d["ranks"] == [0, 1] and d["step"] == 0
    assert d["zero_bytes_per_step"] == pytest.approx(0.95 * 2_560_000)
    assert d["bytes_per_step"] == 3_000_000
    # the zeros' share of the step's allreduced bytes, times its allreduce time (10 ms)
    assert d["zero_ms"] == pytest.approx(0.95 * 2_560_000 / 3_000_000 * 10.0)
    assert f.message.startswith(
        "sparse gradient sent dense: emb.weight (an embedding's dense gradient, 2.4 MiB) is "
        "allreduced dense every step, but a median 95% of its rows were zero in the averaged "
        "gradient at 2 checks (steps 0, 5) on ranks 0, 1: at least 2.3 MiB of the 2.9 MiB each "
        "rank sends a step carried zeros, about 8.1 ms of the step's 10.0 ms of allreduce time"
    ), f.message
    assert "nn.Embedding(..., sparse=True), and keep the DistributedOptimizer's default " in (
        f.message
    )
    assert "the allgather would bring each rank about 0.1 times the dense bytes" in f.message
    assert "gradient emb.weight (2.4 MiB, sent dense): a median 95% of its rows zero" in (
        _report(a)
    )
    doc = json.loads(json.dumps(analysis_to_dict(a)))
    assert doc["gradients"]["zero_rows"][0]["share"] == pytest.approx(0.95)


def test_a_sparse_gradient_sent_dense_by_sparse_as_dense_is_told_to_leave_it_out(tmp_path):
    _write_sparse(tmp_path, how="sparse_as_dense")
    (f,) = _kind(analyze(open_run(tmp_path)), "sparse_as_dense")
    assert "because the DistributedOptimizer has sparse_as_dense=True" in f.message
    assert "Leave out sparse_as_dense=True: Horovod 0.28 then allgathers only the rows" in (
        f.message
    )


def test_an_embedding_with_few_zero_rows_is_not_named(tmp_path) -> None:
    _write_sparse(tmp_path, share=0.3)
    a = analyze(open_run(tmp_path))
    assert a.gradients["zero_rows"][0]["share"] == pytest.approx(0.3)
    assert not _kind(a, "sparse_as_dense")


def test_the_sparse_path_is_advised_only_where_it_sends_fewer_bytes() -> None:
    few = gradients._sparse_advice("dense", 2, 0.05, 2 * 0.05, plain=False)
    assert few.startswith("Make the embedding sparse") and "0.1 times the dense bytes" in few
    many = gradients._sparse_advice("dense", 64, 0.05, 64 * 0.05, plain=False)
    assert many.startswith("Horovod's sparse path does not pay here: with 64 ranks")
    assert "another design" in many and "Make the embedding sparse" not in many


def test_the_new_kinds_are_documented() -> None:
    for kind in ("manual_averaging", "sparse_as_dense"):
        k = FINDING_KINDS[kind]
        assert k.means and k.cost and k.action
