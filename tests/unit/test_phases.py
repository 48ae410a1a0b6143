"""The tracer's per-step hooks in both forms: the compiled ones (``hvtrace.record._hot.Phases``:
``c_fwd_pre``, ``c_fwd_post``, ``c_synchronize``, ``c_step``) and the Python methods
(``HVTRACE_NATIVE=0``) must record the same spans, in the same order, with the same state after.

No Horovod here: a real torch model with the hooks registered on it, the tracer's real enqueue
wrapper around a stand-in for Horovod's enqueue, and stand-ins for Horovod's ``synchronize``
(notes each handle done, as hvtrace's module patch does) and ``step`` (synchronizes first unless
told not to, as Horovod's does). The timer and the counter readings are scripted, so that both
forms see the same tokens; the wait span's own times are the host clock's and are compared by
order only. The real Horovod path runs in tests/integration (the compiled hooks by default,
``test_hot_path_horovod.py`` both forms).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

from hvtrace.format.schema import FLAG_END_UPPER_BOUND, KIND_CODE, LR_PREFIX, PARAM_PREFIX
from hvtrace.record import hot, hvdpatch, native
from hvtrace.record import optimizer as opt
from hvtrace.record.consistency import ConsistencyChecks
from hvtrace.record.optimizer import Tracer
from hvtrace.record.rows import Allreduces

KIND_NAME = {v: k for k, v in KIND_CODE.items()}
#: Host-clock times (the wait span's, synchronize's exit) are above this; scripted ones below.
HOST_NS = 10**10


class FakeRec:
    """The recorder's attributes the hot path reads and writes, and what it was handed."""

    def __init__(self) -> None:
        self.enabled, self.step, self.micro, self.between_steps = True, 0, 0, True
        self.entries: list[list] = []
        self.added: list[tuple] = []  # Recorder.add's rows (the consistency fingerprints)
        self.failures: list[str] = []

    def add(self, *args: Any, **kw: Any) -> None:
        self.added.append((*args, *sorted(kw.items())))

    def extend(self, entries: list) -> None:
        self.entries.append(list(entries))

    def fail(self, reason: str) -> None:
        self.failures.append(reason)
        self.enabled = False


class Job:
    """One traced optimizer over a real ``Linear`` model, driven step by step."""

    def __init__(
        self,
        model: bool = True,
        fail_read_at: int | None = None,
        cuda: bool = False,
        checks_every: int | None = None,
        counters_gap_ns: int = 0,
    ) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.params = list(self.model.parameters())
        self.x = torch.randn(4, 3)
        self.handles = itertools.count(1)
        self.sync_calls = 0
        self.observer_seen: list[Any] = []
        self.skip_sync = False
        tr = self.tr = Tracer.__new__(Tracer)
        ticks, reads = itertools.count(1_000, 1_000), itertools.count(1)

        def read() -> tuple[str, int]:
            n = next(reads)
            if n == fail_read_at:
                raise OSError("schedstat went away")
            return ("c", n)

        # CUDA timers: tokens are events (here tuples), resolved later by the writer
        now = (lambda: ("event", next(ticks))) if cuda else (lambda: next(ticks))
        tr.now, tr.read, tr.rec = now, read, FakeRec()
        tr.flags, tr.ar_flags, tr.is_cuda, tr.has_model = 0, FLAG_END_UPPER_BOUND, cuda, model
        tr._grad_enabled = torch.is_grad_enabled
        tr.meta, tr.rows, tr.done_rows, tr.steps_done = {}, [], [], 0
        tr._sample_counters(counters_gap_ns)
        tr._clear_step()
        tr.poll_interval_ns, tr._poll = 0, (lambda h: 0)  # nothing completes before the wait
        tr.step_start, tr.step_cpu = tr.now(), tr.read()
        tr.checks = tr.live = None
        tr._orig_sync, tr._orig_step = self._horovod_sync, self._horovod_step
        tr._learn = lambda key, arg, out: tr.meta.__setitem__(key, (["p"], [4], [1]))
        if checks_every is not None:  # real consistency checks over two param groups
            w, b = self.params
            tr.dist = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.25}], lr=0.125)
            tr.checks = ConsistencyChecks(tr, checks_every, device=False)
        self.hooks = tr.hooks()
        self.enqueue = tr._enqueue_wrapper(lambda arg: next(self.handles), id)
        if model:
            self.model.register_forward_pre_hook(self.hooks["fwd_pre"])
            self.model.register_forward_hook(self.hooks["fwd_post"])

    def _horovod_sync(self) -> None:
        self.sync_calls += 1
        self.observer_seen.append(hvdpatch.observer is self.tr)
        for _t, _key, h in list(self.tr.enqueued):
            if hvdpatch.observer is not None:
                hvdpatch.observer.done.append((h, 7))

    def _horovod_step(self, closure: Any = None) -> str:
        if not self.skip_sync:
            self.hooks["synchronize"]()
        return f"stepped {closure is not None}"

    def forward_backward(self) -> None:
        loss = self.model(self.x).sum()
        self.tr._backward_called()  # what the torch.autograd.backward wrapper tells it
        loss.backward()
        for p in self.params:  # Horovod's gradient hooks enqueue one allreduce each
            self.enqueue(p)

    def step(self, **kw: Any) -> Any:
        return self.hooks["step"](**kw)


def _norm(x: Any) -> Any:
    """Host-clock ints become 'T' (both forms read the clock at different moments)."""
    if isinstance(x, Allreduces):
        return ("Allreduces", _norm(tuple(x[:6])), sorted(map(str, x.meta)) and len(x.meta))
    if isinstance(x, (tuple, list)):
        return type(x)(_norm(v) for v in x)
    if isinstance(x, int) and not isinstance(x, bool) and x > HOST_NS:
        return "T"
    if isinstance(x, float) and x != x:
        return "nan"
    return x


def _transcript(job: Job) -> dict[str, Any]:
    tr, rec = job.tr, job.tr.rec
    return {
        "entries": _norm(rec.entries),
        "added": _norm(rec.added),
        "rows": _norm(tr.rows),
        "step": rec.step,
        "micro": rec.micro,
        "between_steps": rec.between_steps,
        "failures": rec.failures,
        "steps_done": tr.steps_done,
        "state": _norm(
            (tr.step_start, tr.step_cpu, tr.fwd_start, tr.bwd_start, tr.sync_exit, tr.last_grad)
        ),
        "flags": (tr.fwd_count, tr.compute_closed, tr.in_sync, tr.poll_idx, tr.grad_mark),
        "sync_calls": job.sync_calls,
        "observer_seen": job.observer_seen,
        "observer_after": hvdpatch.observer,
    }


def _scenario(name: str) -> dict[str, Any]:
    """Run one scenario to its end; return its transcript and the step() results."""
    job = Job(
        model=name != "no_model",
        fail_read_at=9 if name == "fail_read" else None,
        cuda=name == "cuda",
        checks_every=3 if name == "checks" else None,
    )
    if name == "disabled":
        job.tr.rec.enabled = False
    out = []
    for i in range(3):
        if name == "micro":  # backward_passes_per_step=2: two forward/backward before the step
            job.forward_backward()
        if name == "eval" and i == 1:
            with torch.no_grad():
                job.model(job.x)  # an evaluation forward between steps: no phase
        if name == "checks" and i == 1:  # a new learning rate (a float)
            job.tr.dist.param_groups[0]["lr"] = 0.5
        if name == "checks" and i == 2:  # an int learning rate: not the compiled case
            job.tr.dist.param_groups[1]["lr"] = 2
        job.forward_backward()
        if name == "sync_then_skip":  # synchronize(); clip; with skip_synchronize(): step()
            job.hooks["synchronize"]()
            job.skip_sync = True
        if name == "no_sync":  # Adasum-like: the step never synchronizes
            job.skip_sync = True
        out.append(job.step(closure=(lambda: 0)) if name == "closure" else job.step())
        job.skip_sync = False
    return {"transcript": _transcript(job), "out": out}


SCENARIOS = [
    "plain",
    "micro",
    "eval",
    "sync_then_skip",
    "no_sync",
    "no_model",
    "disabled",
    "fail_read",
    "closure",
    "cuda",
    "checks",
]


@pytest.fixture
def both(monkeypatch):
    """Run a scenario with the compiled hooks, then with the Python ones."""
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")

    def run(name: str) -> tuple[dict, dict]:
        res = {}
        for form in ("1", "0"):
            monkeypatch.setenv("HVTRACE_NATIVE", form)
            res[form] = _scenario(name)
        return res["1"], res["0"]

    return run


def test_the_compiled_hooks_are_installed_unless_native_is_off(monkeypatch) -> None:
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    hooks = Job(model=False).hooks
    assert type(hooks["step"]).__name__ == "builtin_function_or_method"
    assert hooks["fwd_pre"].__name__ == "c_fwd_pre"
    monkeypatch.setenv("HVTRACE_NATIVE", "0")
    assert Job(model=False).hooks["synchronize"].__name__ == "_synchronize"


@pytest.mark.parametrize("name", SCENARIOS)
def test_both_forms_record_the_same(both, name) -> None:
    compiled, python = both(name)
    assert compiled == python


def test_short_steps_read_the_counters_on_the_steps_a_power_of_two_divides(monkeypatch) -> None:
    """With steps much shorter than ``counter_gap_ns``, both forms read the counters on every
    step until the second review (step 128), then on one step in 64 (the steps whose number 64
    divides: the same on every rank); a step between them has no span with both readings and
    makes no reading but those that border a reading step. Both record the same."""
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    res = {}
    for form in ("1", "0"):
        monkeypatch.setenv("HVTRACE_NATIVE", form)
        job = Job(counters_gap_ns=10**15)
        reads = []
        read = job.tr.read

        def counted(read: Any = read, reads: list = reads, rec: Any = job.tr.rec) -> Any:
            reads.append(rec.step)
            return read()

        job.tr.read = counted
        for _ in range(260):
            job.forward_backward()
            job.step()
        read_steps = {
            i
            for i, step in enumerate(job.tr.rec.entries)
            if all(e[10] is not None and e[11] is not None for e in step if type(e) is tuple)
        }
        assert read_steps == set(range(129)) | {192, 256}, form
        assert job.tr.counter_every == 64
        # between reading steps: only the step end before a reading step reads (its start)
        assert [s for s in reads if s > 128 and s % 64] == [191, 255], form
        res[form] = _transcript(job)
    assert res["1"] == res["0"]


def test_a_counter_gap_of_0_reads_them_on_every_step(both) -> None:
    compiled, _ = both("plain")  # (Job's default: counters_gap_ns=0)
    for step in compiled["transcript"]["entries"]:
        spans = [e for e in step if e[0] != "Allreduces"]
        assert spans and all(e[10] is not None and e[11] is not None for e in spans)


def _kinds(entries: list) -> list[list[str]]:
    return [[e[0] if isinstance(e[0], str) else KIND_NAME[e[2]] for e in step] for step in entries]


def test_a_step_with_a_model_has_its_phases_in_order(both) -> None:
    """What is recorded, not only that both forms agree: per step input, forward, backward, the
    wait and its allreduces, update, step; the phases tile the step (each starts where the one
    before ended, except the wait, timed by the host clock)."""
    compiled, _ = both("plain")
    t = compiled["transcript"]
    expect = ["input", "forward", "backward", "wait", "Allreduces", "update", "step"]
    assert _kinds(t["entries"]) == [expect] * 3
    assert t["step"] == 3 and t["steps_done"] == 3 and t["failures"] == []
    assert t["sync_calls"] == 3 and t["observer_seen"] == [True] * 3
    assert t["observer_after"] is None and t["between_steps"] is True
    first = t["entries"][0]
    inp, fwd, bwd, wait, ar, upd, step = first
    assert inp[4] == 1_000 and inp[5] == fwd[4] and fwd[5] < bwd[4]  # backward() after the loss
    assert bwd[5] == "T" or bwd[5] > bwd[4]  # the last gradient's enqueue
    assert wait[3] == "synchronize" and wait[4] == wait[5] == "T" and wait[9] == 0
    assert ar[1][2] == FLAG_END_UPPER_BOUND and len(ar[1][3]) == 2  # two tensors enqueued
    assert upd[4] == "T" and step[4] == 1_000 and step[5] == upd[5]  # update from sync's exit
    # the counter readings tile the step: each phase's start reading is the last one's end
    readings = [inp[10], inp[11], fwd[11], bwd[11], wait[11], upd[11]]
    assert readings == [("c", 1), ("c", 2), ("c", 3), ("c", 4), ("c", 5), ("c", 6)]
    assert step[10:] == (("c", 1), ("c", 6)) and compiled["out"] == ["stepped False"] * 3


def test_micro_steps_and_the_skip_pattern(both) -> None:
    micro, _ = both("micro")
    kinds = _kinds(micro["transcript"]["entries"])
    assert kinds[0][:5] == ["input", "forward", "backward", "forward", "backward"]
    assert [r[1] for r in micro["transcript"]["entries"][0][3:5]] == [1, 1]  # micro-step 1
    skip, _ = both("sync_then_skip")
    assert skip["transcript"]["sync_calls"] == 3
    assert _kinds(skip["transcript"]["entries"])[0][-2:] == ["update", "step"]
    nosync, _ = both("no_sync")
    kinds = _kinds(nosync["transcript"]["entries"])
    assert kinds == [["input", "forward", "backward", "update", "step"]] * 3
    assert nosync["transcript"]["sync_calls"] == 0


def test_without_a_model_compute_is_one_phase(both) -> None:
    compiled, _ = both("no_model")
    assert (
        _kinds(compiled["transcript"]["entries"])
        == [["compute", "wait", "Allreduces", "update", "step"]] * 3
    )


def test_an_evaluation_forward_is_no_phase(both) -> None:
    compiled, _ = both("eval")
    kinds = _kinds(compiled["transcript"]["entries"])
    assert kinds[1] == ["input", "forward", "backward", "wait", "Allreduces", "update", "step"]


def test_disabled_recording_still_counts_steps(both) -> None:
    compiled, _ = both("disabled")
    t = compiled["transcript"]
    assert t["entries"] == [] and t["steps_done"] == 3 and t["step"] == 0
    assert t["sync_calls"] == 3 and compiled["out"] == ["stepped False"] * 3


def test_a_failure_inside_disables_tracing_and_training_goes_on(both) -> None:
    """The 9th counter reading raises (in the second step's forward): one failure, naming the
    error; the steps all run and return Horovod's result; what was recorded before stays."""
    compiled, _ = both("fail_read")
    t = compiled["transcript"]
    assert t["failures"] == ["OSError: schedstat went away"]
    assert compiled["out"] == ["stepped False"] * 3 and t["steps_done"] == 3
    assert len(t["entries"]) == 1 and t["sync_calls"] == 3


def test_with_cuda_timers_the_phases_end_at_events(both) -> None:
    """CUDA timers (written, not run on a GPU here): the phase boundaries are the timer's
    tokens (events), synchronize's exit too (the update starts there); the wait span keeps the
    host clock; no polling (the enqueue wrapper gets no poll)."""
    compiled, _ = both("cuda")
    t = compiled["transcript"]
    assert (
        _kinds(t["entries"])
        == [["input", "forward", "backward", "wait", "Allreduces", "update", "step"]] * 3
    )
    inp, fwd, bwd, wait, ar, upd, step = t["entries"][1]
    assert step[4] == inp[4] and step[5] == upd[5]
    assert inp[4][0] == "event" and fwd[5][0] == "event" and bwd[4][0] == "event"
    assert wait[4] == wait[5] == "T"  # the wait: host clock
    assert upd[4][0] == "event" and ar[1][5] == upd[4]  # the allreduces end at sync's exit event


def test_step_passes_the_closure(both) -> None:
    compiled, _ = both("closure")
    assert compiled["out"] == ["stepped True"] * 3


def _is_lr(entry: Any) -> bool:
    return len(entry) == 10 and entry[2] == KIND_CODE["scalar"] and entry[3].startswith(LR_PREFIX)


def test_the_learning_rate_rows_join_each_step_and_fingerprints_every_n(both) -> None:
    """Per step one learning-rate row per param group among the step's spans (the value as of
    that step), and the parameters' fingerprints every 3rd step; the same in both forms."""
    compiled, _ = both("checks")
    entries, added = compiled["transcript"]["entries"], compiled["transcript"]["added"]
    lrs = [[(e[0], e[3], e[8]) for e in step if _is_lr(e)] for step in entries]
    assert lrs == [
        [(0, LR_PREFIX + "0", 0.125), (0, LR_PREFIX + "1", 0.25)],
        [(1, LR_PREFIX + "0", 0.5), (1, LR_PREFIX + "1", 0.25)],
        [(2, LR_PREFIX + "0", 0.5), (2, LR_PREFIX + "1", 2.0)],
    ]
    fingerprints = [(r[1], dict(r[4:])["step"]) for r in added if r[1].startswith(PARAM_PREFIX)]
    assert [step for _, step in fingerprints] == [0, 0]  # weight and bias at step 0 (3: not run)


def test_the_compiled_step_writes_the_common_learning_rate_rows_itself(monkeypatch) -> None:
    """The compiled step calls the checks' on_step only where it has more to do than float
    learning rates: a fingerprint step, fingerprints pending, new param groups, an int rate."""
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    job = Job(checks_every=4)
    checks, called = job.tr.checks, []
    on_step = checks.on_step
    checks.on_step = lambda step: (called.append(step), on_step(step))[1]
    for i in range(7):
        if i == 2:  # a third param group: its row name is made by on_step
            job.tr.dist.add_param_group({"params": [torch.zeros(1)], "lr": 1.0})
        if i == 5:
            job.tr.dist.param_groups[0]["lr"] = 3  # an int
        if i == 6:
            job.tr.dist.param_groups[0]["lr"] = 3.0
            checks.pending.append("a device fingerprint in flight")  # on_step collects it
            checks.collect = lambda: checks.pending.clear()
        job.forward_backward()
        job.step()
    assert called == [0, 2, 4, 5, 6]
    rows = [[e[8] for e in step if _is_lr(e)] for step in job.tr.rec.entries]
    assert rows == [[0.125, 0.25]] * 2 + [[0.125, 0.25, 1.0]] * 3 + [[3.0, 0.25, 1.0]] * 2
    assert job.tr.rec.failures == [] and job.tr.rec.enabled


def test_live_and_the_clock_collective_are_called_at_their_steps(both, monkeypatch) -> None:
    """Live detection gets each step's entries; the clock collective runs at the scheduled
    steps (here 2, then every 3rd), and the next step starts after it."""
    first, every = opt.CLOCK_RESYNC_FIRST, opt.CLOCK_RESYNC_EVERY
    hot.configure(hvdpatch, 2, 3)  # both forms' schedule
    seen: dict[str, Any] = {}
    try:
        for form in ("1", "0"):
            monkeypatch.setenv("HVTRACE_NATIVE", form)
            seen[form] = _seven_steps_watched()
    finally:
        hot.configure(hvdpatch, first, every)
    assert seen["1"] == seen["0"]
    assert seen["1"][0] == [7] * 7 and seen["1"][1] == [2, 3, 6]


def _seven_steps_watched() -> tuple[list[int], list[int], Any]:
    """Seven steps with live detection and the clock collective stood in for: the number of
    entries live got per step, the steps the collective ran at, where the last step began."""
    job = Job()
    live: list = []
    resyncs: list = []
    job.tr.live = type("Live", (), {"on_step": lambda self, rows: live.append(rows)})()
    job.tr.resync_clock = lambda: resyncs.append(job.tr.steps_done)
    for _ in range(7):
        job.forward_backward()
        job.step()
    return [len(x) for x in live], resyncs, _norm(job.tr.step_start)


class HorovodWaitError(RuntimeError):
    pass


def _waits(form: str, monkeypatch) -> dict[str, Any]:
    """Horovod's module synchronize(handle), wrapped in one form: what an observing tracer
    notes, what an error of Horovod's and one of hvtrace's do."""
    monkeypatch.setenv("HVTRACE_NATIVE", form)
    monkeypatch.setattr(hvdpatch, "observer", None)

    def horovod_wait(handle: int) -> str:
        if handle < 0:
            raise HorovodWaitError(f"handle {handle} failed")
        return f"result {handle}"

    wait = hvdpatch.wrap(horovod_wait)
    job = Job(model=False, cuda=True)  # the timer's tokens are events: the waits are not
    tr = job.tr
    out = {"type": type(wait).__name__, "wrapped": wait.__wrapped__ is horovod_wait}
    out["unobserved"] = wait(1)  # no traced synchronize() running: nothing noted
    monkeypatch.setattr(hvdpatch, "observer", tr)
    t0 = time.monotonic_ns()
    out["observed"] = [wait(2), wait(3)]
    t1 = time.monotonic_ns()
    with pytest.raises(HorovodWaitError, match="handle -1 failed"):
        wait(-1)  # Horovod's own error, unchanged; nothing noted
    # (handle, when the host saw the wait return: the monotonic clock, in order)
    times = [t for _, t in tr.done]
    out["done_on_host_clock"] = all(type(t) is int for t in times) and t0 <= min(times)
    out["done_on_host_clock"] &= times == sorted(times) and max(times) <= t1
    out["done"] = [h for h, _ in tr.done]
    tr.done = "not a list"  # hvtrace's own error: tracing off, Horovod's result still returned
    out["after_failure"] = wait(4)
    out["failures"] = list(tr.rec.failures)
    return out


def test_the_handle_wait_wrapper_notes_each_wait_in_both_forms(monkeypatch) -> None:
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    compiled, python = _waits("1", monkeypatch), _waits("0", monkeypatch)
    assert compiled.pop("type") == "HandleWait" and python.pop("type") == "function"
    # the same, but for how the error inside hvtrace reads (TypeError / AttributeError)
    failures = compiled.pop("failures"), python.pop("failures")
    assert compiled == python
    assert compiled["wrapped"] and compiled["unobserved"] == "result 1"
    assert compiled["observed"] == ["result 2", "result 3"]
    assert compiled["done"] == [2, 3] and compiled["done_on_host_clock"]
    assert compiled["after_failure"] == "result 4"
    assert [len(f) for f in failures] == [1, 1]
    assert "tracer.done is not a list" in failures[0][0] and "append" in failures[1][0]


def _synchronize_through_waits(form: str, monkeypatch) -> dict[str, Any]:
    """A traced synchronize() whose Horovod waits for each handle through the wrapped module
    synchronize(handle), as Horovod's optimizer does; then a wait outside it."""
    monkeypatch.setenv("HVTRACE_NATIVE", form)
    monkeypatch.setattr(hvdpatch, "observer", None)
    job = Job()
    tr = job.tr
    seen: list[bool] = []

    def horovod_wait(handle: int) -> int:
        seen.append(hvdpatch.observer is tr)
        return handle

    wait = hvdpatch.wrap(horovod_wait)

    def horovod_sync() -> None:
        job.sync_calls += 1
        for _t, _key, h in list(tr.enqueued):
            wait(h)

    tr._orig_sync = horovod_sync
    job.forward_backward()
    t0 = time.monotonic_ns()
    job.step()
    t1 = time.monotonic_ns()
    syncs = [e for entries in tr.rec.entries for e in entries if isinstance(e, Allreduces)]
    done = [d for s in syncs for d in s.done]
    wait(99)  # no traced synchronize() running: nothing noted anywhere
    return {
        "type": type(wait).__name__,
        "observer_in_waits": seen,
        "done": [h for h, _ in done],
        "on_host_clock": all(type(t) is int and t0 <= t <= t1 for _, t in done),
        "after": list(tr.done),
        "observer_after": hvdpatch.observer,
        "failures": tr.rec.failures,
    }


def test_a_traced_synchronize_notes_each_handle_wait_in_both_forms(monkeypatch) -> None:
    """The compiled synchronize() hands its tracer to the compiled wait wrapper without the
    module attribute (a C pointer, cleared on return): every wait inside it is noted, in order,
    on the host clock, and none after it, as in the Python form."""
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    compiled, python = (_synchronize_through_waits(f, monkeypatch) for f in ("1", "0"))
    assert compiled.pop("type") == "HandleWait" and python.pop("type") == "function"
    assert compiled == python
    assert compiled["observer_in_waits"] == [True, True, False]  # the last: wait(99)
    assert compiled["done"] == [1, 2] and compiled["on_host_clock"]
    assert compiled["after"] == [] and compiled["observer_after"] is None
    assert compiled["failures"] == []


def test_the_compiled_step_closes_the_switch_check_while_recording_is_off(monkeypatch) -> None:
    """With recording off no reading comes, so the reader's own reviews never run: the compiled
    step() tells it each step, and after 64 the training thread's perf event is gone."""
    if native._hot is None:
        pytest.skip("hvtrace.record._hot is not built here")
    from hvtrace.record.cpustat import ThreadCounters

    counters = ThreadCounters()
    if not getattr(counters.read, "switch_check", False):
        counters.close()
        pytest.skip("no perf event on this thread here")
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    job = Job(model=False)
    job.tr.read = reader = counters.read
    job.tr.rec.enabled = False
    try:
        for _ in range(63):
            job.forward_backward()
            job.step()
        assert reader.switch_check
        job.forward_backward()
        assert job.step() == "stepped False"
        assert not reader.switch_check and job.tr.steps_done == 64
    finally:
        counters.close()
