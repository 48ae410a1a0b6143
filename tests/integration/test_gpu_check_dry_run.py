"""scripts/gpu_check.sh --dry-run: the GPU check's jobs, profile and comparison run here on the
CPU with the real Horovod (issue 38: the preparation must pass in CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.horovod


def test_the_dry_run_traces_profiles_and_compares(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    jobs = {j["model"]: j for j in results["jobs"]}
    assert set(jobs) == {"tiny", "tiny@host"}
    tiny = jobs["tiny"]
    assert tiny["job"]["traced"] and tiny["analyze_rc"] == 0 and tiny["ab"]["pairs"] == 2
    # with no device, each traced step's forward and backward spans against its own host marks:
    # the step numbers and the clock tie are what is checked
    cmp_ = tiny["compare"]
    assert cmp_["against"] == "host marks"
    for kind in ("forward", "backward"):
        assert cmp_["phases"][kind]["compared"] == 3, cmp_["phases"][kind]
        assert abs(cmp_["phases"][kind]["start_diff_median_us"]) < 1_000
    assert cmp_["syncs_per_step"] == {"untraced": 0, "traced": 0}
    summary = (out / "summary.txt").read_text()
    assert "tiny: hvtrace analyze rc=0" in summary and "tiny@host: timing=host_monotonic" in summary
    assert (out / "gc_tiny.tar.gz").stat().st_size > 0
