"""``import hvtrace`` in a training rank loads the recorder only: neither pandas nor DuckDB.

Checked in a fresh interpreter (this test process has pandas loaded already).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Run in a fresh interpreter: ``import hvtrace`` loads neither the reader nor DuckDB, and
#: ``load_run`` / ``Run`` / ``TraceError`` still work (the first two imported on first use).
_LIGHT = """
import sys
import hvtrace
heavy = sorted(m for m in ("duckdb", "dask", "dash", "plotly", "hvtrace.load") if m in sys.modules)
assert not heavy, f"import hvtrace loaded {heavy}"
import hvtrace.record.recorder, hvtrace.record.writer, hvtrace.record.timers, hvtrace.clock
import hvtrace.selection, hvtrace.units, hvtrace.format.schema, hvtrace.errors
assert "duckdb" not in sys.modules and "hvtrace.load" not in sys.modules
from hvtrace.errors import TraceError
assert hvtrace.TraceError is TraceError and issubclass(TraceError, Exception)
load_run = hvtrace.load_run  # imported on first use
import hvtrace.load
assert load_run is hvtrace.load.load_run and hvtrace.Run is hvtrace.load.Run
assert hvtrace.load.TraceError is TraceError
assert "load_run" in dir(hvtrace) and {"load_run", "Run", "TraceError"} <= set(hvtrace.__all__)
try:
    load_run(sys.argv[1])
except hvtrace.TraceError as exc:
    print("TraceError:", exc)
"""

#: The training rank's imports must not load pandas either.
_NO_PANDAS = """
import sys
import hvtrace
from hvtrace import DistributedOptimizer, finish, scalar, span
import hvtrace.record.recorder, hvtrace.record.writer, hvtrace.record.timers, hvtrace.clock
import hvtrace.selection, hvtrace.units, hvtrace.format.schema, hvtrace.errors
heavy = sorted(m for m in ("pandas", "duckdb") if m in sys.modules)
assert not heavy, f"import hvtrace loaded {heavy}"
from hvtrace.record.writer import BatchEncoder
batch = BatchEncoder().encode([(3, 0, 5, "net.0.weight", 10, 20, 4096, 1, float("nan"), 2)])
assert batch.column(3).to_pylist() == ["net.0.weight"] and batch.column(6).to_pylist() == [4096]
heavy = sorted(m for m in ("pandas", "duckdb") if m in sys.modules)
assert not heavy, f"a flush loaded {heavy}"
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


def test_import_hvtrace_loads_no_duckdb_and_load_run_still_works(tmp_path) -> None:
    out = _python(_LIGHT, str(tmp_path / "nope"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TraceError:") and "no such directory" in out.stdout


def test_import_hvtrace_loads_no_pandas() -> None:
    """``import hvtrace`` in a training rank imports neither pandas nor DuckDB, and neither does
    the writer's first flush (``pa.array`` would import pandas: the writer builds its arrays
    from numpy buffers)."""
    out = _python(_NO_PANDAS)
    assert out.returncode == 0, out.stderr


def test_missing_attribute_is_an_attribute_error() -> None:
    import hvtrace

    with pytest.raises(AttributeError, match="no_such_name"):
        _ = hvtrace.no_such_name  # type: ignore[attr-defined]


_MIMALLOC = """
import os, sys
first = sys.argv[1]
if first == "pyarrow":
    import pyarrow
import hvtrace
import pyarrow as pa
print(os.environ.get("MIMALLOC_ARENA_EAGER_COMMIT"), pa.default_memory_pool().backend_name)
"""


@pytest.mark.parametrize(
    ("first", "user", "expected"),
    [
        ("hvtrace", None, "0"),  # pyarrow's mimalloc commits its arena as it is used
        ("hvtrace", "1", "1"),  # the user's own choice stands
        ("pyarrow", None, "None"),  # mimalloc already started: nothing to set
    ],
)
def test_import_lets_pyarrows_allocator_commit_on_demand(first, user, expected) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")}
    if user is not None:
        env["MIMALLOC_ARENA_EAGER_COMMIT"] = user

    def run(code: str, *args: str) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=True,
        )
        return proc.stdout.split()

    out = run(_MIMALLOC, first)
    assert out[0] == expected
    # the pool is the one pyarrow picks without hvtrace
    assert out[1] == run("import pyarrow as pa; print(pa.default_memory_pool().backend_name)")[0]
