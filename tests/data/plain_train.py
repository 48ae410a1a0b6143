"""The training function of the Ray and Spark jobs (``plain_ray.py``, ``plain_spark.py``): plain
Horovod, no hvtrace. The launchers pickle it by reference, so their workers import this module:
each driver puts this directory on the workers' ``PYTHONPATH``.

``slow_rank`` sleeps ``slow_ms`` in its forward each step (a known straggler).
"""

import argparse
import os
import time

import horovod.torch as hvd
import torch
from torch import nn

#: The directory to put on the workers' PYTHONPATH.
HERE = os.path.dirname(os.path.abspath(__file__))


def driver_args() -> argparse.Namespace:
    """The drivers' options: ``--np``, ``--steps``, ``--slow-rank``, ``--slow-ms``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-ms", type=float, default=0.0)
    return parser.parse_args()


def on_workers_path() -> None:
    """Put this directory first on ``$PYTHONPATH``, which the launcher's workers inherit."""
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, old) if p)


def train(steps: int, slow_rank: int, slow_ms: float) -> float:
    """Train a small MLP for ``steps`` steps with Horovod's optimizer; return the last loss."""
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if hvd.rank() == slow_rank:
                time.sleep(slow_ms / 1000)
            return self.body(x)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = torch.tensor(0.0)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss.detach())
