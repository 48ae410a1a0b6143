"""The Dask engine (``hvtrace analyze --dask``) against the local engine, on real clusters.

A ``LocalCluster`` of worker processes stands for the user's cluster; every figure must equal the
local engine's, the tasks must run on every worker, and the failures (no scheduler, a worker
killed mid-analysis, no worker left) must end in one line, never in a hang.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from helpers import damage_row_group, synth_module

distributed = pytest.importorskip("distributed")
import cloudpickle  # noqa: E402  (a dependency of distributed)

from hvtrace import cli  # noqa: E402
from hvtrace.analysis import analyze  # noqa: E402
from hvtrace.analysis import cluster as hv_cluster  # noqa: E402
from hvtrace.errors import TraceError  # noqa: E402
from hvtrace.load import open_run  # noqa: E402

# the worker plugin below travels by value: the workers cannot import this test module
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FRAMES = [
    "steps", "per_rank", "users", "user_per_rank", "per_step", "collectives", "tensors",
    "step_comm", "verdicts", "stragglers", "slow_hosts",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dask-run")
    # rank 5 computes 25 ms longer in backward: the straggler both engines must name
    synth_module().write_synth_run(
        d, ranks=8, steps=40, tensors=8, slow_rank=5, slow_ms=25.0, slow_phase="backward",
        ranks_per_host=4,
    )  # fmt: skip
    return d


@pytest.fixture(scope="module")
def local_cluster():
    c = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    )
    client = distributed.Client(c)
    try:
        yield c, client
    finally:
        client.close()
        c.close()


def assert_same_analysis(a, b) -> None:
    for name in FRAMES:
        pd.testing.assert_frame_equal(
            getattr(a, name).reset_index(drop=True),
            getattr(b, name).reset_index(drop=True),
            obj=name,
        )
    assert a.comm == b.comm
    assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
    assert a.read == b.read


def test_dask_equals_local_and_uses_every_worker(run_dir: Path, local_cluster) -> None:
    c, client = local_cluster
    local = analyze(open_run(run_dir))
    on_dask = analyze(open_run(run_dir), dask=c.scheduler_address)
    assert local.engine == {"name": "duckdb"}
    assert on_dask.engine["name"] == "dask"
    workers = set(client.scheduler_info()["workers"])
    assert set(on_dask.engine["tasks_by_worker"]) == workers and len(workers) == 2
    assert on_dask.engine["tasks"] == sum(on_dask.engine["tasks_by_worker"].values()) >= 2
    assert_same_analysis(local, on_dask)
    assert list(on_dask.stragglers["rank"]) == [5]
    # a step window and a rank subset go through the same tasks
    sub_local = analyze(open_run(run_dir, ranks=frozenset({0, 2, 5, 7})), steps=(10, 30))
    sub_dask = analyze(
        open_run(run_dir, ranks=frozenset({0, 2, 5, 7})), steps=(10, 30), dask=c.scheduler_address
    )
    assert_same_analysis(sub_local, sub_dask)


def test_cli_local_cluster_prints_the_same_report(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["analyze", str(run_dir), "--json", str(tmp_path / "local.json")]) == 0
    local_out = capsys.readouterr().out
    args = ["analyze", str(run_dir), "--dask", "local:2", "--json", str(tmp_path / "dask.json")]
    assert cli.main(args) == 0
    dask_out = capsys.readouterr().out
    assert "engine: Dask (local): " in dask_out and "on 2 worker(s)" in dask_out

    def report_lines(out: str) -> list[str]:  # the report, without the note naming the file
        lines = out.splitlines()
        end = max(i for i, ln in enumerate(lines) if ln.startswith("summary:"))
        return [ln for ln in lines[:end] if not ln.startswith("engine:")]

    assert report_lines(dask_out) == report_lines(local_out)
    a = json.loads((tmp_path / "local.json").read_text())
    b = json.loads((tmp_path / "dask.json").read_text())
    assert b.pop("engine")["name"] == "dask" and a.pop("engine") == {"name": "duckdb"}
    assert a == b


def test_unreachable_scheduler_is_one_line(run_dir: Path, capsys, monkeypatch) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(hv_cluster, "CONNECT_TIMEOUT_S", 2.0)
    t0 = time.monotonic()
    assert cli.main(["analyze", str(run_dir), "--dask", f"tcp://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip()
    assert time.monotonic() - t0 < 30
    assert len(err.splitlines()) == 1, err
    assert f"cannot reach tcp://127.0.0.1:{port}" in err
    for bad in ("local:0", "local:x", "tcp://a b"):
        assert cli.main(["analyze", str(run_dir), "--dask", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--dask" in err, err


def test_an_address_that_is_not_a_scheduler_is_one_line_not_a_hang(
    run_dir: Path, capsys, monkeypatch, local_cluster
) -> None:
    """An HTTP server at the address (Python's http.server, or the Dask dashboard's port, a
    common slip) accepts the connection and never answers as a scheduler: one line, exit 2,
    within the connect timeout; a scheme this install cannot use (tls:// without a security
    configuration, ucx:// without ucx-py) is one line too (was: a hang, internal errors). And
    the process's next analysis on a real scheduler still runs: a Client left hanging on the
    HTTP server held Dask's process-wide loop lock, and the next cluster or client hung for
    ever (a notebook's next analysis; here, the next test's cluster)."""
    import http.server

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # Dask's handshake is a bad request: no log line
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    monkeypatch.setattr(hv_cluster, "CONNECT_TIMEOUT_S", 2.0)
    try:
        for address in (f"tcp://127.0.0.1:{port}", f"tls://127.0.0.1:{port}", "ucx://127.0.0.1:1"):
            t0 = time.monotonic()
            assert cli.main(["analyze", str(run_dir), "--dask", address]) == 2
            took = time.monotonic() - t0
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and f"cannot reach {address}" in err, err
            assert "internal error" not in err and took < 10, (err, took)
    finally:
        server.shutdown()
    cluster, _ = local_cluster
    box: dict = {}

    def after() -> None:
        box["a"] = analyze(open_run(run_dir), dask=cluster.scheduler_address)

    t = threading.Thread(target=after, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and "a" in box, "the next analysis on a real scheduler hung"


class _SlowTasks(distributed.WorkerPlugin):
    """A worker plugin that makes each task take at least ``delay_s`` (so a kill lands inside
    one). It sleeps in the executing thread, not the worker's event loop."""

    name = "hvtrace-test-slow"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def setup(self, worker) -> None:
        from hvtrace.analysis import cluster

        real = cluster.Engine.rank_pass
        delay = self.delay_s

        def slow(self, *args, **kwargs):
            time.sleep(delay)
            return real(self, *args, **kwargs)

        cluster.Engine.rank_pass = slow  # this worker process only


def _kill_a_busy_worker(client) -> int | None:
    """SIGKILL the process of a worker that is running a task; return its pid."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [w for w, keys in client.processing().items() if keys]
        if busy:
            time.sleep(0.3)  # inside the slowed task
            pid = client.run(os.getpid, workers=[busy[0]])[busy[0]]
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.05)
    return None


def _kill_during_analysis(run_dir: Path, box: dict) -> int | None:
    """Analyze ``run_dir`` on a fresh 2-worker LocalCluster whose tasks take a second each,
    SIGKILL a worker while it runs one, and wait (bounded) for the analysis to end. ``box``
    gets ``a`` (the Analysis) or ``err`` (the TraceError's line); returns the killed pid."""

    def go(address: str) -> None:
        try:
            box["a"] = analyze(open_run(run_dir), dask=address)
        except TraceError as exc:
            box["err"] = str(exc)

    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as c,
        distributed.Client(c) as client,
    ):
        client.register_plugin(_SlowTasks(1.0))
        t = threading.Thread(target=go, args=(c.scheduler_address,), daemon=True)
        t.start()
        pid = _kill_a_busy_worker(client)
        t.join(120)
        assert not t.is_alive(), "the analysis hung after a worker was killed"
    return pid


def test_worker_killed_mid_analysis_gives_the_right_answer(run_dir: Path) -> None:
    local = analyze(open_run(run_dir))
    box: dict = {}
    assert _kill_during_analysis(run_dir, box) is not None
    assert "err" not in box, box.get("err")
    assert_same_analysis(local, box["a"])


def test_task_that_kills_its_workers_is_one_line(run_dir: Path) -> None:
    import dask

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        box: dict = {}
        assert _kill_during_analysis(run_dir, box) is not None
    assert "a" not in box
    assert "KilledWorker" in box["err"] and "\n" not in box["err"]


def test_no_worker_left_is_one_line_not_a_hang(run_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(hv_cluster, "NO_WORKER_TIMEOUT_S", 3.0)
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=None) as c:
        t0 = time.monotonic()
        with pytest.raises(TraceError) as ei:
            analyze(open_run(run_dir), dask=c.scheduler_address)
    assert time.monotonic() - t0 < 60
    assert "has had no worker for 3 s" in str(ei.value)
    assert "\n" not in str(ei.value)


def test_damaged_file_is_salvaged_as_in_the_local_engine(tmp_path: Path, local_cluster) -> None:
    """DuckDB on the worker cannot read a damaged row group: the client salvages what the
    careful reader keeps and runs that group again, exactly as the local engine does."""
    import pyarrow.parquet as pq

    synth_module().write_synth_run(tmp_path, ranks=4, steps=30, tensors=4, row_group_rows=100)
    target = next(tmp_path.glob("rank00002-*.parquet"))
    assert pq.read_metadata(target).num_row_groups >= 3
    damage_row_group(target, 1)
    local = analyze(open_run(tmp_path))
    on_dask = analyze(open_run(tmp_path), dask=local_cluster[0].scheduler_address)
    assert any(target.name in p for p in on_dask.problems), on_dask.problems
    assert on_dask.problems == local.problems
    assert_same_analysis(local, on_dask)
