"""A Horovod job on Ray that knows nothing of hvtrace: ``horovod.ray.RayExecutor`` runs a training
function on a local Ray cluster this driver starts. Tests trace it by environment alone: the Ray
workers inherit the driver's environment (``$HVTRACE_DIR``) through the local raylet.

``--slow-rank R --slow-ms MS`` makes rank R sleep MS in its forward each step.
"""

import argparse

import ray
from horovod.ray import RayExecutor

parser = argparse.ArgumentParser()
parser.add_argument("--np", type=int, default=2)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-ms", type=float, default=0.0)
args = parser.parse_args()


def train(steps: int, slow_rank: int, slow_ms: float) -> float:
    import time

    import horovod.torch as hvd
    import torch
    from torch import nn

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
    return float(loss)


ray.init(num_cpus=args.np, include_dashboard=False)
executor = RayExecutor(
    RayExecutor.create_settings(timeout_s=120), num_workers=args.np, use_gpu=False
)
executor.start()
losses = executor.run(train, args=[args.steps, args.slow_rank, args.slow_ms])
executor.shutdown()
ray.shutdown()
print("losses", losses)
