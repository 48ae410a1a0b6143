"""Horovod's own optimizer tests with hvtrace in by the environment alone (issue 35).

Horovod 0.28.1's ``test/parallel/test_torch.py`` (vendored in ``tests/upstream/horovod``)
exercises ``DistributedOptimizer`` in ways hvtrace's tests do not: no named parameters, duplicate
names before ``hvd.init()``, parameters that stop requiring grad, sparse embeddings, process sets,
gradient clipping, ``synchronize()`` warnings, ``broadcast_optimizer_state`` options. Its tests
that use the optimizer run under one ``horovodrun -np 2 --gloo`` without hvtrace and one with
``HVTRACE_DIR`` set (``bench/horovod_tests.py --together``): every test must end the same way,
whatever Horovod accepts or rejects, and the traced launch must have recorded its ranks.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, horovod_unavailable_reason

pytestmark = pytest.mark.horovod


def _runner():
    spec = importlib.util.spec_from_file_location(
        "horovod_tests", REPO_ROOT / "bench" / "horovod_tests.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["horovod_tests"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_horovods_optimizer_tests_end_the_same_with_hvtrace(tmp_path: Path, capsys) -> None:
    why = horovod_unavailable_reason()
    if why:
        pytest.skip(why)
    if importlib.util.find_spec("mock") is None:
        pytest.skip("Horovod's test utilities import mock (pip install mock)")
    out = tmp_path / "results.json"
    rc = _runner().main(["--together", "--tests", "optimizer", "--json", str(out)])
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    differ = {n: (r["without"]["ended"], r["with"]["ended"]) for n, r in results.items()
              if not r["same"]}  # fmt: skip
    assert rc == 0 and not differ, (differ, printed[-3000:])
    assert len(results) >= 15, sorted(results)  # the file's optimizer tests, all of them ran
    ended = {n: r["with"]["ended"] for n, r in results.items()}
    assert "no result" not in ended.values(), ended
    # tests that pass on this stack, each with hvtrace building a traced optimizer
    for name in ("test_duplicate_names", "test_dynamic_requires_grad", "test_sparse_embeddings",
                 "test_optimizer_process_sets", "test_gradient_clipping"):  # fmt: skip
        assert ended.get(name) == "passed", (name, ended)
    some = next(iter(results.values()))["with"]
    assert some["files_all"] >= 2, printed[-2000:]  # the traced launch recorded its ranks
