"""The disk tier as the engine loop sees it: a :class:`KVConnector`.

The scheduler's half is :class:`~phalanx.engine.core.scheduler.PrefixTier` (lookups,
pins, what to stage, what was saved); the loop adds the step's half: the loads a plan
carries to the ranks, the loads the ranks could not do, draining the background stores
and closing. The implementation is ``engine/disk/``'s ``DiskTier`` (its package
docstring states the whole contract, both sides); the loop knows only this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .plan import StepPlan
from .scheduler import PrefixTier

__all__ = ["ConnectorStats", "KVConnector"]


@dataclass
class ConnectorStats:
    """The disk tier's counters since it opened."""

    lookups: int = 0          # asked rank 0
    lookups_skipped: int = 0  # answered 0 at once: the first wanted key is on no disk
    key_refreshes: int = 0
    pages_loaded: int = 0
    load_failures: int = 0
    stores: int = 0
    store_failures: int = 0
    stores_dropped: int = 0   # the queue was full
    maintenance_jobs: int = 0
    last_error: str | None = None


class KVConnector(PrefixTier, Protocol):
    """See the module docstring."""

    stats: ConnectorStats

    @property
    def cache_id(self) -> str:
        """The replicated cache's id on the ranks (their gauges read it by this)."""
        ...

    @property
    def pending(self) -> int:
        """Stores queued or running."""
        ...

    def loads(self, plan: StepPlan) -> object | None:
        """What the ranks read from the disk tier for ``plan`` (None: nothing)."""
        ...

    def load_failed(self, plan: StepPlan, failures: dict[int, str]) -> None:
        """``plan``'s loads failed on the ranks of ``failures`` (rank -> why): the step
        ran on no rank and its prefixes are recomputed."""
        ...

    def drain(self, timeout: float) -> bool:
        """Until every queued store ran (True), or ``timeout`` (False)."""
        ...

    def close(self, timeout: float, healthy: bool) -> None:
        """Finish the queued stores (bounded), stop, and close the cache it owns
        (``healthy``: the ranks are alive to close it with)."""
        ...
