"""The header of a rank's trace file: who recorded it, where, with what (see docs/format.md)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from hvtrace import settings
from hvtrace.clock import ClockEstimate
from hvtrace.format.schema import FORMAT_NAME, FORMAT_VERSION
from hvtrace.record.timers import monotonic_ns


def build_header(
    hvd: Any,
    dist: Any,
    model: Any,
    run_id: str,
    clock: ClockEstimate,
    params: list,
    device: Any,
    timer: Any,
    counters: str,
    counters_derived_max_ns: int = 0,
    framework: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Return the header of this rank's file.

    ``params``: the gradient tensors' parameters; ``timer``: the span timer (host or CUDA);
    ``counters``: how CPU time and run-queue wait are read (:class:`ThreadCounters.mode`);
    ``counters_derived_max_ns``: :attr:`ThreadCounters.derived_max_ns`; ``framework``: the
    training framework that built the optimizer (``{"name": "pytorch_lightning", "version":
    "1.9.5"}`` from :mod:`hvtrace.lightning`), None for a plain Horovod script.
    """
    mono = monotonic_ns()
    wall = time.time_ns()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "run_id": run_id,
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "time_namespace": _time_namespace(),
        "pid": os.getpid(),
        "device": str(device),
        "cpu": cpu_info(),
        "cuda": cuda_info(device),
        "timing": "cuda_events" if timer.is_cuda else "host_monotonic",
        "cpu_counters": counters,
        "cpu_derived_max_ns": counters_derived_max_ns,
        "cpu_counters_gap_ns": settings.counters_gap_ns(),
        "torch_version": _version("torch"),
        "horovod_version": _version("horovod"),
        "hvtrace_version": _version("hvtrace"),
        "horovod_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")},
        "controller": _controller(hvd),
        "gpu_operations": _gpu_operations(hvd, device),
        "optimizer": optimizer_info(dist, params),
        "model": model_name(model),
        "framework": framework,
        "mono_anchor_ns": mono,
        "wall_anchor_ns": wall,
        "clock": {"method": "barrier-interval", "reference_rank": 0, "start": clock.to_dict()},
        "cuda_anchor_uncertainty_ns": getattr(timer, "anchor_uncertainty_ns", None),
    }


#: Parameters listed one by one in the header's ``optimizer.param_bytes``, at most.
MAX_PARAMS_LISTED = 10_000


def optimizer_info(dist: Any, params: list) -> dict[str, Any]:
    """The header's ``optimizer``: Horovod's options of ``dist`` and the gradients it holds.

    ``distributed``: False for a plain torch optimizer traced without Horovod's (a job that
    averages its gradients itself: :mod:`hvtrace.record.plain`; its Horovod options are then
    null); ``class``: the torch optimizer's class; ``tensors`` and ``grad_bytes``: the
    parameters that take gradients, their count and bytes; ``param_bytes``: each one's bytes, in
    the optimizer's order (the first :data:`MAX_PARAMS_LISTED`), which the analysis matches
    collectives against (:mod:`hvtrace.analysis.gradients`)."""
    distributed = bool(getattr(dist, "distributed", True))
    groups = getattr(dist, "_groups", None)
    compression = getattr(dist, "_compression", None)
    sizes = [int(p.numel() * p.element_size()) for p in params]
    return {
        "class": getattr(dist, "header_class", None) or type(dist).__mro__[1].__name__,
        "distributed": distributed,
        "backward_passes_per_step": getattr(dist, "backward_passes_per_step", 1),
        "compression": (
            getattr(compression, "__name__", None) or type(compression).__name__
            if distributed
            else None
        ),
        "op": str(getattr(dist, "op", None)) if distributed else None,
        "gradient_predivide_factor": getattr(dist, "gradient_predivide_factor", 1.0),
        "groups": groups if isinstance(groups, int | None) else f"list[{len(groups)}]",
        "sparse_as_dense": getattr(dist, "sparse_as_dense", False),
        "tensors": len(params),
        "grad_bytes": int(sum(sizes)),
        "param_bytes": sizes[:MAX_PARAMS_LISTED],
    }


def cpu_info() -> dict[str, Any]:
    """What this rank asks of its host's CPUs: ``cpu_count`` (the host's logical CPUs),
    ``affinity`` (the CPUs this process may run on, as a sorted list; None where the platform
    cannot say), ``torch_threads`` / ``torch_interop_threads`` (torch's intra-op and inter-op
    pools, as set when the optimizer was built) and ``omp_num_threads`` (the variable, if set)."""
    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "affinity": None}
    try:
        out["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        import torch

        out["torch_threads"] = int(torch.get_num_threads())
        out["torch_interop_threads"] = int(torch.get_num_interop_threads())
    except Exception:  # noqa: BLE001 - torch missing or odd: not known
        out["torch_threads"] = out["torch_interop_threads"] = None
    out["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    return out


def cuda_info(device: Any) -> dict[str, Any] | None:
    """The CUDA device this rank trains on (``device``: its parameters' device): ``index``,
    ``uuid``, ``pci_bus_id`` (``domain:bus:device``), ``name`` and ``visible`` (the devices this
    process sees); None when it trains on the CPU. Two ranks of one host with the same ``uuid``
    share one GPU."""
    if getattr(device, "type", None) != "cuda":
        return None
    out: dict[str, Any] = {"index": getattr(device, "index", None)}
    try:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        out.update(
            index=int(index),
            uuid=str(uuid) if uuid is not None else None,
            pci_bus_id=(
                f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:"
                f"{getattr(props, 'pci_device_id', 0):02x}"
                if getattr(props, "pci_bus_id", None) is not None
                else None
            ),
            name=str(props.name),
            visible=int(torch.cuda.device_count()),
        )
    except Exception:  # noqa: BLE001 - what could be read stays
        pass
    return out


def _controller(hvd: Any) -> str | None:
    """Return how Horovod's ranks talk to each other: ``"mpi"`` (launched by ``mpirun`` or
    ``horovodrun --mpi``), ``"gloo"`` (``horovodrun --gloo``, Ray, Spark), None if unknown."""
    for name in ("mpi", "gloo"):
        try:
            if getattr(hvd, f"{name}_enabled")():
                return name
        except Exception:  # noqa: BLE001 - an older Horovod, or a stand-in: not known
            continue
    return None


def _gpu_operations(hvd: Any, device: Any) -> str | None:
    """Return what carries Horovod's collectives of this rank's CUDA tensors: ``"nccl"`` where
    Horovod was built with NCCL (``HOROVOD_GPU_OPERATIONS=NCCL``), else ``"host"`` (copied to
    host memory and sent by the controller's library); None for a CPU rank or when not known."""
    if getattr(device, "type", None) != "cuda":
        return None
    try:
        return "nccl" if hvd.nccl_built() else "host"
    except Exception:  # noqa: BLE001 - an older Horovod, or a stand-in: not known
        return None


def _boot_id() -> str | None:
    """Return the kernel's boot id: ranks with equal boot ids share one CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _time_namespace() -> str | None:
    """Return this process's time namespace (``time:[4026531834]``): processes under one kernel
    share CLOCK_MONOTONIC only when they share it too (a time namespace offsets the clock)."""
    try:
        return os.readlink("/proc/self/ns/time")
    except OSError:
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def model_name(model: Any) -> str | None:
    """The model's class name for the header; None without a model, or when it is not known yet
    (a model found at its first forward, :class:`hvtrace.autotrace.ModelFinder`)."""
    if model is None:
        return None
    return getattr(model, "header_name", type(model).__name__)
