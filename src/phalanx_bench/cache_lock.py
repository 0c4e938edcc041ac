"""One process at a time fills a shared cache (a fetched wheel, llama.cpp's source and
build, converted model files): the suite runs in two pytest-xdist workers, and two
benchmarks may start together, each finding the cache empty. ``flock`` on a file in the
cache's directory; released when the holder exits, even killed."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["cache_lock"]


@contextmanager
def cache_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s fill lock (made 0700 where missing) for the block."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(directory / ".fill.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # closing drops the lock
