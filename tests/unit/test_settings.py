"""Every HVTRACE_* setting is parsed in one place: a bad value warns once and uses the default."""

from __future__ import annotations

import logging

import pytest

from hvtrace import settings


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(settings, "_warned", set())


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "-inf", "abc", "", "1e9", "0.001"])
def test_bad_flush_interval_warns_and_uses_the_default(monkeypatch, caplog, raw) -> None:
    monkeypatch.setenv("HVTRACE_FLUSH_S", raw)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert settings.flush_interval_s() == 1.0
        assert settings.flush_interval_s() == 1.0  # warned once, not on every call
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "HVTRACE_FLUSH_S" in msgs[0] and "using 1.0" in msgs[0]


@pytest.mark.parametrize("raw", ["0", "-5", "3.5", "nan", "many", str(1 << 30)])
def test_bad_buffer_bound_warns_and_uses_the_default(monkeypatch, caplog, raw) -> None:
    monkeypatch.setenv("HVTRACE_BUFFER_SPANS", raw)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert settings.buffer_spans() == 1 << 20
    assert any("HVTRACE_BUFFER_SPANS" in r.getMessage() for r in caplog.records)


def test_good_values_and_explicit_arguments(monkeypatch, caplog) -> None:
    monkeypatch.setenv("HVTRACE_FLUSH_S", "2")
    monkeypatch.setenv("HVTRACE_BUFFER_SPANS", "40")
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert settings.flush_interval_s() == 2.0
        assert settings.buffer_spans() == 40
        assert settings.flush_interval_s(0.1) == 0.1  # an argument wins over the environment
        assert not caplog.records
        assert settings.flush_interval_s(0) == 1.0  # and is checked the same way
    assert "HVTRACE_FLUSH_S=0" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("raw", "on"), [("0", False), ("off", False), ("No", False),
                                         ("1", True), ("yes", True), ("", True)])  # fmt: skip
def test_hvtrace_switch(monkeypatch, raw, on) -> None:
    monkeypatch.setenv("HVTRACE", raw)
    assert settings.tracing_enabled() is on


def test_unknown_switch_value_warns_and_keeps_recording(monkeypatch, caplog) -> None:
    monkeypatch.setenv("HVTRACE", "maybe")
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert settings.tracing_enabled() is True
    assert "HVTRACE='maybe'" in caplog.records[0].getMessage()


def test_trace_dir(monkeypatch) -> None:
    monkeypatch.setenv("HVTRACE_DIR", "  ")
    assert settings.trace_dir(None, "d") == "d"
    monkeypatch.setenv("HVTRACE_DIR", "runs/x")
    assert settings.trace_dir(None, "d") == "runs/x"
    assert settings.trace_dir("mine", "d") == "mine"


@pytest.mark.parametrize(
    ("raw", "ns", "warns"),
    [(None, 200_000, False), ("1000", 1_000_000, False), ("0", 0, False), ("2.5", 2_500, False),
     ("-1", 200_000, True), ("1e7", 200_000, True), ("nan", 200_000, True), ("x", 200_000, True)],
)  # fmt: skip
def test_poll_interval(monkeypatch, caplog, raw, ns, warns) -> None:
    if raw is not None:
        monkeypatch.setenv("HVTRACE_POLL_US", raw)
    with caplog.at_level(logging.WARNING, logger="hvtrace"):
        assert settings.poll_interval_ns() == ns
    assert any("HVTRACE_POLL_US" in r.getMessage() for r in caplog.records) == warns
