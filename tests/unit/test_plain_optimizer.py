"""A plain torch optimizer traced (issue 40, manual gradient averaging), recording side.

- :class:`hvtrace.record.plain.PlainSteps` on a tracer over a real model and a real ``SGD``:
  torch's step hooks close each step as the tracer's step hook does for Horovod's optimizer
  (input, forward, backward, update, step, in order), the backward ends where it returns (so
  an allreduce the job issues after it falls after it), steps are counted; the optimizer's
  ``step`` is not replaced (an LR scheduler built on it afterwards works); the hooks are removed
  with the tracer's.
- :func:`hvtrace.autotrace.patch_plain` on a stand-in ``horovod.torch``: the broadcasts note the
  optimizer or parameters; the first plain optimizer that holds them and finishes a step is
  traced once (not Horovod's optimizer, not the step ``broadcast_optimizer_state`` takes inside),
  and torch's global hook is removed outside its iteration.

The real ``horovodrun`` jobs are in ``tests/integration/test_gradient_runs.py``.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.optim import optimizer as torch_optimizer

from hvtrace import autotrace
from hvtrace.format.schema import KIND_CODE
from hvtrace.record import plain, torchpatch
from hvtrace.record.optimizer import Tracer

KIND_NAME = {v: k for k, v in KIND_CODE.items()}


class FakeRec:
    def __init__(self) -> None:
        self.enabled, self.step, self.micro, self.between_steps = True, 0, 0, True
        self.entries: list[list] = []
        self.failures: list[str] = []

    def extend(self, entries: list) -> None:
        self.entries.append(list(entries))

    def fail(self, reason: str) -> None:
        self.failures.append(reason)
        self.enabled = False


def _tracer(model: torch.nn.Module) -> Tracer:
    """A tracer over ``model`` (scripted clock and counters), as ``test_phases.py`` builds one."""
    tr = Tracer.__new__(Tracer)
    ticks, reads = itertools.count(1_000, 1_000), itertools.count(1)
    tr.now, tr.read, tr.rec = (lambda: next(ticks)), (lambda: ("c", next(reads))), FakeRec()
    tr.flags, tr.ar_flags, tr.is_cuda, tr.has_model = 0, 0, False, True
    tr._grad_enabled = torch.is_grad_enabled
    tr.meta, tr.rows, tr.done_rows, tr.steps_done = {}, [], [], 0
    tr._sample_counters(0)
    tr._clear_step()
    tr.step_start, tr.step_cpu = tr.now(), tr.read()
    tr.checks = tr.live = None
    tr._hooks = []
    tr._hook_model(model)  # as Tracer._install does with model=
    return tr


@pytest.fixture
def job(monkeypatch):
    monkeypatch.setattr(torchpatch, "observers", ())
    monkeypatch.setattr(torchpatch, "returns", ())
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tr = _tracer(model)
    torchpatch.observe(tr)  # the backward's call (what _install does with a model)
    first: list[int] = []
    steps = plain.install(tr, opt, first=lambda: first.append(1))
    return SimpleNamespace(model=model, opt=opt, tr=tr, steps=steps, first=first)


def _train_step(j: SimpleNamespace) -> int:
    """One step of a job that averages by hand: forward, backward, then (what an allreduce after
    the backward would be) a time taken, then the optimizer's step. Returns that time."""
    j.opt.zero_grad()
    j.model(torch.randn(4, 3)).sum().backward()
    after_backward = j.tr.now()
    j.opt.step()
    return after_backward


def _spans(entries: list) -> list[tuple[str, Any, Any]]:
    return [(KIND_NAME[e[2]], e[4], e[5]) for e in entries if type(e) is tuple]


def test_each_step_is_closed_by_torchs_step_hooks(job) -> None:
    marks = [_train_step(job) for _ in range(3)]
    rec = job.tr.rec
    assert rec.step == 3 and job.tr.steps_done == 3 and not rec.failures
    assert len(rec.entries) == 3 and job.first == [1]  # called once, at the first step
    for entries, mark in zip(rec.entries, marks, strict=True):
        spans = _spans(entries)
        assert [k for k, _, _ in spans] == ["input", "forward", "backward", "update", "step"]
        by = {k: (s, e) for k, s, e in spans}
        # the backward ends where it returned: before the allreduce issued after it
        assert by["backward"][1] < mark < by["update"][0]
        assert by["input"][0] == by["step"][0] and by["update"][1] == by["step"][1]


def test_the_optimizers_step_is_not_replaced(job) -> None:
    assert "step" not in vars(job.opt)  # torch's own method: its hooks call the tracer
    sched = torch.optim.lr_scheduler.StepLR(job.opt, step_size=1, gamma=0.5)
    for _ in range(2):
        _train_step(job)
        sched.step()
    assert job.opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert job.tr.rec.step == 2 and job.opt._hvtrace is job.tr


def test_the_hooks_go_with_the_tracers(job) -> None:
    _train_step(job)
    for h in job.tr._hooks:
        h.remove()
    assert torchpatch.returns == ()
    _train_step(job)
    assert job.tr.rec.step == 1  # no longer counted


def test_while_recording_is_off_steps_are_still_counted(job) -> None:
    job.tr.rec.enabled = False
    _train_step(job)
    assert job.tr.steps_done == 1 and job.tr.rec.entries == []


# -- which optimizer, when: the broadcasts and torch's global step hook ----------------------------
class FakeHvd(SimpleNamespace):
    """``horovod.torch``'s two broadcasts: ``broadcast_optimizer_state`` steps the optimizer
    once to initialize its state, as Horovod's does for a new one."""


@pytest.fixture
def watched(monkeypatch):
    monkeypatch.setattr(autotrace, "_plain", autotrace._Plain())
    calls: list[tuple[Any, dict]] = []
    monkeypatch.setattr(autotrace, "attach_plain", lambda opt, names: calls.append((opt, names)))

    def state(optimizer: Any, root_rank: int) -> None:
        optimizer.step()

    hvd = FakeHvd(broadcast_optimizer_state=state, broadcast_parameters=lambda p, root_rank: None)
    autotrace.patch_plain(hvd)
    yield hvd, calls
    hook = autotrace._plain.hook
    if hook is not None:
        hook.remove()


def _hooked() -> bool:
    return autotrace._first_step in torch_optimizer._global_optimizer_post_hooks.values()


def test_the_optimizer_holding_the_broadcast_parameters_is_traced_at_its_first_step(watched):
    hvd, calls = watched
    model = torch.nn.Linear(3, 2)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    assert _hooked() and calls == []
    other.step()  # holds none of them
    assert calls == []
    opt.step()
    assert len(calls) == 1 and calls[0][0] is opt
    assert sorted(calls[0][1].values()) == ["bias", "weight"]  # the names the broadcast gave
    opt.step()
    assert len(calls) == 1  # once
    assert _hooked()  # not removed inside torch's iteration of the hooks ...
    autotrace.remove_hook()  # ... but at the next safe point
    assert not _hooked()


def test_a_broadcast_optimizer_is_traced_after_the_broadcast_not_inside(watched):
    hvd, calls = watched
    opt = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # steps it inside
    assert calls == []
    opt.step()
    assert [c[0] for c in calls] == [opt]


def test_horovods_optimizer_is_never_traced_as_a_plain_one(watched):
    hvd, calls = watched
    model = torch.nn.Linear(3, 2)
    dist = torch.optim.SGD(model.parameters(), lr=0.1)
    dist._allreduce_grad_async = lambda p: None  # what makes it Horovod's
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(dist, root_rank=0)
    dist.step()
    assert calls == [] and dist not in autotrace._plain.optimizers


def test_a_traced_model_is_copied_and_saved_whole_without_the_tracer(job, tmp_path) -> None:
    """``copy.deepcopy(model)`` (an EMA, ``swa_utils.AveragedModel``) and ``torch.save(model)``
    work on a traced model as on an untraced one (they raised ``TypeError: cannot pickle
    'Tracer' object``): the copy's hooks are inert, record nothing, and a model saved whole loads
    in a process where hvtrace cannot be imported."""
    import copy
    import subprocess
    import sys

    _train_step(job)
    averaged = torch.optim.swa_utils.AveragedModel(job.model)  # deep-copies the model
    twin = copy.deepcopy(job.model)
    tr, x = job.tr, torch.randn(4, 3)
    state = (tr.fwd_count, tr.fwd_start, list(tr.rows), tr.rec.step)
    outs = [m(x) for m in (twin, averaged)]  # with grad on: a traced forward would open a phase
    assert (tr.fwd_count, tr.fwd_start, list(tr.rows), tr.rec.step) == state
    with torch.no_grad():
        assert all(torch.equal(y, job.model(x)) for y in outs)  # the same weights
    path = tmp_path / "model.pt"
    torch.save(job.model, path)
    load = (
        "import sys; sys.modules['hvtrace'] = None\n"  # import hvtrace fails here
        "import torch\n"
        f"m = torch.load({str(path)!r}, weights_only=False)\n"
        "print(tuple(m(torch.randn(4, 3)).shape))"
    )
    p = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "(4, 2)", p.stderr[-2000:]
    _train_step(job)  # the traced model goes on being traced
    assert job.tr.rec.step == 2 and not job.tr.rec.failures
