"""A Horovod PyTorch job that knows nothing of hvtrace: the shape of Horovod's
``pytorch_synthetic_benchmark.py`` (fixed fake data, a conv net, ``hvd.DistributedOptimizer`` with
``named_parameters`` and a compression, parameters and optimizer state broadcast, ``timeit``
rounds), small enough for a CPU. Tests trace it by environment alone (``$HVTRACE_DIR``).

``--slow-rank R --slow-ms MS`` makes rank R sleep MS in its forward each step (a known straggler).
``--metric`` averages the loss across ranks every step with an unnamed ``hvd.allreduce``, as
metric code often does: Horovod names it after a per-process count of its operations, so a job
stays correct only while every rank issues the same operations in the same order.
"""

import argparse
import time
import timeit

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--num-warmup-batches", type=int, default=2)
parser.add_argument("--num-batches-per-iter", type=int, default=5)
parser.add_argument("--num-iters", type=int, default=4)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-ms", type=float, default=0.0)
parser.add_argument("--metric", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hvd.rank() == args.slow_rank:
            time.sleep(args.slow_ms / 1000)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.randint(0, 10, (args.batch_size,))
loss_fn = nn.CrossEntropyLoss()  # a module without parameters, called after the model


metrics: list[float] = []


def benchmark_step() -> None:
    optimizer.zero_grad()
    loss = loss_fn(model(data), target)
    loss.backward()
    optimizer.step()
    if args.metric:
        metrics.append(float(hvd.allreduce(loss.detach())))  # unnamed, as metric code often is


timeit.timeit(benchmark_step, number=args.num_warmup_batches)
for i in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    if hvd.rank() == 0:
        print(f"Iter #{i}: {args.batch_size * args.num_batches_per_iter / t:.1f} img/sec")
if args.metric:
    # every rank averaged the same values: the same sum on every rank, to the last bit
    total = hvd.allgather(torch.tensor([sum(metrics)], dtype=torch.float64), name="metric.check")
    print(f"rank {hvd.rank()}: metrics {len(metrics)} agree {bool((total == total[0]).all())}")
