"""An LR scheduler built on hvtrace's optimizer (the usual order: the optimizer, then its
scheduler) works as on Horovod's. torch's ``LRScheduler.__init__`` rebinds
``optimizer.step.__func__`` to the optimizer; hvtrace's step was once the compiled hook (a builtin:
no ``__func__``, AttributeError in the user's job) or, in Python, the tracer's own method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
import horovod.torch as hvd, torch
import hvtrace
hvd.init()
torch.manual_seed(0)
out = {}
for traced in (False, True):
    m = torch.nn.Linear(8, 2)
    base = torch.optim.SGD(m.parameters(), lr=0.1)
    if traced:
        opt = hvtrace.DistributedOptimizer(base, named_parameters=m.named_parameters(),
                                           trace_dir=sys.argv[1], model=m)
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    lrs = []
    for i in range(6):
        opt.zero_grad()
        m(torch.ones(4, 8)).sum().backward()
        opt.step()
        sched.step()
        plateau.step(1.0)
        lrs.append(opt.param_groups[0]["lr"])
    out["traced" if traced else "horovod"] = lrs
out["steps"] = int(opt._hvtrace.rec.step)
hvtrace.finish(sync_clock=False)
print(json.dumps(out))
"""


@pytest.mark.parametrize("native", ["1", "0"], ids=["compiled", "python"])
def test_lr_schedulers_on_the_traced_optimizer_work_as_on_horovods(tmp_path: Path, native) -> None:
    pytest.importorskip("horovod.torch")
    env = dict(os.environ, HVTRACE_NATIVE=native, PYTHONWARNINGS="ignore", HOROVOD_ELASTIC="1")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["traced"] == out["horovod"], out
    assert out["horovod"][-1] < 0.1  # the schedulers did act
    assert out["steps"] == 6, out  # and hvtrace recorded every step
    assert "tracing disabled" not in proc.stderr, proc.stderr[-2000:]
