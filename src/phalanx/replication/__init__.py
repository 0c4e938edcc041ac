"""The replication layer: rank 0 decides, every rank mirrors (see docs/architecture.md, Layers).

Each rank keeps its own shard of every cached prefix in its own :class:`DiskStore`
(``phalanx.kvstore``); rank 0 decides every record operation and replicates it to its
peers over authenticated, flow-controlled links, so the ranks' record sets stay
identical. :class:`ReplicatedCache` is the parent-side facade (operators and tests);
:class:`RankCache` (``rank_cache(cache_id)`` in a task running in a rank) is each rank's
side and the engine's API: ``lookup_many`` -> :class:`Lease`, ``load_many``,
``store_many`` -> :class:`StoreTicket`; ``RankCache.leader`` is rank 0's decider.
KV sources give each rank's bytes. Sits above :mod:`phalanx.runtime`.
"""

from ._errors import (
    LinkAuthError,
    LinkClosedError,
    LinkProtocolError,
    LinkStalledError,
    PeerJobError,
    ReplicaDivergedError,
    ReplicationError,
)
from .kv_source import KVSource, KVSourceFactory, SyntheticSource
from .leader import Leader, MaintainReport
from .rank_api import Lease, StoreTicket
from .rank_cache import RankCache, rank_cache
from .replicated import ReplicatedCache, check_states, rank_directories

__all__ = [
    "KVSource",
    "KVSourceFactory",
    "Leader",
    "Lease",
    "LinkAuthError",
    "LinkClosedError",
    "LinkProtocolError",
    "LinkStalledError",
    "MaintainReport",
    "PeerJobError",
    "RankCache",
    "ReplicaDivergedError",
    "ReplicatedCache",
    "ReplicationError",
    "StoreTicket",
    "SyntheticSource",
    "check_states",
    "rank_cache",
    "rank_directories",
]
