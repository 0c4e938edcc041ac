"""POSIX shared-memory segments, opened directly under /dev/shm.

Not ``multiprocessing.shared_memory``: its resource tracker starts a helper process
and unlinks segments it thinks leaked, which fights an ownership ledger that already
decides exactly when each name is unlinked (see docs/design.md).
"""

from __future__ import annotations

import mmap
import os

__all__ = ["SHM_DIR", "create_segment", "open_segment", "unlink_segment"]

SHM_DIR = "/dev/shm"


def _path(name: str) -> str:
    if "/" in name:
        raise ValueError(f"shared-memory name {name!r} may not contain '/'")
    return os.path.join(SHM_DIR, name)


def create_segment(name: str, size: int) -> int:
    """Create ``name`` exclusively (0600) and size it; return the open fd.

    ftruncate gives zero-filled pages: the segment is zeroed before any peer can map it.
    """
    fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_segment(name: str) -> int:
    return os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map an open segment and close the fd: the mapping keeps the memory alive."""
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    os.unlink(_path(name))
