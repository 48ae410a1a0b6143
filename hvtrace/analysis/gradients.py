"""How a job sends its gradients: two anti-patterns that cost communication time and raise no
error, each named with what it costs and what to do.

- **Manual gradient averaging** (:func:`manual_check`, :func:`manual_findings`): the job
  allreduces its gradients itself after ``loss.backward()`` (``hvd.allreduce`` or
  ``hvd.allreduce_async_`` on each ``p.grad``) and steps a plain optimizer, instead of
  Horovod's distributed optimizer, which starts each gradient's allreduce as soon as the backward
  produces it. Seen through the collectives hvtrace records outside the optimizer
  (:mod:`hvtrace.record.collectives`; a job without Horovod's optimizer is traced through its
  plain one, :mod:`hvtrace.record.plain`): per rank and step, the allreduces issued after the
  backward ended whose tensors have the size of one of the model's parameters' gradients (or of
  all of them together: a flattened buffer), from the header's ``optimizer.param_bytes``. A rank
  where they carry at least :data:`MANUAL_COVER` of the gradients' bytes in at least
  :data:`MANUAL_STEPS` of its steps is named, with the first such step.

  What a distributed optimizer would hide (:func:`hidden_ms`, one definition): the backward
  (``B``, measured) produces the gradients at an even rate per byte, last layer first (the
  parameters in reverse order); each gradient's allreduce takes its bytes' share of the
  communication measured after the backward (``C``: from the first of those allreduces' start to
  the last one's end), one at a time, starting when its gradient is ready. The last allreduce
  ends at ``max_k (B F_k + C (1 - F_{k-1}))`` (``F_k``: the share of the bytes ready with the
  k-th gradient), so ``max(0, that - B)`` stays exposed after the backward and the rest of
  ``C``, at most ``B``, is hidden under it. The model leaves out that overlapped communication
  competes with the backward for the host's CPUs (Gloo on a small CPU host): the figure is what
  overlap alone would hide.

  Blocking calls made one at a time (their spans, one after the other, add up to ``C``) also
  pay a negotiation each, where Horovod's optimizer sends the gradients together (fused): that
  saves at least about ``(calls - 1) x`` the shortest call's time (a small tensor's call is
  mostly its negotiation; the others' are longer), at most what overlap leaves exposed. The
  finding's cost is the two together: a lower bound (bench/README.md: a 2-rank job's blocking
  calls cost 7 ms by this, 20 ms by the same job with the distributed optimizer).

  A run with Horovod's optimizer as well (its allreduces recorded as the optimizer's) averages
  the gradients twice: the manual allreduces are all waste, and the finding says so.

- **Sparse gradients sent dense** (:func:`zero_rows_summary`, :func:`sparse_findings`): on the
  consistency checks' schedule each rank records, for a large embedding gradient that Horovod
  allreduces dense, the share of its rows that were all zero (``hvtrace.zero_rows|HOW|NAME``:
  :class:`hvtrace.record.consistency.ZeroRows`). A tensor whose median share over the checks is
  at least :data:`ZERO_ROWS_MOST` is named with the bytes per step that carried zeros and their
  share of the step's measured communication time (bytes x share over the step's allreduced
  bytes, times its allreduce time), and the option that avoids it in Horovod 0.28: a sparse
  embedding with ``sparse_as_dense=False`` (Horovod allgathers the rows each rank used), where
  that sends fewer bytes at this many ranks, or another design where it would not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from hvtrace.analysis.antipatterns import rank_words
from hvtrace.analysis.model import Analysis, Finding
from hvtrace.format.schema import FLAG_OWN, ZERO_ROWS_HOW, ZERO_ROWS_PREFIX
from hvtrace.load import RankSource
from hvtrace.selection import StepRange
from hvtrace.units import format_bytes, printable

#: A step averages by hand when its allreduces after the backward that match the gradients'
#: sizes carry at least this share of the gradients' bytes.
MANUAL_COVER: Final = 0.5
#: A rank is named when at least this share of its steps with a backward average by hand.
MANUAL_STEPS: Final = 0.5
#: The manual-averaging finding is a warning when the communication after the backward is at
#: least this share of the median step (else an info note: it costs the job little).
MANUAL_WARN_SHARE: Final = 0.02
#: A tensor is "mostly zeros" when at least this share of its rows were zero (median over checks).
ZERO_ROWS_MOST: Final = 0.5
#: The sparse-gradient finding is a warning when the zeros' communication time is at least this
#: share of the median step (else an info note).
ZERO_ROWS_WARN_SHARE: Final = 0.01
#: Horovod's sparse path allgathers each rank's rows to every rank, about ``ranks x used``
#: times the dense bytes to each rank (``used``: the share of rows not zero; plus an index per
#: row, and a row looked up twice is sent twice), against ``2 (ranks - 1) / ranks`` for the ring
#: allreduce: it is advised when it stays below this share of the ring's.
SPARSE_PAYS: Final = 0.5

#: Allreduce families recorded outside the optimizer (``op`` of a collective's name).
_ALLREDUCE_OPS: Final = ("allreduce.", "grouped_allreduce.")

_MANUAL_SQL = f"""
WITH b AS (
    SELECT rank, step, max(end_ns) AS b1, sum(end_ns - start_ns) AS b_ns
    FROM ({{src}}) WHERE kind = 'backward' AND {{where}} GROUP BY rank, step
), c AS (
    SELECT rank, step, start_ns, end_ns, bytes, value FROM ({{src}})
    WHERE kind = 'collective' AND (flags & {FLAG_OWN}) = 0 AND {{where}} AND bytes > 0
      AND (starts_with(name::VARCHAR, '{_ALLREDUCE_OPS[0]}')
           OR starts_with(name::VARCHAR, '{_ALLREDUCE_OPS[1]}'))
      AND (list_contains($sizes, bytes) OR bytes = $total)
), per_step AS (
    SELECT b.rank, b.step, b.b_ns, count(c.start_ns) AS n,
           coalesce(sum(c.bytes), 0) AS bytes, min(c.start_ns) AS c0, max(c.end_ns) AS c1,
           sum(c.value) AS blocked, sum(c.end_ns - c.start_ns) AS flight,
           min(c.end_ns - c.start_ns) AS shortest
    FROM b LEFT JOIN c ON c.rank = b.rank AND c.step = b.step AND c.start_ns >= b.b1
    GROUP BY b.rank, b.step, b.b_ns
)
SELECT rank, count(*) AS steps, count(*) FILTER (WHERE bytes >= $cover) AS seen,
       min(step) FILTER (WHERE bytes >= $cover) AS first_step,
       median(b_ns) FILTER (WHERE bytes >= $cover) AS backward_ns,
       median(c1 - c0) FILTER (WHERE bytes >= $cover) AS comm_ns,
       median(blocked) FILTER (WHERE bytes >= $cover) AS blocked_ns,
       median(flight) FILTER (WHERE bytes >= $cover) AS flight_ns,
       median(shortest) FILTER (WHERE bytes >= $cover) AS shortest_ns,
       median(n) FILTER (WHERE bytes >= $cover) AS tensors,
       median(bytes) FILTER (WHERE bytes >= $cover) AS bytes
FROM per_step GROUP BY rank ORDER BY rank
"""


# -- manual gradient averaging ---------------------------------------------------------------------
def empty_manual() -> dict[str, Any]:
    """:func:`manual_check`'s result when nothing was looked at."""
    return {"checked": False, "ranks": []}


def param_sizes(headers: dict[int, dict[str, Any]]) -> list[int]:
    """The gradients' bytes in the optimizer's order, from the lowest rank's header that lists
    them (``optimizer.param_bytes``; empty for older files)."""
    for rank in sorted(headers):
        opt = (headers[rank] or {}).get("optimizer") or {}
        sizes = opt.get("param_bytes")
        if isinstance(sizes, list) and sizes and len(sizes) == opt.get("tensors", len(sizes)):
            return [int(x) for x in sizes]
    return []


def may_average_by_hand(outside: Any) -> bool:
    """Whether the run has allreduces outside the optimizer issued in a backward phase (what
    :func:`manual_check` looks at; without any, its scan is skipped)."""
    if outside is None or not len(outside):
        return False
    op = outside["op"].astype(str) + "."
    ph = outside["phase"].astype(str)
    return bool((op.str.startswith(_ALLREDUCE_OPS) & (ph == "backward")).any())


def manual_check(
    sources: Sequence[RankSource],
    headers: dict[int, dict[str, Any]],
    steps: StepRange | None = None,
    con: Any = None,
) -> dict[str, Any]:
    """Per rank, the steps whose gradients it allreduced itself after the backward (see the
    module doc), from one DuckDB query over the rank files.

    Returns a JSON-ready dict: ``checked`` (the parameters' sizes were known), ``param_tensors``
    and ``param_bytes`` (the gradients), ``distributed`` (the run had Horovod's optimizer too),
    ``per_rank`` (every rank with a backward: ``rank``, ``steps`` with a backward, ``seen``
    steps averaged by hand, ``first_step``, and over those steps the medians ``backward_ms``,
    ``comm_ms`` (first allreduce's start to the last one's end), ``blocked_ms`` (the training
    thread blocked in them), ``flight_ms`` (their spans' lengths summed: about ``comm_ms`` when
    they ran one at a time), ``shortest_ms`` (the shortest call), ``tensors``, ``bytes``;
    ``hidden_ms``: :func:`hidden_ms` of those medians; ``one_at_a_time``: blocking calls, one
    after the other; ``fused_ms``: for those, what sending them together would save, each call
    after the first paying the shortest call's time less, at most what is not hidden) and
    ``ranks`` (those named: seen in at least :data:`MANUAL_STEPS` of their steps). ``con``: a
    DuckDB connection used by this call alone (default: a new one); a damaged file gives
    ``error``.
    """
    from hvtrace.analysis.engine import on_own_engine, span_query

    sizes = param_sizes(headers)
    if not sizes or not sources:
        return empty_manual()
    if con is None:
        return on_own_engine(
            lambda c: manual_check(sources, headers, steps, c),
            lambda error: {**empty_manual(), "error": error},
        )
    total = int(sum(sizes))
    h0 = headers[min(headers)] if headers else {}
    with span_query(con, sources, steps) as (src, where, params):
        got = con.execute(
            _MANUAL_SQL.format(src=src, where=where),
            {**params, "sizes": sorted(set(sizes)), "total": total, "cover": MANUAL_COVER * total},
        ).fetchall()
    per_rank = []
    for rank, n, seen, first, b_ns, c_ns, blk_ns, flight_ns, short_ns, tensors, nbytes in got:
        per_rank.append(
            {
                "rank": int(rank),
                "steps": int(n),
                "seen": int(seen),
                "first_step": None if first is None else int(first),
                "backward_ms": _ms(b_ns),
                "comm_ms": _ms(c_ns),
                "blocked_ms": _ms(blk_ns),
                "flight_ms": _ms(flight_ns),
                "shortest_ms": _ms(short_ns),
                "tensors": None if tensors is None else float(tensors),
                "bytes": None if nbytes is None else float(nbytes),
            }
        )
        r = per_rank[-1]
        comm = r["comm_ms"] or 0.0
        r["hidden_ms"] = hidden_ms(r["backward_ms"] or 0.0, comm, sizes)
        # blocking calls: each span is the thread blocked, one after the other (their lengths
        # add up to the stretch); async ones overlap (enqueued together, waited for in turn)
        n_calls = round(r["tensors"] or 0)
        r["one_at_a_time"] = n_calls > 1 and (r["flight_ms"] or 0.0) <= 1.1 * comm
        fused = (n_calls - 1) * (r["shortest_ms"] or 0.0) if r["one_at_a_time"] else 0.0
        r["fused_ms"] = max(0.0, min(fused, comm - r["hidden_ms"]))
    named = [r for r in per_rank if r["steps"] and r["seen"] >= MANUAL_STEPS * r["steps"]]
    return {
        "checked": True,
        "param_tensors": len(sizes),
        "param_bytes": total,
        "distributed": bool(((h0 or {}).get("optimizer") or {}).get("distributed", True)),
        "per_rank": per_rank,
        "ranks": [r["rank"] for r in named],
    }


def _ms(ns: Any) -> float | None:
    return None if ns is None or ns != ns else float(ns) / 1e6


def hidden_ms(backward_ms: float, comm_ms: float, sizes: Sequence[int]) -> float:
    """How much of ``comm_ms`` of allreduces issued after a ``backward_ms`` backward a
    distributed optimizer would hide under it (the module doc's model; ``sizes``: the
    gradients' bytes in the optimizer's order, produced last first). In ``[0, min(B, C)]``."""
    b, c = float(backward_ms), float(comm_ms)
    if not (np.isfinite(b) and np.isfinite(c)) or b <= 0 or c <= 0:
        return 0.0
    f = np.asarray(list(sizes)[::-1], dtype=np.float64)
    if f.size == 0 or f.sum() <= 0:
        return 0.0
    f /= f.sum()
    ready = np.cumsum(f)  # F_k
    end = float(np.max(b * ready + c * (1.0 - (ready - f))))
    exposed = min(max(end - b, 0.0), c)
    return c - exposed


def manual_findings(a: Analysis) -> list[Finding]:
    """A ``manual_averaging`` finding when ranks allreduced their gradients themselves after the
    backward (:func:`manual_check` in ``a.gradients["manual"]``): the ranks, the first step, the
    communication and what a distributed optimizer would hide of it, what to do."""
    m = (getattr(a, "gradients", None) or {}).get("manual") or {}
    ranks = list(m.get("ranks") or [])
    if not ranks:
        return []
    by_rank = {int(r["rank"]): r for r in m.get("per_rank") or []}
    named = [by_rank[r] for r in ranks if r in by_rank]
    keys = ("backward_ms", "comm_ms", "blocked_ms", "shortest_ms", "hidden_ms", "fused_ms")
    med = {
        k: float(np.median([float(r.get(k) or 0.0) for r in named]))
        for k in (*keys, "tensors", "bytes")
    }
    first = min(int(r["first_step"]) for r in named)
    seen = [int(r["seen"]) for r in named]
    total = [int(r["steps"]) for r in named]
    s = a.analyzed
    step_ms = float(s["step_ns"].median()) / 1e6 if len(s) else float("nan")
    share = med["comm_ms"] / step_ms if step_ms > 0 else float("nan")
    tensors = round(med["tensors"])
    one_by_one = sum(bool(r.get("one_at_a_time")) for r in named) * 2 > len(named)
    who = f"rank{'s' if len(ranks) > 1 else ''} {rank_words(ranks)}"
    what = (
        f"{tensors} allreduce{'s' if tensors != 1 else ''} of {format_bytes(med['bytes'])} a "
        f"step whose sizes match the model's {m.get('param_tensors')} gradients "
        f"({format_bytes(float(m.get('param_bytes') or 0))})"
    )
    when = (
        f"from step {first}, in every step with a backward"
        if seen == total
        else f"from step {first}, in {min(seen)} to {max(seen)} of each rank's "
        f"{min(total)} to {max(total)} steps with a backward"
        if len(named) > 1
        else f"from step {first}, in {seen[0]} of its {total[0]} steps with a backward"
    )
    comm = (
        f"they take a median {med['comm_ms']:.1f} ms a step after a {med['backward_ms']:.1f} "
        f"ms backward, all of it exposed"
        + (f" ({share:.0%} of the {step_ms:.1f} ms step)" if np.isfinite(share) else "")
    )
    if one_by_one:
        comm += (
            f", in {tensors} calls made one at a time (each blocks), each with its own "
            f"negotiation (the shortest took a median {med['shortest_ms']:.1f} ms)"
        )
    if m.get("distributed"):
        lost = med["comm_ms"]
        msg = (
            f"gradients averaged twice: {who} allreduce their gradients themselves after the "
            f"backward ({what}, {when}) although the distributed optimizer allreduces them too; "
            f"{comm}. All of it is waste: remove the manual allreduces and let the "
            "DistributedOptimizer average the gradients"
        )
    else:
        lost = min(med["hidden_ms"] + (med["fused_ms"] if one_by_one else 0.0), med["comm_ms"])
        saved = lost / step_ms if step_ms > 0 else float("nan")
        fused = (
            f"; and it sends them together (fused), where these calls pay a negotiation each: "
            f"at least about {med['fused_ms']:.1f} ms less ({tensors - 1} calls fewer, each "
            "the shortest call's time)"
            if one_by_one
            else ""
        )
        msg = (
            f"manual gradient averaging: {who} allreduce their gradients themselves after the "
            f"backward ({what}, {when}) and step a plain optimizer; {comm}. A distributed "
            f"optimizer would save {'at least ' if one_by_one else ''}about {lost:.1f} ms of "
            f"the {med['comm_ms']:.1f} ms"
            + (f" ({saved:.0%} of the step)" if np.isfinite(saved) else "")
            + f": it starts each gradient's allreduce as soon as the backward produces it, "
            f"which would hide about {med['hidden_ms']:.1f} ms under the backward (gradients "
            f"produced at an even rate per byte, last layer first){fused}. Use "
            "hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters()) "
            "(or hvtrace.DistributedOptimizer) instead of averaging by hand: it overlaps the "
            "allreduces with the backward and fuses them"
        )
    sev = "warning" if np.isfinite(share) and share >= MANUAL_WARN_SHARE else "info"
    data = {
        "ranks": ranks,
        "step": first,
        "steps_seen": {str(r["rank"]): int(r["seen"]) for r in named},
        "steps": {str(r["rank"]): int(r["steps"]) for r in named},
        "tensors": tensors,
        "bytes": med["bytes"],
        "backward_ms": med["backward_ms"],
        "comm_ms": med["comm_ms"],
        "blocked_ms": med["blocked_ms"],
        "hidden_ms": med["hidden_ms"],
        "fused_ms": med["fused_ms"] if one_by_one else 0.0,
        "shortest_ms": med["shortest_ms"],
        "one_at_a_time": one_by_one,
        "averaged_twice": bool(m.get("distributed")),
        "lost_ms_per_step": lost,
    }
    return [Finding("manual_averaging", sev, msg, lost, "ms", data)]


def manual_sources(a: Analysis) -> set[str]:
    """Names (``op|phase|tensor``) of the collectives outside the optimizer that the
    manual-averaging finding prices (allreduces of a gradient's size in the backward phase), so
    that no other finding prices them again; empty without that finding."""
    m = (getattr(a, "gradients", None) or {}).get("manual") or {}
    t = a.outside
    if not m.get("ranks") or t is None or not len(t):
        return set()
    sizes = set(int(x) for x in (a.optimizer or {}).get("param_bytes") or [])
    total = sum((a.optimizer or {}).get("param_bytes") or [])
    out = set()
    for r in t.to_dict("records"):
        op = str(r["op"]) + "."
        if op.startswith(_ALLREDUCE_OPS) and str(r["phase"]) == "backward":
            b = int(r["bytes"]) if r["bytes"] == r["bytes"] else -1
            if b in sizes or b == total:
                out.add(f"{r['op']}|{r['phase']}|{r['name']}")
    return out


# -- sparse gradients sent dense -------------------------------------------------------------------
def zero_rows_summary(rows: Sequence[tuple[int, int, str, float, int]]) -> list[dict[str, Any]]:
    """Per tensor, its zero-row checks (``rows``: ``(rank, step, name, value, bytes)`` of the
    ``hvtrace.zero_rows|HOW|NAME`` scalars): ``name``, ``how`` (:data:`ZERO_ROWS_HOW`),
    ``bytes`` (the dense tensor), ``share`` (median share of zero rows over every rank's
    checks), ``min_share``, ``checks`` (steps checked), ``steps`` (those steps), ``ranks``,
    ``first_step`` (the first check where the share was at least :data:`ZERO_ROWS_MOST`, None
    if never). Sorted by zero bytes, most first."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for rank, step, name, value, nbytes in rows:
        rest = str(name)[len(ZERO_ROWS_PREFIX) :]
        how, _, tensor = rest.partition("|")
        if how not in ZERO_ROWS_HOW or not tensor or value is None or value != value:
            continue
        e = by.setdefault((how, tensor), {"vals": [], "steps": set(), "ranks": set(), "bytes": 0})
        e["vals"].append((int(step), float(value)))
        e["steps"].add(int(step))
        e["ranks"].add(int(rank))
        e["bytes"] = max(int(e["bytes"]), int(nbytes or 0))
    out = []
    for (how, tensor), e in by.items():
        vals = [v for _, v in e["vals"]]
        most = sorted(s for s, v in e["vals"] if v >= ZERO_ROWS_MOST)
        out.append(
            {
                "name": tensor,
                "how": how,
                "bytes": int(e["bytes"]),
                "share": float(np.median(vals)),
                "min_share": float(min(vals)),
                "checks": len(e["steps"]),
                "steps": sorted(e["steps"]),
                "ranks": sorted(e["ranks"]),
                "first_step": most[0] if most else None,
            }
        )
    return sorted(out, key=lambda t: -t["bytes"] * t["share"])


def sparse_findings(a: Analysis) -> list[Finding]:
    """A ``sparse_as_dense`` finding per embedding gradient allreduced dense while most of its
    rows were zero (:func:`zero_rows_summary` in ``a.gradients["zero_rows"]``): the bytes that
    carried zeros, their share of the step's communication time, what to do in Horovod 0.28."""
    tensors = (getattr(a, "gradients", None) or {}).get("zero_rows") or []
    if not tensors:
        return []
    s = a.analyzed
    step_ms = float(s["step_ns"].median()) / 1e6 if len(s) else float("nan")
    sent = _bytes_per_step(a)
    comm_ms = float(s["comm_ns"].median() if len(s) else np.nan) / 1e6
    plain = not bool((a.optimizer or {}).get("distributed", True))
    outside_bytes = (
        {int(b) for b in a.outside["bytes"] if b == b}
        if a.outside is not None and len(a.outside)
        else set()
    )
    size = max(int(a.size or 0), len(a.ranks), 1)
    out = []
    for t in tensors:
        if t["share"] < ZERO_ROWS_MOST:
            continue
        if plain and t["bytes"] not in outside_bytes:
            continue  # a plain optimizer's gradient that no allreduce of its size carried
        zero_bytes = t["share"] * t["bytes"]
        zero_ms = zero_bytes / sent * comm_ms if sent > 0 and np.isfinite(comm_ms) else float("nan")
        zero_share = zero_ms / step_ms if step_ms > 0 and np.isfinite(zero_ms) else float("nan")
        used = 1.0 - t["share"]
        name = printable(t["name"])
        steps = t["steps"]
        listed = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
        where = (
            f"at {t['checks']} check{'s' if t['checks'] != 1 else ''} "
            f"(step{'s' if len(steps) != 1 else ''} {listed}) on "
            f"rank{'s' if len(t['ranks']) > 1 else ''} {rank_words(t['ranks'])}"
        )
        if t["how"] == "dense":
            what = f"{name} (an embedding's dense gradient, {format_bytes(t['bytes'])})"
            sent_how = "is allreduced dense every step"
        else:
            what = f"{name} (a sparse embedding gradient, {format_bytes(t['bytes'])} dense)"
            sent_how = (
                "is allreduced dense every step because the DistributedOptimizer has "
                "sparse_as_dense=True"
            )
        cost = (
            f"at least {format_bytes(zero_bytes)} of the {format_bytes(sent)} each rank sends a "
            f"step carried zeros"
            + (
                f", about {zero_ms:.1f} ms of the step's {comm_ms:.1f} ms of allreduce time by "
                f"their share of the bytes ({zero_share:.0%} of the {step_ms:.1f} ms step; less "
                "where the allreduces' time is mostly latency, as on one host)"
                if np.isfinite(zero_ms)
                else ""
            )
        )
        ratio = size * used
        advice = _sparse_advice(t["how"], size, used, ratio, plain)
        msg = (
            f"sparse gradient sent dense: {what} {sent_how}, but a median {t['share']:.0%} of "
            f"its rows were zero in the averaged gradient {where}: {cost}. {advice}"
        )
        sev = (
            "warning" if np.isfinite(zero_share) and zero_share >= ZERO_ROWS_WARN_SHARE else "info"
        )
        data = {
            "name": t["name"],
            "how": t["how"],
            "bytes": t["bytes"],
            "zero_share": t["share"],
            "zero_bytes_per_step": zero_bytes,
            "bytes_per_step": sent,
            "zero_ms": None if not np.isfinite(zero_ms) else zero_ms,
            "comm_ms": None if not np.isfinite(comm_ms) else comm_ms,
            "ranks": t["ranks"],
            "step": t["first_step"] if t["first_step"] is not None else steps[0],
            "steps": steps,
            "sparse_bytes_ratio": ratio,
            "lost_ms_per_step": None if not np.isfinite(zero_ms) else zero_ms,
        }
        out.append(Finding("sparse_as_dense", sev, msg, zero_bytes, "bytes per step", data))
    return out


def _bytes_per_step(a: Analysis) -> float:
    """The median bytes a rank sends in a step's allreduces (the optimizer's and its own)."""
    s = a.analyzed
    if not len(s):
        return 0.0
    total = s["allreduce_bytes"].astype("float64")
    if "collective_bytes" in s.columns:
        total = total + s["collective_bytes"].astype("float64")
    return float(total.median())


def _sparse_advice(how: str, size: int, used: float, ratio: float, plain: bool) -> str:
    """What avoids sending the zeros, true for Horovod 0.28's torch optimizer: a sparse gradient
    with ``sparse_as_dense=False`` is sent by ``sparse_allreduce_async``, an allgather of each
    rank's rows (indices and values) to every rank."""
    sparse = (
        "Horovod 0.28 then allgathers only the rows each rank used (their indices and values) "
        "instead of allreducing the whole table; the optimizer must accept sparse gradients for "
        "it (torch.optim.SGD, SparseAdam, Adagrad; not Adam or AdamW: give the embedding "
        "SparseAdam)"
    )
    if how == "dense":
        fix = (
            "Make the embedding sparse, nn.Embedding(..., sparse=True), and keep the "
            "DistributedOptimizer's default sparse_as_dense=False: " + sparse
        )
    else:
        fix = "Leave out sparse_as_dense=True: " + sparse
    if plain:
        fix += "; and average with hvd.DistributedOptimizer (see the manual-averaging finding)"
    ring = 2.0 * (size - 1) / size if size > 1 else 1.0
    pays = (
        f"with {size} rank{'s' if size != 1 else ''} and about {used:.0%} of the rows used, the "
        f"allgather would bring each rank about {ratio:.2g} times the dense bytes (plus an index "
        f"per row), against {ring:.2g} for the ring allreduce"
    )
    if ratio <= SPARSE_PAYS * ring:
        return (
            f"{fix} ({pays}; two allgathers, indices and values, replace one allreduce: on a "
            "fast network with a small table the time saved can be small, so time both)"
        )
    return (
        f"Horovod's sparse path does not pay here: {pays}; fewer bytes needs another design "
        "(a smaller table, hashing the ids into fewer rows, or the table sharded across ranks)"
    )


__all__ = [
    "empty_manual",
    "hidden_ms",
    "manual_check",
    "manual_findings",
    "manual_sources",
    "may_average_by_hand",
    "param_sizes",
    "sparse_findings",
    "zero_rows_summary",
]
