"""The rank side of a replicated cache: everything one rank owns for one cache.

One :class:`RankCache` per rank and cache. It is registered in the rank's service
registry (``phalanx.runtime.rank_services()``) under ``replication.cache/<cache id>``
the moment it exists, so the rank's services journal closes it even when the parent
never asks (a failed close, a parent that died). Tasks reach it by cache id with
:func:`rank_cache`; nothing lives in a module global.

Ownership: every resource it acquires becomes an entry of its cleanup journal right
after the acquisition succeeded, and :meth:`RankCache.close` runs them newest first,
every step even when one fails, raising one :class:`~phalanx.lifecycle.CleanupError`
with every failure (a failed step stays owed; a second close retries only it):

* the DiskStore (every rank), closed last;
* rank 0: the listener (closed as soon as every peer connected), one PeerLink per
  peer (threads and socket), the Leader's BYE to every peer (first: drain, then say
  goodbye, then close the links), the background store thread of ``store_many``;
* a peer: the Replica (its thread and socket) and its staged rows.

The engine's API (``load_many``, ``lookup_many``/``release``, ``store_many``) is on
this class; its machinery (leases, store tickets, rank 0's store thread) is in
:mod:`phalanx.replication.rank_api`.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from phalanx.kvstore import StoreOptions
from phalanx.kvstore.geometry import Geometry
from phalanx.kvstore.keys import KeyChain, Tokens
from phalanx.kvstore.loads import Destination, LoadRequest
from phalanx.kvstore.store import DiskStore
from phalanx.kvstore.stores import StoreItem
from phalanx.lifecycle import CleanupError
from phalanx.lifecycle.journal import CleanupJournal
from phalanx.runtime import current_rank, rank_services

from ._errors import LinkStalledError, ReplicationError
from .frames import RecordSet, records_digest
from .kv_source import KVSource, KVSourceFactory
from .leader import JobCollector, Leader
from .link import PeerLink, accept_peer, connect_leader, listen
from .rank_api import Lease, LeaseTable, StoreThread, StoreTicket
from .replica import Replica
from .staging import StagedRows, row_start

__all__ = ["OpenConfig", "RankCache", "rank_cache", "service_name"]

T = TypeVar("T")
_PEER_CAPACITY = 1 << 62  # a peer never evicts by itself: rank 0 decides


@dataclass(frozen=True)
class OpenConfig:
    """What every rank needs to open its side (pickled to the ranks at open)."""

    directories: Sequence[str]  # one per rank
    geometry: Geometry
    fingerprint: str | bytes
    capacity_bytes: int
    max_age: float | None
    kv_source_factory: KVSourceFactory
    job_timeout: float
    window: int
    reserve: int
    bind_host: str
    fsync: bool


def service_name(cache_id: str) -> str:
    """The rank-service name of cache ``cache_id``."""
    return f"replication.cache/{cache_id}"


def rank_cache(cache_id: str) -> RankCache:
    """This rank's side of cache ``cache_id``; call it from a task running in a rank
    (``ReplicatedCache.cache_id`` names it). Raises ServiceNotFoundError when the cache
    is not open on this rank."""
    return rank_services().get(service_name(cache_id), RankCache)


class RankCache:
    """One rank's side of one replicated cache. See the module docstring."""

    def __init__(self, cache_id: str, rank: int, config: OpenConfig) -> None:
        self.cache_id = cache_id
        self.rank = rank
        self.config = config
        self.close_timeout = 30.0  # what the services journal's close step allows
        self._journal = CleanupJournal(f"rank {rank}: replicated cache {cache_id}")
        self._deadline = 0.0  # of the close under way: every step shares it
        self._store: DiskStore | None = None
        self._source: KVSource | None = None
        self._collector = JobCollector()
        self._listener: socket.socket | None = None
        self._links: dict[int, PeerLink] = {}
        self._leader: Leader | None = None
        self._replica: Replica | None = None
        self.staged = StagedRows(rank)
        self._farewells: list[Exception] = []  # peers that did not ack BYE (see close)
        self._stores: StoreThread | None = None  # rank 0: store_many's decider
        self._leases: LeaseTable | None = None  # rank 0: lookup_many's pins
        self._accept_cancelled = threading.Event()  # a peer's open failed: stop accepting

    # -- opening (one typed task per step: _rank_tasks.py) ------------------------------
    @classmethod
    def create(cls, cache_id: str, config: OpenConfig, rank: int | None = None) -> RankCache:
        """A new, empty side registered at once in this rank's services (owner at birth).
        ``rank``: this rank's place in the cache (default: its rank in its Worker; a job
        of several hosts gives the job-wide rank, its Worker holding only that host's)."""
        if current_rank() is None:
            raise ReplicationError(f"cache {cache_id}: a rank side opens in a rank process only")
        rank = current_rank() if rank is None else rank
        if rank is None:
            raise ReplicationError(f"cache {cache_id}: a rank side opens in a rank process only")
        cache = cls(cache_id, rank, config)
        rank_services().register(service_name(cache_id), cache,
                                 lambda: cache.close(cache.close_timeout))
        cache._journal.add("drop staged rows", cache.staged.clear)
        return cache

    def open_store(self) -> int:
        """Open this rank's DiskStore (recovery); returns the records it recovered."""
        cfg = self.config
        if self.rank == 0:
            store = DiskStore(cfg.directories[0], cfg.geometry, cfg.fingerprint,
                              StoreOptions(cfg.capacity_bytes, cfg.max_age, fsync=cfg.fsync,
                                           progress=False), on_job=self._collector)
        else:
            store = DiskStore(cfg.directories[self.rank], cfg.geometry, cfg.fingerprint,
                              StoreOptions(_PEER_CAPACITY, fsync=cfg.fsync, progress=False))
        self._journal.add("close the store", store.close)
        self._store = store
        self._source = cfg.kv_source_factory(cfg.geometry, self.rank)
        return len(store.record_states())

    def listen(self) -> int:
        """Rank 0: listen for the peers; returns the port."""
        listener = listen(self.config.bind_host)
        self._journal.add("close the listener", listener.close)
        self._listener = listener
        port: int = listener.getsockname()[1]
        return port

    def accept(self, peers: list[int], token: str, timeout: float) -> dict[str, Any]:
        """Rank 0: accept and authenticate every peer, reconcile; the reconciliation
        report. On failure what this step opened stays in the journal (close rolls it
        back)."""
        store, source, listener = self.store, self._need(self._source), self._need(self._listener)
        cfg = self.config
        deadline = time.monotonic() + timeout
        sets: dict[int, RecordSet] = {}
        while len(sets) < len(peers):
            rank, host, sock, reader, records = accept_peer(
                listener, token, set(peers) - set(sets), deadline, self._accept_cancelled)
            try:
                link = PeerLink(rank, host, sock, reader, cfg.window, cfg.job_timeout)
            except BaseException:  # the socket is ours until the link owns it
                sock.close()
                raise
            self._journal.add(f"close the link to peer rank {rank}",
                              functools.partial(self._close_link, link))
            self._links[rank] = link
            sets[rank] = records
        self._journal.run_only("close the listener")  # every peer is in: no more accepts
        self._listener = None
        leader = Leader(store, self._collector, source, self._links, reserve=cfg.reserve)
        self._journal.add("say BYE to every peer", functools.partial(self._say_bye, leader))
        self._leader = leader
        writer = StoreThread(leader, cfg.job_timeout)
        self._journal.add("stop the store thread", lambda: writer.close(self._left()))
        self._stores = writer
        leases = LeaseTable(leader)
        self._journal.add("release every lease", leases.release_all)
        self._leases = leases
        p = leader.reconcile(sets)
        return {"discarded": len(p.discard), "thinned": len(p.thin), "missing": p.missing,
                "extra": p.extra, "records": len(store.record_states())}

    def cancel_accept(self) -> None:
        """Rank 0: stop waiting for peers (a peer's open failed; its error is the news)."""
        self._accept_cancelled.set()

    def connect(self, host: str, port: int, token: str, timeout: float) -> int:
        """A peer: connect to rank 0 and authenticate, then mirror; returns the records
        this peer recovered."""
        store, source = self.store, self._need(self._source)
        states = store.record_states()
        rs = RecordSet(list(states), list(states.values()))
        sock, reader = connect_leader(host, port, self.rank, token,
                                      socket.gethostname(), rs, time.monotonic() + timeout)
        try:
            replica = Replica(self.rank, store, source, sock, reader, self.staged,
                              self.config.job_timeout / 2)
        except BaseException:  # the socket is ours until the replica owns it
            sock.close()
            raise
        self._journal.add("stop the replica", lambda: replica.close(self._left()))
        self._replica = replica
        return len(states)

    # -- the engine's API (rank_api.py) --------------------------------------------------
    def lookup_many(self, prefixes: Sequence[Tokens | KeyChain]) -> Lease:
        """Rank 0: pages cached of each prefix, pinned until :meth:`release`; hand the
        lease to every rank's ``load_many`` (it is plain data)."""
        return self._rank0_leases().take(prefixes)

    def release(self, lease: Lease) -> None:
        """Rank 0: unpin what ``lease`` reported, once the step that used it finished on
        every rank (then rank 0 may decide to evict it again)."""
        self._rank0_leases().release(lease)

    def load_many(self, requests: Sequence[LoadRequest], lease: Lease | None = None
                  ) -> list[Destination]:
        """This rank's shard of each request ``(tokens, n_pages[, out])``, read from its
        own store straight into ``out`` (the caller's buffer or a ``PageScatter`` of the
        buffers its pages go to) where given; views in
        request order. On a peer, ``lease`` (from rank 0's lookup_many) makes it wait
        until it applied what rank 0 had queued to it then (LinkStalledError after the
        job timeout). Takes no lock that stores or maintenance wait on."""
        if lease is not None and self._replica is not None:
            self._replica.wait_applied(lease.through.get(self.rank, 0),
                                       self.config.job_timeout)
        return self.store.load_many(requests)

    def store_many(self, rows: Sequence[StoreItem]) -> StoreTicket:
        """Every rank calls it with the same rows (tokens, its own shard's bytes), in the
        same order: the bytes are copied now, so the caller may reuse its memory when
        this returns. Rank 0 decides and writes them in the background and sends each
        peer its decisions; ``ticket.wait()`` on rank 0 gives the results or the
        refusal (then no rank keeps the rows, nor a staged copy)."""
        if self.rank == 0:
            return self._need(self._stores).submit(rows)
        store, pb = self.store, self.config.geometry.page_bytes
        for tokens, row in rows:
            keys = tokens.keys if isinstance(tokens, KeyChain) else store.chain(tokens).keys
            self.staged.put((keys[-1], row_start(len(keys), row, pb)), row)
        return StoreTicket(len(rows), done=True)

    def wait_replicated(self, timeout: float) -> None:
        """Rank 0: until every peer applied everything queued so far (tests, shutdown of
        a step loop); raises LinkStalledError naming the peers that did not."""
        left = self.leader.drain(timeout)
        if left:
            raise LinkStalledError(f"rank 0: peers did not apply everything within "
                                   f"{timeout:.1f}s: {left}")

    # -- what tasks use -----------------------------------------------------------------
    @property
    def store(self) -> DiskStore:
        """This rank's own store."""
        return self._need(self._store)

    @property
    def source(self) -> KVSource:
        return self._need(self._source)

    @property
    def leader(self) -> Leader:
        """Rank 0's decider (stores, lookups, maintenance, replication to the peers)."""
        if self._leader is None:
            raise self._not_leader()
        return self._leader

    def state(self) -> dict[str, Any]:
        """This rank's check(), statistics and record-set digest (check() and stats())."""
        store = self.store
        extra: dict[str, Any]
        if self._replica is not None:
            src = self.source
            source = {k: v for k, v in vars(src).items() if k != "_buf" and k != "page_bytes"
                      and isinstance(v, int | float | str)} if hasattr(src, "__dict__") else {}
            extra = {"applied": self._replica.applied,
                     "link_error": str(self._replica.error or ""), "source": source}
        else:
            leader = self.leader
            extra = {"jobs_sent": dict(leader.jobs_sent),
                     "links": {r: ln.describe() for r, ln in leader.links.items()}}
        extra["staged_rows"] = len(self.staged)
        extra["leases"] = len(self._leases) if self._leases is not None else 0
        return {"rank": self.rank, "pid": os.getpid(), "problems": store.check(),
                "digest": records_digest(store.record_states()).hex(),
                "stats": msgspec.structs.asdict(store.statistics()), **extra}

    # -- closing ------------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Run every owed close step within ``timeout`` (shared); raises one
        CleanupError with every failure: each step that failed (it stays owed: a retry
        runs only it) and each peer that did not say goodbye (reported once: a BYE
        holds nothing, so it is not retried)."""
        self._deadline = time.monotonic() + timeout
        errors: list[Exception] = []
        try:
            self._journal.run()
        except CleanupError as exc:
            errors += exc.exceptions
        errors = self._farewells + errors
        self._farewells = []
        if errors:
            raise CleanupError(
                f"rank {self.rank}: closing replicated cache {self.cache_id} failed "
                f"({len(errors)} error(s)); steps still owed: {self._journal.pending()}",
                errors)

    def _say_bye(self, leader: Leader) -> None:
        try:
            leader.close(self._left())
        except CleanupError as exc:  # a peer that did not drain: reported by close()
            self._farewells += exc.exceptions

    def _rank0_leases(self) -> LeaseTable:
        if self._leases is None:
            raise self._not_leader()
        return self._leases

    def _not_leader(self) -> ReplicationError:
        where = "is not rank 0" if self.rank else "has not finished opening"
        return ReplicationError(f"cache {self.cache_id}: rank {self.rank} {where}: only "
                                "rank 0 decides")

    def _left(self) -> float:
        return max(0.1, self._deadline - time.monotonic())

    def _close_link(self, link: PeerLink) -> None:
        link.close(self._left())

    def _need(self, value: T | None) -> T:
        if value is None:
            raise ReplicationError(f"cache {self.cache_id}: rank {self.rank} is not open yet")
        return value
