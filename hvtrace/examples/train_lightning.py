"""A small LightningModule trained with ``Trainer(strategy="horovod")``, traced by hvtrace.

Run it under Horovod (needs ``pip install 'hvtrace[lightning]'``), for example::

    horovodrun -np 2 -H localhost:2 --gloo python -m hvtrace.examples.train_lightning \\
        --trace-dir runs/lightning

The model is :class:`hvtrace.examples.train.MLP` on synthetic data, on the CPU. Everything is
deterministic for a given ``--seed`` (``seed_everything``, ``Trainer(deterministic=True)``, a fixed
data set sharded by Lightning's ``DistributedSampler``), so a traced run and an untraced one
(``--no-trace``: no callback) end with identical parameters (``--save-params``). ``--slow-rank``
with ``--slow-ms`` and ``--slow-phase`` injects a known straggler: it sleeps in the data loader's
collate function (``input``), in the module's ``forward`` (``forward``), or in a gradient hook of
the first layer (``backward``). ``--val-every``, ``--ckpt-dir`` and ``--log-dir`` turn on
validation, checkpointing and a CSV logger, so that their spans show.

``val_loss`` is averaged across ranks with ``hvd.allreduce(..., op=hvd.Average)`` in
``on_validation_epoch_end`` and logged there, so that ``ModelCheckpoint``, ``EarlyStopping`` and a
plateau scheduler read the job's value: under ``strategy="horovod"`` pytorch-lightning 1.9's
``self.log(..., sync_dist=True)`` averages nothing (it reduces only when ``torch.distributed`` is
initialized, which Horovod does not do). ``--val-unsynced`` logs each rank's own instead.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from hvtrace.examples.train import MLP, slow_backward

IN_DIM = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (max_steps, default 40)")
    p.add_argument(
        "--epochs", type=int, default=1, help="epochs the data set holds steps for (default 1)"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01, help="per-rank lr (Horovod scales it)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trace-dir", default=None, help="hvtrace trace directory (else $HVTRACE_DIR)")
    p.add_argument("--no-trace", action="store_true", help="train without HvtraceCallback")
    p.add_argument("--slow-rank", type=int, default=-1, help="rank to slow down")
    p.add_argument("--slow-ms", type=float, default=0.0, help="delay added on --slow-rank")
    p.add_argument("--slow-phase", choices=["input", "forward", "backward"], default="forward")
    p.add_argument(
        "--val-every", type=int, default=0, help="validate every N steps (0: no validation)"
    )
    p.add_argument("--ckpt-dir", default=None, help="save a checkpoint at each validation here")
    p.add_argument(
        "--early-stopping",
        action="store_true",
        help="EarlyStopping on val_loss (never stopping these runs), and with --ckpt-dir a "
        "ModelCheckpoint keeping the best by val_loss",
    )
    p.add_argument(
        "--stop-rank0-at",
        type=int,
        default=None,
        metavar="STEP",
        help="a callback sets trainer.should_stop on rank 0 alone at this global step (a stop "
        "decided on one rank's view: the other ranks train on)",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="N",
        help="Trainer(accumulate_grad_batches=N) (Lightning passes it to Horovod as "
        "backward_passes_per_step)",
    )
    p.add_argument(
        "--count-updates",
        action="store_true",
        help="count the optimizer's updates during training and print them per rank",
    )
    p.add_argument(
        "--patience",
        type=int,
        default=None,
        metavar="P",
        help="with --early-stopping: EarlyStopping(patience=P) (default: never stop these runs)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=1,
        metavar="K",
        help="with --early-stopping and --ckpt-dir: ModelCheckpoint(save_top_k=K) (default 1)",
    )
    p.add_argument(
        "--val-drift-rank",
        type=int,
        default=-1,
        metavar="RANK",
        help="this rank adds 0.1 per validation so far to its own validation loss, the other "
        "ranks subtract 0.1 (before any averaging): its own val_loss gets worse at every "
        "validation while the others' improve",
    )
    p.add_argument(
        "--skip-step-rank",
        type=int,
        default=-1,
        metavar="RANK",
        help="this rank's training_step returns None at --skip-at (a 'bad loss' guard on one "
        "rank: Lightning skips that batch's backward and update there alone)",
    )
    p.add_argument(
        "--skip-at",
        type=int,
        default=12,
        metavar="BATCH",
        help="with --skip-step-rank: the batch index (in each epoch)",
    )
    p.add_argument("--log-dir", default=None, help="CSV logger here (log every 5 steps)")
    p.add_argument("--save-params", default=None, help="rank 0 saves final parameters here")
    p.add_argument(
        "--consistency-every",
        type=int,
        default=None,
        metavar="N",
        help="HvtraceCallback(consistency_every=N): fingerprint the parameters every N steps",
    )
    p.add_argument(
        "--plateau",
        action="store_true",
        help="a ReduceLROnPlateau scheduler (patience 0, factor 0.25) monitoring val_loss",
    )
    p.add_argument(
        "--val-unsynced",
        action="store_true",
        help="log each rank's own val_loss (on its own validation shard), not the average",
    )
    return p.parse_args(argv)


def _stop_on_rank0(step: int) -> Any:
    """A callback that stops the fit on this rank at ``step`` (given to rank 0's Trainer only)."""
    import pytorch_lightning as pl

    class StopOnRank0(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.global_step >= step:
                trainer.should_stop = True

    return StopOnRank0()


def _update_counter_class() -> type:
    import pytorch_lightning as pl
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    class UpdateCounter(pl.Callback):
        """Counts the optimizer's updates during training, hvtrace or not: the outermost
        ``step()`` calls (Horovod's step calls the base optimizer's, and both run torch's global
        optimizer hooks), from ``on_train_start`` on (not Horovod's initial step in
        ``broadcast_optimizer_state``)."""

        def __init__(self) -> None:
            self.updates, self._depth, self._on = 0, 0, False
            register_optimizer_step_pre_hook(self._before)
            register_optimizer_step_post_hook(self._after)

        def _before(self, *_: Any) -> None:
            self._depth += 1

        def _after(self, *_: Any) -> None:
            self._depth -= 1
            if self._depth == 0 and self._on:
                self.updates += 1

        def on_train_start(self, *_: Any) -> None:
            self._on = True

    return UpdateCounter


def _update_counter() -> Any:
    return _update_counter_class()()


def _module_class() -> type:
    import pytorch_lightning as pl

    class LitMLP(pl.LightningModule):
        """:class:`MLP` with a cross-entropy loss, SGD with momentum, and logged losses: the
        validation loss averaged across ranks (``val_sync``), or each rank's own."""

        def __init__(
            self,
            width: int,
            layers: int,
            lr: float,
            slow_forward_s: float,
            plateau: bool = False,
            val_sync: bool = True,
            val_drift: float = 0.0,
            skip_at: int = -1,
        ) -> None:
            super().__init__()
            self.skip_at = skip_at
            self.val_drift = val_drift
            self._validations = 0
            self.plateau = plateau
            self.val_sync = val_sync
            self.net = MLP(width, layers, IN_DIM)
            self.lr = lr
            self.slow_forward_s = slow_forward_s
            self._val_losses: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.slow_forward_s and torch.is_grad_enabled():
                time.sleep(self.slow_forward_s)
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            if batch_idx == self.skip_at:
                return None  # Lightning skips this batch's backward and optimizer step
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss)
            return loss

        def on_validation_epoch_start(self) -> None:
            if not self.trainer.sanity_checking:
                self._validations += 1

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            loss = F.cross_entropy(self(x), y) + self.val_drift * self._validations
            if self.val_sync:
                self._val_losses.append(loss.detach())
            else:  # each rank's own mean over its own validation shard
                self.log("val_loss", loss)

        def on_validation_epoch_end(self) -> None:
            """Log the validation loss averaged across ranks (every rank calls this): under
            strategy="horovod", ``self.log(..., sync_dist=True)`` would average nothing."""
            if not (self.val_sync and self._val_losses):
                return
            import horovod.torch as hvd

            mean = torch.stack(self._val_losses).mean()
            self._val_losses.clear()
            self.log("val_loss", hvd.allreduce(mean, op=hvd.Average, name="val_loss"))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
            if not self.plateau:
                return opt
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.25)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    return LitMLP


def _data(n: int, seed: int) -> TensorDataset:
    """``n`` synthetic samples: Gaussian inputs, labels from a fixed random linear map."""
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(IN_DIM, 10, generator=gen)
    x = torch.randn(n, IN_DIM, generator=gen)
    return TensorDataset(x, (x @ w_true).argmax(dim=1))


def _slow_collate(delay_s: float) -> Any:
    from torch.utils.data import default_collate

    def collate(samples: list) -> Any:
        time.sleep(delay_s)
        return default_collate(samples)

    return collate


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd
    import pytorch_lightning as pl

    warnings.filterwarnings("ignore", ".*(deprecated|does not have many workers|pkg_resources).*")
    hvd.init()  # Lightning's Horovod strategy needs it; done here to know the rank up front
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    pl.seed_everything(args.seed, workers=True)

    slow_s = args.slow_ms / 1e3 if rank == args.slow_rank and args.slow_ms > 0 else 0.0
    model = _module_class()(
        args.width,
        args.layers,
        args.lr,
        slow_s if args.slow_phase == "forward" else 0.0,
        plateau=args.plateau,
        val_sync=not args.val_unsynced,
        val_drift=(0.1 if rank == args.val_drift_rank else -0.1)
        if args.val_drift_rank >= 0
        else 0.0,
        skip_at=args.skip_at if rank == args.skip_step_rank else -1,
    )
    if slow_s and args.slow_phase == "backward":
        slow_backward(model.net, slow_s)
    per_epoch = -(-args.steps // max(1, args.epochs))  # ceil
    train = _data(per_epoch * args.batch_size * size, args.seed)
    collate = _slow_collate(slow_s) if slow_s and args.slow_phase == "input" else None
    loaders: dict[str, Any] = {
        "train_dataloaders": DataLoader(train, batch_size=args.batch_size, collate_fn=collate)
    }
    if args.val_every:
        val = _data(4 * args.batch_size * size, args.seed + 1)
        loaders["val_dataloaders"] = DataLoader(val, batch_size=args.batch_size)

    from hvtrace.lightning import HvtraceCallback  # (also lets numpy 2 run ModelCheckpoint)

    callbacks: list[Any] = []
    if not args.no_trace:
        callbacks.append(
            HvtraceCallback(trace_dir=args.trace_dir, consistency_every=args.consistency_every)
        )
    if args.ckpt_dir:
        from pytorch_lightning.callbacks import ModelCheckpoint

        if args.early_stopping:  # the best by val_loss, as such jobs keep it
            callbacks.append(
                ModelCheckpoint(dirpath=args.ckpt_dir, monitor="val_loss", save_top_k=args.top_k)
            )
        else:
            callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1))
    if args.stop_rank0_at is not None and rank == 0:
        callbacks.append(_stop_on_rank0(args.stop_rank0_at))
    if args.early_stopping:
        from pytorch_lightning.callbacks import EarlyStopping

        # by default patient enough never to stop these short runs: its checks are exercised
        patience = 1000 if args.patience is None else args.patience
        callbacks.append(EarlyStopping(monitor="val_loss", patience=patience))
    logger: Any = False
    if args.log_dir:
        from pytorch_lightning.loggers import CSVLogger

        logger = CSVLogger(args.log_dir)
    counter = _update_counter() if args.count_updates else None
    if counter is not None:
        callbacks.append(counter)
    trainer = pl.Trainer(
        strategy="horovod",
        accelerator="cpu",
        max_steps=args.steps,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=args.val_every or None,
        limit_val_batches=2 if args.val_every else 0,
        num_sanity_val_steps=1 if args.val_every else 0,
    )
    trainer.fit(model, **loaders)

    if args.save_params and rank == 0:
        Path(args.save_params).parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().clone() for k, v in model.net.state_dict().items()}
        torch.save(state, args.save_params)
    if rank == 0:
        loss = trainer.callback_metrics.get("train_loss")
        loss_s = f"{float(loss):.4f}" if loss is not None else "n/a"
        print(f"rank 0: {trainer.global_step} steps, final loss {loss_s}", flush=True)
    ckpt = trainer.checkpoint_callback
    if args.early_stopping and ckpt is not None and getattr(ckpt, "monitor", None):
        print(f"rank {rank}: best checkpoint {Path(ckpt.best_model_path).name}", flush=True)
    if counter is not None:
        print(f"rank {rank}: {counter.updates} optimizer updates", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
