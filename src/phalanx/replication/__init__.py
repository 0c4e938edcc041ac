"""The replication layer: rank 0 decides, every rank mirrors (see DESIGN.md, Layers).

Each rank keeps its own shard of every cached prefix in its own :class:`DiskStore`
(``phalanx.kvstore``); rank 0 decides every record operation and replicates it to its
peers over authenticated, flow-controlled links, so the ranks' record sets stay
identical. :class:`ReplicatedCache` is the parent-side facade (operators and tests);
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
from .replicated import ReplicatedCache, rank_directories

__all__ = [
    "KVSource",
    "KVSourceFactory",
    "LinkAuthError",
    "LinkClosedError",
    "LinkProtocolError",
    "LinkStalledError",
    "PeerJobError",
    "ReplicaDivergedError",
    "ReplicatedCache",
    "ReplicationError",
    "SyntheticSource",
    "rank_directories",
]
