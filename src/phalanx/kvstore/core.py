"""``StoreCore``: the state one ``DiskStore``'s parts share, handed to each of them.

``DiskStore`` composes a :class:`~phalanx.kvstore.loads.Reader` (``load``,
``load_many``), a :class:`~phalanx.kvstore.stores.Writer` (``store``, ``store_many``)
and a :class:`~phalanx.kvstore.jobs.JobRunner` (maintenance jobs, making room); each
is handed this one object at construction, so what they share is written down in one
place, with the lock that guards it, instead of being attributes a mixin assumes.

Invariant: ``index``, ``scheduler``, ``stats``, ``reserved``, ``inflight``,
``retired``, ``writers`` and ``state`` are read and written under ``mutex`` only; file
I/O runs outside it. ``io``, ``files``, ``rings`` and ``staging`` are thread-safe themselves.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ._errors import RowSpanError, StoreClosedError
from .buffers import ParallelReader
from .files import Staging
from .geometry import Geometry
from .index import Index, Record
from .keys import KeyChain, Tokens, page_keys
from .maintenance import Scheduler
from .open_files import OpenFiles
from .options import StoreOptions
from .stats import CacheStats
from .uring import Rings

__all__ = ["StoreCore", "StoreState"]


class StoreState(enum.Enum):
    OPEN = "open"  # serving and accepting maintenance
    CLOSED = "closed"  # close() began: every call raises StoreClosedError


@dataclass(eq=False)
class StoreCore:
    """What the reads, the writes and the maintenance of one store share."""

    directory: str
    geometry: Geometry
    fingerprint: bytes
    options: StoreOptions
    clock: Callable[[], float]
    io: ParallelReader  # the I/O threads (reads, batch writes, a lone row's checksums)
    files: OpenFiles  # record descriptors kept open between loads
    staging: Staging  # per-thread slots for the temp files of writes
    rings: Rings | None  # one io_uring per worker thread, where asked for and offered
    index: Index
    scheduler: Scheduler
    stats: CacheStats
    mutex: threading.RLock = field(default_factory=threading.RLock)
    state: StoreState = StoreState.OPEN
    reserved: int = 0  # bytes of admitted writes in flight, counted against capacity
    inflight: Counter[bytes] = field(default_factory=Counter)  # page keys being written
    # records that left the index while a load still had them pinned: until those
    # loads finish, no new file may take the name (they read the old one by name and
    # at the old record's offsets)
    retired: dict[bytes, Record] = field(default_factory=dict)
    # store calls between their admission and their indexing: each may still create,
    # write and rename files in the directory, so close() lets the directory go (its
    # lock) only once none is left; ``idle`` (on ``mutex``) is notified when it drops to 0
    writers: int = 0
    idle: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.mutex)

    def is_open(self) -> bool:
        return self.state is StoreState.OPEN

    def check_open(self) -> None:
        if self.state is not StoreState.OPEN:
            raise StoreClosedError(f"cache store {self.directory} is closed")

    def keys(self, tokens: Tokens | KeyChain, limit: int | None = None) -> list[bytes]:
        """Page keys of ``tokens`` (at most ``limit``) for this store's model and pages."""
        if isinstance(tokens, KeyChain):
            if (tokens.page_tokens, tokens.fingerprint) != (
                self.geometry.page_tokens, self.fingerprint
            ):
                raise RowSpanError("KeyChain was made for another model or page size")
            if not tokens.keys:
                raise RowSpanError("an empty KeyChain has no page to cache")
            return tokens.keys if limit is None else tokens.keys[:limit]
        return page_keys(tokens, self.geometry.page_tokens, self.fingerprint, limit)

    def retire_locked(self, rec: Record) -> None:
        """``rec`` left the index for good: if loads still pin it, keep its name from a
        new record until they are done (see ``retired``); forget finished ones."""
        if rec.pins:
            self.retired[rec.key] = rec
        for key in [k for k, r in self.retired.items() if not r.pins]:
            del self.retired[key]
