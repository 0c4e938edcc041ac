"""Recovery scan: one header read per file, no row reads.

Per file: open, one ``pread`` of HEADER_PROBE bytes (a second only for spans longer
than ~196 pages), ``fstat`` for the length, close. The row's page CRCs are checked
when a load first reads them (or by ``phalanx cache verify``), not here: reading every
row would make a restart cost the whole disk.
"""

from __future__ import annotations

import gc
import logging
import operator
import os
import time
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .files import QUARANTINE_DIR, STAGING_DIR, is_temp_name, staged_temps
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
from .snapshot import (
    SEAL_NAME,
    SNAPSHOT_NAME,
    Columns,
    Fact,
    Snapshot,
    consume_seal,
    read_snapshot,
)

__all__ = [
    "ScanResult", "build_index", "build_index_columns", "no_gc", "read_header", "recover", "scan",
]

log = logging.getLogger("phalanx.kvstore")

_OURS = frozenset({LOCK_NAME, MANIFEST_NAME, QUARANTINE_DIR, SEAL_NAME, SNAPSHOT_NAME,
                   STAGING_DIR})
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
    # "absent", "ignored" (unreadable/stale as a whole), "used" (checked file by file),
    # "sealed" (written by a clean close: trusted on name and inode)
    snapshot: str = "absent"
    snapshot_taken_ns: int | None = None  # of a snapshot that was read

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
        return read_header_at(fd)
    finally:
        os.close(fd)


def read_header_at(fd: int) -> RecordHeader:
    """``read_header`` of an open record file."""
    buf = os.pread(fd, HEADER_PROBE, 0)
    try:
        header = RecordHeader.decode(buf)
    except HeaderError as exc:
        if exc.reason != "short":
            raise
        buf = os.pread(fd, exc.needed, 0)
        header = RecordHeader.decode(buf)
    size = os.fstat(fd).st_size
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
    res.temps += staged_temps(directory)
    res.seconds = time.perf_counter() - t0
    return res


def _fact(h: RecordHeader) -> Fact:
    return (h.key, h.parent, h.start_page, h.end_page, h.row_len, h.file_len, h.created,
            h.flags, h.keys)


def recover(directory: str, geometry: Geometry, fingerprint: bytes,
            progress: bool = True) -> ScanResult:
    """Like ``scan``, with the snapshot: a header read only for files the snapshot does
    not cover exactly (see snapshot.py). A sealed snapshot costs the listing alone; an
    unsealed one a ``stat`` per file. Removes the seal: call only as the lock holder."""
    t0 = time.perf_counter()
    res = ScanResult()
    sealed_ns = consume_seal(directory)  # first: a seal must not outlive what follows
    snap = read_snapshot(directory, geometry, fingerprint)
    has_file = os.path.exists(os.path.join(directory, SNAPSHOT_NAME))
    sealed = snap is not None and sealed_ns == snap.taken_ns
    res.snapshot = ("sealed" if sealed else "used") if snap is not None else (
        "ignored" if has_file else "absent")
    res.snapshot_taken_ns = snap.taken_ns if snap is not None else None
    to_read: list[str] = []
    with os.scandir(directory) as it:
        inode_of = {e.name: e.inode() for e in it}  # the listing carries inodes: no stat
    if snap is None:
        trusted: list[int] = []
        present = 0
    elif sealed:
        trusted, present = _trusted_by_inode(snap, inode_of, to_read)
    else:
        trusted, present = _trusted_by_stat(directory, snap, inode_of.keys(), to_read, res)
    # names the snapshot does not hold: classify them, read the records' headers. On a
    # clean restart there are none but ours, which a count shows (no set difference)
    if present + sum(name in inode_of for name in _OURS) != len(inode_of):
        known = set(snap.names) if snap is not None else set()
        for name in inode_of.keys() - known:  # set difference: C speed
            if name in _OURS:
                continue
            if is_temp_name(name):
                res.temps.append(name)
            elif len(name) != _NAME_LEN or not name.endswith(RECORD_SUFFIX):
                res.foreign.append(name)
            else:
                to_read.append(name)
    res.temps += staged_temps(directory)
    cols = snap.columns if snap is not None else Columns()
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


def _trusted_by_inode(snap: Snapshot, inode_of: dict[str, int],
                      to_read: list[str]) -> tuple[list[int], int]:
    """Rows of a sealed snapshot whose file is listed under the same inode, and how many
    of its files are listed. A file replaced since has another inode: its header is
    read. (map/zip loops: C speed.)"""
    listed = list(map(inode_of.get, snap.names))  # None: removed since the snapshot
    same = np.fromiter(map(operator.eq, listed, snap.inos), dtype=bool, count=len(listed))
    trusted: list[int] = np.flatnonzero(same).tolist()  # in the snapshot's order
    if len(trusted) != len(listed):
        to_read.extend(name for name, ino, ok in zip(snap.names, listed, same.tolist(),
                                                      strict=True)
                       if not ok and ino is not None)
    return trusted, len(listed) - listed.count(None)


def _trusted_by_stat(directory: str, snap: Snapshot, listed: Set[str], to_read: list[str],
                     res: ScanResult) -> tuple[list[int], int]:
    """Rows of an unsealed snapshot whose file's size, mtime, ctime and inode all match
    and whose mtime is older than the snapshot by the racy window (see snapshot.py),
    and how many of its files are listed."""
    sizes, mtimes, ctimes, inos = snap.columns.file_lens, snap.mtimes, snap.ctimes, snap.inos
    cutoff = snap.cutoff_ns
    trusted: list[int] = []
    present = 0
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # the snapshot's files in its order (write order: inode order on a fresh
        # directory), not the listing's hash order: the stat and compare loop then walks
        # inodes and the snapshot's columns in sequence
        stat = os.stat
        for i, name in enumerate(snap.names):
            if name not in listed:
                continue  # removed since the snapshot
            present += 1
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
    return trusted, present


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
    n = len(cols.keys)
    thin_col = (np.array(cols.flags, dtype=np.int64) & FLAG_THINNED) != 0
    start_col = np.array(cols.starts, dtype=np.int64)
    columns = (cols.keys, cols.parents, cols.starts, cols.ends, cols.row_lens,
               cols.file_lens, cols.created, cols.flags, cols.spans)
    # ready rows first, by first page (stable: equal starts keep their order); a
    # snapshot is written in this order (collect_facts), so a reopen usually only
    # checks it
    if n > 1 and (np.diff((thin_col.astype(np.int64) << 32) | start_col) < 0).any():
        pick = operator.itemgetter(*np.lexsort((start_col, thin_col)).tolist())
        columns = tuple(list(pick(col)) for col in columns)  # type: ignore[assignment]
    attached = 0
    total = 0
    nodes_get = nodes.get
    for key, parent_key, start, end, row_len, file_len, created, flag, span in zip(
            *columns, strict=True):
        thinned = bool(flag & FLAG_THINNED)
        rec = Record(key, parent_key, start, end, row_len, file_len, created, thinned, False)
        if start == 0:
            parent: Node | None = root
        else:
            parent = nodes_get(parent_key)
            if parent is not None and parent.depth != start:
                parent = None
        existing = nodes_get(key)
        if parent is None or (existing is not None and existing.record is not None):
            index.add_orphan(rec)
            continue
        if thinned:
            if not index.attach_interior(rec, [key] if span is None else span, parent):
                index.add_orphan(rec)
        elif span is not None:
            index.add(rec, span, parent, recovering=True)
        else:  # a one-page row: Index.add(recovering=True), inline
            node = existing  # keys chain their parent's: an existing node is parent's child
            if node is None:
                node = Node(key, parent, start + 1)
                parent.children[key] = node
                nodes[key] = node
            rec.node = node
            node.record = rec
            records[key] = rec
            node.covers.append(rec)
            total += file_len
            attached += 1
    index.bytes += total
    index.changes += attached
    index.reseed()
    return index
