"""The disk tier across hosts: each host's ranks keep their shards on that host's disk.

:class:`HostsDiskCache` is the part of :class:`~phalanx.replication.ReplicatedCache` the
engine's disk tier uses (``store``, ``poll``, ``stats``, ``close``, ``cache_id``), driven
over a :class:`~phalanx.hosts.MultiHostWorker` instead of a local Worker: every call is a
named function below with typed arguments (the control plane carries no pickles), and
every rank's side is the same :class:`~phalanx.replication.RankCache` as on one host.
Rank 0 listens on node 0's job address; each other rank connects to it from its own
host with the job token (which reaches a rank by its environment, never in a frame), so
the replication links, their credits and the start-up reconciliation cross hosts as
they are.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.hosts.functions import resolve
from phalanx.runtime import rank_services

from ...kvstore import Geometry, KeyChain
from ...lifecycle import CleanupError
from ...replication import MaintainReport, RankCache, check_states, rank_cache, rank_directories
from ...replication.rank_cache import OpenConfig, service_name

__all__ = ["CacheSpec", "HostsDiskCache"]

_ids = itertools.count(1)
_SETTLE_S = 10.0


@dataclass(frozen=True)
class CacheSpec:
    """What every rank needs to open its side (typed: it crosses hosts)."""

    directories: list[str]
    geometry: Geometry
    fingerprint: bytes  # a text fingerprint is its UTF-8 (as fingerprint_digest reads it)
    capacity_bytes: int
    max_age: float | None
    job_timeout: float
    window: int
    reserve: int
    fsync: bool
    # the KV source each rank's side reads from and writes to, by name: the engine's
    # staging (the runner's pages), or a synthetic one for operator tools and tests
    kv_source: str = "phalanx.engine.disk.staging:staging_source"


def _config(spec: CacheSpec) -> Any:

    return OpenConfig(spec.directories, spec.geometry, spec.fingerprint, spec.capacity_bytes,
                      spec.max_age, resolve(spec.kv_source), spec.job_timeout, spec.window,
                      spec.reserve, os.environ.get("PHALANX_NODE_ADDR", "127.0.0.1"),
                      spec.fsync)


def _token() -> str:
    token = os.environ.get("PHALANX_JOB_TOKEN", "")
    if not token:
        raise RuntimeError("this rank has no PHALANX_JOB_TOKEN: it was not started by a "
                           "host agent of a multi-host job")
    return token


# -- the rank side (named by module:function) -------------------------------------------

def open_leader(cache_id: str, spec: CacheSpec) -> int:
    """Rank 0: open its store (recovery) and listen on node 0's address; the port."""

    cache = RankCache.create(cache_id, _config(spec), rank=0)
    cache.open_store()
    return cache.listen()


def accept_peers(cache_id: str, peers: list[int], timeout: float) -> dict[str, Any]:
    """Rank 0: accept and authenticate every peer, reconcile; the report."""

    return rank_cache(cache_id).accept(peers, _token(), timeout)


def open_replica(cache_id: str, spec: CacheSpec, rank: int, host: str, port: int,
                 timeout: float) -> int:
    """Rank ``rank`` (job-wide): open its store, connect to rank 0; its records."""

    # this host's copy of the cache directory (node 0 made its own): private to the user
    os.makedirs(os.path.dirname(spec.directories[rank]), mode=0o700, exist_ok=True)
    cache = RankCache.create(cache_id, _config(spec), rank=rank)
    records = cache.open_store()
    cache.connect(host, port, _token(), timeout)
    return records


def store_keys(cache_id: str, keys: list[bytes], page_tokens: int, fingerprint: bytes) -> int:
    """Rank 0: store the uncached suffix of the chain on every rank; pages stored."""

    r = rank_cache(cache_id).leader.store_chain(KeyChain(keys, page_tokens, fingerprint))
    return r.end_page - r.start_page if r.stored else 0


def poll(cache_id: str, max_jobs: int) -> int:

    return rank_cache(cache_id).leader.poll(max_jobs)


def maintain(cache_id: str, timeout: float | None) -> MaintainReport:
    """Rank 0: maintenance to completion on every rank (decided, applied, acked)."""

    return rank_cache(cache_id).leader.maintain(timeout)


def state(cache_id: str) -> dict[str, Any]:

    return rank_cache(cache_id).state()


def close_side(cache_id: str, timeout: float) -> None:

    cache = rank_services().find(service_name(cache_id), RankCache)
    if cache is None:
        return  # never opened here, or closed already
    cache.close(timeout)
    rank_services().close(service_name(cache_id))


# -- node 0's side ----------------------------------------------------------------------

class HostsDiskCache:
    """The replicated disk tier of a multi-host job; see the module docstring."""

    def __init__(self, hosts: Any, cache_id: str, report: dict[str, Any],
                 close_timeout: float) -> None:
        self.hosts, self.cache_id, self.report = hosts, cache_id, report
        self.close_timeout = close_timeout
        self._closed = False

    @classmethod
    def open(cls, hosts: Any, directory: str, *, geometry: Geometry,
             fingerprint: str | bytes, capacity_bytes: int, max_age: float | None = None,
             job_timeout: float = 30.0, window: int = 64, connect_timeout: float = 60.0,
             close_timeout: float = 30.0,
             kv_source: str = CacheSpec.kv_source) -> HostsDiskCache:
        """Recover every rank's store on its host, connect the links, reconcile."""

        ranks = list(hosts.ranks)
        cid = f"rch{os.getpid()}-{next(_ids)}"
        fp = fingerprint.encode() if isinstance(fingerprint, str) else fingerprint
        spec = CacheSpec(rank_directories(directory, len(ranks)), geometry, fp,
                         capacity_bytes, max_age, job_timeout, window, window // 4, False,
                         kv_source)
        t = connect_timeout + _SETTLE_S
        opening: list[concurrent.futures.Future[Any]] = []
        try:
            port = hosts.call(0, open_leader, cid, spec, timeout=t)
            accept = hosts.submit(0, accept_peers, cid, ranks[1:], connect_timeout,
                                  timeout=t)
            host = hosts.node_addr(0)
            replicas = [hosts.submit(r, open_replica, cid, spec, r, host, port,
                                     connect_timeout, timeout=t) for r in ranks[1:]]
            opening = replicas
            concurrent.futures.wait([accept, *replicas], timeout=t + _SETTLE_S,
                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in replicas:  # a replica's own failure is the news; rank 0's follows
                exc = f.exception() if f.done() else None
                if exc is not None:
                    raise exc
            report: dict[str, Any] = accept.result(timeout=t + _SETTLE_S)
        except BaseException:
            # every rank is asked: a side that never opened is a no-op to close; the
            # replicas still opening end before theirs are (see _close_ranks)
            cls._close_ranks(hosts, cid, ranks, close_timeout, opening, t + _SETTLE_S)
            raise
        return cls(hosts, cid, report, close_timeout)

    def store(self, chain: KeyChain) -> int:
        return int(self.hosts.call(0, store_keys, self.cache_id, list(chain.keys),
                                   chain.page_tokens, chain.fingerprint))

    def poll(self, max_jobs: int = 32) -> int:
        return int(self.hosts.call(0, poll, self.cache_id, max_jobs))

    def maintain(self, timeout: float | None = None) -> MaintainReport:
        """Maintenance to completion on every rank; a peer that stalls or a host that is
        lost fails it naming the peer (LinkStalledError, HostLostError)."""
        t = (self.hosts.task_timeout if timeout is None else timeout) + _SETTLE_S
        report: MaintainReport = self.hosts.call(0, maintain, self.cache_id, timeout,
                                                 timeout=t)
        return report

    def check(self, timeout: float | None = None) -> list[str]:
        """Every rank's store check plus cross-rank identity of the record sets."""

        return check_states(self.stats(timeout))

    def stats(self, timeout: float | None = None) -> dict[int, dict[str, Any]]:
        """rank -> its state; a rank that does not answer is reported in its entry."""
        t = self.close_timeout if timeout is None else timeout
        futs = {r: self.hosts.submit(r, state, self.cache_id, timeout=t)
                for r in self.hosts.ranks}
        out: dict[int, dict[str, Any]] = {}
        for r, f in futs.items():
            try:
                out[r] = f.result(timeout=t + _SETTLE_S)
            except Exception as exc:  # noqa: BLE001  reported in the rank's entry
                out[r] = {"error": f"{type(exc).__name__}: {exc}",
                          "problems": [f"unreachable: {exc}"], "digest": None}
        return out

    @staticmethod
    def _close_ranks(hosts: Any, cid: str, ranks: list[int], timeout: float,
                     opening: Sequence[concurrent.futures.Future[Any]] = (),
                     opening_timeout: float = 0.0) -> list[str]:
        """Rank 0's side closed first (it drains and says BYE), then the others'. After
        a failed open, ``opening``: the replicas' opens, waited for between the two, so a
        replica still connecting fails (its leader is gone) before its side is closed
        instead of registering it after."""
        if hosts.dead is not None:
            return []  # the job is over: each host's agent stops its ranks, sides and all
        problems = []
        for group in ([0], [r for r in ranks if r != 0]):
            if group != [0] and opening:  # as long as an open may take
                _, late = concurrent.futures.wait(opening, timeout=opening_timeout)
                if late:
                    problems.append(f"{len(late)} replica(s) still opening after "
                                    f"{opening_timeout:g}s: their ranks' services close "
                                    f"them at shutdown")
            futs = {r: hosts.submit(r, close_side, cid, timeout * 0.9, timeout=timeout)
                    for r in group}
            for r, f in futs.items():
                try:
                    f.result(timeout=timeout + _SETTLE_S)
                except Exception as exc:  # noqa: BLE001  every rank is still asked
                    problems.append(f"rank {r}: {exc}")
        return problems

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        problems = self._close_ranks(self.hosts, self.cache_id, list(self.hosts.ranks),
                                     self.close_timeout if timeout is None else timeout)
        if problems:

            raise CleanupError(f"disk tier {self.cache_id} across hosts: closing failed: "
                               f"{'; '.join(problems)}",
                               [RuntimeError(p) for p in problems])
