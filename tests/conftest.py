"""Shared pytest setup.

- ``tests/`` is put on ``sys.path`` so test modules can ``import helpers``.
- Tests marked ``horovod`` are skipped, with the reason, when real Horovod runs are impossible
  (no ``horovodrun`` or no ``horovod.torch``); they never fall back to a fake Horovod.
- Tests marked ``gpu`` are skipped without a CUDA device.
- After every test the process-wide active recorder is reset, so one test's recorder never
  records another test's spans.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from helpers import horovod_unavailable_reason  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    horovod_items = [it for it in items if it.get_closest_marker("horovod")]
    if horovod_items:
        reason = horovod_unavailable_reason()
        if reason:
            for it in horovod_items:
                it.add_marker(pytest.mark.skip(reason=f"needs real Horovod: {reason}"))
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if gpu_items:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            for it in gpu_items:
                it.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none available)"))


@pytest.fixture(autouse=True)
def _reset_active_recorder():
    """Leave no active hvtrace recorder behind a test."""
    yield
    mod = sys.modules.get("hvtrace.record.recorder")
    if mod is not None and mod.active_recorder() is not None:
        rec = mod.active_recorder()
        mod._set_active(None)
        try:
            rec.close()
        except Exception:  # noqa: BLE001 - cleanup only
            pass
