"""The tracer's per-allreduce wrapper, in both forms: the compiled one (``hvtrace.record._hot``)
and the pure-Python closure (``HVTRACE_NATIVE=0``) must record the same things.

No Horovod here: a stand-in for Horovod's enqueue returns handle numbers and a stand-in poll says
which are done, so that only the wrapper's own logic is under test (the real Horovod path is in
tests/integration/test_hot_path_horovod.py, both forms; every other real job runs the compiled one).
"""

from __future__ import annotations

import itertools
import shutil
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest

from hvtrace.record import native
from hvtrace.record.optimizer import Tracer, _group_key


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch) -> str:
    if request.param == "native" and native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    monkeypatch.setenv("HVTRACE_NATIVE", "1" if request.param == "native" else "0")
    return request.param


def test_the_compiled_wrapper_is_built_where_a_compiler_is() -> None:
    """`make setup` builds it (an optional extension): on a machine with a C compiler and
    Python's headers, a missing build is a defect, not a fallback."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if shutil.which("cc") is None or not headers.exists():
        pytest.skip("no C compiler or no Python.h here")
    assert native._hot is not None


def test_a_source_tree_without_the_build_records_with_the_python_forms(tmp_path) -> None:
    """Without the compiled extension, in a checkout whose C sources' folder
    (``hvtrace/record/_hot/``) then imports as a namespace package, hvtrace imports and runs
    the Python forms (it failed at import before: the folder has none of the extension's
    types)."""
    import subprocess
    import sys

    import hvtrace

    src = Path(hvtrace.__file__).parent
    shutil.copytree(src, tmp_path / "hvtrace", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    assert (tmp_path / "hvtrace" / "record" / "_hot").is_dir()
    code = "from hvtrace.record import hot, native; print(native._hot, hot.PhasesBase.__module__)"
    res = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["None", "hvtrace.record.hot"], res.stdout


class FakeHorovod:
    """Handles 1, 2, ...; ``done`` holds the handles complete so far; every poll is logged."""

    def __init__(self, grouped: bool = False) -> None:
        self.next = 0
        self.done: set[int] = set()
        self.polls: list[int] = []
        self.grouped = grouped

    def enqueue(self, arg):
        self.next += 1
        return (self.next, "ctx") if self.grouped else self.next

    def poll(self, h: int) -> int:
        self.polls.append(h)
        return 1 if h in self.done else 0


def make_tracer(hvd: FakeHorovod, interval_ns: int = 0, clock=None):
    tr = Tracer.__new__(Tracer)
    failures: list[str] = []
    tr.rec = SimpleNamespace(enabled=True, between_steps=True)
    tr.rec.fail = lambda reason: (failures.append(reason), setattr(tr.rec, "enabled", False))
    tr.meta, tr.enqueued, tr.done, tr.poll_idx = {}, [], [], 0
    ticks = clock if clock is not None else itertools.count(1_000, 1_000)
    tr.now, tr.is_cuda, tr.in_sync = lambda: next(ticks), False, False
    tr.poll_interval_ns, tr.last_grad, tr.grad_mark = interval_ns, None, 0
    tr._poll = hvd.poll
    learned: list = []

    def learn(key, arg, out):
        learned.append(key)
        tr.meta[key] = ([], [], [])

    tr._learn = learn
    return tr, learned, failures


@pytest.mark.parametrize("interval_ns", [0, 200_000, 5_000_000])
def test_the_tracer_polls_at_most_every_interval(impl, interval_ns) -> None:
    """The wrapper looks at the in-flight allreduces on the first gradient, then only once
    ``interval_ns`` has passed since its last look (nothing completes: one poll per look)."""
    hvd = FakeHorovod()
    tr, _, _ = make_tracer(hvd, interval_ns, iter(range(0, 10_000_000, 100_000)))
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    looks: list[int] = []
    for _ in range(60):
        n = len(hvd.polls)
        enqueue(object())
        if len(hvd.polls) > n:
            looks.append(tr.enqueued[-1][0])
    assert looks[0] == 0 and len(tr.enqueued) == 60
    assert all(p == 1 for p in hvd.polls)  # always the oldest in flight, which never completes
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert all(interval_ns <= g <= interval_ns + 100_000 for g in gaps), gaps
    assert len(looks) == {0: 60, 200_000: 30, 5_000_000: 2}[interval_ns]


def run_backward(impl_name: str, grouped: bool) -> dict:
    """One step's worth of gradients, some allreduces completing between them; what the tracer
    holds afterwards, with the completion times replaced by their order."""
    hvd = FakeHorovod(grouped)
    tr, learned, failures = make_tracer(hvd)
    key_of = _group_key if grouped else id
    enqueue = tr._enqueue_wrapper(hvd.enqueue, key_of)
    grads = [[object(), object()] if grouped else object() for _ in range(6)]
    outs = []
    for i, g in enumerate(grads):
        if i == 3:
            hvd.done |= {1, 2}  # 1 and 2 finished before the 4th gradient: seen at its enqueue
        if i == 5:
            hvd.done |= {4}  # 4 done but 3 not: nothing new (oldest first)
        outs.append(enqueue(g))
    between_steps = tr.rec.between_steps
    tr.rec.between_steps = True  # written at the step's first allreduce only
    last_grad = tr._grad_end(None)  # what synchronize() closes the backward with
    tr.in_sync = True  # a late allreduce sent inside synchronize(): no gradient, no poll
    hvd.done |= {3, 5, 6}
    n_polls = len(hvd.polls)
    outs.append(enqueue(grads[0]))
    assert len(hvd.polls) == n_polls and tr.last_grad is None and tr.rec.between_steps is True
    keys = [key_of(g) for g in grads]
    times = sorted({t for _, t in tr.done})
    return {
        "outs": outs,
        "enqueued": [(t, keys.index(k), h) for t, k, h in tr.enqueued],
        "done": [(h, times.index(t)) for h, t in tr.done],
        "poll_idx": tr.poll_idx,
        "learned": [keys.index(k) for k in learned],
        "last_grad": last_grad,
        "between_steps": between_steps,
        "failures": failures,
        "polls": hvd.polls,
    }


@pytest.mark.parametrize("grouped", [False, True])
def test_both_forms_record_the_same(monkeypatch, grouped) -> None:
    """Enqueue times, keys, handles, the completions seen (oldest first, at the gradient after
    they happened), tensors learned once, the last gradient's time: the same in both forms."""
    got = {}
    for name in ("native", "python"):
        if name == "native" and native._hot is None:
            continue
        monkeypatch.setenv("HVTRACE_NATIVE", "1" if name == "native" else "0")
        got[name] = run_backward(name, grouped)
    py = got["python"]
    h = (lambda i: (i, "ctx")) if grouped else (lambda i: i)
    assert py["outs"] == [h(i) for i in range(1, 8)]
    assert py["enqueued"] == [(1000 * i, (i - 1) % 6, h(i)) for i in range(1, 7)] + [
        (7000, 0, h(7))
    ]
    assert py["done"] == [(1, 0), (2, 0)] and py["poll_idx"] == 2
    assert py["learned"] == list(range(6)) and py["last_grad"] == 6000
    assert py["between_steps"] is False and py["failures"] == []
    assert py["polls"] == [1, 1, 1, 1, 2, 3, 3, 3]
    if "native" in got:
        assert got["native"] == py


def test_a_backward_pass_ends_at_its_last_gradient(impl) -> None:
    """The wrapper keeps no time of its own: a backward pass ends at the last allreduce enqueued
    since it began, at the gradient accumulators' hooks' last call where they are installed
    (``backward_passes_per_step`` > 1), and at the boundary itself when it sent nothing."""
    hvd = FakeHorovod()
    tr, _, _ = make_tracer(hvd)
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    for _ in range(3):
        enqueue(object())  # at 1000, 2000, 3000
    assert tr._grad_end(9_000) == 3_000
    assert tr._grad_end(10_000) == 10_000  # a second pass (micro-step) that enqueued nothing
    enqueue(object())  # 4000
    tr.last_grad = 4_500  # a gradient accumulator's hook, after Horovod's
    assert tr._grad_end(11_000) == 4_500 and tr.grad_mark == 4


def test_disabled_recording_passes_straight_through(impl) -> None:
    hvd = FakeHorovod()
    tr, learned, _ = make_tracer(hvd)
    tr.rec.enabled = False
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    assert [enqueue(object()) for _ in range(3)] == [1, 2, 3]
    assert tr.enqueued == [] and learned == [] and hvd.polls == [] and tr.last_grad is None
    if impl == "native":
        assert enqueue.__wrapped__ == hvd.enqueue


def test_a_failure_after_horovod_disables_tracing_and_training_goes_on(impl) -> None:
    """An error in the bookkeeping (here learning a tensor's names) after Horovod enqueued the
    allreduce: the handle still reaches training, tracing is off with one reason, later gradients
    go straight to Horovod."""
    hvd = FakeHorovod()
    tr, _, failures = make_tracer(hvd)

    def broken(key, arg, out):
        raise KeyError("no such tensor")

    tr._learn = broken
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    assert enqueue(object()) == 1
    assert failures == ["KeyError: 'no such tensor'"] and tr.rec.enabled is False
    assert enqueue(object()) == 2 and tr.enqueued == [] and len(failures) == 1


def test_horovods_own_error_reaches_training_unchanged(impl) -> None:
    hvd = FakeHorovod()
    tr, _, failures = make_tracer(hvd)

    def refuse(arg):
        raise ValueError("Horovod has been shut down")

    enqueue = tr._enqueue_wrapper(refuse, id)
    with pytest.raises(ValueError, match="shut down"):
        enqueue(object())
    assert failures == [] and tr.rec.enabled is True and tr.enqueued == []


def test_a_poll_that_raises_disables_tracing(impl) -> None:
    """Horovod's poll raises for a handle it does not know (released behind the tracer's back):
    tracing stops with that reason; the gradient's handle still reaches training."""
    hvd = FakeHorovod()
    tr, _, failures = make_tracer(hvd)

    def poll(h):
        raise ValueError(f"Handle {h} was not created or has been cleared.")

    tr._poll = poll
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    assert enqueue(object()) == 1
    assert failures == ["ValueError: Handle 1 was not created or has been cleared."]


def test_cuda_tokens_are_never_polled(impl) -> None:
    hvd = FakeHorovod()
    tr, _, _ = make_tracer(hvd)
    tr.is_cuda = True
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    hvd.done = {1, 2, 3}
    for _ in range(3):
        enqueue(object())
    assert hvd.polls == [] and tr.done == [] and len(tr.enqueued) == 3


def test_a_poll_that_changes_the_list_under_it_does_not_crash(impl) -> None:
    """A poll that is Python code (not Horovod's) may change the tracer's list while the look
    walks it: the wrapper still returns Horovod's handle, and the process lives on (the compiled
    form reads the list's size at every entry and holds the entry it polls)."""
    hvd = FakeHorovod()
    tr, _, _ = make_tracer(hvd)

    def poll(h):
        tr.enqueued.clear()
        return 1

    tr._poll = poll
    enqueue = tr._enqueue_wrapper(hvd.enqueue, id)
    assert [enqueue(object()) for _ in range(3)] == [1, 2, 3]
