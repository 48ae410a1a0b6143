"""The analyzer on the real sample traces (sample_traces/, recorded with horovodrun --gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvtrace.analysis import analyze
from hvtrace.load import load_run

SAMPLES = Path(__file__).resolve().parents[2] / "sample_traces"


def test_balanced_run_names_nobody() -> None:
    a = analyze(load_run(SAMPLES / "balanced_2rank"))
    assert a.stragglers.empty, a.stragglers


@pytest.mark.parametrize(
    ("sample", "rank", "phases", "injected_ms"),
    [
        ("slow_rank1_forward_2rank", 1, {"forward"}, 40.0),
        # the sleep sits inside the example's hvtrace.span("data"), itself in the input gap
        ("slow_rank2_input_4rank", 2, {"data", "input"}, 30.0),
    ],
)
def test_slowed_rank_is_named_with_its_phase(
    sample: str, rank: int, phases: set[str], injected_ms: float
) -> None:
    run = load_run(SAMPLES / sample)
    a = analyze(run)
    assert a.stragglers["rank"].tolist() == [rank]
    row = a.stragglers.iloc[0]
    assert row["phase"] in phases
    assert row["host"] == run.hosts[rank]
    # the phase excess is the injected delay, within the noise of a 2-core machine
    assert injected_ms * 0.75 <= row["phase_excess_ms"] <= injected_ms * 1.5
    assert row["last_share"] >= 0.75
