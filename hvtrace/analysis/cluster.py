"""The per-rank pass as tasks on a Dask cluster (``hvtrace analyze --dask``).

Dask only schedules: each task is the local engine's :meth:`~hvtrace.analysis.engine.Engine.
rank_pass` over one group of ranks (DuckDB over those ranks' files, read by the worker from a
path every worker sees), and the client joins the small summaries with the same
:func:`~hvtrace.analysis.engine.cross_rank` as the local engine. So there is one implementation
of each metric, whatever the engine, and the result is the same object.

- ``--dask tcp://HOST:8786`` (any address ``distributed.Client`` takes) uses a running cluster;
  ``--dask local:N`` starts a ``LocalCluster`` of N worker processes for this analysis.
- A task that DuckDB cannot finish (a damaged file) is run again on what the careful reader
  salvages (the client's ``repair``), as in the local engine.
- A worker that dies is Dask's business: its tasks are rescheduled, and after Dask's
  ``distributed.scheduler.allowed-failures`` the task fails with ``KilledWorker``, which is
  reported in one line. When no worker is left for ``no_worker_timeout_s``, the analysis stops
  with one line instead of waiting for a worker that may never come.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from hvtrace.analysis.engine import (
    GROUP_SPANS,
    Engine,
    EngineError,
    GroupSummary,
    Summaries,
    _first_line,
    cross_rank,
    groups,
)
from hvtrace.load import RankSource
from hvtrace.selection import StepRange

log = logging.getLogger(__name__)

#: Seconds to wait for the scheduler when connecting: 8, so that with Dask's import (about a
#: second) an address that is not a scheduler ends the command within the 10 s docs/scale.md
#: promises (at 10 it took 11.3-11.7 s).
CONNECT_TIMEOUT_S = 8.0
#: Tasks per worker the ranks are split into (fewer when there are fewer ranks).
TASKS_PER_WORKER = 4
#: Seconds the analysis waits with no worker in the cluster before it gives up.
NO_WORKER_TIMEOUT_S = 60.0


@dataclass
class _Failed:
    """What a task returns when DuckDB could not read its group (``message``: the first line).

    Returned rather than raised, so the client need not unpickle DuckDB's exception types."""

    message: str


def group_task(
    sources: Sequence[RankSource], steps: StepRange | None, memory_limit_bytes: int | None
) -> GroupSummary | _Failed:
    """One Dask task: the per-rank pass over ``sources`` on a fresh single-threaded engine.

    The partial collectives come back with the summary (the client merges them); the worker's
    address is in ``GroupSummary.worker``."""
    import duckdb

    try:
        with Engine(memory_limit_bytes, threads=1) as eng:
            out = eng.rank_pass(sources, steps)
    except duckdb.Error as exc:
        return _Failed(_first_line(exc))
    try:
        from distributed import get_worker

        out.worker = str(get_worker().address)
    except (ImportError, ValueError):  # not on a worker (run inline)
        out.worker = ""
    return out


def check_spec(spec: str) -> tuple[str, int]:
    """Parse a ``--dask`` value: ``local:N`` -> ("local", N); an address -> (address, 0).

    Raises ValueError (one line) for anything else."""
    s = spec.strip()
    if s.startswith("local:") or s == "local":
        n_text = s.partition(":")[2] or str(min(os.cpu_count() or 2, 4))
        try:
            n = int(n_text)
        except ValueError:
            raise ValueError(f"--dask {spec!r}: local:N needs a number of workers") from None
        if not 1 <= n <= 256:
            raise ValueError(f"--dask {spec!r}: the number of workers must be 1..256")
        return "local", n
    if not s or any(c.isspace() for c in s):
        raise ValueError(f"--dask {spec!r} is not a scheduler address (tcp://HOST:8786 or local:N)")
    return s, 0


@contextmanager
def dask_client(spec: str, connect_timeout_s: float | None = None) -> Iterator[Any]:
    """A ``distributed.Client`` for ``spec`` (``local:N`` or a scheduler address), closed on exit
    (with the LocalCluster it started). Raises :class:`EngineError` (one line) when Dask is not
    installed or the scheduler cannot be reached (within ``connect_timeout_s``, default
    :data:`CONNECT_TIMEOUT_S`)."""
    if connect_timeout_s is None:
        connect_timeout_s = CONNECT_TIMEOUT_S
    address, n = check_spec(spec)
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise EngineError("--dask needs dask.distributed: pip install 'hvtrace[dask]'") from None
    if not log.isEnabledFor(logging.DEBUG):
        _quiet_dask()
    cluster = None
    try:
        if address == "local":
            cluster = LocalCluster(
                n_workers=n,
                threads_per_worker=1,
                processes=True,
                dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            client = Client(cluster, timeout=connect_timeout_s)
        else:
            client = _connect(Client, address, connect_timeout_s)
    except (OSError, TimeoutError, ValueError, TypeError, ImportError) as exc:
        if cluster is not None:
            cluster.close()
        what = "start a local Dask cluster" if address == "local" else f"reach {address}"
        raise EngineError(f"cannot {what}: {_first_line(exc)}") from None
    try:
        yield client
    finally:
        try:
            client.close()
        finally:
            if cluster is not None:
                cluster.close()


def _connect(client_cls: Any, address: str, timeout_s: float) -> Any:
    """``client_cls(address)`` once a Dask scheduler has answered at ``address``; TimeoutError
    when none has within ``timeout_s`` (plus a second), OSError when something else answered.

    ``Client``'s own timeout does not bound a handshake with a server that accepts the
    connection and never answers as a scheduler (an HTTP server, such as the Dask dashboard's
    port), and a ``Client`` left hanging holds Dask's process-wide event-loop lock, so that every
    later cluster or client of the process would hang too (a notebook's next analysis). So the
    address is first probed with Dask's own connection handshake, in a thread of its own with an
    event loop of its own and a bound on it (nothing of Dask's shared state is held); only a
    scheduler that answered gets a ``Client``."""
    import asyncio
    import threading

    from distributed.comm import connect

    out: dict[str, Any] = {}

    async def probe() -> None:
        comm = await connect(address, timeout=timeout_s)
        await comm.close()

    def attempt() -> None:
        try:
            asyncio.run(asyncio.wait_for(probe(), timeout_s))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    t = threading.Thread(target=attempt, name="hvtrace-dask-probe", daemon=True)
    t.start()
    t.join(timeout_s + 1.0)
    err = out.get("error")
    if t.is_alive() or isinstance(err, asyncio.TimeoutError | TimeoutError):
        raise TimeoutError(
            f"no Dask scheduler answered within {timeout_s:g} s (is it a scheduler's address? "
            "the dashboard's port, 8787, is not)"
        )
    if isinstance(err, OSError | ValueError | TypeError | ImportError):
        raise err
    if err is not None:
        raise OSError(f"no Dask scheduler answered ({type(err).__name__}: {err})")
    return client_cls(address, timeout=timeout_s)


def _quiet_dask() -> None:
    """Keep Dask's own INFO/WARNING lines (workers started, lost, restarted) off the terminal:
    the analysis reports what matters in one line. ``-v`` keeps them."""
    for name in ["distributed", *logging.root.manager.loggerDict]:
        if name == "distributed" or name.startswith("distributed."):
            logging.getLogger(name).setLevel(logging.ERROR)


def summarize_dask(
    sources: Sequence[RankSource],
    steps: StepRange | None = None,
    *,
    dask: str,
    n_ranks: int | None = None,
    memory_limit_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_group_spans: int = GROUP_SPANS,
    repair: Callable[[list[RankSource]], list[RankSource]] | None = None,
    no_worker_timeout_s: float | None = None,
) -> Summaries:
    """Run the per-rank pass as Dask tasks and the cross-rank pass here; return the same
    :class:`~hvtrace.analysis.engine.Summaries` as the local engine's ``summarize``.

    Ranks are grouped into about :data:`TASKS_PER_WORKER` tasks per worker (at most
    ``max_group_spans`` spans each; a rank is never split). ``dask``: ``local:N`` or a
    scheduler address. ``memory_limit_bytes``: each task's DuckDB limit (default: a quarter of
    the worker machine's memory). Raises :class:`EngineError` (one line) for an unreachable
    scheduler, a group no reader can read, a task that killed its workers, or a cluster left
    without workers for ``no_worker_timeout_s`` (default :data:`NO_WORKER_TIMEOUT_S`)."""
    if no_worker_timeout_s is None:
        no_worker_timeout_s = NO_WORKER_TIMEOUT_S
    # paths as every worker sees them (a relative one would be resolved in the worker's cwd)
    srcs = [
        replace(s, parquet=os.path.abspath(s.parquet)) if s.parquet is not None else s
        for s in sources
    ]
    results: dict[int, GroupSummary] = {}  # by group index: joined in rank order
    by_worker: dict[str, int] = {}
    with dask_client(dask) as client, Engine(memory_limit_bytes, threads=1) as merger:
        address = str(client.scheduler.address)
        # about TASKS_PER_WORKER tasks per worker (a rank is never split), for balance
        total = sum(s.n_spans for s in srcs)
        per_task = -(-total // (TASKS_PER_WORKER * max(1, _n_workers(client))))
        gs = list(groups(srcs, max(1, min(max_group_spans, per_task))))
        pending: dict[Any, tuple[int, list[RankSource], bool]] = {}

        def submit(i: int, g: list[RankSource], repaired: bool) -> None:
            arg: Any = g
            if any(s.table is not None for s in g):  # in-memory spans travel as data
                arg = client.scatter(g, hash=False)
            fut = client.submit(group_task, arg, steps, memory_limit_bytes, pure=False)
            pending[fut] = (i, g, repaired)

        for i, g in enumerate(gs):
            submit(i, g, False)
        done = 0
        no_workers_since: float | None = None
        try:
            while pending:
                _wait_some(list(pending), timeout_s=1.0)
                for fut in [f for f in pending if f.done()]:
                    i, g, repaired = pending.pop(fut)
                    out = _outcome(fut, g)
                    if isinstance(out, _Failed):
                        if repair is None or repaired:
                            raise EngineError(out.message)
                        submit(i, repair(g), True)
                        continue
                    merger.add_collectives(out.collectives)
                    out.collectives = None
                    results[i] = out
                    by_worker[out.worker] = by_worker.get(out.worker, 0) + 1
                    done += len(g)
                    if progress is not None:
                        progress(done, len(srcs))
                if pending and not _n_workers(client):
                    no_workers_since = no_workers_since or time.monotonic()
                    if time.monotonic() - no_workers_since > no_worker_timeout_s:
                        raise EngineError(
                            f"the Dask cluster at {address} has had no worker for "
                            f"{no_worker_timeout_s:g} s; {len(pending)} task(s) left"
                        )
                else:
                    no_workers_since = None
        finally:
            if pending:
                client.cancel(list(pending))
        summ = cross_rank([results[i] for i in sorted(results)], n_ranks, merger.collectives())
    summ.engine = {
        "name": "dask",
        "scheduler": "local" if dask.strip().startswith("local") else address,
        "tasks": len(results),
        "tasks_by_worker": dict(sorted(by_worker.items())),
    }
    return summ


def _wait_some(futures: list[Any], timeout_s: float) -> None:
    """Return when one of ``futures`` is done, or after ``timeout_s``."""
    from distributed import wait

    try:
        wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")
    except TimeoutError:
        pass


def _outcome(fut: Any, group: list[RankSource]) -> GroupSummary | _Failed:
    """The result of a finished task; a task Dask gave up on becomes :class:`EngineError`."""
    if fut.status == "finished":
        return fut.result()
    exc = fut.exception() if fut.status == "error" else None
    ranks = [s.rank for s in group if s.rank is not None]
    which = f"ranks {ranks[0]}..{ranks[-1]}" if ranks else "a group of spans"
    if exc is None:
        raise EngineError(f"the Dask task for {which} was {fut.status}")
    name = type(exc).__name__
    if name == "KilledWorker":
        raise EngineError(
            f"Dask workers died running the task for {which} (KilledWorker; see the workers' "
            "logs: memory limit or a crash)"
        )
    raise EngineError(f"the Dask task for {which} failed: {name}: {_first_line(exc)}")


def _n_workers(client: Any) -> int:
    try:
        return len(client.scheduler_info().get("workers", {}))
    except (OSError, TimeoutError):
        return 0
