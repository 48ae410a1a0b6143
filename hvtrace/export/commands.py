"""Sub-commands registered by later parts of hvtrace (analyze, dashboard).

Each registers its parser here and imports its heavy modules only when run, so ``hvtrace info``
never pays for Dash or the analysis.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the optional sub-commands to ``sub``."""
