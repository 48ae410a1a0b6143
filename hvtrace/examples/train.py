"""The built-in demo: a synthetic-data MLP trained with Horovod, traced by hvtrace.

Run it under Horovod, for example::

    horovodrun -np 2 -H localhost:2 --gloo python -m hvtrace.examples.train --trace-dir runs/demo

Everything is deterministic for a given ``--seed``: each rank draws its batches from its own
seeded generator (seeded with its rank: the data is sharded; ``--unsharded`` gives every rank the
same batches), so a traced and an untraced run end with identical parameters. Options inject a
known slowdown on one rank (``--slow-rank``) or on every rank of one host (``--slow-host``):
``--slow-kind sleep`` (the default) sleeps (the rank is blocked), ``--slow-kind compute`` does
extra matrix products on the training thread (more work); ``--pin-cores`` pins each rank to one
core (so that a busy process pinned beside one rank takes that rank's CPU). Others
exercise Horovod's options (``--bpps``, ``--fp16``, ``--clip``, ``--groups``,
``--sparse-as-dense``); ``--embedding ROWS`` puts an embedding table in front of the MLP
(``--sparse-embedding``: sparse gradients), and ``--manual-average`` averages the gradients by hand
after the backward with a plain optimizer (traced as tracing by environment does). For benchmarks,
``--torch-profiler DIR`` runs the loop under ``torch.profiler`` instead (use it with
``--no-trace``), and ``--step-times`` records each step's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hvtrace


class MLP(nn.Module):
    """``layers`` Linear+ReLU blocks of ``width`` units and a 10-way classifier head; block
    ``wide`` (0-based; -1: none) has ``wide_factor`` times the units."""

    def __init__(
        self,
        width: int = 1024,
        layers: int = 6,
        in_dim: int = 256,
        wide: int = -1,
        wide_factor: int = 4,
    ) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        d = in_dim
        for k in range(layers):
            units = width * wide_factor if k == wide else width
            blocks += [nn.Linear(d, units), nn.ReLU()]
            d = units
        blocks.append(nn.Linear(d, 10))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """A small convolutional net on the same 256-value inputs, seen as 1x16x16 images."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(2 * channels * 12 * 12, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.view(-1, 1, 16, 16))


class EmbeddingMLP(nn.Module):
    """An MLP whose input is the batch and the mean of ``lookups`` rows of an embedding table of
    ``rows`` x ``dim``, the rows picked from the batch's values (so each rank looks up its own
    rows, and a batch touches at most ``batch x lookups`` of them): ``sparse`` makes the
    embedding's gradient a sparse tensor."""

    def __init__(
        self,
        rows: int,
        width: int = 1024,
        layers: int = 6,
        dim: int = 32,
        lookups: int = 16,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        self.rows, self.lookups = rows, lookups
        self.emb = nn.Embedding(rows, dim, sparse=sparse)
        self.mlp = MLP(width, layers, in_dim=256 + dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, : self.lookups] * 10_000).long().abs() % self.rows
        return self.mlp(torch.cat([x, self.emb(ids).mean(dim=1)], dim=1))


#: Whether injected delays are on now (``--slow-from-step`` turns them on at that step).
DELAYS = {"on": True}


def delay(seconds: float, kind: str = "sleep") -> None:
    """Spend ``seconds`` more: asleep (``sleep``: blocked, that much wall time) or multiplying
    matrices on this thread (``compute``: more work, that much of this thread's CPU time, however
    long a busy machine makes it wait for a CPU meanwhile). Nothing while :data:`DELAYS` is off."""
    if not DELAYS["on"]:
        return
    if kind == "sleep":
        time.sleep(seconds)
        return
    a = torch.ones(64, 64)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        a = (a @ a).clamp_(max=1.0)


class SlowForward(nn.Module):
    """Wraps a model and spends ``delay_s`` inside its forward (an injected straggler), asleep
    or computing (:func:`delay`)."""

    def __init__(self, inner: nn.Module, delay_s: float, kind: str = "sleep") -> None:
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delay(self.delay_s, self.kind)
        return self.inner(x)


def slow_backward(model: MLP, delay_s: float, kind: str = "sleep") -> None:
    """Spend ``delay_s`` inside every backward pass of ``model`` (an injected straggler): a
    gradient hook on its first layer's output, which runs late in the backward pass, after the
    later layers' gradients and before the first layer's."""

    def on_grad(grad: torch.Tensor) -> None:
        delay(delay_s, kind)

    def on_forward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(on_grad)

    model.net[0].register_forward_hook(on_forward)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument(
        "--wide-layer", type=int, default=-1, help="MLP block (0-based) made 4 times wider"
    )
    p.add_argument(
        "--model", choices=["mlp", "cnn"], default="mlp", help="an MLP (default) or a small CNN"
    )
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trace-dir", default=None, help="hvtrace trace directory (else $HVTRACE_DIR)")
    p.add_argument("--no-trace", action="store_true", help="use hvd.DistributedOptimizer as is")
    p.add_argument("--no-model-hooks", action="store_true", help="do not pass model= to hvtrace")
    p.add_argument("--slow-rank", type=int, default=-1, help="rank to slow down")
    p.add_argument(
        "--slow-host", default=None, help="slow down every rank on the host of this name"
    )
    p.add_argument(
        "--slow-ms", type=float, default=0.0, help="delay added on --slow-rank / --slow-host"
    )
    p.add_argument(
        "--slow-phase", choices=["forward", "backward", "input", "update"], default="forward"
    )
    p.add_argument(
        "--slow-kind",
        choices=["sleep", "compute"],
        default="sleep",
        help="how the delay is spent: asleep (blocked) or computing (more work)",
    )
    p.add_argument(
        "--input-wait-ms",
        type=float,
        default=0.0,
        help="every rank waits this long (asleep) for each batch, as on a data loader: the "
        "CPU is idle for a share of each step",
    )
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="pin each rank (and the threads it starts) to core local_rank modulo the cores",
    )
    p.add_argument("--bpps", type=int, default=1, help="backward_passes_per_step")
    p.add_argument("--fp16", action="store_true", help="hvd.Compression.fp16")
    p.add_argument(
        "--clip",
        action="store_true",
        help="synchronize(); clip_grad_norm_; with skip_synchronize(): step()",
    )
    p.add_argument("--groups", type=int, default=0, help="Horovod groups= (0: none)")
    p.add_argument("--save-params", default=None, help="rank 0 saves final parameters here")
    p.add_argument(
        "--save-model",
        default=None,
        help="rank 0 saves the model whole and a deep copy of it here, while it is still traced "
        "(torch.save([model, copy.deepcopy(model)]))",
    )
    p.add_argument(
        "--step-times",
        default=None,
        help="write this rank's step times (s) as JSON; '{rank}' in the path is replaced by the "
        "rank (without it every rank writes the same path)",
    )
    p.add_argument("--no-finish", action="store_true", help="skip hvtrace.finish()")
    p.add_argument(
        "--stop-rank",
        type=int,
        default=None,
        help="this rank stops itself (SIGSTOP) at the start of --stop-step: the others hang",
    )
    p.add_argument("--stop-step", type=int, default=10)
    p.add_argument(
        "--end-early-rank",
        type=int,
        default=None,
        help="this rank alone leaves the loop at --stop-step and calls hvd.join() (a stop "
        "decided on one rank: the others train on alone); every rank joins after its loop",
    )
    p.add_argument(
        "--skip-backward-rank",
        type=int,
        default=None,
        help="this rank alone skips the backward of --stop-step but still steps the optimizer "
        "(Horovod allreduces zeros for its missing gradients: the ranks stay in step); every "
        "rank joins after its loop",
    )
    p.add_argument(
        "--skip-step-rank",
        type=int,
        default=None,
        help="this rank alone skips --stop-step after its forward (a 'bad loss' guard on one "
        "rank: no backward, no optimizer step, so it takes one optimizer step fewer than the "
        "others); every rank joins after its loop",
    )
    p.add_argument(
        "--lone-allreduce-rank",
        type=int,
        default=None,
        help="after --stop-step this rank alone averages a metric with hvd.allreduce (a bug: "
        "the others never issue it, so every rank hangs)",
    )
    p.add_argument(
        "--late-metric-rank",
        type=int,
        default=None,
        help="every rank averages a metric with hvd.allreduce_async after --stop-step and waits "
        "for it two steps later; this rank issues it a step late (a collective issued at "
        "another step on one rank: the ranks' collectives per step differ, and nothing hangs)",
    )
    p.add_argument(
        "--skip-allreduce-rank",
        type=int,
        default=None,
        help="with --metric-allreduce: this rank skips the metric's allreduce after --stop-step "
        "(a bug: the others issue it and wait there, so every rank hangs)",
    )
    p.add_argument(
        "--slow-from-step",
        type=int,
        default=0,
        help="the --slow-rank / --slow-host delay starts at this step (default: from the start)",
    )
    p.add_argument(
        "--live-callback",
        default=None,
        metavar="FILE",
        help="rank 0 registers hvtrace.on_straggler, which appends each verdict to FILE as JSON",
    )
    p.add_argument(
        "--metric-allreduce",
        action="store_true",
        help="after each step, average the loss across ranks with hvd.allreduce (name "
        "'metric.loss'), as a metric logger does",
    )
    p.add_argument(
        "--broadcast-object-at",
        type=int,
        default=None,
        metavar="STEP",
        help="after this step, rank 0 broadcasts a dict to every rank with hvd.broadcast_object",
    )
    p.add_argument(
        "--ab-every",
        type=int,
        default=0,
        metavar="N",
        help="benchmark: switch recording off and on every N steps (same step on every rank), "
        "so that one run times traced and untraced steps side by side; --step-times tells which",
    )
    p.add_argument(
        "--ab-toggle",
        choices=["hvtrace", "horovod-timeline"],
        default="hvtrace",
        help="what --ab-every switches: hvtrace's recording, or Horovod's own timeline (started "
        "by hvtrace with HVTRACE_HOROVOD_TIMELINE=1; hvtrace records throughout)",
    )
    p.add_argument(
        "--torch-profiler",
        default=None,
        metavar="DIR",
        help="run the training loop under torch.profiler (CPU activity) and export one Chrome "
        "trace per rank to DIR/rank{RANK}.json (for comparisons: combine with --no-trace)",
    )
    # consistency across ranks (issue 13): what the checks must catch
    p.add_argument(
        "--consistency-every",
        type=int,
        default=None,
        metavar="N",
        help="hvtrace: fingerprint the parameters every N steps (else $HVTRACE_CONSISTENCY_EVERY)",
    )
    p.add_argument(
        "--perturb-rank",
        type=int,
        default=None,
        help="this rank alone adds 1e-3 to one weight of --perturb-tensor before the forward of "
        "--perturb-step (weights changed on one rank only)",
    )
    p.add_argument("--perturb-step", type=int, default=7)
    p.add_argument("--perturb-tensor", default="net.2.weight", help="parameter name")
    p.add_argument(
        "--lr-skew-rank",
        type=int,
        default=None,
        help="this rank alone halves its learning rate before --lr-skew-step (a scheduler "
        "stepped on one rank only)",
    )
    p.add_argument("--lr-skew-step", type=int, default=12)
    p.add_argument(
        "--agree-skew-rank",
        type=int,
        default=None,
        help="record hvtrace.scalar('lr_scale', ..., agree=True) each step; from "
        "--agree-skew-step this rank records another value",
    )
    p.add_argument("--agree-skew-step", type=int, default=20)
    p.add_argument(
        "--no-broadcast",
        action="store_true",
        help="leave out hvd.broadcast_parameters and hvd.broadcast_optimizer_state (a bug)",
    )
    p.add_argument(
        "--rank-seed",
        action="store_true",
        help="initialize the model with seed + rank (different weights per rank before the "
        "broadcast)",
    )
    # set-up anti-patterns (issue 40): what the analysis must name, and what it must not
    p.add_argument(
        "--unsharded",
        action="store_true",
        help="every rank draws the same batches (one seed for all: the data is not sharded, as "
        "without a DistributedSampler); by default each rank draws its own",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        metavar="N",
        help="torch.set_num_threads(N) on every rank (default 0: the host's cores divided among "
        "its ranks, so that they never ask for more threads than it has cores)",
    )
    p.add_argument(
        "--manual-average",
        choices=["off", "blocking", "async"],
        default="off",
        help="no distributed optimizer: after each backward, average every gradient by hand "
        "with hvd.allreduce (blocking: one call per gradient; async: hvd.allreduce_async_ on "
        "each, then hvd.synchronize) and step a plain SGD. Traced as tracing by environment "
        "traces such a job (its plain optimizer, from the end of its first step): by "
        "HVTRACE_DIR, or --trace-dir (which applies the same patch here)",
    )
    p.add_argument(
        "--embedding",
        type=int,
        default=0,
        metavar="ROWS",
        help="an nn.Embedding of ROWS x 32 in front of the MLP (16 rows looked up per sample, "
        "picked from its values; default 0: none)",
    )
    p.add_argument(
        "--sparse-embedding",
        action="store_true",
        help="nn.Embedding(sparse=True): its gradient is a sparse tensor (Horovod allgathers "
        "its rows unless --sparse-as-dense)",
    )
    p.add_argument(
        "--sparse-as-dense",
        action="store_true",
        help="Horovod's sparse_as_dense=True: sparse gradients are allreduced dense",
    )
    return p.parse_args(argv)


def _average_by_hand(hvd: Any, named: list[tuple[str, nn.Parameter]], how: str) -> None:
    """Average the gradients across ranks by hand, after the backward (an anti-pattern: a
    distributed optimizer would overlap these allreduces with the backward)."""
    if how == "blocking":
        for name, p in named:
            p.grad = hvd.allreduce(p.grad, name=f"grad.{name}")
        return
    handles = [hvd.allreduce_async_(p.grad, name=f"grad.{name}") for name, p in named]
    for h in handles:
        hvd.synchronize(h)


def _log_verdicts_to(path: Path) -> None:
    """Register an hvtrace.on_straggler callback that appends each verdict to ``path``."""

    def write(verdict: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(verdict) + "\n")

    hvtrace.on_straggler(write)


def _toggle_horovod_timeline(hvd: Any, tracer: Any, on: bool, step: int) -> bool:
    """Benchmark only: stop Horovod's timeline, or start it again into a new file (rank 0 writes
    it; every rank keeps the same flag). Returns whether it is on now."""
    if hvd.rank() == 0:
        if on:
            hvd.stop_timeline()
        else:
            path = Path(tracer.rec.path).parent / f"horovod-timeline-ab-{step + 1}.json"
            hvd.start_timeline(str(path), mark_cycles=False)
    return not on


def _toggle_recording(tracer: Any) -> None:
    """Benchmark only: switch a healthy tracer's recording off, or back on (between steps)."""
    rec = tracer.rec
    if rec.writer is None:  # failed or closed: stays off
        return
    rec.enabled = not rec.enabled
    if rec.enabled:
        tracer.step_start = tracer.now()


def _profiler(out_dir: str | None) -> Any:
    """Return a ``torch.profiler.profile`` context (CPU activity) when ``out_dir`` is set."""
    if not out_dir:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd

    if args.pin_cores and hasattr(os, "sched_setaffinity"):
        # before hvd.init(): Horovod's background thread inherits the affinity
        cores = sorted(os.sched_getaffinity(0))
        local = int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
        os.sched_setaffinity(0, {cores[local % len(cores)]})
    hvd.init()
    rank = hvd.rank()
    if args.manual_average != "off" and args.trace_dir and not args.no_trace:
        # what the start-up hook does when HVTRACE_DIR is set: trace the plain optimizer
        from hvtrace.autotrace import patch_plain

        os.environ.setdefault("HVTRACE_DIR", args.trace_dir)
        patch_plain(hvd)
    torch.manual_seed(args.seed + (rank if args.rank_seed else 0))
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    wide = args.wide_layer
    core: nn.Module = CNN() if args.model == "cnn" else MLP(args.width, args.layers, wide=wide)
    if args.embedding:
        core = EmbeddingMLP(args.embedding, args.width, args.layers, sparse=args.sparse_embedding)
    on_slow_host = args.slow_host is not None and socket.gethostname() == args.slow_host
    slow = (rank == args.slow_rank or on_slow_host) and args.slow_ms > 0
    model: nn.Module = (
        SlowForward(core, args.slow_ms / 1e3, args.slow_kind)
        if slow and args.slow_phase == "forward"
        else core
    )
    if slow and args.slow_phase == "backward":
        slow_backward(core, args.slow_ms / 1e3, args.slow_kind)
    base = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    kwargs = dict(
        # the core's names: SlowForward would prefix 'inner.' on the slowed rank only, and
        # Horovod would wait forever for tensors whose names differ between ranks
        named_parameters=core.named_parameters(),
        backward_passes_per_step=args.bpps,
        compression=hvd.Compression.fp16 if args.fp16 else hvd.Compression.none,
    )
    if args.groups:
        kwargs["groups"] = args.groups
    if args.sparse_as_dense:
        kwargs["sparse_as_dense"] = True
    manual = args.manual_average != "off"
    if manual:  # no distributed optimizer: traced only by environment
        opt = base
    elif args.no_trace:
        opt = hvd.DistributedOptimizer(base, **kwargs)
    else:
        if args.consistency_every is not None:
            kwargs["consistency_every"] = args.consistency_every
        opt = hvtrace.DistributedOptimizer(
            base,
            trace_dir=args.trace_dir,
            model=None if args.no_model_hooks else model,
            **kwargs,
        )
    if not args.no_broadcast:
        hvd.broadcast_parameters(core.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    # each rank its own batches (sharded), unless --unsharded: the same seed on every rank
    gen = torch.Generator().manual_seed(args.seed * 1000 + (0 if args.unsharded else rank))
    w_true = torch.randn(256, 10, generator=torch.Generator().manual_seed(args.seed))
    loss_fn = nn.CrossEntropyLoss()
    step_times: list[float] = []
    traced: list[bool] = []
    tracer = getattr(opt, "_hvtrace", None)  # (None here for a plain one: traced from a step)
    if args.live_callback and rank == 0:
        _log_verdicts_to(Path(args.live_callback))
    # whether Horovod's timeline is being written (the same on every rank; rank 0 writes it)
    timeline_on = False
    if tracer is not None:  # (benchmarks run this file with a stand-in hvtrace: import here)
        from hvtrace.settings import horovod_timeline

        timeline_on = horovod_timeline() and (
            tracer.horovod_timeline is not None or hvd.rank() != 0
        )
    profiler_active = False
    with _profiler(args.torch_profiler) as prof:
        # Checked inside the loop's context: True only when torch's profiler is really recording.
        profiler_active = bool(torch.autograd._profiler_enabled())
        cpu0 = time.process_time()
        for i in range(args.steps):
            DELAYS["on"] = i >= args.slow_from_step
            on = tracer is not None and tracer.rec.enabled
            if args.ab_toggle == "horovod-timeline":
                on = timeline_on
            t0 = time.perf_counter()
            if rank == args.stop_rank and i == args.stop_step:
                os.kill(os.getpid(), signal.SIGSTOP)  # a rank that stops arriving (a hang)
            if rank == args.end_early_rank and i == args.stop_step:
                break  # a stop decided on this rank alone
            if rank == args.perturb_rank and i == args.perturb_step:
                with torch.no_grad():  # weights changed on this rank only
                    dict(core.named_parameters())[args.perturb_tensor].view(-1)[0] += 1e-3
            if rank == args.lr_skew_rank and i == args.lr_skew_step:
                for g in opt.param_groups:  # a scheduler stepped on this rank only
                    g["lr"] *= 0.5
            opt.zero_grad()
            for _ in range(args.bpps):
                with hvtrace.span("data"):
                    x = torch.randn(args.batch_size, 256, generator=gen)
                    y = (x @ w_true).argmax(dim=1)
                    if args.input_wait_ms > 0:
                        time.sleep(args.input_wait_ms / 1e3)
                    if slow and args.slow_phase == "input":
                        delay(args.slow_ms / 1e3, args.slow_kind)
                loss = loss_fn(model(x), y) / args.bpps
                if rank == args.skip_step_rank and i == args.stop_step:
                    break  # leaves the micro-batches; the step is skipped below
                if not (rank == args.skip_backward_rank and i == args.stop_step):
                    loss.backward()
            if rank == args.skip_step_rank and i == args.stop_step:
                continue  # no backward, no optimizer step on this rank
            if manual:
                _average_by_hand(hvd, list(core.named_parameters()), args.manual_average)
            if args.clip:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            if slow and args.slow_phase == "update":
                delay(args.slow_ms / 1e3, args.slow_kind)
            skip = rank == args.skip_allreduce_rank and i == args.stop_step
            if args.metric_allreduce and not skip:
                hvd.allreduce(loss.detach(), name="metric.loss")
            if args.broadcast_object_at == i:
                state = {"step": i, "lr": args.lr, "payload": list(range(1000))}
                got = hvd.broadcast_object(state if rank == 0 else None, 0, name="config")
                assert got["step"] == i
            if args.late_metric_rank is not None:
                late = int(rank == args.late_metric_rank)
                if i == args.stop_step + late:
                    late_metric = hvd.allreduce_async(loss.detach(), name="metric.late")
                if i == args.stop_step + 2:
                    hvd.synchronize(late_metric)
            if rank == args.lone_allreduce_rank and i == args.stop_step:
                hvd.allreduce(loss.detach(), name="metric.loss")  # the others never do
            hvtrace.scalar("loss", float(loss.detach()))
            if args.agree_skew_rank is not None:
                skew = rank == args.agree_skew_rank and i >= args.agree_skew_step
                hvtrace.scalar("lr_scale", 2.0 if skew else 1.0, agree=True)
            step_times.append(time.perf_counter() - t0)
            traced.append(on)
            if args.ab_every and tracer is not None and (i + 1) % args.ab_every == 0:
                if args.ab_toggle == "horovod-timeline":
                    timeline_on = _toggle_horovod_timeline(hvd, tracer, timeline_on, i)
                else:
                    _toggle_recording(tracer)
        if {args.end_early_rank, args.skip_backward_rank, args.skip_step_rank} != {None}:
            hvd.join()  # the uneven-data pattern: no rank waits forever for the others
        t_loop_end = time.perf_counter()
        loop_cpu_s = time.process_time() - cpu0
    if args.save_model and rank == 0:  # as a checkpoint or an EMA would, mid-run
        Path(args.save_model).parent.mkdir(parents=True, exist_ok=True)
        torch.save([model, copy.deepcopy(model)], args.save_model)
    tracer = getattr(opt, "_hvtrace", None)
    writer = tracer.rec.writer if tracer is not None else None
    writer_cpu_s = writer.cpu_s if writer is not None else None
    profiler_trace = None
    if prof is not None:
        Path(args.torch_profiler).mkdir(parents=True, exist_ok=True)
        profiler_trace = Path(args.torch_profiler) / f"rank{rank}.json"
        prof.export_chrome_trace(str(profiler_trace))
    if not args.no_finish:
        hvtrace.finish()
    finish_s = time.perf_counter() - t_loop_end
    if args.step_times:
        out = Path(args.step_times.replace("{rank}", str(rank)))
        out.parent.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"rank": rank, "step_s": step_times, "traced": traced}
        # Extra fields for benchmarks: the process's CPU time over the loop (all threads), the
        # time from the loop's end to the trace being on disk (profiler stop + export,
        # hvtrace.finish), and whether torch's profiler was recording.
        record["loop_cpu_s"] = loop_cpu_s
        record["writer_cpu_s"] = writer_cpu_s  # hvtrace's writer thread, over the loop
        record["finish_s"] = finish_s
        record["profiler_active"] = profiler_active
        if profiler_trace is not None:
            record["profiler_trace_bytes"] = profiler_trace.stat().st_size
        out.write_text(json.dumps(record))
    if args.save_params and rank == 0:
        Path(args.save_params).parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in core.state_dict().items()}, args.save_params)
    if rank == 0:
        med = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
        print(
            f"rank 0: {args.steps} steps, median step {med * 1e3:.1f} ms, final loss "
            f"{float(loss.detach()):.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
