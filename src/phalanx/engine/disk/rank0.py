"""Rank 0's side of the disk tier, and what a step's loads carry to every rank.

Rank 0 decides (``phalanx.replication``'s rank-side API): a lookup pins what it reports
in a :class:`~phalanx.replication.Lease`; the step that consumes the pages carries the
leases (:class:`DiskLoads`) beside its plan, and rank 0 releases them when the step ran
on every rank. The functions are module-level: the executors ship them by reference
(one host) or by name (several hosts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...kvstore import KeyChain
from ...replication import Lease, ReplicationError, rank_cache

__all__ = ["DiskLoad", "DiskLoads", "rank_lookup", "rank_page_keys", "release_leases"]


@dataclass(frozen=True)
class DiskLoad:
    """One prefix a step loads: ``keys`` is its chain from page 0; pages ``start:`` go
    into the step's ``PageLoad`` of ``keys[start:]``."""

    keys: list[bytes]
    start: int
    lease: Lease


@dataclass(frozen=True)
class DiskLoads:
    """What a step's disk loads need on every rank (pickled with the step's tasks)."""

    cache_id: str
    page_tokens: int
    fingerprint: bytes
    loads: list[DiskLoad] = field(default_factory=list)

    def leases(self) -> list[Lease]:
        return [d.lease for d in self.loads]


# -- rank 0's side (module-level: tasks ship them by reference) ---------------------------

def rank_lookup(cache_id: str, keys: list[bytes], page_tokens: int, fingerprint: bytes,
                start: int, releases: list[Lease]) -> tuple[int, Lease | None]:
    """Rank 0: release ``releases``, then the pages of ``keys`` cached, pinned in a
    lease when more than ``start`` (else nothing is held)."""
    cache = rank_cache(cache_id)
    for lease in releases:
        try:
            cache.release(lease)
        except ReplicationError:
            pass  # released already: given back again after a lookup whose reply was lost
    lease = cache.lookup_many([KeyChain(keys, page_tokens, fingerprint)])
    n = lease.pages[0]
    if n <= start:
        cache.release(lease)
        return 0, None
    return n, lease


def rank_page_keys(cache_id: str, limit: int) -> list[bytes] | None:
    """Rank 0: every page key its store holds (None past ``limit``)."""
    return rank_cache(cache_id).store.page_keys(limit)


def release_leases(cache_id: str, leases: list[Lease]) -> None:
    """Rank 0: unpin what a step's loads held, once the step ran on every rank."""
    cache = rank_cache(cache_id)
    for lease in leases:
        cache.release(lease)
