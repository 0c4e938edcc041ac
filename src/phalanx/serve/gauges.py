"""The ranks' gauges for ``/metrics``: disk tier records, bytes and maintenance queue per
rank, rank 0's replication link windows, uncertain resources (parent and ranks).

One run of the engine's Worker asks every rank at once (the rank side is a module-level
function, shipped by reference). It reads counters only: no ``check()`` of the store,
no record digest (``ReplicatedCache.stats()`` does both, which a 2 s scrape cadence must
not pay on a recovered directory of thousands of records). It never touches the engine's
scheduler, so it runs on the scrape's thread beside the engine thread, as the disk
tier's own store thread runs its cache calls.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_gauges", "worker_gauges"]

_SETTLE_S = 5.0  # a run whose tasks all have deadlines settles this soon after them


def rank_gauges(cache_id: str | None) -> dict[str, Any]:
    """On a rank: its uncertain resources and, with a disk tier, its store's counters;
    on rank 0 also each peer link's window (credits in flight, ops waiting)."""
    from phalanx.comm.rank_state import rank_comm

    out: dict[str, Any] = {"uncertain": len(rank_comm().ledger.stats()["uncertain"])}
    if cache_id is None:
        return out
    from phalanx.replication import rank_cache

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


def _each_rank(o: Any, cache_id: str | None, timeout: float, out: dict[int, Any]) -> None:
    futs = {r: o.options(timeout=timeout).submit(r, rank_gauges, cache_id) for r in o.ranks}
    for r, f in futs.items():
        exc = f.exception()  # a rank that does not answer is left out, the rest reported
        out[r] = f.result() if exc is None else exc


def _each_host_rank(worker: Any, cache_id: str | None, timeout: float) -> dict[int, Any]:
    futs = {r: worker.submit(r, rank_gauges, cache_id, timeout=timeout) for r in worker.ranks}
    out: dict[int, Any] = {}
    for r, f in futs.items():
        try:
            out[r] = f.result(timeout=timeout + _SETTLE_S)
        except Exception as exc:  # noqa: BLE001  left out, the rest reported
            out[r] = exc
    return out


def worker_gauges(worker: Any, cache_id: str | None, timeout: float = 10.0) -> dict[str, Any]:
    """The gauges of every rank of ``worker`` plus the parent's uncertain resources, in
    the names :mod:`phalanx.serve.api.metrics` exports. A rank that did not answer within
    ``timeout`` is missing from the per-rank gauges (and its resources from the count)."""
    from phalanx.hosts import MultiHostWorker

    per_rank: dict[int, Any] = {}
    if isinstance(worker, MultiHostWorker):
        # ranks on several hosts: one typed call per rank (no runs across hosts); node
        # 0's own parent ledger is its host Worker's
        per_rank = _each_host_rank(worker, cache_id, timeout)
        parent_stats = worker.local.worker.stats() if worker.local is not None else None
    else:
        handle = worker.submit(_each_rank, cache_id, timeout, per_rank)
        handle.wait(timeout + _SETTLE_S)
        parent_stats = worker.stats()
    answered = {r: g for r, g in per_rank.items() if isinstance(g, dict)}
    parent = (parent_stats.extra.get("parent_resources", {}).get("uncertain", [])
              if parent_stats is not None else [])
    out: dict[str, Any] = {
        "uncertain_resources": len(parent) + sum(g["uncertain"] for g in answered.values()),
    }
    if cache_id is not None:
        out["cache_disk_records"] = {r: g["records"] for r, g in answered.items()}
        out["cache_disk_bytes"] = {r: g["bytes"] for r, g in answered.items()}
        # rank 0 decides every job and the peers apply what it sends: its queue is what
        # the tier still has to do; each rank's own count is exported beside it
        out["cache_maintenance_queue"] = answered.get(0, {}).get("maintenance", 0)
        out["cache_maintenance_queued"] = {r: g["maintenance"] for r, g in answered.items()}
        links = answered.get(0, {}).get("links", {})
        out["replication_link_window"] = {p: v["window"] for p, v in links.items()}
        out["replication_link_window_free"] = {p: v["free"] for p, v in links.items()}
        out["replication_link_pending"] = {p: v["pending"] for p, v in links.items()}
    return out
