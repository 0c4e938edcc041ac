"""Counters of one DiskStore, as returned by ``DiskStore.statistics()``."""

from __future__ import annotations

import msgspec

__all__ = ["CacheStats"]


class CacheStats(msgspec.Struct, kw_only=True):
    records: int = 0  # attached records (thinned ones included)
    thinned_records: int = 0
    bytes: int = 0  # file bytes counted against capacity (records and orphans)
    capacity_bytes: int = 0
    hits: int = 0  # lookups that found at least one page
    misses: int = 0
    hit_tokens: int = 0
    stores: int = 0  # records written
    stores_skipped: int = 0  # store() calls whose tokens were all cached already
    stored_bytes: int = 0
    loads: int = 0
    loaded_bytes: int = 0
    io_uring_loaded_bytes: int = 0  # of loaded_bytes, read through io_uring (uring.py)
    rows_thinned: int = 0
    evictions: int = 0
    expirations: int = 0
    dropped: int = 0  # unreachable records' files deleted
    temps_purged: int = 0
    quarantined: int = 0
    corrupt_loads: int = 0
    recovered: int = 0  # record headers accepted at open
    skipped: dict[str, int] = msgspec.field(default_factory=dict)  # at open, by reason
    maintenance_queued: int = 0
    maintenance_done: int = 0
    maintenance_deferred: int = 0
