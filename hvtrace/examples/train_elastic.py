"""Elastic Horovod training traced by hvtrace: the demo's MLP under ``hvd.elastic.run``.

Run it with a host discovery script (elastic mode), for example::

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover.sh \\
        --network-interface lo python -m hvtrace.examples.train_elastic --trace-dir runs/elastic

where ``discover.sh`` prints one ``host:slots`` line per host (``localhost:1`` and
``127.0.0.1:1`` make two hosts of one machine: Horovod blocklists the whole host of a failed
worker, so a second host name lets the job go on). The state (model, optimizer, step) is a
``hvd.elastic.TorchState`` committed every ``--commit-every`` steps; a reset callback scales the
learning rate with the new size, as Horovod's examples do. The optimizer is
``hvtrace.DistributedOptimizer``, created once, outside the elastic function.

To exercise the membership changes:

- ``--die-rank R --die-step S``: the worker that has rank R in the first membership kills itself
  with SIGKILL when it reaches step S (a worker lost mid-run; the others go on from the last
  commit);
- ``--marker-step S --marker PATH``: rank 0 creates PATH at step S (a discovery script that
  prints a second host once PATH exists makes a worker join);
- ``--step-sleep-ms MS``: every step sleeps that long (so that a join has time to happen).

Each rank prints ``rank R (worker W): done N steps, size Z`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import hvtrace
from hvtrace.examples.train import MLP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's options (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in all (default 60)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    p.add_argument("--trace-dir", default=None, help="hvtrace trace directory (else $HVTRACE_DIR)")
    p.add_argument("--die-rank", type=int, default=-1, help="rank (first membership) to kill")
    p.add_argument("--die-step", type=int, default=-1, help="step at which it kills itself")
    p.add_argument("--marker", default=None, help="file rank 0 creates at --marker-step")
    p.add_argument("--marker-step", type=int, default=-1)
    p.add_argument("--step-sleep-ms", type=float, default=0.0, help="sleep in every step")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Train under ``hvd.elastic.run``, traced; return 0."""
    args = parse_args(argv)
    import horovod.torch as hvd

    hvd.init()
    first_size = hvd.size()
    first_rank = hvd.rank()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = MLP(args.width, args.layers)
    base = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    opt = hvtrace.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), trace_dir=args.trace_dir, model=model
    )
    w_true = torch.randn(256, 10, generator=torch.Generator().manual_seed(args.seed))
    loss_fn = nn.CrossEntropyLoss()
    state = hvd.elastic.TorchState(model, opt, batch=0)

    def on_reset() -> None:
        for group in opt.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.batch < args.steps:
            i = state.batch
            if first_rank == args.die_rank and hvd.size() == first_size and i == args.die_step:
                os.kill(os.getpid(), signal.SIGKILL)  # a worker lost mid-run
            if args.marker and hvd.rank() == 0 and i == args.marker_step:
                Path(args.marker).touch()  # the discovery script now adds a host
            gen = torch.Generator().manual_seed(args.seed * 100_003 + i * 1009 + hvd.rank())
            x = torch.randn(args.batch_size, 256, generator=gen)
            y = (x @ w_true).argmax(dim=1)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            hvtrace.scalar("loss", loss.item())
            if args.step_sleep_ms > 0:
                time.sleep(args.step_sleep_ms / 1e3)
            state.batch = i + 1
            if state.batch % args.commit_every == 0:
                state.commit()

    train(state)
    hvtrace.finish()
    tracer = getattr(opt, "_hvtrace", None)
    worker = tracer.worker if tracer is not None else -1
    print(f"rank {hvd.rank()} (worker {worker}): done {state.batch} steps, size {hvd.size()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
