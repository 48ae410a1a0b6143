"""Write a synthetic run of any size with hvtrace's own writer, closed as a clean close would.

    python bench/synth_run.py DIR --ranks 128 --steps 1500 --tensors 96 --slow-rank 5
                                  [--slow-ms 20] [--slow-phase forward] [--ranks-per-host 8]

Every rank gets the spans a traced Horovod step produces (input, forward, backward, one allreduce
per gradient tensor, wait, update, step, a loss scalar), simulated as a synchronous ring: a tensor
is reduced once every rank has enqueued it, in order, so the slowed rank's lateness shows on all
the others as waiting, as in a real job. Each rank's clock is offset from rank 0's by a known
amount recorded in its header (loading exercises the alignment). The simulation is vectorized
over ranks and tensors (a block of steps at a time, bounded memory), written as Arrow record
batches through :class:`hvtrace.record.writer.TraceFile` (one batch per rank per block, with the
writer's batch status), then each file is closed and compacted exactly as the recorder does on a
clean close (:func:`hvtrace.format.compact.compact`).

Prints spans written, bytes on disk and seconds taken.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from hvtrace.format.compact import compact
from hvtrace.format.schema import DTYPES, FILE_SCHEMA, FORMAT_NAME, FORMAT_VERSION, KIND_CODE, KINDS
from hvtrace.record.writer import TraceFile

log = logging.getLogger("synth_run")
K = KIND_CODE
MS = 1_000_000
PHASES = ("input", "forward", "backward", "update")
#: What a slow rank's extra time can be made of (see ``write_synth_run``'s ``slow_cause``).
CAUSES = ("work", "contention", "blocked")
#: Rows per rank per step besides the allreduces: input, forward, backward, wait, update, step,
#: and the loss scalar.
_FIXED = ("input", "forward", "backward", "wait", "update", "step", "scalar")


def tensor_names(tensors: int) -> list[str]:
    """Gradient names in the order backward produces them (last layer first)."""
    return [
        f"net.{(tensors - 1 - i) // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(tensors)
    ]


def header(run_id: str, rank: int, ranks: int, ranks_per_host: int, offset_ns: int) -> dict:
    """The header a recorder writes, for a synthetic rank whose clock is ``offset_ns`` ahead."""
    base = 10_000_000_000
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "run_id": run_id,
        "rank": rank,
        "size": ranks,
        "local_rank": rank % ranks_per_host,
        "local_size": min(ranks_per_host, ranks),
        "cross_rank": rank // ranks_per_host,
        "cross_size": (ranks + ranks_per_host - 1) // ranks_per_host,
        "host": f"node{rank // ranks_per_host:03d}",
        "pid": 1000 + rank,
        "device": "cpu",
        "timing": "host_monotonic",
        "torch_version": "synthetic",
        "horovod_version": "synthetic",
        "horovod_env": {},
        "optimizer": {"class": "SGD", "backward_passes_per_step": 1},
        "model": "MLP",
        "mono_anchor_ns": int(base + offset_ns),
        "wall_anchor_ns": 1_700_000_000_000_000_000,
        "clock": {
            "method": "barrier-interval",
            "reference_rank": 0,
            "start": {
                "at_ns": int(base + offset_ns),
                "offset_ns": int(offset_ns),
                "uncertainty_ns": 20_000,
                "rounds": 5,
                "bounded": True,
            },
        },
    }


def write_synth_run(
    out_dir: str | Path,
    ranks: int = 8,
    steps: int = 100,
    tensors: int = 16,
    slow_rank: int = 1,
    slow_ms: float = 20.0,
    slow_phase: str = "forward",
    ranks_per_host: int = 8,
    seed: int = 0,
    run_id: str = "20260101-000000-synth1",
    block_steps: int = 100,
    compact_files: bool = True,
    row_group_rows: int | None = None,
    slow_cause: str = "work",
    runq_frac: float = 0.0,
    counters_every: int = 1,
    slow_speed: float = 1.0,
    speed_phases: tuple[str, ...] = PHASES,
) -> int:
    """Write the run into ``out_dir``; return the number of spans written.

    ``slow_phase`` is one of input, forward, backward, update: the phase of ``slow_rank`` that
    takes ``slow_ms`` longer in every step. ``compact_files`` False leaves the files as a
    crashed job would (never closed): Arrow IPC streams without their final batch.
    ``row_group_rows``: the Parquet row group bound (default: the writer's). ``slow_cause``
    (one of :data:`CAUSES`) is what the slow rank's extra time is made of in the ``cpu_ns`` and
    ``runq_ns`` columns: CPU time (``work``), run-queue wait (``contention``) or neither
    (``blocked``). Every other phase is CPU work, except ``runq_frac`` of it spent waiting for
    a CPU on every rank (an oversubscribed host); the wait phase spends 5 % on a CPU.
    ``counters_every``: the counters are read on the steps it divides only (short steps, see
    ``$HVTRACE_COUNTERS_MS``); the other steps' spans have null ``cpu_ns``/``runq_ns``.
    ``slow_speed``: ``slow_rank``'s ``speed_phases`` take that many times as long, all of it CPU
    time (the same work on a slower processor: every phase; more data per step: not the
    update).
    """
    if slow_phase not in PHASES:
        raise ValueError(f"slow_phase must be one of {PHASES}")
    if slow_cause not in CAUSES:
        raise ValueError(f"slow_cause must be one of {CAUSES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = tensor_names(tensors)
    fixed_names = ["input", "forward", "backward", "synchronize", "update", "step", "loss"]
    name_dict = pa.array([*fixed_names, *names], pa.string())
    nbytes = np.array([(4 << 20) if i % 2 == 0 else (4 << 10) for i in range(tensors)], np.int64)
    comm_ns = (nbytes * 2 * (ranks - 1) / max(ranks, 1) / 4.0e9 * 1e9).astype(np.int64) + 50_000
    c_comm = np.cumsum(comm_ns)
    offsets = rng.integers(-5 * MS, 5 * MS, ranks)
    offsets[0] = 0
    slow = np.zeros(ranks, np.int64)
    if 0 <= slow_rank < ranks:
        slow[slow_rank] = int(slow_ms * MS)
    files = [
        TraceFile(
            out / f"rank{r:05d}-{run_id}.arrows",
            header(run_id, r, ranks, ranks_per_host, offsets[r]),
        )
        for r in range(ranks)
    ]
    per_step = tensors + len(_FIXED)
    kind_row = np.array(
        [K[k] for k in ("input", "forward", "backward")]
        + [K["allreduce"]] * tensors
        + [K[k] for k in ("wait", "update", "step", "scalar")],
        np.int8,
    )
    name_row = np.array([0, 1, 2, *range(7, 7 + tensors), 3, 4, 5, 6], np.int32)
    bytes_row = np.concatenate([[0, 0, 0], nbytes, [0, 0, 0, 0]]).astype(np.int64)
    dtype_row = np.array([0, 0, 0] + [DTYPES.index("float32")] * tensors + [0, 0, 0, 0], np.int8)
    flags_row = np.array([0, 0, 0] + [2] * tensors + [0, 0, 0, 0], np.uint8)
    step_start = np.full(ranks, 10_000_000_000, np.int64)
    written = 0
    measured = np.zeros(per_step, bool)
    measured[[0, 1, 2, per_step - 4, per_step - 3, per_step - 2]] = True  # not allreduce, scalar
    for b0 in range(0, steps, block_steps):
        nb = min(block_steps, steps - b0)
        st = np.empty((nb, ranks, per_step), np.int64)
        en = np.empty((nb, ranks, per_step), np.int64)
        runq = np.zeros((nb, ranks, per_step), np.int64)
        loss = np.empty((nb, ranks))
        for i in range(nb):
            s = b0 + i
            jit = rng.normal(1.0, 0.03, (4, ranks)).clip(0.8, 1.3)
            if 0 <= slow_rank < ranks:
                for p in speed_phases:
                    jit[PHASES.index(p), slow_rank] *= slow_speed
            extra = {p: (slow if slow_phase == p else 0) for p in PHASES}
            d_in = (2 * MS * jit[0]).astype(np.int64) + extra["input"]
            d_fw = (8 * MS * jit[1]).astype(np.int64) + extra["forward"]
            d_bw = (16 * MS * jit[2]).astype(np.int64) + extra["backward"]
            d_up = (1 * MS * jit[3]).astype(np.int64) + extra["update"]
            fw0 = step_start + d_in
            bw0 = fw0 + d_fw
            bw1 = bw0 + d_bw
            ready = bw0[:, None] + (d_bw[:, None] * np.arange(1, tensors + 1)[None, :]) // tensors
            # ring in order: done_k = max over j <= k of (last enqueue of j + comm of j..k)
            last_ready = ready.max(axis=0)
            prev_c = np.concatenate([[0], c_comm[:-1]])
            done = np.maximum.accumulate(last_ready - prev_c) + c_comm
            sync_end = np.maximum(bw1, done[-1]) + 30_000
            upd_end = sync_end + d_up
            o = offsets[:, None]
            st[i, :, 0], en[i, :, 0] = step_start, fw0
            st[i, :, 1], en[i, :, 1] = fw0, bw0
            st[i, :, 2], en[i, :, 2] = bw0, bw1
            st[i, :, 3 : 3 + tensors] = ready
            en[i, :, 3 : 3 + tensors] = done[None, :]
            j = 3 + tensors
            st[i, :, j], en[i, :, j] = bw1, sync_end
            st[i, :, j + 1], en[i, :, j + 1] = sync_end, upd_end
            st[i, :, j + 2], en[i, :, j + 2] = step_start, upd_end
            st[i, :, j + 3] = en[i, :, j + 3] = upd_end + 1000
            col = {"input": 0, "forward": 1, "backward": 2, "update": j + 1}[slow_phase]
            if slow_cause == "contention":
                runq[i, :, col] += slow
            st[i] += o
            en[i] += o
            loss[i] = 2.3 * np.exp(-s / max(steps, 1)) + 0.01 * np.arange(ranks)
            step_start = upd_end + 100_000
        # CPU time: the whole phase, less its run-queue wait; the wait phase 5 %; the slow rank's
        # extra is CPU only for slow_cause "work"; the step is the sum of its phases
        for c in (0, 1, 2, j + 1):
            runq[:, :, c] += ((en[:, :, c] - st[:, :, c]) * runq_frac).astype(np.int64)
        runq[:, :, j + 2] = runq[:, :, [0, 1, 2, j + 1]].sum(axis=2)
        cpu = en - st - runq
        cpu[:, :, j] = (en[:, :, j] - st[:, :, j]) // 20
        if slow_cause == "blocked":
            cpu[:, :, col] -= slow[None, :]
        cpu[:, :, j + 2] = cpu[:, :, [0, 1, 2, j, j + 1]].sum(axis=2)
        step_col = np.repeat(np.arange(b0, b0 + nb, dtype=np.int32), per_step)
        unread = ~(np.tile(measured, nb) & (step_col % counters_every == 0))
        value = np.full((nb, per_step), np.nan)
        last = b0 + nb >= steps
        for r in range(ranks):
            value[:, -1] = loss[:, r]
            batch = pa.RecordBatch.from_arrays(
                [
                    pa.array(step_col),
                    pa.array(np.zeros(nb * per_step, np.int16)),
                    pa.DictionaryArray.from_arrays(
                        pa.array(np.tile(kind_row, nb)), pa.array(KINDS, pa.string())
                    ),
                    pa.DictionaryArray.from_arrays(pa.array(np.tile(name_row, nb)), name_dict),
                    pa.array(st[:, r, :].ravel()),
                    pa.array(en[:, r, :].ravel()),
                    pa.array(np.tile(bytes_row, nb)),
                    pa.DictionaryArray.from_arrays(
                        pa.array(np.tile(dtype_row, nb)), pa.array(DTYPES, pa.string())
                    ),
                    pa.array(value.ravel()),
                    pa.array(np.tile(flags_row, nb)),
                    pa.array(cpu[:, r, :].ravel(), mask=unread),
                    pa.array(runq[:, r, :].ravel(), mask=unread),
                ],
                schema=FILE_SCHEMA,
            )
            done_spans = (b0 + nb) * per_step
            status = {
                "dropped": 0,
                "clock": [],
                "last_step": b0 + nb - 1,
                "spans": done_spans,
                "writer_cpu_s": 0.0,
                "final": bool(last and compact_files),
            }
            files[r].write_batch(batch, status)
        written += nb * per_step * ranks
        log.info("steps %d..%d written (%d spans)", b0, b0 + nb - 1, written)
    for f in files:
        if compact_files:
            f.close()
            if row_group_rows is None:
                compact(f.path)
            else:
                compact(f.path, row_group_rows=row_group_rows)
        else:
            f.abandon()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", metavar="DIR")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--slow-rank", type=int, default=1, help="-1: no slow rank")
    p.add_argument("--slow-ms", type=float, default=20.0)
    p.add_argument("--slow-phase", default="forward", choices=PHASES)
    p.add_argument("--slow-cause", default="work", choices=CAUSES)
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crashed", action="store_true", help="leave the files unclosed (IPC)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = Path(args.out_dir)
    if out.is_dir() and any(p.name.startswith("rank") for p in out.iterdir()):
        print(f"{out}: already holds rank files; choose an empty directory", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    n = write_synth_run(
        args.out_dir,
        args.ranks,
        args.steps,
        args.tensors,
        args.slow_rank,
        args.slow_ms,
        args.slow_phase,
        args.ranks_per_host,
        args.seed,
        compact_files=not args.crashed,
        slow_cause=args.slow_cause,
    )
    dt = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in Path(args.out_dir).iterdir() if f.is_file())
    print(
        f"{args.out_dir}: {n:,} spans ({args.ranks} ranks x {args.steps} steps x "
        f"{args.tensors + len(_FIXED)} spans), {size / 1e6:.1f} MB ({size / max(n, 1):.1f} B/span) "
        f"in {dt:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
