"""The zero rows of large embedding gradients (issue 40, sparse gradients sent dense), recording
side: :class:`hvtrace.record.consistency.ZeroRows`, run by the parameter checks.

On a real :class:`~hvtrace.record.recorder.Recorder` with a stand-in tracer (as
``test_consistency_record.py``): an ``nn.Embedding``'s dense gradient is measured at the checks'
steps (rows sampled), a sparse one only when Horovod sends it dense (``sparse_as_dense``, rows
counted exactly), a small embedding or a large non-embedding layer never; without the model
only sparse gradients are known as embeddings'; a failure turns this check off alone. The real
``horovodrun`` jobs are in ``tests/integration/test_gradient_runs.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import make_header

from hvtrace.format.schema import DTYPE_CODE, KIND_CODE, PARAM_PREFIX
from hvtrace.record import consistency as cons
from hvtrace.record import recorder as recmod
from hvtrace.record.recorder import Recorder

ROWS, DIM = 2000, 64  # 512,000 bytes: over ZERO_ROWS_MIN_BYTES


class _Tracer(SimpleNamespace):
    def fail(self, exc: object) -> None:
        self.failures.append(str(exc))
        self.rec.fail(str(exc))


class Net(torch.nn.Module):
    def __init__(self, sparse: bool = False, rows: int = ROWS) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, DIM, sparse=sparse)
        self.big = torch.nn.Linear(DIM, 2000)  # 512,000 bytes of weight, not an embedding


@pytest.fixture
def make(tmp_path):
    made = []

    def build(net: Net, sparse_as_dense: bool = False, model: object = "net"):
        rec = Recorder(
            tmp_path / str(len(made)), make_header(rank=0, size=1), flush_interval_s=60.0
        )
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        opt._parameter_names = {p: n for n, p in net.named_parameters()}
        opt.sparse_as_dense = sparse_as_dense
        tracer = _Tracer(
            rec=rec, dist=opt, is_cuda=False, failures=[], rows=[],
            model=net if model == "net" else model,
        )  # fmt: skip
        rec.tracer = tracer
        made.append(rec)
        return rec, tracer

    yield build
    for rec in made:
        rec.close()
    recmod._set_active(None)


def _zero_rows(rec: Recorder) -> list[tuple]:
    """(step, name, bytes, dtype, value) of the zero-row rows recorded."""
    return [
        (e[0], e[3], e[6], e[7], e[8])
        for e in rec._buf
        if type(e) is tuple and e[2] == KIND_CODE["scalar"] and e[3].startswith("hvtrace.zero_")
    ]


def _grads(net: Net, used_rows: int = 200) -> None:
    """Gradients as a batch that looked up rows 0 .. used_rows-1 leaves them (dense or sparse),
    and a dense one for the linear layer."""
    net.zero_grad()
    ids = torch.arange(used_rows)
    (net.emb(ids).sum() + net.big(torch.ones(1, DIM)).sum()).backward()


def test_a_dense_embedding_gradient_is_measured_at_the_checks(make) -> None:
    net = Net()
    rec, tracer = make(net)
    checks = cons.ConsistencyChecks(tracer, every=2)
    for step in range(5):
        _grads(net)
        checks.on_step(step)
    got = _zero_rows(rec)
    name = "hvtrace.zero_rows|dense|emb.weight"
    assert [(s, n, b, d) for s, n, b, d, _ in got] == [
        (s, name, ROWS * DIM * 4, DTYPE_CODE["float32"]) for s in (0, 2, 4)
    ]
    # 200 of 2,000 rows used: about 90 % zero among the 256 rows sampled over the table
    assert all(v == pytest.approx(0.9, abs=0.01) for *_, v in got), got
    assert checks.zero_rows is not None and checks.zero_rows.recorded == 3
    assert not tracer.failures


def test_the_share_follows_the_rows_used(make) -> None:
    net = Net()
    rec, tracer = make(net)
    checks = cons.ConsistencyChecks(tracer, every=1)
    for step, used in enumerate((ROWS, ROWS // 2, 1)):
        _grads(net, used)
        checks.on_step(step)
    shares = [v for *_, v in _zero_rows(rec)]
    assert shares[0] == 0.0 and shares[1] == pytest.approx(0.5, abs=0.01)
    assert shares[2] == pytest.approx(1.0, abs=0.005)


def test_a_sparse_gradient_is_measured_only_when_horovod_sends_it_dense(make) -> None:
    for as_dense in (False, True):
        net = Net(sparse=True)
        rec, tracer = make(net, sparse_as_dense=as_dense)
        checks = cons.ConsistencyChecks(tracer, every=1)
        net.zero_grad()
        net.emb(torch.tensor([3, 3, 7, 11])).sum().backward()  # a row looked up twice
        assert net.emb.weight.grad.is_sparse
        checks.on_step(0)
        got = _zero_rows(rec)
        if not as_dense:
            assert got == []  # Horovod allgathers its rows: no zeros sent
        else:  # counted exactly from the indices: 3 distinct rows used
            assert got == [
                (0, "hvtrace.zero_rows|sparse_as_dense|emb.weight", ROWS * DIM * 4,
                 DTYPE_CODE["float32"], pytest.approx(1 - 3 / ROWS))
            ]  # fmt: skip


def test_small_embeddings_and_unknown_models_are_left_out(make) -> None:
    small = Net(rows=100)  # 25,600 bytes
    rec, tracer = make(small)
    checks = cons.ConsistencyChecks(tracer, every=1)
    _grads(small, 10)
    checks.on_step(0)
    assert _zero_rows(rec) == []
    # without the model (hvtrace.DistributedOptimizer without model=) a dense gradient is not
    # known as an embedding's; a model found later (the stand-in's .model) is looked up then
    net = Net()
    finder = SimpleNamespace(model=None)
    rec, tracer = make(net, model=finder)
    checks = cons.ConsistencyChecks(tracer, every=1)
    _grads(net)
    checks.on_step(0)
    assert _zero_rows(rec) == []
    finder.model = net
    checks.on_step(1)
    assert [r[1] for r in _zero_rows(rec)] == ["hvtrace.zero_rows|dense|emb.weight"]


def test_a_failure_turns_this_check_off_alone(make, caplog, monkeypatch) -> None:
    net = Net()
    rec, tracer = make(net)
    checks = cons.ConsistencyChecks(tracer, every=1)

    def broken(g: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(checks.zero_rows, "share", broken)
    _grads(net)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        checks.on_step(0)
        checks.on_step(1)
    assert checks.zero_rows is None and rec.enabled and not tracer.failures
    assert sum("zero-rows check" in r.getMessage() for r in caplog.records) == 1
    # the fingerprints go on
    params = {e[0] for e in rec._buf if type(e) is tuple and str(e[3]).startswith(PARAM_PREFIX)}
    assert params == {0, 1}
