"""The public surface is declared and pinned: a change here is an API change."""

from __future__ import annotations

import phalanx


def test_top_level_all() -> None:
    assert sorted(phalanx.__all__) == sorted([
        "Domain", "DomainView", "Orchestrator", "RunHandle", "TaskFuture", "Worker",
        "WorkerStats", "__version__", "current_rank",
    ])
    for name in phalanx.__all__:
        assert hasattr(phalanx, name)


def test_layers_import_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, phalanx, phalanx.lifecycle, phalanx.runtime; "
            "assert 'torch' not in sys.modules, 'torch imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
