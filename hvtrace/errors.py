"""The errors hvtrace raises for bad input, in a module that imports nothing heavy.

A training rank imports :mod:`hvtrace` (and so this module) without pandas or DuckDB; the
readers and the analysis raise these, and the command line prints their one-line message.
"""

from __future__ import annotations


class TraceError(Exception):
    """A run or trace file that cannot be used; ``str()`` is a one-line message for the user."""


__all__ = ["TraceError"]
