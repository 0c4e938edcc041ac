"""The one way a test waits: on a condition, with a deadline that names what it waited
for (never a sleep that races the code)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

__all__ = ["ranks_under", "wait_for"]


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); fail naming
    ``what`` at the deadline."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def ranks_under(runtime_dir: Path) -> list[int]:
    """Pids of the rank processes still running with ``runtime_dir`` as their runtime
    directory (a killed parent's ranks, on their way out)."""
    out = []
    for p in psutil.process_iter():
        try:
            if ("phalanx.runtime.rank_main" in " ".join(p.cmdline())
                    and str(runtime_dir) in p.environ().get("PHALANX_RUNTIME_DIR", "")):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out
