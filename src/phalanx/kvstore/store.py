"""``DiskStore``: the single-rank persistent prefix-cache store.

One directory per rank and model. Records are span files (see record.py); the index
(index.py) is rebuilt from their headers at open (recovery.py); maintenance is a stream
of jobs (maintenance.py) applied in bounded bursts by ``poll()``. The write side is
stores.py, the read side loads.py.

Thread safety: one mutex guards the index and counters. File writes and load reads run
outside it; a load pins the records it reads, and a store the prefix it extends, so
maintenance defers jobs on them.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

from phalanx.lifecycle.failpoints import Failpoint

from ._errors import (
    CapacityError,
    RowSpanError,
    StoreClosedError,
)
from .buffers import MAP_MIN, ParallelReader
from .files import (
    Staging,
    is_temp_name,
    purge_temp,
    quarantine,
    remove_record,
    staged_temps,
    thin_record,
)
from .geometry import Geometry
from .index import Record
from .keys import KeyChain, Tokens, fingerprint_digest, page_keys
from .loads import Loads
from .lock import DirLock
from .maintenance import Job, JobKind, JobOutcome, Scheduler
from .manifest import check_or_create
from .open_files import OpenFiles, default_capacity
from .record import FLAG_THINNED, RECORD_SUFFIX, RecordHeader, record_name
from .recovery import build_index_columns, no_gc, recover
from .snapshot import collect_facts, save_snapshot, write_seal
from .stats import CacheStats
from .stores import StoreResult, Stores
from .uring import Rings

__all__ = ["DiskStore", "StoreResult"]

log = logging.getLogger("phalanx.kvstore")

_FP_SEAL = Failpoint("cache.close.seal", "close wrote the snapshot; about to seal it")

BadFilePolicy = Literal["quarantine", "delete"]


class _State(enum.Enum):
    OPEN = "open"  # serving and accepting maintenance
    CLOSED = "closed"  # lock released; every call raises StoreClosedError


class DiskStore(Loads, Stores):
    """Persistent prefix-cache records of one rank in ``directory``.

    ``capacity_bytes`` bounds the bytes of record files (headers included);
    ``max_age`` (seconds, None for never) bounds a leaf record's age; ``fsync=True``
    makes every commit durable (off by default: a cache can lose its newest records
    on power loss, and the page CRCs catch torn ones). ``clock`` gives wall time
    (tests pass their own to age records without sleeping). ``load_threads`` (default
    min(4, CPUs + 1)) threads read one large load in parallel parts, a ``load_many`` batch
    at once, write a ``store_many`` batch at once, and hash a lone large row while it
    is written. ``map_reads`` (default on): rows
    of 2 MiB and more loaded into a buffer that is not 64-byte aligned are copied from
    a mapping of the file when all of it is in the page cache (twice preadv's speed
    into such a buffer here; see buffers.py); off, every read is preadv.
    ``open_files`` (default: a quarter of the descriptor limit, at most 4096) record
    files stay open between loads, least recently used out (see open_files.py); 0
    opens and closes a file per read. ``io_uring`` (default on): a ``load_many`` batch
    is read through io_uring where the kernel offers it and there is a worker thread
    (``load_threads`` of 2 or more; see uring.py); off, or where it does not, on the
    threads.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        geometry: Geometry,
        fingerprint: str | bytes,
        capacity_bytes: int,
        max_age: float | None = None,
        *,
        fsync: bool = False,
        max_jobs_per_poll: int = 32,
        bad_files: BadFilePolicy = "quarantine",
        clock: Callable[[], float] = time.time,
        progress: bool = True,
        on_job: Callable[[Job], None] | None = None,
        load_threads: int | None = None,
        map_reads: bool = True,
        open_files: int | None = None,
        io_uring: bool = True,
    ) -> None:
        if capacity_bytes <= 0 or max_jobs_per_poll <= 0:
            raise ValueError("capacity_bytes and max_jobs_per_poll must be positive")
        if open_files is not None and open_files < 0:
            raise ValueError(f"open_files must be 0 (none kept) or more, not {open_files}")
        self.directory = os.fspath(directory)
        self.geometry = geometry
        self.fingerprint = fingerprint_digest(fingerprint)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.max_jobs_per_poll = max_jobs_per_poll
        self.bad_files = bad_files
        self._on_job = on_job
        # one thread more than cores: a reader woken onto a core that a kernel thread
        # (write-back after a store) holds leaves a core idle until the scheduler moves
        # it; the first load_many after a store ran at 7.7 GB/s with 2 threads on 2
        # cores, 10.4 with 3 (256 KiB rows; later loads 11.0 against 10.8)
        self._reader = ParallelReader(
            load_threads if load_threads is not None else min(4, (os.cpu_count() or 1) + 1),
            map_min=MAP_MIN if map_reads else None)
        self._files = OpenFiles(default_capacity() if open_files is None else open_files)
        self._rings: Rings | None = None  # one ring per reader thread (see loads.py)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lock = DirLock(self.directory)  # first: touch nothing before owning the dir
        try:
            check_or_create(self.directory, geometry, self.fingerprint)
            self._staging = Staging(self.directory, self._reader.threads + 1)
            with no_gc():
                result = recover(self.directory, geometry, self.fingerprint, progress=progress)
                self._index = build_index_columns(result.columns)
            # one ring per worker thread: ring reads run on those only (see uring.py)
            workers = self._reader.threads - 1
            self._rings = Rings.open(workers) if io_uring and workers else None
        except BaseException:  # release the lock on any failure, then re-raise as is
            self._lock.release()
            raise
        self._scheduler = Scheduler(self._index, capacity_bytes, max_age, clock)
        self._scheduler.temps.update(dict.fromkeys(result.temps))
        self._scheduler.bad.update(dict.fromkeys(name for name, _ in result.bad))
        self._clock = clock
        self._mutex = threading.RLock()
        self._state = _State.OPEN
        self._reserved = 0  # bytes of writes in flight, counted against capacity
        self._inflight: Counter[bytes] = Counter()  # page keys of the spans being written
        # records that left the index while a load still had them pinned: until those
        # loads finish, no new file may take the name (they read the old one by name
        # and at the old record's offsets)
        self._retired: dict[bytes, Record] = {}
        self._stats = CacheStats(capacity_bytes=capacity_bytes, recovered=len(result.columns),
                                 skipped=result.skipped())
        ix = self._index
        # index.changes when the on-disk snapshot last matched the index (-1: it does not)
        clean = (result.from_snapshot == len(result.columns)
                 and result.snapshot in ("used", "sealed"))
        self._snapshot_changes = ix.changes if clean else -1
        self._snapshot_taken = result.snapshot_taken_ns if clean else None
        log.info(
            "cache %s: recovered %d records (%d bytes, %d orphans, %d thinnable) in %.2fs "
            "(%d from the %s snapshot); %d temp files, skipped %s", self.directory,
            len(ix.records), ix.bytes, len(ix.orphans), len(ix.thin_candidates),
            result.seconds, result.from_snapshot, result.snapshot, len(result.temps),
            result.skipped() or "none",
        )

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Write the header snapshot if the index changed, seal it, release the directory
        lock.

        Idempotent; loads already reading finish. A snapshot or seal that cannot be
        written is logged and skipped: the next open checks or reads those headers.
        """
        try:
            with self._mutex:
                if self._state is _State.CLOSED:
                    return
                self._state = _State.CLOSED
                try:
                    if self._index.changes != self._snapshot_changes:
                        self._save_snapshot_locked()
                    if self._index.changes == self._snapshot_changes:
                        self._seal_locked()
                finally:
                    self._lock.release()
        finally:
            # outside the mutex: a reader thread finishing a load may need it (a corrupt
            # record is dropped under it), and closing waits for those threads
            self._reader.close()
            try:
                if self._rings is not None:
                    self._rings.close()  # after the parts reading through them
            finally:
                self._files.close()

    @property
    def io_uring(self) -> bool:
        """``load_many`` reads through io_uring: asked for, and offered by the kernel."""
        return self._rings is not None

    def snapshot(self) -> int:
        """Write the header snapshot now (see cache/snapshot.py), so that a reopen after
        a crash reads only the headers of files changed since; returns the records it
        covers. Files are stat-ed outside the store's mutex; stores and loads go on."""
        with self._mutex:
            self._check_open()
            taken = time.time_ns()  # before collecting: later changes are never trusted
            changes = self._index.changes
            facts = collect_facts(self._index)
        n = save_snapshot(self.directory, self.geometry, self.fingerprint, taken, facts,
                          self.fsync)
        with self._mutex:
            self._snapshot_changes = changes
            self._snapshot_taken = taken
        return n

    def _save_snapshot_locked(self) -> None:
        taken = time.time_ns()
        try:
            save_snapshot(self.directory, self.geometry, self.fingerprint, taken,
                          collect_facts(self._index), self.fsync)
        except OSError as exc:
            log.warning("cache %s: header snapshot not written (%s); the next open reads "
                        "every header", self.directory, exc)
            return
        self._snapshot_changes = self._index.changes
        self._snapshot_taken = taken

    def _seal_locked(self) -> None:
        if self._snapshot_taken is None:
            return
        try:
            _FP_SEAL.hit()
            write_seal(self.directory, self._snapshot_taken, self.fsync)
        except OSError as exc:
            log.warning("cache %s: snapshot seal not written (%s); the next open checks "
                        "every file against the snapshot", self.directory, exc)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _is_open(self) -> bool:
        return self._state is _State.OPEN

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise StoreClosedError(f"cache store {self.directory} is closed")

    # -- store / lookup / load ---------------------------------------------------------
    def chain(self, tokens: Tokens) -> KeyChain:
        """The key chain of ``tokens`` for this store's model and page size."""
        return KeyChain(self._keys(tokens), self.geometry.page_tokens, self.fingerprint)

    def _keys(self, tokens: Tokens | KeyChain, limit: int | None = None) -> list[bytes]:
        if isinstance(tokens, KeyChain):
            if (tokens.page_tokens, tokens.fingerprint) != (
                self.geometry.page_tokens, self.fingerprint
            ):
                raise RowSpanError("KeyChain was made for another model or page size")
            if not tokens.keys:
                raise RowSpanError("an empty KeyChain has no page to cache")
            return tokens.keys if limit is None else tokens.keys[:limit]
        return page_keys(tokens, self.geometry.page_tokens, self.fingerprint, limit)

    def lookup(self, tokens: Tokens | KeyChain) -> int:
        """Pages of the longest cached page-aligned prefix of ``tokens`` (0 on a miss).

        A token list shorter than a page is a miss, not an error.
        """
        pt = self.geometry.page_tokens
        short = len(tokens) < (1 if isinstance(tokens, KeyChain) else pt)
        keys = [] if short else self._keys(tokens)
        with self._mutex:
            self._check_open()
            n = self._index.cached_pages(keys)
            if n:
                self._stats.hits += 1
                self._stats.hit_tokens += n * pt
                for rec, _, _ in self._index.plan(keys, n):
                    self._index.touch(rec)
            else:
                self._stats.misses += 1
            return n

    # -- maintenance -----------------------------------------------------------------
    def poll(self, max_jobs: int | None = None) -> int:
        """Decide and apply at most ``max_jobs`` maintenance jobs; return how many ran."""
        limit = self.max_jobs_per_poll if max_jobs is None else max_jobs
        done = 0
        with self._mutex:
            self._check_open()
            self._scheduler.begin_burst()
            while done < limit:
                job = self._scheduler.next_job()
                if job is None:
                    break
                if self._apply_locked(job) is JobOutcome.DEFERRED:
                    self._scheduler.defer(job)
                    continue
                done += 1
                if self._on_job is not None:
                    self._on_job(job)
        return done

    def pending(self) -> int:
        """Known maintenance jobs still queued (0 once maintenance is through)."""
        with self._mutex:
            return self._scheduler.queued()

    def make_room(self, nbytes: int) -> int:
        """Evict LRU leaves until ``nbytes`` more fit under capacity; return evictions."""
        with self._mutex:
            self._check_open()
            return self._make_room_locked(nbytes)

    def _check_fits(self, nbytes: int) -> None:
        if nbytes > self.capacity_bytes:
            raise CapacityError(
                f"a record of {nbytes} bytes exceeds the capacity of {self.directory} "
                f"({self.capacity_bytes} bytes); raise capacity_bytes or store shorter rows"
            )

    def _make_room_locked(self, nbytes: int) -> int:
        self._check_fits(nbytes)
        ix = self._index
        n = 0
        while ix.bytes + self._reserved + nbytes > self.capacity_bytes:
            orphan = next((r for r in ix.orphans.values() if not r.pins), None)
            victim = ix.lru_leaf() if orphan is None else None
            if orphan is None and victim is None:
                raise CapacityError(
                    f"cannot make room for {nbytes} bytes in {self.directory}: "
                    f"{ix.bytes} bytes held, {self._reserved} of stores in flight, nothing "
                    "evictable (every leaf is pinned by a load or by the prefix a store "
                    "extends); retry after those finish, or store fewer rows at once"
                )
            kind = JobKind.DROP if orphan is not None else JobKind.EVICT
            rec = orphan if orphan is not None else victim
            assert rec is not None
            job = Job.for_record(kind, rec)
            self._apply_locked(job)
            n += 1
            if self._on_job is not None:
                self._on_job(job)
        return n

    def apply_job(self, job: Job) -> JobOutcome:
        """Apply one job to this directory (what a peer rank does with rank 0's jobs)."""
        with self._mutex:
            self._check_open()
            return self._apply_locked(job)

    def _apply_locked(self, job: Job) -> JobOutcome:
        outcome = _APPLY[job.kind](self, job)
        if outcome is JobOutcome.DEFERRED:
            self._stats.maintenance_deferred += 1
        else:
            self._stats.maintenance_done += 1
        return outcome

    def _apply_purge(self, job: Job) -> JobOutcome:
        if not is_temp_name(job.name):
            return JobOutcome.NOOP
        purge_temp(self.directory, job.name)
        self._scheduler.temps.pop(job.name, None)
        self._stats.temps_purged += 1
        return JobOutcome.DONE

    def _apply_quarantine(self, job: Job) -> JobOutcome:
        quarantine(self.directory, job.name, delete=self.bad_files == "delete")
        self._scheduler.bad.pop(job.name, None)
        self._stats.quarantined += 1
        return JobOutcome.DONE

    def _apply_drop(self, job: Job) -> JobOutcome:
        rec = self._index.orphans.get(job.key)
        if rec is None:
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        self._drop_orphan_locked(rec)
        return JobOutcome.DONE

    def _free_name_locked(self, key: bytes) -> None:
        """Before a new record's file takes the name of ``key``: drop the orphan or
        move aside the bad file that holds it (a later job would take the new file)."""
        orphan = self._index.orphans.get(key)
        if orphan is not None:
            self._drop_orphan_locked(orphan)
        name = record_name(key)
        if name in self._scheduler.bad:
            self._apply_quarantine(Job(JobKind.QUARANTINE, name=name))

    def _drop_orphan_locked(self, rec: Record) -> None:
        self._unlink_locked(rec)
        self._stats.dropped += 1

    def _unlink_locked(self, rec: Record) -> None:
        """Delete a detached record's file and forget it (a load still reading keeps its
        descriptor until it is done)."""
        self._files.forget(rec.key)  # first: a failed unlink keeps no descriptor
        remove_record(self.directory, rec.key)
        self._index.forget_orphan(rec.key)

    def _apply_remove(self, job: Job) -> JobOutcome:
        rec = self._index.records.get(job.key)
        if rec is None or not self._index.is_leaf(rec):
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        self._index.remove(rec)  # stop serving first; the file goes after
        self._unlink_locked(rec)
        if job.kind is JobKind.EXPIRE:
            self._stats.expirations += 1
        else:
            self._stats.evictions += 1
        return JobOutcome.DONE

    def _apply_thin(self, job: Job) -> JobOutcome:
        ix = self._index
        rec = ix.records.get(job.key)
        if rec is None or not ix.is_thinnable(rec):
            ix.thin_candidates.pop(job.key, None)
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        keys = [n.key for n in ix.span_nodes(rec)]
        header = RecordHeader(self.geometry, self.fingerprint, rec.key, rec.parent, rec.start,
                              rec.end, 0, rec.created, keys, [0] * len(keys), FLAG_THINNED)
        def renamed() -> None:
            ix.thin(rec, header.file_len)
            self._files.forget(rec.key)  # its descriptor reads the replaced file
            self._stats.rows_thinned += 1

        thin_record(self.directory, header, self.fsync, renamed, self._staging.path())
        return JobOutcome.DONE

    # -- replication (replica.py, reconcile.py) ----------------------------------------
    def record_states(self) -> dict[bytes, bool]:
        """Key -> thinned for every attached record: what ranks compare at start-up."""
        with self._mutex:
            return {k: r.thinned for k, r in self._index.records.items()}

    def prefix_keys(self, key: bytes) -> list[bytes]:
        """Page keys of the cached prefix that ends at node ``key`` ([] when not cached)."""
        with self._mutex:
            node = self._index.nodes.get(key)
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
        with self._mutex:
            self._check_open()
            rec = self._index.records.get(key)
            if rec is None:
                return False
            self._index.remove(rec)
            self._drop_orphan_locked(rec)
            self._retire_locked(rec)
            return True

    def _retire_locked(self, rec: Record) -> None:
        """``rec`` left the index for good: if loads still pin it, keep its name from a
        new record until they are done (see ``_retired``); forget finished ones."""
        if rec.pins:
            self._retired[rec.key] = rec
        for key in [k for k, r in self._retired.items() if not r.pins]:
            del self._retired[key]

    def purge_leftovers(self) -> int:
        """Apply only the jobs that decide nothing about records: temp files, bad files
        and orphans. A replica's own leftovers, whose names rank 0 cannot know."""
        with self._mutex:
            self._check_open()
            sched = self._scheduler
            jobs = [Job(JobKind.PURGE_TEMP, name=n) for n in sched.temps]
            jobs += [Job(JobKind.QUARANTINE, name=n) for n in sched.bad]
            jobs += [Job.for_record(JobKind.DROP, r) for r in self._index.orphans.values()
                     if not r.pins]
            return sum(self._apply_locked(j) is JobOutcome.DONE for j in jobs)

    # -- audit and stats ---------------------------------------------------------------
    def check(self) -> list[str]:
        """Audit the index against the directory; returns problems (empty when sound)."""
        with self._mutex:
            ix = self._index
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
                if name not in self._scheduler.temps and not self._inflight:
                    problems.append(f"temp file {name} not queued for purging")
            for rec in [*ix.records.values(), *ix.orphans.values()]:
                name = record_name(rec.key)
                size = on_disk.pop(name, None)
                if size != rec.file_len:
                    problems.append(f"record {name}: {size} bytes on disk, index {rec.file_len}")
            for name in on_disk:
                if name not in self._scheduler.bad and not self._inflight:
                    problems.append(f"file {name} on disk is not in the index")
            if ix.bytes > self.capacity_bytes and not self._scheduler.queued() and (
                ix.lru_leaf() is None
            ):
                problems.append(f"{ix.bytes} bytes over capacity with nothing evictable")
            return problems

    def statistics(self) -> CacheStats:
        with self._mutex:
            ix = self._index
            s = self._stats
            s.records = len(ix.records)
            s.thinned_records = sum(1 for r in ix.records.values() if r.thinned)
            s.bytes = ix.bytes
            s.maintenance_queued = self._scheduler.queued()
            return CacheStats(**{f: getattr(s, f) for f in s.__struct_fields__})


_APPLY: dict[JobKind, Callable[[DiskStore, Job], JobOutcome]] = {
    JobKind.PURGE_TEMP: DiskStore._apply_purge,
    JobKind.QUARANTINE: DiskStore._apply_quarantine,
    JobKind.DROP: DiskStore._apply_drop,
    JobKind.EXPIRE: DiskStore._apply_remove,
    JobKind.EVICT: DiskStore._apply_remove,
    JobKind.THIN: DiskStore._apply_thin,
}
