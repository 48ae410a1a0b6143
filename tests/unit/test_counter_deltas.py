"""The counters' deltas of a batch of readings (hvtrace.record.cpustat.deltas_columns), the
writer's columns of a batch of rows (hvtrace.record.writer.BatchEncoder._row_columns) and of a
whole batch (BatchEncoder.encode's one pass) and the live thread's window matrix: the compiled
forms (``_hot.deltas_into``, ``_hot.rows_into``, ``_hot.syncs_into``, ``_hot.entries_into``,
``_hot.window_into``) and their Python twins give the same columns, or the same error, for what
the recorder makes and for anything else."""

from __future__ import annotations

import itertools
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from hvtrace.format.schema import KIND_CODE
from hvtrace.record import cpustat, writer
from hvtrace.record.native import hot_module
from hvtrace.record.rows import Allreduces
from hvtrace.record.writer import BatchEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import writer_cost  # (its column-by-column comparison of two batches)

JUNK = [b"1 2", b"1 x 3\n", b" 4  5\t6 ", b"-1 2 3", "7 8 9", b"", b"1 99999999999999999999 3",
        2**70, -(2**63), 3.5, True, (1,), (1, b"1 2 3", 0), [1, b"1 2 3"]]  # fmt: skip


def _python(pairs: list) -> tuple:
    cols = (np.zeros(len(pairs), np.int64), np.zeros(len(pairs), np.int64),
            np.zeros(len(pairs), np.bool_), np.zeros(len(pairs), np.bool_))  # fmt: skip
    cpustat._deltas_py(pairs, *cols)
    return cols


def _readings(rng: random.Random, n: int, junk: bool) -> list:
    """Readings of one thread as the recorder takes them: the CPU clock, and a schedstat line
    shared by readings that found it unchanged; some not read (None), some the clock only,
    counters that go back, and (``junk``) anything else."""
    out, line, cpu, waited = [], b"0 0 0\n", 10**12, 10**12
    for _ in range(n):
        cpu += rng.choice([0, 1, 500, 10**6]) * rng.choice([1, 1, 1, -1])
        if rng.random() < 0.5:
            waited += rng.choice([0, 3, 10**5]) * rng.choice([1, 1, -1])
            line = f"{cpu * 3} {waited} {rng.randrange(9)}\n".encode()
        kind = rng.random()
        if kind < 0.1:
            out.append(None)
        elif kind < 0.2:
            out.append(cpu)
        elif junk and kind < 0.25:
            j = rng.choice(JUNK)
            out.append((cpu, j) if isinstance(j, bytes | str) and rng.random() < 0.7 else j)
        else:
            out.append((cpu, line))
    return out


@pytest.mark.parametrize("junk", [False, True], ids=["readings", "junk"])
def test_the_compiled_deltas_are_the_python_twins(monkeypatch, junk: bool) -> None:
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    if hot_module() is None or not hasattr(hot_module(), "deltas_into"):
        pytest.skip("the compiled hot path is not built here")
    rng = random.Random(11 if junk else 5)
    compiled = 0
    for case in range(400):
        r = _readings(rng, rng.randrange(0, 30), junk)
        pairs = [*itertools.pairwise(r), (None, None)]
        try:
            want = _python(pairs)
        except (TypeError, ValueError, IndexError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                cpustat.deltas_columns(pairs)
            continue
        got = cpustat.deltas_columns(pairs)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), case
        cols = [np.zeros(len(pairs), t) for t in (np.int64, np.int64, np.bool_, np.bool_)]
        if hot_module().deltas_into(pairs, *cols):
            compiled += 1
            assert all(np.array_equal(a, b) for a, b in zip(cols, want, strict=True)), case
    # the compiled form answered every reading the recorder makes, not the twin
    assert compiled == 400 if not junk else compiled > 50


def test_deltas_of_shared_lines_and_counters_that_go_back() -> None:
    line_a, line_b = b"10 100 1\n", b"20 400 2\n"
    pairs = [((5, line_a), (9, line_b)), ((9, line_b), (7, line_a)), (None, (1, line_a)),
             (3, 8), ((3, line_a), 8)]  # fmt: skip
    cpu, runq, cpu_ok, runq_ok = cpustat.deltas_columns(pairs)
    assert cpu.tolist() == [4, 0, 0, 5, 5] and cpu_ok.tolist() == [True, False, False, True, True]
    assert runq.tolist() == [300, 0, 0, 0, 0]
    assert runq_ok.tolist() == [True, False, False, False, False]


def test_the_compiled_form_refuses_columns_of_the_wrong_size() -> None:
    hot = hot_module()
    if hot is None or not hasattr(hot, "deltas_into"):
        pytest.skip("the compiled hot path is not built here")
    ok = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="wrong size"):
        hot.deltas_into([(1, 2), (2, 3)], ok, ok, np.zeros(1, np.bool_), np.zeros(2, np.bool_))
    with pytest.raises(ValueError, match="wrong size"):
        hot.deltas_into([(1, 2)], ok, ok, np.zeros(1, np.bool_), np.zeros(1, np.bool_))


def _rows(rng: random.Random, n: int, junk: bool) -> list:
    """A batch of rows as the hot path makes them (tests/unit/test_writer*.py have the batches'
    meaning): phase rows with readings, scalars with a value, rows without readings; and
    (``junk``) fields of other types or out of their column's range."""
    readings = _readings(rng, n + 1, False)
    out = []
    for i in range(n):
        name = rng.choice(["forward", "backward", "lr", "user:é", "step"])
        t = 10**15 + i
        row = [i // 3, 0, rng.randrange(12), name, t, t + rng.randrange(-5, 9**9),
               rng.choice([0, 4096]), rng.randrange(3), rng.choice([math.nan, 3]), 0]  # fmt: skip
        if junk and rng.random() < 0.1:
            k = rng.randrange(10)
            row[k] = rng.choice([None, 1.5, True, 2**40, -1, 300, "x", np.int64(2)])
        tail = [(readings[i], readings[i + 1])] if rng.random() < 0.7 else [()]
        if junk and rng.random() < 0.05:
            tail = [(readings[i],)]
        out.append(tuple(row) + tail[0])
    return out


@pytest.mark.parametrize("junk", [False, True], ids=["rows", "junk"])
def test_the_compiled_row_columns_are_the_python_forms(monkeypatch, junk: bool) -> None:
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    if hot_module() is None or not hasattr(hot_module(), "rows_into"):
        pytest.skip("the compiled hot path is not built here")
    rng = random.Random(3 if junk else 4)
    compiled = 0
    for case in range(300):
        rows = _rows(rng, rng.randrange(0, 25), junk)
        py, c = BatchEncoder(), BatchEncoder()
        py._name_id("earlier")  # names interned by an earlier batch keep their ids
        c._name_id("earlier")
        try:
            want = py._row_columns_py(rows)
        except (TypeError, ValueError, IndexError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                c._row_columns(rows)
            continue
        got = c._row_columns(rows)
        assert c._names == py._names and c._name_ids == py._name_ids, case
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), case
        n = len(rows)
        cols = [np.zeros(n, t) for t in writer._ROW_DTYPES]
        if hot_module().rows_into(rows, {}, [], *cols):
            compiled += 1
    # the compiled form answered every batch the recorder makes, not the Python form
    assert compiled == 300 if not junk else compiled > 30


def _spoiled(rng: random.Random, e: Allreduces, kinds: list[str]) -> Allreduces:
    """Synchronize ``e`` with one thing wrong, of ``kinds``: a start token that is not an int,
    no end, an unhashable handle among the completions, a call too short, a step out of range,
    a key its ``meta`` does not know (its lists changed in place)."""
    calls, done = e.enqueued, e.done
    bad = rng.choice(kinds)
    if bad == "token" and calls:
        calls[0] = (1.5, *calls[0][1:])
    elif bad == "end":
        e = e._replace(end=None)
    elif bad == "handle":
        done.append(([1], 5))
    elif bad == "step":
        e = e._replace(step=2**40)
    elif bad == "key" and calls:
        calls[0] = (calls[0][0], ("not", "there"), calls[0][2])
    elif calls:
        calls[-1] = calls[-1][:2]
    return e


def _syncs(rng: random.Random, n: int, junk: bool) -> list:
    """Synchronizes as the hot path records them: calls enqueued (their handles as Horovod
    returns them, alone or with a context), completions observed for some (a handle seen twice:
    its first), the others ending at the synchronize's end; and (``junk``) anything else."""
    out = []
    for s in range(n):
        t, calls, done = 10**15 + s * 10**7, [], []
        for k in range(rng.randrange(0, 6)):
            h = s * 100 + k
            calls.append((t + k, ("key", k), (h, None) if rng.random() < 0.5 else h))
            for _ in range(rng.choice([0, 1, 1, 2])):
                done.append((h, t + 1000 + rng.randrange(10**6)))
        rng.shuffle(done)
        e = Allreduces(s, 0, 0, calls, done, t + 9 * 10**6, {})
        if junk and rng.random() < 0.2:
            e = _spoiled(rng, e, ["token", "end", "handle", "call"])
        out.append(e)
    return out


@pytest.mark.parametrize("junk", [False, True], ids=["syncs", "junk"])
def test_the_compiled_call_times_are_the_python_forms(monkeypatch, junk: bool) -> None:
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    if hot_module() is None or not hasattr(hot_module(), "syncs_into"):
        pytest.skip("the compiled hot path is not built here")
    rng = random.Random(8 if junk else 9)
    compiled = 0
    for case in range(300):
        syncs = _syncs(rng, rng.randrange(0, 6), junk)
        try:
            want = writer._call_times_py(syncs)
        except (TypeError, ValueError, IndexError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                writer._call_times(syncs)
            continue
        got = writer._call_times(syncs)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), case
        n = len(want[0])
        if hot_module().syncs_into(syncs, np.empty(n, np.int64), np.empty(n, np.int64)):
            compiled += 1
    assert compiled == 300 if not junk else compiled > 30


def _window(rng: random.Random, n: int, junk: bool) -> list:
    """A live window's steps as the tracer hands them over: phase rows (some without readings),
    a scalar, a synchronize's allreduces (tensors grouped or not, one missing from ``meta``),
    collectives outside the optimizer counted; and (``junk``) anything else."""
    kinds = ["input", "forward", "backward", "wait", "update", "step", "scalar", "forward"]
    out = []
    readings = _readings(rng, 12 * n + 2, False)
    for s in range(n):
        t, rows = 10**15 + s * 10**7, []
        for p, k in enumerate(kinds[: rng.randrange(0, len(kinds) + 1)]):
            row = (s, 0, KIND_CODE[k], k, t + p, t + p + rng.randrange(10**6), 0, 0, math.nan, 0)
            if rng.random() < 0.8:
                row += (readings[12 * s + p], readings[12 * s + p + 1])
            rows.append(row)
        if rng.random() < 0.8:
            meta = {("key", k): (["w"] * (1 + k % 3), [4], [1]) for k in range(4)}
            calls = [(t + 50 + k, ("key", k), k) for k in range(rng.randrange(0, 6))]
            rows.append(Allreduces(s, 0, 0, calls, [], t + 10**6, meta))
        if junk and rows and rng.random() < 0.2:
            i = rng.randrange(len(rows))
            r = rows[i]
            rows[i] = rng.choice([r[:11] if type(r) is tuple else None, (1.5, *r[1:]), "x", (r,)])
        entry = (rows, rng.randrange(1, 4)) if rng.random() < 0.3 else rows
        if junk and rng.random() < 0.05:
            entry = (rows, 2.5)
        out.append(entry)
    return out


@pytest.mark.parametrize("junk", [False, True], ids=["windows", "junk"])
def test_the_compiled_window_matrix_is_the_python_forms(monkeypatch, junk: bool) -> None:
    from hvtrace.record import live

    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    if hot_module() is None or not hasattr(hot_module(), "window_into"):
        pytest.skip("the compiled hot path is not built here")
    rng = random.Random(12 if junk else 13)
    compiled = 0
    for case in range(300):
        window = _window(rng, rng.randrange(0, 8), junk)
        offset = rng.choice([0, 10**15 - 7])
        try:
            want = live._step_matrix_py(window, offset)
        except (TypeError, ValueError, IndexError, OverflowError, AttributeError) as exc:
            with pytest.raises(type(exc)):
                live.step_matrix(window, offset)
            continue
        got = live.step_matrix(window, offset)
        assert np.array_equal(got, want, equal_nan=True), case
        out = np.full(want.shape, np.nan)
        if hot_module().window_into(window, out, live._CODE, live._K_FORWARD,
                                    live._K_BACKWARD, Allreduces, offset, live._ARRIVAL,
                                    live._COUNT):  # fmt: skip
            compiled += 1
    assert compiled == 300 if not junk else compiled > 30


def _model(rng: random.Random) -> tuple[dict, list]:
    """A model's synchronize as the tracer keeps it: per enqueued call, its key and its tensors'
    ``(names, bytes, dtype codes)`` in ``meta`` (grouped calls hold several tensors)."""
    keys = [("key", k) for k in range(rng.randrange(0, 6))]
    meta = {}
    for i, key in enumerate(keys):
        t = rng.randrange(1, 4)
        meta[key] = ([f"layer{i}.{j}" for j in range(t)], [4096 * (j + 1) for j in range(t)],
                     [rng.randrange(3)] * t)  # fmt: skip
    return meta, keys


def _sync(rng: random.Random, s: int, model: tuple[dict, list], junk: bool) -> Allreduces:
    """One synchronize of ``model`` at step ``s``: its calls' handles alone or with a context,
    completions observed for some (a handle seen twice: its first); (``junk``) anything else."""
    meta, keys = model
    t, calls, done = 10**15 + s * 10**7, [], []
    for k, key in enumerate(keys):
        h = s * 100 + k
        calls.append((t + k, key, (h, None) if rng.random() < 0.5 else h))
        for _ in range(rng.choice([0, 1, 1, 2])):
            done.append((h, t + 1000 + rng.randrange(10**6)))
    rng.shuffle(done)
    e = Allreduces(s, rng.randrange(2), rng.choice([0, 2]), calls, done, t + 9 * 10**6, meta)
    if junk and rng.random() < 0.15:
        e = _spoiled(rng, e, ["token", "end", "handle", "call", "step", "key"])
    return e


def _encoders() -> tuple[BatchEncoder, BatchEncoder, list[int]]:
    """A writer's encoder in Python and one that may take the compiled one pass, and the count
    of batches that the one pass made."""
    py, c, made = BatchEncoder(), BatchEncoder(), [0]
    py._compiled_columns = lambda entries: None
    one_pass = c._compiled_columns

    def counted(entries: list) -> list | None:
        out = one_pass(entries)
        made[0] += out is not None
        return out

    c._compiled_columns = counted
    return py, c, made


@pytest.mark.parametrize("junk", [False, True], ids=["batches", "junk"])
def test_the_one_pass_batch_columns_are_the_python_forms(monkeypatch, junk: bool) -> None:
    """A writer's batches one after another (a model's synchronizes among its rows, the model
    changing now and then): the compiled one pass (``_hot.entries_into``) gives the Python
    form's columns and names, or its error, and makes every batch whose synchronizes are the
    last one's (every flush after a rank's first) or that has none."""
    monkeypatch.setenv("HVTRACE_NATIVE", "1")
    if hot_module() is None or not hasattr(hot_module(), "entries_into"):
        pytest.skip("the compiled hot path is not built here")
    rng = random.Random(21 if junk else 22)
    py, c, made = _encoders()
    compiled = 0
    model, held = _model(rng), None  # held: the model whose tensor columns the encoders hold
    for case in range(300):
        if rng.random() < 0.1:
            model = _model(rng)
        entries: list = []
        for s in range(rng.randrange(0, 5)):
            entries += _rows(rng, rng.randrange(0, 6), junk)
            if rng.random() < 0.9:
                entries.append(_sync(rng, s, model, junk))
        syncs = any(type(e) is not tuple for e in entries)
        due = not syncs or held is model
        made[0] = 0
        try:
            want = py.encode(entries)
        except (TypeError, ValueError, IndexError, OverflowError, KeyError, AttributeError) as exc:
            with pytest.raises(type(exc)):
                c.encode(entries)
            py, c, made = _encoders()  # their names may differ past a failure
            held = None
            continue
        got = c.encode(entries)
        assert c._names == py._names and c._name_ids == py._name_ids, case
        assert got.schema == want.schema
        writer_cost.check_same(want, got)
        compiled += made[0]
        if syncs:
            held = model
        if due and not junk:
            assert made[0] == 1, f"batch {case}: the one pass did not make it"
    assert compiled > (200 if not junk else 80)


def test_the_one_pass_refuses_tensor_columns_of_the_wrong_type_or_size() -> None:
    hot = hot_module()
    if hot is None or not hasattr(hot, "entries_into"):
        pytest.skip("the compiled hot path is not built here")
    k = KIND_CODE["allreduce"]
    rows = [(0, 0, 1, "forward", 5, 9, 0, 0, math.nan, 0)]
    cols = [np.empty(1, t) for t in writer._ROW_DTYPES]

    def good() -> list[np.ndarray]:  # one call of one tensor: counts, name ids, bytes, dtypes
        return [np.ones(1, np.int64), np.zeros(1, np.int32), np.zeros(1, np.int64),
                np.zeros(1, np.int8)]  # fmt: skip

    assert hot.entries_into(rows, {}, [], *good(), k, *cols)
    wrong = [np.ones(1, np.float32), np.zeros(1, np.int64), np.zeros(2, np.int64),
             np.zeros(3, np.int8)]  # fmt: skip
    for i, bad in enumerate(wrong):  # counts not int64, name ids not int32, sizes that differ
        tensor_cols = good()
        tensor_cols[i] = bad
        refs = [sys.getrefcount(a) for a in tensor_cols]
        with pytest.raises(ValueError):
            hot.entries_into(rows, {}, [], *tensor_cols, k, *cols)
        # no buffer is left held (a held one holds a reference to its array)
        assert [sys.getrefcount(a) for a in tensor_cols] == refs
    with pytest.raises(ValueError, match="wrong size"):
        hot.entries_into(rows, {}, [], *good(), k, *cols[:13],
                         np.empty(2, np.bool_))  # fmt: skip
