"""Shared test helpers: launching real ``horovodrun`` jobs, and writing synthetic trace files.

Launching: :func:`run_horovodrun` runs ``horovodrun -np N -H localhost:N --gloo ...`` with this
interpreter's ``bin`` directory (the venv) first on ``PATH``, kills the whole job on timeout and
fails the test with the command, exit status and the tail of stdout/stderr.

Synthetic traces: :func:`make_header` and :func:`write_rank_file` build rank files through the real
writer (:class:`hvtrace.record.writer.TraceFile`), for loader and analysis tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The directory of the interpreter running the tests (the venv's ``bin``): put first on PATH so
#: that horovodrun's workers run this same Python.
PY_BIN = Path(sys.executable).parent


# -- horovodrun -----------------------------------------------------------------------------------
def horovodrun_path() -> Path | None:
    """Return the ``horovodrun`` next to this interpreter, else the one on PATH, else None."""
    here = PY_BIN / "horovodrun"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("horovodrun")
    return Path(found) if found else None


def horovod_unavailable_reason() -> str | None:
    """Return why real Horovod runs are impossible here, or None when they are possible."""
    if horovodrun_path() is None:
        return f"horovodrun is not installed (not in {PY_BIN} nor on PATH)"
    try:
        spec = importlib.util.find_spec("horovod.torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "horovod.torch is not importable by this interpreter (no Horovod with PyTorch)"
    return None


def tail(text: str | bytes | None, lines: int = 40) -> str:
    """Return the last ``lines`` lines of a process output (decoded), or a placeholder."""
    if text is None:
        return "<none>"
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    rows = text.rstrip().splitlines()
    if not rows:
        return "<empty>"
    cut = rows[-lines:]
    more = f"[... {len(rows) - lines} earlier lines ...]\n" if len(rows) > lines else ""
    return more + "\n".join(cut)


def describe(proc: subprocess.CompletedProcess, wall_s: float | None = None) -> str:
    """Return a multi-line account of a finished command for a failure message."""
    cmd = " ".join(map(str, proc.args)) if isinstance(proc.args, list | tuple) else proc.args
    took = f" after {wall_s:.1f} s" if wall_s is not None else ""
    return (
        f"command: {cmd}\nexit status: {proc.returncode}{took}\n"
        f"--- stdout (tail) ---\n{tail(proc.stdout)}\n--- stderr (tail) ---\n{tail(proc.stderr)}"
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the process group started for ``proc`` (TERM, then KILL)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment for a horovodrun job: this venv first on PATH, the repo importable,
    the caller's ``HVTRACE*`` variables removed, then ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVTRACE")}
    env["PATH"] = f"{PY_BIN}{os.pathsep}{env.get('PATH', '')}"
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{pp}" if pp else str(REPO_ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def run_horovodrun(
    args: Sequence[str | os.PathLike],
    np: int = 2,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``horovodrun -np NP -H localhost:NP --gloo ARGS...`` and return the CompletedProcess.

    ``env`` entries are added to this process's environment (``HVTRACE*`` variables of the caller
    are removed first, so a job is traced only as its test asks). The job runs in its own process
    group, killed entirely after ``timeout`` seconds. With ``check`` (default) a non-zero exit or a
    timeout fails the test with the command and the tail of both outputs.
    """
    hr = horovodrun_path()
    if hr is None:
        pytest.skip(horovod_unavailable_reason() or "horovodrun not installed")
    cmd = [str(hr), "-np", str(np), "-H", f"localhost:{np}", "--gloo", *map(str, args)]
    return run_job(cmd, env, cwd, timeout, check, "horovodrun")


def run_on_cluster(
    args: Sequence[str | os.PathLike],
    np: int,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ARGS under Horovod with ``np`` ranks on the namespace cluster that
    ``scripts/cluster.sh up`` made (``scripts/cluster.sh run``), from the repository root."""
    cmd = ["bash", str(REPO_ROOT / "scripts" / "cluster.sh"), "run", "--np", str(np), "--"]
    return run_job([*cmd, *map(str, args)], env, REPO_ROOT, timeout, check, "cluster.sh run")


#: Every job :func:`run_job` ran in this process: (label, wall seconds). The session's summary
#: prints how many and how long, per kind (tests/conftest.py), so that the suite's growth is seen.
LAUNCHES: list[tuple[str, float]] = []


def run_job(
    cmd: Sequence[str],
    env: dict[str, str] | None,
    cwd: str | os.PathLike | None,
    timeout: float,
    check: bool,
    label: str,
) -> subprocess.CompletedProcess:
    """Run a job command in its own process group (killed entirely after ``timeout``), in the
    :func:`job_env` environment; fail the test on a timeout, or on a non-zero exit with
    ``check``, with the command and the tail of both outputs."""
    full_env = job_env(env)
    cmd = list(cmd)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=str(cwd) if cwd is not None else None,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            LAUNCHES.append((label, time.monotonic() - t0))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        pytest.fail(
            f"{label} timed out after {timeout:.0f} s and was killed\n"
            + describe(done, time.monotonic() - t0),
            pytrace=False,
        )
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and done.returncode != 0:
        pytest.fail(f"{label} failed\n" + describe(done, time.monotonic() - t0), pytrace=False)
    return done


def analyze_cli(*args: str | os.PathLike, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m hvtrace.cli analyze ARGS...`` as a user would (the repo importable, the
    caller's ``HVTRACE*`` variables removed: :func:`job_env`); return the finished process."""
    return subprocess.run(
        [sys.executable, "-m", "hvtrace.cli", "analyze", *map(str, args)],
        capture_output=True,
        text=True,
        env=job_env(),
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def run_train(
    *train_args: str | os.PathLike,
    np: int = 2,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``python -m hvtrace.examples.train TRAIN_ARGS...`` under :func:`run_horovodrun`."""
    return run_horovodrun(
        [sys.executable, "-m", "hvtrace.examples.train", *train_args],
        np=np,
        env=env,
        cwd=cwd,
        timeout=timeout,
        check=check,
    )


# -- jobs run several to a launch (tests/batch_train.py; tests/integration/conftest.py) ------------
@dataclass(frozen=True)
class Scenario:
    """One job of ``hvtrace.examples.train`` (or another ``module``'s ``main``) that the
    integration tests read: its arguments (``{base}`` stands for the job's own directory, made
    when it runs; its trace goes where ``--trace-dir`` says) and the ``HVTRACE*`` settings it is
    run with.

    Jobs of the same ``np`` run one after another in one ``horovodrun`` launch
    (``tests/batch_train.py``, the ``batched`` fixture): each is the same ``main(argv)`` a launch
    of its own would run, in processes that ran other jobs before it. A job that needs a fresh
    process (settings read once a process, a fault that leaves a rank stopped) is run with
    :func:`run_train` instead.
    """

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    np: int = 2
    #: files written into the job's directory before it runs: (relative path, text)
    files: tuple[tuple[str, str], ...] = ()
    #: jobs share a launch only with jobs of their group (and ``np``): a group whose fixture
    #: sets something up around its jobs (a busy host) keeps the others out of it
    group: str = ""
    #: the script whose ``main(argv)`` the job runs
    module: str = "hvtrace.examples.train"

    def args_for(self, base: Path) -> list[str]:
        """The arguments with ``{base}`` replaced by the job's directory."""
        return [a.replace("{base}", str(base)) for a in self.argv]


#: Every scenario the collected test modules declared, in the order they did (module import).
SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    *argv: str | os.PathLike,
    env: dict[str, str] | None = None,
    np: int = 2,
    files: dict[str, str] | None = None,
    group: str = "",
    module: str = "hvtrace.examples.train",
) -> Scenario:
    """Declare (at a test module's import) a job for the ``batched`` fixture to run; its name is
    unique in the session. Declared at import, so that the first launch runs the jobs of every
    collected module together."""
    items = (tuple(sorted((env or {}).items())), np, tuple(sorted((files or {}).items())))
    sc = Scenario(name, tuple(map(str, argv)), *items, group, module)
    if SCENARIOS.setdefault(name, sc) != sc:
        raise ValueError(f"two different scenarios named {name!r}")
    return sc


def traced_scenario(name: str, *argv: str | os.PathLike, **kwargs: Any) -> Scenario:
    """:func:`scenario` with its trace in the job's ``trace`` directory (``--trace-dir``)."""
    return scenario(name, *argv, "--trace-dir", "{base}/trace", **kwargs)


def ran_steps(job: Any, steps: int) -> Path:
    """Check that a finished job (``RecordedJob``) ran ``steps`` steps on rank 0 and said
    nothing of being unable to trace; return its trace directory."""
    assert f"rank 0: {steps} steps" in job.stdout, tail(job.stdout) + tail(job.stderr)
    assert "hvtrace: could not" not in job.stderr, tail(job.stderr)
    return job.trace


# -- jobs shared by several integration modules (tests/integration/conftest.py) ------------------
#: The demo with rank 1 sleeping 40 ms in each forward: a small model (a few ms of compute per
#: step), so that the delay stands out from the scheduling noise of a shared 2-core machine.
SLOW_RANK1_JOB = ["--steps", "30", "--width", "256", "--layers", "3", "--batch-size", "32",
                  "--slow-rank", "1", "--slow-ms", "40", "--slow-phase", "forward"]  # fmt: skip
#: The demo with nothing injected, as ``test_lockstep.py`` runs its faults (30 steps, live
#: windows of 5 steps; ``--stop-step`` only says where a fault would be, and none is asked).
CLEAN_LIVE_JOB = ["--steps", "30", "--width", "128", "--layers", "3", "--batch-size", "32"]
#: Live windows of exactly 5 steps, each judged as it comes (no CPU budget for the judge: these
#: jobs check which window names what).
LIVE_EVERY_5 = {"HVTRACE_LIVE_EVERY": "5", "HVTRACE_LIVE_S": "0", "HVTRACE_JUDGE_PCT": "100"}
#: The job of ``test_compare_runs.py`` (60 steps of a 4-layer, 512-wide MLP, live detection off:
#: every run of that module), here with rank 1 sleeping SLOW_SLEEP_MS in each forward: 50 ms, so
#: that the step's change stands clear of a busy host's noise (at 25 ms, beside a busy process,
#: `make test-busy`, the base run's 52.7 ms median step against the slowed run's 66.2: +13.5 ms,
#: its 95 % interval -0.4..+25.6 ms, not significant; 29 Nov 2026).
COMPARE_JOB = ["--steps", "60", "--width", "512", "--layers", "4", "--batch-size", "64"]
SLOW_SLEEP_MS = 50
SLOW_SLEEP_JOB = [*COMPARE_JOB, "--slow-rank", "1", "--slow-ms", str(SLOW_SLEEP_MS),
                  "--slow-phase", "forward", "--slow-kind", "sleep"]  # fmt: skip
LIVE_OFF = {"HVTRACE_LIVE_EVERY": "0"}
#: The plain traced demo of ``test_record_horovod.py``: 10 steps of a 2-layer, 64-wide MLP.
PLAIN_STEPS = 10
PLAIN_JOB = ["--steps", str(PLAIN_STEPS), "--width", "64", "--layers", "2", "--batch-size", "32"]


# -- synthetic trace files ------------------------------------------------------------------------
def make_header(
    rank: int = 0,
    size: int = 1,
    run_id: str = "20240101-000000-abcdef",
    clock_start: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Return a valid hvtrace header (every required field); ``extra`` adds or overrides fields."""
    from hvtrace.format.schema import FORMAT_NAME, FORMAT_VERSION

    h: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "run_id": run_id,
        "rank": rank,
        "size": size,
        "host": "testhost",
        "pid": 1000 + rank,
        "mono_anchor_ns": 10**12,
        "wall_anchor_ns": 1_700_000_000 * 10**9,
        "clock": {"method": "barrier-interval", "reference_rank": 0},
        "timing": "host_monotonic",
    }
    if clock_start is not None:
        h["clock"]["start"] = clock_start
    h.update(extra)
    return h


def row(
    kind: str,
    name: str,
    start: int,
    end: int,
    step: int = 0,
    micro: int = 0,
    nbytes: int = 0,
    dtype: str = "",
    value: float = math.nan,
    flags: int = 0,
) -> tuple:
    """Return one buffer row tuple as the writer takes it (kind and dtype given by name)."""
    from hvtrace.format.schema import DTYPE_CODE, KIND_CODE

    return (step, micro, KIND_CODE[kind], name, start, end, nbytes, DTYPE_CODE[dtype], value, flags)


def status(
    final: bool = False, dropped: int = 0, last_step: int = -1, clock: list | None = None
) -> dict[str, Any]:
    """Return a batch status dict as the recorder makes it."""
    return {"dropped": dropped, "clock": clock or [], "last_step": last_step, "final": final}


def write_rank_file(
    path: str | os.PathLike,
    header: dict[str, Any],
    batches: Sequence[Sequence[tuple]],
    statuses: Sequence[dict[str, Any]] | None = None,
    close: bool = True,
) -> list[int]:
    """Write a rank file with the real writer; return the file size after each step.

    The first size is after opening, then one per appended batch, then (with ``close``) after
    the end-of-stream marker. The last batch's status is ``final`` unless ``statuses`` is given.
    """
    from hvtrace.record.writer import TraceFile

    path = Path(path)
    if statuses is None:
        statuses = [status(final=(i == len(batches) - 1)) for i in range(len(batches))]
    tf = TraceFile(path, header)
    sizes = [path.stat().st_size]
    for rows, st in zip(batches, statuses, strict=True):
        tf.append(list(rows), dict(st))
        sizes.append(path.stat().st_size)
    if close:
        tf.close()
        sizes.append(path.stat().st_size)
    return sizes


def rewrite_header(path: str | os.PathLike, edit: Any) -> None:
    """Rewrite a trace file with its header JSON changed by ``edit`` (dict -> dict or bytes)."""
    import pyarrow as pa

    from hvtrace.format.schema import HEADER_KEY

    path = Path(path)

    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        meta = dict(pq.read_metadata(path).metadata)
        meta.pop(b"ARROW:schema")
        new = edit(json.loads(meta[HEADER_KEY]))
        if new is None:
            meta.pop(HEADER_KEY)
        else:
            meta[HEADER_KEY] = new if isinstance(new, bytes) else json.dumps(new).encode()
        pq.write_table(table.replace_schema_metadata(meta), path)
        return
    # read a copy, not a memory map: the file is rewritten below while the batches are alive
    reader = pa.ipc.open_stream(pa.py_buffer(path.read_bytes()))
    schema = reader.schema
    batches = list(reader)
    header = json.loads(schema.metadata[HEADER_KEY])
    new = edit(header)
    meta = dict(schema.metadata)
    if new is None:
        meta.pop(HEADER_KEY)
    else:
        meta[HEADER_KEY] = new if isinstance(new, bytes) else json.dumps(new).encode()
    with open(path, "wb") as f, pa.ipc.new_stream(f, schema.with_metadata(meta)) as w:
        for b in batches:
            w.write_batch(b)


def bench_module(name: str) -> Any:
    """Import ``bench/NAME.py`` (a benchmark script, not a package) once per session; it is put
    in ``sys.modules`` before it runs, as dataclasses look their module up."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def synth_module() -> Any:
    """Import ``bench/synth_run.py`` (the synthetic-run writer the benchmarks use)."""
    return bench_module("synth_run")


def layout_texts(node: Any) -> list[str]:
    """Every string in a Dash layout's or a figure's JSON (children and figure text)."""
    import plotly

    out: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(json.dumps(node, cls=plotly.utils.PlotlyJSONEncoder)))
    return out


def damage_row_group(path: str | os.PathLike, index: int) -> None:
    """Flip bytes inside the data pages of a Parquet file's row group ``index`` (the footer
    stays intact, so the file opens and only that row group cannot be decoded)."""
    import pyarrow.parquet as pq

    rg = pq.read_metadata(path).row_group(index)
    start = min(rg.column(i).data_page_offset for i in range(rg.num_columns))
    end = max(
        rg.column(i).data_page_offset + rg.column(i).total_compressed_size
        for i in range(rg.num_columns)
    )
    raw = bytearray(Path(path).read_bytes())
    for i in range(start + 8, end, 7):
        raw[i] ^= 0x5A
    Path(path).write_bytes(bytes(raw))


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@contextlib.contextmanager
def headless_chromium(profile: Path, window_size: str = "1400,1000") -> Iterator[Any]:
    """A selenium driver of Debian's headless Chromium, offline (no background networking, no
    selenium-manager download), with a fresh profile in ``profile`` (removed after) and the
    browser's console log kept. Skips the test when selenium is not installed."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must never download anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-unsafe-swiftshader",  # WebGL through SwiftShader, without warnings
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--window-size={window_size}",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    drv.set_page_load_timeout(120)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


# -- the dashboard in a subprocess ----------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_dashboard(run_dir: Path, log: Path, poll_s: float = 0.5) -> Iterator[str]:
    """Serve ``hvtrace dashboard RUN_DIR`` in a subprocess (output to ``log``); yield its URL once
    it answers, fail the test if it exits or does not answer in 180 s; stop it on exit."""
    port = free_port()
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hvtrace.cli", "dashboard", str(run_dir), "--port", str(port)],
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"hvtrace dashboard exited {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"hvtrace dashboard did not serve {url} in 180 s:\n{log.read_text()}")
            time.sleep(poll_s)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


#: The marks of a test module of Lightning jobs under real horovodrun: skipped where
#: pytorch-lightning is not installed.
LIGHTNING_JOB_MARKS = [
    pytest.mark.horovod,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("pytorch_lightning") is None,
        reason="pytorch-lightning is not installed (pip install -e '.[lightning]')",
    ),
]
