"""Runtime-internal functions the Worker runs in its ranks (shipped by reference)."""

from __future__ import annotations

from phalanx.lifecycle import failpoints

from .run import Orchestrator
from .services import existing_rank_services

__all__ = ["arm_in_ranks", "close_services_here"]


def close_services_here() -> None:
    """Runs in a rank: close its rank services, if it made any."""
    registry = existing_rank_services()
    if registry is not None:
        registry.close_all()


def arm_in_ranks(o: Orchestrator, ranks: list[int], name: str | None, spec: str | None) -> None:
    for f in [o.control(r, arm_here, name, spec) for r in ranks]:
        f.result()


def arm_here(name: str | None, spec: str | None) -> None:
    if name is None:
        failpoints.disarm_all()
    else:
        failpoints.arm(name, spec or "raise")
