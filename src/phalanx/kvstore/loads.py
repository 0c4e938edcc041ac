"""The read side of ``DiskStore`` (``Reader``): ``load`` one prefix, ``load_many`` a batch of them.

A load plans its pieces (record, first page, stop page) under the store's mutex, pins
those records so maintenance defers jobs on them, reads outside the mutex, and checks
a record's header and page CRCs the first time it is read (``Record.verified``).
A record that fails is dropped from the index and counted: it is never served.

A ``load_many`` batch reads its small verified pieces through io_uring where the
kernel offers it (uring.py): in parts the worker threads take in turn, each part one
system call that copies it, so no Python runs per piece and no thread waits for the
GIL between reads. The rest (files to open, records to verify, large pieces, reads
that came back short) go to the reader threads piece by piece.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from phalanx.lifecycle.failpoints import Failpoint

from ._errors import NotCachedError, RecordCorruptError, RowSpanError
from .buffers import aligned_empty, as_out_view
from .core import StoreCore
from .index import Record
from .keys import KeyChain, Tokens
from .record import page_digest, page_digest_parts, record_name
from .recovery import read_header_at
from .scatter import IOV_MAX, PageScatter, preadv_full
from .uring import RING_MAX_PIECE

__all__ = ["LoadRequest", "Reader"]

log = logging.getLogger("phalanx.kvstore")

_FP_LOAD_PINNED = Failpoint("cache.load.pinned", "load planned, records pinned, not yet read")

# (tokens or key chain, pages) or (tokens or key chain, pages, out buffer or PageScatter)
LoadRequest = tuple[Tokens | KeyChain, int] | tuple[Tokens | KeyChain, int, Any]
# where a load's bytes go: one flat buffer, or the caller's buffers for each page
Destination = memoryview | PageScatter
_Piece = tuple[Record, int, int]
_Read = tuple[Record, int, int, Destination]  # a piece and the part of dst it fills
_RUN_PIECES = 16  # at most this many pieces per load_many task
_RUN_BYTES = 1 << 20  # and about this many bytes
# a read of the page cache or a local disk takes milliseconds: a batch still reading
# after this long is on a failing disk or a hung network filesystem
_RING_DEADLINE_S = 120.0


class Reader:
    """The read side of one store, on the state it is handed (see core.py)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def load(self, tokens: Tokens | KeyChain, n_pages: int, out: Any = None) -> memoryview:
        """The KV bytes of the first ``n_pages`` pages, as a flat byte memoryview.

        ``numpy.frombuffer(view, dtype)`` and ``torch.frombuffer`` wrap it without a
        copy. Pass ``out`` (a writable buffer of n_pages * page_bytes) to read into
        memory you own (pinned, preallocated); start it at least 64-byte aligned (torch
        allocations are; numpy's 16-byte ones halve the kernel's copy speed here).
        (``load_many`` also reads into a :class:`PageScatter`.)
        Raises NotCachedError or RecordCorruptError (that record is never served
        again). A large row is read in parallel parts (``io_threads``).
        """
        if isinstance(out, PageScatter):
            raise RowSpanError("load() reads into one buffer; pass a PageScatter to load_many")
        dst, pieces = self._plan([(tokens, n_pages, out)])[0]
        assert isinstance(dst, memoryview)  # only load_many's may be a PageScatter
        pb = self._core.geometry.page_bytes
        try:
            _FP_LOAD_PINNED.hit()
            for rec, first, stop in pieces:
                self._read_piece(rec, first, stop, _span(dst, first, stop, pb), split=True)
        finally:
            self._unpin([(dst, pieces)])
        return dst

    def load_many(self, requests: Sequence[LoadRequest]) -> list[Destination]:
        """``load`` of a batch of prefixes (a server's batch of requests), their pieces
        read at once on the store's reader threads and the caller's (``io_threads``
        in all). Each request is ``(tokens, n_pages)`` or ``(tokens, n_pages, out)``,
        ``out`` a buffer or a :class:`PageScatter` of the buffers each page goes to;
        returns the views (or the scatters) in request order. All or nothing:
        NotCachedError before anything is read; RecordCorruptError after every other
        read finished (the bad record is dropped: a retry after ``lookup`` loads the
        rest); TimeoutError when io_uring reads have not finished in two minutes (a
        failing disk or a hung network filesystem; the rest were cancelled)."""
        planned = self._plan(requests)
        pb = self._core.geometry.page_bytes
        # a piece that fills its whole destination (a request served by one record, the
        # common case) reads into dst itself, not a slice of it
        reads = [(rec, first, stop, dst if len(pieces) == 1 else _span(dst, first, stop, pb))
                 for dst, pieces in planned for rec, first, stop in pieces]
        try:
            _FP_LOAD_PINNED.hit()
            self._read_threads(self._read_rings(reads))
        finally:
            self._unpin(planned)
        return [dst for dst, _ in planned]

    def _read_rings(self, reads: list[_Read]) -> list[_Read]:
        """Read the pieces that need no Python of their own (a verified record whose
        descriptor is held, a small piece) through the store's rings; returns the
        others, and those that came back short or found no free ring: the threads read
        them the long way."""
        rings = self._core.rings
        if rings is None or not reads:
            return reads
        held = self._core.files.acquire_held([rec.key for rec, *_ in reads])
        try:
            pb = self._core.geometry.page_bytes
            rest: list[_Read] = []
            fast: list[_Read] = []
            fds, offsets, addrs, lengths = [], [], [], []
            for read, f in zip(reads, held, strict=True):
                rec, first, _, view = read
                if (f is None or not rec.verified or isinstance(view, PageScatter)
                        or view.nbytes >= RING_MAX_PIECE):
                    rest.append(read)
                    continue
                fast.append(read)
                fds.append(f.fd)
                offsets.append(rec.file_len - rec.row_len + (first - rec.start) * pb)
                addrs.append(ctypes.addressof(ctypes.c_char.from_buffer(view)))
                lengths.append(view.nbytes)
            if fast:
                sizes = np.array(lengths, dtype=np.int64)
                try:
                    whole = rings.read(
                        np.array(fds, dtype=np.int32), np.array(offsets, dtype=np.int64),
                        np.array(addrs, dtype=np.uint64), sizes, self._core.io.submit,
                        _RING_DEADLINE_S)
                except TimeoutError as exc:
                    exc.add_note(f"loading {len(fast)} pieces from {self._core.directory}")
                    raise
                rest += [read for read, ok in zip(fast, whole.tolist(), strict=True) if not ok]
                with self._core.mutex:
                    self._core.stats.io_uring_loaded_bytes += int(sizes[whole].sum())
            return rest
        finally:
            self._core.files.release_all(held)

    def _read_threads(self, reads: list[_Read]) -> None:
        if not reads:
            return
        # a task reads a run of pieces: small rows cost a task hand-off once per run,
        # not per piece; runs stay short in bytes so the threads finish together (a
        # run of eight 4 MiB rows left one thread reading alone for ~10% of a batch)
        avg = max(1, sum(v.nbytes for *_, v in reads) // len(reads))
        run = max(1, min(_RUN_PIECES, _RUN_BYTES // avg, len(reads) // (4 * self._core.io.threads)))
        tasks = [partial(self._read_run, reads[i : i + run]) for i in range(0, len(reads), run)]
        self._core.io.run_all(tasks)

    def _plan(self, requests: Sequence[LoadRequest]) -> list[tuple[Destination, list[_Piece]]]:
        pb = self._core.geometry.page_bytes
        wanted = []
        for req in requests:
            tokens, n_pages = req[0], req[1]
            out = req[2] if len(req) > 2 else None
            keys = self._core.keys(tokens, limit=n_pages)
            # not bytearray(n): it zero-fills, an extra pass over the row; aligned: the
            # kernel copies into a page-aligned buffer at twice numpy's default's speed
            dst: Destination
            if isinstance(out, PageScatter):
                if out.nbytes != n_pages * pb:
                    raise RowSpanError(f"a PageScatter of {out.nbytes} bytes for {n_pages} "
                                       f"pages of {pb}")
                dst = out
            else:
                dst = (aligned_empty(n_pages * pb).data if out is None
                       else as_out_view(out, n_pages * pb))
            wanted.append((keys, n_pages, dst))
        planned = []
        ix = self._core.index
        with self._core.mutex:
            self._core.check_open()
            for keys, n_pages, _ in wanted:
                if n_pages <= 0 or not ix.has_prefix(keys, n_pages):
                    raise NotCachedError(
                        f"load of {n_pages} pages from {self._core.directory}: only "
                        f"{ix.cached_pages(keys)} cached; call lookup() first and load at "
                        "most what it returns")
            for keys, n_pages, dst in wanted:
                pieces = ix.plan(keys, n_pages)
                for rec, _, _ in pieces:
                    rec.pins += 1  # maintenance defers jobs on pinned records
                planned.append((dst, pieces))
            ix.touch_all([rec for _, pieces in planned for rec, _, _ in pieces])
        return planned

    def _unpin(self, planned: list[tuple[Destination, list[_Piece]]]) -> None:
        with self._core.mutex:
            for _, pieces in planned:
                for rec, _, _ in pieces:
                    rec.pins -= 1
            self._core.stats.loads += len(planned)
            self._core.stats.loaded_bytes += sum(dst.nbytes for dst, _ in planned)

    def _read_run(self, reads: list[_Read]) -> None:
        """Read every piece, even after one failed; then raise the first failure.

        The common case takes a short path: a verified record whose descriptor is held
        is one ``preadv`` (descriptors taken and given back for the whole run under
        one lock hold). The reader threads share the GIL between their reads, and the
        Python a piece runs while holding it delays the other threads too: two threads
        reading 1,024 rows of 256 KiB (the read phase alone), 12.5-14.3 GB/s this way
        against 10.4-12.8 through ``_read_piece`` alone (a bare preadv loop: 12.7-15.2).
        Anything else (a file to open, a record to verify, a short read, an error) goes
        the long way, ``_read_piece``."""
        error: BaseException | None = None
        pb = self._core.geometry.page_bytes
        held = self._core.files.acquire_held([rec.key for rec, *_ in reads])
        try:
            for (rec, first, stop, view), f in zip(reads, held, strict=True):
                if f is not None and rec.verified:
                    at = rec.file_len - rec.row_len + (first - rec.start) * pb
                    iov = view.views if isinstance(view, PageScatter) else [view]
                    try:
                        if len(iov) <= IOV_MAX and os.preadv(f.fd, iov, at) == view.nbytes:
                            continue
                    except OSError:
                        pass  # the long way says what it is
                try:
                    self._read_piece(rec, first, stop, view, split=False)
                except BaseException as exc:  # noqa: BLE001  raised once the rest are read
                    error = error or exc
        finally:
            self._core.files.release_all(held)
        if error is not None:
            raise error

    def _read_piece(self, rec: Record, first: int, stop: int, dst: Destination,
                    split: bool) -> None:
        pb = self._core.geometry.page_bytes
        offset = rec.file_len - rec.row_len + (first - rec.start) * pb  # past the header
        crcs = None
        try:
            f = self._core.files.acquire(rec.key, self._core.directory, record_name)
            try:
                # straight into dst (in parallel parts when large and split)
                if isinstance(dst, PageScatter):
                    preadv_full(f.fd, dst.views, offset)
                else:
                    self._core.io.read(f.fd, dst, offset, split)
                if not rec.verified:
                    h = read_header_at(f.fd)  # the same file as the row just read
                    if (h.key, h.start_page, h.end_page, h.row_len, h.thinned) != (
                        rec.key, rec.start, rec.end, rec.row_len, rec.thinned
                    ):
                        raise ValueError("its header does not match the index")
                    crcs, digest = h.crcs, page_digest(h.version)
                    parts_digest = page_digest_parts(h.version)
            finally:
                self._core.files.release(f)
        except (OSError, ValueError) as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                exc.add_note(f"loading from {self._core.directory}: out of file descriptors "
                             "(the record is fine); lower StoreOptions(open_files=) or raise the "
                             "descriptor limit")
                raise
            self._corrupt(rec, f"unreadable: {exc}")
            raise RecordCorruptError(
                f"record {rec.key.hex()} in {self._core.directory} could not be read ({exc}); "
                "it is dropped from the index; the prefix will be recomputed"
            ) from exc
        if crcs is not None:
            for i in range(stop - first):
                got = (parts_digest(dst.page(i)) if isinstance(dst, PageScatter)
                       else digest(dst[i * pb : (i + 1) * pb]))
                if got != crcs[first - rec.start + i]:
                    self._corrupt(rec, f"page {first + i} checksum mismatch")
                    raise RecordCorruptError(
                        f"record {rec.key.hex()} in {self._core.directory}: page {first + i} "
                        "failed its checksum (torn write or bit rot); it is moved aside and never "
                        "served; the prefix will be recomputed"
                    )
            if first == rec.start and stop == rec.end:
                rec.verified = True  # every page checked once; the page cache holds them

    def _corrupt(self, rec: Record, why: str) -> None:
        log.warning("cache %s: record %s is corrupt (%s)", self._core.directory, rec.key.hex(), why)
        self._core.files.forget(rec.key)  # a file fixed or replaced later is opened afresh
        with self._core.mutex:
            self._core.stats.corrupt_loads += 1
            if self._core.index.records.get(rec.key) is rec and not rec.thinned:
                self._core.index.remove(rec)
            if self._core.index.forget_orphan(rec.key) is not None:
                self._core.scheduler.bad[record_name(rec.key)] = None
                self._core.retire_locked(rec)  # this load's pin, at least, is still held


def _span(dst: Destination, first: int, stop: int, page_bytes: int) -> Destination:
    """Pages ``[first, stop)`` of a load's destination (no copy)."""
    if isinstance(dst, PageScatter):
        return dst.span(first, stop)
    return dst[first * page_bytes : stop * page_bytes]
