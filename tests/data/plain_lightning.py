"""A Lightning job with ``Trainer(strategy="horovod")`` that knows nothing of hvtrace: tests trace
it by environment alone (``$HVTRACE_DIR``), which gives its Trainer hvtrace's callback."""

import argparse

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
data = TensorDataset(torch.randn(2048, 32), torch.randint(0, 4, (2048,)))
trainer = pl.Trainer(
    strategy="horovod",
    accelerator="cpu",
    max_steps=args.steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Model(), DataLoader(data, batch_size=16))
