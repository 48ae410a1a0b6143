"""The writer's encoder takes a synchronize's allreduces unexpanded and builds their columns
directly: the batch must hold exactly the rows that expanding them into tuples gives, in the
same places (names compared as strings: the dictionary's order may differ)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from hvtrace.format.schema import KIND_CODE
from hvtrace.record.rows import Allreduces, expand
from hvtrace.record.writer import BatchEncoder


def _row(step: int, kind: str, t: int, readings: bool = True) -> tuple:
    base = (step, 0, KIND_CODE[kind], kind, t, t + 100, 0, 0, math.nan, 0)
    if not readings:
        return base
    return (*base, (1_000 + t, b"1 20 3\n"), (1_050 + t, b"1 45 4\n"))


META = {
    11: (["fc1.weight"], [4096], [1]),
    12: (["fc1.bias"], [64], [1]),
    ("g", 1): (["fc2.weight", "fc2.bias", "emb"], [256, 16, 8192], [1, 1, 2]),
}


def _sync(step: int, t: int, meta: dict = META, observed: bool = True) -> Allreduces:
    enqueued = [(t + 1, 11, (101, None)), (t + 2, ("g", 1), (102, None)), (t + 3, 12, 103)]
    # handle 102 completes twice (the first counts); 103 never seen: ends at the sync's end
    done = [(101, t + 50), (102, t + 60), (102, t + 70)] if observed else []
    return Allreduces(step, 0, 2, enqueued, done, t + 99, meta)


def _same(a: pa.RecordBatch, b: pa.RecordBatch) -> None:
    assert a.num_rows == b.num_rows
    for name in a.schema.names:
        x, y = a.column(name), b.column(name)
        if pa.types.is_dictionary(x.type):
            x, y = x.cast(x.type.value_type), y.cast(y.type.value_type)
        if name == "value":
            nx, ny = x.to_numpy(zero_copy_only=False), y.to_numpy(zero_copy_only=False)
            assert np.array_equal(nx, ny, equal_nan=True), name
        else:
            assert x.equals(y), (name, x, y)


def test_allreduces_are_encoded_as_their_expanded_rows_in_place() -> None:
    entries = [
        _row(0, "input", 10),
        _row(0, "forward", 20),
        _sync(0, 1_000),
        _row(0, "update", 30, readings=False),
        _row(0, "step", 40),
        _sync(1, 2_000, observed=False),  # nothing observed: every tensor ends at the sync's end
        _sync(1, 3_000),  # the same tensors again: their columns are reused
        _row(1, "step", 50),
    ]
    columnar = BatchEncoder().encode(entries)
    _same(columnar, BatchEncoder().encode(expand(entries, [])))
    assert columnar.num_rows == 5 + 3 * 5
    names = columnar.column("name").cast(pa.string()).to_pylist()
    assert names[2:7] == ["fc1.weight", "fc2.weight", "fc2.bias", "emb", "fc1.bias"]
    ends = columnar.column("end_ns").to_pylist()
    assert ends[2:7] == [1_050, 1_060, 1_060, 1_060, 1_099]  # first completion seen, else end
    assert ends[9:14] == [2_099] * 5
    cpu = columnar.column("cpu_ns").to_pylist()
    assert cpu[:2] == [50, 50] and cpu[2:7] == [None] * 5 and cpu[7] is None


def test_new_tensors_or_new_meta_are_not_taken_from_the_last_synchronize() -> None:
    """The columns of the last synchronize's tensors are reused only for the very same meta
    entries: a changed entry (a tensor learned again) or another set is encoded afresh."""
    other = dict(META)
    other[11] = (["fc1.weight.renamed"], [1], [3])
    entries = [_sync(0, 1_000), _sync(1, 2_000, meta=other), _sync(2, 3_000)]
    enc = BatchEncoder()
    _same(enc.encode(entries), BatchEncoder().encode(expand(entries, [])))
    fewer = Allreduces(3, 0, 0, [(4_001, 12, 103)], [(103, 4_010)], 4_099, META)
    _same(enc.encode([fewer]), BatchEncoder().encode(expand([fewer], [])))
    assert enc.encode([]).num_rows == 0


def test_a_synchronize_with_nothing_enqueued_first_and_between() -> None:
    """A synchronize that enqueued nothing (every step of a single-process run, where Horovod
    registers no gradient hooks; or a step with no gradients) holds no rows, first in a fresh
    encoder (nothing cached yet) and between ones that hold some."""
    empty = [Allreduces(s, 0, 2, [], [], 500 + s, {}) for s in range(3)]
    enc = BatchEncoder()
    batch = enc.encode([_row(0, "input", 10), empty[0], _row(0, "step", 40)])
    assert batch.num_rows == 2
    assert batch.column("name").cast(pa.string()).to_pylist() == ["input", "step"]
    entries = [empty[1], _sync(1, 1_000), empty[2], _sync(2, 2_000), _row(2, "step", 50)]
    _same(enc.encode(entries), BatchEncoder().encode(expand(entries, [])))
