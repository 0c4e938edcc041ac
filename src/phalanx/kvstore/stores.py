"""The write side of ``DiskStore`` (``Writer``): ``store`` one row, ``store_many`` a batch of them.

A store runs in three steps:

- *admit*, under the store's mutex: sizes and gaps checked, the records holding the
  cached prefix the row extends pinned (so making room for the row never evicts the
  prefix it hangs from), room made, the file's bytes reserved against capacity, the
  page keys of its span marked in flight (a store needing those pages waits: it is
  skipped);
- *write*, outside the mutex: page checksums, a temp file, the rename (files.py);
- *index*, under the mutex: the record attached below its prefix, or kept as an
  orphan when that prefix went meanwhile (maintenance drops it); pins, reservation
  and in-flight marks released whatever happened.

``store_many`` admits a whole batch first, in order, each row as if the ones before it
were stored already (a row may extend an earlier row of the batch), then writes the
rows at once on the store's I/O threads and the caller's, then indexes them in order.
Creating the file is most of a small row's store (a create costs 20-500 µs on this
VM's ext4, a 256 KiB write ~60 µs), and creates, writes and renames of different files
overlap in the kernel: LMCache's ``fs_native`` runs four writers for this reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ._errors import CapacityError, RowSpanError, StoreWriteError
from .buffers import as_byte_view, wait_all
from .core import StoreCore
from .files import write_record
from .index import Record
from .jobs import JobRunner
from .keys import ROOT_KEY, KeyChain, Tokens
from .record import RecordHeader, page_crcs

__all__ = ["StoreItem", "StoreResult", "Writer"]

# below, a thread hand-off costs more than the checksums of a lone row it would overlap
_OVERLAP_MIN = 1 << 20

StoreItem = tuple[Tokens | KeyChain, Any]  # (tokens or key chain, row)


@dataclass(frozen=True)
class StoreResult:
    key: bytes  # key of the record's end page
    start_page: int
    end_page: int
    # False: nothing written; every page was cached already, or another call is
    # writing these pages or the ones they extend (store again once those are cached)
    stored: bool
    bytes_written: int


@dataclass(eq=False)
class _Write:
    """One row on its way to disk. From admission until indexed it holds its bytes
    reserved, its span's page keys in flight and its prefix's records pinned."""

    header: RecordHeader
    view: memoryview
    keys: list[bytes]  # page keys 0 .. end of the row's tokens
    pinned: list[Record] = field(default_factory=list)
    reserved: bool = False  # its bytes counted in core.reserved, its span in core.inflight
    written: bool = False  # committed by rename
    kept: int | None = None  # the written file's descriptor, for OpenFiles
    error: BaseException | None = None

    @property
    def start(self) -> int:
        return self.header.start_page

    @property
    def size(self) -> int:
        return self.header.file_len

    def skipped(self) -> StoreResult:
        return StoreResult(self.header.key, self.start, self.header.end_page, False, 0)

    def result(self) -> StoreResult:
        return StoreResult(self.header.key, self.start, self.header.end_page, True, self.size)


class Writer:
    """The write side of one store, on the state it is handed (see core.py); it makes
    room and frees names through the store's ``JobRunner``."""

    def __init__(self, core: StoreCore, jobs: JobRunner) -> None:
        self._core = core
        self._jobs = jobs

    def store(self, tokens: Tokens | KeyChain, row: Any) -> StoreResult:
        """Store the KV ``row`` of the last ``len(row) / page_bytes`` full pages of tokens.

        A row may start at any page up to the cached prefix (overlapping cached pages
        is allowed: maintenance thins the rows it makes redundant), or up to pages
        another call is writing (then nothing is written: ``stored`` is False). Raises
        RowSpanError for bad sizes or a gap, CapacityError, StoreWriteError/DiskFullError
        (nothing visible; the store keeps serving).
        """
        return self._store_all([self._prepare(tokens, row)])[0]

    def store_many(self, items: Sequence[StoreItem]) -> list[StoreResult]:
        """``store`` of a batch of rows (a server's finished requests), results in item
        order. Rows are admitted in order, each as if the ones before it were stored (a
        row may extend an earlier row's tokens; a row whose pages an earlier row holds
        is skipped, as is one that needs pages another call is still writing), written
        at once on the store's I/O threads and the caller's (``io_threads`` in all),
        and indexed in order. The prefixes the rows extend stay pinned until then.

        Bad input (RowSpanError) or no room (CapacityError: the rows, or the rows and
        the pinned prefixes, do not fit) raises before anything is written (records may
        have been evicted making room). A failed write (StoreWriteError, DiskFullError)
        raises once every other row is written and indexed: those are stored, and the
        error's note says how many; a row that extends the failed one is never served
        (an orphan, dropped by maintenance).
        """
        return self._store_all([self._prepare(tokens, row) for tokens, row in items])

    # -- the three steps ---------------------------------------------------------------
    def _prepare(self, tokens: Tokens | KeyChain, row: Any) -> _Write:
        """Check the row's size against its tokens and build its header (no I/O)."""
        view = as_byte_view(row)
        pb = self._core.geometry.page_bytes
        if not view.nbytes or view.nbytes % pb:
            raise RowSpanError(
                f"row of {view.nbytes} bytes is not a positive multiple of the page size "
                f"{pb} ({self._core.geometry})"
            )
        keys = self._core.keys(tokens)
        end = len(keys)
        start = end - view.nbytes // pb
        if start < 0:
            raise RowSpanError(f"row holds {view.nbytes // pb} pages, tokens only {end}")
        header = RecordHeader(
            self._core.geometry, self._core.fingerprint, keys[-1],
            keys[start - 1] if start else ROOT_KEY, start, end, view.nbytes, 0.0,
            keys[start:], [],
        )
        self._jobs.check_fits(header.file_len)
        return _Write(header, view, keys)

    def _store_all(self, prepared: list[_Write]) -> list[StoreResult]:
        with self._core.mutex:
            self._core.check_open()
            writes = self._admit_locked(prepared)
            self._core.writers += 1  # until indexed: close() waits for it (core.py)
        try:
            if len(writes) == 1:  # alone: its checksums may overlap its write
                self._write(writes[0], overlap=True)
            else:
                self._core.io.run_all([partial(self._write, w, False) for w in writes])
        finally:
            self._index_written(writes)  # every admitted row released, written or not
        failed = [w for w in writes if not w.written]
        if failed:
            error = failed[0].error or StoreWriteError(
                f"a store to {self._core.directory} was interrupted before its write")
            if len(prepared) > 1:
                error.add_note(f"store_many: {len(writes) - len(failed)} of {len(writes)} "
                               f"rows to write were stored; {len(failed)} failed")
            raise error
        return [w.result() if w.written else w.skipped() for w in prepared]

    def _admit_locked(self, prepared: list[_Write]) -> list[_Write]:
        """Admit the rows to write, in order. Left unwritten and counted as skipped: a
        row whose pages are all cached, held by an earlier row of the batch or being
        written by another call; and a row extending pages that another call is still
        writing, or that hang from such a row (store it again once they are cached).
        All or nothing: on an error every row admitted so far is released, and no skip
        is counted."""
        ix, inflight = self._core.index, self._core.inflight
        batch: set[bytes] = set()  # page keys that earlier rows of this call will cache
        unsettled: set[bytes] = set()  # page keys of rows skipped for another call's write
        writes: list[_Write] = []
        skipped = 0
        try:
            for w in prepared:  # checks first: nothing is evicted for a refused batch
                keys, start, end = w.keys, w.start, len(w.keys)
                cached = ix.cached_pages(keys)
                if cached >= end or keys[-1] in batch:
                    skipped += 1
                    continue
                # another call is writing these pages or the ones before them, or a load
                # still reads the file of an orphan or a dropped record by this name (at
                # that record's offsets): not now
                later = keys[-1] in inflight
                if start > cached and keys[start - 1] not in batch:
                    if keys[start - 1] not in inflight and keys[start - 1] not in unsettled:
                        raise RowSpanError(
                            f"row covers pages {start}..{end} but only {cached} pages are "
                            f"cached: a row must start at or before page {cached} (no gaps)"
                        )
                    later = True
                orphan = ix.orphans.get(keys[-1]) or self._core.retired.get(keys[-1])
                if later or (orphan is not None and orphan.pins):
                    unsettled.update(keys[cached:])  # rows hanging from it wait too
                    skipped += 1
                    continue
                if start:  # the prefix it extends stays while it is written
                    w.pinned = [rec for rec, _, _ in ix.plan(keys, min(start, cached))]
                    for rec in w.pinned:
                        rec.pins += 1
                batch.update(keys[start:])
                writes.append(w)
            total = sum(w.size for w in writes)
            cap = self._core.options.capacity_bytes
            if total > cap:
                raise CapacityError(
                    f"a store_many batch of {len(writes)} records takes {total} bytes, more "
                    f"than the capacity of {self._core.directory} ({cap} bytes); "
                    "store it in smaller batches"
                )
            for w in writes:
                self._jobs.free_name_locked(w.header.key)
                self._jobs.make_room_locked(w.size)
                self._core.reserved += w.size
                for k in w.keys[w.start :]:
                    inflight[k] += 1
                w.reserved = True
        except BaseException:
            for w in writes:
                self._release_locked(w)
            raise
        self._core.stats.stores_skipped += skipped
        return writes

    def _write(self, w: _Write, overlap: bool) -> None:
        """Checksums, temp file, rename; the outcome is left in ``w`` (never raises)."""
        pb = self._core.geometry.page_bytes
        # a lone large row's checksums are computed on an I/O thread while this one
        # writes the row (both release the GIL): the store costs its write, not both
        checksums = (self._core.io.submit(page_crcs, w.view, pb)
                     if overlap and w.view.nbytes >= _OVERLAP_MIN else None)
        try:
            if checksums is None:
                w.header.crcs = page_crcs(w.view, pb)
            w.header.created = self._core.clock()
            core = self._core
            w.kept = write_record(core.directory, w.header, w.view, core.options.fsync,
                                  checksums, keep_open=core.files.capacity > 0,
                                  tmp_dir=core.staging.path())  # this thread's slot
            w.written = True
        except BaseException as exc:  # noqa: BLE001  raised by the caller once all are done
            w.error = exc
        finally:
            if checksums is not None:
                wait_all([checksums])  # never leave a thread reading the caller's row

    def _index_written(self, writes: list[_Write]) -> None:
        """Release every admitted row; index, in order, those written. The call is no
        longer a writer then (close() may let the directory go)."""
        core = self._core
        with core.mutex:
            try:
                for w in writes:
                    self._release_locked(w)
                    if w.written:
                        self._index_locked(w)
            finally:
                core.writers -= 1
                if not core.writers:
                    core.idle.notify_all()

    def _release_locked(self, w: _Write) -> None:
        if w.reserved:
            inflight = self._core.inflight
            for k in w.keys[w.start :]:
                left = inflight[k] - 1
                if left:
                    inflight[k] = left
                else:
                    del inflight[k]
            self._core.reserved -= w.size
            w.reserved = False
        for rec in w.pinned:
            rec.pins -= 1
        w.pinned = []

    def _index_locked(self, w: _Write) -> None:
        ix, h = self._core.index, w.header
        rec = Record(h.key, h.parent, h.start_page, h.end_page, h.row_len, h.file_len,
                     h.created, thinned=False, verified=True)
        parent = ix.root if h.start_page == 0 else ix.nodes.get(w.keys[h.start_page - 1])
        kept, w.kept = w.kept, None
        try:
            if parent is None or not self._core.is_open():
                ix.add_orphan(rec)  # its prefix went meanwhile (or closed): dropped later
            else:
                ix.add(rec, w.keys[h.start_page :], parent)
                if kept is not None:
                    self._core.files.keep(rec.key, kept)  # a record just written is read soon
                    kept = None
        finally:
            if kept is not None:
                os.close(kept)
        self._core.stats.stores += 1
        self._core.stats.stored_bytes += h.row_len
