"""The ranks' gauges: what each rank holds now, asked of every rank at once.

:func:`rank_gauges` runs on a rank (both executors ship it: ``Executor.on_each_rank``);
:func:`gather_gauges` turns the answers into :class:`EngineGauges`. It reads counters
only: no ``check()`` of the store, no record digest (``ReplicatedCache.stats()`` does
both, which a scrape cadence of seconds must not pay on a recovered directory of
thousands of records). It never touches the engine's scheduler, so a server calls it
on a scrape's thread beside the engine thread.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.comm.rank_state import rank_comm
from phalanx.replication import rank_cache

from .heap import TRIMMER

__all__ = ["EngineGauges", "gather_gauges", "rank_gauges"]


def rank_gauges(cache_id: str | None) -> dict[str, Any]:
    """On a rank: its uncertain resources, the heap it gave back (``worker/heap.py``)
    and, with a disk tier, its store's counters; on rank 0 also each peer link's window
    (credits in flight, ops waiting)."""
    out: dict[str, Any] = {"uncertain": len(rank_comm().ledger.stats()["uncertain"]),
                           "heap_released": TRIMMER.released}
    if cache_id is None:
        return out
    rc = rank_cache(cache_id)
    s = rc.store.statistics()
    out.update(records=s.records, bytes=s.bytes, maintenance=s.maintenance_queued)
    if rc.rank == 0:
        links: dict[int, dict[str, int]] = {}
        for peer, link in rc.leader.links.items():
            # public counters, read without the link's lock: seqs are sent in order, so
            # ops sent and not acked are in flight, queued and not sent are waiting
            queued, sent, acked = link.queued_through(), link.sent, link.acked
            in_flight = max(0, sent - acked)
            links[peer] = {"window": link.window, "free": max(0, link.window - in_flight),
                           "pending": max(0, queued - sent)}
        out["links"] = links
    return out


@dataclass(frozen=True)
class EngineGauges:
    """What the ranks that answered hold (a rank that did not is missing from the
    per-rank figures, and its resources from the count)."""

    uncertain_resources: int
    rank_heap_released_bytes: dict[int, int] = field(default_factory=dict)
    disk: bool = False  # the figures below exist only with a disk tier
    cache_disk_records: dict[int, int] = field(default_factory=dict)
    cache_disk_bytes: dict[int, int] = field(default_factory=dict)
    # rank 0 decides every job and the peers apply what it sends: its queue is what the
    # tier still has to do; each rank's own count is exported beside it
    cache_maintenance_queue: int = 0
    cache_maintenance_queued: dict[int, int] = field(default_factory=dict)
    replication_link_window: dict[int, int] = field(default_factory=dict)
    replication_link_window_free: dict[int, int] = field(default_factory=dict)
    replication_link_pending: dict[int, int] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, Any]:
        """The figures under the names ``phalanx.serve.api.metrics`` exports."""
        if not self.disk:
            return {"uncertain_resources": self.uncertain_resources,
                    "rank_heap_released_bytes": self.rank_heap_released_bytes}
        return {k: v for k, v in asdict(self).items() if k != "disk"}


def gather_gauges(per_rank: dict[int, Any], parent_uncertain: int, disk: bool
                  ) -> EngineGauges:
    """The gauges of the ranks that answered (``per_rank``: each rank's
    :func:`rank_gauges`, or its error) and the parent's uncertain resources."""
    answered = {r: g for r, g in per_rank.items() if isinstance(g, dict)}
    uncertain = parent_uncertain + sum(int(g["uncertain"]) for g in answered.values())
    heap = {r: int(g["heap_released"]) for r, g in answered.items()}
    if not disk:
        return EngineGauges(uncertain, heap)
    links = answered.get(0, {}).get("links", {})
    return EngineGauges(
        uncertain, heap, disk=True,
        cache_disk_records={r: g["records"] for r, g in answered.items()},
        cache_disk_bytes={r: g["bytes"] for r, g in answered.items()},
        cache_maintenance_queue=answered.get(0, {}).get("maintenance", 0),
        cache_maintenance_queued={r: g["maintenance"] for r, g in answered.items()},
        replication_link_window={p: v["window"] for p, v in links.items()},
        replication_link_window_free={p: v["free"] for p, v in links.items()},
        replication_link_pending={p: v["pending"] for p, v in links.items()})
