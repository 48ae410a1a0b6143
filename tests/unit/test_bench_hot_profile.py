"""bench/hot_profile.py's attribution of perf samples: each to the first frame from its leaf that
is hvtrace's compiled module, Python's evaluation loop or PyTorch's and Horovod's native code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HOT = "/v/lib/python3.11/site-packages/hvtrace/record/_hot.cpython-311-x86_64-linux-gnu.so"
PY = "/p/lib/libpython3.11.so.1.0"
TORCH = "/v/torch/lib/libtorch_cpu.so"
KERNEL = "[kernel.kallsyms]"


def _module():
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))  # (hot_profile imports wallclock beside it)
    spec = importlib.util.spec_from_file_location("hot_profile_bench", bench / "hot_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sample(*frames: tuple[str, str], at: float = 100.0) -> str:
    """One sample as ``perf script -F time,ip,sym,dso`` prints it, leaf first."""
    head = f" {at:.6f}: \n"
    return head + "\n".join(f"\t  {i:x} {sym} ({dso})" for i, (sym, dso) in enumerate(frames))


def test_each_sample_goes_to_the_first_attributable_frame_from_its_leaf() -> None:
    mod = _module()
    samples = [
        # a C-API call hvtrace's wrapper made: hvtrace's, its function's
        _sample(
            ("PyObject_GetAttr", PY), ("enqueue_vectorcall", HOT), ("_PyEval_EvalFrameDefault", PY)
        ),
        # hvtrace's own code
        _sample(("ph_span", HOT), ("Phases_step", HOT), ("_PyEval_EvalFrameDefault", PY)),
        # an interrupt while in hvtrace's code: still hvtrace's
        _sample(("finish_task_switch", KERNEL), ("__schedule", KERNEL), ("Phases_step", HOT)),
        # Horovod's Python function called by hvtrace's wrapper: Python, not hvtrace
        _sample(
            ("_Py_dict_lookup", PY),
            ("_PyEval_EvalFrameDefault", PY),
            ("handle_wait_vectorcall", HOT),
        ),
        # PyTorch's kernel called from a traced step: native
        _sample(("mkl_blas_def_sgemm_kernel_0_zen", TORCH), ("Phases_step", HOT)),
        # nothing known on the stack
        _sample(("memcpy", "/lib/libc.so.6"), at=102.5),
    ]
    n, per_fn, classes, span = mod.classify("\n\n".join(samples) + "\n")
    assert n == 6 and span == (100.0, 102.5)
    assert dict(per_fn) == {"enqueue_vectorcall": 1, "ph_span": 1, "Phases_step": 1}
    assert dict(classes) == {"hvtrace": 3, "python": 1, "native": 1, "other": 1}
