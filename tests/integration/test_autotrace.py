"""Tracing by environment: unmodified jobs traced with ``$HVTRACE_DIR`` or ``hvtrace run``.

The start-up hook (``hvtrace-autotrace.pth``, installed with the package: :mod:`hvtrace_boot`) is
checked in plain interpreters (idle without hvtrace's variables, watching with them, the fallback
``sitecustomize`` of ``hvtrace run``), then on real jobs that never import hvtrace
(``tests/data/plain_synthetic.py``, the shape of Horovod's synthetic benchmark, and
``tests/data/plain_lightning.py``): each traced, analyzed, its injected straggler named.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO_ROOT, describe, horovodrun_path, run_horovodrun, run_job

from hvtrace.analysis import analyze
from hvtrace.launch import PTH_NAME, hook_installed, recorded_files, traced_environment
from hvtrace.load import load_run

DATA = REPO_ROOT / "tests" / "data"
PROBE = """
import json, os, sys
before = sorted(m for m in sys.modules if m.split('.')[0] in ('hvtrace', 'hvtrace_boot'))
finders = [type(f).__name__ for f in sys.meta_path]
timeline = os.environ.get('HOROVOD_TIMELINE')
patched = None
if len(sys.argv) > 1:
    import horovod.torch as hvd
    patched = hasattr(hvd.DistributedOptimizer, '_hvtrace_original')
print(json.dumps(dict(before=before, finders=finders, timeline=timeline, patched=patched)))
"""


def probe(env: dict[str, str], import_horovod: bool = False) -> dict:
    """What the start-up hook did in a fresh interpreter with ``env`` (nothing else set)."""
    args = [sys.executable, "-c", PROBE] + (["horovod"] if import_horovod else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, describe(proc)
    assert "hvtrace" not in proc.stderr, describe(proc)  # no warning from the hook
    return json.loads(proc.stdout)


def plain_env(**extra: str) -> dict[str, str]:
    """This environment without any HVTRACE variable and without the repo on PYTHONPATH (the
    installed package and its .pth only), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVTRACE", "HOROVOD_TIME"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


# -- the hook, in plain interpreters ---------------------------------------------------------------
def test_the_hook_is_installed_and_idle_without_hvtrace_variables() -> None:
    assert hook_installed(), f"{PTH_NAME} is not in this Python's site-packages (make setup)"
    got = probe(plain_env(), import_horovod=True)
    assert got["before"] == [], got  # not even hvtrace_boot is imported
    assert "_PostImport" not in got["finders"] and got["patched"] is False, got
    assert got["timeline"] is None, got


def test_the_hook_watches_horovod_when_asked_and_not_when_turned_off(tmp_path: Path) -> None:
    got = probe(plain_env(HVTRACE_DIR=str(tmp_path)), import_horovod=True)
    assert got["before"] == ["hvtrace_boot"], got  # hvtrace itself waits for horovod.torch
    assert got["finders"][0] == "_PostImport" and got["patched"] is True, got
    off = probe(plain_env(HVTRACE_DIR=str(tmp_path), HVTRACE="0"), import_horovod=True)
    assert "_PostImport" not in off["finders"] and off["patched"] is False, off


def test_horovod_timeline_is_enabled_before_any_import() -> None:
    """HVTRACE_HOROVOD_TIMELINE acts at start-up: whatever the script imports first, Horovod
    finds HOROVOD_TIMELINE=DYNAMIC at hvd.init(); a user's own HOROVOD_TIMELINE is kept."""
    assert probe(plain_env(HVTRACE_HOROVOD_TIMELINE="1"))["timeline"] == "DYNAMIC"
    mine = probe(plain_env(HVTRACE_HOROVOD_TIMELINE="1", HOROVOD_TIMELINE="/tmp/mine.json"))
    assert mine["timeline"] == "/tmp/mine.json"


def test_the_fallback_sitecustomize_hooks_and_runs_the_one_it_hides(tmp_path: Path) -> None:
    """Where the .pth is missing, ``hvtrace run`` leads PYTHONPATH with the hook's
    sitecustomize: the hook runs, and so does the user's own sitecustomize that it hides."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    base = plain_env(PYTHONPATH=str(theirs))
    env = traced_environment(base, tmp_path / "trace", use_pth=False)
    code = "import os, sys; print(os.environ.get('THEIRS_RAN'), type(sys.meta_path[0]).__name__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.split() == ["1", "_PostImport"], describe(proc)
    assert env["HVTRACE_DIR"] == str((tmp_path / "trace").absolute())


def test_a_script_calling_hvtrace_is_traced_once(tmp_path: Path) -> None:
    """Under HVTRACE_DIR, a script that already uses hvtrace.DistributedOptimizer gets one tracer
    and one file (hvtrace builds with Horovod's own function, not the patched one)."""
    if horovodrun_path() is None:
        pytest.skip("no Horovod here")
    script = tmp_path / "explicit.py"
    script.write_text(
        textwrap.dedent("""
        import horovod.torch as hvd, torch, hvtrace
        hvd.init()
        model = torch.nn.Linear(4, 2)
        opt = hvtrace.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), model=model)
        for _ in range(3):
            opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
        print(type(opt._hvtrace).__name__, opt._hvtrace.has_model)
        """)
    )
    trace = tmp_path / "trace"
    proc = run_job(
        [sys.executable, str(script)], {"HVTRACE_DIR": str(trace)}, tmp_path, 120, True, "python"
    )
    assert proc.stdout.split() == ["Tracer", "True"], describe(proc)
    assert len(recorded_files(trace)) == 1, describe(proc)
    assert "hvtrace" not in proc.stderr.replace(str(trace), ""), describe(proc)


# -- real jobs that never import hvtrace ----------------------------------------------------------
@dataclass
class Job:
    proc: subprocess.CompletedProcess
    trace_dir: Path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """``hvtrace run --horovod-timeline -- horovodrun -np 2 ... plain_synthetic.py``, rank 1
    sleeping 40 ms in its forward (about twice its step's work on this machine), the loss
    averaged every step with an unnamed ``hvd.allreduce`` (``--metric``) and live windows of 5
    steps: every window's exchange meets those unnamed collectives."""
    hr = horovodrun_path()
    if hr is None:
        pytest.skip("horovodrun is not installed")
    base = tmp_path_factory.mktemp("synthetic")
    trace = base / "trace"
    script = [sys.executable, str(DATA / "plain_synthetic.py"), "--num-iters", "6"]
    launcher = [str(hr), "-np", "2", "-H", "localhost:2", "--gloo", *script]
    launcher += ["--slow-rank", "1", "--slow-ms", "40", "--metric"]
    hv_run = [sys.executable, "-m", "hvtrace.cli", "run", "--dir", str(trace)]
    live = {"HVTRACE_LIVE_EVERY": "5", "HVTRACE_LIVE_S": "0", "HVTRACE_JUDGE_PCT": "100"}
    proc = run_job([*hv_run, "--horovod-timeline", "--", *launcher], live, base, 300, True, "run")
    return Job(proc, trace)


def test_hvtrace_run_says_where_the_run_is(synthetic: Job) -> None:
    err = synthetic.proc.stderr
    assert f"tracing into {synthetic.trace_dir}" in err, describe(synthetic.proc)
    assert f"hvtrace analyze {synthetic.trace_dir}" in err, describe(synthetic.proc)
    assert "Iter #5" in synthetic.proc.stdout, describe(synthetic.proc)


def test_unnamed_collectives_stay_paired_under_live_detection(synthetic: Job) -> None:
    """Horovod names an unnamed collective after a count of the process's collectives; live
    detection's exchanges are issued at the same step on every rank, so the job's unnamed
    allreduces pair as without hvtrace (issued from a background thread, they hung such jobs or
    crashed them), and every window is judged: the slowed rank is logged live."""
    out = synthetic.proc.stdout
    assert "rank 0: metrics 32 agree True" in out, describe(synthetic.proc)
    assert "rank 1: metrics 32 agree True" in out, describe(synthetic.proc)
    assert "rank 1 (host" in synthetic.proc.stderr and "forward" in synthetic.proc.stderr


def test_an_unmodified_script_is_traced_with_its_model_found(synthetic: Job) -> None:
    run = load_run(synthetic.trace_dir)
    assert run.complete and sorted(run.ranks) == [0, 1], run.problems
    spans = run.spans
    steps = 2 + 6 * 5  # warm-up batches, then iterations x batches
    for rank in (0, 1):
        mine = spans[spans["rank"] == rank]
        counts = mine.groupby("kind").size()
        # the model was found at its first forward: every step is split as with model=
        for kind in ("step", "input", "forward", "backward", "wait", "update"):
            assert counts.get(kind, 0) == steps, (rank, counts.to_dict())
        assert counts.get("compute", 0) == 0, counts.to_dict()
    names = set(spans.loc[spans["kind"] == "allreduce", "name"])
    assert names == {f"{m}.{p}" for m in ("conv1", "conv2", "fc") for p in ("weight", "bias")}


def test_the_injected_straggler_is_named(synthetic: Job) -> None:
    a = analyze(load_run(synthetic.trace_dir))
    assert a.stragglers["rank"].tolist() == [1], a.verdicts.to_string()
    assert a.stragglers.iloc[0]["phase"] == "forward", a.verdicts.to_string()


def test_horovod_timeline_by_environment_in_a_script_that_never_imports_hvtrace(
    synthetic: Job,
) -> None:
    files = list(synthetic.trace_dir.glob("horovod-timeline-*.json"))
    assert len(files) == 1, (files, describe(synthetic.proc))
    h = analyze(load_run(synthetic.trace_dir)).horovod_timeline
    assert h["merged"] and not h["partial"], h
    assert {"conv1.weight", "fc.bias"} <= {r["name"] for r in h["tensors"]}, h["tensors"]


@pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="pytorch-lightning is not installed (pip install -e '.[lightning]')",
)
def test_an_unmodified_lightning_script_gets_the_callback(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    proc = run_horovodrun(
        [sys.executable, str(DATA / "plain_lightning.py"), "--steps", "20"],
        env={"HVTRACE_DIR": str(trace)},
        cwd=tmp_path,
    )
    run = load_run(trace)
    assert run.complete and sorted(run.ranks) == [0, 1], (run.problems, describe(proc))
    header = run.header(0)
    assert (header.get("framework") or {}).get("name") == "pytorch_lightning", header
    spans = run.spans
    for rank in (0, 1):
        counts = spans[spans["rank"] == rank].groupby("kind").size()
        assert counts.get("step", 0) == 20 and counts.get("forward", 0) == 20, counts.to_dict()


def _driver_reason(launcher: str) -> str | None:
    """Why the Ray or Spark test cannot run here (None: it can)."""
    import shutil

    if importlib.util.find_spec("pyspark" if launcher == "spark" else "ray") is None:
        return f"{launcher} is not installed (pip install -e '.[{launcher}]')"
    if launcher == "spark" and shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime for Spark (apt-get install openjdk-17-jre-headless)"
    return None


@pytest.mark.parametrize("launcher", ["ray", "spark"])
def test_a_ray_or_spark_job_is_traced_by_environment(launcher: str, tmp_path: Path) -> None:
    """``horovod.ray.RayExecutor`` on a local Ray cluster, ``horovod.spark.run`` on a local
    Spark (``local[2]``), each started by its driver: the workers inherit HVTRACE_DIR (through
    the raylet; through Spark's JVM and Horovod's task services); both ranks traced with Gloo, on
    one host, 40 steps each, the slowed rank named in its forward."""
    why = _driver_reason(launcher)
    if why:
        pytest.skip(why)
    trace = tmp_path / "trace"
    script = [sys.executable, str(DATA / f"plain_{launcher}.py"), "--np", "2", "--steps", "40"]
    script += ["--slow-rank", "1", "--slow-ms", "30"]
    env = {"HVTRACE_DIR": str(trace)}
    proc = run_job(script, env, tmp_path, 300, True, f"{launcher} driver")
    assert "losses" in proc.stdout, describe(proc)
    run = load_run(trace)
    assert run.complete and sorted(run.ranks) == [0, 1], (run.problems, describe(proc))
    assert {run.header(r).get("controller") for r in (0, 1)} == {"gloo"}, run.header(0)
    assert len(set(run.hosts.values())) == 1, run.hosts
    steps = run.spans[run.spans["kind"] == "step"].groupby("rank").size().to_dict()
    assert steps == {0: 40, 1: 40}, steps
    a = analyze(run)
    assert a.stragglers["rank"].tolist() == [1], a.verdicts.to_string()
    assert a.stragglers.iloc[0]["phase"] == "forward", a.verdicts.to_string()


def _mpi_reason() -> str | None:
    """Why the mpirun test cannot run here (None: it can)."""
    import shutil

    if shutil.which("mpirun") is None:
        return "no mpirun (HOROVOD_WITH_MPI=1 make setup installs Open MPI, builds Horovod with it)"
    probe_mpi = "import horovod.torch as h, sys; sys.exit(0 if h.mpi_built() else 1)"
    if subprocess.run([sys.executable, "-c", probe_mpi], capture_output=True).returncode != 0:
        return "Horovod is built without MPI (HOROVOD_WITH_MPI=1 make setup builds it with)"
    return None


def test_an_mpirun_job_is_traced_by_environment(tmp_path: Path) -> None:
    """``hvtrace run -- mpirun -np 2 python plain_synthetic.py``: Open MPI's mpirun (not
    horovodrun) starts the ranks; hvtrace run adds ``-x`` for its variables (ranks on other hosts
    get them too); both ranks traced with Horovod's MPI controller, on one host, the clocks
    aligned, every step split, the slowed rank named in its forward."""
    why = _mpi_reason()
    if why:
        pytest.skip(why)
    trace = tmp_path / "trace"
    script = [sys.executable, str(DATA / "plain_synthetic.py"), "--num-iters", "4"]
    script += ["--slow-rank", "1", "--slow-ms", "40"]
    launcher = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PATH", *script]
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    hv_run = [sys.executable, "-m", "hvtrace.cli", "run", "--dir", str(trace), "--"]
    proc = run_job([*hv_run, *launcher], root, tmp_path, 300, True, "hvtrace run -- mpirun")
    assert f"hvtrace analyze {trace}" in proc.stderr, describe(proc)
    run = load_run(trace)
    assert run.complete and sorted(run.ranks) == [0, 1], (run.problems, describe(proc))
    assert {run.header(r).get("controller") for r in (0, 1)} == {"mpi"}, run.header(0)
    assert len(set(run.hosts.values())) == 1, run.hosts
    steps = 2 + 4 * 5
    for rank in (0, 1):
        counts = run.spans[run.spans["rank"] == rank].groupby("kind").size()
        for kind in ("step", "input", "forward", "backward", "wait", "update"):
            assert counts.get(kind, 0) == steps, (rank, counts.to_dict())
    a = analyze(run)
    assert a.controller == "mpi"
    assert "clocks aligned" in a.clock, a.clock
    assert a.stragglers["rank"].tolist() == [1], a.verdicts.to_string()
    assert a.stragglers.iloc[0]["phase"] == "forward", a.verdicts.to_string()
    report = subprocess.run(
        [sys.executable, "-m", "hvtrace.cli", "analyze", str(trace)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    head = " ".join(report.stdout.split("\n\n")[0].split()[:20])
    assert "Horovod over MPI" in head, head


@pytest.mark.skipif(
    importlib.util.find_spec("pytorch_lightning") is None,
    reason="pytorch-lightning is not installed (pip install -e '.[lightning]')",
)
def test_an_unmodified_lightning_script_under_mpirun_gets_the_callback(tmp_path: Path) -> None:
    """The Lightning script (``Trainer(strategy="horovod")``, no hvtrace import) started by
    ``hvtrace run -- mpirun``: Horovod's MPI controller, both ranks traced by the callback the
    hook adds, every step split."""
    why = _mpi_reason()
    if why:
        pytest.skip(why)
    trace = tmp_path / "trace"
    script = [sys.executable, str(DATA / "plain_lightning.py"), "--steps", "20"]
    launcher = ["mpirun", "-np", "2", "--oversubscribe", "-x", "PATH", *script]
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    hv_run = [sys.executable, "-m", "hvtrace.cli", "run", "--dir", str(trace), "--"]
    proc = run_job([*hv_run, *launcher], root, tmp_path, 300, True, "hvtrace run -- mpirun")
    run = load_run(trace)
    assert run.complete and sorted(run.ranks) == [0, 1], (run.problems, describe(proc))
    for r in (0, 1):
        header = run.header(r)
        assert header.get("controller") == "mpi", header
        assert (header.get("framework") or {}).get("name") == "pytorch_lightning", header
    for rank in (0, 1):
        counts = run.spans[run.spans["rank"] == rank].groupby("kind").size()
        assert counts.get("step", 0) == 20 and counts.get("forward", 0) == 20, counts.to_dict()
