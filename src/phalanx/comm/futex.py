"""Waiting on a 32-bit word of shared memory across processes: Linux futexes.

A waiter sleeps in the kernel until the word's value changes and its writer wakes it:
no core is burnt while a server is idle, and a wake costs one system call (~1-2 us)
with the sleeper running again within tens of microseconds. The engine's step channel
(``engine/worker/step_channel.py``) waits on it in both directions.

Why hand-written: Python has no futex binding, and what the standard library offers
across already-running processes (a FIFO or a socket per rank) needs a file name or a
descriptor handed over, and a read and a write per wake. This is the raw system call
through ctypes, for the two architectures whose call number is known here; elsewhere a
wait polls with a capped backoff (correct, a little slower to wake).

The protocol every user follows (no lost wake-up): the writer stores the new value,
then calls :func:`wake`; the waiter reads the value ``v`` it expects to change, checks
its condition, and calls :func:`wait` with ``v``, which returns at once if the word no
longer holds ``v``. Waits are bounded: callers loop with a deadline and check for dead
peers between slices.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import time
from typing import Any

import numpy as np

__all__ = ["FUTEX_AVAILABLE", "Word", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): across processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


_LIBC = _libc() if _SYS_FUTEX is not None and os.name == "posix" else None
FUTEX_AVAILABLE = _LIBC is not None


class Word:
    """One aligned 32-bit word at ``offset`` of a shared mapping ``buf`` (an mmap):
    its value through numpy, its address for the kernel."""

    def __init__(self, buf: Any, offset: int) -> None:
        if offset % 4:
            raise ValueError(f"a futex word must be 4-byte aligned, not at {offset}")
        self._view = np.frombuffer(buf, dtype=np.uint32, count=1, offset=offset)
        self.address = self._view.ctypes.data

    @property
    def value(self) -> int:
        return int(self._view[0])

    def store(self, value: int) -> None:
        self._view[0] = value & 0xFFFFFFFF

    def release(self) -> None:
        """Drop the view (the mapping can be closed after every word released it)."""
        del self._view


def wait(word: Word, expected: int, timeout: float) -> None:
    """Sleep while ``word`` holds ``expected``, at most ``timeout`` seconds (or until a
    wake, or a signal): the caller re-checks its condition either way."""
    if _LIBC is None:
        _poll(word, expected, timeout)
        return
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    rc = _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(word.address), _FUTEX_WAIT,
                       ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)
    if rc == -1:
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(err, f"futex wait: {os.strerror(err)}")


def wake(word: Word, count: int = 0x7FFFFFFF) -> None:
    """Wake up to ``count`` waiters of ``word`` (after storing its new value)."""
    if _LIBC is None:
        return
    rc = _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(word.address), _FUTEX_WAKE, count,
                       None, None, 0)
    if rc == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake: {os.strerror(err)}")


def _poll(word: Word, expected: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    delay = 5e-6
    while word.value == expected & 0xFFFFFFFF and time.monotonic() < end:
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
