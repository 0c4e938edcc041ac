"""``DiskStore``: the single-rank persistent prefix-cache store.

One directory per rank and model. Records are span files (see record.py); the index
(index.py) is rebuilt from their headers at open (recovery.py); maintenance is a stream
of jobs (maintenance.py) decided by the scheduler and applied by the ``JobRunner``
(jobs.py) in bounded bursts by ``poll()``. ``DiskStore`` composes three parts, each
handed the one ``StoreCore`` (core.py) that holds what they share: the ``Reader``
(loads.py), the ``Writer`` (stores.py) and the ``JobRunner``.

Ownership: what the store acquires at open (the directory lock, the record
descriptors, the io_uring rings, the I/O threads, the snapshot owed at close) is an
entry of one ``CleanupJournal`` the moment it exists. A failure part-way through open
runs that journal (what was acquired is released newest first, and nothing else);
``close()`` runs it too: every step runs even when one fails, the failures come up as
one ``CleanupError`` and stay owed, and a second ``close()`` retries only those.

Thread safety: one mutex guards the index and counters. File writes and load reads run
outside it; a load pins the records it reads, and a store the prefix it extends, so
maintenance defers jobs on them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from phalanx.lifecycle import CleanupError, CleanupJournal, ResourceUncertainError
from phalanx.lifecycle.failpoints import Failpoint
from phalanx.lifecycle.journal import close_on_exit

from .buffers import MAP_MIN, ParallelReader
from .core import StoreCore, StoreState
from .files import Staging, is_temp_name, staged_temps
from .geometry import Geometry
from .index import Record
from .jobs import JobRunner
from .keys import KeyChain, Tokens, fingerprint_digest
from .loads import Destination, LoadRequest, Reader
from .lock import DirLock
from .maintenance import Job, JobKind, JobOutcome, Scheduler
from .manifest import check_or_create
from .open_files import OpenFiles, default_capacity
from .options import StoreOptions
from .record import RECORD_SUFFIX, record_name
from .recovery import build_index_columns, no_gc, recover
from .snapshot import collect_facts, save_snapshot, write_seal
from .stats import CacheStats
from .stores import StoreItem, StoreResult, Writer
from .uring import Rings, unsupported_reason

__all__ = ["DiskStore", "StoreResult"]

log = logging.getLogger("phalanx.kvstore")

# a record write takes milliseconds; a store still writing after this long is on a
# failing disk or a hung network file system (as loads.py's ring deadline)
_CLOSE_DRAIN_S = 120.0

_FP_SEAL = Failpoint("cache.close.seal", "close wrote the snapshot; about to seal it")
_FP_CLOSE_LOCK = Failpoint("cache.close.lock",
                           "close is about to release the directory's lock (the last step)")


@dataclass(eq=False)
class PrefixPins:
    """What :meth:`DiskStore.lookup_pin` found (pages per prefix) and holds pinned."""

    pages: list[int]
    records: list[Record]
    released: bool = False


class DiskStore:
    """Persistent prefix-cache records of one rank in ``directory``.

    ``options`` are the tuning knobs (capacity, age, fsync, threads, descriptors, read
    paths; see :class:`StoreOptions`). ``clock`` gives wall time (tests pass their own
    to age records without sleeping); ``on_job`` sees every maintenance job applied
    (rank 0's replication forwards them to its peers).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        geometry: Geometry,
        fingerprint: str | bytes,
        options: StoreOptions,
        *,
        clock: Callable[[], float] = time.time,
        on_job: Callable[[Job], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.geometry = geometry
        self.fingerprint = fingerprint_digest(fingerprint)
        self.options = options
        # every resource open acquires, each added the moment it exists; close() and a
        # failed open run it (LIFO, every step, failures kept owed)
        self._journal = CleanupJournal(f"cache store {self.directory}")
        try:
            self._core = self._open(clock)
        except BaseException as exc:  # roll back what was acquired, then re-raise as is
            self._roll_back(exc)
            raise
        self._jobs = JobRunner(self._core, on_job)
        self._reader = Reader(self._core)
        self._writer = Writer(self._core, self._jobs)

    def _open(self, clock: Callable[[], float]) -> StoreCore:
        """Acquire, in dependency order, what the store owns; each is journaled as it
        exists. Close releases in reverse: the snapshot, then the I/O threads (loads
        finish), the rings they read through, the descriptors, and the lock last."""
        opts, journal = self.options, self._journal
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        lock = DirLock(self.directory)  # first: touch nothing before owning the dir
        journal.add("directory lock", lambda: self._release_lock(lock))
        check_or_create(self.directory, self.geometry, self.fingerprint)
        # one thread more than cores: a reader woken onto a core that a kernel thread
        # (write-back after a store) holds leaves a core idle until the scheduler moves
        # it; the first load_many after a store ran at 7.7 GB/s with 2 threads on 2
        # cores, 10.4 with 3 (256 KiB rows; later loads 11.0 against 10.8)
        threads = max(1, opts.io_threads if opts.io_threads is not None
                      else min(4, (os.cpu_count() or 1) + 1))
        staging = Staging(self.directory, threads + 1)
        with no_gc():
            result = recover(self.directory, self.geometry, self.fingerprint,
                             progress=opts.progress)
            index = build_index_columns(result.columns)
        files = OpenFiles(default_capacity() if opts.open_files is None else opts.open_files)
        journal.add("open files", files.close)
        rings = self._open_rings(threads - 1)
        if rings is not None:
            journal.add("io_uring rings", rings.close)  # after the parts reading them
        io = ParallelReader(threads, map_min=MAP_MIN if opts.map_reads else None)
        journal.add("I/O threads", io.close)
        scheduler = Scheduler(index, opts.capacity_bytes, opts.max_age, clock)
        scheduler.temps.update(dict.fromkeys(result.temps))
        scheduler.bad.update(dict.fromkeys(name for name, _ in result.bad))
        stats = CacheStats(capacity_bytes=opts.capacity_bytes, recovered=len(result.columns),
                           skipped=result.skipped())
        core = StoreCore(self.directory, self.geometry, self.fingerprint, opts, clock, io,
                         files, staging, rings, index, scheduler, stats)
        # index.changes when the on-disk snapshot last matched the index (-1: it does not)
        clean = (result.from_snapshot == len(result.columns)
                 and result.snapshot in ("used", "sealed"))
        self._snapshot_changes = index.changes if clean else -1
        self._snapshot_taken = result.snapshot_taken_ns if clean else None
        journal.add("header snapshot and seal", lambda: self._close_snapshot(core, lock))
        log.info(
            "cache %s: recovered %d records (%d bytes, %d orphans, %d thinnable) in %.2fs "
            "(%d from the %s snapshot); %d temp files, skipped %s", self.directory,
            len(index.records), index.bytes, len(index.orphans), len(index.thin_candidates),
            result.seconds, result.from_snapshot, result.snapshot, len(result.temps),
            result.skipped() or "none",
        )
        return core

    def _open_rings(self, workers: int) -> Rings | None:
        """One ring per worker thread (ring reads run on those only; see uring.py), when
        asked for, on x86-64, and offered by the kernel; else None: threads read."""
        if not self.options.io_uring or not workers:
            return None
        why = unsupported_reason()
        if why is not None:
            # a tuning knob, not a correctness one: the threads read the same bytes, so
            # a configuration written on x86-64 still opens a store on aarch64
            log.warning("cache %s: io_uring asked for but not used: %s; reading with "
                        "threads", self.directory, why)
            return None
        return Rings.open(workers)

    def _roll_back(self, exc: BaseException) -> None:
        """Undo a failed open. A rollback step that fails too comes up beside the open's
        own error, in one CleanupError (never hidden in ``__context__``)."""
        try:
            self._journal.run()
        except CleanupError as undo:
            if not isinstance(exc, Exception):  # an interrupt stays an interrupt
                exc.add_note(f"and rolling back the open failed: {undo}")
                return
            raise CleanupError(
                f"cache store {self.directory}: open failed ({exc!r}) and rolling back "
                f"what it had acquired failed too; those steps stay owed",
                [exc, *undo.exceptions]) from None

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Wait for store calls already admitted to finish writing (at most
        ``_CLOSE_DRAIN_S``; past it nothing is released and a later close() retries),
        write the header snapshot if the index changed and seal it, stop the I/O
        threads (loads already reading finish), close the rings and the descriptors,
        release the directory lock.

        Every step runs even when one fails; failures come up together as one
        ``CleanupError`` (each in ``.exceptions``, its note naming the step) and stay
        owed: a second ``close()`` retries only those (idempotent once all succeeded).
        A snapshot or seal that cannot be written (OSError) is logged and skipped, not
        a failure: the next open checks or reads those headers.
        """
        core = self._core
        with core.mutex:
            core.state = StoreState.CLOSED
            # a store admitted before still creates and renames files in the directory:
            # the snapshot must cover it and the lock must not go under it
            # (test_close_lets_the_directory_go_only_once_a_store_in_flight_is_done)
            drained = core.idle.wait_for(lambda: not core.writers, _CLOSE_DRAIN_S)
            writers = core.writers
        if not drained:
            raise CleanupError(
                f"cache store {self.directory}: close() released nothing", [
                    ResourceUncertainError(
                        f"cache store {self.directory}: {writers} store call(s) still "
                        f"writing into the directory after {_CLOSE_DRAIN_S:g}s (a failing "
                        "disk or a hung file system?); it stays locked and owned, and the "
                        "next close() tries again")])
        # outside the mutex: a reader thread finishing a load may need it (a corrupt
        # record is dropped under it), and closing waits for those threads
        self._journal.run()

    def _release_lock(self, lock: DirLock) -> None:
        _FP_CLOSE_LOCK.hit()
        lock.release()

    def _close_snapshot(self, core: StoreCore, lock: DirLock) -> None:
        if not lock.held:
            # an earlier close() failed here, ran the later steps and released the lock
            # (the last one): the directory may be another store's now, and only the lock
            # holder may write a snapshot or a seal (an open consumes the seal first,
            # trusting that none outlives a change). Nothing is owed any more: without a
            # seal the next open checks every file against the snapshot, as after a
            # crash (test_a_seal_still_owed_once_the_lock_went_is_never_written_into_...).
            log.warning("cache %s: the header snapshot and seal are not written: this "
                        "store released the directory's lock already", self.directory)
            return
        with core.mutex:
            if core.index.changes != self._snapshot_changes:
                self._save_snapshot_locked()
            if core.index.changes == self._snapshot_changes:
                self._seal_locked()

    @property
    def io_uring(self) -> bool:
        """``load_many`` reads through io_uring: asked for, and offered here."""
        return self._core.rings is not None

    def snapshot(self) -> int:
        """Write the header snapshot now (see snapshot.py), so that a reopen after a
        crash reads only the headers of files changed since; returns the records it
        covers. Files are stat-ed outside the store's mutex; stores and loads go on."""
        core = self._core
        with core.mutex:
            core.check_open()
            taken = time.time_ns()  # before collecting: later changes are never trusted
            changes = core.index.changes
            facts = collect_facts(core.index)
        n = save_snapshot(self.directory, self.geometry, self.fingerprint, taken, facts,
                          self.options.fsync)
        with core.mutex:
            self._snapshot_changes = changes
            self._snapshot_taken = taken
        return n

    def _save_snapshot_locked(self) -> None:
        taken = time.time_ns()
        try:
            save_snapshot(self.directory, self.geometry, self.fingerprint, taken,
                          collect_facts(self._core.index), self.options.fsync)
        except OSError as exc:
            log.warning("cache %s: header snapshot not written (%s); the next open reads "
                        "every header", self.directory, exc)
            return
        self._snapshot_changes = self._core.index.changes
        self._snapshot_taken = taken

    def _seal_locked(self) -> None:
        if self._snapshot_taken is None:
            return
        try:
            _FP_SEAL.hit()
            write_seal(self.directory, self._snapshot_taken, self.options.fsync)
        except OSError as exc:
            log.warning("cache %s: snapshot seal not written (%s); the next open checks "
                        "every file against the snapshot", self.directory, exc)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # the block's own error comes up beside the close's, never in its __context__
        # (test_an_error_in_a_with_block_comes_up_beside_a_failing_close)
        close_on_exit(self.close, exc, f"cache store {self.directory}")

    # -- store / lookup / load ---------------------------------------------------------
    def chain(self, tokens: Tokens) -> KeyChain:
        """The key chain of ``tokens`` for this store's model and page size."""
        return KeyChain(self._core.keys(tokens), self.geometry.page_tokens, self.fingerprint)

    def lookup(self, tokens: Tokens | KeyChain) -> int:
        """Pages of the longest cached page-aligned prefix of ``tokens`` (0 on a miss).

        A token list shorter than a page is a miss, not an error.
        """
        core = self._core
        pt = self.geometry.page_tokens
        short = len(tokens) < (1 if isinstance(tokens, KeyChain) else pt)
        keys = [] if short else core.keys(tokens)
        with core.mutex:
            core.check_open()
            n = core.index.cached_pages(keys)
            if n:
                core.stats.hits += 1
                core.stats.hit_tokens += n * pt
                for rec, _, _ in core.index.plan(keys, n):
                    core.index.touch(rec)
            else:
                core.stats.misses += 1
            return n

    def lookup_pin(self, prefixes: Sequence[Tokens | KeyChain]) -> PrefixPins:
        """``lookup`` of a batch of prefixes at once, pinning the records that hold the
        pages it reports until :meth:`unpin`: maintenance defers its jobs on them and
        making room never evicts them. What a replicated cache's rank 0 uses so that no
        peer is told to evict a record before it read it (phalanx.replication)."""
        core = self._core
        pt = self.geometry.page_tokens
        wanted = [[] if len(t) < (1 if isinstance(t, KeyChain) else pt) else core.keys(t)
                  for t in prefixes]
        pins = PrefixPins([], [])
        with core.mutex:
            core.check_open()
            for keys in wanted:
                n = core.index.cached_pages(keys)
                pins.pages.append(n)
                if not n:
                    core.stats.misses += 1
                    continue
                core.stats.hits += 1
                core.stats.hit_tokens += n * pt
                for rec, _, _ in core.index.plan(keys, n):
                    rec.pins += 1
                    pins.records.append(rec)
            core.index.touch_all(pins.records)
        return pins

    def unpin(self, pins: PrefixPins) -> None:
        """Release what :meth:`lookup_pin` pinned (once; a second call does nothing)."""
        with self._core.mutex:
            if pins.released:
                return
            pins.released = True
            for rec in pins.records:
                rec.pins -= 1

    def load(self, tokens: Tokens | KeyChain, n_pages: int, out: Any = None) -> memoryview:
        """The KV bytes of the first ``n_pages`` pages, as a flat byte memoryview (see
        :meth:`Reader.load`)."""
        return self._reader.load(tokens, n_pages, out)

    def load_many(self, requests: Sequence[LoadRequest]) -> list[Destination]:
        """``load`` of a batch of prefixes, read at once (see :meth:`Reader.load_many`)."""
        return self._reader.load_many(requests)

    def store(self, tokens: Tokens | KeyChain, row: Any) -> StoreResult:
        """Store the KV ``row`` of the last ``len(row) / page_bytes`` full pages of
        ``tokens`` (see :meth:`Writer.store`)."""
        return self._writer.store(tokens, row)

    def store_many(self, items: Sequence[StoreItem]) -> list[StoreResult]:
        """``store`` of a batch of rows, written at once (see :meth:`Writer.store_many`)."""
        return self._writer.store_many(items)

    # -- maintenance -----------------------------------------------------------------
    def poll(self, max_jobs: int | None = None) -> int:
        """Decide and apply at most ``max_jobs`` maintenance jobs; return how many ran."""
        limit = self.options.max_jobs_per_poll if max_jobs is None else max_jobs
        with self._core.mutex:
            self._core.check_open()
            return self._jobs.poll_locked(limit)

    def pending(self) -> int:
        """Known maintenance jobs still queued (0 once maintenance is through)."""
        with self._core.mutex:
            return self._core.scheduler.queued()

    def make_room(self, nbytes: int) -> int:
        """Evict LRU leaves until ``nbytes`` more fit under capacity; return evictions."""
        with self._core.mutex:
            self._core.check_open()
            return self._jobs.make_room_locked(nbytes)

    def apply_job(self, job: Job) -> JobOutcome:
        """Apply one job to this directory (what a peer rank does with rank 0's jobs)."""
        with self._core.mutex:
            self._core.check_open()
            return self._jobs.apply_locked(job)

    # -- replication (replica.py, reconcile.py) ----------------------------------------
    def record_states(self) -> dict[bytes, bool]:
        """Key -> thinned for every attached record: what ranks compare at start-up."""
        with self._core.mutex:
            return {k: r.thinned for k, r in self._core.index.records.items()}

    def page_keys(self, limit: int) -> list[bytes] | None:
        """Every cached page key (the trie's nodes: a key names its whole prefix), or
        None when there are more than ``limit`` (a caller's filter would cost too much
        memory)."""
        with self._core.mutex:
            nodes = self._core.index.nodes
            return None if len(nodes) > limit else list(nodes)

    def prefix_keys(self, key: bytes) -> list[bytes]:
        """Page keys of the cached prefix that ends at node ``key`` ([] when not cached)."""
        with self._core.mutex:
            node = self._core.index.nodes.get(key)
            out: list[bytes] = []
            while node is not None and node.depth:
                out.append(node.key)
                node = node.parent
            out.reverse()
            return out

    def discard(self, key: bytes) -> bool:
        """Remove record ``key`` wherever it sits (start-up reconciliation only).

        Records that only it made reachable become orphans, which maintenance drops.
        False when it is not an attached record. A pinned one is removed all the same:
        a load reading it finishes if it holds the file open, else fails with
        RecordCorruptError; no store takes its name until such loads are done.
        """
        with self._core.mutex:
            self._core.check_open()
            rec = self._core.index.records.get(key)
            if rec is None:
                return False
            self._core.index.remove(rec)
            self._jobs.drop_orphan_locked(rec)
            self._core.retire_locked(rec)
            return True

    def purge_leftovers(self) -> int:
        """Apply only the jobs that decide nothing about records: temp files, bad files
        and orphans. A replica's own leftovers, whose names rank 0 cannot know."""
        with self._core.mutex:
            self._core.check_open()
            sched = self._core.scheduler
            jobs = [Job(JobKind.PURGE_TEMP, name=n) for n in sched.temps]
            jobs += [Job(JobKind.QUARANTINE, name=n) for n in sched.bad]
            jobs += [Job.for_record(JobKind.DROP, r) for r in self._core.index.orphans.values()
                     if not r.pins]
            return sum(self._jobs.apply_locked(j) is JobOutcome.DONE for j in jobs)

    # -- audit and stats ---------------------------------------------------------------
    def check(self) -> list[str]:
        """Audit the index against the directory; returns problems (empty when sound)."""
        with self._core.mutex:
            ix = self._core.index
            problems = ix.problems()
            on_disk: dict[str, int] = {}
            temps = staged_temps(self.directory)
            with os.scandir(self.directory) as it:
                for e in it:
                    if e.name.endswith(RECORD_SUFFIX) and e.is_file():
                        on_disk[e.name] = e.stat().st_size
                    elif is_temp_name(e.name):
                        temps.append(e.name)
            for name in temps:
                if name not in self._core.scheduler.temps and not self._core.inflight:
                    problems.append(f"temp file {name} not queued for purging")
            for rec in [*ix.records.values(), *ix.orphans.values()]:
                name = record_name(rec.key)
                size = on_disk.pop(name, None)
                if size != rec.file_len:
                    problems.append(f"record {name}: {size} bytes on disk, index {rec.file_len}")
            for name in on_disk:
                if name not in self._core.scheduler.bad and not self._core.inflight:
                    problems.append(f"file {name} on disk is not in the index")
            if ix.bytes > self.options.capacity_bytes and not self._core.scheduler.queued() and (
                ix.lru_leaf() is None
            ):
                problems.append(f"{ix.bytes} bytes over capacity with nothing evictable")
            return problems

    def statistics(self) -> CacheStats:
        with self._core.mutex:
            ix = self._core.index
            s = self._core.stats
            s.records = len(ix.records)
            s.thinned_records = sum(1 for r in ix.records.values() if r.thinned)
            s.bytes = ix.bytes
            s.maintenance_queued = self._core.scheduler.queued()
            return CacheStats(**{f: getattr(s, f) for f in s.__struct_fields__})
