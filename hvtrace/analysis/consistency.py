"""Consistency across ranks: the first step at which ranks stopped training the same model.

Each rank records values that must be equal on every rank (:mod:`hvtrace.record.consistency`):
parameter fingerprints every N steps (``hvtrace.param|TENSOR``), the learning rate of each param
group every step (``hvtrace.lr|GROUP``), and values marked as ones that must agree
(``hvtrace.scalar(..., agree=True)``: flag bit 3; Lightning's logged metrics; the metric a
plateau scheduler is stepped with, ``hvtrace.monitor|NAME``). :func:`check` compares them across
ranks with DuckDB over the rank files (one aggregate query: per (step, name, occurrence) the
minimum and maximum over ranks, compared exactly), then reads the rows of the first differing step
of each kind (a Parquet file's row groups of other steps are skipped). Nothing is loaded into
pandas but those few rows.

:func:`divergence_findings` turns the result into ``divergence`` findings, first differing step
first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

from hvtrace.analysis.model import Analysis, Finding
from hvtrace.format.schema import FLAG_AGREE, LR_PREFIX, METRIC_PREFIX, MONITOR_PREFIX, PARAM_PREFIX
from hvtrace.load import RankSource
from hvtrace.selection import StepRange
from hvtrace.units import printable

#: At most this many names (and ranks per name) are kept with a divergence's values.
MAX_NAMES: Final = 8
MAX_RANKS: Final = 16
#: Parameter check steps listed in the summary, at most.
MAX_STEPS_LISTED: Final = 200

#: What a divergence is about: parameter fingerprints, learning rates, values that must agree
#: (``agree=True`` scalars, the metric a plateau scheduler is stepped with), Lightning's logged
#: metrics (info only: a per-rank metric is harmless until something acts on it).
_KINDS: Final = ("parameters", "lr", "values", "metrics")

_WHAT_SQL = (
    f"CASE WHEN starts_with(name, '{PARAM_PREFIX}') THEN 'parameters' "
    f"WHEN starts_with(name, '{LR_PREFIX}') THEN 'lr' "
    f"WHEN starts_with(name, '{METRIC_PREFIX}') THEN 'metrics' ELSE 'values' END"
)
_ROWS_SQL = (
    "SELECT rank, step, name::VARCHAR AS name, coalesce(value, 'NaN'::DOUBLE) AS value, start_ns, "
    "row_number() OVER (PARTITION BY rank, step, name ORDER BY start_ns) AS occ, "
    f"{_WHAT_SQL} AS what FROM ({{src}}) WHERE kind = 'scalar' AND "
    f"(starts_with(name, '{PARAM_PREFIX}') OR starts_with(name, '{LR_PREFIX}') OR "
    f"starts_with(name, '{MONITOR_PREFIX}') OR starts_with(name, '{METRIC_PREFIX}') OR "
    f"(coalesce(flags, 0) & {FLAG_AGREE}) <> 0) "
    "AND {where}"
)
#: Per (what, step, name, occurrence): how many ranks, and whether their values differ.
_GROUPS_SQL = (
    "SELECT what, step, name, occ, count(*) AS n, "
    "(min(value) IS DISTINCT FROM max(value)) AS differs FROM ({rows}) GROUP BY ALL"
)
_SUMMARY_SQL = """SELECT what, count(DISTINCT step) AS steps, count(DISTINCT name) AS names,
    min(step) AS first_step, max(step) AS last_step,
    count(DISTINCT CASE WHEN differs AND n > 1 THEN step END) AS steps_differing,
    min(CASE WHEN differs AND n > 1 THEN step END) AS first_diff,
    max(CASE WHEN differs AND n > 1 THEN step END) AS last_diff
FROM ({groups}) GROUP BY what"""


def empty() -> dict[str, Any]:
    """The result of :func:`check` for a run without consistency rows."""
    return {"checked": False, "divergences": []}


def check(
    sources: Sequence[RankSource], steps: StepRange | None = None, con: Any = None
) -> dict[str, Any]:
    """Compare the consistency rows of ``sources`` across ranks (see the module doc).

    Returns a JSON-ready dict: ``checked`` (any rows), ``parameters`` (``checks``: the steps
    fingerprinted, ``steps`` (up to :data:`MAX_STEPS_LISTED`), ``tensors``, ``first_step``,
    ``last_step``), ``lr`` (``steps``, ``groups``), ``values`` (``steps``, ``names``), and
    ``divergences``: per kind that differs (``what``: ``parameters``, ``lr`` or ``values``),
    ``step`` (the first step at which the ranks differ), ``names`` (tensor names; ``lr``; metric
    names), ``groups`` (for ``lr``: the param groups), ``ranks`` (those whose value differs from
    the reference rank's), ``reference_rank`` (rank 0, else the lowest), ``values`` (name ->
    rank -> value, for up to :data:`MAX_NAMES` names and :data:`MAX_RANKS` ranks; fingerprints
    for parameters), ``steps_differing``, ``last_step_differing``, ``first_check`` (for
    parameters: the first fingerprinted step), ``last_equal_step`` (for parameters: the last
    check before ``step``, where they were equal), sorted by ``step``.
    ``con``: a DuckDB connection used by this call alone (default: a new one).
    """
    from hvtrace.analysis.engine import on_own_engine, span_query

    if con is None:
        return on_own_engine(
            lambda c: check(sources, steps, c), lambda error: {**empty(), "error": error}
        )
    if not sources:
        return empty()
    with span_query(con, sources, steps) as (src, where, params):
        rows = _ROWS_SQL.format(src=src, where=where)
        groups = _GROUPS_SQL.format(rows=rows)
        summary = con.execute(_SUMMARY_SQL.format(groups=groups), params).fetchall()
        if not summary:
            return empty()
        by_what = {
            r[0]: dict(
                zip(
                    (
                        "steps",
                        "names",
                        "first_step",
                        "last_step",
                        "steps_differing",
                        "first_diff",
                        "last_diff",
                    ),
                    r[1:],
                )
            )
            for r in summary
        }

        def distinct(col: str, what: str, limit: int) -> list[Any]:
            """The first ``limit`` distinct values of ``col`` in the rows of kind ``what``."""
            return [
                v
                for (v,) in con.execute(
                    f"SELECT DISTINCT {col} FROM ({rows}) WHERE what = '{what}' "
                    f"ORDER BY {col} LIMIT {limit}",
                    params,
                ).fetchall()
            ]

        out: dict[str, Any] = {"checked": True}
        p = by_what.get("parameters")
        param_steps: list[int] = []
        if p is not None:
            param_steps = [int(s) for s in distinct("step", "parameters", MAX_STEPS_LISTED)]
            out["parameters"] = {
                "checks": int(p["steps"]),
                "steps": param_steps,
                "tensors": int(p["names"]),
                "first_step": int(p["first_step"]),
                "last_step": int(p["last_step"]),
            }
        if "lr" in by_what:
            out["lr"] = {
                "steps": int(by_what["lr"]["steps"]),
                "groups": int(by_what["lr"]["names"]),
            }
        for what in ("values", "metrics"):
            if what not in by_what:
                continue
            names = [str(n) for n in distinct("name", what, MAX_NAMES * 4)]
            out[what] = {
                "steps": int(by_what[what]["steps"]),
                "names": [_display(n) for n in names],
            }
        divs = []
        for what in _KINDS:
            w = by_what.get(what)
            if w is None or w["first_diff"] is None:
                continue
            step = int(w["first_diff"])
            # the rows of that one step (a Parquet file's other row groups are skipped)
            at = _ROWS_SQL.format(src=src, where=f"step = {step}")
            got = con.execute(
                f"SELECT rank, name, occ, value FROM ({at}) WHERE what = '{what}' "
                "ORDER BY name, occ, rank",
                params,
            ).fetchall()
            d = _divergence(what, step, got)
            d["steps_differing"] = int(w["steps_differing"])
            d["last_step_differing"] = int(w["last_diff"])
            if what == "parameters":
                d["first_check"] = int(w["first_step"])
                (last_equal,) = con.execute(
                    f"SELECT max(step) FROM ({rows}) WHERE what = 'parameters' AND step < {step}",
                    params,
                ).fetchall()[0]
                d["last_equal_step"] = int(last_equal) if last_equal is not None else None
            divs.append(d)
        out["divergences"] = sorted(divs, key=lambda d: (d["step"], _KINDS.index(d["what"])))
        return out


def _display(name: str) -> str:
    """A name as the report shows it (reserved prefixes removed)."""
    for prefix in (PARAM_PREFIX, LR_PREFIX, MONITOR_PREFIX, METRIC_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _divergence(what: str, step: int, got: list[tuple]) -> dict[str, Any]:
    """One divergence from the rows ``(rank, name, occ, value)`` of its first differing step."""
    by_key: dict[tuple[str, int], dict[int, float]] = {}
    for rank, name, occ, value in got:
        by_key.setdefault((str(name), int(occ)), {})[int(rank)] = value
    all_ranks = sorted({int(r) for r, _, _, _ in got})
    ref = 0 if 0 in all_ranks else (all_ranks[0] if all_ranks else 0)
    differing_names: list[str] = []
    ranks: set[int] = set()
    values: dict[str, dict[str, Any]] = {}
    for (name, _occ), vals in by_key.items():
        if len(vals) < 2 or not _differ(list(vals.values())):
            continue
        base = vals.get(ref, next(iter(vals.values())))
        off = [r for r, v in vals.items() if not _same(v, base)]
        ranks.update(off)
        shown = _display(name)
        if shown not in differing_names:
            differing_names.append(shown)
        if len(values) < MAX_NAMES and shown not in values:
            keep = sorted(vals)[:MAX_RANKS]
            values[shown] = {str(r): _num(vals[r]) for r in keep}
    d: dict[str, Any] = {"what": what, "step": step}
    if what == "lr":
        d["names"] = ["lr"]
        d["groups"] = [int(n) if n.isdigit() else n for n in differing_names]
    else:
        d["names"] = differing_names
    if what in ("values", "metrics"):
        d["monitored"] = [
            _display(n)
            for (n, _), vals in by_key.items()
            if n.startswith(MONITOR_PREFIX) and len(vals) > 1 and _differ(list(vals.values()))
        ]
    d["ranks"] = sorted(ranks)
    d["reference_rank"] = ref
    d["values"] = values
    return d


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def _differ(vals: list[Any]) -> bool:
    return any(not _same(v, vals[0]) for v in vals[1:])


def _num(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def check_frame(spans: Any, steps: StepRange | None = None) -> dict[str, Any]:
    """:func:`check` of a span frame (:func:`hvtrace.load_run`'s ``Run.spans`` or a hand-made
    table with ``rank, step, kind, name, start_ns, value`` and optionally ``flags``)."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    if spans is None or len(spans) == 0 or "value" not in spans.columns:
        return empty()
    n = len(spans)
    cols: dict[str, Any] = {
        "rank": spans["rank"].astype(np.int32).to_numpy(),
        "step": spans["step"].astype(np.int32).to_numpy(),
        "kind": spans["kind"].astype(str).to_numpy(),
        "name": spans["name"].astype(str).to_numpy(),
        "start_ns": spans["start_ns"].astype(np.int64).to_numpy(),
        "end_ns": (spans["end_ns"] if "end_ns" in spans.columns else spans["start_ns"])
        .astype(np.int64)
        .to_numpy(),
        "bytes": np.zeros(n, np.int64),
        "dtype": np.full(n, "", object),
        "value": spans["value"].astype("float64").to_numpy(),
        "flags": (
            spans["flags"].fillna(0).astype(np.uint8).to_numpy()
            if "flags" in spans.columns
            else np.zeros(n, np.uint8)
        ),
    }
    table = pa.Table.from_pandas(pd.DataFrame(cols), preserve_index=False)
    return check([RankSource(None, n, table=table)], steps)


# -- findings --------------------------------------------------------------------------------------
def divergence_findings(a: Analysis) -> list[Finding]:
    """``divergence`` findings from ``a.consistency`` (:func:`check`), first step first."""
    c = getattr(a, "consistency", None) or {}
    lightning = getattr(a, "lightning", None)
    out = []
    for d in c.get("divergences") or []:
        try:
            out.append(_finding(d, lightning))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _ranks_words(d: dict[str, Any]) -> str:
    ranks = d.get("ranks") or []
    shown = ", ".join(map(str, ranks[:8])) + (
        f" (and {len(ranks) - 8} more)" if len(ranks) > 8 else ""
    )
    plural = len(ranks) > 1
    ref = d.get("reference_rank", 0)
    return f"rank{'s' if plural else ''} {shown} differ{'' if plural else 's'} from rank {ref}"


def _values_words(
    values: dict[str, dict[str, Any]], names: Sequence[str] = (), limit: int = 3, ranks: int = 4
) -> str:
    """``"val_loss: rank 0 2.3, rank 1 2.31; ..."`` for the first ``limit`` names of ``values``
    (and ``ranks`` ranks of each), saying how many more there are: the other names of
    ``names`` (every differing name) and the other ranks kept."""
    parts = []
    for name, by_rank in list(values.items())[:limit]:
        vs = ", ".join(f"rank {r} {_fmt(v)}" for r, v in list(by_rank.items())[:ranks])
        more = len(by_rank) - ranks
        if more > 0:
            vs += (
                " (and more ranks)"
                if len(by_rank) >= MAX_RANKS
                else f" (and {more} more rank{'s' if more > 1 else ''})"
            )
        parts.append(f"{printable(name)}: {vs}")
    shown = set(list(values)[:limit])
    extra = [printable(n) for n in dict.fromkeys(names) if n not in shown]
    if not names:  # only the values kept: what they hold beyond the limit
        extra = [printable(n) for n in list(values)[limit:]]
    if extra:
        listed = ", ".join(extra[:5]) + (", ..." if len(extra) > 5 else "")
        parts.append(f"and {len(extra)} more ({listed})")
    return "; ".join(parts)


def _sync_dist_words(lightning: str) -> str:
    """Why ``self.log(..., sync_dist=True)`` averages nothing under Lightning's Horovod strategy,
    and what does (pytorch-lightning 1.9: ``LightningModule.log`` passes on ``sync_dist=sync_dist
    and _distributed_available()``, true only when ``torch.distributed`` is initialized)."""
    version = (
        f"pytorch-lightning {printable(lightning[:40])}" if lightning else "pytorch-lightning 1.9"
    )
    return (
        f'under strategy="horovod" self.log(..., sync_dist=True) averages nothing: {version} '
        "reduces a logged value only when torch.distributed is initialized, which Horovod does "
        "not do (torchmetrics objects do not sync either). Log the value averaged across ranks "
        "instead, where ModelCheckpoint, EarlyStopping and the scheduler read it: in "
        "on_validation_epoch_end, self.log(NAME, hvd.allreduce(value, op=hvd.Average)) with "
        "value the rank's own mean (averaging trainer.callback_metrics in the module's "
        "on_validation_end comes after ModelCheckpoint's and EarlyStopping's on_validation_end)"
    )


#: The advice of :func:`_sync_dist_words`, for the other modules' findings.
sync_dist_words = _sync_dist_words


def _fmt(v: Any) -> str:
    if v is None:
        return "nan"
    return f"{float(v):.6g}"


def _finding(d: dict[str, Any], lightning: str | None = None) -> Finding:
    """The finding of one divergence; ``lightning``: the run's pytorch-lightning version (``""``
    when unknown), None when the run is not known to be Lightning's (:attr:`Analysis.
    lightning`): the advice names what averages a value on that stack."""
    what, step = d["what"], int(d["step"])
    names = [printable(n) for n in d.get("names") or []]
    more = len(names) - 3
    listed = ", ".join(names[:3]) + (f" (and {more} more)" if more > 0 else "")
    if what == "parameters":
        first = d.get("first_check")
        if first is not None and step == int(first) and step == 0:
            msg = (
                f"divergence at step 0, before any update: the ranks start from different "
                f"weights ({listed}; {_ranks_words(d)}): hvd.broadcast_parameters("
                "model.state_dict(), root_rank=0) is probably missing after the model is built "
                "(and hvd.broadcast_optimizer_state(optimizer, root_rank=0) after the optimizer "
                "state is loaded); every rank trains its own model"
            )
        else:
            since = d.get("last_equal_step")
            window = (
                f" (equal at the check of step {since})" if since is not None else " (first check)"
            )
            msg = (
                f"divergence at step {step}: the parameters differ across ranks{window} in "
                f"{listed}; {_ranks_words(d)}: something changed the weights on some ranks only "
                "(code or a callback that runs on one rank, an optimizer state or a learning "
                "rate that differs: hvd.broadcast_optimizer_state); from here the ranks train "
                "different models"
            )
    elif what == "lr":
        groups = d.get("groups") or []
        gw = f"param group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups[:4]))}"
        vals = "; ".join(
            f"{', '.join(f'rank {r} {_fmt(v)}' for r, v in list(by.items())[:4])}"
            for by in list((d.get("values") or {}).values())[:1]
        )
        fix = (
            "a ReduceLROnPlateau monitoring a logged value that differs across ranks: "
            + _sync_dist_words(lightning)
            if lightning is not None
            else "a ReduceLROnPlateau stepped with each rank's own value: average it first, "
            "hvd.allreduce(value, op=hvd.Average)"
        )
        msg = (
            f"divergence at step {step}: the learning rate (lr) differs across ranks ({gw}: "
            f"{vals}); {_ranks_words(d)}: a scheduler stepped on some ranks only, or fed a "
            f"metric that differs across ranks ({fix}); the ranks now train different models"
        )
    elif what == "metrics":  # recorded by hvtrace.lightning only
        msg = (
            f"logged metrics differ across ranks at step {step}: "
            f"{_values_words(d.get('values') or {}, d.get('names') or ())}; the logger shows "
            "rank 0's, and "
            "anything that acts on one (a scheduler, EarlyStopping, ModelCheckpoint's monitor) "
            "acts on each rank's own value; "
            + _sync_dist_words(lightning or "")
            + ", for every value that should describe the whole job"
        )
        return Finding("divergence", "info", msg, float(step), "step", dict(d))
    else:
        monitored = d.get("monitored") or []
        mon = (
            f"; {', '.join(printable(m) for m in monitored)} is what a ReduceLROnPlateau "
            "scheduler is stepped with: its learning rate will differ across ranks"
            if monitored
            else ""
        )
        fix = (
            _sync_dist_words(lightning)
            if lightning is not None
            else "average them across ranks with hvd.allreduce(value, op=hvd.Average) before "
            "using them"
        )
        msg = (
            f"divergence at step {step}: values that must agree differ across ranks: "
            f"{_values_words(d.get('values') or {}, d.get('names') or ())}{mon}; {fix}"
        )
    return Finding("divergence", "warning", msg, float(step), "step", dict(d))


__all__ = ["check", "check_frame", "divergence_findings", "empty", "sync_dist_words"]
