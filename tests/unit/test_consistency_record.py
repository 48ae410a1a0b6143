"""Consistency across ranks, recording side: fingerprints and the per-step checks.

The checks run on a real :class:`~hvtrace.record.recorder.Recorder` writing a real file; the
tracer around it is a small stand-in holding a plain torch optimizer (no Horovod here: the runs
with ``horovodrun`` are in ``tests/integration/test_consistency_runs.py``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import make_header

from hvtrace.format.schema import FLAG_AGREE, KIND_CODE
from hvtrace.record import consistency as cons
from hvtrace.record import recorder as recmod
from hvtrace.record.recorder import Recorder


def _bump(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first element moved to the next representable value (1 ulp)."""
    out = t.clone()
    flat = out.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=t.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fingerprints_are_equal_for_equal_bits_and_differ_for_one_ulp(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(257, 33, generator=g).to(dtype)
    same = t.clone()
    for fp in (cons.fingerprint_bytes, lambda x: float(cons.fingerprint_device([x])[0])):
        assert fp(t) == fp(same)
        assert fp(t) != fp(_bump(t))
        v = fp(t)
        assert v == int(v) and 0 <= v < 2**52  # exact as a float64


def test_fingerprints_of_a_non_contiguous_tensor_are_those_of_its_values() -> None:
    t = torch.randn(64, 32)
    assert cons.fingerprint_bytes(t.t()) == cons.fingerprint_bytes(t.t().contiguous())
    dev = cons.fingerprint_device([t.t(), t.t().contiguous()])
    assert int(dev[0]) == int(dev[1])


def test_device_fingerprint_sees_a_swap_of_two_elements() -> None:
    t = torch.arange(10, dtype=torch.float32)
    s = t.clone()
    s[[2, 7]] = s[[7, 2]]
    fps = cons.fingerprint_device([t, s, torch.zeros(1), torch.zeros(0)])
    assert int(fps[0]) != int(fps[1])


class _Tracer(SimpleNamespace):
    """What the checks use of a tracer: ``rec``, ``dist`` (param_groups, _parameter_names),
    ``is_cuda``, ``rows`` (the step's spans, where the learning rates go) and ``fail``."""

    def fail(self, exc: object) -> None:
        self.failures.append(str(exc))
        self.rec.fail(str(exc))


@pytest.fixture
def setup(tmp_path):
    header = make_header(rank=0, size=1)
    rec = Recorder(tmp_path, header, flush_interval_s=60.0)  # the buffer stays to be read
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(
        [
            {"params": list(model[0].parameters()), "lr": 0.1},
            {"params": list(model[1].parameters()), "lr": 0.2},
        ]
    )
    opt._parameter_names = {p: n for n, p in model.named_parameters()}
    tracer = _Tracer(rec=rec, dist=opt, is_cuda=False, failures=[], rows=[])
    rec.tracer = tracer  # (what _rows reads the step's rows from)
    yield rec, model, opt, tracer
    rec.close()
    recmod._set_active(None)


def _rows(rec: Recorder) -> list[tuple]:
    """The scalar rows recorded: in the recorder's buffer, and the learning rates still among
    the tracer's rows of the step (handed over at the step's end)."""
    rows = [*rec._buf, *rec.tracer.rows]
    return sorted(
        (e for e in rows if type(e) is tuple and e[2] == KIND_CODE["scalar"]), key=lambda e: e[0]
    )


@pytest.mark.parametrize("device", [False, True])
def test_checks_record_lrs_every_step_and_fingerprints_every_n(setup, device) -> None:
    rec, model, _opt, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=2, device=device)
    for step in range(5):
        checks.on_step(step)
    checks.close()
    rows = _rows(rec)
    lrs = [(r[0], r[3], r[8]) for r in rows if r[3].startswith(cons.LR_PREFIX)]
    assert lrs == [(s, f"hvtrace.lr|{g}", 0.1 * (g + 1)) for s in range(5) for g in range(2)]
    params = [(r[0], r[3]) for r in rows if r[3].startswith(cons.PARAM_PREFIX)]
    names = [f"hvtrace.param|{n}" for n, _ in model.named_parameters()]
    assert sorted(params) == sorted((s, n) for s in (0, 2, 4) for n in names)
    # the fingerprint of each tensor is the same at each check (nothing changed the weights)
    fps = {}
    for r in rows:
        if r[3].startswith(cons.PARAM_PREFIX):
            fps.setdefault(r[3], set()).add(r[8])
    assert all(len(v) == 1 for v in fps.values()), fps
    assert checks.checks == 3 and not tracer.failures
    spans = [e for e in rec._buf if type(e) is tuple and e[3] == cons.CHECK_SPAN]
    assert [e[0] for e in spans] == [0, 2, 4]


def test_a_changed_weight_changes_only_its_fingerprint(setup) -> None:
    rec, model, _opt, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=1)
    checks.on_step(0)
    with torch.no_grad():
        model[1].weight.view(-1)[0] += 1e-3
    checks.on_step(1)
    by = {}
    for r in _rows(rec):
        if r[3].startswith(cons.PARAM_PREFIX):
            by.setdefault(r[3], []).append(r[8])
    changed = [n for n, (a, b) in by.items() if a != b]
    assert changed == ["hvtrace.param|1.weight"]


def test_every_zero_records_learning_rates_only(setup) -> None:
    rec, _model, _opt, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=0)
    checks.on_step(0)
    assert {r[3] for r in _rows(rec)} == {"hvtrace.lr|0", "hvtrace.lr|1"}


def test_a_failure_disables_tracing_with_one_warning_and_never_raises(setup) -> None:
    rec, _model, opt, tracer = setup
    checks = cons.ConsistencyChecks(tracer, every=1)
    opt.param_groups[0]["lr"] = object()  # not a number
    checks.on_step(0)  # no exception
    assert len(tracer.failures) == 1 and "consistency" in tracer.failures[0]
    assert not rec.enabled
    checks.on_step(1)  # disabled: nothing, no second failure
    assert len(tracer.failures) == 1


def test_scalar_agree_sets_the_flag(setup) -> None:
    rec, *_ = setup
    recmod._set_active(rec)
    recmod.scalar("epoch", 3, agree=True)
    recmod.scalar("loss", 0.5)
    flags = {r[3]: r[9] for r in _rows(rec)}
    assert flags == {"epoch": FLAG_AGREE, "loss": 0}


@pytest.mark.gpu
def test_cuda_checks_are_read_back_lazily_and_equal_the_cpu_device_method(setup) -> None:
    """On a GPU the fingerprints are launched on the device and written when their event is
    done; they equal the same computation on the CPU (integer sums: order-independent)."""
    rec, model, _opt, tracer = setup
    model.cuda()
    tracer.is_cuda = True
    checks = cons.ConsistencyChecks(tracer, every=1)
    checks.on_step(0)
    checks.on_step(1)
    checks.close()
    assert not checks.pending and not tracer.failures
    got = {}
    for r in _rows(rec):
        if r[3].startswith(cons.PARAM_PREFIX):
            got.setdefault(r[0], {})[r[3]] = r[8]
    cpu = {
        f"{cons.PARAM_PREFIX}{n}": float(cons.fingerprint_device([p.detach().cpu()])[0])
        for n, p in model.named_parameters()
    }
    assert got == {0: cpu, 1: cpu}
