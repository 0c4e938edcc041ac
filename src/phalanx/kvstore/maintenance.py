"""Maintenance as a stream of small jobs: decided by a scheduler, applied one by one.

The split is the replication contract: rank 0's :class:`Scheduler` decides each job
from its index; every rank (rank 0 included) applies the same :class:`Job` to its own
directory with ``DiskStore.apply_job``. A job names a record by key and page span, not
by this rank's byte sizes, so a peer whose shard has other sizes applies it as is.
``row_bytes`` is informational (the decider's size) for stats and logs.

Jobs are decided lazily, one at a time, from the index's candidate sets; so nothing is
queued beyond what the index itself holds, and ``poll(max_jobs)`` does a bounded burst.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import msgspec

from .index import Index, Record

__all__ = ["Job", "JobKind", "JobOutcome", "Scheduler"]


class JobKind(enum.Enum):
    PURGE_TEMP = "purge_temp"  # delete a temp file a dead writer left (name)
    QUARANTINE = "quarantine"  # move aside (or delete, by policy) a bad record file (name)
    DROP = "drop"  # delete the file of an unreachable record (orphan) (key)
    EXPIRE = "expire"  # remove a leaf record older than max_age (key)
    EVICT = "evict"  # remove the least recently used leaf: capacity (key)
    THIN = "thin"  # truncate a row all of whose bytes a descendant holds (key)


class JobOutcome(enum.Enum):
    DONE = "done"  # applied
    NOOP = "noop"  # nothing to do any more (already applied, or record gone)
    DEFERRED = "deferred"  # record pinned by a load in flight: decide it again later


class Job(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One maintenance step; a few dozen bytes as msgpack."""

    kind: JobKind
    key: bytes = b""  # record key (16 bytes) for DROP/EXPIRE/EVICT/THIN
    name: str = ""  # file name for PURGE_TEMP/QUARANTINE
    start_page: int = 0
    end_page: int = 0
    row_bytes: int = 0

    @classmethod
    def for_record(cls, kind: JobKind, rec: Record) -> Job:
        return cls(kind, key=rec.key, start_page=rec.start, end_page=rec.end,
                   row_bytes=rec.row_len)

    def describe(self) -> str:
        what = self.name or f"{self.key.hex()} pages {self.start_page}..{self.end_page}"
        return f"{self.kind.value} {what}"


class Scheduler:
    """Decides the next job from an index. Priority: leftovers first (temps, bad files,
    orphans), then expiry, then capacity, then thinning (it only saves bytes)."""

    def __init__(self, index: Index, capacity_bytes: int, max_age: float | None,
                 clock: Callable[[], float]) -> None:
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.max_age = max_age
        self.clock = clock
        self.temps: dict[str, None] = {}  # ordered sets of file names
        self.bad: dict[str, None] = {}
        self._deferred: set[tuple[JobKind, bytes]] = set()  # within one burst

    def queued(self) -> int:
        """Known pending jobs (expiry and eviction are decided when due, not counted)."""
        ix = self.index
        return len(self.temps) + len(self.bad) + len(ix.orphans) + len(ix.thin_candidates)

    def begin_burst(self) -> None:
        self._deferred.clear()

    def defer(self, job: Job) -> None:
        self._deferred.add((job.kind, job.key))

    def next_job(self) -> Job | None:
        if self.temps:
            return Job(JobKind.PURGE_TEMP, name=next(iter(self.temps)))
        if self.bad:
            return Job(JobKind.QUARANTINE, name=next(iter(self.bad)))
        ix = self.index
        for orphan in ix.orphans.values():
            if not orphan.pins and (JobKind.DROP, orphan.key) not in self._deferred:
                return Job.for_record(JobKind.DROP, orphan)
        if self.max_age is not None:
            old = ix.expired_leaf(self.clock() - self.max_age)
            if old is not None:
                return Job.for_record(JobKind.EXPIRE, old)
        if ix.bytes > self.capacity_bytes:
            victim = ix.lru_leaf()
            if victim is not None:
                return Job.for_record(JobKind.EVICT, victim)
        # No copy of the candidates per call (a burst would be quadratic): stale ones
        # met on the way are dropped after the scan, so the next call starts past them.
        stale: list[bytes] = []
        found: Job | None = None
        for key in ix.thin_candidates:
            rec = ix.records.get(key)
            if rec is None or not ix.is_thinnable(rec):
                stale.append(key)
                continue
            if rec.pins or (JobKind.THIN, key) in self._deferred:
                continue
            found = Job.for_record(JobKind.THIN, rec)
            break
        for key in stale:
            del ix.thin_candidates[key]
        return found
