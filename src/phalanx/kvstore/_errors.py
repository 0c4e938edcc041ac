"""Errors of the kvstore layer (one rank's persistent prefix store).

Every error names the directory, the record key or file, the errno where there is one,
and what the caller can do about it.

    PhalanxError                      (phalanx.lifecycle)
    └── CacheError                    any failure of the prefix-cache disk store
        ├── StoreLockedError          another live process holds the directory's lock
        ├── StoreClosedError          the store was used after close()
        ├── ForeignStoreError         the directory belongs to another model or geometry
        │   └── GeometryMismatchError   its geometry or format version differs
        ├── RowSpanError              a row or token list that cannot be stored (ValueError)
        ├── CapacityError             a row larger than the capacity, or nothing evictable
        ├── StoreWriteError           a record could not be written; nothing became visible
        │   └── DiskFullError           ... because the disk is full (ENOSPC)
        ├── RecordCorruptError        a record failed its checksum while being loaded
        ├── NotCachedError            load() asked for pages that are not cached (KeyError)
        ├── LoadTimeoutError          a load's reads did not finish by its deadline (TimeoutError)
        └── ReplicationError          (phalanx.replication) rank 0 and its peers disagree
"""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError

__all__ = [
    "CacheError",
    "CapacityError",
    "DiskFullError",
    "ForeignStoreError",
    "GeometryMismatchError",
    "LoadTimeoutError",
    "NotCachedError",
    "RecordCorruptError",
    "RowSpanError",
    "StoreClosedError",
    "StoreLockedError",
    "StoreWriteError",
]


class CacheError(PhalanxError):
    """Root of the cache layer's errors."""


class StoreLockedError(CacheError):
    """The directory's lock file is held by another live process (one store per directory)."""


class StoreClosedError(CacheError):
    """The store was used after ``close()``."""


class ForeignStoreError(CacheError):
    """The directory was made for another model (its fingerprint differs)."""


class GeometryMismatchError(ForeignStoreError):
    """The directory's geometry (layers, heads, head dim, dtype, page) or version differs."""


class RowSpanError(CacheError, ValueError):
    """A token list shorter than a page, or a row whose size or span cannot be stored."""


class CapacityError(CacheError):
    """A row larger than the whole capacity, or no room can be made (everything pinned)."""


class StoreWriteError(CacheError):
    """Writing or committing a record failed; the temp file is gone, nothing is visible."""


class DiskFullError(StoreWriteError):
    """The file system reported ENOSPC while a record was written."""


class RecordCorruptError(CacheError):
    """A record's bytes failed their checksum on load; it is never served again."""


class NotCachedError(CacheError, KeyError):
    """``load()`` asked for more pages than are cached for these tokens."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class LoadTimeoutError(CacheError, TimeoutError):
    """A load's reads did not finish within its deadline; the rest were cancelled and no
    read is still in flight into the caller's memory."""
