"""``make unit``'s quick loop: ``scripts/slow_tests.py`` lists the slow unit tests from a measured
``--durations=0`` run, and the committed list (tests/unit/slow_tests.txt, which ``pytest --quick``
leaves out) names tests that exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("slow_tests", ROOT / "scripts" / "slow_tests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_slow_tests_are_summed_over_phases_and_parametrizations(tmp_path: Path) -> None:
    log = tmp_path / "unit.log"
    log.write_text(
        "===== slowest durations =====\n"
        "0.80s call     tests/unit/test_a.py::test_x[python]\n"
        "0.70s call     tests/unit/test_a.py::test_x[native]\n"  # 1.5 s together: slow
        "0.30s setup    tests/unit/test_a.py::test_y\n"
        "0.20s call     tests/unit/test_a.py::test_y\n"  # 0.5 s: kept
        "2.00s call     tests/integration/test_b.py::test_z\n"  # not a unit test
        "1.20s call     tests/unit/test_c.py::test_w\n"
    )
    out = tmp_path / "slow.txt"
    assert _script().main([str(log), "--out", str(out), "--min-s", "1.0"]) == 0
    lines = out.read_text().splitlines()
    assert [ln for ln in lines if not ln.startswith("#")] == [
        "tests/unit/test_a.py::test_x",
        "tests/unit/test_c.py::test_w",
    ]
    assert "# 2 of 3 tests, 3 of 3 s of test time." in lines


def test_a_log_without_unit_durations_is_one_line(tmp_path: Path, capsys) -> None:
    log = tmp_path / "empty.log"
    log.write_text("973 passed\n")
    assert _script().main([str(log), "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no --durations lines" in err


def test_every_listed_slow_test_exists() -> None:
    text = _script().OUT.read_text()  # the list the script writes and --quick reads
    listed = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert listed, "the quick loop leaves nothing out"
    for test in listed:
        path, _, name = test.partition("::")
        name = name.rsplit("::", 1)[-1]  # (a test in a class: path::Class::name)
        src = (ROOT / path).read_text()
        assert re.search(rf"^(async )?def {re.escape(name)}\(", src, re.M), test
