"""Read-only descriptors of record files, kept open between loads.

Opening and closing a record file costs a path lookup and two syscalls per load: about
a sixth of a 256 KiB load on this VM (two threads reading through descriptors kept
open: 12.8 GB/s, opening each time: 11.0). Hot prefixes (a system prompt, a shared
document) are loaded again and again, and a record just written is usually read soon,
so the store keeps descriptors open, least recently used first out, up to a bound well
below the process's descriptor limit.

A descriptor is never closed under a reader: each use holds it (``acquire`` /
``release``). When a record's file is removed or replaced (``forget``), its descriptor
leaves the table at once and closes when its last reader releases it, so a removed
file's space is not held. An open that raced a ``forget`` is used once and not kept.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["OpenFile", "OpenFiles", "default_capacity"]


def default_capacity() -> int:
    """A quarter of the soft descriptor limit, at most 4096 (a server has sockets too)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(0, min(4096, soft // 4))


@dataclass(eq=False)
class OpenFile:
    fd: int
    users: int = 0
    doomed: bool = False  # out of the table: closes when its last user releases it


class OpenFiles:
    """Record key -> open read-only descriptor, bounded, least recently used out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._table: OrderedDict[bytes, OpenFile] = OrderedDict()
        self._lock = threading.Lock()
        self._forgets = 0  # bumped by every forget: an open that raced one is not kept
        self._closed = False

    def acquire(self, key: bytes, directory: str, name: Callable[[bytes], str]) -> OpenFile:
        """The record's descriptor, opened (``directory/name(key)``) if needed; raises
        OSError as ``os.open`` does. (The name is only built on a miss.)"""
        with self._lock:
            f = self._table.get(key)
            if f is not None:
                f.users += 1
                self._table.move_to_end(key)
                return f
            forgets = self._forgets
        fd = os.open(os.path.join(directory, name(key)), os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            f = self._table.get(key)
            if f is not None:  # another reader opened it meanwhile: use theirs
                f.users += 1
                spare: list[int] = [fd]
            else:
                f = OpenFile(fd, users=1)
                if self._closed or self.capacity == 0 or self._forgets != forgets:
                    f.doomed = True
                    spare = []
                else:
                    self._table[key] = f
                    spare = self._trim_locked()
        for d in spare:
            os.close(d)
        return f

    def acquire_held(self, keys: list[bytes]) -> list[OpenFile | None]:
        """``acquire`` of the keys whose descriptor is held, under one lock hold; None
        for the others (the caller opens those through ``acquire``)."""
        out: list[OpenFile | None] = []
        with self._lock:
            table = self._table
            for key in keys:
                f = table.get(key)
                if f is not None:
                    f.users += 1
                    table.move_to_end(key)
                out.append(f)
        return out

    def release_all(self, files: list[OpenFile | None]) -> None:
        """``release`` of each file given (None entries skipped), under one lock hold."""
        close = []
        with self._lock:
            for f in files:
                if f is not None:
                    f.users -= 1
                    if f.doomed and f.users == 0:
                        close.append(f.fd)
        for fd in close:
            os.close(fd)

    def keep(self, key: bytes, fd: int) -> None:
        """Adopt a descriptor of the record's file just written (the store's own, opened
        read-write): the first load need not open it. It replaces any descriptor held
        for that key (of a file the new one was renamed over); it is closed if it
        cannot be kept."""
        with self._lock:
            spare = self._forget_locked(key) if key in self._table else []
            if self._closed or self.capacity == 0:
                spare.append(fd)
            else:
                self._table[key] = OpenFile(fd)
                spare += self._trim_locked()
        for d in spare:
            os.close(d)

    def release(self, f: OpenFile) -> None:
        with self._lock:
            f.users -= 1
            close = f.doomed and f.users == 0
        if close:
            os.close(f.fd)

    def forget(self, key: bytes) -> None:
        """The record's file was removed or replaced: stop handing out its descriptor."""
        with self._lock:
            spare = self._forget_locked(key)
        for d in spare:
            os.close(d)

    def _forget_locked(self, key: bytes) -> list[int]:
        """Take the key's descriptor out of the table: the one to close now, if idle."""
        self._forgets += 1
        f = self._table.pop(key, None)
        if f is None:
            return []
        f.doomed = True
        return [f.fd] if f.users == 0 else []

    def __len__(self) -> int:
        return len(self._table)

    def close(self) -> None:
        """Close every descriptor not in use; those in use close at their release."""
        with self._lock:
            self._closed = True
            table, self._table = self._table, OrderedDict()
            idle = []
            for f in table.values():
                f.doomed = True
                if f.users == 0:
                    idle.append(f.fd)
        for fd in idle:
            os.close(fd)

    def _trim_locked(self) -> list[int]:
        """Take the least recently used idle descriptors out until within capacity."""
        excess = len(self._table) - self.capacity
        victims = []
        for key, f in self._table.items():  # oldest first
            if excess <= 0:
                break
            if f.users == 0:
                victims.append(key)
                excess -= 1
        return [self._table.pop(key).fd for key in victims]
