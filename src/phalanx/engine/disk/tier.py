"""The disk tier's scheduler side: :class:`DiskTier`, the engine loop's KV connector
(``core/connector.py``) over the replicated persistent cache. The contract it keeps
with rank 0's side and each rank's staging is the package's docstring
(``engine/disk/__init__.py``)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ...kvstore import KeyChain
from ...lifecycle import PhalanxError
from ...lifecycle.failpoints import Failpoint
from ...replication import Lease
from .._errors import EngineError
from ..core.connector import ConnectorStats
from ..core.executor import Executor
from ..core.plan import StepPlan
from .rank0 import DiskLoad, DiskLoads, rank_lookup, rank_page_keys

# the disk tier's lookup is about to ask rank 0 (a fault here fails the schedule)
_LOOKUP = Failpoint("engine.disk.lookup")


__all__ = ["DiskCache", "DiskTier"]

log = logging.getLogger("phalanx.engine")


class DiskCache(Protocol):
    """What the tier drives of the replicated cache: ``phalanx.replication``'s
    ``ReplicatedCache`` on one host, ``multihost/disk.py``'s ``HostsDiskCache`` across
    hosts."""

    @property
    def cache_id(self) -> str: ...

    def store(self, chain: KeyChain) -> object: ...

    def poll(self, max_jobs: int) -> int: ...

    def close(self) -> None: ...

_IDLE_POLL_S = 0.5          # how long the store thread waits before a maintenance burst
# ... doubled after each second burst in a row that did nothing, up to _IDLE_POLL_MAX_S;
# a burst that did work starts again from _IDLE_POLL_S. Each burst is a run on rank 0,
# and an idle server ran two a second forever. One empty burst alone keeps the pace: a
# burst reports 0 when the peers' windows are full (acks on the way) as well as when
# nothing is due. A store does not reset it: the store path makes its own room. Jobs
# that fall due with time alone (records past their age) wait at most
# _IDLE_POLL_MAX_S for their burst.
_IDLE_POLL_MAX_S = 8.0
_MAINTENANCE_JOBS = 64      # jobs per burst: a store waits behind one burst at most
# Before a store or a burst the thread waits for the ranks to be quiet this long (no
# step, no lookup), at most _QUIET_WAIT_S: a store of one page costs 2-12 ms of the two
# shared cores, which the request just admitted would otherwise pay.
_QUIET_GAP_S = 0.05
_QUIET_WAIT_S = 1.0
# The page keys the tier keeps to answer a miss without asking rank 0: past this many
# (~100 bytes each in a set) it asks rank 0 for every lookup instead.
_KNOWN_KEYS_MAX = 1 << 20


class DiskTier:
    """See the module docstring. ``close()`` drains the queued stores (bounded)."""

    def __init__(self, cache: DiskCache, group: Executor, page_tokens: int,
                 fingerprint: bytes, queue_limit: int = 256, maintenance: bool = True) -> None:
        self.cache = cache
        self.group = group
        # looked up, not yet in a step: PageLoad keys -> its load (request path only)
        self._held: dict[tuple[bytes, ...], DiskLoad] = {}
        self._releases: list[Lease] = []  # given back by the scheduler: rank 0 unpins
        self.page_tokens = page_tokens
        self.fingerprint = fingerprint
        self.stats = ConnectorStats()
        self._maintenance = maintenance
        self._q: queue.Queue[tuple[float, list[bytes]] | None] = queue.Queue(maxsize=queue_limit)
        self._cv = threading.Condition()
        self._pending = 0       # stores queued or running
        self._stopping = False
        # the page keys rank 0 holds, or more (see the module docstring); None: ask it
        # for every lookup. _queued: the keys of the stores queued, not yet run.
        self._keys_lock = threading.Lock()
        self._known: set[bytes] | None = None
        self._queued: collections.Counter[bytes] = collections.Counter()
        self._refresh_keys()
        self._thread = threading.Thread(target=self._run, name="phalanx-engine-disk-stores",
                                        daemon=True)
        self._thread.start()

    def _chain(self, keys: Sequence[bytes]) -> KeyChain:
        return KeyChain(list(keys), self.page_tokens, self.fingerprint)

    # -- the scheduler's side (request path) ----------------------------------------------

    def lookup(self, keys: Sequence[bytes], start: int) -> int:
        known = self._known
        if (known is not None and start < len(keys) and keys[start] not in known
                and not self._releases):  # given-back leases ride on the next lookup
            self.stats.lookups_skipped += 1
            return 0
        self.stats.lookups += 1
        releases, self._releases = self._releases, []
        try:
            _LOOKUP.hit()
            n, lease = self.group.on_rank0(rank_lookup, self.cache.cache_id, list(keys),
                                           self.page_tokens, self.fingerprint, start,
                                           releases)
        except PhalanxError as exc:
            # rank 0 may not have seen them: they go back, to be released with the next
            self._releases[:0] = releases
            self._failed("lookup", exc)
            self.stats.load_failures += 1
            return 0
        if lease is None:
            return 0
        self._held[tuple(keys[start:n])] = DiskLoad(list(keys[:n]), start, lease)
        self.stats.pages_loaded += n - start
        return n - start

    def unpin(self, keys: Sequence[bytes]) -> None:
        """A lookup the scheduler did not use: rank 0 unpins it with the next lookup
        (a lookup a step used was released by that step)."""
        held = self._held.pop(tuple(keys), None)
        if held is not None:
            self._releases.append(held.lease)

    def loads(self, plan: StepPlan) -> DiskLoads | None:
        """The disk loads of ``plan`` (its ``PageLoad``s' leases), for every rank."""
        if not plan.loads:
            return None
        picked = []
        for load in plan.loads:
            held = self._held.pop(tuple(load.keys), None)
            if held is None:
                raise EngineError(f"step {plan.step}: a PageLoad of {len(load.keys)} pages "
                                  "that no disk tier lookup holds")
            picked.append(held)
        return DiskLoads(self.cache.cache_id, self.page_tokens, self.fingerprint, picked)

    def load_failed(self, plan: StepPlan, failures: dict[int, str]) -> None:
        """``plan``'s loads failed on the ranks of ``failures`` (rank -> reason: record,
        directory, errno); the step ran on no rank and its prefixes are recomputed."""
        self.stats.load_failures += len(failures)
        self.stats.pages_loaded -= sum(len(load.keys) for load in plan.loads)
        for rank, why in sorted(failures.items()):
            self.stats.last_error = f"load on rank {rank}: {why}"
            log.warning("disk tier: step %d: the load of %d prefixes failed on rank %d "
                        "(recomputed as a miss): %s", plan.step, len(plan.loads), rank, why)

    def wants(self, keys: Sequence[bytes], start: int) -> list[bool]:
        return [True] * (len(keys) - start)

    def saved(self, keys: Sequence[bytes]) -> None:
        with self._keys_lock:  # before the store can run: a lookup after it asks rank 0
            if self._known is not None:
                self._known.update(keys)
                if len(self._known) > _KNOWN_KEYS_MAX:
                    self._known = None
            self._queued.update(keys)
        with self._cv:
            try:
                self._q.put_nowait((time.monotonic(), list(keys)))
            except queue.Full:
                self.stats.stores_dropped += 1
                self._unqueue(keys)
                return
            self._pending += 1

    def _unqueue(self, keys: Sequence[bytes]) -> None:
        with self._keys_lock:
            self._queued.subtract(keys)
            for k in keys:
                if self._queued[k] <= 0:
                    del self._queued[k]

    # -- the background thread --------------------------------------------------------

    def _run(self) -> None:
        behind = False  # the last burst did work: more may be due, so do not idle
        idle, empty = _IDLE_POLL_S, 0   # the pace of bursts; empty bursts in a row
        while True:
            try:
                item = self._q.get_nowait() if behind else self._q.get(timeout=idle)
            except queue.Empty:
                if self._stopping:
                    return
                was_behind, behind = behind, self._maintain() > 0
                if was_behind and not behind:
                    self._refresh_keys()  # the bursts evicted: forget what they removed
                empty = 0 if behind else empty + 1
                if behind:
                    idle = _IDLE_POLL_S
                elif empty >= 2:
                    idle = min(2 * idle, _IDLE_POLL_MAX_S)
                continue
            if item is None:
                return
            queued, keys = item
            try:
                if not self._stopping:  # a busy engine still stores within _QUIET_WAIT_S
                    self.group.wait_quiet(_QUIET_GAP_S,
                                          queued + _QUIET_WAIT_S - time.monotonic())
                self.cache.store(self._chain(keys))
                self.stats.stores += 1
            except PhalanxError as exc:
                self.stats.store_failures += 1
                self._failed("store", exc)
            finally:
                self._unqueue(keys)
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _maintain(self) -> int:
        """One bounded burst of maintenance; the jobs it did. Stores queued meanwhile go
        first (the loop checks the queue between bursts), so maintenance stays behind
        requests however much is due (a recovered directory may owe thousands)."""
        if not self._maintenance:
            return 0
        if not self.group.wait_quiet(_QUIET_GAP_S, _QUIET_WAIT_S) and not self._q.empty():
            return 1  # busy and stores are queued: they go first
        try:
            done = self.cache.poll(_MAINTENANCE_JOBS)
        except PhalanxError as exc:
            self._failed("maintenance", exc)
            return 0
        self.stats.maintenance_jobs += done
        return done

    def _refresh_keys(self) -> None:
        """Ask rank 0 for the page keys it holds, and keep those of the stores not yet
        run. Runs before the thread starts or on it, so no store runs meanwhile. On a
        failure the tier asks rank 0 for every lookup until the next refresh."""
        try:
            keys = self.group.on_rank0(rank_page_keys, self.cache.cache_id, _KNOWN_KEYS_MAX)
        except PhalanxError as exc:
            keys = None
            self._failed("reading the page keys rank 0 holds", exc)
        with self._keys_lock:
            self._known = None if keys is None else set(keys).union(self._queued)
        self.stats.key_refreshes += 1

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.last_error = f"{what}: {exc!r}"
        log.warning("disk tier %s failed (a cache miss later, not an error): %s", what, exc)

    @property
    def pending(self) -> int:
        """Stores queued or running (a finished prefill's pages on their way to disk)."""
        with self._cv:
            return self._pending

    def drain(self, timeout: float) -> bool:
        """Wait until every queued store ran; False if ``timeout`` passed first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    @property
    def cache_id(self) -> str:
        return self.cache.cache_id

    def close(self, timeout: float = 30.0, healthy: bool = True) -> None:
        """Finish the queued stores (at most ``timeout``), stop the thread, and close
        the cache this tier owns (``healthy``: its ranks are alive to close it with;
        a dead engine's ranks are gone, and their stores with them)."""
        self._stopping = True
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            log.warning("disk tier: %d stores still queued at close", self._q.qsize())
        self._thread.join(timeout)
        if healthy:
            self.cache.close()
