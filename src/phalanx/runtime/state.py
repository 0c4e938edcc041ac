"""The Worker's lifecycle states (one enum, read by the modules that serve the Worker)."""

from __future__ import annotations

import enum

__all__ = ["WorkerState"]


class WorkerState(enum.Enum):
    STARTING = "starting"  # ranks are being started; no runs yet
    RUNNING = "running"  # admitting runs (unless poisoned)
    CLOSING = "closing"  # close() began: no new runs; in-flight runs drain
    CLOSED = "closed"  # close() finished and owes nothing
