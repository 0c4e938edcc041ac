"""File steps of the store: write a record, thin it, remove it, purge, quarantine.

Storage discipline: a record is written to a new temp file (O_EXCL, 0600; in the
writer thread's staging slot, ``Staging``), committed by rename into the cache
directory, and only then is anything it replaces gone; a crash leaves the old state or
the new one plus, at most, a temp file the next open purges. Every step carries a
failpoint; a failure before the commit removes the temp file, after it undoes the
commit, so the caller's error always means "nothing changed".
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from phalanx.lifecycle.failpoints import Failpoint

from ._errors import DiskFullError, StoreWriteError
from .record import RecordHeader, record_name

__all__ = [
    "QUARANTINE_DIR",
    "STAGING_DIR",
    "TEMP_SUFFIX",
    "Staging",
    "is_temp_name",
    "purge_temp",
    "quarantine",
    "remove_record",
    "staged_temps",
    "thin_record",
    "write_record",
]

TEMP_SUFFIX = ".tmp"
QUARANTINE_DIR = "quarantine"
STAGING_DIR = ".staging"

_FP_TEMP_OPENED = Failpoint("cache.store.temp_opened", "record temp file created, empty")
_FP_TEMP_WRITTEN = Failpoint("cache.store.temp_written", "record temp file written, not renamed")
_FP_COMMITTED = Failpoint("cache.store.committed", "record renamed into place, not indexed")
_FP_THIN_WRITTEN = Failpoint("cache.thin.temp_written", "thinned header written, not renamed")
_FP_THIN_COMMITTED = Failpoint("cache.thin.committed", "thinned header renamed over the row")
_FP_REMOVE = Failpoint("cache.remove.unlinking", "record file about to be unlinked")
_FP_PURGE = Failpoint("cache.purge.unlinking", "stale temp file about to be unlinked")
_FP_QUARANTINE = Failpoint("cache.quarantine.moving", "bad file about to be moved aside")

_counter = itertools.count()


def is_temp_name(name: str) -> bool:
    """A temp file's name in the cache directory, or relative to it in a staging slot."""
    head, _, base = name.rpartition("/")
    return base.startswith(".") and base.endswith(TEMP_SUFFIX) and (
        not head or (head.startswith(STAGING_DIR + "/") and head.count("/") == 1))


def _temp_path(tmp_dir: str, key: bytes) -> str:
    return os.path.join(tmp_dir, f".{key.hex()}.{os.getpid()}.{next(_counter)}{TEMP_SUFFIX}")


class Staging:
    """Per-thread subdirectories of ``DIR/.staging/`` for the temp files of record
    writes.

    A filesystem creates a file under its directory's lock, and on this VM's ext4 a
    create costs 20-500 µs of CPU (by the block group the directory landed in): writers
    creating in one directory take turns. Each writer thread creates its temp files in
    a slot of its own (threads take slots round-robin), then renames them into the
    cache directory: 1,024 files of 256 KiB on two threads, 1.06-1.48 GB/s against
    0.59-0.94 through one directory (0.53-0.74 on one thread).
    """

    def __init__(self, directory: str, slots: int) -> None:
        self.root = os.path.join(directory, STAGING_DIR)
        self.slots = max(1, slots)
        _private_dir(self.root)
        for i in range(self.slots):
            _private_dir(os.path.join(self.root, str(i)))
        self._mine = threading.local()
        self._next = itertools.count()

    def path(self) -> str:
        """This thread's staging directory."""
        slot: int | None = getattr(self._mine, "slot", None)
        if slot is None:
            slot = self._mine.slot = next(self._next) % self.slots
        return os.path.join(self.root, str(slot))


def _private_dir(path: str) -> None:
    """``path`` as a directory of ours (0700), made if absent; a symlink or a file
    there is refused (temp files must not land, nor be purged, outside the cache)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise NotADirectoryError(
                errno.ENOTDIR, "not a directory of the cache's (a symlink or a file); the "
                "cache keeps its writers' temp files there: remove it", path) from None


def staged_temps(directory: str) -> list[str]:
    """Temp files in the staging slots (left by writers that died), as names relative
    to ``directory``; PURGE_TEMP jobs take them. Only real directories are listed, never
    through a symlink; an unreadable one (an inspection by another user) lists nothing."""
    out: list[str] = []
    root = os.path.join(directory, STAGING_DIR)
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return out
        with os.scandir(root) as slots:
            for slot in slots:
                if slot.is_dir(follow_symlinks=False):
                    with os.scandir(slot.path) as it:
                        out += [f"{STAGING_DIR}/{slot.name}/{e.name}" for e in it
                                if is_temp_name(e.name) and e.is_file(follow_symlinks=False)]
    except OSError:
        pass
    return out


def _write_all(fd: int, bufs: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwritev(fd, [view], offset)
        view, offset = view[n:], offset + n


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_error(directory: str, key: bytes, what: str, exc: OSError) -> StoreWriteError:
    cls = DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else StoreWriteError
    hint = "free disk space or lower capacity_bytes" if cls is DiskFullError else (
        "check the directory's permissions and disk health")
    return cls(
        f"{what} of record {key.hex()} in {directory} failed: "
        f"[errno {exc.errno} {errno.errorcode.get(exc.errno or 0, '?')}] {exc.strerror}; "
        f"nothing was committed, the cache keeps serving; {hint}"
    )


def _commit(directory: str, key: bytes, write: Callable[[int], None], fsync: bool,
            written: Failpoint, committed: Failpoint, what: str,
            on_renamed: Callable[[], None] | None = None, keep_open: bool = False,
            tmp_dir: str | None = None) -> int | None:
    """Write a temp file (in ``tmp_dir``, default the directory itself), rename it
    into place; with ``keep_open``, return its descriptor (readable) instead of
    closing it."""
    final = os.path.join(directory, record_name(key))
    tmp = _temp_path(tmp_dir or directory, key)
    renamed = False
    fd = -1
    try:
        fd = os.open(tmp, (os.O_RDWR if keep_open else os.O_WRONLY) | os.O_CREAT | os.O_EXCL
                     | os.O_CLOEXEC, 0o600)
        _FP_TEMP_OPENED.hit()
        write(fd)
        if fsync:
            os.fsync(fd)
        if not keep_open:
            os.close(fd)
            fd = -1
        written.hit()
        os.rename(tmp, final)
        renamed = True
        if on_renamed is not None:
            on_renamed()  # the replaced file is gone: the caller's index follows at once
        if fsync:
            _fsync_dir(directory)
        committed.hit()
        return fd if keep_open else None
    except BaseException as exc:  # undo on anything, KeyboardInterrupt included, re-raised
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # the undo below matters more
        try:
            if renamed and what == "write":
                _unlink_quiet(final)  # undo the commit: the caller never indexed it
            elif not renamed:
                _unlink_quiet(tmp)
        except OSError:
            pass  # the next open purges a temp; a committed file is recovered as a record
        if isinstance(exc, OSError):
            raise _write_error(directory, key, what, exc) from exc
        raise


def write_record(directory: str, header: RecordHeader, row: memoryview, fsync: bool,
                 checksums: Future[list[int]] | None = None,
                 keep_open: bool = False, tmp_dir: str | None = None) -> int | None:
    """Write header + row as ``<key>.kv`` via temp + rename. Raises StoreWriteError.
    With ``keep_open``, returns the file's descriptor, open for reading.

    ``checksums``: the row's page checksums, still being computed on another thread;
    the row is written while they are, then the header with them. The file is a temp
    file until the rename: the order is free."""
    def write(fd: int) -> None:
        if checksums is None:
            _write_all(fd, [header.encode(), row])
            return
        # one sequential write from offset 0 (the header's room zeroed for now), as the
        # file would be written without the overlap, then the header over its room
        _write_all(fd, [bytes(header.header_len), row])
        header.crcs = checksums.result()
        _pwrite_all(fd, header.encode(), 0)

    return _commit(directory, header.key, write, fsync, _FP_TEMP_WRITTEN, _FP_COMMITTED,
                   "write", keep_open=keep_open, tmp_dir=tmp_dir)


def thin_record(directory: str, thinned: RecordHeader, fsync: bool,
                on_renamed: Callable[[], None], tmp_dir: str | None = None) -> None:
    """Replace a record's file by its header alone (flag THINNED), atomically.

    ``on_renamed`` runs right after the rename: a later failure (directory fsync, a
    failpoint) cannot undo a thin, so the index must already say "thinned".
    """
    _commit(directory, thinned.key, lambda fd: _write_all(fd, [thinned.encode()]), fsync,
            _FP_THIN_WRITTEN, _FP_THIN_COMMITTED, "thin", on_renamed, tmp_dir=tmp_dir)


def remove_record(directory: str, key: bytes) -> None:
    _FP_REMOVE.hit()
    _unlink_quiet(os.path.join(directory, record_name(key)))


def purge_temp(directory: str, name: str) -> None:
    if not is_temp_name(name):  # never delete what is not ours by name
        raise ValueError(f"{name!r} is not a temp file name")
    _FP_PURGE.hit()
    _unlink_quiet(os.path.join(directory, name))


def quarantine(directory: str, name: str, delete: bool) -> None:
    """Move a bad file into ``DIR/quarantine/`` (or delete it, by policy)."""
    _FP_QUARANTINE.hit()
    src = os.path.join(directory, name)
    if delete:
        _unlink_quiet(src)
        return
    aside = os.path.join(directory, QUARANTINE_DIR)
    os.makedirs(aside, mode=0o700, exist_ok=True)
    try:
        os.rename(src, os.path.join(aside, name))
    except FileNotFoundError:
        pass
