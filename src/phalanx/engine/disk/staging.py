"""One rank's staging of KV pages between its runner and the disk tier.

The same object is both sides of the hand-over, so a page's bytes never leave the rank:

- the runner's :class:`~phalanx.engine.worker.runner.Staging`: a plan's ``PageSave`` stages
  pages after the forward (``save``); a plan's ``PageLoad`` (``load``) is read from the
  rank's own store, straight into the runner's buffer, when the step's
  :class:`~phalanx.engine.disk.rank0.DiskLoads` name it (``expect``: rank 0's leases),
  else taken from the pages a parent-side load delivered before the step;
- the replicated cache's KV source (:class:`phalanx.replication.KVSource`): a store
  reads staged pages (``row``), a load delivers pages (``loaded``).

Rank 0 decides what is saved and loaded; the parent calls the cache's ``store`` after
the step that staged a row. Both maps are bounded (``capacity`` pages each, oldest
dropped first and counted), so a store that never comes cannot grow a rank's memory.

Saved pages live in one slab of ``capacity`` page slots, allocated once. A slot whose
page a store has read is the first to be reused, so the slab's touched (resident) part
is about the pages in flight. When the rank idles, :meth:`PageStaging.release_stored`
frees the slots of pages already stored and gives their memory back (the slab is an
anonymous map: ``madvise(MADV_DONTNEED)``): after a burst of prefills the slab held its
high-water mark, 16 pages or 46 MB of the real model, for the rank's life.

Why not a ``bytes`` per page, as before: those long-lived
128 KiB blocks, allocated after every forward, took the heap holes the forward's
temporaries had just freed, so the next forward grew the heap and faulted its memory in
afresh (a median 500-600 faults per 512-token chunk on each rank against 0-3 now and
without the tier; that chunk's forward 7-20% slower than with the tier off).

One per rank process, kept in the rank's services under ``engine.staging``, reached
two ways that find the same object: the runner gets it from :func:`attach_staging`
(the one place a runner's staging is set: ``worker/rank.py`` opens every runner through
it), the replicated cache from :func:`staging_source`, its ``kv_source_factory``.
"""

from __future__ import annotations

import errno
import mmap
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...kvstore import Geometry, KeyChain, PageScatter, aligned_empty
from ...lifecycle import PhalanxError
from ...replication import rank_cache
from ...runtime import rank_services
from .._errors import EngineError
from .rank0 import DiskLoad, DiskLoads

if TYPE_CHECKING:
    import torch

__all__ = ["PageStaging", "attach_staging", "expect_loads", "rank_staging", "staging_source"]

_SERVICE = "engine.staging"
DEFAULT_CAPACITY = 4096        # pages, at most ...
DEFAULT_SLAB_BYTES = 1 << 30   # ... and at most this much address space for the slab
_OPEN_LOCK = threading.Lock()


class PageStaging:
    """Staged pages (runner -> disk) and loaded pages (disk -> runner) of one rank."""

    def __init__(self, geometry: Geometry, rank: int, capacity: int | None = None) -> None:
        self.geometry = geometry
        self.page_bytes = geometry.page_bytes
        self.rank = rank
        if capacity is None:
            capacity = max(1, min(DEFAULT_CAPACITY, DEFAULT_SLAB_BYTES // self.page_bytes))
        if capacity < 1:
            raise EngineError(f"rank {rank}: a staging needs capacity >= 1 page (got "
                              f"{capacity})")
        self.capacity = capacity
        self._lock = threading.Lock()
        # Saved pages: key -> slot of the slab, in reuse order (first reused first; a
        # page a store read moves to the front). Invariant: the slots of _staged and
        # _free are disjoint and together every slot; _read is a subset of _staged.
        # Virtual until touched: slots are handed out lowest first (_free is a stack,
        # kept in descending order). An anonymous map: page-aligned, as the store's
        # buffers are (kvstore.aligned_empty says why), and its pages can be given back.
        self._map = mmap.mmap(-1, capacity * self.page_bytes)
        self._slab = np.frombuffer(self._map, dtype=np.uint8).reshape(capacity,
                                                                      self.page_bytes)
        self._staged: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._read: set[bytes] = set()
        self._touched = 0       # slots below this may be resident (handed out)
        self._written: set[int] = set()  # slots handed out since last given back
        # Invariant: every value is exactly page_bytes long; len(_loaded) <= capacity.
        self._loaded: OrderedDict[bytes, bytes] = OrderedDict()
        self.dropped = 0        # pages pushed out unread (a store or load that never came)
        self.saved = 0
        self.delivered = 0
        self._direct: dict[tuple[bytes, ...], DiskLoad] = {}  # this step's disk loads
        self._disk: DiskLoads | None = None

    def _put(self, table: OrderedDict[bytes, bytes], key: bytes, data: bytes) -> None:
        table[key] = data
        table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)
            self.dropped += 1

    # -- the runner's side ------------------------------------------------------------
    def save(self, keys: list[bytes], data: torch.Tensor | PageScatter) -> None:
        with self._lock:
            if isinstance(data, PageScatter):
                if data.pages != len(keys):
                    raise EngineError(f"rank {self.rank}: {data.pages} pages saved for "
                                      f"{len(keys)} keys")
                size = data.part_bytes
                for i, key in enumerate(keys):
                    slot = self._slab[self._slot_for(key)].data
                    for j, part in enumerate(data.page(i)):
                        slot[j * size:(j + 1) * size] = part
            else:
                for key, row in zip(keys, data.numpy(), strict=True):
                    self._slab[self._slot_for(key)] = row
            self.saved += len(keys)

    def _slot_for(self, key: bytes) -> int:
        """The slot ``key`` is saved into, at the back of the reuse order: its own if
        staged already, else a read page's (stored: kept only for a retry), else an
        untouched one, else the oldest unread page's (dropped)."""
        slot = self._staged.pop(key, None)
        if slot is None:
            first = next(iter(self._staged), None)
            if first is not None and first in self._read:
                slot = self._staged.pop(first)
                self._read.discard(first)
            elif self._free:
                slot = self._free.pop()
                self._touched = max(self._touched, slot + 1)
            else:
                _, slot = self._staged.popitem(last=False)
                self.dropped += 1
        self._read.discard(key)
        self._staged[key] = slot
        self._written.add(slot)
        return slot

    def expect(self, disk: DiskLoads) -> None:
        """The disk loads of the step about to run: ``load`` reads them from the rank's
        store (its own shard, straight into the runner's buffer), not from staging."""
        self._direct = {tuple(d.keys[d.start:]): d for d in disk.loads}
        self._disk = disk

    def load(self, keys: list[bytes], out: torch.Tensor | PageScatter) -> None:
        direct = self._direct.pop(tuple(keys), None)
        if direct is not None:
            self._load_direct(direct, out)
            return
        with self._lock:
            missing = [k.hex() for k in keys if k not in self._loaded]
            if missing:
                raise EngineError(
                    f"rank {self.rank}: the plan loads {len(keys)} pages but {len(missing)} "
                    f"were not delivered by the disk tier (first {missing[0]}); the cache's "
                    f"load must run before the step")
            for i, key in enumerate(keys):
                page = memoryview(self._loaded.pop(key))
                if isinstance(out, PageScatter):
                    size = out.part_bytes
                    for j, part in enumerate(out.page(i)):
                        part[:] = page[j * size:(j + 1) * size]
                else:
                    out.numpy()[i] = np.frombuffer(page, dtype=np.uint8)

    def _load_direct(self, d: DiskLoad, out: torch.Tensor | PageScatter) -> None:
        disk = self._disk
        if disk is None:  # set together with _direct
            raise EngineError(f"rank {self.rank}: a direct load without its step's leases")
        chain = KeyChain(list(d.keys), disk.page_tokens, disk.fingerprint)
        n = len(d.keys)
        # the store reads a prefix from its first page: pages already in memory (before
        # ``start``) are read into scratch and dropped
        dst: Any
        if isinstance(out, PageScatter):
            dst = out if d.start == 0 else _behind(aligned_empty(d.start * self.page_bytes),
                                                   out)
        else:
            dst = out.numpy() if d.start == 0 else aligned_empty(n * self.page_bytes)
        cache = rank_cache(disk.cache_id)
        try:
            cache.load_many([(chain, n, dst)], d.lease)
        except (PhalanxError, OSError) as exc:
            # the runner turns this into a miss agreed by every rank; say which record,
            # where and why (the errno of the system call, when one failed)
            code = _errno_of(exc)
            why = f"errno {code} ({errno.errorcode.get(code, '?')})" if code else "no errno"
            raise EngineError(
                f"rank {self.rank}: disk tier load of pages {d.start}..{n} of prefix "
                f"{d.keys[-1].hex()} from {cache.store.directory} failed, {why}: "
                f"{exc}") from exc
        if d.start and not isinstance(out, PageScatter):
            out.numpy()[:] = np.frombuffer(dst, dtype=np.uint8)[
                d.start * self.page_bytes:].reshape(n - d.start, self.page_bytes)
        self.delivered += n - d.start

    # -- the disk tier's side (a replication KV source) -------------------------------
    def row(self, keys: list[bytes], start: int) -> Any:
        with self._lock:
            missing = [k.hex() for k in keys[start:] if k not in self._staged]
            if missing:
                raise EngineError(
                    f"rank {self.rank}: a store asked for {len(keys) - start} pages from page "
                    f"{start} but {len(missing)} are not staged (first {missing[0]}): never "
                    f"saved by a step, or dropped ({self.dropped} dropped so far)")
            wanted = keys[start:]
            # a copy (the slots may be reused once the lock is let go), then the pages
            # go first in the reuse order: stored, they are kept only for a retry
            out = aligned_empty(len(wanted) * self.page_bytes).reshape(len(wanted),
                                                                        self.page_bytes)
            np.take(self._slab, [self._staged[k] for k in wanted], axis=0, out=out)
            for k in reversed(wanted):
                self._staged.move_to_end(k, last=False)
                self._read.add(k)
            return out

    def loaded(self, keys: list[bytes], data: memoryview) -> None:
        flat = memoryview(data).cast("B")
        if len(flat) != len(keys) * self.page_bytes:
            raise EngineError(f"rank {self.rank}: {len(flat)} bytes loaded for {len(keys)} "
                              f"pages of {self.page_bytes}")
        with self._lock:
            for i, key in enumerate(keys):
                self._put(self._loaded, key,
                          bytes(flat[i * self.page_bytes:(i + 1) * self.page_bytes]))
            self.delivered += len(keys)

    def release_stored(self) -> int:
        """Free the slots of pages a store has read (kept until now only for a retry,
        which after this finds them gone and fails, naming them) and give back the
        memory of every free slot written since it was last given back; the slots given
        back. For an idle rank (``worker/rank.py``'s step loop)."""
        with self._lock:
            for k in [k for k in self._staged if k in self._read]:
                self._free.append(self._staged.pop(k))
            self._read.clear()
            idle = self._written - set(self._staged.values())
            for slot in idle:
                self._give_back(slot)
            self._written -= idle
            self._free.sort(reverse=True)
            self._touched = max(self._written, default=-1) + 1
            return len(idle)

    def _give_back(self, slot: int) -> None:
        """The whole pages inside ``slot`` back to the system (read as zeros after)."""
        page = mmap.PAGESIZE
        start = -(-slot * self.page_bytes // page) * page
        end = (slot + 1) * self.page_bytes // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def stats(self) -> dict[str, int]:
        with self._lock:
            # slots_touched: the slab's high-water mark (its resident part, at most)
            return {"staged": len(self._staged), "loaded": len(self._loaded),
                    "slots_touched": self._touched,
                    "dropped": self.dropped, "saved": self.saved,
                    "delivered": self.delivered}

    def clear(self) -> None:
        with self._lock:
            self._free.extend(self._staged.values())
            self._staged.clear()
            self._read.clear()
            self._loaded.clear()


def _behind(scratch: np.ndarray, pages: PageScatter) -> PageScatter:
    """``pages`` after scratch pages (cut into ``pages``' parts) for the prefix before
    them."""
    size = pages.part_bytes
    flat = scratch.data.cast("B")
    return PageScatter([flat[i:i + size] for i in range(0, len(flat), size)] + pages.views,
                       pages.parts)


def _errno_of(exc: BaseException) -> int | None:
    """The errno of the first OSError in ``exc``'s chain of causes (None if there is
    none: a checksum that failed, a record not in the index)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def expect_loads(staging: object, disk: DiskLoads) -> None:
    """Hand the step's disk loads to the runner's staging."""
    if not isinstance(staging, PageStaging):
        raise EngineError(f"the step loads {len(disk.loads)} prefixes from the disk tier "
                          f"but the runner's staging is {type(staging).__name__}, not this "
                          "rank's PageStaging")
    staging.expect(disk)


def rank_staging(geometry: Geometry, capacity: int | None = None) -> PageStaging:
    """This rank's staging (created on first use, in the rank's services)."""
    services = rank_services()
    with _OPEN_LOCK:  # the runner and the cache's open may ask at once
        found = services.find(_SERVICE, PageStaging)
        if found is not None:
            if found.geometry != geometry:
                raise EngineError(f"rank {services.rank}: the staging holds pages of "
                                  f"{found.geometry}, asked for {geometry}; close it first")
            return found
        staging = PageStaging(geometry, services.rank, capacity)
        return services.register(_SERVICE, staging, staging.clear)


def staging_source(geometry: Geometry, rank: int) -> PageStaging:
    """A replication ``kv_source_factory``: the rank's staging, shared with its runner."""
    return rank_staging(geometry)


class _StagedRunner(Protocol):
    """What :func:`attach_staging` needs of a runner (``worker/runner.py``'s)."""

    staging: Any

    def geometry(self) -> Geometry: ...


def attach_staging(runner: _StagedRunner) -> PageStaging:
    """Give ``runner`` this rank's staging (its pages' geometry): the one way a runner
    gets one."""
    staging = rank_staging(runner.geometry())
    runner.staging = staging
    return staging
