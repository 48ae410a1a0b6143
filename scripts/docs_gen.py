"""Pages of the documentation generated from the code, so they cannot drift from it.

Run by ``mkdocs build`` (the ``gen-files`` plugin, ``mkdocs.yml``); each page is written into
the site's virtual file system, never into ``docs/``:

- ``reference/cli.md``: every ``hvtrace`` command and option, from the argparse parser;
- ``findings.md``: every kind of finding, from :data:`hvtrace.analysis.model.FINDING_KINDS`;
- ``settings.md``: every ``HVTRACE_*`` setting, from :mod:`hvtrace.settings`;
- ``bench.md``: ``bench/README.md``, the benchmarks' method and figures, as it is.

``python scripts/docs_gen.py OUT_DIR`` writes the same pages into OUT_DIR (the tests read them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this tree's hvtrace, whatever is installed


def _escape(text: str) -> str:
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _num(x: float) -> str:
    """A default or bound as a person writes it: 1,048,576, 0.5, 1e+09 stays 1,000,000,000."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | what it does |", "| --- | --- |"]
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if a.option_strings:
            flags = ", ".join(a.option_strings)
            if a.nargs != 0:
                flags += f" {a.metavar or a.dest.upper()}"
        else:
            flags = str(a.metavar or a.dest)
        helptext = a.help or ""
        if "%(default)" in helptext:
            helptext = helptext % {"default": a.default}
        rows.append(f"| `{flags}` | {_escape(helptext)} |")
    return rows


def _help(parser: argparse.ArgumentParser, name: str) -> str:
    """A sub-command's one-line help, where it has no description."""
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for c in a._choices_actions:
                if c.dest == name:
                    return (c.help or "").capitalize() + "."
    return ""


def cli_page() -> str:
    """The command-line reference, from :func:`hvtrace.cli.build_parser`."""
    from hvtrace.cli import build_parser

    parser = build_parser()
    out = [
        "# Command line",
        "",
        "Generated from the `hvtrace` command's own parser (`hvtrace/cli.py`): what "
        "`hvtrace COMMAND --help` prints, as tables.",
        "",
        "```",
        parser.format_usage().strip(),
        "```",
        "",
        parser.description or "",
        "",
        *_options(parser),
    ]
    for name, sub in _subparsers(parser).items():
        out += [
            "",
            f"## hvtrace {name}",
            "",
            "```",
            sub.format_usage().strip(),
            "```",
            "",
            sub.description or _help(parser, name),
            "",
            *_options(sub),
        ]
    return "\n".join(out) + "\n"


def findings_page() -> str:
    """Every kind of finding, from :data:`hvtrace.analysis.model.FINDING_KINDS`."""
    from hvtrace.analysis.findings import CORRECTNESS_KINDS
    from hvtrace.analysis.model import FINDING_KINDS

    out = [
        "# Findings",
        "",
        "Every kind of finding `hvtrace analyze` can raise, generated from the analysis' own list "
        "(`hvtrace.analysis.model.FINDING_KINDS`; a test fails when the analysis raises a kind "
        "that is not in it). In the report a finding is one line, `!` for a warning, `-` for "
        "a note; in the JSON (`findings`) it has `kind`, `severity`, `message`, `value` with its "
        "`unit`, and `data`. Warnings come first: whether the job is correct ("
        + ", ".join(f"`{k}`" for k in CORRECTNESS_KINDS)
        + "), then the rest by what each costs, the costliest first; every finding with a time "
        "cost carries `data.cost_ms_per_step` and `data.cost_share` (its share of the run).",
        "",
        "| kind | severity |",
        "| --- | --- |",
    ]
    out += [f"| [`{k}`](#{k}) | {v.severity} |" for k, v in FINDING_KINDS.items()]
    for k, v in FINDING_KINDS.items():
        out += [
            "",
            f"## {k}",
            "",
            f"**{v.title}.** {v.means}",
            "",
            f"- **Severity**: {v.severity}.",
            f"- **What it costs**: {v.cost}",
            f"- **What to do**: {v.action}",
        ]
    return "\n".join(out) + "\n"


def settings_page() -> str:
    """Every ``HVTRACE_*`` setting, from :mod:`hvtrace.settings`."""
    from hvtrace import settings

    out = [
        "# Settings",
        "",
        "Every `HVTRACE_*` environment variable, generated from `hvtrace/settings.py`. A value "
        "that cannot be parsed or is out of bounds gives one warning (logger `hvtrace`) and the "
        "default; it never stops training. Arguments of `hvtrace.DistributedOptimizer` "
        "(`flush_interval_s=`, `consistency_every=`, `live_every=`, ...) go through the same "
        "checks and take precedence.",
        "",
        "| variable | default | bounds | what it sets |",
        "| --- | --- | --- | --- |",
    ]
    for env, s in settings.SETTINGS.items():
        bounds = f"{_num(s.lo)} .. {_num(s.hi)}" if s.lo is not None and s.hi is not None else ""
        out.append(f"| `{env}` | {_num(s.default)} | {bounds} | {_escape(s.doc)} |")
    out += ["", "| variable | what it does |", "| --- | --- |"]
    out += [f"| `{env}` | {_escape(doc)} |" for env, doc in settings.SWITCHES.items()]
    return "\n".join(out) + "\n"


def bench_page() -> str:
    """``bench/README.md`` as it is: how each figure was measured."""
    return (ROOT / "bench" / "README.md").read_text(encoding="utf-8")


PAGES = {
    "reference/cli.md": cli_page,
    "findings.md": findings_page,
    "settings.md": settings_page,
    "bench.md": bench_page,
}


def _mkdocs() -> None:
    import mkdocs_gen_files

    for path, make in PAGES.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(make())
        mkdocs_gen_files.set_edit_path(path, "scripts/docs_gen.py")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/docs_gen.py OUT_DIR")
    out_dir = Path(sys.argv[1])
    for path, make in PAGES.items():
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / path).write_text(make(), encoding="utf-8")
else:
    _mkdocs()
