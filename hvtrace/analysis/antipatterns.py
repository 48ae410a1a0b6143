"""Anti-patterns of a Horovod job's set-up that cost work without an error: each rank trains on
the same batches (no ``DistributedSampler``), the ranks of one host ask for more threads than
it has cores, two ranks share one GPU. Each is named with what it costs and what to do.

- **Unsharded data.** Each rank records a fingerprint of the batch its model's forward received
  on the consistency checks' schedule (``hvtrace.batch|input``:
  :class:`hvtrace.record.consistency.BatchFingerprints`). :func:`batch_check` compares them
  across ranks with DuckDB over the rank files: one aggregate query (per checked step, how many
  ranks and how many distinct fingerprints); only when every checked step after the first has
  ranks with equal fingerprints are those steps' rows read, to group the ranks.
  :func:`unsharded_findings` names the groups: ranks with equal batches at every checked step
  after the first (two checks at least) did the same work, and ``1 - groups / ranks`` of the
  job's compute was spent on duplicates. Data that is the same on every rank on purpose cannot be
  told apart: the finding says it is the likely cause, not a certainty.
- **Placement** (:func:`placement`), from the rank headers (:func:`hvtrace.record.header.
  cpu_info` and :func:`~hvtrace.record.header.cuda_info`): per host, the threads the ranks ask
  torch for against the cores they may run on (``oversubscribed``, with the run-queue wait the
  analysis measured there: :func:`hvtrace.analysis.stragglers.host_contention`), and ranks of one
  host on the same CUDA device (``shared_gpu``, by UUID, else PCI bus id).
- **Learning rate and world size** (:func:`lr_summary`): the recorded learning rates beside the
  number of ranks, as information (the JSON's ``scale``).

The same scan of the rank files reads the zero-row checks of large embedding gradients
(``hvtrace.zero_rows|...``), which :mod:`hvtrace.analysis.gradients` judges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from hvtrace.analysis.model import Analysis, Finding
from hvtrace.format.schema import BATCH_NAME, LR_PREFIX, ZERO_ROWS_PREFIX
from hvtrace.load import RankSource
from hvtrace.selection import StepRange, rank_runs
from hvtrace.units import printable

#: Checked steps listed in :func:`batch_check`'s result, at most.
MAX_STEPS_LISTED: Final = 50
#: Groups of ranks named in one finding, at most (the rest are counted).
MAX_GROUPS: Final = 8
#: An oversubscribed host whose ranks were measured waiting for a CPU less than this share of
#: their work outside synchronize is an info note, not a warning (the threads were not all busy).
OVERSUBSCRIBED_QUIET_SHARE: Final = 0.02

#: The scalar rows the checks read, in one scan of the rank files: the batch fingerprints (the
#: first of each rank and step), the learning rates of one rank, the zero-row checks.
_SCAN_SQL = (
    "SELECT rank, step, name::VARCHAR AS name, value, start_ns, bytes FROM ({src}) "
    f"WHERE kind = 'scalar' AND value IS NOT NULL AND {{where}} AND (name = '{BATCH_NAME}' OR "
    f"(starts_with(name, '{LR_PREFIX}') AND rank = {{lr_rank}}) OR "
    f"starts_with(name, '{ZERO_ROWS_PREFIX}'))"
)
_ZERO_SQL = (
    "SELECT rank, step, name, value, bytes FROM {table} "
    f"WHERE starts_with(name, '{ZERO_ROWS_PREFIX}') ORDER BY step, rank, name"
)
_ROWS_SQL = (
    "SELECT step, rank, arg_min(value, start_ns) AS v FROM {table} "
    f"WHERE name = '{BATCH_NAME}' GROUP BY step, rank"
)
_STEPS_SQL = (
    "SELECT step, count(*) AS ranks, count(DISTINCT v) AS distinct_v FROM ({rows}) "
    "GROUP BY step ORDER BY step"
)
_LR_SQL = (
    "SELECT name, arg_min(value, step) AS first_lr, min(step) AS first_step, "
    "arg_max(value, step) AS last_lr, max(step) AS last_step, min(value) AS min_lr, "
    f"max(value) AS max_lr FROM {{table}} WHERE starts_with(name, '{LR_PREFIX}') "
    "GROUP BY name ORDER BY name"
)


def empty_batches() -> dict[str, Any]:
    """The result of :func:`batch_check` for a run without batch fingerprints."""
    return {"checked": False, "groups": []}


def scan(
    sources: Sequence[RankSource], size: int, steps: StepRange | None = None, con: Any = None
) -> tuple[dict[str, Any], dict[str, Any], list[tuple[int, int, str, float, int]]]:
    """:func:`batch_check` and :func:`lr_summary` of ``sources``, and the zero-row checks'
    rows ``(rank, step, name, value, bytes)`` (for :func:`hvtrace.analysis.gradients.
    zero_rows_summary`), from one scan of the rank files (the rows, few, in a temporary
    table). ``size``: the world size. ``con``: a DuckDB connection used by this call alone
    (default: a new one). A damaged file leaves all empty, with ``error`` in the first."""
    from hvtrace.analysis.engine import on_own_engine, span_query

    if con is None:
        return on_own_engine(
            lambda c: scan(sources, size, steps, c),
            lambda error: (
                {**empty_batches(), "error": error},
                {"size": int(size), "groups": []},
                [],
            ),
        )
    ranks = [int(s.rank) for s in sources if s.rank is not None]
    if not sources:
        return empty_batches(), {"size": int(size), "groups": []}, []
    lr_rank = min(ranks) if ranks else 0
    table = "hv_antipattern_rows"
    with span_query(con, sources, steps) as (src, where, params):
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE {table} AS "
            + _SCAN_SQL.format(src=src, where=where, lr_rank=lr_rank),
            params,
        )
    try:
        rows = _ROWS_SQL.format(table=table)
        per_step = con.execute(_STEPS_SQL.format(rows=rows)).fetchall()

        def fetch(steps_wanted: list[int]) -> list[tuple[int, int, float]]:
            listed = ", ".join(str(int(s)) for s in steps_wanted) or "NULL"
            return con.execute(
                f"SELECT step, rank, v FROM ({rows}) WHERE step IN ({listed})"
            ).fetchall()

        batches = _judge([(int(s), int(n), int(d)) for s, n, d in per_step], fetch)
        lrs = con.execute(_LR_SQL.format(table=table)).fetchall()
        zero = con.execute(_ZERO_SQL.format(table=table)).fetchall()
    finally:
        con.execute(f"DROP TABLE IF EXISTS {table}")
    return batches, _lr_groups(lrs, size, lr_rank), zero


def batch_check(
    sources: Sequence[RankSource], steps: StepRange | None = None, con: Any = None
) -> dict[str, Any]:
    """Compare the ranks' batch fingerprints at each checked step (see the module doc).

    Returns a JSON-ready dict: ``checked`` (any fingerprints), ``checks`` (steps checked by two
    ranks or more), ``steps`` (up to :data:`MAX_STEPS_LISTED` of them), ``ranks`` (ranks with
    fingerprints), ``duplicate_steps`` (how many checked steps had ranks with equal batches),
    ``groups`` (when every checked step after the first, two checks at least, had equal batches:
    each group of two or more ranks whose batches were equal at every one of those steps, as
    ``{"ranks", "first_step"}``; ``first_step`` is the first checked step at which all of them
    had the same batch), ``distinct`` (how many different batch sequences the ranks trained on)
    and ``wasted_share`` (``1 - distinct / ranks``: the share of the compute spent on duplicate
    batches). ``con``: a DuckDB connection used by this call alone (default: a new one).
    """
    return scan(sources, len(sources), steps, con)[0]


def batch_check_frame(spans: Any, steps: StepRange | None = None) -> dict[str, Any]:
    """:func:`batch_check` of a span frame (``rank, step, kind, name, start_ns, value``)."""
    if spans is None or len(spans) == 0 or "value" not in spans.columns:
        return empty_batches()
    m = (spans["kind"].astype(str) == "scalar") & (spans["name"].astype(str) == BATCH_NAME)
    s = spans.loc[m & spans["value"].notna(), ["step", "rank", "start_ns", "value"]]
    if steps is not None:
        s = s[steps.mask(s["step"])]
    s = s.sort_values("start_ns").drop_duplicates(["step", "rank"], keep="first")
    per_step = [
        (int(step), len(g), int(g["value"].nunique())) for step, g in s.groupby("step", sort=True)
    ]

    def fetch(steps_wanted: list[int]) -> list[tuple[int, int, float]]:
        t = s[s["step"].isin(steps_wanted)]
        return list(zip(t["step"].astype(int), t["rank"].astype(int), t["value"].astype(float)))

    return _judge(per_step, fetch)


def _judge(per_step: list[tuple[int, int, int]], fetch: Any) -> dict[str, Any]:
    """The verdict from ``per_step`` ``(step, ranks, distinct fingerprints)`` and ``fetch(steps)``
    (the ``(step, rank, value)`` rows of those steps), read only when needed."""
    if not per_step:
        return empty_batches()
    checked = [(s, n, d) for s, n, d in per_step if n >= 2]
    out: dict[str, Any] = {
        "checked": True,
        "checks": len(checked),
        "steps": [s for s, _, _ in checked[:MAX_STEPS_LISTED]],
        "ranks": max(n for _, n, _ in per_step),
        "duplicate_steps": sum(1 for _, n, d in checked if d < n),
        "groups": [],
        "distinct": None,
        "wasted_share": None,
    }
    after = checked[1:]
    if len(checked) < 2 or any(d >= n for _, n, d in after):
        return out  # sharded (or too few checks to say)
    steps_after = [s for s, _, _ in after]
    got = fetch([checked[0][0], *steps_after])
    by_rank: dict[int, dict[int, float]] = {}
    for step, rank, v in got:
        by_rank.setdefault(int(rank), {})[int(step)] = float(v)
    keys: dict[tuple, list[int]] = {}
    for rank in sorted(by_rank):
        vals = by_rank[rank]
        key = tuple(vals.get(s) for s in steps_after)
        # a rank missing a check is its own group (None is no value to share)
        key = key if None not in key else ("rank", rank)
        keys.setdefault(key, []).append(rank)
    groups = []
    all_steps = [checked[0][0], *steps_after]
    for ranks in keys.values():
        if len(ranks) < 2:
            continue
        first = next(
            (s for s in all_steps if len({by_rank[r].get(s) for r in ranks}) == 1),
            steps_after[0],
        )
        groups.append({"ranks": ranks, "first_step": int(first)})
    if not groups:
        return out
    n = len(by_rank)
    out["groups"] = sorted(groups, key=lambda g: (-len(g["ranks"]), g["ranks"][0]))
    out["distinct"] = len(keys)
    out["wasted_share"] = 1.0 - len(keys) / n if n else None
    out["ranks"] = n
    return out


def unsharded_findings(a: Analysis) -> list[Finding]:
    """An ``unsharded_data`` finding when ranks trained on the same batches (:func:`batch_check`
    in ``a.batches``): the groups, the first step, the share of the work wasted, what to do."""
    b = getattr(a, "batches", None) or {}
    groups = b.get("groups") or []
    if not groups:
        return []
    n, distinct = int(b["ranks"]), int(b["distinct"])
    wasted = float(b["wasted_share"])
    steps = b.get("steps") or []
    listed = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    start = int(steps[0]) if steps else 0
    parts = [
        f"ranks {rank_words(g['ranks'])}"
        + (f" (from step {g['first_step']})" if int(g["first_step"]) != start else "")
        for g in groups[:MAX_GROUPS]
    ]
    more = len(groups) - MAX_GROUPS
    who = "; ".join(parts) + (f"; and {more} more groups" if more > 0 else "")
    every = len(groups) == 1 and len(groups[0]["ranks"]) == n
    first = min(int(g["first_step"]) for g in groups)
    when = "at every checked step" if first == start else "at every checked step after the first"
    msg = (
        f"unsharded data: {who} trained on the same batches {when} (steps {listed}: "
        f"{b['checks']} checks): no DistributedSampler, or the same seed for every rank's data? "
        f"The job did the work of {distinct} rank{'s' if distinct != 1 else ''} with {n}: "
        f"{wasted:.0%} of the compute was spent on duplicate batches, and each step averaged "
        f"the gradients of {'one batch' if every else f'{distinct} batches'}, not {n}. Shard "
        "the data: DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank()) for "
        "the DataLoader, and sampler.set_epoch(epoch) at each epoch (synthetic data: seed each "
        "rank's generator with its rank). This is the likely cause, not a certainty: data meant "
        "to be the same on every rank looks the same"
    )
    data = {
        "groups": [dict(g) for g in groups],
        "ranks": n,
        "distinct": distinct,
        "wasted_share": wasted,
        "step": first,
        "checks": int(b["checks"]),
        "steps": list(steps),
    }
    return [Finding("unsharded_data", "warning", msg, wasted, "share of compute", data)]


# -- placement: threads against cores, GPUs shared ------------------------------------------------
def placement(headers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per host, what its ranks ask of its CPUs and GPUs, from the rank headers (``cpu`` and
    ``cuda``: :mod:`hvtrace.record.header`).

    Returns a JSON-ready dict: ``hosts``, one entry per host with ``host``, ``ranks``,
    ``cpu_count`` (the host's logical CPUs, as the first rank saw it), ``cores`` (the CPUs the
    ranks may run on: the union of their affinities, else ``cpu_count``), ``threads`` (rank ->
    torch intra-op threads), ``threads_total`` and ``oversubscribed`` (``threads_total >
    cores``, or a rank asking for more threads than its own affinity has), ``snug_ranks`` (the
    ranks pinned to exactly as many CPUs as they run torch threads, fewer than the host has:
    their other threads, Horovod's background thread first, have no CPU of their own); and
    ``shared_gpus``:
    per CUDA device used by two ranks or more of one host, ``host``, ``device`` (UUID, else PCI
    bus id), ``ranks``, ``index``, ``name``, ``visible`` (the devices each process sees).
    Ranks whose headers lack the fields (older files) are left out."""
    hosts: dict[str, dict[str, Any]] = {}
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    for rank in sorted(headers):
        h = headers[rank] or {}
        host = str(h.get("host") or "?")
        cpu = h.get("cpu")
        if isinstance(cpu, dict) and isinstance(cpu.get("torch_threads"), int):
            e = hosts.setdefault(
                host,
                {"host": host, "ranks": [], "cpu_count": cpu.get("cpu_count"), "threads": {},
                 "_cpus": set(), "_tight": [], "_snug": []},
            )  # fmt: skip
            e["ranks"].append(int(rank))
            e["threads"][int(rank)] = int(cpu["torch_threads"])
            aff = cpu.get("affinity")
            if isinstance(aff, list) and aff:
                e["_cpus"].update(int(c) for c in aff)
                if int(cpu["torch_threads"]) > len(aff):
                    e["_tight"].append(int(rank))
                elif int(cpu["torch_threads"]) == len(aff) < int(cpu.get("cpu_count") or 0):
                    e["_snug"].append(int(rank))
        cuda = h.get("cuda")
        if isinstance(cuda, dict):
            dev = cuda.get("uuid") or cuda.get("pci_bus_id")
            if dev:
                g = gpus.setdefault(
                    (host, str(dev)),
                    {"host": host, "device": str(dev), "ranks": [], "index": cuda.get("index"),
                     "name": cuda.get("name"), "visible": cuda.get("visible"),
                     "pci_bus_id": cuda.get("pci_bus_id")},
                )  # fmt: skip
                g["ranks"].append(int(rank))
    out_hosts = []
    for e in hosts.values():
        cpus, tight, e["snug_ranks"] = e.pop("_cpus"), e.pop("_tight"), e.pop("_snug")
        cores = len(cpus) if cpus else e["cpu_count"]
        total = sum(e["threads"].values())
        e["cores"] = cores
        e["threads_total"] = total
        e["tight_ranks"] = tight
        e["oversubscribed"] = bool((cores is not None and total > int(cores)) or tight)
        out_hosts.append(e)
    shared = [g for g in gpus.values() if len(g["ranks"]) > 1]
    return {"hosts": out_hosts, "shared_gpus": shared}


def oversubscribed_findings(a: Analysis) -> list[Finding]:
    """``oversubscribed``: a host whose ranks ask torch for more threads than it has cores (see
    :func:`placement`), with the run-queue wait measured there (``a.contention``)."""
    p = getattr(a, "placement", None) or {}
    cont = a.contention
    measured: dict[str, Any] = {}
    if cont is not None and len(cont):
        measured = {str(r.host): r for r in cont.itertuples()}
    out = []
    for e in p.get("hosts") or []:
        if not e.get("oversubscribed"):
            continue
        host, ranks, cores = str(e["host"]), list(e["ranks"]), e.get("cores")
        threads = {int(r): int(t) for r, t in e["threads"].items()}
        total = int(e["threads_total"])
        same = len(set(threads.values())) == 1
        asks = (
            f"ask torch for {next(iter(threads.values()))} intra-op thread"
            f"{'s' if next(iter(threads.values())) != 1 else ''} each, {total} in all"
            if same
            else "ask torch for "
            + ", ".join(f"{t} (rank {r})" for r, t in list(threads.items())[:6])
            + f" intra-op threads, {total} in all"
        )
        where = f"on {cores} core{'s' if cores != 1 else ''}"
        if e.get("cpu_count") is not None and cores != e.get("cpu_count"):
            where += f" (their CPU affinity; the host has {e['cpu_count']})"
        tight = e.get("tight_ranks") or []
        if tight and not (cores is not None and total > int(cores)):
            where += (
                f"; rank{'s' if len(tight) > 1 else ''} {rank_words(tight)} each ask for more "
                "threads than the cores their affinity allows"
            )
        m = measured.get(host)
        runq = work_share = None
        sev = "warning"
        if m is not None and m.runq_ms == m.runq_ms:
            runq, work_share = float(m.runq_ms), float(m.work_share)
            cost = (
                f"measured: its ranks waited a median {runq:.1f} ms per step runnable but "
                f"without a CPU, {work_share:.0%} of their {float(m.work_ms):.1f} ms of work "
                "outside synchronize"
            )
            if work_share < OVERSUBSCRIBED_QUIET_SHARE:
                sev = "info"
                cost += " (little contention in this run: the threads were not all busy)"
        else:
            cost = "the run-queue wait was not measured (no per-thread scheduler counters)"
        per_rank = max(1, int(cores or 1) // max(1, len(ranks)))
        msg = (
            f"oversubscribed host {printable(host)}: ranks {rank_words(ranks)} {asks}, {where}: "
            f"more busy threads than cores, so they take turns on the CPUs; {cost}. Give each "
            f"rank its share: torch.set_num_threads({per_rank}) (cores // ranks on the host = "
            f"{cores} // {len(ranks)}; or OMP_NUM_THREADS={per_rank}) before training, or run "
            "fewer ranks per host"
        )
        data = {
            "host": host,
            "ranks": ranks,
            "threads": {str(r): t for r, t in threads.items()},
            "threads_total": total,
            "cores": cores,
            "cpu_count": e.get("cpu_count"),
            "suggested_threads": per_rank,
            "runq_ms": runq,
            "work_share": work_share,
        }
        out.append(Finding("oversubscribed", sev, msg, float(total), "threads", data))
    return out


def shared_gpu_findings(a: Analysis) -> list[Finding]:
    """``shared_gpu``: ranks of one host that train on the same CUDA device (:func:`placement`)."""
    p = getattr(a, "placement", None) or {}
    out = []
    for g in p.get("shared_gpus") or []:
        ranks = list(g["ranks"])
        idx = g.get("index")
        dev = f"cuda:{idx}" if idx is not None else "one device"
        name = f", {printable(str(g['name']))}" if g.get("name") else ""
        visible = g.get("visible")
        idle = (
            f"; each process sees {visible} GPUs, so {visible - 1} of them may idle"
            if isinstance(visible, int) and visible > 1
            else ""
        )
        msg = (
            f"ranks {rank_words(ranks)} on host {printable(str(g['host']))} share one GPU "
            f"({dev}{name}, {printable(str(g['device']))}): they take turns on it and share its "
            f"memory, each getting about 1/{len(ranks)} of it{idle}. Probably "
            "torch.cuda.set_device(hvd.local_rank()) is missing, or the device is hard-coded "
            "(cuda:0): set the device from hvd.local_rank() right after hvd.init(), and build the "
            "model and tensors on torch.device('cuda', hvd.local_rank())"
        )
        data = {k: g.get(k) for k in ("host", "device", "index", "name", "visible", "pci_bus_id")}
        data["ranks"] = ranks
        out.append(Finding("shared_gpu", "warning", msg, float(len(ranks)), "ranks", data))
    return out


# -- learning rate beside world size (information) ------------------------------------------------
def lr_summary(
    sources: Sequence[RankSource], size: int, steps: StepRange | None = None, con: Any = None
) -> dict[str, Any]:
    """The learning rates the lowest rank recorded (``hvtrace.lr|G``), per param group, beside
    the world size ``size``: information only (Horovod's usual rule scales the learning rate by
    the number of ranks, but whether a job should is the user's call). Returns ``{"size",
    "rank", "groups"}``, each group with ``group``, ``first_lr``, ``first_step``, ``last_lr``,
    ``last_step``, ``min_lr``, ``max_lr`` (``groups`` empty when none was recorded)."""
    return scan(sources, size, steps, con)[1]


def _lr_groups(got: list[tuple], size: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"size": int(size), "rank": int(rank), "groups": []}
    for name, first, s0, last, s1, lo, hi in got:
        g = str(name)[len(LR_PREFIX) :]
        out["groups"].append(
            {
                "group": int(g) if g.isdigit() else g,
                "first_lr": float(first),
                "first_step": int(s0),
                "last_lr": float(last),
                "last_step": int(s1),
                "min_lr": float(lo),
                "max_lr": float(hi),
            }
        )
    return out


def rank_words(ranks: Sequence[int]) -> str:
    """``0-3`` for consecutive ranks, ``0, 2, 4`` otherwise (ranges within a list: ``0-3, 8``)."""
    parts = [
        f"{a}-{b}" if b - a >= 2 else ", ".join(map(str, range(a, b + 1)))
        for a, b in rank_runs(ranks)
    ]
    return ", ".join(parts)


__all__ = [
    "batch_check",
    "batch_check_frame",
    "empty_batches",
    "lr_summary",
    "oversubscribed_findings",
    "placement",
    "rank_words",
    "scan",
    "shared_gpu_findings",
    "unsharded_findings",
]
