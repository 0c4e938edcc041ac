"""The benchmarks' own error: a benchmark whose measurement cannot be trusted stops."""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError

__all__ = ["BenchError"]


class BenchError(PhalanxError):
    """A benchmark found its measurement invalid (a side returned wrong bytes, a lane
    left work undone, a baseline's peer went away); the message says which and why."""
