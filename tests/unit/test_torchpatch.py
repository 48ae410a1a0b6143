"""Where a backward pass begins: PyTorch's ``torch.autograd.backward``, wrapped once
(:mod:`hvtrace.record.torchpatch`), tells the tracers with ``model=``; each keeps the first call
after its own recorded forward. Real autograd here; the tracer's other state is set by hand
(the real optimizer path, with horovodrun, is in tests/integration/test_record_horovod.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from hvtrace.record import torchpatch  # noqa: E402
from hvtrace.record.optimizer import Tracer  # noqa: E402


@pytest.fixture
def observer(monkeypatch):
    """A stand-in observer that logs each call; removed after the test."""
    torchpatch.patch_backward()
    calls: list[str] = []
    obs = SimpleNamespace(_backward_called=lambda: calls.append("called"), fail=calls.append)
    monkeypatch.setattr(torchpatch, "observers", ())
    torchpatch.observe(obs)
    return obs, calls


def test_loss_backward_goes_through_the_wrapper(observer) -> None:
    """``Tensor.backward`` calls ``torch.autograd.backward`` by its module attribute: each
    backward pass is seen once, before autograd runs, and the gradients are PyTorch's."""
    _, calls = observer
    w = torch.ones(3, requires_grad=True)
    (w * 2).sum().backward()
    assert calls == ["called"]
    torch.autograd.backward([(w * 3).sum()], retain_graph=False)
    assert calls == ["called", "called"]
    assert w.grad.tolist() == [5.0, 5.0, 5.0]
    assert torch.autograd.backward.__wrapped__ is not None
    torchpatch.patch_backward()  # idempotent: still one wrapper
    assert not hasattr(torch.autograd.backward.__wrapped__, "__wrapped__")


def test_a_failing_observer_disables_tracing_and_the_backward_runs(observer) -> None:
    obs, calls = observer

    def boom() -> None:
        raise RuntimeError("inside hvtrace")

    obs._backward_called = boom
    w = torch.ones(2, requires_grad=True)
    (w * 4).sum().backward()
    assert w.grad.tolist() == [4.0, 4.0]
    assert len(calls) == 1 and "inside hvtrace" in str(calls[0])


def test_pytorchs_own_error_reaches_training_unchanged(observer) -> None:
    _, calls = observer
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.ones(2).sum().backward()
    assert calls == ["called"]


def test_no_observer_no_call(monkeypatch) -> None:
    torchpatch.patch_backward()
    monkeypatch.setattr(torchpatch, "observers", ())
    w = torch.ones(2, requires_grad=True)
    (w * 1).sum().backward()
    assert w.grad.tolist() == [1.0, 1.0]


def _tracer(ticks=None) -> Tracer:
    tr = Tracer.__new__(Tracer)
    ticks = ticks if ticks is not None else itertools.count(1_000, 1_000)
    tr.now = lambda: next(ticks)
    tr.bwd_start, tr.fwd_start, tr.fwd_count = None, None, 0
    return tr


def test_the_first_backward_after_a_forward_begins_the_pass() -> None:
    """Before any forward of the step: not a backward phase. During a forward (``fwd_start``
    set): not one either. After it: the first call, and only the first (gradient checkpointing
    calls backward again inside the pass)."""
    tr = _tracer()
    tr._backward_called()
    assert tr.bwd_start is None  # no forward yet in this step
    tr.fwd_start = 1
    tr._backward_called()
    assert tr.bwd_start is None  # inside the forward
    tr.fwd_start, tr.fwd_count = None, 1
    tr._backward_called()
    first = tr.bwd_start
    assert first is not None
    tr._backward_called()
    assert tr.bwd_start == first


def test_two_tracers_each_time_the_backward_after_their_own_forward(monkeypatch) -> None:
    """Two traced optimizers with ``model=`` (a GAN's): each is told of every backward call and
    keeps the one after its own model's forward; after its finish it is told nothing more."""
    monkeypatch.setattr(torchpatch, "observers", ())
    clock = itertools.count(1_000, 1_000)  # one clock for both
    gen, disc = _tracer(clock), _tracer(clock)
    torchpatch.observe(gen)
    torchpatch.observe(disc)
    torchpatch.observe(disc)  # once only
    assert torchpatch.observers == (gen, disc)
    w = torch.ones(2, requires_grad=True)
    disc.fwd_count = 1  # the discriminator's forward ran
    (w * 2).sum().backward()
    assert disc.bwd_start is not None and gen.bwd_start is None
    gen.fwd_count = 1  # then the generator's
    (w * 2).sum().backward()
    assert gen.bwd_start is not None and gen.bwd_start > disc.bwd_start
    torchpatch.unobserve(disc)
    assert torchpatch.observers == (gen,)
