"""hvtrace's start-up hook for a Python whose site-packages lack ``hvtrace-autotrace.pth``:
``hvtrace run`` puts this directory first on ``$PYTHONPATH`` there. It runs the hook
(:mod:`hvtrace_boot`), then the ``sitecustomize`` this one hides, if any, as Python would have."""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    import hvtrace_boot

    hvtrace_boot.install()
except Exception as exc:  # noqa: BLE001 - never take the process down
    sys.stderr.write(f"hvtrace: start-up hook failed ({type(exc).__name__}: {exc})\n")
_chain()
