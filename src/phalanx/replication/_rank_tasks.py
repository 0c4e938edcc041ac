"""The tasks ReplicatedCache (replicated.py) submits to the ranks: one typed function
per operation, submitted by reference (this module is importable in every rank).

Each takes the cache id first and finds the rank's side in the rank's services
(:func:`~phalanx.replication.rank_cache.rank_cache`); the parent holds only the id.
A reader or a type checker follows a call from ``ReplicatedCache.store`` to
:func:`leader_store` to ``Leader.store_chain``; nothing is dispatched by name.
"""

from __future__ import annotations

from typing import Any

from phalanx.kvstore.keys import KeyChain, Tokens
from phalanx.kvstore.store import StoreResult
from phalanx.runtime import rank_services

from .leader import MaintainReport
from .rank_cache import OpenConfig, RankCache, rank_cache, service_name
from .synth import SynthReport, synthesize

__all__ = [
    "close_rank", "leader_accept", "leader_cancel_accept", "leader_load", "leader_lookup",
    "leader_maintain", "leader_open", "leader_poll", "leader_store", "leader_synth",
    "rank_state", "replica_open",
]


# -- opening and closing ---------------------------------------------------------------
def leader_open(cache_id: str, config: OpenConfig) -> int:
    """Rank 0: register its side, open its store (recovery) and listen; the port."""
    cache = RankCache.create(cache_id, config)
    cache.open_store()
    return cache.listen()


def leader_accept(cache_id: str, peers: list[int], token: str,
                  timeout: float) -> dict[str, Any]:
    """Rank 0: accept and authenticate the peers, reconcile; the reconciliation report."""
    return rank_cache(cache_id).accept(peers, token, timeout)


def leader_cancel_accept(cache_id: str) -> None:
    """Rank 0: stop waiting for peers (one's open failed)."""
    cache = rank_services().find(service_name(cache_id), RankCache)
    if cache is not None:
        cache.cancel_accept()


def replica_open(cache_id: str, config: OpenConfig, host: str, port: int, token: str,
                 timeout: float) -> int:
    """A peer: register its side, open its store, connect to rank 0; its records."""
    cache = RankCache.create(cache_id, config)
    records = cache.open_store()
    cache.connect(host, port, token, timeout)
    return records


def close_rank(cache_id: str, timeout: float) -> None:
    """Close this rank's side within ``timeout``; raises one CleanupError with every
    failed step (they stay owed: the rank's shutdown retries them)."""
    cache = rank_services().find(service_name(cache_id), RankCache)
    if cache is None:
        return  # never opened here (an open that failed early), or closed already
    cache.close(timeout)  # its own CleanupError, as is (not wrapped by the registry's)
    cache.close_timeout = timeout
    rank_services().close(service_name(cache_id))  # closed: unregister (a no-op step)


# -- rank 0's decisions ------------------------------------------------------------------
def _chain(cache: RankCache, tokens: Tokens | KeyChain) -> KeyChain:
    return tokens if isinstance(tokens, KeyChain) else cache.store.chain(tokens)


def leader_store(cache_id: str, tokens: Tokens | KeyChain,
                 from_page: int | None) -> StoreResult:
    cache = rank_cache(cache_id)
    return cache.leader.store_chain(_chain(cache, tokens), from_page)


def leader_lookup(cache_id: str, tokens: Tokens | KeyChain) -> int:
    return rank_cache(cache_id).leader.lookup(tokens)


def leader_load(cache_id: str, tokens: Tokens | KeyChain, n_pages: int) -> dict[int, int]:
    cache = rank_cache(cache_id)
    return cache.leader.load_chain(_chain(cache, tokens), n_pages)


def leader_poll(cache_id: str, max_jobs: int) -> int:
    return rank_cache(cache_id).leader.poll(max_jobs)


def leader_maintain(cache_id: str, timeout: float | None) -> MaintainReport:
    return rank_cache(cache_id).leader.maintain(timeout)


def leader_synth(cache_id: str, records: int, shape: str, seed: int,
                 group: int) -> SynthReport:
    return synthesize(rank_cache(cache_id).leader, records, shape, seed, group)


# -- audit -------------------------------------------------------------------------------
def rank_state(cache_id: str) -> dict[str, Any]:
    """This rank's check(), statistics and record-set digest."""
    return rank_cache(cache_id).state()
