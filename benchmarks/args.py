"""Argument types the benchmark scripts share, so a count that cannot run (0, -1) is said by
argparse in one line (exit 2) rather than found by a traceback halfway through a run."""

from __future__ import annotations

import argparse


def count(text: str) -> int:
    """A whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n
