"""``Worker.stats()``: a snapshot of counters, one dataclass (every resource class has one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerStats:
    ranks: int
    ranks_alive: int
    state: str
    poisoned: str | None
    runs_admitted: int
    runs_retired: int
    runs_failed: int
    runs_in_flight: int
    tasks_submitted: int
    tasks_succeeded: int
    tasks_failed: int
    uptime_s: float
    generation: str
    rendezvous: str
    sweep_failures: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
