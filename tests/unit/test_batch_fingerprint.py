"""The batch fingerprint (issue 40, unsharded data), recording side.

A forward pre-hook on the traced model fingerprints the first tensor the forward receives at the
first training forward of step 0 and of every ``consistency_every``-th step, as the scalar
``hvtrace.batch|input``; equal batches give equal fingerprints, different ones differ; a failure
turns this check alone off. The hook runs on a real :class:`~hvtrace.record.recorder.Recorder`
with a stand-in tracer (as ``test_consistency_record.py``); the real ``horovodrun`` jobs are in
``tests/integration/test_antipattern_runs.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import make_header

from hvtrace.format.schema import BATCH_NAME, KIND_CODE
from hvtrace.record import consistency as cons
from hvtrace.record import recorder as recmod
from hvtrace.record.recorder import Recorder


class _Tracer(SimpleNamespace):
    def fail(self, exc: object) -> None:  # must never be called by the batch check
        self.failures.append(str(exc))


@pytest.fixture
def setup(tmp_path):
    rec = Recorder(tmp_path, make_header(rank=0, size=1), flush_interval_s=60.0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracer = _Tracer(rec=rec, dist=opt, is_cuda=False, failures=[], rows=[])
    rec.tracer = tracer
    yield rec, model, tracer
    rec.close()
    recmod._set_active(None)


def _batches(rec: Recorder) -> list[tuple[int, float]]:
    return [
        (e[0], e[8])
        for e in rec._buf
        if type(e) is tuple and e[2] == KIND_CODE["scalar"] and e[3] == BATCH_NAME
    ]


def _train(rec: Recorder, model: torch.nn.Module, xs: list[torch.Tensor], forwards: int = 1):
    """One training step per batch of ``xs`` (``forwards`` forwards each), the step number kept
    by the recorder as the tracer does; every 3rd step also runs an evaluation forward."""
    for x in xs:
        for _ in range(forwards):
            model(x).sum().backward()
        if rec.step % 3 == 0:
            with torch.no_grad():
                model(torch.zeros_like(x))
        rec.step += 1


def test_fingerprints_on_the_schedule_first_forward_only(setup) -> None:
    rec, model, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=4)
    batch = cons.make_batch_check(checks, model)
    assert batch is not None
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 8, generator=g) for _ in range(10)]
    _train(rec, model, xs, forwards=2)
    got = _batches(rec)
    assert [s for s, _ in got] == [0, 4, 8]  # step 0, then every 4; one per step
    assert len({v for _, v in got}) == 3  # different batches, different fingerprints
    assert not tracer.failures


def test_equal_batches_equal_fingerprints_and_one_element_differs(tmp_path) -> None:
    def run(xs: list[torch.Tensor], sub: str) -> list[float]:
        rec = Recorder(tmp_path / sub, make_header(rank=0, size=1), flush_interval_s=60.0)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracer = _Tracer(rec=rec, dist=opt, is_cuda=False, failures=[], rows=[])
        rec.tracer = tracer
        cons.make_batch_check(cons.ConsistencyChecks(tracer, every=1), model)
        _train(rec, model, xs)
        out = [v for _, v in _batches(rec)]
        rec.close()
        recmod._set_active(None)
        return out

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 8, generator=g) for _ in range(3)]
    a = run(xs, "a")
    b = run([x.clone() for x in xs], "b")
    assert a == b and len(a) == 3
    # a batch differing in one sampled element, or in its shape only, differs
    changed = xs[0].clone()
    pos = cons.batch_positions(changed.numel())[5]
    changed.view(-1)[pos] += 1.0
    c = run([changed, xs[1][:31], xs[2].reshape(64, 4)[:, :2].reshape(32, 4).repeat(1, 2)], "c")
    assert c[0] != a[0] and c[1] != a[1] and c[2] != a[2]
    # equal values in another shape: the shape is in the fingerprint
    assert run([xs[0]], "d") != run([xs[0].reshape(4, 8, 8)], "e")


def test_positions_spread_over_the_tensor_and_off_a_regular_grid() -> None:
    n = 32 * 28 * 28  # MNIST-like: a grid of 28-wide rows
    pos = cons.batch_positions(n)
    assert len(pos) == cons.BATCH_SAMPLES and len(set(pos)) == len(pos)
    assert pos == sorted(pos) and pos[0] >= 0 and pos[-1] < n
    assert len({p % 28 for p in pos}) > 10  # not all in one column of the images
    assert cons.batch_positions(10) == list(range(10))


def test_nested_and_keyword_inputs_are_found(setup) -> None:
    x = torch.ones(3)
    assert cons._first_tensor(((x, 1),), {}) is x
    assert cons._first_tensor((), {"input_ids": x}) is x
    assert cons._first_tensor(({"a": 1, "b": x},), None) is x
    assert cons._first_tensor((1, "s"), {}) is None


def test_a_failure_turns_this_check_off_alone_with_one_warning(setup, caplog) -> None:
    rec, model, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=1)
    batch = cons.make_batch_check(checks, model)

    def broken(step: int, x: torch.Tensor) -> None:
        raise RuntimeError("boom")

    batch.record = broken
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        _train(rec, model, [torch.randn(4, 8) for _ in range(4)])
    warnings = [r for r in caplog.records if "batch fingerprint" in r.getMessage()]
    assert len(warnings) == 1 and "boom" in warnings[0].getMessage()
    assert rec.enabled and not tracer.failures  # tracing goes on
    assert batch.handle is None and not model._forward_pre_hooks  # the hook is gone


def test_no_hook_without_a_schedule(setup) -> None:
    _rec, model, tracer = setup
    assert cons.make_batch_check(cons.ConsistencyChecks(tracer, every=0), model) is None
    assert cons.make_batch_check(None, model) is None
    assert not model._forward_pre_hooks
