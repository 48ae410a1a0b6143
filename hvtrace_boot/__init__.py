"""hvtrace's start-up hook: tracing an unmodified job from the environment alone.

``hvtrace-autotrace.pth``, installed beside the package, runs one line in every Python process
that starts in this environment. It reads three variables and, unless one asks for hvtrace,
imports nothing (this module is not even loaded)::

    HVTRACE_DIR=runs/exp1 horovodrun -np 4 python train.py     # train.py untouched

What asks: ``$HVTRACE_DIR`` (not blank), ``$HVTRACE`` on (1, true, on, yes) or
``$HVTRACE_HOROVOD_TIMELINE`` on; ``HVTRACE=0`` turns everything off, here as everywhere. When
asked, :func:`install`:

- sets ``HOROVOD_TIMELINE=DYNAMIC`` when ``$HVTRACE_HOROVOD_TIMELINE`` is on (and the user has no
  ``$HOROVOD_TIMELINE``), before anything can call ``hvd.init()``: Horovod reads it there, and
  only then lets hvtrace start its timeline later, whatever the script's import order;
- with tracing asked for (``$HVTRACE_DIR`` or ``$HVTRACE``), watches two imports and patches each
  right after it loads, before the importing line gets the module
  (:mod:`hvtrace.autotrace`): ``horovod.torch`` (its ``DistributedOptimizer`` builds
  Horovod's optimizer and traces it) and ``pytorch_lightning`` (a ``Trainer(strategy="horovod")``
  gets hvtrace's callback). Nothing of hvtrace is imported before one of them is.

The hook never raises: a failure here prints one warning line and leaves the process untraced.
This module imports only ``os`` and ``sys`` (loaded already by every interpreter).
"""

from __future__ import annotations

import os
import sys

#: The modules watched, and the function of hvtrace.autotrace that patches each.
TARGETS = {"horovod.torch": "patch_horovod_torch", "pytorch_lightning": "patch_lightning"}

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def _flag(name: str) -> bool | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _ON or value == "":
        return True
    if value in _OFF:
        return False
    return None  # hvtrace.settings warns about it, once, where it is read


def tracing_asked() -> bool:
    """Whether the environment asks for tracing by environment: ``$HVTRACE_DIR`` not blank or
    ``$HVTRACE`` on, and ``$HVTRACE`` not off."""
    flag = _flag("HVTRACE")
    if flag is False:
        return False
    return flag is True or bool(os.environ.get("HVTRACE_DIR", "").strip())


def timeline_asked() -> bool:
    """Whether ``$HVTRACE_HOROVOD_TIMELINE`` is on (and ``$HVTRACE`` not off)."""
    return _flag("HVTRACE") is not False and _flag("HVTRACE_HOROVOD_TIMELINE") is True


class _PostImport:
    """A ``sys.meta_path`` entry that finds nothing itself: for a watched module it asks the
    finders after it for the spec, and has the module's loader call the patch once the module
    has run (``exec_module``), so that ``import horovod.torch as hvd`` binds the patched module."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name not in TARGETS:
            return None
        try:
            spec = self._spec(name, path, target)
        except Exception as exc:  # noqa: BLE001 - the import goes on as without the hook
            _warn(f"cannot watch the import of {name} ({type(exc).__name__}: {exc})")
            return None
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: object) -> None:
            run_module(module)
            _patch(name, module)

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader that cannot be changed: left untraced
            _warn(f"cannot watch the import of {name}; not tracing it")
        return spec

    def _spec(self, name: str, path: object, target: object) -> object:
        """The spec the finders after this one give for ``name``."""
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


def _patch(name: str, module: object) -> None:
    try:
        from hvtrace import autotrace

        getattr(autotrace, TARGETS[name])(module)
    except Exception as exc:  # noqa: BLE001 - the hook never takes the job down
        _warn(f"could not patch {name} ({type(exc).__name__}: {exc}); not tracing it")


def _warn(msg: str) -> None:
    sys.stderr.write(f"hvtrace: {msg}\n")


def install() -> None:
    """Act on the environment (see the module doc). Idempotent; never raises."""
    try:
        if timeline_asked() and "HOROVOD_TIMELINE" not in os.environ:
            os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
        if not tracing_asked() or any(isinstance(f, _PostImport) for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _PostImport())
        for name in TARGETS:  # imported before this hook ran (a sitecustomize): patch it now
            if name in sys.modules:
                _patch(name, sys.modules[name])
    except Exception as exc:  # noqa: BLE001
        _warn(f"start-up hook failed ({type(exc).__name__}: {exc}); not tracing")
