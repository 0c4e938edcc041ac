"""``DIR/phalanx-index.snap``: a checksummed cache of record headers, so a reopen reads
only the files it does not cover.

The snapshot holds, per record file, what recovery would read from its header (key,
parent, span, row length, created, flags, the span's page keys) keyed by the file's
identity at snapshot time: name, size, ``mtime_ns``, ``ctime_ns`` and inode. It is a
cache, never an authority: at open every directory entry is still listed and
``stat``-ed, and an entry is used only when all five match and the file's mtime is
older than the snapshot by more than ``RACY_NS`` (a file replaced after the snapshot
in the same timestamp tick, on a reused inode, would otherwise look unchanged).
Every other file's header is read as before; a snapshot that fails its checksum, is
of another version, geometry or model, or cannot be read is ignored as a whole.
Rows' page CRCs are not in it: a load still checks them against the file's header.

Written at ``close()`` (when the index changed since it was read or written) and by
``DiskStore.snapshot()``, as a 0600 temp file renamed into place; a crash leaves the
old snapshot or the new one (the temp is purged like any other).

The seal (``DIR/phalanx-index.seal``): ``close()`` writes it after the snapshot, naming
the snapshot it vouches for (its ``taken_ns``). It says: the store that held the
directory lock wrote this snapshot as its last change and closed. The next open
removes the seal before it reads or changes anything else, so a seal is never seen by
an open after a crash, and never outlives the first change. A sealed snapshot is
trusted on a name and inode match from the directory listing alone (no ``stat`` per
file, the cost of a restart otherwise); an unsealed one (after a crash, or written by
``DiskStore.snapshot()`` while the store went on) is checked file by file as above.
What a seal cannot vouch for, a file edited in place by another program while the
store was closed, the first load still catches: it checks the file's header against
the index and every page against its CRC (as it does for bit rot, which no timestamp
shows either).

Layout (little endian): a 64-byte head (magic, version, record count, extra-key
count, taken_ns, fingerprint, geometry digest), then ``count`` ENTRY rows, then the
extra page keys (16 bytes each: every span page but the last, whose key is the
record's), then a CRC32 of everything before it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
import zlib
from collections.abc import Sequence

import msgspec
import numpy as np

from .geometry import Geometry
from .index import Index, Record
from .keys import KEY_BYTES
from .record import FLAG_THINNED, RECORD_SUFFIX

__all__ = [
    "RACY_NS",
    "SEAL_NAME",
    "SNAPSHOT_NAME",
    "Columns",
    "Entry",
    "Fact",
    "Snapshot",
    "collect_facts",
    "consume_seal",
    "read_snapshot",
    "save_snapshot",
    "write_seal",
    "write_snapshot",
]

log = logging.getLogger("phalanx.kvstore")

SNAPSHOT_NAME = "phalanx-index.snap"
SEAL_NAME = "phalanx-index.seal"
_SEAL = struct.Struct("<8sq")  # magic, taken_ns of the snapshot it vouches for; + CRC32
_SEAL_MAGIC = b"PHXSEAL1"
SNAPSHOT_VERSION = 1
MAGIC = b"PHXIXSNP"
# Entries whose file mtime is within this of the snapshot's start are re-read: kernel
# file timestamps come from a coarse clock (one tick, <= 10 ms at HZ >= 100).
RACY_NS = 50_000_000
# ...and within this on a filesystem whose timestamps have whole-second granularity.
RACY_COARSE_NS = 2_000_000_000

_HEAD = struct.Struct("<8sIIQq16s16s")
_HEAD_SIZE = 64
_CRC = struct.Struct("<I")
ENTRY = np.dtype([
    ("key", "V16"), ("parent", "V16"), ("start", "<u4"), ("end", "<u4"),
    ("row_len", "<u8"), ("file_len", "<u8"), ("created", "<f8"), ("flags", "<u4"),
    ("mtime_ns", "<i8"), ("ctime_ns", "<i8"), ("ino", "<u8"), ("extra", "<u8"),
])

# (key, parent, start, end, row_len, file_len, created, flags, keys): a header's facts
Fact = tuple[bytes, bytes, int, int, int, int, float, int, list[bytes]]
# a fact with its file's (mtime_ns, ctime_ns, ino) when the snapshot was taken
Entry = tuple[Fact, tuple[int, int, int]]


def geometry_digest(geometry: Geometry) -> bytes:
    return hashlib.blake2b(msgspec.json.encode(geometry), digest_size=16).digest()


class Columns:
    """Header facts of many records, column by column (what recovery builds from).

    ``spans[i]`` is the span's page keys, or None for a one-page span (``[keys[i]]``).
    """

    __slots__ = ("created", "ends", "file_lens", "flags", "keys", "parents", "row_lens",
                 "spans", "starts")

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.parents: list[bytes] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.row_lens: list[int] = []
        self.file_lens: list[int] = []
        self.created: list[float] = []
        self.flags: list[int] = []
        self.spans: list[list[bytes] | None] = []

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, fact: Fact) -> None:
        key, parent, start, end, row_len, file_len, created, flags, keys = fact
        self.keys.append(key)
        self.parents.append(parent)
        self.starts.append(start)
        self.ends.append(end)
        self.row_lens.append(row_len)
        self.file_lens.append(file_len)
        self.created.append(created)
        self.flags.append(flags)
        self.spans.append(keys if len(keys) != 1 else None)

    def take(self, rows: list[int]) -> Columns:
        out = Columns()
        for name in Columns.__slots__:
            col = getattr(self, name)
            setattr(out, name, [col[i] for i in rows])
        return out


class Snapshot:
    """A decoded snapshot: facts by row, and each row's file identity."""

    __slots__ = ("columns", "ctimes", "cutoff_ns", "inos", "mtimes", "names", "taken_ns")

    def __init__(self, columns: Columns, names: list[str], mtimes: list[int],
                 ctimes: list[int], inos: list[int], cutoff_ns: int, taken_ns: int) -> None:
        self.columns = columns
        self.names = names  # file name by row (each once)
        self.mtimes = mtimes
        self.ctimes = ctimes
        self.inos = inos
        self.cutoff_ns = cutoff_ns  # trust only files with mtime_ns below this
        self.taken_ns = taken_ns  # names the snapshot in its seal

    def __len__(self) -> int:
        return len(self.columns)


def write_snapshot(directory: str, geometry: Geometry, fingerprint: bytes, taken_ns: int,
                   entries: Sequence[Entry], fsync: bool) -> None:
    """Write ``entries`` (facts + (mtime_ns, ctime_ns, ino)) atomically. Raises OSError."""
    n = len(entries)
    arr = np.zeros(n, dtype=ENTRY)
    extra: list[bytes] = []
    rows = []
    for (key, parent, start, end, row_len, file_len, created, flags, keys), (m, c, ino) in entries:
        rows.append((key, parent, start, end, row_len, file_len, created, flags, m, c, ino,
                     len(extra)))
        if len(keys) > 1:
            extra.extend(keys[:-1])
    if n:
        arr[:] = rows
    head = _HEAD.pack(MAGIC, SNAPSHOT_VERSION, n, len(extra), taken_ns, fingerprint,
                      geometry_digest(geometry)).ljust(_HEAD_SIZE, b"\0")
    body = b"".join((head, arr.tobytes(), *extra))
    _write_private(directory, SNAPSHOT_NAME, body + _CRC.pack(zlib.crc32(body)), fsync)


def _write_private(directory: str, name: str, data: bytes, fsync: bool) -> None:
    """``data`` as ``directory/name``, 0600, through a temp file renamed into place."""
    path = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_seal(directory: str, taken_ns: int, fsync: bool) -> None:
    """Vouch for the snapshot taken at ``taken_ns`` (see the module doc). Raises OSError."""
    body = _SEAL.pack(_SEAL_MAGIC, taken_ns)
    _write_private(directory, SEAL_NAME, body + _CRC.pack(zlib.crc32(body)), fsync)


def consume_seal(directory: str) -> int | None:
    """Remove the seal; the ``taken_ns`` it vouches for, or None when there was none, it
    is not ours, or it could not be removed (then it vouches for nothing: a seal left in
    place could outlive the changes this store is about to make)."""
    path = os.path.join(directory, SEAL_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(_SEAL.size + _CRC.size + 1)
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cache %s: seal %s unreadable or not removable (%s); the header snapshot "
                    "is checked file by file", directory, path, exc)
        return None
    if len(data) != _SEAL.size + _CRC.size:
        return None
    magic, taken_ns = _SEAL.unpack_from(data)
    (crc,) = _CRC.unpack_from(data, _SEAL.size)
    if magic != _SEAL_MAGIC or zlib.crc32(data[: _SEAL.size]) != crc:
        return None
    return int(taken_ns)


def read_snapshot(directory: str, geometry: Geometry, fingerprint: bytes) -> Snapshot | None:
    """The directory's snapshot, or None when absent or not usable (never raises)."""
    try:
        with open(os.path.join(directory, SNAPSHOT_NAME), "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return _decode(data, geometry, fingerprint)
    except (ValueError, struct.error):
        return None


def _decode(data: bytes, geometry: Geometry, fingerprint: bytes) -> Snapshot | None:
    if len(data) < _HEAD_SIZE + _CRC.size:
        return None
    (want,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[: -_CRC.size]) != want:
        return None
    magic, version, n, n_extra, taken_ns, fp, gd = _HEAD.unpack_from(data)
    if (magic, version, fp, gd) != (MAGIC, SNAPSHOT_VERSION, fingerprint,
                                    geometry_digest(geometry)):
        return None
    extra_at = _HEAD_SIZE + n * ENTRY.itemsize
    if extra_at + n_extra * KEY_BYTES + _CRC.size != len(data):
        return None
    arr = np.frombuffer(data, dtype=ENTRY, count=n, offset=_HEAD_SIZE)
    starts, ends = arr["start"], arr["end"]
    spans_n = ends.astype(np.int64) - starts
    if n and int(spans_n.min()) <= 0:
        return None
    mt = arr["mtime_ns"]
    coarse = n > 0 and not bool((mt % 1_000_000_000).any())
    cutoff = taken_ns - (RACY_COARSE_NS if coarse else RACY_NS)
    cols = Columns()
    keys = cols.keys = arr["key"].tolist()
    cols.parents = arr["parent"].tolist()
    cols.starts = starts.tolist()
    cols.ends = ends.tolist()
    cols.row_lens = arr["row_len"].tolist()
    cols.file_lens = arr["file_len"].tolist()
    cols.created = arr["created"].tolist()
    cols.flags = arr["flags"].tolist()
    spans: list[list[bytes] | None] = [None] * n
    offs = arr["extra"]
    for i in np.flatnonzero(spans_n > 1).tolist():
        m, off = int(spans_n[i]), int(offs[i])
        if off + m - 1 > n_extra:
            return None
        at = extra_at + off * KEY_BYTES
        span = [data[at + j * KEY_BYTES : at + (j + 1) * KEY_BYTES] for j in range(m - 1)]
        span.append(keys[i])
        spans[i] = span
    cols.spans = spans
    names = [k.hex() + RECORD_SUFFIX for k in keys]
    if len(set(names)) != n:  # a name twice: not a snapshot we wrote
        return None
    return Snapshot(cols, names, mt.tolist(), arr["ctime_ns"].tolist(),
                    arr["ino"].tolist(), cutoff, taken_ns)


def _attach_order(rec: Record) -> tuple[bool, int]:
    return rec.thinned, rec.start


def collect_facts(index: Index) -> list[Fact]:
    """Header facts of every attached record (orphans are left to a header read), in
    the order recovery attaches them (ready rows by first page, then thinned ones), so
    that a reopen builds its index from the snapshot as it lies (no sort at open, where
    a restart waits on it: 0.03 s of 0.32 for 100,000 records; the sort here costs
    close as much, which nobody waits on)."""
    out: list[Fact] = []
    for rec in sorted(index.records.values(), key=_attach_order):
        node = rec.node
        keys: list[bytes] = []
        for _ in range(rec.end - rec.start):
            assert node is not None
            keys.append(node.key)
            node = node.parent
        keys.reverse()
        out.append((rec.key, rec.parent, rec.start, rec.end, rec.row_len, rec.file_len,
                    rec.created, FLAG_THINNED if rec.thinned else 0, keys))
    return out


def save_snapshot(directory: str, geometry: Geometry, fingerprint: bytes, taken_ns: int,
                  facts: list[Fact], fsync: bool) -> int:
    """``stat`` each fact's file and write the snapshot; returns the entries written.

    A file whose size is not the fact's is left out. ``taken_ns`` must be read before
    the facts were collected: a file changed after that is never trusted (RACY_NS).
    """
    entries: list[Entry] = []
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        stat = os.stat
        for f in facts:
            try:
                st = stat(f[0].hex() + RECORD_SUFFIX, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_size == f[5]:
                entries.append((f, (st.st_mtime_ns, st.st_ctime_ns, st.st_ino)))
    finally:
        os.close(dfd)
    write_snapshot(directory, geometry, fingerprint, taken_ns, entries, fsync)
    return len(entries)
