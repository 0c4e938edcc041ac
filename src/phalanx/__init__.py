"""phalanx: a runtime for one-process-per-rank jobs on one or many hosts.

The public surface is declared in ``__all__`` and pinned by tests/test_public_api.py,
as is each layer's (``phalanx.runtime``, ``phalanx.comm``, ``phalanx.kvstore``, ...).
Every error phalanx raises is in :mod:`phalanx.errors`, which draws the whole tree;
every failpoint is in :mod:`phalanx.lifecycle.catalogue`, known once this package is
imported. The layers and who may import whom: docs/architecture.md "Layers", tests/test_layers.py.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING, Any

from phalanx.comm import Domain, DomainOrchestrator, DomainView, Worker
from phalanx.runtime import RunHandle, TaskFuture, WorkerStats, current_rank

if TYPE_CHECKING:
    from phalanx.engine import LLM, SamplingParams

# The engine's names load on first use (PEP 562): every rank process imports this package
# when it unpickles a task, and the engine's modules (with kvstore's) doubled the time
# `import phalanx` took (224 -> 510 ms), which every Worker start paid per rank.
_LAZY = {"LLM": "phalanx.engine", "SamplingParams": "phalanx.engine"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

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
