"""Task functions that run *in rank processes* for ReplicatedCache (replicated.py).

Rank-side state lives in a module-level registry keyed by cache id, so the parent
holds only ids and every store, link and thread is owned by the rank that uses it.
Each function is submitted by reference (this module is importable in every rank).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from phalanx.kvstore.geometry import Geometry
from phalanx.kvstore.keys import KeyChain
from phalanx.kvstore.store import DiskStore
from phalanx.runtime import _context

from ._errors import ReplicationError
from .frames import RecordSet, records_digest
from .kv_source import KVSource, KVSourceFactory
from .leader import JobCollector, Leader
from .link import PeerLink, accept_peer, connect_leader, listen
from .replica import Replica
from .synth import synthesize

__all__ = ["OpenConfig"]

_PEER_CAPACITY = 1 << 62  # a peer never evicts by itself: rank 0 decides


@dataclass(frozen=True)
class OpenConfig:
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


class _Opening:
    """Rank 0 between ``leader_open`` and ``leader_accept``: store and listener."""

    def __init__(self, store: DiskStore, collector: JobCollector, source: KVSource,
                 listener: socket.socket) -> None:
        self.store = store
        self.collector = collector
        self.source = source
        self.listener = listener


_REGISTRY: dict[str, Leader | Replica | _Opening] = {}


def _rank() -> int:
    rank = _context.current_rank()
    if rank is None:
        raise ReplicationError("replicated-cache tasks run in rank processes only")
    return rank


def _token() -> str:
    token = _context.job_token()
    if token is None:
        raise ReplicationError("this rank has no job token: start it through a Worker")
    return token


def leader_open(cid: str, cfg: OpenConfig) -> int:
    """Open rank 0's store (recovery) and listen; returns the port peers connect to."""
    collector = JobCollector()
    store = DiskStore(cfg.directories[0], cfg.geometry, cfg.fingerprint, cfg.capacity_bytes,
                      cfg.max_age, fsync=cfg.fsync, on_job=collector, progress=False)
    try:
        listener = listen(cfg.bind_host)
    except BaseException:  # the store is ours until registered
        store.close()
        raise
    _REGISTRY[cid] = _Opening(store, collector, cfg.kv_source_factory(cfg.geometry, 0),
                              listener)
    port: int = listener.getsockname()[1]
    return port


def leader_accept(cid: str, cfg: OpenConfig, peers: list[int], timeout: float) -> dict[str, Any]:
    """Accept and authenticate every peer, reconcile; returns the reconciliation report."""
    opening = _REGISTRY[cid]
    assert isinstance(opening, _Opening)
    deadline = time.monotonic() + timeout
    links: dict[int, PeerLink] = {}
    sets: dict[int, RecordSet] = {}
    try:
        with opening.listener:
            while len(links) < len(peers):
                rank, host, sock, reader, records = accept_peer(
                    opening.listener, _token(), set(peers) - set(links), deadline)
                links[rank] = PeerLink(rank, host, sock, reader, cfg.window, cfg.job_timeout)
                sets[rank] = records
        leader = Leader(opening.store, opening.collector, opening.source, links,
                        reserve=cfg.reserve)
        _REGISTRY[cid] = leader
        p = leader.reconcile(sets)
    except BaseException:  # roll back what this step opened, then re-raise as is
        for link in links.values():
            link.close(1.0)
        opening.store.close()
        _REGISTRY.pop(cid, None)
        raise
    return {"discarded": len(p.discard), "thinned": len(p.thin), "missing": p.missing,
            "extra": p.extra, "records": len(opening.store.record_states())}


def replica_open(cid: str, cfg: OpenConfig, host: str, port: int, timeout: float) -> int:
    """Open this peer's store, connect and authenticate; returns its recovered records."""
    rank = _rank()
    store = DiskStore(cfg.directories[rank], cfg.geometry, cfg.fingerprint, _PEER_CAPACITY,
                      None, fsync=cfg.fsync, progress=False)
    try:
        states = store.record_states()
        rs = RecordSet(list(states), list(states.values()))
        sock, reader = connect_leader(host, port, rank, _token(), socket.gethostname(), rs,
                                      time.monotonic() + timeout)
    except BaseException:  # the store is ours until registered
        store.close()
        raise
    _REGISTRY[cid] = Replica(rank, store, cfg.kv_source_factory(cfg.geometry, rank), sock,
                             reader)
    return len(states)


def close_rank(cid: str, timeout: float) -> list[str]:
    """Close this rank's side; returns problems (what did not drain or exit)."""
    state = _REGISTRY.pop(cid, None)
    if state is None:
        return []
    if isinstance(state, _Opening):
        state.listener.close()
        state.store.close()
        return []
    return state.close(timeout)


def leader_call(cid: str, method: str, *args: Any) -> Any:
    """Run one of rank 0's operations (store, load, lookup, poll, maintain, drain)."""
    leader = _REGISTRY[cid]
    if not isinstance(leader, Leader):
        raise ReplicationError(f"cache {cid} is not open on rank 0")
    if method in ("store", "load"):
        tokens = args[0]
        chain = tokens if isinstance(tokens, KeyChain) else leader.store.chain(tokens)
        if method == "store":
            return leader.store_chain(chain, args[1])
        return leader.load_chain(chain, args[1])
    if method == "lookup":
        return leader.lookup(args[0])
    if method == "poll":
        return leader.poll(args[0])
    if method == "maintain":
        return leader.maintain(args[0])
    if method == "synth":
        return synthesize(leader, *args)
    raise ValueError(f"unknown leader method {method!r}")


def rank_state(cid: str) -> dict[str, Any]:
    """This rank's check(), statistics and record-set digest (for check() and stats())."""
    state = _REGISTRY[cid]
    if isinstance(state, _Opening):
        raise ReplicationError(f"cache {cid} is still opening on this rank")
    store = state.store
    stats = store.statistics()
    extra: dict[str, Any] = {}
    if isinstance(state, Replica):
        extra = {"applied": state.applied, "link_error": str(state.error or ""),
                 "source": vars(state.source).copy() if hasattr(state.source, "__dict__")
                 else {}}
        extra["source"].pop("page_bytes", None)
    else:
        extra = {"jobs_sent": dict(state.jobs_sent),
                 "links": {r: ln.describe() for r, ln in state.links.items()}}
    return {"rank": _rank(), "pid": os.getpid(), "problems": store.check(),
            "digest": records_digest(store.record_states()).hex(),
            "stats": msgspec.structs.asdict(stats), **extra}


def leader_run(cid: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(leader, *args)`` on rank 0 (benchmarks: a whole measurement loop in one
    task, no parent round trip per job). ``fn`` must be importable by reference."""
    leader = _REGISTRY[cid]
    if not isinstance(leader, Leader):
        raise ReplicationError(f"cache {cid} is not open on rank 0")
    return fn(leader, *args)
