"""One store per directory: an exclusive ``flock`` on ``DIR/.lock``.

flock dies with its process (kill -9 included), so a stale lock file is harmless; the
file holds the owner's pid only to name it in the error.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ._errors import StoreLockedError

__all__ = ["LOCK_NAME", "DirLock"]

LOCK_NAME = ".lock"


class DirLock:
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(
                    f"cache directory {directory} is locked by another store "
                    f"(pid {holder}, lock file {self.path}); one store per directory: "
                    "close the other store or use another directory"
                ) from exc
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        """Not released yet: the directory is still this store's."""
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the description drops the flock


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"
