"""Where a rank's shard bytes come from and go to: the engine's KV staging buffer.

Rank 0 decides *which* pages are stored or loaded; each rank's bytes never leave its
process. A :class:`KVSource` hands the row of a span to the rank's store and receives
loaded pages. :class:`SyntheticSource` derives the bytes deterministically from the page
keys (so from the tokens) and the rank; tests, ``phalanx cache synth`` and the
benchmark use it through the very same code path an engine's source takes.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Protocol

import numpy as np

from phalanx.kvstore.geometry import Geometry

__all__ = ["KVSource", "KVSourceFactory", "SyntheticSource"]


class KVSource(Protocol):
    """A rank-local staging buffer of KV rows (one per rank process)."""

    def row(self, keys: list[bytes], start: int) -> Any:
        """The KV bytes of pages ``start .. len(keys)-1`` of the prefix with page
        ``keys`` (a buffer of ``(len(keys) - start) * page_bytes`` bytes)."""
        ...

    def loaded(self, keys: list[bytes], data: memoryview) -> None:
        """Pages ``0 .. len(keys)-1`` were loaded from disk into ``data``."""
        ...


class KVSourceFactory(Protocol):
    """Builds a rank's source in its rank process (must be importable by reference)."""

    def __call__(self, geometry: Geometry, rank: int) -> KVSource: ...


class SyntheticSource:
    """Bytes of page p = an expansion of BLAKE2b(key of p, rank): deterministic per rank,
    different across ranks (so a peer storing rank 0's bytes would be caught)."""

    def __init__(self, geometry: Geometry, rank: int) -> None:
        self.page_bytes = geometry.page_bytes
        self.rank = rank
        self.loads = 0
        self.bad_loads = 0  # loaded bytes that differ from what this source would store

    def page(self, key: bytes) -> np.ndarray:
        seed = hashlib.blake2b(key + self.rank.to_bytes(4, "little"), digest_size=8).digest()
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "little")))
        return rng.integers(0, 256, self.page_bytes, dtype=np.uint8)

    def row(self, keys: list[bytes], start: int) -> Any:
        if start == len(keys) - 1:
            return self.page(keys[start])
        return np.concatenate([self.page(k) for k in keys[start:]])

    def loaded(self, keys: list[bytes], data: memoryview) -> None:
        self.loads += 1
        if zlib.crc32(data) != zlib.crc32(memoryview(self.row(keys, 0)).cast("B")):
            self.bad_loads += 1
