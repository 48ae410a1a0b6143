"""``hvtrace analyze RUN --tensorboard DIR``: the per-step table, as TensorBoard reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hvtrace.analysis import analyze
from hvtrace.cli import main
from hvtrace.format.tensorboard import SCALARS
from hvtrace.load import load_run

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "slow_rank2_input_4rank"

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(d: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(d))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_every_step_of_the_analysis_is_a_point_of_each_scalar(tmp_path: Path, capsys) -> None:
    assert main(["analyze", str(SAMPLE), "--tensorboard", str(tmp_path / "tb")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the note is wrapped at 80 columns
    assert f"tensorboard: per-step scalars in {tmp_path / 'tb'}" in out
    got = _read(tmp_path / "tb")
    assert set(got) == set(SCALARS)
    ps = load_run(SAMPLE)
    per_step = analyze(ps).per_step.set_index("step")
    for tag, (col, _) in SCALARS.items():
        steps = [s for s, _ in got[tag]]
        assert steps == sorted(per_step.index[per_step[col].notna()]), tag
        assert [v for _, v in got[tag]] == pytest.approx(
            per_step.loc[steps, col].astype(float).tolist(), rel=1e-6
        ), tag
    late = [int(v) for _, v in got["hvtrace/late_rank"]]
    assert late.count(2) >= 0.9 * len(late)  # the sample's slow rank


def test_a_file_where_the_directory_should_be_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    f = tmp_path / "tb"
    f.write_text("mine")
    assert main(["analyze", str(SAMPLE), "--tensorboard", str(f)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not a directory" in err and "Traceback" not in err
    assert f.read_text() == "mine"
