"""HvtraceCallback hands live windows' per-step figures to the Trainer's loggers on rank 0.

The judge process's figures reach rank 0's listeners (``tests/unit/test_live_verdicts.py``, with
the real judge process); here the callback's half: it registers a listener on rank 0 with live
detection on and a logger, the listener's points are logged on the training thread at the next
batch end, at their steps, each once; a logger that fails stops the figures with one warning,
never training; and the listener goes when the fit ends.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("pytorch_lightning")

from hvtrace.lightning import HvtraceCallback
from hvtrace.record import live


class _Logger:
    def __init__(self, fail: bool = False) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.fail = fail

    def log_metrics(self, metrics: dict, step: int) -> None:
        if self.fail:
            raise OSError("disk full")
        self.rows.append((step, dict(metrics)))


def _callback(monkeypatch, logger: _Logger) -> tuple[HvtraceCallback, SimpleNamespace]:
    monkeypatch.setattr(live, "_figure_listeners", [])
    cb = HvtraceCallback()
    trainer = SimpleNamespace(loggers=[logger], is_global_zero=True)
    # what _start does once the tracer exists, with live detection on, on rank 0
    live.on_window_figures(cb._figures.extend)
    cb._undo.append(cb._undo_figures)
    return cb, trainer


def test_points_are_logged_at_their_steps_once(monkeypatch) -> None:
    logger = _Logger()
    cb, trainer = _callback(monkeypatch, logger)
    pts = [(0, {"hvtrace/step_ms": 10.0}), (1, {"hvtrace/step_ms": 11.0, "hvtrace/late_rank": 1})]
    for listener in live._figure_listeners:  # as the live thread calls them
        listener(pts)
    cb.on_train_batch_end(trainer, None)
    cb.on_train_batch_end(trainer, None)  # nothing new: nothing logged again
    assert logger.rows == pts
    cb._stop(sync_clock=False)
    assert live._figure_listeners == []  # gone with the fit


def test_a_failing_logger_stops_the_figures_not_training(monkeypatch, caplog) -> None:
    logger = _Logger(fail=True)
    cb, trainer = _callback(monkeypatch, logger)
    live._figure_listeners[0]([(5, {"hvtrace/step_ms": 3.0})])
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        cb.on_train_batch_end(trainer, None)  # does not raise
    assert "live figures not logged any more: OSError: disk full" in caplog.text
    assert live._figure_listeners == [] and not cb._figures
