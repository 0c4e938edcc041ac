"""Rows in and out as flat byte views, with no copy where the caller's object allows.

Anything with the buffer protocol (bytes, bytearray, numpy arrays, mmap) is viewed as
is. torch is imported only when a tensor is passed: the cache layer never needs it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

import numpy as np

from ._errors import RowSpanError

__all__ = [
    "ParallelReader", "aligned_empty", "as_byte_view", "as_out_view", "pread_full", "wait_all",
]


def aligned_empty(nbytes: int, align: int = mmap.PAGESIZE) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` starting on an ``align`` boundary.

    numpy aligns its allocations to 16 bytes, and on this VM the kernel copies into a
    buffer 16 bytes off a page boundary at half the speed it copies into one 64 bytes
    off (5.7 against 11.6 GB/s a thread, preadv of 4 MiB rows): loads and the buffers a
    caller passes as ``out`` should start at least 64-byte aligned (torch's CPU and
    pinned allocations are). This one wastes at most ``align`` bytes.
    """
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]


def as_byte_view(row: Any) -> memoryview:
    """A 1-D unsigned-byte view of ``row`` (C-contiguous buffer or CPU/GPU tensor)."""
    try:
        view = memoryview(row)
    except TypeError:
        if not type(row).__module__.startswith("torch"):
            raise RowSpanError(
                f"a row must be a buffer (bytes, bytearray, numpy array) or a torch tensor, "
                f"got {type(row).__name__}"
            ) from None
        view = _tensor_view(row)
    if not view.c_contiguous:
        raise RowSpanError("a row must be C-contiguous; pass arr.copy() or tensor.contiguous()")
    if view.ndim == 1 and view.format == "B":
        return view
    return view.cast("B")


def _tensor_view(tensor: Any) -> memoryview:
    import torch  # lazily: only callers that pass tensors pay for torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # a device row must come to the host to be written; one copy
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(t.numpy())


def as_out_view(out: Any, nbytes: int | None = None) -> memoryview:
    """A writable flat byte view of a load destination (buffer or CPU tensor), no copy;
    ``nbytes`` long where given."""
    if (type(out) is memoryview and out.format == "B" and out.ndim == 1  # a batch's usual
            and out.c_contiguous and not out.readonly
            and (nbytes is None or out.nbytes == nbytes)):
        return out
    size = "" if nbytes is None else f" of {nbytes} bytes"
    if type(out).__module__.startswith("torch") and not isinstance(out, memoryview):
        if out.device.type != "cpu":
            raise RowSpanError("out must be in host memory (a CPU or pinned tensor); copy "
                               "the loaded view to the device yourself")
        if not out.is_contiguous():  # reshape would read into a copy, and lose it
            raise RowSpanError(f"out must be a contiguous tensor{size}")
        import torch  # only callers that pass tensors pay for torch

        view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
    else:
        try:
            view = memoryview(out)
        except TypeError:
            raise RowSpanError(f"out must be a writable buffer, got {type(out).__name__}") from None
    if view.readonly or not view.c_contiguous or (nbytes is not None and view.nbytes != nbytes):
        raise RowSpanError(f"out must be a writable C-contiguous buffer{size}")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def pread_full(fd: int, dst: memoryview, offset: int) -> None:
    """Fill ``dst`` from ``fd`` at ``offset`` with ``preadv`` straight into it (no copy)."""
    got = 0
    while got < dst.nbytes:
        n = os.preadv(fd, [dst[got:]], offset + got)
        if n == 0:
            raise OSError(0, "file shorter than its header says")
        got += n


# Reads of at least this many bytes into a destination that is not 64-byte aligned copy
# from a mapping of the file instead of preadv: on this VM the kernel copies into such a
# buffer at ~5.7 GB/s a thread, a userland copy from the mapped page cache runs at ~11.5
# (mmap and munmap cost more than that saves below ~2 MiB). Into an aligned buffer the
# kernel copies as fast as userland, without the mapping's cost: preadv then wins (4 MiB
# rows loaded just after they were written, two threads: 15.0 GB/s against 10.9).
MAP_MIN = 2 << 20
_FAST_ALIGN = 64
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _copy_range(dst: Any, src: Any, at: int, size: int) -> None:
    # releases the GIL for large copies: parts run on several cores
    np.copyto(dst[at : at + size], src[at : at + size])


def _aligned(dst: memoryview) -> bool:
    return bool(np.frombuffer(dst, dtype=np.uint8).ctypes.data % _FAST_ALIGN == 0)


def _libc_mincore() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _libc_mincore()


def _resident(mapped: mmap.mmap) -> bool:
    """Every page of the mapping is in memory (mincore). A copy from a page that is not
    must read the disk, and an I/O error there is SIGBUS, not EIO: such a read goes
    through preadv instead, whose EIO drops the record."""
    if _MINCORE is None:
        return False
    size = len(mapped)
    vec = np.empty(-(-size // mmap.PAGESIZE), dtype=np.uint8)
    view = np.frombuffer(mapped, dtype=np.uint8)
    try:
        ok = _MINCORE(view.ctypes.data, size, vec.ctypes.data) == 0
    finally:
        del view
    return ok and bool((vec & 1).all())


def wait_all(futures: list[Future[None]]) -> None:
    """Wait until every future is done, through a KeyboardInterrupt too (re-raised
    after): a task still running uses the caller's buffers and state."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # noqa: BLE001  re-raised once all are done
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


class ParallelReader:
    """Reads rows from files into caller memory, a large one in parallel parts.

    ``preadv`` straight into the destination (in ``threads`` page-aligned parts at once
    when large and ``split``: preadv releases the GIL). From ``map_min`` (None: never)
    into a destination that is not 64-byte aligned, the file's range is mapped
    (read-only, populated) and copied, in parallel parts when ``split`` (the copy
    releases the GIL too): on this VM the kernel copies into such a buffer at half the
    speed of a userland copy from the mapped page cache (into an aligned one, at the
    same speed). A mapped copy only runs when every page is resident (after
    the populate), so it never waits on the disk: a page that is not goes through
    preadv, where an I/O error is EIO (the record dropped), not SIGBUS (the process
    killed). The file's length is checked before mapping; our files are never truncated
    in place (writes and thins replace them by rename), so only another program
    truncating a live cache's file could fault a copy under way. The caller's thread
    does the first part; worker threads start on the first large read and stop at
    ``close()``; a read after ``close()`` runs on the caller's thread alone.
    """

    def __init__(self, threads: int, min_part: int = 1 << 20,
                 map_min: int | None = MAP_MIN) -> None:
        self.threads = max(1, threads)
        self.min_part = min_part
        self.map_min = map_min
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def read(self, fd: int, dst: memoryview, offset: int, split: bool = True) -> None:
        n = dst.nbytes
        if self.map_min is None or n < self.map_min or _aligned(dst):
            if not split or n < 2 * self.min_part:
                pread_full(fd, dst, offset)  # one call, no parts
            else:
                self._read_pread(fd, dst, offset, split)
            return
        # a large read into a misaligned buffer: copy from a mapping (see MAP_MIN)
        if os.fstat(fd).st_size < offset + n:
            raise OSError(0, "file shorter than its header says")
        if not self._read_mapped(fd, dst, offset, split):
            self._read_pread(fd, dst, offset, split)

    def _read_mapped(self, fd: int, dst: memoryview, offset: int, split: bool) -> bool:
        n = dst.nbytes
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(fd, offset + n - base, flags=_MAP_FLAGS, prot=mmap.PROT_READ,
                               offset=base)
        except OSError:
            return False  # a filesystem that cannot map: preadv
        with mapped:
            if not _resident(mapped):
                return False
            src = np.frombuffer(mapped, dtype=np.uint8, count=n, offset=offset - base)
            out = np.frombuffer(dst, dtype=np.uint8)
            try:
                self._in_parts(n, split, partial(_copy_range, out, src))
            except BaseException as exc:
                # a traceback keeps the frames' arrays alive, and a mapping with arrays
                # on it cannot close (BufferError would hide this error)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                del src, out
        return True

    def _read_pread(self, fd: int, dst: memoryview, offset: int, split: bool) -> None:
        self._in_parts(dst.nbytes, split,
                       lambda at, size: pread_full(fd, dst[at : at + size], offset + at))

    def _in_parts(self, n: int, split: bool, part: Callable[[int, int], None]) -> None:
        """``part(at, size)`` over ``n`` bytes: in ``threads`` page-aligned parts at once
        when ``split`` and large, the caller's thread doing the first; returns when all
        are done (never with a part running: the caller then unmaps or closes)."""
        parts = min(self.threads, n // self.min_part) if split else 1
        pool = self._get_pool() if parts > 1 else None
        if pool is None:
            part(0, n)
            return
        per = -(-n // parts)
        size = -(-per // 4096) * 4096
        futures: list[Future[None]] = []
        done = size
        try:
            for at in range(size, n, size):
                futures.append(pool.submit(part, at, min(size, n - at)))
                done = at + size
        except RuntimeError:  # shut down meanwhile: the rest here
            if done < n:
                part(done, n - done)
        try:
            part(0, size)
        finally:
            wait_all(futures)
        for f in futures:
            f.result()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Run ``fn(*args)`` on a worker thread; None when there is none (one thread, or
        closed): the caller then runs it itself."""
        pool = self._get_pool() if self.threads > 1 else None
        if pool is None:
            return None
        try:
            return pool.submit(fn, *args)
        except RuntimeError:  # shut down meanwhile
            return None

    def run_all(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run independent reads at once: on the worker threads and the caller's thread,
        each taking the next task until none is left. Returns when every task finished;
        then raises the first task's error, if any (the rest still ran)."""
        pending = iter(tasks)
        take = threading.Lock()
        errors: list[BaseException] = []

        def drain() -> None:
            while True:
                with take:
                    task = next(pending, None)
                if task is None:
                    return
                try:
                    task()
                except BaseException as exc:  # noqa: BLE001  kept: raised after all ran
                    errors.append(exc)

        helpers = min(self.threads - 1, len(tasks) - 1)
        pool = self._get_pool() if helpers > 0 else None
        futures: list[Future[None]] = []
        if pool is not None:
            try:
                futures = [pool.submit(drain) for _ in range(helpers)]
            except RuntimeError:  # shut down meanwhile: the caller's thread does it all
                pass
        try:
            drain()
        finally:
            wait_all(futures)
        if errors:
            raise errors[0]

    def _get_pool(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._pool is None and not self._closed:
                self._pool = ThreadPoolExecutor(self.threads - 1, "phalanx-cache-io")
            return self._pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
