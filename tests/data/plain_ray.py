"""A Horovod job on Ray that knows nothing of hvtrace: ``horovod.ray.RayExecutor`` runs a training
function (``plain_train.train``) on a local Ray cluster this driver starts. Tests trace it by
environment alone: the Ray workers inherit the driver's environment (``$HVTRACE_DIR``) through
the local raylet.

``--slow-rank R --slow-ms MS`` makes rank R sleep MS in its forward each step.
"""

import ray
from horovod.ray import RayExecutor
from plain_train import driver_args, on_workers_path, train

args = driver_args()

on_workers_path()
ray.init(num_cpus=args.np, include_dashboard=False)
executor = RayExecutor(
    RayExecutor.create_settings(timeout_s=120), num_workers=args.np, use_gpu=False
)
executor.start()
losses = executor.run(train, args=[args.steps, args.slow_rank, args.slow_ms])
executor.shutdown()
ray.shutdown()
print("losses", losses)
