"""Recording under real Horovod: ``horovodrun -np 2 -H localhost:2 --gloo`` on the demo trainer.

Each module-scoped fixture is one job (seven in all; several tests read each), run with other
modules' jobs in shared launches (the ``batched`` fixture, ``tests/batch_train.py``). Jobs are
small (10 steps of a 2-layer, 64-wide MLP).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from helpers import PLAIN_JOB, Scenario, scenario, tail, traced_scenario

from hvtrace.format.schema import FORMAT_VERSION
from hvtrace.load import Run, load_run

# a fixture's horovodrun launch counts against the first test that needs it: allow several
pytestmark = [pytest.mark.horovod, pytest.mark.timeout(1500)]

STEPS = 10
WIDTH = 64
LAYERS = 2
N_TENSORS = 2 * (LAYERS + 1)
COMMON = ["--steps", str(STEPS), "--width", str(WIDTH), "--layers", str(LAYERS)]
COMMON += ["--batch-size", "32"]
assert COMMON == PLAIN_JOB  # its plain run is shared (``plain_run``, tests/integration/conftest.py)
PHASES = ("step", "input", "forward", "backward", "wait", "update")


def expected_tensors(width: int = WIDTH, layers: int = LAYERS, in_dim: int = 256) -> dict:
    """Parameter name -> number of elements of ``hvtrace.examples.train.MLP``."""
    out = {}
    d = in_dim
    for i in range(layers):
        out[f"net.{2 * i}.weight"] = width * d
        out[f"net.{2 * i}.bias"] = width
        d = width
    out[f"net.{2 * layers}.weight"] = 10 * d
    out[f"net.{2 * layers}.bias"] = 10
    return out


TENSORS = expected_tensors()
assert len(TENSORS) == N_TENSORS


@dataclass
class Job:
    """One horovodrun launch: its output and, when it traced, the loaded run."""

    proc: object
    trace_dir: Path
    params: Path | None = None
    run: Run | None = None

    def context(self) -> str:
        return f"stdout tail:\n{tail(self.proc.stdout, 15)}\nstderr tail:\n{tail(self.proc.stderr)}"


def _scenario(name: str, *args: str, env=None, save: bool = True) -> Scenario:
    """``COMMON`` and ``args``, traced to the job's ``trace``, the parameters saved (``save``)."""
    extra = ["--save-params", "{base}/params.pt"] if save else []
    return traced_scenario(f"record_{name}", *COMMON, *extra, *args, env=env)


UNTRACED = _scenario("untraced", "--no-trace")
OFF = _scenario("off", env={"HVTRACE": "0"})
#: Rank 1 60 ms slower in its forward; every rank clipping its gradients between Horovod's
#: synchronize() and the update (``--clip``), its parameters in 2 groups (``--groups 2``).
SLOWED = _scenario(
    "slow", "--slow-rank", "1", "--slow-ms", "60", "--slow-phase", "forward",
    "--clip", "--groups", "2", save=False,
)  # fmt: skip
BPPS_FP16 = _scenario("bpps_fp16", "--bpps", "2", "--fp16", save=False)
#: Its trace directory under a regular file: it cannot be made.
UNWRITABLE = scenario(
    "record_unwritable", *COMMON, "--trace-dir", "{base}/not_a_dir/trace",
    files={"not_a_dir": "a regular file"},
)  # fmt: skip


def _launch(batched, sc: Scenario, traced: bool = True) -> Job:
    """The finished job of ``sc`` (run with others in one launch: ``batched``)."""
    done = batched(sc)
    params = done.base / "params.pt"
    job = Job(done.proc, done.trace, params if "--save-params" in sc.argv else None)
    assert f"rank 0: {STEPS} steps" in job.proc.stdout, job.context()
    if traced:
        job.run = load_run(job.trace_dir)
    return job


@pytest.fixture(scope="module")
def plain(plain_run) -> Job:
    """``COMMON``, traced, the parameters saved: ``helpers.PLAIN_JOB`` (the same job, shared
    with ``test_hot_path_horovod.py``, recorded once a session)."""
    job = Job(plain_run.proc, plain_run.trace, plain_run.base / "params.pt")
    assert f"rank 0: {STEPS} steps" in job.proc.stdout, job.context()
    job.run = load_run(job.trace_dir)
    return job


@pytest.fixture(scope="module")
def untraced(batched) -> Job:
    return _launch(batched, UNTRACED, traced=False)


@pytest.fixture(scope="module")
def hvtrace_off(batched) -> Job:
    return _launch(batched, OFF, traced=False)


@pytest.fixture(scope="module")
def slowed(batched) -> Job:
    """``SLOWED``: the delay and the clipping are independent of each other (the delay is in
    the forward, the clipping after the backward's wait, the same on both ranks); each test
    reads its own part of this one job."""
    return _launch(batched, SLOWED)


@pytest.fixture(scope="module")
def bpps_fp16(batched) -> Job:
    return _launch(batched, BPPS_FP16)


@pytest.fixture(scope="module")
def clip_groups(slowed: Job) -> Job:
    """The clipped, grouped job: the ``slowed`` launch (its delay is in the forward only)."""
    return slowed


@pytest.fixture(scope="module")
def unwritable(batched) -> Job:
    done = batched(UNWRITABLE)
    return Job(done.proc, done.base / "not_a_dir" / "trace")


# -- helpers --------------------------------------------------------------------------------------
def local_spans(run: Run, rank: int) -> pd.DataFrame:
    """One rank's spans on its own clock (for ordering checks free of alignment rounding)."""
    df = run.files[rank].table.to_pandas()
    for c in ("kind", "name", "dtype"):
        df[c] = df[c].astype(str)
    return df


def per_step_counts(df: pd.DataFrame, kind: str) -> dict[int, int]:
    return df[df["kind"] == kind].groupby("step").size().to_dict()


def assert_phase_counts(run: Run, per_step: dict[str, int]) -> None:
    """Every rank has exactly ``per_step[kind]`` spans of each kind in every step 0..STEPS-1."""
    for rank in (0, 1):
        df = local_spans(run, rank)
        for kind, n in per_step.items():
            got = per_step_counts(df, kind)
            assert got == {s: n for s in range(STEPS)}, (rank, kind, got)


def assert_allreduces(run: Run, elem_bytes: int, dtype: str, names: dict | None = None) -> None:
    """One allreduce span per gradient tensor per step, with the right bytes and dtype."""
    names = TENSORS if names is None else names
    for rank in (0, 1):
        ar = local_spans(run, rank)
        ar = ar[ar["kind"] == "allreduce"]
        assert sorted(ar["step"].unique()) == list(range(STEPS)), rank
        for step, g in ar.groupby("step"):
            assert len(g) == N_TENSORS, (rank, step, g["name"].tolist())
            assert sorted(g["name"]) == sorted(names), (rank, step)
            for name, nbytes, dt in zip(g["name"], g["bytes"], g["dtype"]):
                assert nbytes == names[name] * elem_bytes, (rank, step, name, nbytes)
                assert dt == dtype, (rank, step, name, dt)
            assert (g["end_ns"] >= g["start_ns"]).all()


def load_params(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


# -- a plain traced run ---------------------------------------------------------------------------
def test_both_ranks_recorded(plain: Job) -> None:
    run = plain.run
    files = sorted(p.name for p in plain.trace_dir.iterdir())
    # each rank closed its stream cleanly, and it was compacted into Parquet (the stream removed)
    assert files == [f"rank0000{r}-{run.run_id}.parquet" for r in (0, 1)], files
    assert run.ranks == [0, 1] and run.size == 2
    assert run.missing_ranks == []
    assert run.complete, run.problems
    assert run.problems == []
    for r in (0, 1):
        f = run.files[r]
        assert f.rank == r and f.header["rank"] == r
        assert f.complete and not f.truncated and f.dropped == 0
        assert f.last_step == STEPS


def test_rank_comes_from_inside_the_file(plain: Job, tmp_path: Path) -> None:
    """Swap the two files' names: each rank's spans still load as that rank."""
    run_id = plain.run.run_id
    f0, f1 = (plain.trace_dir / f"rank0000{r}-{run_id}.parquet" for r in (0, 1))
    shutil.copy(f0, tmp_path / f1.name)
    shutil.copy(f1, tmp_path / f0.name)
    swapped = load_run(tmp_path)
    assert swapped.files[0].path.name == f1.name
    assert swapped.files[1].path.name == f0.name
    for r in (0, 1):
        assert swapped.files[r].spans == plain.run.files[r].spans
        assert swapped.files[r].header == plain.run.files[r].header


def test_every_step_has_every_phase(plain: Job) -> None:
    assert_phase_counts(plain.run, dict.fromkeys(PHASES, 1))
    for rank in (0, 1):
        df = local_spans(plain.run, rank)
        assert "compute" not in set(df["kind"])  # model= given: compute is split
        assert (df["end_ns"] >= df["start_ns"]).all()
        # user spans of the trainer and the loss scalar, one per step
        data = df[(df["kind"] == "user") & (df["name"] == "data")]
        assert sorted(data["step"]) == list(range(STEPS))
        loss = df[(df["kind"] == "scalar") & (df["name"] == "loss")]
        assert sorted(loss["step"]) == list(range(STEPS))  # recorded after opt.step()
        assert loss["value"].notna().all() and (loss["value"] > 0).all()
        # the final clock collective of hvtrace.finish()
        assert ((df["kind"] == "user") & (df["name"] == "hvtrace.clock_sync")).sum() == 1


def test_phases_are_ordered_within_each_step(plain: Job) -> None:
    for rank in (0, 1):
        df = local_spans(plain.run, rank)
        for step in range(STEPS):
            s = df[df["step"] == step]

            def one(kind: str, s=s) -> pd.Series:
                return s[s["kind"] == kind].iloc[0]

            st, inp, fwd, bwd, wait, upd = (one(k) for k in PHASES)
            assert st.start_ns == inp.start_ns
            assert inp.end_ns <= fwd.start_ns < fwd.end_ns <= bwd.start_ns <= bwd.end_ns
            assert bwd.end_ns <= wait.start_ns <= wait.end_ns <= upd.start_ns <= upd.end_ns
            assert upd.end_ns == st.end_ns
            ar = s[s["kind"] == "allreduce"]
            # enqueued when a gradient became ready during backward, seen done by the wait's end
            assert (ar["start_ns"] >= fwd.end_ns).all()
            assert (ar["start_ns"] <= bwd.end_ns).all()
            assert (ar["end_ns"] <= wait.end_ns).all()
        steps = df[df["kind"] == "step"].sort_values("step")
        # consecutive steps tile the timeline (the next step starts where the last update ended)
        assert (steps["start_ns"].to_numpy()[1:] >= steps["end_ns"].to_numpy()[:-1]).all()


def test_one_allreduce_per_tensor_per_step(plain: Job) -> None:
    assert_allreduces(plain.run, elem_bytes=4, dtype="float32")


def test_header(plain: Job) -> None:
    run = plain.run
    h0, h1 = run.header(0), run.header(1)
    assert h0["run_id"] == h1["run_id"] == run.run_id
    assert len(run.run_id) > 8
    host = socket.gethostname()
    for r, h in ((0, h0), (1, h1)):
        assert h["format"] == "hvtrace" and h["version"] == FORMAT_VERSION == 2
        assert h["rank"] == r and h["size"] == 2
        assert h["local_size"] == 2 and h["local_rank"] == r
        assert h["host"] == host
        assert isinstance(h["pid"], int) and h["pid"] > 0
        assert h["timing"] == "host_monotonic" and h["device"] == "cpu"
        assert h["torch_version"] == importlib.metadata.version("torch")
        assert h["horovod_version"] == importlib.metadata.version("horovod")
        assert h["model"] == "MLP"
        opt = h["optimizer"]
        assert opt["class"] == "SGD"
        assert opt["tensors"] == N_TENSORS
        assert opt["grad_bytes"] == 4 * sum(TENSORS.values())
        assert opt["backward_passes_per_step"] == 1
        assert isinstance(h["mono_anchor_ns"], int) and isinstance(h["wall_anchor_ns"], int)
    assert h0["pid"] != h1["pid"]
    # both ranks anchored their clocks within a few seconds of each other
    assert abs(h0["wall_anchor_ns"] - h1["wall_anchor_ns"]) < 30 * 10**9


def test_clock_estimates(plain: Job) -> None:
    run = plain.run
    boot = run.header(0).get("boot_id")
    for r in (0, 1):
        h = run.header(r)
        start = h["clock"]["start"]
        assert start["bounded"] is True
        if r == 0:
            assert start["offset_ns"] == 0 and start["uncertainty_ns"] == 0
            assert start["rounds"] == 8 and start["method"] == "barrier"
        else:
            # TCP round trips on one host bound it far tighter than 8 barrier rounds
            assert start["method"] == "round-trip" and start["rounds"] == 32, start
            assert start["uncertainty_ns"] < 1_000_000, start
            # one host, one monotonic clock: the true offset is 0
            assert abs(start["offset_ns"]) <= start["uncertainty_ns"] + 1_000_000, start
        # the estimates as recorded: the start one and hvtrace.finish()'s
        f = run.files[r]
        measured = f.clock_measured
        assert len(measured) == 2, measured
        assert measured[1].at_ns > measured[0].at_ns
        for e in measured:
            assert e.bounded
            assert abs(e.offset_ns) <= e.uncertainty_ns + 1_000_000, e
        # both ranks on this machine's kernel: aligned with offset 0 exactly
        if boot:
            assert h["boot_id"] == boot
            assert f.same_clock
            assert [e.offset_ns for e in f.clock] == [0]
    # alignment left every rank's times as recorded (offset 0)
    for r in (0, 1):
        df = run.spans[run.spans["rank"] == r].sort_values(["start_ns", "end_ns"])
        local = local_spans(run, r).sort_values(["start_ns", "end_ns"])
        assert df["start_ns"].tolist() == local["start_ns"].tolist()


def test_parameters_identical_with_and_without_hvtrace(
    plain: Job, untraced: Job, hvtrace_off: Job
) -> None:
    import torch

    traced = load_params(plain.params)
    assert set(traced) == set(TENSORS)
    for other in (untraced, hvtrace_off):
        ref = load_params(other.params)
        assert set(ref) == set(traced)
        for k, v in traced.items():
            assert torch.equal(v, ref[k]), k
    # and training did change them (the comparison is not between two initial states)
    init = dict(zip(TENSORS, _initial_params()))
    assert any(not torch.equal(init[k], traced[k]) for k in TENSORS)


def _initial_params() -> list:
    import torch

    from hvtrace.examples.train import MLP

    torch.manual_seed(1234)  # the trainer's default --seed
    return [p.detach().clone() for p in MLP(WIDTH, LAYERS).parameters()]


# -- HVTRACE=0 and an unwritable trace directory --------------------------------------------------
def test_hvtrace_0_writes_nothing(hvtrace_off: Job) -> None:
    d = hvtrace_off.trace_dir
    assert not d.exists() or not any(d.iterdir()), list(d.iterdir())
    assert "tracing disabled" not in hvtrace_off.proc.stderr


def test_unwritable_trace_dir_trains_untraced(unwritable: Job) -> None:
    proc = unwritable.proc
    assert proc.returncode == 0, unwritable.context()
    assert f"rank 0: {STEPS} steps" in proc.stdout, unwritable.context()
    # one warning per rank, naming the directory
    for r in (0, 1):
        lines = [ln for ln in proc.stderr.splitlines() if f"tracing disabled on rank {r}" in ln]
        assert len(lines) == 1, unwritable.context()
        assert str(unwritable.trace_dir) in lines[0], unwritable.context()
    # and nothing else: the tracer is installed on every rank (the counters the failed recorder
    # closed are not read), so the scheduled clock collectives stay in step on every rank
    assert "could not start tracing" not in proc.stderr, unwritable.context()
    assert "Bad file descriptor" not in proc.stderr, unwritable.context()
    assert not unwritable.trace_dir.exists()


def test_distributed_optimizer_rejects_what_horovod_rejects() -> None:
    """Before hvd.init(), and with duplicate parameter names, hvtrace's optimizer raises what
    Horovod's raises (type and message): it builds Horovod's first (Horovod's test_duplicate_names
    builds it before hvd.init())."""
    torch = pytest.importorskip("torch")
    hvd = pytest.importorskip("horovod.torch")
    import hvtrace

    if hvd.is_initialized():
        pytest.skip("Horovod is already initialized in this process")
    model = torch.nn.Linear(4, 2)

    def error(build: Any, named: Any) -> tuple[type, str]:
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(Exception) as caught:
            build(base, named_parameters=named)
        return type(caught.value), str(caught.value)

    cases = {
        "before init": list(model.named_parameters()),
        "duplicate names": [("same", p) for p in model.parameters()],
    }
    for what, named in cases.items():
        theirs = error(hvd.DistributedOptimizer, named)
        ours = error(hvtrace.DistributedOptimizer, named)
        assert ours == theirs, what
    duplicate = error(hvtrace.DistributedOptimizer, cases["duplicate names"])
    assert "duplicates" in duplicate[1], duplicate  # Horovod's check ran, not only init's


# -- a slowed rank --------------------------------------------------------------------------------
def test_slowed_rank_forward_and_compute(slowed: Job) -> None:
    run = slowed.run
    assert run.complete, run.problems
    assert_phase_counts(run, dict.fromkeys(PHASES, 1))

    def medians(rank: int) -> tuple[float, float]:
        df = local_spans(run, rank)
        dur = df["end_ns"] - df["start_ns"]
        fwd = dur[df["kind"] == "forward"].groupby(df["step"]).sum()
        bwd = dur[df["kind"] == "backward"].groupby(df["step"]).sum()
        return statistics.median(fwd), statistics.median(fwd + bwd)

    fwd0, comp0 = medians(0)
    fwd1, comp1 = medians(1)
    assert 45e6 <= fwd1 - fwd0 <= 90e6, (fwd0 / 1e6, fwd1 / 1e6)
    assert 45e6 <= comp1 - comp0 <= 90e6, (comp0 / 1e6, comp1 / 1e6)
    # the slowed rank wraps its model; its allreduces still carry the core's tensor names
    assert_allreduces(run, elem_bytes=4, dtype="float32")
    assert run.header(0)["model"] == "MLP" and run.header(1)["model"] == "SlowForward"


# -- Horovod options ------------------------------------------------------------------------------
def test_backward_passes_per_step_2(bpps_fp16: Job) -> None:
    run = bpps_fp16.run
    assert run.complete, run.problems
    assert_phase_counts(
        run, {"step": 1, "input": 1, "forward": 2, "backward": 2, "wait": 1, "update": 1}
    )
    for rank in (0, 1):
        df = local_spans(run, rank)
        for kind in ("forward", "backward"):
            micro = df[df["kind"] == kind].groupby("step")["micro"].apply(sorted).to_dict()
            assert micro == {s: [0, 1] for s in range(STEPS)}, (rank, kind, micro)
        for step in range(STEPS):
            s = df[df["step"] == step]
            f = s[s["kind"] == "forward"].sort_values("micro")
            b = s[s["kind"] == "backward"].sort_values("micro")
            # forward 0, backward 0, forward 1, backward 1
            assert f.iloc[0].end_ns <= b.iloc[0].start_ns <= b.iloc[0].end_ns
            assert b.iloc[0].end_ns <= f.iloc[1].start_ns
            assert f.iloc[1].end_ns <= b.iloc[1].start_ns
        h = run.header(rank)["optimizer"]
        assert h["backward_passes_per_step"] == 2


def test_fp16_compression(bpps_fp16: Job) -> None:
    # one allreduce per tensor per step (even with 2 backward passes), fp16 bytes and dtype
    assert_allreduces(bpps_fp16.run, elem_bytes=2, dtype="float16")
    for rank in (0, 1):
        assert bpps_fp16.run.header(rank)["optimizer"]["compression"] == "FP16Compressor"


def test_skip_synchronize_and_groups(clip_groups: Job) -> None:
    run = clip_groups.run
    assert run.complete, run.problems
    # synchronize(); clip; with skip_synchronize(): step() -> one wait, one update per step
    assert_phase_counts(run, dict.fromkeys(PHASES, 1))
    assert_allreduces(run, elem_bytes=4, dtype="float32")
    for rank in (0, 1):
        assert run.header(rank)["optimizer"]["groups"] == 2
        df = local_spans(run, rank)
        for step in range(STEPS):
            s = df[df["step"] == step]
            wait = s[s["kind"] == "wait"].iloc[0]
            upd = s[s["kind"] == "update"].iloc[0]
            # clipping happens between the wait and the update
            assert wait.end_ns <= upd.start_ns
