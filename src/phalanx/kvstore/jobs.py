"""``JobRunner``: applies maintenance jobs to one store's directory and index.

The scheduler (maintenance.py) decides a job; this applies it: purge a dead writer's
temp file, move a bad file aside, drop an orphan, expire or evict a leaf, thin a row.
The writes use it too, to make room for a row and to free the name a new record's
file takes. Every method ending in ``_locked`` runs under the core's mutex.
"""

from __future__ import annotations

from collections.abc import Callable

from ._errors import CapacityError
from .core import StoreCore
from .files import is_temp_name, purge_temp, quarantine, remove_record, thin_record
from .index import Record
from .maintenance import Job, JobKind, JobOutcome
from .record import FLAG_THINNED, RecordHeader, record_name

__all__ = ["JobRunner"]


class JobRunner:
    """Maintenance of one store, on the state it is handed.

    ``on_job`` sees every job applied by ``poll`` or to make room (rank 0's replication
    forwards them to its peers)."""

    def __init__(self, core: StoreCore, on_job: Callable[[Job], None] | None = None) -> None:
        self._core = core
        self._on_job = on_job
        self._apply: dict[JobKind, Callable[[Job], JobOutcome]] = {
            JobKind.PURGE_TEMP: self._apply_purge,
            JobKind.QUARANTINE: self._apply_quarantine,
            JobKind.DROP: self._apply_drop,
            JobKind.EXPIRE: self._apply_remove,
            JobKind.EVICT: self._apply_remove,
            JobKind.THIN: self._apply_thin,
        }

    def poll_locked(self, limit: int) -> int:
        """Decide and apply at most ``limit`` jobs; return how many ran."""
        sched = self._core.scheduler
        done = 0
        sched.begin_burst()
        while done < limit:
            job = sched.next_job()
            if job is None:
                break
            if self.apply_locked(job) is JobOutcome.DEFERRED:
                sched.defer(job)
                continue
            done += 1
            if self._on_job is not None:
                self._on_job(job)
        return done

    def apply_locked(self, job: Job) -> JobOutcome:
        outcome = self._apply[job.kind](job)
        if outcome is JobOutcome.DEFERRED:
            self._core.stats.maintenance_deferred += 1
        else:
            self._core.stats.maintenance_done += 1
        return outcome

    def check_fits(self, nbytes: int) -> None:
        cap = self._core.options.capacity_bytes
        if nbytes > cap:
            raise CapacityError(
                f"a record of {nbytes} bytes exceeds the capacity of {self._core.directory} "
                f"({cap} bytes); raise capacity_bytes or store shorter rows"
            )

    def make_room_locked(self, nbytes: int) -> int:
        """Evict LRU leaves (orphans first) until ``nbytes`` more fit; return evictions."""
        self.check_fits(nbytes)
        core = self._core
        ix = core.index
        cap = core.options.capacity_bytes
        n = 0
        while ix.bytes + core.reserved + nbytes > cap:
            orphan = next((r for r in ix.orphans.values() if not r.pins), None)
            victim = ix.lru_leaf() if orphan is None else None
            if orphan is None and victim is None:
                raise CapacityError(
                    f"cannot make room for {nbytes} bytes in {core.directory}: "
                    f"{ix.bytes} bytes held, {core.reserved} of stores in flight, nothing "
                    "evictable (every leaf is pinned by a load or by the prefix a store "
                    "extends); retry after those finish, or store fewer rows at once"
                )
            kind = JobKind.DROP if orphan is not None else JobKind.EVICT
            rec = orphan if orphan is not None else victim
            assert rec is not None
            job = Job.for_record(kind, rec)
            self.apply_locked(job)
            n += 1
            if self._on_job is not None:
                self._on_job(job)
        return n

    def free_name_locked(self, key: bytes) -> None:
        """Before a new record's file takes the name of ``key``: drop the orphan or
        move aside the bad file that holds it (a later job would take the new file)."""
        orphan = self._core.index.orphans.get(key)
        if orphan is not None:
            self.drop_orphan_locked(orphan)
        name = record_name(key)
        if name in self._core.scheduler.bad:
            self._apply_quarantine(Job(JobKind.QUARANTINE, name=name))

    def drop_orphan_locked(self, rec: Record) -> None:
        self._unlink_locked(rec)
        self._core.stats.dropped += 1

    def _unlink_locked(self, rec: Record) -> None:
        """Delete a detached record's file and forget it (a load still reading keeps its
        descriptor until it is done)."""
        core = self._core
        core.files.forget(rec.key)  # first: a failed unlink keeps no descriptor
        remove_record(core.directory, rec.key)
        core.index.forget_orphan(rec.key)

    # -- one method per job kind -------------------------------------------------------
    def _apply_purge(self, job: Job) -> JobOutcome:
        if not is_temp_name(job.name):
            return JobOutcome.NOOP
        purge_temp(self._core.directory, job.name)
        self._core.scheduler.temps.pop(job.name, None)
        self._core.stats.temps_purged += 1
        return JobOutcome.DONE

    def _apply_quarantine(self, job: Job) -> JobOutcome:
        core = self._core
        quarantine(core.directory, job.name, delete=core.options.bad_files == "delete")
        core.scheduler.bad.pop(job.name, None)
        core.stats.quarantined += 1
        return JobOutcome.DONE

    def _apply_drop(self, job: Job) -> JobOutcome:
        rec = self._core.index.orphans.get(job.key)
        if rec is None:
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        self.drop_orphan_locked(rec)
        return JobOutcome.DONE

    def _apply_remove(self, job: Job) -> JobOutcome:
        core = self._core
        rec = core.index.records.get(job.key)
        if rec is None or not core.index.is_leaf(rec):
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        core.index.remove(rec)  # stop serving first; the file goes after
        self._unlink_locked(rec)
        if job.kind is JobKind.EXPIRE:
            core.stats.expirations += 1
        else:
            core.stats.evictions += 1
        return JobOutcome.DONE

    def _apply_thin(self, job: Job) -> JobOutcome:
        core = self._core
        ix = core.index
        rec = ix.records.get(job.key)
        if rec is None or not ix.is_thinnable(rec):
            ix.thin_candidates.pop(job.key, None)
            return JobOutcome.NOOP
        if rec.pins:
            return JobOutcome.DEFERRED
        keys = [n.key for n in ix.span_nodes(rec)]
        header = RecordHeader(core.geometry, core.fingerprint, rec.key, rec.parent, rec.start,
                              rec.end, 0, rec.created, keys, [0] * len(keys), FLAG_THINNED)

        def renamed() -> None:
            ix.thin(rec, header.file_len)
            core.files.forget(rec.key)  # its descriptor reads the replaced file
            core.stats.rows_thinned += 1

        thin_record(core.directory, header, core.options.fsync, renamed,
                    core.staging.path())
        return JobOutcome.DONE
