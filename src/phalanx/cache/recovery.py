"""Recovery scan: one header read per file, no row reads.

Per file: open, one ``pread`` of HEADER_PROBE bytes (a second only for spans longer
than ~196 pages), ``fstat`` for the length, close. The row's page CRCs are checked
when a load first reads them (or by ``phalanx cache verify``), not here: reading every
row would make a restart cost the whole disk.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .files import QUARANTINE_DIR, is_temp_name
from .geometry import Geometry
from .index import Index, Node, Record
from .lock import LOCK_NAME
from .manifest import MANIFEST_NAME
from .record import (
    FLAG_THINNED,
    HEADER_PROBE,
    RECORD_SUFFIX,
    HeaderError,
    RecordHeader,
    record_name,
)
from .snapshot import SNAPSHOT_NAME, Columns, Fact, read_snapshot

__all__ = [
    "ScanResult", "build_index", "build_index_columns", "no_gc", "read_header", "recover", "scan",
]

log = logging.getLogger("phalanx.cache")

_OURS = frozenset({LOCK_NAME, MANIFEST_NAME, QUARANTINE_DIR, SNAPSHOT_NAME})
_NAME_LEN = 32 + len(RECORD_SUFFIX)


@dataclass
class ScanResult:
    headers: list[RecordHeader] = field(default_factory=list)
    temps: list[str] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (name, reason): ours, broken
    foreign: list[str] = field(default_factory=list)  # not named like ours: left alone
    seconds: float = 0.0
    # recover() only: every good record's header facts
    columns: Columns = field(default_factory=Columns)
    from_snapshot: int = 0  # of columns: taken from the snapshot, header not read
    snapshot: str = "absent"  # "absent", "ignored" (unreadable/stale as a whole), "used"

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


def _with_progress(names: list[str], directory: str, progress: bool) -> Iterator[str]:
    """Yield ``names``; a progress bar appears when a recovery takes more than a second
    (updated every 1,024 files, so the bar costs nothing per file)."""
    bar = _Bar(total=len(names), desc=f"recovering {directory}", unit="file", delay=1.0,
               disable=not progress or len(names) < 1000, leave=False)
    try:
        for i, name in enumerate(names):
            if i % 1024 == 1023:
                bar.update(1024)
            yield name
    finally:
        bar.close()


@contextmanager
def no_gc() -> Iterator[None]:
    """Cyclic GC off while recovery builds 100,000s of objects that all stay alive:
    each collection would traverse the growing index for nothing (half of the time).

    On the way out the new objects go straight to the oldest generation (freeze then
    unfreeze: two list splices), so the first young collection after recovery does not
    traverse them either; skipped when the process has frozen objects of its own.
    """
    was = gc.isenabled()
    mine = gc.get_freeze_count() == 0
    gc.disable()
    try:
        yield
    finally:
        if mine:
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


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


def _checked_header(directory: str, name: str, geometry: Geometry | None,
                    fingerprint: bytes | None) -> RecordHeader | str:
    """The file's header if it may be served here, else the reason it is skipped."""
    try:
        header = read_header(os.path.join(directory, name))
    except HeaderError as exc:
        return exc.reason
    except OSError:
        return "unreadable"
    if record_name(header.key) != name:
        return "name"
    if geometry is not None and header.geometry != geometry:
        return "geometry"
    if fingerprint is not None and header.fingerprint != fingerprint:
        return "fingerprint"
    return header


def scan(directory: str, geometry: Geometry | None, fingerprint: bytes | None,
         progress: bool = True) -> ScanResult:
    """Classify every entry of ``directory``; headers that pass are in ``headers``."""
    t0 = time.perf_counter()
    res = ScanResult()
    with os.scandir(directory) as it:
        names = [e.name for e in it]
    for name in _with_progress(names, directory, progress):
        if name in _OURS:
            continue
        if is_temp_name(name):
            res.temps.append(name)
            continue
        if len(name) != _NAME_LEN or not name.endswith(RECORD_SUFFIX):
            res.foreign.append(name)
            continue
        checked = _checked_header(directory, name, geometry, fingerprint)
        if isinstance(checked, str):
            res.bad.append((name, checked))
        else:
            res.headers.append(checked)
    res.seconds = time.perf_counter() - t0
    return res


def _fact(h: RecordHeader) -> Fact:
    return (h.key, h.parent, h.start_page, h.end_page, h.row_len, h.file_len, h.created,
            h.flags, h.keys)


def recover(directory: str, geometry: Geometry, fingerprint: bytes,
            progress: bool = True) -> ScanResult:
    """Like ``scan``, with the snapshot: one ``stat`` per record file, and a header read
    only for files the snapshot does not cover exactly (see snapshot.py)."""
    t0 = time.perf_counter()
    res = ScanResult()
    snap = read_snapshot(directory, geometry, fingerprint)
    has_file = os.path.exists(os.path.join(directory, SNAPSHOT_NAME))
    res.snapshot = "used" if snap is not None else ("ignored" if has_file else "absent")
    rows: dict[str, int] = snap.rows if snap is not None else {}
    empty: list[int] = []
    cols = snap.columns if snap is not None else Columns()
    sizes, mtimes = cols.file_lens, snap.mtimes if snap is not None else empty
    ctimes, inos = (snap.ctimes, snap.inos) if snap is not None else (empty, empty)
    cutoff = snap.cutoff_ns if snap is not None else 0
    trusted: list[int] = []
    to_read: list[str] = []
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it]
        for name in names:
            if name not in rows:  # not in the snapshot: classify, read if a record
                if name in _OURS:
                    continue
                if is_temp_name(name):
                    res.temps.append(name)
                elif len(name) != _NAME_LEN or not name.endswith(RECORD_SUFFIX):
                    res.foreign.append(name)
                else:
                    to_read.append(name)
        # the snapshot's files in its order (write order: inode order on a fresh
        # directory), not the listing's hash order: the stat and compare loop then walks
        # inodes and the snapshot's columns in sequence
        listed = set(names)
        stat = os.stat
        for i, name in enumerate(snap.names if snap is not None else ()):
            if name not in listed:
                continue  # removed since the snapshot
            try:
                st = stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                res.bad.append((name, "unreadable"))
                continue
            m = st.st_mtime_ns
            if (m < cutoff and m == mtimes[i] and st.st_size == sizes[i]
                    and st.st_ino == inos[i] and st.st_ctime_ns == ctimes[i]):
                trusted.append(i)
            else:
                to_read.append(name)
    finally:
        os.close(dfd)
    if len(trusted) != len(cols):  # names are unique: all trusted means every row once
        cols = cols.take(trusted)
    res.columns = cols
    res.from_snapshot = len(trusted)
    for name in _with_progress(to_read, directory, progress):
        checked = _checked_header(directory, name, geometry, fingerprint)
        if isinstance(checked, str):
            res.bad.append((name, checked))
        else:
            cols.append(_fact(checked))
    res.seconds = time.perf_counter() - t0
    return res


def build_index(headers: list[RecordHeader]) -> Index:
    """Rebuild the trie from record headers (see ``build_index_columns``)."""
    cols = Columns()
    for h in headers:
        cols.append(_fact(h))
    return build_index_columns(cols)


def build_index_columns(cols: Columns) -> Index:
    """Rebuild the trie from record headers' facts.

    Ready rows are attached in order of their first page, so the node a span hangs
    from (covered by a span that starts earlier) exists before it; thinned records
    attach afterwards to nodes that ready rows cover. A record whose parent prefix is
    not cached is an orphan: unreachable, counted against capacity until dropped.
    """
    index = Index()
    root, nodes, records = index.root, index.nodes, index.records
    keys, parents, starts, ends = cols.keys, cols.parents, cols.starts, cols.ends
    row_lens, file_lens, created, flags, spans = (
        cols.row_lens, cols.file_lens, cols.created, cols.flags, cols.spans)
    n = len(keys)
    thin_col = np.array(flags, dtype=np.int64) & FLAG_THINNED
    start_col = np.array(starts, dtype=np.int64)
    order: Iterable[int] = range(n)
    if n and (thin_col.any() or (np.diff(start_col) < 0).any()):
        # ready rows first, by first page (stable: equal starts keep their order)
        order = np.lexsort((start_col, thin_col)).tolist()
    attached = 0
    total = 0
    for i in order:
        key, start, flag = keys[i], starts[i], flags[i]
        thinned = bool(flag & FLAG_THINNED)
        rec = Record(key, parents[i], start, ends[i], row_lens[i], file_lens[i], created[i],
                     thinned, False)
        if start == 0:
            parent: Node | None = root
        else:
            parent = nodes.get(parents[i])
            if parent is not None and parent.depth != start:
                parent = None
        existing = nodes.get(key)
        if parent is None or (existing is not None and existing.record is not None):
            index.add_orphan(rec)
            continue
        span = spans[i]
        if thinned:
            if not index.attach_interior(rec, [key] if span is None else span, parent):
                index.add_orphan(rec)
        elif span is not None:
            index.add(rec, span, parent, recovering=True)
        else:  # a one-page row: Index.add(recovering=True), inline
            node = parent.children.get(key)
            if node is None:
                node = Node(key, parent, start + 1)
                parent.children[key] = node
                nodes[key] = node
            rec.node = node
            node.record = rec
            records[key] = rec
            node.covers.append(rec)
            total += rec.file_len
            attached += 1
    index.bytes += total
    index.changes += attached
    index.reseed()
    return index
