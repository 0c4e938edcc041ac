"""The Worker with communication domains: what ``phalanx.Worker`` is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from phalanx import runtime
from phalanx.runtime import Orchestrator, WorkerStats

from .domain import Domain
from .manager import DomainManager
from .rank_ops import ledger_report
from .spec import DEFAULT_SCRATCH

__all__ = ["DomainOrchestrator", "Worker"]


class DomainOrchestrator(Orchestrator):
    """The ``o`` of a run: submits tasks, and allocates and releases domains."""

    @property
    def _domains(self) -> DomainManager:
        return cast("Worker", self.worker).domains

    def allocate_domain(self, name: str, ranks: Sequence[int], window_size: int = 0,
                        buffers: Sequence[tuple[str, int]] = (),
                        scratch_size: int = DEFAULT_SCRATCH) -> Domain:
        """Allocate a domain over ``ranks`` (their order defines ``domain_rank``).

        Each member gets a zeroed window of ``window_size`` bytes with ``buffers`` carved
        from it in order. The domain is released when this run retires, at the latest.
        """
        return self._domains.allocate(self, name, ranks, window_size, buffers, scratch_size)

    def release_domain(self, domain: Domain) -> None:
        """Revoke ``domain`` now; its memory is freed when this run's fence retires."""
        self._domains.release_logical(domain)


class Worker(runtime.Worker):
    """A :class:`phalanx.runtime.Worker` whose runs can allocate communication domains.

    ``domain_timeout`` bounds every handshake of an allocation or release.
    """

    orchestrator_class = DomainOrchestrator

    def __init__(self, ranks: int, *, domain_timeout: float = 30.0, **kwargs: Any) -> None:
        super().__init__(ranks, **kwargs)
        self.domains = DomainManager(self, domain_timeout)
        # Runs LIFO before "stop rank processes": domains and the base communicator are
        # released while the rank control channels still work.
        self.add_close_step("release domains and the base communicator", self.domains.close)

    def release_domain(self, domain: Domain) -> None:
        """Release ``domain`` from outside a run: revoke it, or replay the outcome of its
        release (a failed release re-raises the same error; it never runs twice)."""
        self.domains.release_logical(domain)

    @property
    def live_domains(self) -> list[Domain]:
        return self.domains.live()

    def stats(self) -> WorkerStats:
        base = super().stats()
        ledger = self.domains.ledger.stats()
        base.extra.update(live_domains=len(self.domains.live()), parent_resources=ledger)
        return base

    def resources(self) -> dict[str, Any]:
        """Every ledger: the parent's and each live rank's (stats and event logs)."""
        ranks = self.call_ranks(self.alive_ranks(), ledger_report, timeout=30)
        return {"parent": self.domains.ledger.stats(),
                "ranks": {r: (o.value if o.ok else repr(o.error)) for r, o in ranks.items()}}
