"""``hvtrace diff`` (issue 36): what changed between two runs, and where it went.

Synthetic runs whose difference is known (a rank slowed in one phase, a tensor resized or added,
a Horovod setting changed, a world size changed) and the sample runs through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from analysis_frames import synth_spans
from helpers import REPO_ROOT

from hvtrace.analysis import analyze_spans
from hvtrace.analysis.diff import block_length, block_resample_index, diff_runs
from hvtrace.cli import main
from hvtrace.export.diff import diff_to_dict, format_diff

SAMPLES = REPO_ROOT / "sample_traces"


def _run(**kw):
    args = {"ranks": 2, "steps": 120, "noise": 0.03, "seed": 1} | kw
    env = args.pop("env", None)
    return analyze_spans(synth_spans(**args), horovod_env=env)


def test_a_slowed_phase_is_the_change_and_the_parts_add_up() -> None:
    a = _run()
    b = _run(seed=2, slow_ranks=(1,), slow_phase="backward", slow_ms=6.0)
    d = diff_runs(a, b)
    s = d.step
    assert s["significant"] and s["delta_ms"] > 4.0, s
    lo, hi = s["ci_ms"]
    assert lo > 0 and lo <= s["delta_ms"] <= hi
    parts = d.parts.set_index("part")
    # rank 1's backward is 6 ms longer: the mean over both ranks' steps +3 ms; rank 0 waits
    assert parts.at["backward", "delta_ms"] == pytest.approx(3.0, abs=0.6)
    assert parts.at["wait", "delta_ms"] > 1.0
    assert parts["delta_ms"].sum() == pytest.approx(s["mean_b_ms"] - s["mean_a_ms"], abs=1e-6)
    assert list(d.ranks["rank"]) == [1] and d.ranks.iloc[0]["status"] == "new"
    assert d.ranks.iloc[0]["phase_b"] == "backward"
    text = format_diff(d)
    assert "slower: a significant change" in text
    assert "rank 1 became a straggler in B: backward" in text


def test_the_same_job_twice_is_no_significant_change() -> None:
    d = diff_runs(_run(seed=3), _run(seed=4))
    assert not d.step["significant"], d.step
    assert d.ranks.empty and not d.config
    assert "no significant change" in format_diff(d)


def test_a_small_steady_change_is_below_the_practical_floor() -> None:
    """A 0.5 % change, measured precisely (no noise), is real but under MIN_REL_CHANGE (1 %)."""
    a = _run(noise=0.0)
    b = analyze_spans(synth_spans(ranks=2, steps=120, noise=0.0, seed=1, scale=1.005))
    d = diff_runs(a, b)
    assert 0 < d.step["rel"] < 0.01 and not d.step["significant"], d.step
    assert "under 1% of A's step" in format_diff(d)


def test_tensors_new_gone_and_resized() -> None:
    a = _run(tensors=4)
    b_spans = synth_spans(ranks=2, steps=120, noise=0.03, seed=2, tensors=5)
    b_spans.loc[b_spans["name"] == "layer0.weight", "bytes"] *= 2
    b = analyze_spans(b_spans)
    t = diff_runs(a, b).tensors.set_index("name")
    assert t.at["layer4.weight", "status"] == "new"
    assert t.at["layer0.weight", "status"] == "resized"
    assert t.at["layer0.weight", "bytes_b"] == 2 * t.at["layer0.weight", "bytes_a"]
    assert t.at["layer1.weight", "status"] == ""
    c = diff_runs(b, a).tensors.set_index("name")
    assert c.at["layer4.weight", "status"] == "gone"


def test_configuration_changes_are_named_and_launch_details_are_not() -> None:
    env_a = {"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234"}
    env_b = {"HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_GLOO_RENDEZVOUS_PORT": "5678"}
    d = diff_runs(_run(env=env_a), _run(seed=2, env=env_b))
    assert d.config == [("HOROVOD_FUSION_THRESHOLD", "67108864", "33554432")]
    assert "HOROVOD_FUSION_THRESHOLD: 67108864 -> 33554432" in format_diff(d)


def test_runs_of_different_world_size_are_compared_per_rank_step_and_say_so() -> None:
    d = diff_runs(_run(ranks=2), _run(ranks=4, seed=2))
    assert any("different world sizes (2 and 4 ranks)" in n for n in d.notes)
    assert ("world size", 2, 4) in d.config
    js = json.loads(json.dumps(diff_to_dict(d)))
    assert js["notes"] and js["config"][0]["what"] == "world size"


def test_the_block_bootstrap_resamples_whole_blocks_within_the_series() -> None:
    assert block_length(8) == 2 and block_length(200) == 20 and block_length(10_000) == 1000
    idx = block_resample_index(200, 50, np.random.default_rng(0))
    assert idx.shape == (50, 200) and idx.min() >= 0 and idx.max() < 200
    step = np.diff(idx[0]) % 200
    assert (step == 1).mean() > 0.9  # mostly consecutive: blocks of 20 steps


def test_the_cli_compares_two_sample_runs(tmp_path: Path, capsys) -> None:
    a, b = SAMPLES / "balanced_2rank", SAMPLES / "slow_rank1_forward_2rank"
    out = tmp_path / "diff.json"
    assert main(["diff", str(a), str(b), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("hvtrace diff: A = run ") and "Where it went" in text
    assert "rank 1 became a straggler in B: forward" in text
    js = json.loads(out.read_text())
    assert js["step"]["significant"] and js["step"]["delta_ms"] > 0
    assert {p["part"] for p in js["parts"]} >= {"forward", "backward", "wait", "other"}
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
