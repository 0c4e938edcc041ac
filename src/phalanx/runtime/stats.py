"""``Worker.stats()``: a snapshot of counters, one dataclass (every resource class has one).

``tasks_retained`` is what the live runs hold of their tasks (futures still running, or
failed with nobody having looked): bounded by what is outstanding, not by how many
tasks a run ever ran, so a run that serves for the process's life stays flat; issue 45
found one (the engine's, which then ran every step as tasks) keeping every future it
ever made.
"""

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
    tasks_retained: int
    uptime_s: float
    generation: str
    rendezvous: str
    sweep_failures: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
