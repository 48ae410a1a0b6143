"""Consistency across ranks, analysis side, on hand-made frames and trace files.

Scalar rows under the reserved names (``hvtrace.param|``, ``hvtrace.lr|``, ``hvtrace.monitor|``,
``hvtrace.metric|``) and user scalars flagged :data:`~hvtrace.format.schema.FLAG_AGREE` are compared
across ranks per (step, name); the first differing step of each kind becomes a ``divergence``
finding, first after hangs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from analysis_frames import synth_spans
from helpers import make_header, write_rank_file

from hvtrace.analysis import consistency
from hvtrace.analysis.summary import analyze, analyze_spans
from hvtrace.export.jsondoc import analysis_to_dict
from hvtrace.export.report import format_report
from hvtrace.format.schema import FLAG_AGREE, KIND_CODE
from hvtrace.load import open_run, span_sources
from hvtrace.selection import StepRange

TENSORS = ["net.0.weight", "net.0.bias", "net.2.weight"]


def _scalars(rows: list[tuple]) -> pd.DataFrame:
    """Scalar rows ``(rank, step, name, value[, flags])`` as spans (start at step * 1 ms)."""
    recs = []
    for r in rows:
        rank, step, name, value, *rest = r
        t = 1_000_000_000 * 1_000_000 + step * 1_000_000 + len(recs)
        recs.append(
            {
                "rank": rank,
                "step": step,
                "micro": 0,
                "kind": "scalar",
                "name": name,
                "start_ns": t,
                "end_ns": t,
                "bytes": 0,
                "dtype": "",
                "value": float(value),
                "flags": rest[0] if rest else 0,
            }
        )
    return pd.DataFrame(recs)


def _consistent(
    ranks: int = 2,
    steps: int = 20,
    every: int = 5,
    fp: dict | None = None,
    lr: dict | None = None,
) -> list[tuple]:
    """Rows of a run whose ranks agree, except ``fp`` {(rank, step, tensor): value} and ``lr``
    {(rank, step): lr} overrides."""
    fp, lr = fp or {}, lr or {}
    rows = []
    for r in range(ranks):
        for s in range(steps):
            rows.append((r, s, "hvtrace.lr|0", lr.get((r, s), 0.1)))
            if s % every == 0:
                for i, t in enumerate(TENSORS):
                    rows.append((r, s, f"hvtrace.param|{t}", fp.get((r, s, t), 1000.0 * i + s)))
    return rows


def _analyze(rows: list[tuple], ranks: int = 2, steps: int = 20) -> object:
    spans = synth_spans(ranks=ranks, steps=steps, tensors=2)
    sc = _scalars(rows)
    both = pd.concat([spans.astype({"kind": str, "name": str, "dtype": str}), sc])
    return analyze_spans(both.reset_index(drop=True))


def _divs(a: object, what: str | None = None) -> list:
    return [
        f for f in a.findings if f.kind == "divergence" and (what is None or f.data["what"] == what)
    ]


def test_a_consistent_run_is_clean_and_says_what_was_checked() -> None:
    a = _analyze(_consistent())
    assert not _divs(a), [f.message for f in a.findings]
    c = a.consistency
    assert c["checked"] and c["divergences"] == []
    assert c["parameters"]["checks"] == 4 and c["parameters"]["steps"] == [0, 5, 10, 15]
    assert c["parameters"]["tensors"] == len(TENSORS)
    assert c["lr"] == {"steps": 20, "groups": 1}
    js = analysis_to_dict(a)
    assert js["consistency"]["parameters"]["checks"] == 4


def test_weights_changed_on_one_rank_name_the_first_check_and_the_tensor() -> None:
    # rank 1's net.2.weight differs from the check at step 10 on
    fp = {(1, s, "net.2.weight"): -1.0 - s for s in (10, 15)}
    a = _analyze(_consistent(fp=fp))
    (d,) = _divs(a)
    assert a.findings[0] is d  # first: no hang here
    assert d.severity == "warning"
    assert d.data["what"] == "parameters" and d.data["step"] == 10
    assert d.data["names"] == ["net.2.weight"]
    assert d.data["ranks"] == [1] and d.data["last_equal_step"] == 5
    assert d.data["steps_differing"] == 2
    assert "step 10" in d.message and "net.2.weight" in d.message
    assert "broadcast_parameters" not in d.message
    # the report puts it at the top, before the tables
    text = format_report(a)
    assert text.index("divergence at step 10") < text.index("Where each step's time goes")


def test_weights_differing_at_step_zero_say_broadcast_parameters_is_missing() -> None:
    fp = {(1, s, t): 7.0 + s for s in (0, 5, 10, 15) for t in TENSORS}
    a = _analyze(_consistent(fp=fp))
    (d,) = _divs(a)
    assert d.data["step"] == 0 and d.data["first_check"] == 0
    assert sorted(d.data["names"]) == sorted(TENSORS)
    assert "hvd.broadcast_parameters" in d.message and "before any update" in d.message


def test_learning_rates_driven_apart_name_lr_the_step_the_ranks_and_values() -> None:
    lr = {(2, s): 0.05 for s in range(12, 20)}
    a = _analyze(_consistent(ranks=4, lr=lr), ranks=4)
    (d,) = _divs(a, "lr")
    assert d.data["step"] == 12 and d.data["names"] == ["lr"] and d.data["groups"] == [0]
    assert d.data["ranks"] == [2] and d.data["reference_rank"] == 0
    assert d.data["values"]["0"] == {"0": 0.1, "1": 0.1, "2": 0.05, "3": 0.1}
    assert "lr" in d.message and "step 12" in d.message


def test_divergences_are_ordered_by_step() -> None:
    lr = {(1, s): 0.05 for s in range(7, 20)}
    fp = {(1, s, "net.0.bias"): -1.0 for s in (10, 15)}
    a = _analyze(_consistent(lr=lr, fp=fp))
    ds = _divs(a)
    assert [(f.data["what"], f.data["step"]) for f in ds] == [("lr", 7), ("parameters", 10)]
    assert a.findings[:2] == ds


def test_agreed_user_scalars_are_compared_and_others_are_not() -> None:
    rows = _consistent()
    for r in range(2):
        for s in range(20):
            rows.append((r, s, "epoch", s // 5 + (r if s >= 8 else 0), FLAG_AGREE))
            rows.append((r, s, "loss", float(r + s)))  # a rank's own value: not compared
    a = _analyze(rows)
    (d,) = _divs(a)
    assert d.data["what"] == "values" and d.data["step"] == 8 and d.data["names"] == ["epoch"]
    assert d.data["values"]["epoch"] == {"0": 1.0, "1": 2.0}
    assert "loss" not in d.data["names"]


def test_nan_on_one_rank_differs_and_a_value_of_one_rank_alone_does_not() -> None:
    rows = _consistent()
    rows += [(0, 3, "metric", 1.0, FLAG_AGREE), (1, 3, "metric", math.nan, FLAG_AGREE)]
    rows += [(0, 4, "solo", 5.0, FLAG_AGREE)]  # only rank 0 recorded it
    a = _analyze(rows)
    (d,) = _divs(a)
    assert d.data["step"] == 3 and d.data["names"] == ["metric"]
    assert d.data["values"]["metric"] == {"0": 1.0, "1": None}


def test_a_value_recorded_twice_in_a_step_is_compared_occurrence_by_occurrence() -> None:
    rows = _consistent()
    for r in range(2):  # two different values in one step, the same on both ranks
        rows += [(r, 6, "stage", 1.0, FLAG_AGREE), (r, 6, "stage", 2.0, FLAG_AGREE)]
    assert not _divs(_analyze(rows))


def test_monitored_metric_and_logged_metrics() -> None:
    rows = _consistent()
    for r in range(2):
        rows.append((r, 9, "hvtrace.monitor|val_loss", 1.25 + r / 100, FLAG_AGREE))
        rows.append((r, 9, "hvtrace.metric|val_loss", 1.25 + r / 100, FLAG_AGREE))
        rows.append((r, 9, "hvtrace.metric|epoch", 0.0, FLAG_AGREE))
    a = _analyze(rows)
    mon = _divs(a, "values")[0]
    assert mon.severity == "warning" and mon.data["monitored"] == ["val_loss"]
    assert "ReduceLROnPlateau" in mon.message
    met = _divs(a, "metrics")[0]
    assert met.severity == "info" and met.data["names"] == ["val_loss"]
    text = format_report(a)
    top = text[: text.index("Where each step's time goes")]
    assert "ReduceLROnPlateau" in top and "logged metrics differ" not in top
    assert a.consistency["metrics"]["names"] == ["epoch", "val_loss"]


def test_no_consistency_rows_is_not_checked() -> None:
    spans = synth_spans(ranks=2, steps=5, tensors=2)
    a = analyze_spans(spans)
    assert a.consistency == {"checked": False, "divergences": []}
    assert analysis_to_dict(a)["consistency"]["checked"] is False


def _row(step: int, name: str, value: float, flags: int = 0) -> tuple:
    t = 10**12 + step * 1000
    return (step, 0, KIND_CODE["scalar"], name, t, t, 0, 0, value, flags)


def _step_rows(step: int) -> list[tuple]:
    t = 10**12 + step * 1000
    return [(step, 0, KIND_CODE["step"], "step", t, t + 900, 0, 0, np.nan, 0)]


def test_files_are_read_by_duckdb_and_the_step_range_applies(tmp_path) -> None:
    """Two ranks' Parquet files: the divergence at step 30 is found; a selection of steps
    before it finds none."""
    for rank in range(2):
        rows = []
        for s in range(40):
            rows += _step_rows(s)
            rows.append(_row(s, "hvtrace.lr|0", 0.1))
            if s % 10 == 0:
                v = 5.0 if (rank == 1 and s >= 30) else 1.0
                rows.append(_row(s, "hvtrace.param|w", v))
        h = make_header(rank=rank, size=2)
        write_rank_file(tmp_path / f"rank{rank:05d}-{h['run_id']}.arrows", h, [rows])
    from hvtrace.cli import main as cli_main

    assert cli_main(["compact", str(tmp_path)]) == 0
    run = open_run(tmp_path)
    assert all(f.format == "parquet" for f in run.files.values())
    c = consistency.check(span_sources(run))
    (d,) = c["divergences"]
    assert (d["what"], d["step"], d["names"], d["last_equal_step"]) == ("parameters", 30, ["w"], 20)
    c2 = consistency.check(span_sources(run, StepRange(0, 30)), StepRange(0, 30))
    assert c2["divergences"] == [] and c2["parameters"]["checks"] == 3
    a = analyze(run)
    assert [f.data["step"] for f in a.findings if f.kind == "divergence"] == [30]


@pytest.mark.parametrize("bad", [None, "x"])
def test_findings_ignore_a_malformed_consistency_dict(bad) -> None:
    a = _analyze(_consistent())
    a.consistency = {"divergences": [{"what": "lr", "step": bad}]}
    assert consistency.divergence_findings(a) == []


# -- advice that fits the stack --------------------------------------------------------------------
def _only_says_sync_dist_is_a_no_op(msg: str) -> bool:
    """Every mention of sync_dist says it averages nothing (none recommends it)."""
    return msg.count("sync_dist") == msg.count("sync_dist=True) averages nothing")


def test_lightning_metric_advice_says_sync_dist_averages_nothing_and_names_hvd_allreduce() -> None:
    rows = _consistent()
    for r in range(2):
        rows.append((r, 9, "hvtrace.monitor|val_loss", 1.25 + r / 100, FLAG_AGREE))
        rows.append((r, 9, "hvtrace.metric|val_loss", 1.25 + r / 100, FLAG_AGREE))
    a = _analyze(rows)
    for f in (_divs(a, "values")[0], _divs(a, "metrics")[0]):
        assert _only_says_sync_dist_is_a_no_op(f.message), f.message
        assert "sync_dist=True) averages nothing" in f.message, f.message
        assert "hvd.allreduce(value, op=hvd.Average)" in f.message, f.message
        assert "torch.distributed is initialized" in f.message, f.message
    assert a.lightning == ""  # the metric rows only hvtrace.lightning records
    # with the header's framework, the version is named
    a.framework = {"name": "pytorch_lightning", "version": "1.9.5"}
    (mon,) = [f for f in consistency.divergence_findings(a) if f.data["what"] == "values"]
    assert "pytorch-lightning 1.9.5 reduces a logged value only when" in mon.message


def test_lightning_lr_divergence_does_not_recommend_sync_dist() -> None:
    lr = {(1, s): 0.05 for s in range(12, 20)}
    rows = _consistent(lr=lr) + [(r, 3, "hvtrace.metric|loss", 1.0, FLAG_AGREE) for r in (0, 1)]
    a = _analyze(rows)
    (d,) = _divs(a, "lr")
    assert _only_says_sync_dist_is_a_no_op(d.message), d.message
    assert "hvd.allreduce(value, op=hvd.Average)" in d.message
    assert a.lightning == ""


def test_a_run_not_known_to_be_lightning_is_not_told_about_sync_dist() -> None:
    lr = {(1, s): 0.05 for s in range(12, 20)}
    rows = _consistent(lr=lr)
    for r in range(2):
        for s in range(20):
            rows.append((r, s, "epoch", s // 5 + (r if s >= 8 else 0), FLAG_AGREE))
    a = _analyze(rows)
    ds = _divs(a)
    assert {f.data["what"] for f in ds} == {"lr", "values"}
    for f in ds:
        assert "sync_dist" not in f.message and "Lightning" not in f.message, f.message
        assert "hvd.allreduce(value, op=hvd.Average)" in f.message, f.message
    assert a.lightning is None


def test_the_message_says_how_many_differing_names_and_ranks_it_leaves_out() -> None:
    rows = _consistent(ranks=6)
    names = [f"m{i}" for i in range(6)]
    for r in range(6):
        for n in names:
            rows.append((r, 4, f"hvtrace.metric|{n}", float(r), FLAG_AGREE))
    a = _analyze(rows, ranks=6)
    (d,) = _divs(a, "metrics")
    assert d.data["names"] == names
    assert "m0: rank 0 0, rank 1 1, rank 2 2, rank 3 3 (and 2 more ranks)" in d.message
    assert "and 3 more (m3, m4, m5)" in d.message, d.message
