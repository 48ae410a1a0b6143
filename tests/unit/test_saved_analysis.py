"""Saved analyses (:mod:`hvtrace.analysis.saved`): a finished run analyzed once is read back whole,
under a key that changes with anything the analysis depends on, from the user's own private
directory only; the dashboard opens a saved run without analyzing it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers import synth_module

from hvtrace.analysis import analyze, saved
from hvtrace.cli import main
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.load import open_run


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("HVTRACE_CACHE_DIR", str(d))
    monkeypatch.delenv("HVTRACE_CACHE", raising=False)
    return d


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    synth_module().write_synth_run(d, ranks=4, steps=30, tensors=4, slow_rank=2)
    return d


def _doc(a) -> str:
    return json.dumps(analysis_to_dict(a), sort_keys=True, default=str)


def test_an_analysis_comes_back_whole(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    a = analyze(run)
    key = saved.default_key(run)
    entry = saved.save_analysis(a, key)
    assert entry is not None and entry.parent == cache
    assert (os.stat(cache).st_mode & 0o777) == 0o700
    b = saved.load_analysis(key)
    assert format_report(b) == format_report(a)
    assert _doc(b) == _doc(a)
    assert b.steps.equals(a.steps)
    # only the columns asked for
    c = saved.load_analysis(key, ["rank", "step", "step_ns", "no such column"])
    assert list(c.steps.columns) == ["rank", "step", "step_ns"] and len(c.steps) == len(a.steps)
    assert list(c.stragglers["rank"]) == [2]


def test_the_key_follows_the_files_and_the_options(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    key = saved.default_key(run)
    assert key == saved.default_key(open_run(run_dir))
    assert key != saved.run_key(run, steps=None, skip_steps=2, horovod_timeline=None)
    assert key != saved.default_key(open_run(run_dir, ranks=frozenset({0, 1})))
    f = sorted(run_dir.glob("rank*"))[1]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a rank file rewritten
    assert saved.default_key(open_run(run_dir)) != key


def test_a_run_still_being_written_is_not_saved(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    a = analyze(run)
    a.in_progress = True
    assert saved.save_analysis(a, saved.default_key(run)) is None
    assert not cache.exists() or not any(cache.iterdir())


def test_an_entry_others_can_write_is_not_read(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    key = saved.default_key(run)
    entry = saved.save_analysis(analyze(run), key)
    assert saved.load_analysis(key) is not None
    os.chmod(entry / "analysis.pkl", 0o666)  # anyone could have replaced it
    assert saved.load_analysis(key) is None
    os.chmod(entry / "analysis.pkl", 0o600)
    assert saved.load_analysis(key) is not None
    os.chmod(cache, 0o777)  # the directory itself
    assert saved.load_analysis(key) is None
    assert saved.save_analysis(analyze(run), key) is None
    os.chmod(cache, 0o700)
    # a link in place of an entry is not followed
    other = cache.parent / "elsewhere"
    os.rename(entry, other)
    os.symlink(other, entry)
    assert saved.load_analysis(key) is None


def test_a_damaged_entry_is_a_miss(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    key = saved.default_key(run)
    entry = saved.save_analysis(analyze(run), key)
    (entry / "analysis.pkl").write_bytes(b"not a pickle")
    assert saved.load_analysis(key) is None


def test_off_means_nothing_written(
    cache: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HVTRACE_CACHE", "0")
    run = open_run(run_dir)
    assert saved.cache_dir() is None
    assert saved.save_analysis(analyze(run), saved.default_key(run)) is None
    assert not cache.exists()


def test_old_entries_are_trimmed(cache: Path, run_dir: Path) -> None:
    run = open_run(run_dir)
    a = analyze(run)
    keys = [f"{i:032x}" for i in range(saved.MAX_ENTRIES + 3)]
    for i, k in enumerate(keys):
        entry = saved.save_analysis(a, k)
        past = time.time() - 1000 + i
        os.utime(entry, (past, past))
    left = sorted(p.name for p in cache.iterdir())
    assert len(left) == saved.MAX_ENTRIES
    assert left == sorted(keys[-saved.MAX_ENTRIES :])  # the least recently used went


def test_analyze_keeps_it_and_the_dashboard_reads_it(
    cache: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``hvtrace analyze`` (default options) keeps the analysis; the dashboard's data of the
    run is then made from it, the engine never called."""
    from hvtrace_dashboard import app as dash_app

    assert main(["analyze", str(run_dir)]) == 0
    capsys.readouterr()
    run = open_run(run_dir)
    assert saved.load_analysis(saved.default_key(run)) is not None
    # with --steps, nothing is kept under the default key's place
    assert main(["analyze", str(run_dir), "--steps", "5:9"]) == 0
    capsys.readouterr()
    assert len(list(cache.iterdir())) == 1

    import hvtrace.analysis as analysis_pkg

    def no_analysis(*a, **k):
        raise AssertionError("analyzed again")

    monkeypatch.setattr(analysis_pkg, "analyze", no_analysis)
    data = dash_app._saved_data(run, spans=10)
    assert data is not None
    assert data.straggler_ranks == [2]
    assert set(data.heat) == {"lateness", "step", "compute"}
    assert data.heat["step"].shape == (4, 30)


def test_a_big_run_is_analyzed_in_a_child_process(
    cache: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past CHILD_ANALYSIS_SPANS spans, a run with no saved analysis is analyzed by a child
    process that keeps it; the server reads what the page shows."""
    from hvtrace_dashboard import app as dash_app

    run = open_run(run_dir)
    pids = []
    real = dash_app._analyze_in_child

    def spy(run_, key):
        ok = real(run_, key)
        pids.append(ok)
        return ok

    monkeypatch.setattr(dash_app, "_analyze_in_child", spy)
    data = dash_app._saved_data(run, spans=dash_app.CHILD_ANALYSIS_SPANS + 1)
    assert pids == [True]
    assert data is not None and data.straggler_ranks == [2]
    assert saved.load_analysis(saved.default_key(run)) is not None
