"""phalanx: a runtime for one-process-per-rank jobs on one or many hosts.

The public surface is declared in ``__all__`` and pinned by tests/test_public_api.py,
as is each layer's (``phalanx.runtime``, ``phalanx.comm``, ``phalanx.kvstore``, ...).
Every error phalanx raises is in :mod:`phalanx.errors`, which draws the whole tree;
every failpoint is in :mod:`phalanx.lifecycle.catalogue`, known once this package is
imported. The layers and who may import whom: DESIGN.md "Layers", tests/test_layers.py.
"""

from __future__ import annotations

__version__ = "0.1.0"

from phalanx.comm import Domain, DomainOrchestrator, DomainView, Worker
from phalanx.engine import LLM, SamplingParams  # torch is imported only when a model runs
from phalanx.runtime import RunHandle, TaskFuture, WorkerStats, current_rank

#: The ``o`` an orch function receives (tasks and domains).
Orchestrator = DomainOrchestrator

__all__ = [
    "LLM",
    "Domain",
    "DomainView",
    "Orchestrator",
    "RunHandle",
    "SamplingParams",
    "TaskFuture",
    "Worker",
    "WorkerStats",
    "__version__",
    "current_rank",
]
