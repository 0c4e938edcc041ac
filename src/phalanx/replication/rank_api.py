"""The engine's half of the rank-side cache: leases, store tickets, rank 0's store thread.

The engine's step code runs in every rank and calls its :class:`RankCache`
(``rank_cache(cache_id)``) in batches:

* ``lookup_many(prefixes) -> Lease`` on rank 0: pages cached per prefix, decided at once
  and pinned until ``release(lease)``; the lease (plain data) goes to every rank in the
  step plan. Pinned records are never evicted, expired or thinned by rank 0, and peers
  only ever do what rank 0 decides, so no rank loses a record before it read it.
* ``load_many(requests, lease)`` on every rank: its own shard, straight from its own
  store into the caller's buffers. A peer first waits until it applied every op rank 0
  had queued to it when the lease was taken (``Lease.through``): the records it reports
  are then on this rank's disk. No link, no parent, no order lock.
* ``store_many(rows) -> StoreTicket`` on every rank: the rows are copied at the call
  (the caller may reuse its memory at once). Rank 0 decides them on its store thread
  (admission, room, write) and sends each peer one decision per row; a peer stores its
  staged copy or drops it. A row that cannot be admitted is refused on every rank.

Bounded: rank 0's store thread takes at most ``_QUEUE_BATCHES`` batches; a call beyond
that waits for room (up to the link's job timeout) and then raises. Leases outstanding
are capped (``_MAX_LEASES``): a caller that never releases is told, not absorbed.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from phalanx.kvstore import StoreClosedError
from phalanx.kvstore.buffers import as_byte_view
from phalanx.kvstore.keys import KeyChain
from phalanx.kvstore.store import PrefixPins, StoreResult

from ._errors import ReplicationError
from .leader import Leader

__all__ = ["Lease", "LeaseTable", "StoreThread", "StoreTicket"]

_QUEUE_BATCHES = 64
_MAX_LEASES = 4096
_IDS = itertools.count(1)


@dataclass(frozen=True)
class Lease:
    """What rank 0 reported for a batch of prefixes, pinned until released.

    ``pages[i]``: pages cached of prefix i (0: a miss). ``through``: peer rank -> the
    last op rank 0 had queued to it; a peer loads once it applied that far."""

    lease_id: int
    pages: tuple[int, ...]
    through: dict[int, int] = field(default_factory=dict)


class LeaseTable:
    """Rank 0's outstanding leases and the pins each holds."""

    def __init__(self, leader: Leader) -> None:
        self._leader = leader
        self._lock = threading.Lock()
        self._pins: dict[int, PrefixPins] = {}  # Invariant: every entry still pinned

    def __len__(self) -> int:
        with self._lock:
            return len(self._pins)

    def take(self, prefixes: Sequence[Any]) -> Lease:
        with self._lock:
            if len(self._pins) >= _MAX_LEASES:
                raise ReplicationError(
                    f"rank 0: {len(self._pins)} leases outstanding (at most {_MAX_LEASES}); "
                    "release each lease once the step that used it finished on every rank")
        pins, through = self._leader.lookup_pinned(prefixes)
        lease = Lease(next(_IDS), tuple(pins.pages), through)
        with self._lock:
            self._pins[lease.lease_id] = pins
        return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            pins = self._pins.pop(lease.lease_id, None)
        if pins is None:
            raise ReplicationError(f"rank 0: lease {lease.lease_id} is not outstanding "
                                   "(released twice, or taken by another cache)")
        self._leader.store.unpin(pins)

    def release_all(self) -> None:
        """Close step: unpin whatever is left (the store closes after this)."""
        with self._lock:
            left, self._pins = list(self._pins.values()), {}
        for pins in left:
            self._leader.store.unpin(pins)


class StoreTicket:
    """The outcome of one ``store_many`` call. On rank 0: the rows' StoreResults once
    decided and written (or the refusal); on a peer: done at once (its copies are
    staged; rank 0's decisions apply them in the background)."""

    def __init__(self, rows: int, done: bool = False) -> None:
        self.rows = rows
        self._done = threading.Event()
        self._results: list[StoreResult] = []
        self._error: BaseException | None = None
        if done:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> list[StoreResult]:
        """Rank 0's results, in row order ([] on a peer); raises the refusal or write
        error, or ReplicationError when not decided within ``timeout``."""
        if not self._done.wait(timeout):
            raise ReplicationError(f"a store_many of {self.rows} rows was not decided "
                                   f"within {timeout:.1f}s")
        if self._error is not None:
            raise self._error
        return self._results

    def _finish(self, results: list[StoreResult], error: BaseException | None) -> None:
        self._results, self._error = results, error
        self._done.set()


_Batch = tuple[list[tuple[KeyChain, np.ndarray]], StoreTicket]


class StoreThread:
    """Rank 0's background decider for ``store_many``: one thread, a bounded queue."""

    def __init__(self, leader: Leader, wait: float) -> None:
        self._leader = leader
        self._wait = wait  # how long a call may wait for room in the queue
        self._queue: queue.Queue[_Batch | None] = queue.Queue(_QUEUE_BATCHES)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="phalanx-rank0-stores",
                                        daemon=True)
        self._thread.start()

    def submit(self, rows: Sequence[tuple[Any, Any]]) -> StoreTicket:
        """Copy ``rows`` (tokens or key chains, row bytes) and queue them."""
        if self._closed:
            raise StoreClosedError("rank 0: the replicated cache is closing; no new stores")
        store = self._leader.store
        staged = [(tokens if isinstance(tokens, KeyChain) else store.chain(tokens),
                   np.array(as_byte_view(row), dtype=np.uint8, copy=True))
                  for tokens, row in rows]
        ticket = StoreTicket(len(staged))
        try:
            self._queue.put((staged, ticket), timeout=self._wait)
        except queue.Full:
            raise ReplicationError(
                f"rank 0: {_QUEUE_BATCHES} store batches are still being decided after "
                f"{self._wait:.1f}s (the disk or a peer is slow); this batch of "
                f"{len(staged)} rows is refused") from None
        return ticket

    def close(self, timeout: float) -> None:
        """Decide what is queued, then stop; raises ReplicationError if the thread did
        not exit within ``timeout``."""
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass  # the thread is stuck; the join below says so
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ReplicationError(
                f"rank 0: the store thread did not exit within {timeout:.1f}s (a store "
                "is blocked on the disk or a peer)")

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            rows, ticket = item
            try:
                results = self._leader.store_staged(rows)
            except Exception as exc:  # noqa: BLE001  the caller's ticket carries it
                ticket._finish([], exc)
            else:
                ticket._finish(results, None)
