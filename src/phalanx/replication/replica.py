"""A peer rank's side of replication: apply rank 0's ops to this rank's own store.

One thread per replica reads ops in order, applies each to the rank's DiskStore with
bytes from the rank's KV source, and acks. Acks of a run of ops that arrived together go
back in one send, but at least every ``_ACK_EVERY`` ops: a peer that applied a whole
window before acking it kept rank 0 waiting for credits meanwhile, so the ranks took
turns instead of working at once (BENCHMARKS.md, the small lane). Ops are applied strictly in
arrival order: rank 0 sent them in the order it applied them itself, so both directories
pass through the same states.

A peer never decides: its store is opened with no expiry and an unbounded capacity, so
it evicts, expires and thins only when rank 0 says so.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import zlib
from typing import Any

from phalanx.kvstore.keys import KeyChain
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.kvstore.store import DiskStore
from phalanx.lifecycle.failpoints import Failpoint

from ._errors import LinkClosedError, LinkStalledError, ReplicationError
from .frames import (
    Ack,
    Bye,
    Frame,
    FrameReader,
    JobOp,
    LoadOp,
    Reconcile,
    StoreOp,
    Unstage,
    encode,
    records_digest,
)
from .kv_source import KVSource
from .staging import StagedRows

__all__ = ["Replica"]

log = logging.getLogger("phalanx.replication")

_FP_APPLY = Failpoint("cache.replica.apply", "a peer is about to apply one of rank 0's ops")
_BYE_GRACE_S = 5.0  # how long a closing peer waits for rank 0's BYE
_CHAINS = 16  # recent prefixes kept: a store usually extends the previous one
_ACK_EVERY = 4  # ops applied before an ack goes back even while more are buffered


class Replica:
    def __init__(self, rank: int, store: DiskStore, source: KVSource, sock: socket.socket,
                 reader: FrameReader, staged: StagedRows, stage_wait: float) -> None:
        self.rank = rank
        self.store = store
        self.source = source
        self.staged = staged
        self.stage_wait = stage_wait  # how long a staged row may lag rank 0's decision
        self._sock = sock
        self._reader = reader
        self._chains: collections.OrderedDict[bytes, list[bytes]] = collections.OrderedDict()
        self.applied = 0
        self.error: ReplicationError | None = None  # why the loop ended, if not BYE
        self._stop = threading.Event()
        # Invariant: every op with seq <= applied_through was applied (or failed and
        # said so in its ack): the ops rank 0 queued before a lease are on disk here.
        self.applied_through = 0
        self._applied_cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"phalanx-replica-{rank}",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> None:
        """Stop the loop (after BYE it has stopped already) and close the socket; the
        store is its owner's. Raises ReplicationError when the thread did not exit within
        ``timeout`` (the socket stays open, owed: a retry joins again)."""
        end = time.monotonic() + timeout
        # Rank 0 may be closing at this very moment (the Worker closes every rank's
        # services at once): let its BYE arrive, so that every op it queued is applied
        # and neither side reports the other's orderly close as a failure.
        self._thread.join(min(timeout / 2, _BYE_GRACE_S))
        self._stop.set()
        self._thread.join(max(0.0, end - time.monotonic()))
        if self._thread.is_alive():
            raise ReplicationError(
                f"rank {self.rank}: the replica thread did not exit within {timeout:.1f}s "
                "(blocked applying an op); its socket stays open until a retry")
        self._sock.close()

    def wait_applied(self, seq: int, timeout: float) -> None:
        """Until rank 0's ops up to ``seq`` are applied here; raises LinkStalledError
        naming this rank when they are not within ``timeout`` (or the link ended)."""
        end = time.monotonic() + timeout
        with self._applied_cond:
            while self.applied_through < seq:
                left = end - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    why = (f"its replication link ended: {self.error}" if self.error
                           else f"not within {timeout:.1f}s")
                    raise LinkStalledError(
                        f"rank {self.rank}: rank 0's ops up to {seq} are not applied here "
                        f"(applied through {self.applied_through}): {why}")
                self._applied_cond.wait(min(left, 0.2))

    def _loop(self) -> None:
        self._sock.settimeout(0.2)  # how late a stop request is noticed
        # Acks are cumulative (rank 0 credits every op up to an ack's seq), so of a run
        # of plain acks only the last is sent; acks that carry something (an error, a
        # digest, a crc) are always sent.
        acks: list[bytes] = []
        plain = 0  # seq of the last plain ack not sent yet (0: none)
        unacked = 0  # ops applied since the last send
        try:
            while not self._stop.is_set():
                frame = self._reader.read()
                if frame is None:
                    continue
                ack = self._apply(frame)
                with self._applied_cond:  # rank-side loads wait on this (wait_applied)
                    self.applied_through = max(self.applied_through, ack.seq)
                    self._applied_cond.notify_all()
                if ack.error or ack.digest or ack.crc:
                    acks.append(encode(ack))
                    plain = 0
                else:
                    plain = ack.seq
                unacked += 1
                # a request's op (a store, a load) is acked at once: its caller waits
                if (isinstance(frame, (Bye, StoreOp, LoadOp)) or unacked >= _ACK_EVERY
                        or not self._reader.buffered()):
                    if plain:
                        acks.append(encode(Ack(plain)))
                        plain = 0
                    self._sock.sendall(b"".join(acks))
                    acks.clear()
                    unacked = 0
                if isinstance(frame, Bye):
                    return
        except ReplicationError as exc:
            self.error = exc
            log.warning("rank %d: replication link ended: %s", self.rank, exc)
        except OSError as exc:
            self.error = LinkClosedError(f"rank {self.rank}: sending acks failed ({exc})")

    def _apply(self, frame: Frame) -> Ack:
        seq = getattr(frame, "seq", 0)
        try:
            _FP_APPLY.hit()
            if isinstance(frame, JobOp):
                self.store.apply_job(frame.job)
            elif isinstance(frame, StoreOp):
                self._store(frame)
            elif isinstance(frame, LoadOp):
                return Ack(seq, crc=self._load(frame))
            elif isinstance(frame, Reconcile):
                return Ack(seq, digest=self._reconcile(frame))
            elif isinstance(frame, Unstage):
                self.staged.drop((frame.key, frame.start), self.stage_wait, self._stop)
            elif not isinstance(frame, Bye):
                return Ack(seq, error=f"unexpected {type(frame).__name__} frame")
        except Exception as exc:  # noqa: BLE001  reported to rank 0, which fails the owner
            log.warning("rank %d: op %d failed: %r", self.rank, seq, exc)
            return Ack(seq, error=f"{type(exc).__name__}: {exc}")
        self.applied += 1
        return Ack(seq)

    def _prefix(self, parent: bytes, start: int) -> list[bytes]:
        if start == 0:
            return []
        keys = self._chains.get(parent)
        if keys is None or len(keys) != start:
            keys = self.store.prefix_keys(parent)  # walks the trie: rare (branch points)
        return keys

    def _store(self, op: StoreOp) -> None:
        keys = self._prefix(op.parent, op.start) + op.span
        chain = KeyChain(keys, self.store.geometry.page_tokens, self.store.fingerprint)
        row: Any
        if op.staged:
            row = self.staged.take((keys[-1], op.start), self.stage_wait, self._stop)
        else:
            row = op.row if op.row else self.source.row(keys, op.start)
        self.store.store(chain, row)
        self._chains[keys[-1]] = keys
        if len(self._chains) > _CHAINS:
            self._chains.popitem(last=False)

    def _load(self, op: LoadOp) -> int:
        chain = KeyChain(op.keys, self.store.geometry.page_tokens, self.store.fingerprint)
        view = self.store.load(chain, len(op.keys))
        self.source.loaded(op.keys, view)
        return zlib.crc32(view)

    def _reconcile(self, op: Reconcile) -> bytes:
        for key in op.discard:
            self.store.discard(key)
        for key in op.thin:
            self.store.apply_job(Job(JobKind.THIN, key=key))
        purged = self.store.purge_leftovers()
        if op.discard or purged:
            log.info("rank %d: reconciled: %d records discarded, %d leftovers purged",
                     self.rank, len(op.discard), purged)
        return records_digest(self.store.record_states())
