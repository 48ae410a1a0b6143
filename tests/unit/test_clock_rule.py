"""One clock-alignment rule (:func:`hvtrace.clock.step_offsets`), used by every reader of spans.

Each (rank, step) moves by one offset, the rank's estimates interpolated at the step's first
span that is a step's work: a step keeps its shape (durations exact, order kept) and drift is
corrected from step to step. The span frame (``load_run``), the engine's step table, the
dashboard's timeline window, the Perfetto export and the Horovod timeline's merge all align by
it; on a run whose clocks drift they must give the very same times, to the nanosecond.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from helpers import synth_module

from hvtrace.analysis import analyze
from hvtrace.analysis.engine import window_spans
from hvtrace.clock import ClockEstimate, step_offsets
from hvtrace.load import open_run, span_sources
from hvtrace.selection import StepRange

MS = 1_000_000


def _drift(offset0_ns: int, at0_ns: int, ppm: float, span_ns: int) -> list[ClockEstimate]:
    """Two estimates ``span_ns`` apart whose offset grows by ``ppm`` parts per million."""
    return [
        ClockEstimate(at0_ns, offset0_ns, 1000, 8),
        ClockEstimate(at0_ns + span_ns, offset0_ns + int(span_ns * ppm / 1e6), 1000, 8),
    ]


def test_a_step_moves_by_one_offset_at_its_first_span_of_work() -> None:
    clock = _drift(5 * MS, 0, 100.0, 10_000 * MS)  # 100 ppm: 1 us per 10 ms
    rank = np.zeros(6, np.int64)
    step = np.array([1, 1, 1, 2, 2, 3])
    start = np.array([900, 1000, 1005, 2000, 2010, 3000]) * MS
    work = np.array([False, True, True, True, True, False])  # a scalar first; step 3 scalars only
    off, cells = step_offsets({0: clock}, rank, step, start, work)
    # step 1 is anchored at its first span of work (1000 ms), not at the scalar before it
    expect1 = 5 * MS + 1000 * MS * 100 // 1_000_000
    assert off[0] == off[1] == off[2] == expect1
    # step 2 at 2000 ms: drift corrected from step to step
    assert off[3] == off[4] == 5 * MS + 2000 * MS * 100 // 1_000_000
    # a step of scalars alone: at its first scalar
    assert off[5] == 5 * MS + 3000 * MS * 100 // 1_000_000
    assert cells.tolist() == [[0, 1, expect1], [0, 2, off[3]], [0, 3, off[5]]]
    # input order does not matter
    p = np.array([5, 3, 0, 4, 2, 1])
    off_p, _ = step_offsets({0: clock}, rank[p], step[p], start[p], work[p])
    assert off_p.tolist() == off[p].tolist()
    # a rank without estimates does not move
    off_none, _ = step_offsets({}, rank, step, start, work)
    assert not off_none.any()


def test_every_reader_aligns_a_drifting_run_to_the_same_nanosecond(tmp_path: Path) -> None:
    synth = synth_module()
    synth.write_synth_run(tmp_path, ranks=3, steps=30, tensors=4, slow_rank=-1)
    run = open_run(tmp_path)
    for r, rf in run.files.items():  # rank 1 and 2 drift apart at 50 / -80 ppm
        if r:
            t0 = int(rf.header["mono_anchor_ns"])
            rf.clock[:] = _drift(r * 3 * MS, t0, 50.0 if r == 1 else -80.0, 60_000 * MS)
    frame = run.spans.sort_values(["rank", "step", "start_ns", "end_ns"]).reset_index(drop=True)
    # the engine's step table: each (rank, step)'s step span where the frame has it
    a = analyze(run)
    st = a.steps.set_index(["rank", "step"])
    steps = frame[frame["kind"] == "step"].set_index(["rank", "step"])
    both = steps.index.intersection(st.index)
    assert len(both) == 3 * 30
    assert (st.loc[both, "start_ns"].to_numpy() == steps.loc[both, "start_ns"].to_numpy()).all()
    assert (st.loc[both, "end_ns"].to_numpy() == steps.loc[both, "end_ns"].to_numpy()).all()
    # the dashboard's timeline window: the same spans at the same times
    win = window_spans(span_sources(run), StepRange(10, 14))
    ref = frame[frame["step"].between(10, 13)]
    key = ["rank", "step", "start_ns", "end_ns"]
    w = win.sort_values(key)[key].to_numpy()
    assert len(w) == len(ref) and (w == ref[key].to_numpy()).all()
    # and a span's duration is what its rank measured: drift moves steps, never stretches spans
    local = pq.read_table(run.files[2].path, columns=["start_ns", "end_ns"])
    dur_local = np.sort(local.column("end_ns").to_numpy() - local.column("start_ns").to_numpy())
    f2 = frame[frame["rank"] == 2]
    assert (np.sort((f2["end_ns"] - f2["start_ns"]).to_numpy()) == dur_local).all()
