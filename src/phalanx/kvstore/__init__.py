"""The kvstore layer: one rank's persistent prefix-cache store (see docs/architecture.md, Layers).

:class:`DiskStore` keeps a record per stored span of pages in one directory: recovered
at open, capped, aged and compacted by ``poll()`` in bounded bursts, audited by
``check()``; its tuning knobs are one frozen :class:`StoreOptions`. It knows nothing
of ranks, peers or networks; the maintenance :class:`Job` messages are what a
replication layer above carries between ranks. Imports only :mod:`phalanx.lifecycle`
(and no torch: tensors are accepted lazily).
"""

from ._errors import (
    CacheError,
    CapacityError,
    DiskFullError,
    ForeignStoreError,
    GeometryMismatchError,
    LoadTimeoutError,
    NotCachedError,
    RecordCorruptError,
    RowSpanError,
    StoreClosedError,
    StoreLockedError,
    StoreWriteError,
)
from .buffers import aligned_empty
from .geometry import Geometry
from .keys import KeyChain, Tokens, fingerprint_digest, page_keys
from .maintenance import Job, JobKind, JobOutcome
from .options import StoreOptions
from .scatter import PageScatter
from .snapshot import SEAL_NAME, SNAPSHOT_NAME
from .stats import CacheStats
from .store import DiskStore, StoreResult

__all__ = [
    "SEAL_NAME",
    "SNAPSHOT_NAME",
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
    "KeyChain",
    "LoadTimeoutError",
    "NotCachedError",
    "PageScatter",
    "RecordCorruptError",
    "RowSpanError",
    "StoreClosedError",
    "StoreLockedError",
    "StoreOptions",
    "StoreResult",
    "StoreWriteError",
    "Tokens",
    "aligned_empty",
    "fingerprint_digest",
    "page_keys",
]
