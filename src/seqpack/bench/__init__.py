"""The ``seqpack bench`` harness: every method on the same inputs in one process, ratios in one run."""

from __future__ import annotations

import re


def plain_summary(docstring: str | None) -> str | None:
    """The first line of a suite's module docstring as plain text for ``--help`` (argparse
    prints a description verbatim): reStructuredText literals and roles unwrapped to their text."""
    if not docstring:  # python -OO strips docstrings
        return None
    return re.sub(r"(?::[\w:]+:)?`+([^`]+)`+", r"\1", docstring.strip().splitlines()[0])
