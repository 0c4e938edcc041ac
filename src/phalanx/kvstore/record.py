"""The on-disk record: one file per written span, ``<key hex>.kv``.

Layout (little endian)::

    fixed part   FIXED (below): magic, version, flags, header length, geometry,
                 fingerprint, key, parent key, start/end page, row length, created
    page keys    16 bytes per page of the span (the chain, so recovery rebuilds the trie)
    page CRCs    4 bytes per page: a checksum of that page's row bytes (``page_digest``:
                 format 2, the low 32 bits of XXH3-64; format 1, zlib.crc32)
    header CRC   4 bytes: crc32 of everything above
    padding      zeros up to HEADER_ALIGN, so the row starts aligned for any dtype
    row          (end - start) pages of KV bytes, token-major; absent when THINNED

A thinned record is its header alone (flag THINNED, row length 0): an interior index
node whose bytes are served by a descendant's row. Per-page CRCs let a load verify
exactly the pages it reads, which a whole-row checksum would not.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from .geometry import DTYPE_SIZES, Geometry
from .keys import KEY_BYTES

__all__ = [
    "FLAG_THINNED",
    "HEADER_ALIGN",
    "HEADER_PROBE",
    "MAGIC",
    "READABLE_VERSIONS",
    "RECORD_SUFFIX",
    "RECORD_VERSION",
    "HeaderError",
    "RecordHeader",
    "page_crcs",
    "page_digest",
    "page_digest_parts",
    "record_name",
]

MAGIC = b"PHXKVREC"
# 2: page checksums are XXH3 (17 GB/s here against zlib.crc32's 4: a store of large
# rows spent more time checksumming than writing). 1: zlib.crc32, still read.
RECORD_VERSION = 2
READABLE_VERSIONS = (1, 2)
FLAG_THINNED = 1
HEADER_ALIGN = 64
# Recovery reads this many bytes with one pread: the whole header of spans up to
# (4096 - 160) / 20 = 196 pages; longer spans need a second read.
HEADER_PROBE = 4096
RECORD_SUFFIX = ".kv"

_GEOMETRIES: dict[tuple[int, int, int, bytes, int], Geometry] = {}
FIXED = struct.Struct("<8sHHIIIII16s16s16s16sIIQd")
_CRC = struct.Struct("<I")


class HeaderError(ValueError):
    """A header that cannot be parsed; ``reason`` is the skip counter's name."""

    def __init__(self, reason: str, detail: str, needed: int = 0) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.needed = needed  # for reason "short": bytes the whole header takes


def record_name(key: bytes) -> str:
    return key.hex() + RECORD_SUFFIX


def _xxh3_low32(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF


_PAGE_DIGESTS: dict[int, Callable[[bytes | memoryview], int]] = {1: zlib.crc32, 2: _xxh3_low32}


def page_digest(version: int) -> Callable[[bytes | memoryview], int]:
    """The page checksum of records of format ``version``."""
    return _PAGE_DIGESTS[version]


def page_digest_parts(version: int) -> Callable[[Sequence[memoryview]], int]:
    """:func:`page_digest` of a page given in parts (a scattered load's destination):
    equal to it over their concatenation."""
    if version == 1:
        def crc32(parts: Sequence[memoryview]) -> int:
            crc = 0
            for p in parts:
                crc = zlib.crc32(p, crc)
            return crc
        return crc32

    def xxh3_low32(parts: Sequence[memoryview]) -> int:
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return h.intdigest() & 0xFFFFFFFF
    if version != 2:
        raise KeyError(version)
    return xxh3_low32


def page_crcs(row: memoryview, page_bytes: int) -> list[int]:
    """Page checksums of a row about to be written (format RECORD_VERSION)."""
    digest = _PAGE_DIGESTS[RECORD_VERSION]
    return [digest(row[i : i + page_bytes]) for i in range(0, len(row), page_bytes)]


@dataclass(slots=True)
class RecordHeader:
    geometry: Geometry
    fingerprint: bytes
    key: bytes
    parent: bytes
    start_page: int
    end_page: int
    row_len: int
    created: float
    keys: list[bytes]  # keys of pages start_page .. end_page - 1; keys[-1] == key
    crcs: list[int]  # one per page
    flags: int = 0
    version: int = RECORD_VERSION

    @property
    def thinned(self) -> bool:
        return bool(self.flags & FLAG_THINNED)

    @property
    def n_pages(self) -> int:
        return self.end_page - self.start_page

    @property
    def header_len(self) -> int:
        raw = FIXED.size + self.n_pages * (KEY_BYTES + 4) + 4
        return -(-raw // HEADER_ALIGN) * HEADER_ALIGN

    @property
    def file_len(self) -> int:
        return self.header_len + self.row_len

    def encode(self) -> bytes:
        g = self.geometry
        fixed = FIXED.pack(
            MAGIC,
            self.version,
            self.flags,
            self.header_len,
            g.page_tokens,
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.dtype.encode().ljust(16, b"\0"),
            self.fingerprint,
            self.key,
            self.parent,
            self.start_page,
            self.end_page,
            self.row_len,
            self.created,
        )
        body = fixed + b"".join(self.keys) + struct.pack(f"<{len(self.crcs)}I", *self.crcs)
        body += _CRC.pack(zlib.crc32(body))
        return body.ljust(self.header_len, b"\0")

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> RecordHeader:
        """Parse and verify a header. Raises HeaderError with a skip reason.

        Raises HeaderError("short", ...) with ``needed`` bytes in the detail when
        ``buf`` holds the fixed part but not the whole header.
        """
        if len(buf) < FIXED.size:
            raise HeaderError("truncated", f"{len(buf)} bytes, a header needs {FIXED.size}")
        (magic, version, flags, header_len, page_tokens, layers, kv_heads, head_dim,
         dtype, fingerprint, key, parent, start, end, row_len, created) = FIXED.unpack_from(buf)
        if magic != MAGIC:
            raise HeaderError("foreign", "no phalanx record magic")
        if version not in READABLE_VERSIONS:
            raise HeaderError("version", f"format version {version}, this build reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
        n = end - start
        if n <= 0 or header_len < FIXED.size + n * (KEY_BYTES + 4) + 4:
            raise HeaderError("corrupt", f"bad span {start}..{end} or header length")
        if len(buf) < header_len:
            raise HeaderError("short", f"header takes {header_len} bytes", header_len)
        keys_at = FIXED.size
        crcs_at = keys_at + n * KEY_BYTES
        crc_at = crcs_at + 4 * n
        (want,) = _CRC.unpack_from(buf, crc_at)
        if zlib.crc32(buf[:crc_at]) != want:
            raise HeaderError("checksum", "header checksum mismatch")
        shape = (layers, kv_heads, head_dim, bytes(dtype), page_tokens)
        geometry = _GEOMETRIES.get(shape)
        if geometry is None:  # recovery decodes 100,000s of headers of one geometry
            name = bytes(dtype).rstrip(b"\0").decode(errors="replace")
            if name not in DTYPE_SIZES or min(layers, kv_heads, head_dim, page_tokens) <= 0:
                raise HeaderError("geometry", f"unknown dtype {name!r} or empty shape")
            geometry = _GEOMETRIES.setdefault(
                shape, Geometry(layers, kv_heads, head_dim, name, page_tokens))
        keys = [bytes(buf[keys_at + i * KEY_BYTES : keys_at + (i + 1) * KEY_BYTES])
                for i in range(n)]
        return cls(
            geometry=geometry,
            fingerprint=fingerprint,
            key=key,
            parent=parent,
            start_page=start,
            end_page=end,
            row_len=row_len,
            created=created,
            keys=keys,
            crcs=list(struct.unpack_from(f"<{n}I", buf, crcs_at)),
            flags=flags,
            version=version,
        )
