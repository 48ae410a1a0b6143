"""Horovod's own PyTorch tests with hvtrace swapped in by the environment alone.

Horovod's ``test/parallel/test_torch.py`` exercises ``DistributedOptimizer`` in ways hvtrace's
tests do not (no named parameters, duplicate names, parameters that stop requiring grad, model
parallelism, sparse embeddings, process sets, gradient clipping, ``synchronize()`` warnings,
``broadcast_optimizer_state`` options). Each test runs in its own ``horovodrun -np 2 --gloo``
twice: without hvtrace, and with ``HVTRACE_DIR`` set (hvtrace's start-up hook makes
``hvd.DistributedOptimizer`` build Horovod's optimizer and trace it, :mod:`hvtrace_boot`). Every
test must end the same way both times (a test that fails here without hvtrace may fail with it,
for the same reason); the table says how each ended, whether the traced run recorded rank files,
and any test that ended differently. Exit status 1 if one did.

Horovod's PyPI package lacks its tests: they are vendored, unchanged, in
``tests/upstream/horovod`` (v0.28.1: ``test/parallel/test_torch.py`` and ``test/utils/``, which
imports ``mock`` and ``cloudpickle``); ``--horovod-src`` points at another checkout::

    .venv/bin/python bench/horovod_tests.py                         # optimizer tests, a launch each
    .venv/bin/python bench/horovod_tests.py --tests all --together  # the file, a launch a mode

``--together`` runs the selected tests in one ``horovodrun`` per mode (as Horovod's own CI runs
the file), the outcome of each read from pytest's summary on every rank (a test failed on one
rank failed); without it, each test has its own launch (isolated, slower).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
#: Horovod 0.28.1's tests, vendored (tests/upstream/horovod/README.md).
VENDORED = Path(__file__).resolve().parent.parent / "tests" / "upstream" / "horovod"
TEST_FILE = Path("test/parallel/test_torch.py")
#: Words in a test's body that make it an optimizer test (the default selection).
OPTIMIZER_WORDS = ("DistributedOptimizer", "broadcast_optimizer_state", "optimizer")
OUTCOME = re.compile(r"\b(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b")
#: pytest -v's line of one test's outcome, on a rank (horovodrun prefixes ``[R]<stdout>:``).
RESULT_LINE = re.compile(
    r"^(?:\[(\d+)\]<std\w+>:)?\S*::TorchTests::(\w+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b",
    re.M,
)
ERROR_LINE = re.compile(r"^(?:\[\d+\]<std\w+>:)?E\s+(\w+(?:Error|Exception|Warning)\b.*)$", re.M)


def test_names(source: str, which: str) -> list[str]:
    """The ``TorchTests`` methods to run: ``all``, ``optimizer`` (those whose body mentions the
    optimizer) or a comma-separated list."""
    parts = re.split(r"\n    def (test_\w+)\(", source)
    bodies = dict(zip(parts[1::2], parts[2::2], strict=True))
    if which == "all":
        return list(bodies)
    if which == "optimizer":
        return [n for n, b in bodies.items() if any(w in b for w in OPTIMIZER_WORDS)]
    names = [n.strip() for n in which.split(",") if n.strip()]
    unknown = [n for n in names if n not in bodies]
    if unknown:
        raise SystemExit(f"not tests of TorchTests: {', '.join(unknown)}")
    return names


def _launch(work: Path, names: list[str], trace: Path | None, np: int, timeout_s: float):
    """Run ``names`` in one ``horovodrun``; return (output, exit code or None on timeout, s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVTRACE", "HOROVOD_TIME"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    if trace is not None:
        env["HVTRACE_DIR"] = str(trace)
    nodes = [f"{TEST_FILE}::TorchTests::{name}" for name in names]
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", "--gloo"]
    cmd += [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *nodes]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        rc = None
    return out, rc, time.monotonic() - t0


def _result(out: str, rc: int | None, wall_s: float, trace: Path | None, ended: str) -> dict:
    errors = sorted({e.strip()[:120] for e in ERROR_LINE.findall(out)})
    files = 0
    if trace is not None and trace.is_dir():
        files = sum(1 for p in trace.iterdir() if p.suffix in (".arrows", ".parquet"))
    return {
        "ended": ended,
        "rc": rc,
        "errors": errors,
        "files": files,
        "wall_s": round(wall_s, 1),
        "hvtrace_warnings": sorted(
            {line.split("hvtrace:", 1)[1].strip()[:160] for line in out.splitlines()
             if "hvtrace:" in line}
        ),
    }  # fmt: skip


def run_one(work: Path, name: str, trace: Path | None, np: int, timeout_s: float) -> dict:
    """Run one test under its own horovodrun; return how it ended."""
    out, rc, wall_s = _launch(work, [name], trace, np, timeout_s)
    counts = sorted({(m.group(2).rstrip("s"), int(m.group(1))) for m in OUTCOME.finditer(out)})
    ended = "timeout" if rc is None else "+".join(k for k, _ in counts) or f"exit {rc}"
    return _result(out, rc, wall_s, trace, ended)


def run_together(
    work: Path, names: list[str], trace: Path | None, np: int, timeout_s: float
) -> dict[str, dict]:
    """Run ``names`` in one horovodrun; return how each ended (pytest's ``-v`` line of each test
    on every rank: failed or error on one rank makes the test's outcome that; a test with no
    line on some rank ended ``no result`` there, e.g. after a crash or a timeout)."""
    out, rc, wall_s = _launch(work, names, trace, np, timeout_s)
    seen: dict[str, dict[int, str]] = {}
    for m in RESULT_LINE.finditer(out):
        seen.setdefault(m.group(2), {})[int(m.group(1) or 0)] = m.group(3).lower()
    rank = {"error": 0, "failed": 1, "xpass": 2, "passed": 3, "xfail": 4, "skipped": 5}
    results = {}
    for name in names:
        per_rank = seen.get(name, {})
        got = [per_rank.get(r, "no result") for r in range(np)]
        ended = min(got, key=lambda o: rank.get(o, -1))
        results[name] = _result("", rc, wall_s, None, ended)
    files = 0
    if trace is not None and trace.is_dir():
        files = sum(1 for p in trace.iterdir() if p.suffix in (".arrows", ".parquet"))
    for r in results.values():
        r["files_all"] = files  # one trace directory for every test of the launch
    results["__launch__"] = _result(
        out, rc, wall_s, trace, "timeout" if rc is None else f"exit {rc}"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--horovod-src",
        type=Path,
        default=VENDORED,
        help="a Horovod 0.28.1 checkout (default: the vendored tests/upstream/horovod)",
    )
    p.add_argument("--together", action="store_true", help="one horovodrun per mode, not per test")
    p.add_argument("--tests", default="optimizer", help="all, optimizer (default) or names")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    src = args.horovod_src / TEST_FILE
    if not src.is_file():
        raise SystemExit(f"{src}: not found (--horovod-src must be a Horovod checkout)")
    names = test_names(src.read_text(), args.tests)
    missing = [m for m in ("pytest", "mock", "cloudpickle") if importlib.util.find_spec(m) is None]
    if missing:  # what Horovod's test/utils/common.py imports
        raise SystemExit(
            f"Horovod's tests need {', '.join(missing)}: pip install {' '.join(missing)}"
        )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hvtrace-hvdtests-") as tmp:
        work = Path(tmp)
        (work / TEST_FILE).parent.mkdir(parents=True)
        shutil.copy2(src, work / TEST_FILE)
        shutil.copytree(args.horovod_src / "test" / "utils", work / "test" / "utils")
        if args.together:
            w_all = run_together(work, names, None, args.np, args.timeout_s)
            t_all = run_together(work, names, work / "traces" / "all", args.np, args.timeout_s)
            for mode, r in (("without", w_all), ("with", t_all)):
                launch = r.pop("__launch__")
                print(f"{mode} hvtrace: one launch, {launch['ended']}, {launch['wall_s']} s, "
                      f"{launch['files']} rank files", flush=True)  # fmt: skip
            pairs = [(name, w_all[name], t_all[name]) for name in names]
        else:
            pairs = []
            for i, name in enumerate(names, 1):
                without = run_one(work, name, None, args.np, args.timeout_s)
                traced = run_one(work, name, work / "traces" / name, args.np, args.timeout_s)
                pairs.append((name, without, traced))
                print(f"[{i}/{len(names)}] {name}: without {without['ended']}, with "
                      f"{traced['ended']} ({traced['files']} rank files)", flush=True)  # fmt: skip
        for name, without, traced in pairs:
            same = (without["ended"], without["errors"]) == (traced["ended"], traced["errors"])
            results[name] = {"without": without, "with": traced, "same": same}
    differ = [n for n, r in results.items() if not r["same"]]
    print("\n| test | without hvtrace | with hvtrace (by environment) | rank files |")
    # (with --together: one trace directory for the launch, so no per-test count: -)
    print("|---|---|---|---|")
    for name, r in results.items():
        w, t = r["without"], r["with"]
        flag = "" if r["same"] else " **differs**"
        files = "-" if args.together else t["files"]
        print(f"| `{name}` | {w['ended']} | {t['ended']}{flag} | {files} |")
    if args.together:  # one trace directory for the whole traced launch
        files = max((r["with"].get("files_all", 0) for r in results.values()), default=0)
        traced = f"the traced launch wrote {files} rank files"
    else:
        traced = f"{sum(1 for r in results.values() if r['with']['files'])} traced (rank files)"
    print(
        f"\n{len(results)} tests, {len(results) - len(differ)} ended the same, "
        f"{len(differ)} differently{': ' + ', '.join(differ) if differ else ''}; {traced}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
