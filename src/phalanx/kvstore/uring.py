"""Batched file reads through io_uring: one system call reads a run of pieces.

``load_many`` of small rows is bound by Python per read, not by the copy: reader
threads take turns on the GIL between their ``preadv`` calls, and the turns cost
wake-ups. Through a ring, a part of the batch is written as submission entries by a
few numpy operations and handed to the kernel by one ``io_uring_enter``; a read whose
pages are in the page cache is copied right there, in that system call, with the GIL
released (a page cache miss goes to the kernel's I/O workers and completes later).
``Rings`` holds one ring per worker thread and splits a batch into parts the worker
threads take in turn, so every core copies and no Python runs between the reads of a
part. On this 2-core VM, 1,024 files of 256 KiB just written, in one process: two
threads with a ring each 12.3-13.0 GB/s against 8.8-9.3 for a preadv loop on three
threads; the store's ``load_many`` 10.7 against 9.8 (LMCache fs_native 10.0 in the
same run; BENCHMARKS.md). Large pieces gain nothing (4 MiB rows: 13.4 against 14.3):
the store sends only pieces below ``RING_MAX_PIECE``.

Tried first and dropped: one ring for the whole batch with ``IOSQE_ASYNC`` (the
kernel's workers copy): the first batch on a fresh ring pays for creating those
workers (32-44 ms against 20-22 for 256 MiB), and the store's loads ran slower than
on threads (first load after a store 6.75 against 8.60 GB/s).

Hand-written on raw system calls (ctypes, which releases the GIL while the call runs)
rather than through the ``liburing`` binding: that binding holds the GIL while it
waits, which would stop every other thread of a server for the length of a read.
Needs Linux 5.11 (``IORING_FEAT_EXT_ARG``: waits with a timeout); ``Ring.open``
returns None where the kernel is older, io_uring is disabled
(``kernel.io_uring_disabled``) or a seccomp profile refuses it (container runtimes'
defaults do), and the store reads with threads instead.

The kernel writes into the caller's buffers until each read completes, so ``read``
never returns with a read in flight: past its deadline it cancels what is left, waits
for the cancellations, then raises TimeoutError.

Opt-in, and x86-64 only (``StoreOptions(io_uring=True)``). The ring's head and tail
indices are shared with the kernel and must be read with acquire and written with
release ordering (liburing's ``smp_load_acquire``/``smp_store_release``). Python and
ctypes cannot issue those fences without a compiled helper; here the indices are plain
loads and stores of a numpy view, which x86-64's total store order makes correct and
nothing else does: on aarch64 a completion's tail could be seen before the kernel's
copy into the buffer, and the store would serve bytes the kernel had not yet written.
The gain is ~8% on 256 KiB rows and none from 1 MiB, not worth a wrong answer on the
hosts this project's incident reports came from (aarch64). See
:func:`unsupported_reason`.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import mmap
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from phalanx.lifecycle.failpoints import Failpoint

from ._errors import LoadTimeoutError, StoreClosedError
from .buffers import wait_all

__all__ = ["RING_MAX_PIECE", "SQE_MAX_BYTES", "Ring", "Rings", "unsupported_reason"]

log = logging.getLogger("phalanx.kvstore")

# the machines whose memory ordering makes unfenced reads of the ring indices correct
_TSO_MACHINES = frozenset({"x86_64", "AMD64"})


def unsupported_reason(machine: str | None = None) -> str | None:
    """Why this module's rings are not safe on ``machine`` (default: this one), or None
    where they are. Only x86-64's total store order makes the unfenced index reads
    correct (see the module docstring)."""
    machine = platform.machine() if machine is None else machine
    if machine in _TSO_MACHINES:
        return None
    return (f"io_uring reads are x86-64 only: the ring indices are read without memory "
            f"barriers, which {machine or 'this machine'}'s memory ordering does not make "
            "safe (the kernel's copy could be seen after its completion)")

_FP_SETUP = Failpoint("cache.uring.setup", "about to create the io_uring (errno: unavailable)")
_FP_ENTER = Failpoint("cache.uring.enter", "about to submit to or wait on a ring (errno: "
                      "the call fails)")

# A read is split into entries of at most this many bytes (one entry's length is 32-bit)
SQE_MAX_BYTES = 1 << 20
# The store reads pieces below this size through rings, larger ones on threads: a large
# piece's Python is nothing beside its copy, and threads split it across cores
RING_MAX_PIECE = 1 << 20
# A batch is cut into parts of about this many bytes (at least one per ring): the
# worker threads take parts in turn, so a thread that started late takes fewer
_PART_BYTES = 16 << 20

_SYS_SETUP, _SYS_ENTER = 425, 426  # the same numbers on every Linux architecture
_OFF_SQ_RING, _OFF_SQES = 0, 0x10000000
_FEAT_SINGLE_MMAP, _FEAT_EXT_ARG = 1 << 0, 1 << 8
_ENTER_GETEVENTS, _ENTER_EXT_ARG = 1 << 0, 1 << 3
_OP_ASYNC_CANCEL, _OP_READ = 14, 22
_CANCEL_ANY = 1 << 2
_CANCEL_INDEX = 0xFFFFFFFF  # low half of a cancel entry's user_data (reads: their index)
_WAIT_SLICE_S = 1.0  # a wait past the deadline logs at most this often

_SQE = np.dtype({
    "names": ["opcode", "flags", "ioprio", "fd", "off", "addr", "len", "op_flags",
              "user_data"],
    "formats": [np.uint8, np.uint8, np.uint16, np.int32, np.uint64, np.uint64, np.uint32,
                np.uint32, np.uint64],
    "offsets": [0, 1, 2, 4, 8, 16, 24, 28, 32],
    "itemsize": 64,
})
_CQE = np.dtype({"names": ["user_data", "res"], "formats": [np.uint64, np.int32],
                 "offsets": [0, 8], "itemsize": 16})


class _Offsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in (
        "head", "tail", "ring_mask", "ring_entries", "flags_or_overflow", "dropped_or_cqes",
        "array_or_flags", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("sq_thread_cpu", ctypes.c_uint32),
                ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
                ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _Offsets), ("cq_off", _Offsets)]


class _GetEventsArg(ctypes.Structure):
    _fields_ = [("sigmask", ctypes.c_uint64), ("sigmask_sz", ctypes.c_uint32),
                ("min_wait_usec", ctypes.c_uint32), ("ts", ctypes.c_uint64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


def _libc_syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_SYSCALL = _libc_syscall()


def _c(value: int) -> ctypes.c_long:
    # syscall() is variadic: a bare Python int would be passed as a C int, and the
    # kernel would read the upper half of its 64-bit register as garbage
    return ctypes.c_long(value)


class Ring:
    """One io_uring for batches of reads; one batch at a time (``lock``)."""

    def __init__(self, fd: int, params: _Params, mapped: mmap.mmap, sqes: mmap.mmap) -> None:
        self.lock = threading.Lock()  # held by the batch in flight, and by close()
        self.entries = int(params.sq_entries)
        self._fd = fd
        self._mapped, self._sqes_map = mapped, sqes
        words = np.frombuffer(mapped, dtype=np.uint32)
        sq, cq = params.sq_off, params.cq_off
        self._words = words
        self._sq_tail = sq.tail // 4
        self._sq_mask = int(words[sq.ring_mask // 4])
        self._cq_head, self._cq_tail = cq.head // 4, cq.tail // 4
        self._cq_mask = int(words[cq.ring_mask // 4])
        # submission slot i always names entry i: the array is written once
        first = sq.array_or_flags // 4
        words[first : first + self.entries] = np.arange(self.entries, dtype=np.uint32)
        self._sqes = np.frombuffer(sqes, dtype=_SQE)
        # the fields above do not cover an entry: the rest (personality, buffer index,
        # ...) must be zero, and is zeroed through this view
        self._sqe_bytes = np.frombuffer(sqes, dtype=np.uint8).reshape(-1, _SQE.itemsize)
        cqes = np.frombuffer(mapped, dtype=np.uint8)
        at = cq.dropped_or_cqes
        self._cqes = cqes[at : at + int(params.cq_entries) * _CQE.itemsize].view(_CQE)
        self._closed = False
        self._failed = False  # io_uring_enter failed, or a forked child: never submit again
        self._tag = 0  # batch counter, the high half of user_data: a stale entry is ignored
        _OPEN.add(self)

    @property
    def usable(self) -> bool:
        """Open and not failed; check it holding ``lock`` (close() takes it)."""
        return not (self._closed or self._failed)

    @classmethod
    def open(cls, entries: int = 1024) -> Ring | None:
        """A ring, or None where this kernel or sandbox offers none (said at debug)."""
        try:
            _FP_SETUP.hit()
            if _SYSCALL is None:
                raise OSError(errno.ENOSYS, "no libc syscall()")
            why = unsupported_reason()
            if why is not None:
                raise OSError(errno.ENOSYS, why)
            params = _Params()
            fd = _SYSCALL(_c(_SYS_SETUP), _c(entries), ctypes.byref(params))
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        except OSError as exc:
            log.debug("io_uring unavailable (%s): loads read with threads", exc)
            return None
        try:
            need = _FEAT_SINGLE_MMAP | _FEAT_EXT_ARG
            if params.features & need != need:
                raise OSError(errno.ENOSYS, "kernel older than 5.11 (no IORING_FEAT_EXT_ARG)")
            size = max(params.sq_off.array_or_flags + 4 * params.sq_entries,
                       params.cq_off.dropped_or_cqes + _CQE.itemsize * params.cq_entries)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, prot, offset=_OFF_SQ_RING)
            try:
                sqes = mmap.mmap(fd, _SQE.itemsize * params.sq_entries, mmap.MAP_SHARED,
                                 prot, offset=_OFF_SQES)
            except BaseException:
                mapped.close()
                raise
            try:
                return cls(fd, params, mapped, sqes)
            except BaseException:
                sqes.close()
                mapped.close()
                raise
        except OSError as exc:
            os.close(fd)
            log.debug("io_uring unusable (%s): loads read with threads", exc)
            return None
        except BaseException:
            os.close(fd)
            raise

    def read(self, fds: npt.NDArray[np.int32], offsets: npt.NDArray[np.int64],
             addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64],
             deadline_s: float) -> npt.NDArray[np.bool_]:
        """Read ``lengths[i]`` bytes of ``fds[i]`` at ``offsets[i]`` into the memory at
        ``addrs[i]``, all at once; which reads came back whole (a short read or an
        error is False: the caller reads it again the long way, which says why).

        The caller keeps the descriptors open and the memory alive until this returns
        and holds ``lock``. Raises TimeoutError past ``deadline_s`` (after every read
        finished or was cancelled)."""
        if not self.usable:
            raise StoreClosedError("io_uring ring used after close() or a failed "
                                   "io_uring_enter; the store reads with threads instead")
        # split large reads into entries of at most SQE_MAX_BYTES
        count = np.maximum(1, -(-lengths // SQE_MAX_BYTES))
        piece = np.repeat(np.arange(len(fds)), count)
        within = np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)
        skip = within * SQE_MAX_BYTES
        want = np.minimum(SQE_MAX_BYTES, lengths[piece] - skip)
        res = np.empty(len(piece), dtype=np.int64)
        end = time.monotonic() + deadline_s
        for lo in range(0, len(piece), self.entries):
            hi = min(len(piece), lo + self.entries)
            self._batch(fds[piece[lo:hi]], offsets[piece[lo:hi]] + skip[lo:hi],
                        addrs[piece[lo:hi]] + skip[lo:hi].astype(np.uint64), want[lo:hi],
                        res[lo:hi], end)
        bad = np.bincount(piece, weights=res != want, minlength=len(fds))
        return np.asarray(bad == 0)

    def _batch(self, fds: npt.NDArray[np.int32], offsets: npt.NDArray[np.int64],
               addrs: npt.NDArray[np.uint64], want: npt.NDArray[np.int64],
               res: npt.NDArray[np.int64], end: float) -> None:
        n = len(fds)
        self._tag = (self._tag + 1) & 0x7FFFFFFF
        tail = int(self._words[self._sq_tail])
        slots = (tail + np.arange(n)) & self._sq_mask
        self._sqe_bytes[slots] = 0
        self._sqes["opcode"][slots] = _OP_READ  # flags 0: a page cache hit is copied inline
        self._sqes["fd"][slots] = fds
        self._sqes["off"][slots] = offsets
        self._sqes["addr"][slots] = addrs
        self._sqes["len"][slots] = want
        self._sqes["user_data"][slots] = (self._tag << 32) | np.arange(n, dtype=np.uint64)
        flight = _Flight(self._tag, left=0, unsubmitted=0)
        try:
            # the kernel reads the tail inside io_uring_enter: the entries are visible
            self._words[self._sq_tail] = (tail + n) & 0xFFFFFFFF
            flight.left = flight.unsubmitted = n
            self._wait(flight, res, end)
        except BaseException:
            self._settle(flight, res)
            raise
        if flight.cancelled:
            raise LoadTimeoutError(f"io_uring: {n} reads did not finish within the load's "
                                   "deadline; the rest were cancelled")

    def _wait(self, flight: _Flight, res: npt.NDArray[np.int64], end: float) -> None:
        """Submit and reap until every read completed; past ``end``, cancel the rest
        and wait for those (the kernel writes into the caller's memory until then)."""
        warned = time.monotonic()
        while flight.left > 0:
            now = time.monotonic()
            if now >= end and not flight.cancelled:
                self._cancel(flight)
            wait_s = _WAIT_SLICE_S if flight.cancelled else min(_WAIT_SLICE_S, end - now)
            flight.unsubmitted -= self._enter(flight.unsubmitted, wait_s)
            flight.left -= self._reap(flight.tag, res)
            if flight.cancelled and flight.left > 0 and now - warned >= _WAIT_SLICE_S:
                warned = now
                log.warning("io_uring: %d reads still in flight past their deadline; "
                            "waiting for them (they write into the caller's buffers)",
                            flight.left)

    def _settle(self, flight: _Flight, res: npt.NDArray[np.int64]) -> None:
        """After an error in ``_wait``: cancel what is left and wait until nothing is
        in flight, through further errors, before the first one goes up (the caller
        then frees the memory the reads write into)."""
        warned = time.monotonic()
        while flight.left > 0:
            try:
                if self._failed:  # io_uring_enter refuses: completions still arrive
                    self._take_back(flight)
                    time.sleep(0.001)
                else:
                    if not flight.cancelled:
                        self._cancel(flight)
                    flight.unsubmitted -= self._enter(flight.unsubmitted, _WAIT_SLICE_S)
            except BaseException:  # noqa: BLE001  the first error goes up after
                time.sleep(0.001)
            try:
                flight.left -= self._reap(flight.tag, res)
            except BaseException:  # noqa: BLE001  as above
                time.sleep(0.001)
            now = time.monotonic()
            if flight.left > 0 and now - warned >= _WAIT_SLICE_S:
                warned = now
                log.warning("io_uring: after an error, %d reads still in flight; waiting "
                            "for them (they write into the caller's buffers)", flight.left)

    def _enter(self, submit: int, wait_s: float) -> int:
        """Submit ``submit`` entries and wait for a completion for at most ``wait_s``;
        returns how many were submitted."""
        assert _SYSCALL is not None
        try:
            _FP_ENTER.hit()
        except OSError as exc:  # armed "errno:N": as if the call had failed with N
            return self._enter_failed(exc.errno or errno.EIO)
        ts = _Timespec(int(wait_s), int((wait_s % 1) * 1e9))
        arg = _GetEventsArg(0, 0, 0, ctypes.addressof(ts))
        rc = _SYSCALL(_c(_SYS_ENTER), _c(self._fd), _c(submit), _c(1),
                      _c(_ENTER_GETEVENTS | _ENTER_EXT_ARG), ctypes.byref(arg),
                      _c(ctypes.sizeof(arg)))
        return int(rc) if rc >= 0 else self._enter_failed(ctypes.get_errno())

    def _enter_failed(self, err: int) -> int:
        """io_uring_enter failed with ``err``, submitting nothing: go round again (0),
        or raise OSError and mark the ring failed."""
        if err in (errno.EINTR, errno.ETIME):
            return 0  # nothing completed in time, or a signal: go round again
        if err in (errno.EAGAIN, errno.EBUSY):
            time.sleep(0.001)  # the kernel is short of resources, or completions to reap
            return 0
        # not an answer a ring in use gives: never submit through it again
        self._failed = True
        raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def _reap(self, tag: int, res: npt.NDArray[np.int64]) -> int:
        """Copy out the completions there are (read results into ``res``); how many of
        them belong to the batch ``tag`` (nothing else should be there)."""
        head, tail = int(self._words[self._cq_head]), int(self._words[self._cq_tail])
        k = (tail - head) & 0xFFFFFFFF
        if not k:
            return 0
        cqes = self._cqes[(head + np.arange(k)) & self._cq_mask]  # a copy
        ids = cqes["user_data"]
        mine = (ids >> np.uint64(32)) == tag
        index = ids & np.uint64(0xFFFFFFFF)
        reads = mine & (index != _CANCEL_INDEX)
        res[index[reads].astype(np.intp)] = cqes["res"][reads]
        done = int(mine.sum())
        # last: an error above leaves the entries to be reaped again, to the same effect
        self._words[self._cq_head] = tail
        return done

    def _cancel(self, flight: _Flight) -> None:
        """Take back the entries the kernel has not seen and queue one cancel of every
        read in flight (Linux 5.19 and later; before, it is refused and the reads are
        waited for)."""
        self._take_back(flight)
        tail = int(self._words[self._sq_tail])
        slot = tail & self._sq_mask
        self._sqe_bytes[slot] = 0
        self._sqes["opcode"][slot] = _OP_ASYNC_CANCEL
        self._sqes["op_flags"][slot] = _CANCEL_ANY
        self._sqes["user_data"][slot] = (flight.tag << 32) | _CANCEL_INDEX
        self._words[self._sq_tail] = (tail + 1) & 0xFFFFFFFF
        flight.left += 1  # the cancel's own completion
        flight.unsubmitted, flight.cancelled = 1, True

    def _take_back(self, flight: _Flight) -> None:
        """Withdraw the entries at the end of the queue that the kernel has not taken
        (it takes entries only inside io_uring_enter, which reports how many)."""
        n = flight.unsubmitted
        self._words[self._sq_tail] = (int(self._words[self._sq_tail]) - n) & 0xFFFFFFFF
        flight.unsubmitted = 0
        flight.left -= n

    def close(self) -> None:
        """Release the ring; waits for a batch in flight to finish. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(self)
            del self._sqes, self._sqe_bytes, self._cqes, self._words
            try:
                self._sqes_map.close()
                self._mapped.close()
            except BufferError:  # a view is still referenced: unmapped when it goes
                log.debug("io_uring: a ring mapping outlives close()")
            finally:
                os.close(self._fd)


@dataclass(slots=True)
class _Flight:
    """A batch between its submission and its last completion."""

    tag: int  # the high half of its entries' user_data
    left: int  # completions still to come (a queued cancel's own included)
    unsubmitted: int  # entries at the end of the queue the kernel has not taken
    cancelled: bool = False


_OPEN: weakref.WeakSet[Ring] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a child shares its parent's rings (MAP_SHARED): it must never submit through them;
    # a lock a parent's thread held stays held in the child: close() would wait forever
    for ring in list(_OPEN):
        ring._failed = True
        ring.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Rings:
    """One ring per worker thread: a batch's reads in parts, on those threads at once."""

    def __init__(self, rings: list[Ring]) -> None:
        self._rings = rings

    @classmethod
    def open(cls, count: int, entries: int = 256) -> Rings | None:
        """``count`` rings, or None where the kernel offers none."""
        rings: list[Ring] = []
        try:
            for _ in range(max(1, count)):
                ring = Ring.open(entries)
                if ring is None:
                    break
                rings.append(ring)
            else:
                return cls(rings)
        except BaseException:
            for r in rings:
                r.close()
            raise
        for r in rings:
            r.close()
        return None

    def read(self, fds: npt.NDArray[np.int32], offsets: npt.NDArray[np.int64],
             addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.int64],
             submit: Callable[..., Future[Any] | None],
             deadline_s: float) -> npt.NDArray[np.bool_]:
        """``Ring.read`` of the batch, cut into parts of about equal bytes that the
        worker threads (``submit``) take in turn, each through a free ring; returns
        when every part is done. A part that finds no free ring (another batch holds
        them all), a failed ring, or no thread to run it reads nothing: its reads come
        back False, like short ones. Raises TimeoutError as ``Ring.read`` does.

        Parts run on the worker threads only, never the caller's: a KeyboardInterrupt
        (raised in the main thread only) must not land between a system call that
        submitted entries and the count of them, which would leave the ring unable to
        tell what is in flight."""
        n = len(fds)
        whole = np.zeros(n, dtype=bool)
        if not n:
            return whole
        ends = np.cumsum(lengths)
        parts = max(len(self._rings), int(ends[-1]) // _PART_BYTES)
        cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts)
        bounds = [0, *sorted(set(cuts.tolist()) - {0, n}), n]

        def part(lo: int, hi: int) -> None:
            ring = self._take_usable()
            if ring is None:
                return
            try:
                whole[lo:hi] = ring.read(fds[lo:hi], offsets[lo:hi], addrs[lo:hi],
                                         lengths[lo:hi], deadline_s)
            except TimeoutError:
                raise
            except OSError as exc:  # the ring is failed now: the threads read these
                log.warning("io_uring: %s; loads read with threads from now on", exc)
            finally:
                ring.lock.release()

        futures = []
        for lo, hi in itertools.pairwise(bounds):
            future = submit(part, lo, hi)
            if future is None:  # no worker thread (closing): the threads path reads them
                break
            futures.append(future)
        wait_all(futures)  # through a KeyboardInterrupt too: parts write into the caller's
        for future in futures:
            future.result()
        return whole

    def _take_usable(self) -> Ring | None:
        """A ring that is free, open and not failed, its lock held; None if none is."""
        for ring in self._rings:
            if ring.lock.acquire(blocking=False):
                if ring.usable:
                    return ring
                ring.lock.release()
        return None

    def close(self) -> None:
        """Close every ring; each waits for a part reading through it."""
        for ring in self._rings:
            ring.close()
