"""phalanx: a runtime for one-process-per-rank jobs on one or many hosts.

The public surface is declared in ``__all__`` and pinned by tests/test_public_api.py.
"""

from __future__ import annotations

__version__ = "0.1.0"

from phalanx.runtime import (
    Orchestrator,
    RunHandle,
    TaskFuture,
    Worker,
    WorkerStats,
    current_rank,
)

__all__ = [
    "Orchestrator",
    "RunHandle",
    "TaskFuture",
    "Worker",
    "WorkerStats",
    "__version__",
    "current_rank",
]
