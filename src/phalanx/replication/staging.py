"""A peer's staged rows: copies of what its engine stored, until rank 0 decides.

``RankCache.store_many`` on a peer copies each row out of the caller's memory at the
call (the caller may reuse its buffer at once) and files the copy here under the row's
identity (end page key, start page). Rank 0 decides every row of its own call and sends
exactly one decision per row: a ``StoreOp`` with ``staged=True`` (the replica takes the
copy and stores it) or an ``Unstage`` (refused or skipped: the copy is dropped). So a
staged copy lives from the peer's call until rank 0's decision on it arrives; what is
left at close (rank 0 died, the link failed) is dropped by the close journal, and at
most ``MAX_STAGED_BYTES`` wait at once (beyond, a peer's store_many raises).

Rank 0's decision may arrive before the peer's own call (the peer's step runs late):
the replica waits for the copy, bounded by ``wait`` (less than the link's job timeout,
so the peer reports a missing row before rank 0 calls it stalled).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from phalanx.kvstore.buffers import as_byte_view

from ._errors import PeerJobError, ReplicationError

__all__ = ["MAX_STAGED_BYTES", "RowId", "StagedRows", "row_start"]

RowId = tuple[bytes, int]  # (key of the row's end page, its start page)
_STOP_CHECK_S = 0.2
# Bounded: copies wait only for rank 0's decisions, which follow its own calls closely;
# this much waiting means rank 0 stopped deciding
MAX_STAGED_BYTES = 1 << 30  # how late a waiting replica notices its stop request


def row_start(n_keys: int, row: Any, page_bytes: int) -> int:
    """The start page of a row of ``row``'s size ending at page ``n_keys`` (every rank
    computes a staged row's identity this way, from its own call's arguments)."""
    return n_keys - as_byte_view(row).nbytes // page_bytes


class StagedRows:
    """Copies of rows waiting for rank 0's decision, per row identity, in call order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._cond = threading.Condition()
        # Invariant: no empty deque is kept; nbytes == total size of the copies held.
        self._rows: dict[RowId, collections.deque[np.ndarray]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._rows.values())

    def put(self, row_id: RowId, row: Any) -> None:
        """Copy ``row`` (any buffer) and file the copy under ``row_id``."""
        view = as_byte_view(row)
        with self._cond:
            if self.nbytes + view.nbytes > MAX_STAGED_BYTES:
                raise ReplicationError(
                    f"rank {self.rank}: {self.nbytes} bytes of rows already wait for rank "
                    f"0's decision (at most {MAX_STAGED_BYTES}); rank 0 is not deciding "
                    "(hung, or its link failed): this row is not staged")
        copy = np.array(view, dtype=np.uint8, copy=True)
        with self._cond:
            self._rows.setdefault(row_id, collections.deque()).append(copy)
            self.nbytes += copy.nbytes
            self._cond.notify_all()

    def take(self, row_id: RowId, wait: float, stop: threading.Event) -> np.ndarray:
        """The oldest copy filed under ``row_id``, waiting up to ``wait`` seconds for it.
        Raises PeerJobError naming the row when none came (the peer's engine did not
        store it)."""
        end = time.monotonic() + wait
        with self._cond:
            while row_id not in self._rows:
                left = end - time.monotonic()
                if left <= 0 or stop.is_set():
                    raise PeerJobError(
                        f"rank {self.rank}: rank 0 stored row {row_id[0].hex()[:16]} (from "
                        f"page {row_id[1]}) but this rank's engine staged no such row within "
                        f"{wait:.1f}s; every rank must store the same rows")
                self._cond.wait(min(left, _STOP_CHECK_S))
            return self._pop_locked(row_id)

    def drop(self, row_id: RowId, wait: float, stop: threading.Event) -> None:
        """Drop the oldest copy under ``row_id`` (rank 0 refused or skipped the row),
        waiting for it like :meth:`take`: a copy filed after its decision passed would
        never be dropped."""
        self.take(row_id, wait, stop)

    def clear(self) -> None:
        with self._cond:
            self._rows.clear()
            self.nbytes = 0

    def _pop_locked(self, row_id: RowId) -> np.ndarray:
        q = self._rows[row_id]
        copy = q.popleft()
        if not q:
            del self._rows[row_id]
        self.nbytes -= copy.nbytes
        return copy
