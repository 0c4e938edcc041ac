"""Recovery scan: one header read per file, no row reads.

Per file: open, one ``pread`` of HEADER_PROBE bytes (a second only for spans longer
than ~196 pages), ``fstat`` for the length, close. The row's page CRCs are checked
when a load first reads them (or by ``phalanx cache verify``), not here: reading every
row would make a restart cost the whole disk.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from .files import QUARANTINE_DIR, is_temp_name
from .geometry import Geometry
from .index import Index, Node, Record
from .lock import LOCK_NAME
from .manifest import MANIFEST_NAME
from .record import HEADER_PROBE, RECORD_SUFFIX, HeaderError, RecordHeader, record_name

__all__ = ["ScanResult", "build_index", "read_header", "scan"]

log = logging.getLogger("phalanx.cache")

_OURS = frozenset({LOCK_NAME, MANIFEST_NAME, QUARANTINE_DIR})
_NAME_LEN = 32 + len(RECORD_SUFFIX)


@dataclass
class ScanResult:
    headers: list[RecordHeader] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): ours, broken
    foreign: list[str] = field(default_factory=list)  # not named like ours: left alone
    seconds: float = 0.0

    def skipped(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, reason in self.bad:
            out[reason] = out.get(reason, 0) + 1
        if self.foreign:
            out["foreign_name"] = len(self.foreign)
        return out


class _Bar(tqdm):  # type: ignore[misc]
    # tqdm starts a monitor thread per process for any bar, even a disabled one; it
    # would outlive the store (the leak check counts threads). Our bar updates itself.
    monitor_interval = 0


def read_header(path: str) -> RecordHeader:
    """Read and check one record's header and length. Raises HeaderError(reason)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = os.pread(fd, HEADER_PROBE, 0)
        try:
            header = RecordHeader.decode(buf)
        except HeaderError as exc:
            if exc.reason != "short":
                raise
            buf = os.pread(fd, exc.needed, 0)
            header = RecordHeader.decode(buf)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size < header.file_len:
        raise HeaderError("truncated", f"{size} bytes on disk, header says {header.file_len}")
    if size > header.file_len:
        raise HeaderError("corrupt", f"{size} bytes on disk, header says {header.file_len}")
    if header.keys[-1] != header.key or (header.thinned and header.row_len):
        raise HeaderError("corrupt", "key chain or thinned flag inconsistent")
    return header


def scan(directory: str, geometry: Geometry | None, fingerprint: bytes | None,
         progress: bool = True) -> ScanResult:
    """Classify every entry of ``directory``; headers that pass are in ``headers``."""
    t0 = time.perf_counter()
    res = ScanResult()
    with os.scandir(directory) as it:
        names = [e.name for e in it]
    bar = _Bar(total=len(names), desc=f"recovering {directory}", unit="file", delay=1.0,
               disable=not progress or len(names) < 1000, leave=False)
    try:
        for i, name in enumerate(names):
            if i % 1024 == 1023:
                bar.update(1024)
            if name in _OURS:
                continue
            if is_temp_name(name):
                res.temps.append(name)
                continue
            if len(name) != _NAME_LEN or not name.endswith(RECORD_SUFFIX):
                res.foreign.append(name)
                continue
            try:
                header = read_header(os.path.join(directory, name))
            except HeaderError as exc:
                res.bad.append((name, exc.reason))
                continue
            except OSError:
                res.bad.append((name, "unreadable"))
                continue
            if record_name(header.key) != name:
                res.bad.append((name, "name"))
            elif geometry is not None and header.geometry != geometry:
                res.bad.append((name, "geometry"))
            elif fingerprint is not None and header.fingerprint != fingerprint:
                res.bad.append((name, "fingerprint"))
            else:
                res.headers.append(header)
    finally:
        bar.close()
    res.seconds = time.perf_counter() - t0
    return res


def build_index(headers: list[RecordHeader]) -> Index:
    """Rebuild the trie from record headers.

    Ready rows are attached in order of their first page, so the node a span hangs
    from (covered by a span that starts earlier) exists before it; thinned records
    attach afterwards to nodes that ready rows cover. A record whose parent prefix is
    not cached is an orphan: unreachable, counted against capacity until dropped.
    """
    index = Index()

    def parent_of(h: RecordHeader) -> Node | None:
        if h.start_page == 0:
            return index.root
        node = index.nodes.get(h.parent)
        return node if node is not None and node.depth == h.start_page else None

    for h in sorted(headers, key=lambda h: (h.thinned, h.start_page)):
        rec = Record(h.key, h.parent, h.start_page, h.end_page, h.row_len, h.file_len,
                     h.created, thinned=h.thinned, verified=False)
        parent = parent_of(h)
        existing = index.nodes.get(h.key)
        if parent is None or (existing is not None and existing.record is not None):
            index.add_orphan(rec)
        elif h.thinned:
            if not index.attach_interior(rec, h.keys, parent):
                index.add_orphan(rec)
        else:
            index.add(rec, h.keys, parent)
    index.reseed()
    return index
