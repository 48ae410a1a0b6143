"""``hvtrace run``'s launcher command line: an ``mpirun`` is told to pass the tracing variables
on to its ranks (ranks on other hosts do not inherit the launcher's environment), in its own
dialect; other launchers are left as they are."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from hvtrace.launch import boot_site_dir, launcher_command


def _fake_launcher(tmp_path: Path, name: str, version: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


ENV = {"HVTRACE_DIR": "/runs/a", "HVTRACE_LIVE_EVERY": "20", "PATH": os.environ["PATH"]}


def test_open_mpi_gets_x_for_each_tracing_variable(tmp_path: Path) -> None:
    mpirun = _fake_launcher(tmp_path, "mpirun", "mpirun (Open MPI) 4.1.4")
    cmd = [mpirun, "-np", "2", "python", "train.py"]
    assert launcher_command(cmd, ENV) == [
        mpirun, "-x", "HVTRACE_DIR", "-x", "HVTRACE_LIVE_EVERY", "-np", "2", "python", "train.py",
    ]  # fmt: skip


def test_mpich_gets_one_genvlist(tmp_path: Path) -> None:
    mpiexec = _fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 4.0")
    got = launcher_command([mpiexec, "-n", "2", "python", "t.py"], ENV)
    assert got == [
        mpiexec,
        "-genvlist",
        "HVTRACE_DIR,HVTRACE_LIVE_EVERY",
        "-n",
        "2",
        "python",
        "t.py",
    ]


def test_the_fallback_hook_path_is_passed_on_too(tmp_path: Path) -> None:
    mpirun = _fake_launcher(tmp_path, "mpirun", "mpirun (Open MPI) 5.0.3")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(boot_site_dir()), "/theirs"])}
    got = launcher_command([mpirun, "python", "t.py"], env)
    assert got[:7] == [mpirun, "-x", "HVTRACE_DIR", "-x", "HVTRACE_LIVE_EVERY", "-x", "PYTHONPATH"]


def test_an_unknown_mpirun_is_left_alone_with_a_warning(tmp_path: Path, caplog) -> None:
    mpirun = _fake_launcher(tmp_path, "mpirun", "Intel(R) MPI Library")
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert launcher_command([mpirun, "python", "t.py"], ENV) == [mpirun, "python", "t.py"]
    assert "HVTRACE_DIR" in caplog.text and "other hosts" in caplog.text


@pytest.mark.parametrize("launcher", ["horovodrun", "python", "ray", "srun"])
def test_other_launchers_are_left_as_they_are(launcher: str) -> None:
    cmd = [launcher, "-np", "2", "python", "train.py"]
    assert launcher_command(cmd, ENV) == cmd
