"""What the training framework counted and decided, beside hvtrace's steps (PyTorch Lightning).

hvtrace's steps are the optimizer's updates. Lightning has its own step counter (the Trainer's
``global_step``), and its callbacks take decisions that Lightning combines across ranks.
:mod:`hvtrace.lightning` records both as a few scalar rows (their format:
:data:`hvtrace.format.schema.LIGHTNING_ROWS`); this module reads them (:func:`scan`, one query
over the rank files, or :func:`scan_frame`) and says:

- **Lightning's step at an hvtrace step** (:func:`lightning_step`), shown beside hvtrace's where
  they differ (the lockstep breaks: :func:`annotate_lockstep`);
- **accumulation that does not accumulate** (:func:`accumulation`): the optimizer was built to
  accumulate over N backward passes (``backward_passes_per_step``; Lightning's
  ``accumulate_grad_batches``), but its steps hold fewer: it updated (and allreduced every
  gradient) after each micro-batch. This part needs no Lightning rows (plain Horovod too);
- **what the callbacks did** (:func:`decisions`, :func:`best_checkpoints`): a decision of
  ``EarlyStopping`` or ``ModelCheckpoint`` that some ranks' own monitored values decided against
  the others' (the ranks' own decisions differed, so the combined one rested on some of them), and
  ranks whose monitored ``ModelCheckpoint`` ended with different best checkpoints.

:func:`findings` turns them into the ``accumulation``, ``callback_decision`` and
``best_checkpoint`` findings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import pandas as pd

from hvtrace.analysis.model import Analysis, Finding
from hvtrace.format.schema import (
    BEST_CKPT_PREFIX,
    DECIDED_ON_PREFIX,
    DECISION_PREFIX,
    LIGHTNING_ROWS,
    LIGHTNING_STEP,
)
from hvtrace.load import RankSource
from hvtrace.selection import StepRange
from hvtrace.units import printable

_COLUMNS: Final = ["rank", "step", "name", "value", "bytes", "start_ns"]
_ROWS_SQL = (
    "SELECT rank, step, name::VARCHAR AS name, value, bytes, start_ns FROM ({src}) "
    f"WHERE kind = 'scalar' AND starts_with(name, '{LIGHTNING_ROWS}') "
    f"AND (name = '{LIGHTNING_STEP}' OR {{where}}) "
    "ORDER BY rank, start_ns"
)


def empty() -> dict[str, Any]:
    """The result of :func:`scan` for a run without Lightning's rows."""
    return {"rows": pd.DataFrame(columns=_COLUMNS)}


def scan(
    sources: Sequence[RankSource], steps: StepRange | None = None, con: Any = None
) -> dict[str, Any]:
    """Read Lightning's rows of ``sources`` (``rows``: a frame of ``rank, step, name, value,
    bytes, start_ns``, few rows) and summarize them: ``global_steps`` (per rank, its
    ``[step, global_step]`` records), ``decisions`` (:func:`decisions`), ``best_checkpoints``
    (:func:`best_checkpoints`). A damaged file leaves it empty, with ``error``."""
    from hvtrace.analysis.engine import on_own_engine, span_query

    if con is None:
        return on_own_engine(
            lambda c: scan(sources, steps, c), lambda error: {**empty(), "error": error}
        )
    if not sources:
        return empty()
    with span_query(con, sources, steps) as (src, where, params):
        rows = con.execute(_ROWS_SQL.format(src=src, where=where), params).df()
    return summarize(rows)


def scan_frame(spans: pd.DataFrame | None, steps: StepRange | None = None) -> dict[str, Any]:
    """:func:`scan` of a span frame (``rank, step, kind, name, value`` and optionally
    ``bytes``, ``start_ns``)."""
    if spans is None or len(spans) == 0 or "value" not in spans.columns:
        return empty()
    names = spans["name"].astype(str)
    keep = (spans["kind"].astype(str) == "scalar") & names.str.startswith(LIGHTNING_ROWS)
    if steps is not None:  # Lightning's step records: all of them (few), to count from
        keep &= steps.mask(spans["step"]) | (names == LIGHTNING_STEP)
    d = spans.loc[keep].copy()
    d["name"] = names[keep]
    for c in ("bytes", "start_ns"):
        if c not in d.columns:
            d[c] = 0
    return summarize(d.sort_values(["rank", "start_ns"])[_COLUMNS])


def summarize(rows: pd.DataFrame) -> dict[str, Any]:
    """The summary of :func:`scan` from Lightning's rows."""
    rows = rows.reset_index(drop=True)
    out: dict[str, Any] = {"rows": rows}
    if rows.empty:
        return out
    gs = rows[rows["name"] == LIGHTNING_STEP]
    out["global_steps"] = {
        str(int(r)): [[int(s), int(v)] for s, v in zip(g["step"], g["value"], strict=True)]
        for r, g in gs.groupby("rank")
    }
    out["decisions"] = decisions(rows)
    out["best_checkpoints"] = best_checkpoints(rows)
    return out


# -- Lightning's step ------------------------------------------------------------------------------
def lightning_step(state: dict[str, Any] | None, step: int, rank: int | None = None) -> int | None:
    """Lightning's ``global_step`` at hvtrace step ``step`` on ``rank`` (default: the lowest rank
    with records), from :func:`scan`'s ``global_steps``; None without records at or before it."""
    recs = (state or {}).get("global_steps") or {}
    if not recs:
        return None
    key = str(rank) if rank is not None and str(rank) in recs else min(recs, key=int)
    best = None
    for s, g in recs[key]:
        if s > step:
            break
        best = (s, g)
    return None if best is None else best[1] + step - best[0]


def annotate_lockstep(breaks: list[dict[str, Any]], state: dict[str, Any] | None) -> None:
    """Add ``lightning_steps`` to each lockstep break (in place): hvtrace step -> Lightning's
    ``global_step`` for each step the break names (on the first rank it names, the others' last
    step on the first of the others), where they differ."""
    for b in breaks:
        rank = (b.get("ranks") or [None])[0]
        other = (b.get("others") or [None])[0]
        named = [(b.get("step"), rank), (b.get("others_last_step"), other)]
        named += [(s, rank) for s in b.get("skipped_steps") or []]
        m = {}
        for s, r in named:
            if s is None:
                continue
            g = lightning_step(state, int(s), r)
            if g is not None and g != int(s):
                m[str(int(s))] = g
        if m:
            b["lightning_steps"] = m


def step_words(step: int, b: dict[str, Any] | None) -> str:
    """``"step 12"``, with Lightning's step where a break (or finding data) has it:
    ``"step 12 (Lightning global_step 6)"``."""
    g = ((b or {}).get("lightning_steps") or {}).get(str(int(step)))
    return f"step {step}" if g is None else f"step {step} (Lightning global_step {g})"


# -- accumulation ----------------------------------------------------------------------------------
def accumulation(a: Analysis) -> dict[str, Any] | None:
    """Accumulation that does not accumulate: the optimizer's ``backward_passes_per_step`` N > 1
    but its steps (updates) held fewer backward passes (the median over the analyzed steps of
    every rank): JSON-ready figures, or None (also where the steps' backward passes are not
    recorded: a run without ``model=``)."""
    n = (a.optimizer or {}).get("backward_passes_per_step")
    try:
        n = int(n)
    except (TypeError, ValueError):
        return None
    st = a.steps
    if n < 2 or st is None or st.empty or "n_backward" not in st.columns:
        return None
    done = st[st["step_ns"].notna()] if "step_ns" in st.columns else st
    if done.empty or not (done["n_backward"].fillna(0) > 0).any():
        return None
    per = float(done["n_backward"].fillna(0).median())
    if per < 1 or per >= n:
        return None
    r0 = done[done["rank"] == done["rank"].min()]
    updates = len(r0)
    out: dict[str, Any] = {
        "backward_passes_per_step": n,
        "backward_per_update": per,
        "updates": updates,
        "allreduces": int(r0["n_allreduce"].fillna(0).sum()) if "n_allreduce" in r0 else None,
        "first_step": int(r0["step"].min()),
        "last_step": int(r0["step"].max()),
    }
    trainer = getattr(a, "trainer", None) or {}
    g0 = lightning_step(trainer, out["first_step"])
    g1 = lightning_step(trainer, out["last_step"])
    if g0 is not None and g1 is not None:
        out["lightning_steps"] = g1 - g0 + 1
    a_steps = a.analyzed
    if len(a_steps) and {"wait_ns", "update_ns"} <= set(a_steps.columns):
        ms = float((a_steps["wait_ns"].fillna(0) + a_steps["update_ns"].fillna(0)).median()) / 1e6
        # of every N updates (each with its wait for the allreduces), N-1 are extra
        out["lost_ms_per_step"] = ms * (1 - per / n) if math.isfinite(ms) else None
    return out


def _accumulation_finding(d: dict[str, Any], lightning: str | None) -> Finding:
    n, per = d["backward_passes_per_step"], d["backward_per_update"]
    each = "after each one" if per == 1 else f"after every {per:g}"
    ups = f"{d['updates']} updates"
    if d.get("allreduces") is not None:
        ups += f" and {d['allreduces']} gradient allreduces"
    if lightning is not None:
        version = f"pytorch-lightning {printable(lightning[:40])}" if lightning else "Lightning"
        asked = f"accumulate_grad_batches={n} (Horovod's backward_passes_per_step={n})"
        if d.get("lightning_steps") is not None:
            ups += f" for {d['lightning_steps']} Lightning global steps"
        why = (
            f'under strategy="horovod" this is what {version} does: its HorovodStrategy '
            "handles accumulation itself (handles_gradient_accumulation), so Lightning calls "
            "optimizer.step() on every micro-batch, and its post_backward calls synchronize() "
            "after every backward, which allreduces every gradient whatever "
            "backward_passes_per_step says (and Lightning zeroes the gradients only before the "
            "first micro-batch of each group, so the later updates apply gradients summed since)"
        )
        fix = (
            'use accumulate_grad_batches=1 with strategy="horovod" (a larger batch_size per '
            "rank, or more ranks, for the same global batch); to accumulate, train with plain "
            f"Horovod: hvd.DistributedOptimizer(optimizer, backward_passes_per_step={n}) and "
            f"optimizer.step() (then zero_grad()) once every {n} backward passes"
        )
    else:
        asked = f"backward_passes_per_step={n}"
        why = (
            "optimizer.step() was called after every backward pass, and Horovod's step() "
            "synchronizes: it allreduces every gradient not yet reduced, so each early step "
            "costs a full allreduce and an update"
        )
        fix = f"call optimizer.step() (then zero_grad()) once every {n} backward passes"
    msg = (
        f"gradient accumulation does not accumulate: {asked} asks for one optimizer update "
        f"per {n} micro-batches, but the optimizer updated {each} ({ups}, steps "
        f"{d['first_step']}..{d['last_step']}): {n / per:g} times the allreduces and updates of "
        f"accumulating, and each update on a smaller batch than configured; {why}. Fix: {fix}"
    )
    return Finding("accumulation", "warning", msg, float(n / per), "x", dict(d))


# -- what the callbacks did ------------------------------------------------------------------------
def _split(name: str, prefix: str) -> tuple[str, str]:
    """``CALLBACK|MONITOR`` of a decision row's name."""
    cb, _, monitor = name[len(prefix) :].partition("|")
    return cb, monitor


def decisions(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Each callback decision whose ranks decided differently on their own (so that the combined
    decision rested on some of them), the first of each callback and monitor: ``callback``,
    ``monitor``, ``step`` (the hvtrace step just finished), ``global_step``, ``decision``
    (combined: True = stop / save), ``ranks`` (those whose own decision it was), ``others``,
    ``values`` (rank -> the monitored value its callback read), ``count`` (such decisions in
    the run), ``decisions`` (all the callback's decisions)."""
    names = rows["name"].astype(str)
    dec = rows[names.str.startswith(DECISION_PREFIX)].copy()
    if dec.empty:
        return []
    on = rows[names.str.startswith(DECIDED_ON_PREFIX)].copy()
    for d, prefix in ((dec, DECISION_PREFIX), (on, DECIDED_ON_PREFIX)):
        d["key"] = d["name"].astype(str).str.slice(len(prefix))
        d["occ"] = d.groupby(["rank", "key"]).cumcount()
    vals = {
        (int(r), k, int(o)): v
        for r, k, o, v in zip(on["rank"], on["key"], on["occ"], on["value"], strict=True)
    }
    out = []
    for key, g in dec.groupby("key", sort=True):
        found, total, count = None, 0, 0
        for occ, h in g.groupby("occ", sort=True):
            total += 1
            codes = {int(r): int(v) for r, v in zip(h["rank"], h["value"], strict=True)}
            own = {r: c & 1 for r, c in codes.items()}
            if len(own) < 2 or len(set(own.values())) < 2:
                continue
            count += 1
            if found is not None:
                continue
            combined = bool(max(c >> 1 for c in codes.values()))
            ranks = sorted(r for r, o in own.items() if bool(o) == combined)
            cb, monitor = _split(DECISION_PREFIX + str(key), DECISION_PREFIX)
            found = {
                "callback": cb,
                "monitor": monitor,
                "step": int(h["step"].min()),
                "global_step": int(h["bytes"].max()),
                "decision": combined,
                "ranks": ranks,
                "others": sorted(r for r in own if r not in ranks),
                "values": {str(r): _num(vals.get((r, str(key), int(occ)))) for r in sorted(own)},
            }
        if found is not None:
            found["count"], found["decisions"] = count, total
            out.append(found)
    return sorted(out, key=lambda d: d["step"])


def best_checkpoints(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """Per monitored ModelCheckpoint whose ranks ended with different best checkpoints:
    ``monitor``, ``files`` (rank -> file name of its last best), ``scores`` (rank -> its
    ``best_model_score``), ``step`` (the first hvtrace step after which the ranks' best differed),
    ``global_step``."""
    names = rows["name"].astype(str)
    best = rows[names.str.startswith(BEST_CKPT_PREFIX)].copy()
    if best.empty:
        return []
    rest = best["name"].astype(str).str.slice(len(BEST_CKPT_PREFIX)).str.partition("|")
    best["monitor"], best["file"] = rest[0], rest[2]
    out = []
    for monitor, g in best.groupby("monitor", sort=True):
        if g["rank"].nunique() < 2:
            continue
        last = g.groupby("rank").tail(1).set_index("rank")
        if last["file"].nunique() < 2:
            continue
        first = None  # the first step after which the ranks' latest best differ
        now: dict[int, str] = {}
        for _, r in g.sort_values(["step", "start_ns"]).iterrows():
            now[int(r["rank"])] = str(r["file"])
            if first is None and len(now) == len(last) and len(set(now.values())) > 1:
                first = (int(r["step"]), int(r["bytes"]))
        out.append(
            {
                "monitor": str(monitor),
                "files": {str(int(r)): str(f) for r, f in last["file"].items()},
                "scores": {str(int(r)): _num(v) for r, v in last["value"].items()},
                "step": first[0] if first else int(g["step"].max()),
                "global_step": first[1] if first else int(g["bytes"].max()),
            }
        )
    return out


def _num(v: Any) -> float | None:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _fmt(v: Any) -> str:
    return "n/a" if v is None else f"{float(v):.6g}"


def _ranks(rs: Sequence[Any]) -> str:
    rs = [str(r) for r in rs]
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(rs)


def _when(d: dict[str, Any]) -> str:
    g = d.get("global_step")
    return f"after step {d['step']}" + (f" (Lightning global_step {g})" if g is not None else "")


def _decision_finding(d: dict[str, Any], averaging: str) -> Finding:
    mon, cb = printable(d["monitor"]), printable(d["callback"])
    vals = d.get("values") or {}
    who, others = d["ranks"], d["others"]

    def seen(rs: list[int]) -> str:
        return ", ".join(f"rank {r}: {_fmt(vals.get(str(r)))}" for r in rs)

    early = d["callback"] == "EarlyStopping" or (d["decision"] and "Stop" in d["callback"])
    if early:
        what = (
            f"{cb} stopped the job {_when(d)} on {_ranks(who)}'s own {mon} alone ({seen(who)}), "
            f"while {_ranks(others)}'s own {cb} would have gone on ({seen(others)}): Lightning "
            f"stops every rank when any rank's {cb} says stop"
        )
    elif d["decision"]:
        what = (
            f"{cb} saved a checkpoint {_when(d)} on {_ranks(who)}'s own {mon} ({seen(who)}), "
            f"against {_ranks(others)}'s ({seen(others)})"
        )
    else:
        what = (
            f"{cb} did not save a checkpoint {_when(d)} because of {_ranks(who)}'s own {mon} "
            f"({seen(who)}: not among its best), while {_ranks(others)}'s would have been "
            f"({seen(others)}): Lightning saves a monitored checkpoint only when every rank's "
            "own value says so"
        )
    more = d.get("count", 1) - 1
    tail = f" ({more} more such decision(s) in the run)" if more > 0 else ""
    msg = (
        f"a callback decided on one rank's view: {what}{tail}. {mon} differs across ranks (each "
        f"rank's own, not averaged), so each rank's {cb} judged its own value; {averaging}"
    )
    return Finding("callback_decision", "warning", msg, float(d["step"]), "step", dict(d))


def _best_finding(d: dict[str, Any], averaging: str) -> Finding:
    mon = printable(d["monitor"])
    scores = d.get("scores") or {}
    listed = ", ".join(
        f"rank {r} {printable(f)} ({mon} {_fmt(scores.get(r))})" for r, f in d["files"].items()
    )
    msg = (
        f"ranks ended with different best checkpoints for ModelCheckpoint(monitor={mon!r}): "
        f"{listed}, differing from the save {_when(d)} on: each rank ranks the checkpoints by its "
        f"own {mon}, so best_model_path (trainer.test(ckpt_path='best'), reloading the best "
        "model) names a different file on each rank, one that rank 0, which writes and deletes "
        f"the files, may not have kept; {averaging}"
    )
    return Finding("best_checkpoint", "warning", msg, float(d["step"]), "step", dict(d))


def findings(a: Analysis) -> list[Finding]:
    """The ``accumulation``, ``callback_decision`` and ``best_checkpoint`` findings."""
    from hvtrace.analysis.consistency import sync_dist_words

    out = []
    acc = getattr(a, "accumulation", None)
    if acc:
        out.append(_accumulation_finding(acc, a.lightning))
    trainer = getattr(a, "trainer", None) or {}
    if trainer.get("decisions") or trainer.get("best_checkpoints"):
        averaging = sync_dist_words(a.lightning or "")
        out += [_decision_finding(d, averaging) for d in trainer.get("decisions") or []]
        out += [_best_finding(d, averaging) for d in trainer.get("best_checkpoints") or []]
    return out


def json_section(state: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`scan`'s summary without its rows (the JSON's ``trainer``)."""
    return {k: v for k, v in (state or {}).items() if k != "rows"}


__all__ = [
    "accumulation",
    "annotate_lockstep",
    "best_checkpoints",
    "decisions",
    "empty",
    "findings",
    "json_section",
    "lightning_step",
    "scan",
    "scan_frame",
    "step_words",
    "summarize",
]
