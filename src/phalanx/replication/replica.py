"""A peer rank's side of replication: apply rank 0's ops to this rank's own store.

One thread per replica reads ops in order, applies each to the rank's DiskStore with
bytes from the rank's KV source, and acks. Acks of a run of ops that arrived together go
back in one send (the leader's window refills in batches). Ops are applied strictly in
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
import zlib

from phalanx.kvstore.keys import KeyChain
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.kvstore.store import DiskStore
from phalanx.lifecycle.failpoints import Failpoint

from ._errors import LinkClosedError, ReplicationError
from .frames import (
    Ack,
    Bye,
    Frame,
    FrameReader,
    JobOp,
    LoadOp,
    Reconcile,
    StoreOp,
    encode,
    records_digest,
)
from .kv_source import KVSource

__all__ = ["Replica"]

log = logging.getLogger("phalanx.replication")

_FP_APPLY = Failpoint("cache.replica.apply", "a peer is about to apply one of rank 0's ops")
_CHAINS = 16  # recent prefixes kept: a store usually extends the previous one


class Replica:
    def __init__(self, rank: int, store: DiskStore, source: KVSource, sock: socket.socket,
                 reader: FrameReader) -> None:
        self.rank = rank
        self.store = store
        self.source = source
        self._sock = sock
        self._reader = reader
        self._chains: collections.OrderedDict[bytes, list[bytes]] = collections.OrderedDict()
        self.applied = 0
        self.error: ReplicationError | None = None  # why the loop ended, if not BYE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"phalanx-replica-{rank}",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout: float) -> list[str]:
        """Stop the loop (after BYE it has stopped already), close socket and store."""
        self._stop.set()
        self._thread.join(timeout)
        problems = []
        if self._thread.is_alive():
            problems.append(f"replica thread of rank {self.rank} did not exit in {timeout}s")
        else:
            self._sock.close()
        self.store.close()
        return problems

    def _loop(self) -> None:
        self._sock.settimeout(0.2)  # how late a stop request is noticed
        # Acks are cumulative (rank 0 credits every op up to an ack's seq), so of a run
        # of plain acks only the last is sent; acks that carry something (an error, a
        # digest, a crc) are always sent.
        acks: list[bytes] = []
        plain = 0  # seq of the last plain ack not sent yet (0: none)
        try:
            while not self._stop.is_set():
                frame = self._reader.read()
                if frame is None:
                    continue
                ack = self._apply(frame)
                if ack.error or ack.digest or ack.crc:
                    acks.append(encode(ack))
                    plain = 0
                else:
                    plain = ack.seq
                if isinstance(frame, Bye) or not self._reader.buffered():
                    if plain:
                        acks.append(encode(Ack(plain)))
                        plain = 0
                    self._sock.sendall(b"".join(acks))
                    acks.clear()
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
