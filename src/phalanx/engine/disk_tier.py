"""The disk tier behind the scheduler: a PrefixTier over the replicated persistent cache.

Rank 0 decides (``phalanx.replication``): a lookup is rank 0's index, a load makes every
rank read its own shard of the pages into its staging (``engine.staging``), from which
the step plan's ``PageLoad`` moves them into KV pages. The load runs before the step
that consumes it, so the pages are delivered, not merely pinned, once ``lookup``
returns; ``unpin`` has nothing left to do.

Stores run on one background thread, in the order their steps ran: a step's
``PageSave`` staged the pages on every rank, ``saved(chain)`` queues the chain, the
thread asks rank 0 to store it (rank 0 admits, makes room, replicates). The request
path never waits on a disk write. A store that fails (disk full, a failpoint, pages
pushed out of staging) or that finds the queue full is counted and dropped: it costs
a later miss, never a wrong answer. The thread also runs the cache's maintenance in
bounded bursts while it is idle.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kvstore import KeyChain
from ..lifecycle import PhalanxError

if TYPE_CHECKING:
    from ..replication import ReplicatedCache

__all__ = ["DiskTier", "DiskTierStats"]

log = logging.getLogger("phalanx.engine")

_IDLE_POLL_S = 0.5          # how long the store thread waits before a maintenance burst
_MAINTENANCE_JOBS = 64      # jobs per burst: a store waits behind one burst at most


@dataclass
class DiskTierStats:
    lookups: int = 0
    pages_loaded: int = 0
    load_failures: int = 0
    stores: int = 0
    store_failures: int = 0
    stores_dropped: int = 0   # the queue was full
    maintenance_jobs: int = 0
    last_error: str | None = None


class DiskTier:
    """See the module docstring. ``close()`` drains the queued stores (bounded)."""

    def __init__(self, cache: ReplicatedCache, page_tokens: int, fingerprint: bytes,
                 queue_limit: int = 256, maintenance: bool = True) -> None:
        self.cache = cache
        self.page_tokens = page_tokens
        self.fingerprint = fingerprint
        self.stats = DiskTierStats()
        self._maintenance = maintenance
        self._q: queue.Queue[list[bytes] | None] = queue.Queue(maxsize=queue_limit)
        self._cv = threading.Condition()
        self._pending = 0       # stores queued or running
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="phalanx-engine-disk-stores",
                                        daemon=True)
        self._thread.start()

    def _chain(self, keys: Sequence[bytes]) -> KeyChain:
        return KeyChain(list(keys), self.page_tokens, self.fingerprint)

    # -- the scheduler's side (request path) ----------------------------------------------

    def lookup(self, keys: Sequence[bytes], start: int) -> int:
        self.stats.lookups += 1
        try:
            n = self.cache.lookup(self._chain(keys))
            if n <= start:
                return 0
            self.cache.load(self._chain(keys[:n]), n)
        except PhalanxError as exc:
            self._failed("load", exc)
            self.stats.load_failures += 1
            return 0
        self.stats.pages_loaded += n - start
        return n - start

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Nothing: a lookup delivered its pages to every rank's staging already."""

    def wants(self, keys: Sequence[bytes], start: int) -> list[bool]:
        return [True] * (len(keys) - start)

    def saved(self, keys: Sequence[bytes]) -> None:
        with self._cv:
            try:
                self._q.put_nowait(list(keys))
            except queue.Full:
                self.stats.stores_dropped += 1
                return
            self._pending += 1

    # -- the background thread --------------------------------------------------------

    def _run(self) -> None:
        behind = False  # the last burst did work: more may be due, so do not idle
        while True:
            try:
                item = self._q.get_nowait() if behind else self._q.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                if self._stopping:
                    return
                behind = self._maintain() > 0
                continue
            if item is None:
                return
            try:
                self.cache.store(self._chain(item))
                self.stats.stores += 1
            except PhalanxError as exc:
                self.stats.store_failures += 1
                self._failed("store", exc)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _maintain(self) -> int:
        """One bounded burst of maintenance; the jobs it did. Stores queued meanwhile go
        first (the loop checks the queue between bursts), so maintenance stays behind
        requests however much is due (a recovered directory may owe thousands)."""
        if not self._maintenance:
            return 0
        try:
            done = self.cache.poll(_MAINTENANCE_JOBS)
        except PhalanxError as exc:
            self._failed("maintenance", exc)
            return 0
        self.stats.maintenance_jobs += done
        return done

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.last_error = f"{what}: {exc!r}"
        log.warning("disk tier %s failed (a cache miss later, not an error): %s", what, exc)

    def drain(self, timeout: float) -> bool:
        """Wait until every queued store ran; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued stores (at most ``timeout``) and stop the thread."""
        self._stopping = True
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            log.warning("disk tier: %d stores still queued at close", self._q.qsize())
        self._thread.join(timeout)
