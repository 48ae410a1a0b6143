"""The documentation cannot drift from the code.

- Every kind of finding the analysis can raise is in :data:`FINDING_KINDS` (the generated
  *Findings* page), and every entry there is one the analysis raises.
- Every ``HVTRACE_*`` variable the code reads is in :mod:`hvtrace.settings`' lists (the
  generated *Settings* page).
- The generated pages name every command, option, kind and setting.
- The examples marked as such (``console`` blocks: ``$ hvtrace ...``) run against the sample
  runs and print the lines shown.
- README.md stays a front door (at most 200 lines) whose links lead somewhere.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hvtrace import settings
from hvtrace.analysis.model import FINDING_KINDS
from hvtrace.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hvtrace"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _finding_kinds_raised() -> dict[str, list[str]]:
    """Every literal kind given to ``Finding(...)`` in the package, with where."""
    found: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"):
                continue
            arg = node.args[0] if node.args else None
            if arg is None:
                arg = next(k.value for k in node.keywords if k.arg == "kind")
            values, choices = [], [arg]
            while choices:  # a if c else b, b itself maybe such a choice
                v = choices.pop()
                if isinstance(v, ast.IfExp):
                    choices += [v.body, v.orelse]
                else:
                    values.append(v)
            for v in values:
                assert isinstance(v, ast.Constant), (
                    f"{path.name}:{node.lineno}: Finding's kind must be a literal (or a choice "
                    "of literals), so that the documentation can be checked against it"
                )
                found.setdefault(v.value, []).append(f"{path.name}:{node.lineno}")
    return found


def test_every_finding_kind_is_documented_and_every_documented_kind_is_raised() -> None:
    raised = _finding_kinds_raised()
    assert len(raised) >= 10, raised  # the scan found the analysis' findings
    undocumented = {k: w for k, w in raised.items() if k not in FINDING_KINDS}
    assert not undocumented, f"add these to FINDING_KINDS: {undocumented}"
    stale = set(FINDING_KINDS) - set(raised)
    assert not stale, f"FINDING_KINDS lists kinds nothing raises: {stale}"
    for k, v in FINDING_KINDS.items():
        assert v.title and v.means and v.cost and v.action, k
        assert v.severity.split()[0].rstrip(";") in ("warning", "info"), (k, v.severity)


def test_every_tensorboard_scalar_is_documented() -> None:
    from hvtrace.format.tensorboard import SCALARS

    page = (ROOT / "docs" / "tensorboard.md").read_text(encoding="utf-8")
    for tag in SCALARS:
        assert f"| `{tag}` |" in page, tag


def test_every_hvtrace_variable_the_code_reads_is_documented() -> None:
    names = set()
    for path in [*PKG.rglob("*.py"), *(ROOT / "hvtrace_boot").rglob("*.py")]:
        names |= set(re.findall(r"\bHVTRACE(?:_[A-Z0-9]+)*\b", path.read_text(encoding="utf-8")))
    names.discard("HVTRACE_")  # a prefix in a comment or a startswith()
    documented = set(settings.SETTINGS) | set(settings.SWITCHES)
    assert {"HVTRACE", "HVTRACE_DIR", "HVTRACE_LIVE_EVERY"} <= names
    assert names - documented == set(), "document these in hvtrace/settings.py"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_gen.py"), str(out)],
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out


def test_generated_pages_name_every_command_option_kind_and_setting(generated: Path) -> None:
    cli = (generated / "reference" / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert f"## hvtrace {name}\n" in cli
        for a in p._actions:
            for flag in a.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in cli or f", {flag}" in cli, (name, flag)
    findings = (generated / "findings.md").read_text()
    for k, v in FINDING_KINDS.items():
        assert f"\n## {k}\n" in findings and v.action in findings, k
    page = (generated / "settings.md").read_text()
    for env in [*settings.SETTINGS, *settings.SWITCHES]:
        assert f"| `{env}` |" in page, env
    assert (generated / "bench.md").read_text() == (ROOT / "bench" / "README.md").read_text()


def _console_examples() -> list[tuple[str, str, list[str]]]:
    """(where, command, lines shown after it) for each ``$ hvtrace`` line of a console block."""
    out = []
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"^```console\n(.*?)^```", text, re.M | re.S):
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            cmd, shown = None, []
            for line in m.group(1).splitlines():
                if line.startswith("$ "):
                    if cmd:
                        out.append((where, cmd, shown))
                    cmd, shown = line[2:], []
                elif cmd is not None:
                    shown.append(line)
            if cmd:
                out.append((where, cmd, shown))
    return out


EXAMPLES = _console_examples()


def test_the_docs_have_examples_to_run() -> None:
    assert len(EXAMPLES) >= 4, EXAMPLES
    assert any(w.startswith("README.md") for w, _, _ in EXAMPLES)


@pytest.mark.parametrize(("where", "cmd", "shown"), EXAMPLES, ids=[w for w, _, _ in EXAMPLES])
def test_doc_example_runs_and_prints_what_is_shown(
    where: str, cmd: str, shown: list[str], tmp_path: Path
) -> None:
    argv = shlex.split(cmd)
    assert argv[0] == "hvtrace", f"{where}: only hvtrace commands are run: {cmd}"
    (tmp_path / "sample_traces").symlink_to(ROOT / "sample_traces")
    r = subprocess.run(
        [sys.executable, "-m", "hvtrace.cli", *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"},
    )
    assert r.returncode == 0, f"{where}: {cmd}\n{r.stderr}"
    got = r.stdout.splitlines()
    i = 0
    for line in shown:
        if line.strip() == "...":
            continue
        try:
            i = got.index(line, i) + 1
        except ValueError:
            pytest.fail(f"{where}: {cmd!r} no longer prints, in this order:\n{line}\n\n{r.stdout}")


def test_readme_is_a_front_door_whose_links_lead_somewhere() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [u for u in links if not re.match(r"[a-z]+://", u)]
    assert len(local) >= 10
    for u in local:
        path, _, anchor = u.partition("#")
        assert (ROOT / path).exists(), f"README links to {u}, which does not exist"
        if anchor and path.endswith(".md"):
            heads = re.findall(r"^#+ (.*)$", (ROOT / path).read_text(encoding="utf-8"), re.M)
            slugs = {
                re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in heads
            }
            assert anchor in slugs, f"README links to {u}: no such heading"
