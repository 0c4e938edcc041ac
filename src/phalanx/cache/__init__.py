"""The cache layer: a persistent, single-rank prefix-cache disk store (see DESIGN.md).

Public surface: :class:`DiskStore` with its :class:`Geometry`, the maintenance
:class:`Job` messages that a replication transport carries, statistics, and the error
tree drawn in ``_errors.py``. Imports no torch (tensors are accepted lazily).
"""

from ._errors import (
    CacheError,
    CapacityError,
    DiskFullError,
    ForeignStoreError,
    GeometryMismatchError,
    NotCachedError,
    RecordCorruptError,
    RowSpanError,
    StoreClosedError,
    StoreLockedError,
    StoreWriteError,
)
from .geometry import Geometry
from .keys import fingerprint_digest, page_keys
from .maintenance import Job, JobKind, JobOutcome
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
    "NotCachedError",
    "RecordCorruptError",
    "RowSpanError",
    "StoreClosedError",
    "StoreLockedError",
    "StoreResult",
    "StoreWriteError",
    "fingerprint_digest",
    "page_keys",
]
