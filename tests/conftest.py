"""Shared pytest setup.

- ``tests/`` is put on ``sys.path`` so test modules can ``import helpers``.
- Tests marked ``horovod`` are skipped, with the reason, when real Horovod runs are impossible
  (no ``horovodrun`` or no ``horovod.torch``); they never fall back to a fake Horovod.
- Tests marked ``gpu`` are skipped without a CUDA device.
- After every test the process-wide active recorder is reset, so one test's recorder never
  records another test's spans.
- Saved analyses go to a temporary directory of the session (``HVTRACE_CACHE_DIR``).
- Tests marked ``timing`` measure this process's CPU time or run-queue wait: they need the cores
  to themselves, so an xdist worker (``-n``: another worker beside it) leaves them out and
  ``--timing-tests=only`` runs them alone afterwards (``make unit`` and ``make test`` do both);
  ``--timing-tests=skip`` leaves them out anywhere.
- ``--busy-neighbour`` (``make test-busy``): a process keeps one core busy for the whole session,
  free to move between cores, as another job or a browser does on a user's machine; a test that
  depends on timing must pass with it (issue 39).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from helpers import horovod_unavailable_reason  # noqa: E402

# the saved analyses (hvtrace.analysis.saved) of this session's runs go to a directory of its
# own, never the user's cache (every subprocess, horovodrun's ranks included, inherits it)
if "HVTRACE_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HVTRACE_CACHE_DIR"] = tempfile.mkdtemp(prefix="hvtrace-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HVTRACE_CACHE_DIR"], True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--busy-neighbour",
        action="store_true",
        help="keep one core busy with another process for the whole session (a busy machine)",
    )
    parser.addoption(
        "--quick",
        action="store_true",
        help="leave out the unit tests listed in tests/unit/slow_tests.txt (make unit: the quick "
        "loop; make test runs them all)",
    )
    parser.addoption(
        "--timing-tests",
        choices=("auto", "skip", "only"),
        default="auto",
        help="tests marked timing (they measure CPU time: no other test may run beside them): "
        "auto runs them except on an xdist worker, skip leaves them out, only runs them alone",
    )


@pytest.fixture(scope="session", autouse=True)
def _busy_neighbour(request: pytest.FixtureRequest):
    """With ``--busy-neighbour``: a process spinning on one core (free to move) meanwhile."""
    if not request.config.getoption("--busy-neighbour"):
        yield
        return
    import subprocess
    import time

    p = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.2)
    assert p.poll() is None, "the busy neighbour did not start"
    try:
        yield
    finally:
        p.kill()
        p.wait()


def _select_timing_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests marked ``timing`` or all others, as ``--timing-tests`` says (auto:
    leave them out on an xdist worker, whose fellow workers run beside it)."""
    mode = config.getoption("--timing-tests")
    if mode == "auto":
        mode = "skip" if hasattr(config, "workerinput") else "run"
    if mode == "run":
        return
    want = mode == "only"
    keep, drop = [], []
    for it in items:
        (keep if bool(it.get_closest_marker("timing")) == want else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from helpers import LAUNCHES

    if LAUNCHES:  # (in this process: none under xdist, whose workers run the tests)
        by: dict[str, list[float]] = {}
        for label, wall_s in LAUNCHES:
            by.setdefault(label, []).append(wall_s)
        terminalreporter.write_line(
            "jobs launched through tests/helpers.run_job: "
            + "; ".join(f"{k} {len(v)}, {sum(v):.0f} s" for k, v in sorted(by.items()))
        )
    if config.getoption("--quick"):
        terminalreporter.write_line(
            "--quick: the unit tests listed in tests/unit/slow_tests.txt were left out "
            "(make test runs them)"
        )
    if config.getoption("--timing-tests") == "auto" and getattr(config.option, "numprocesses", 0):
        terminalreporter.write_line(
            "note: the xdist workers left out the tests marked timing; "
            "`pytest tests/unit --timing-tests=only` runs them (make unit and make test do)"
        )


#: The unit tests ``--quick`` leaves out (``scripts/slow_tests.py`` writes it from a measured run).
SLOW_TESTS = Path(__file__).resolve().parent / "unit" / "slow_tests.txt"


def _leave_out_slow_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--quick``, deselect the tests listed in :data:`SLOW_TESTS` (``path::name``: every
    parametrization of it)."""
    if not config.getoption("--quick"):
        return
    lines = SLOW_TESTS.read_text().splitlines() if SLOW_TESTS.is_file() else []
    slow = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    keep, drop = [], []
    for it in items:
        (drop if it.nodeid.split("[", 1)[0] in slow else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _select_timing_tests(config, items)
    _leave_out_slow_tests(config, items)
    horovod_items = [it for it in items if it.get_closest_marker("horovod")]
    if horovod_items:
        reason = horovod_unavailable_reason()
        if reason:
            for it in horovod_items:
                it.add_marker(pytest.mark.skip(reason=f"needs real Horovod: {reason}"))
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if gpu_items:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            for it in gpu_items:
                it.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none available)"))


@pytest.fixture(autouse=True)
def _reset_active_recorder():
    """Leave no active hvtrace recorder behind a test."""
    yield
    mod = sys.modules.get("hvtrace.record.recorder")
    if mod is not None and mod.active_recorder() is not None:
        rec = mod.active_recorder()
        mod._set_active(None)
        try:
            rec.close()
        except Exception:  # noqa: BLE001 - cleanup only
            pass
