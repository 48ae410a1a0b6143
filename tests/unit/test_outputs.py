"""Outputs never harm what is there: devices and FIFOs are written through, never replaced; inputs
are refused; temporary files are exclusive; a file is written whole or left untouched.

(Issue "Hostile and broken input", classes 1, 3 and 9.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import make_header

from hvtrace.cli import main
from hvtrace.errors import TraceError
from hvtrace.export.output import open_output
from hvtrace.format.schema import KIND_CODE
from hvtrace.record import recorder as R

SAMPLE = Path(__file__).resolve().parents[2] / "sample_traces" / "balanced_2rank"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


@pytest.fixture
def run(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    shutil.copytree(SAMPLE, d)
    return d


def _sums(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("hvtrace: error: ") and "\n" not in err, err
    return err


def test_dev_null_is_written_through(run: Path, capsys) -> None:
    assert main(["analyze", str(run), "-o", "/dev/null", "--json", "/dev/null"]) == 0
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@root_only
def test_a_full_device_says_no_space_and_stays_a_device(run: Path, tmp_path: Path, capsys) -> None:
    full = tmp_path / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # what /dev/full is
    for opt in ("--json", "-o"):
        assert main(["analyze", str(run), opt, str(full)]) == 2
        assert "No space left" in _one_line_error(capsys)
        assert stat.S_ISCHR(os.lstat(full).st_mode)


def test_a_fifo_gets_the_output(run: Path, tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["analyze", str(run), "--json", str(fifo)]) == 0
    reader.join(30)
    assert json.loads(got[0])["run_id"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_an_input_is_never_an_output(run: Path, tmp_path: Path, capsys) -> None:
    before = _sums(run)
    rank_file = sorted(run.iterdir())[0]
    link = tmp_path / "innocent.json"
    link.symlink_to(rank_file)
    for opt in ("--json", "-o"):
        for target in (rank_file, link):
            assert main(["analyze", str(run), opt, str(target)]) == 2
            assert "is an input of this analysis" in _one_line_error(capsys)
    assert _sums(run) == before
    assert main(["analyze", str(run), "--json", str(run)]) == 2
    assert "a directory" in _one_line_error(capsys)
    assert _sums(run) == before


def test_planted_links_at_temp_names_are_not_followed(run: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("report.json", "timeline.json"):
        for i in range(3):  # the names the old code used, and a few more
            (out / f".{name}.{i:03d}.tmp").symlink_to(victim)
    assert main(["analyze", str(run), "--json", str(out / "report.json"),
                 "-o", str(out / "timeline.json")]) == 0  # fmt: skip
    assert victim.read_text() == "precious"
    assert json.loads((out / "report.json").read_text())["run_id"]
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]
    umask = os.umask(0)
    os.umask(umask)
    for name in ("report.json", "timeline.json"):  # a new file's mode, not mkstemp's 0600
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~umask, name
    # replacing a file keeps its mode (a 0644 timeline does not become 0600)
    os.chmod(out / "timeline.json", 0o640)
    assert main(["analyze", str(run), "-o", str(out / "timeline.json")]) == 0
    assert stat.S_IMODE(os.stat(out / "timeline.json").st_mode) == 0o640


def test_a_failed_write_leaves_the_old_file_whole(tmp_path: Path) -> None:
    p = tmp_path / "report.json"
    p.write_text("old content")
    with pytest.raises(RuntimeError), open_output(p) as f:
        f.write(b"half of the new")
        raise RuntimeError("disk full, say")
    assert p.read_text() == "old content"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["report.json"]


def test_table_outputs_are_checked_too(run: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "tables"
    blocker.write_text("a file, not a directory")
    assert main(["analyze", str(run), "--csv", str(blocker)]) == 2
    assert "not a directory" in _one_line_error(capsys)
    assert main(["analyze", str(run), "--parquet", str(tmp_path / "pq")]) == 0
    assert (tmp_path / "pq" / "steps.parquet").stat().st_size > 0
    first = sorted(run.iterdir())[0]
    with pytest.raises(TraceError, match="is an input"), open_output(first, list(run.iterdir())):
        pass


EVIL = 'R</title><script>alert(1)</script><b>"x"'


def test_dashboard_shows_trace_text_as_text(tmp_path: Path) -> None:
    """A run id, host or tensor name from a trace file never becomes markup in the page."""
    pytest.importorskip("dash")
    from helpers import rewrite_header as _rewrite_header
    from helpers import synth_module
    from hvtrace_dashboard import figures
    from hvtrace_dashboard.app import create_app

    from hvtrace.load import load_run

    synth_module().write_synth_run(tmp_path, ranks=4, steps=12, tensors=4, ranks_per_host=2,
                          compact_files=False)  # fmt: skip
    for p in tmp_path.iterdir():
        _rewrite_header(p, lambda h: {**h, "run_id": EVIL, "host": EVIL + str(h["rank"] // 2)})
    page = create_app(load_run(tmp_path)).server.test_client().get("/").get_data(as_text=True)
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    labels = figures.rank_labels([0, 2], {0: EVIL + "0", 2: EVIL + "1"})
    assert all("<" not in lab and "&lt;script&gt;" in lab for lab in labels)


def test_terminal_output_shows_control_characters_escaped(tmp_path: Path, capsys) -> None:
    """Names, hosts and run ids cannot act on the terminal or forge report lines."""
    from helpers import rewrite_header as _rewrite_header

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    nasty = "vm\x1b]0;owned\x07\x1b[2J\nFindings\n! forged"
    for p in run.iterdir():
        _rewrite_header(p, lambda h: {**h, "host": nasty})
    for cmd, shown in (
        (["analyze", str(run)], "\\x1b]0;owned\\x07\\x1b[2J\\nFindings\\n! forged"),
        (["info", str(run)], "vm\\x1b]0;owne"),  # the host column is 14 wide
    ):
        assert main(cmd) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out
        assert shown in out
        assert not any(line.startswith("! forged") for line in out.splitlines())


def test_report_says_when_the_warm_up_is_analyzed(capsys, tmp_path: Path) -> None:
    """--skip-steps past the end (or --steps :1) cannot leave a report that claims a skip."""
    for extra in (["--skip-steps", "1000"], ["--steps", ":1"]):
        out_json = tmp_path / "r.json"
        assert main(["analyze", str(SAMPLE), *extra, "--json", str(out_json)]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "so it is included" in text and "skipped" not in text.split("Where")[0]
        assert json.loads(out_json.read_text())["steps"]["warmup_included"] is True
    assert main(["analyze", str(SAMPLE), "--json", str(out_json)]) == 0
    assert "warm-up step 0 skipped" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["steps"]["warmup_included"] is False


def test_small_ones(tmp_path: Path, monkeypatch) -> None:
    """Messages are shortened at a word, an unopenable file is "cannot read", and the dashboard
    carries its sample run as package data (an installed wheel has it)."""
    import tomllib

    from hvtrace.format.read import _short, read_header

    long = ValueError(("word " * 80).strip())
    short = _short(long)
    assert short.endswith(" …") and len(short) <= 200 and "wor …" not in short
    d = tmp_path / "rank00000-x.arrows"
    d.mkdir()  # exists, has a size, cannot be read as a file
    with pytest.raises(TraceError, match="cannot read"):
        read_header(d)
    dash = pytest.importorskip("hvtrace_dashboard.app")
    packaged = Path(dash.__file__).parent / "sample"
    assert sorted(p.suffix for p in packaged.iterdir()) == [".arrows", ".arrows"]
    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    assert "sample/*" in data["tool"]["setuptools"]["package-data"]["hvtrace_dashboard"]
    # installed: no sample_traces/ beside the package or in the working directory
    site = tmp_path / "site" / "hvtrace_dashboard"
    shutil.copytree(packaged, site / "sample")
    monkeypatch.setattr(dash, "__file__", str(site / "app.py"))
    monkeypatch.chdir(tmp_path)
    assert dash.sample_run_dir() == site / "sample"


@pytest.mark.parametrize("cmd", ["analyze", "info"])
def test_standard_output_on_a_full_device(cmd: str) -> None:
    """stdout on /dev/full: one line, exit 2, not an internal error."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [sys.executable, "-m", "hvtrace.cli", cmd, str(SAMPLE)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert lines == ["hvtrace: error: cannot write the output (No space left on device)"]


def test_csv_cells_a_spreadsheet_would_run_are_neutralized(tmp_path: Path) -> None:
    """Names in a trace are anyone's (a span, a tensor, a host): a CSV cell beginning with =, +,
    -, @, a tab or a carriage return is prefixed with ' (OWASP), in every table; the Parquet
    tables keep the names as they are."""
    hostile = ['=HYPERLINK("http://evil","x")', "+1+1", "-2+3", "@SUM(A1)", "\tcmd"]
    run = tmp_path / "run"
    rec = R.Recorder(run, make_header(), flush_interval_s=30)
    t = 1_000_000
    for s in range(6):
        rec.step = s
        rec.add(KIND_CODE["forward"], "forward", t, t + 1000)
        rec.add(KIND_CODE["step"], "step", t, t + 2000)
        for i, name in enumerate(hostile):
            rec.add(KIND_CODE["user"], name, t + 10 * i, t + 10 * i + 5)
        t += 10_000
    rec.close()
    assert main(["analyze", str(run), "--csv", str(tmp_path / "csv")]) == 0
    assert main(["analyze", str(run), "--parquet", str(tmp_path / "pq")]) == 0
    for f in (tmp_path / "csv").glob("*.csv"):
        for line in f.read_text().splitlines():
            for cell in line.split(","):
                assert not cell.strip('"').startswith(("=", "+", "@", "\t")), (f.name, cell)
    text = (tmp_path / "csv" / "user_spans.csv").read_text()
    assert "'=HYPERLINK(" in text and "'@SUM(A1)" in text and "'-2+3" in text
    names = set(pq.read_table(tmp_path / "pq" / "spans.parquet").column("name").to_pylist())
    assert set(hostile) <= names  # the data itself is not changed


def test_table_directories_are_checked_before_the_analysis(
    run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """--parquet into the run directory would leave tables every later analysis takes for
    damaged trace files: refused; a --csv/--parquet path that is a file is refused too, both
    before anything is analyzed."""
    import hvtrace.analysis

    def no_analysis(*a, **k):
        raise AssertionError("analyzed before the output was checked")

    monkeypatch.setattr(hvtrace.analysis, "analyze", no_analysis)
    before = _sums(run)
    assert main(["analyze", str(run), "--parquet", str(run)]) == 2
    assert "that is the run directory" in _one_line_error(capsys)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for opt in ("--csv", "--parquet"):
        assert main(["analyze", str(run), opt, str(blocker)]) == 2
        assert "exists and is not a directory" in _one_line_error(capsys)
    assert _sums(run) == before
