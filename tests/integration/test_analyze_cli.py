"""``hvtrace analyze`` on real 2-rank ``horovodrun --gloo`` runs: two jobs, both shared with other
modules (``conftest.py``): the slowed one with ``test_dashboard_browser.py``, the balanced one
with ``test_lockstep.py``.

The model is small (a few ms of compute per step) so that the 40 ms injected into rank 1's
forward stands out from the scheduling noise of a shared 2-core machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import analyze_cli as _cli
from helpers import describe

from hvtrace.analysis import analyze
from hvtrace.load import load_run

pytestmark = pytest.mark.horovod


@pytest.fixture(scope="module")
def slow_run(slow_rank1_run: Path) -> Path:
    """30 steps of a 3-layer, 256-wide MLP, rank 1 40 ms slower in its forward
    (``helpers.SLOW_RANK1_JOB``: shared with the dashboard's browser test, recorded once a
    session)."""
    return slow_rank1_run


@pytest.fixture(scope="module")
def balanced_run(clean_live_run) -> Path:
    """The demo with nothing injected (``helpers.CLEAN_LIVE_JOB``, 30 steps: the clean job of
    ``test_lockstep.py``, recorded once a session)."""
    return clean_live_run.trace


def test_names_the_slowed_rank_and_its_phase(slow_run):
    a = analyze(load_run(slow_run))
    assert a.stragglers["rank"].tolist() == [1], a.verdicts.to_string()
    s = a.stragglers.iloc[0]
    assert s["phase"] == "forward", a.verdicts.to_string()
    assert s["phase_excess_ms"] > 25, a.verdicts.to_string()
    assert s["last_share"] >= 0.75
    assert any(f.kind == "straggler" and "rank 1" in f.message for f in a.findings)


def test_balanced_run_names_nobody(balanced_run):
    a = analyze(load_run(balanced_run))
    # Nothing is injected: no rank does more work or is blocked. On 2 cores a rank may wait for
    # a CPU more than the other (Horovod's and hvtrace's threads share them): that may be named,
    # as contention only, never as a straggler in a phase.
    assert (a.stragglers["cause"] == "contention").all(), a.verdicts.to_string()
    assert not [f.message for f in a.findings if f.kind == "straggler"]


def test_analyze_command_end_to_end(slow_run, tmp_path):
    out = tmp_path / "summary.json"
    p = _cli(slow_run, "--json", out, "--csv", tmp_path / "csv")
    assert p.returncode == 0, describe(p)
    assert "Stragglers" in p.stdout and "clocks aligned" in p.stdout
    assert max(len(line) for line in p.stdout.splitlines()) <= 80
    d = json.loads(out.read_text())
    for key in ("ranks", "steps", "per_rank", "stragglers", "findings", "clock", "problems"):
        assert key in d
    assert d["ranks"] == [0, 1]
    assert {k: d["stragglers"][0][k] for k in ("rank", "phase")} == {"rank": 1, "phase": "forward"}
    # rank 1 sleeps in its forward: blocked, neither on a CPU nor waiting for one
    assert d["stragglers"][0]["cause"] == "blocked", d["stragglers"][0]
    assert d["stragglers"][0]["blocked_ms"] > 0.6 * d["stragglers"][0]["phase_excess_ms"]
    assert set(d["stragglers"][0]) >= {"rank", "host", "late_ms", "last_share", "phase"}
    assert (tmp_path / "csv" / "spans.csv").is_file()


def test_analyze_command_bad_dir(tmp_path):
    p = _cli(tmp_path / "no-such-run")
    assert p.returncode == 2, describe(p)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "hvtrace: error:" in lines[0], describe(p)
    assert "Traceback" not in p.stderr
