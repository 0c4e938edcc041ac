"""The cache layer: a persistent, single-rank prefix-cache disk store (see DESIGN.md).

Public surface: :class:`ReplicatedCache` (TP-N: rank 0 decides, every rank stores,
KV sources give each rank's bytes) and :class:`DiskStore` with its :class:`Geometry`,
the maintenance :class:`Job` messages that a replication transport carries, statistics,
and the error tree drawn in ``_errors.py``. Imports no torch (tensors are accepted lazily).
"""

from ._errors import (
    CacheError,
    CapacityError,
    DiskFullError,
    ForeignStoreError,
    GeometryMismatchError,
    LinkAuthError,
    LinkClosedError,
    LinkProtocolError,
    LinkStalledError,
    NotCachedError,
    PeerJobError,
    RecordCorruptError,
    ReplicaDivergedError,
    ReplicationError,
    RowSpanError,
    StoreClosedError,
    StoreLockedError,
    StoreWriteError,
)
from .geometry import Geometry
from .keys import fingerprint_digest, page_keys
from .kv_source import KVSource, KVSourceFactory, SyntheticSource
from .maintenance import Job, JobKind, JobOutcome
from .replicated import ReplicatedCache, rank_directories
from .stats import CacheStats
from .store import DiskStore, StoreResult

__all__ = [
    "CacheError",
    "CacheStats",
    "CapacityError",
    "DiskFullError",
    "DiskStore",
    "ForeignStoreError",
    "Geometry",
    "GeometryMismatchError",
    "Job",
    "JobKind",
    "JobOutcome",
    "KVSource",
    "KVSourceFactory",
    "LinkAuthError",
    "LinkClosedError",
    "LinkProtocolError",
    "LinkStalledError",
    "NotCachedError",
    "PeerJobError",
    "RecordCorruptError",
    "ReplicaDivergedError",
    "ReplicatedCache",
    "ReplicationError",
    "RowSpanError",
    "StoreClosedError",
    "StoreLockedError",
    "StoreResult",
    "StoreWriteError",
    "SyntheticSource",
    "fingerprint_digest",
    "page_keys",
    "rank_directories",
]
