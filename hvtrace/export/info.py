"""``hvtrace info``: what each rank recorded, and where the files are."""

from __future__ import annotations

from hvtrace.load import Run, span_sources
from hvtrace.units import printable


def format_info(run: Run) -> str:
    """Return a plain-text summary of a run: one line per rank, then problems and clock note.

    Spans are counted by the query engine, file by file: a run of any size is never loaded. Text
    from the files is shown escaped where a terminal would act on it."""
    from hvtrace.analysis.engine import kind_counts

    kc = kind_counts(span_sources(run))
    counts = kc.set_index(["rank", "kind"])["spans"]
    steps = kc[kc["kind"] == "step"].set_index("rank")["spans"]
    lines = [f"run {run.run_id}: {run.size} rank(s), directory {run.run_dir}"]
    lines.append(
        f"{'rank':>4} {'host':<14} {'steps':>6} {'spans':>8} {'allreduce':>9} "
        f"{'B/span':>6} {'state':<10} file"
    )
    for r in run.ranks:
        f = run.files[r]
        size_b = f.path.stat().st_size
        n_ar = int(counts.get((r, "allreduce"), 0))
        state = "truncated" if f.truncated else ("complete" if f.complete else "unclosed")
        lines.append(
            f"{r:>4} {printable(f.header.get('host', '?'))[:14]:<14} {int(steps.get(r, 0)):>6} "
            f"{f.spans:>8} {n_ar:>9} {size_b / max(f.spans, 1):>6.1f} {state:<10} {f.path}"
        )
    kinds = kc.groupby("kind")["spans"].sum().sort_values(ascending=False)
    lines.append("spans by kind: " + ", ".join(f"{k} {n}" for k, n in kinds.items() if n))
    h0 = run.files[run.ranks[0]].header
    lines.append(
        f"timing: {h0.get('timing')} on {h0.get('device')}; torch {h0.get('torch_version')}, "
        f"horovod {h0.get('horovod_version')}"
    )
    cpu = [
        1e3 * run.files[r].writer_cpu_s / n
        for r in run.ranks
        if run.files[r].writer_cpu_s and (n := int(steps.get(r, 0)))
    ]
    if cpu:
        lines.append(
            f"hvtrace's writer thread: {sorted(cpu)[len(cpu) // 2]:.3f} ms CPU per step "
            f"(median over ranks; max {max(cpu):.3f})"
        )
    lines.append(run.clock_summary())
    for p in run.problems:
        lines.append(f"warning: {p}")
    return "\n".join(printable(line) for line in lines)
