"""Rank 0's side of replication: every decision, applied here first, then sent to peers.

Ordering. One lock (``_order``) covers "apply on rank 0, queue to every link", so the
order of ops on each link is the order rank 0 applied them in; each peer applies in
arrival order and passes through the same states.

Two lanes share each link's window:

* request lane (``store``, ``load``): never waits to be queued; may use the whole
  window; while any request is being decided and queued, maintenance issues nothing
  new (once queued, a request waits for its acks while maintenance goes on: what it
  queues then lands behind the request's op on every link).
* maintenance lane (``poll``/``maintain``): decides jobs from the Scheduler only while
  every link has room beyond ``reserve`` credits, so a burst of any size is a stream
  throttled by the slowest peer, never a flood of queued frames (the docs/architecture.md
  incident: regression test
  ``test_replication_incident.py::test_recovered_chain_needs_maintenance_everywhere``),
  and a store arriving mid-burst finds at most ``window - reserve`` ops ahead of it.
  For ``_BUSY_S`` after any request, the lane keeps at most ``window // 4`` ops in
  flight (``busy_reserve``): a request's store waits behind every maintenance op
  already queued on each peer (peers apply in order). With 48 unlinks ahead of it its
  p99 during a 100,000-job burst was 4.5-7.1x its idle p99; since the lane is
  pipelined (below), 16 ahead cost 0.8-1.1x, and 32 bought no jobs/s over 16
  (BENCHMARKS.md). With no request in the last second the lane has its whole share.

Pipelining. The lane decides and sends in chunks of ``window // 8`` (at most half its
share), and peers ack every few ops (replica.py), so rank 0 applies one chunk while
the peers apply the one before. Deciding a whole share and sending it at the end,
with peers acking only when their buffer ran dry, made the three ranks take turns:
0.71 cores busy, 0.36-0.38x one local store (BENCHMARKS.md).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.kvstore import CacheError, NotCachedError
from phalanx.kvstore.keys import ROOT_KEY, KeyChain, Tokens
from phalanx.kvstore.maintenance import Job, JobKind
from phalanx.kvstore.store import DiskStore, PrefixPins, StoreResult
from phalanx.lifecycle import CleanupError

from ._errors import LinkStalledError, ReplicaDivergedError, ReplicationError
from .frames import Bye, Frame, LoadOp, Reconcile, RecordSet, StoreOp, Unstage, records_digest
from .kv_source import KVSource
from .link import PeerLink
from .reconcile import ReconcilePlan, plan
from .staging import row_start

__all__ = ["JobCollector", "Leader", "MaintainReport"]

_BUSY_S = 1.0  # after a request, maintenance keeps to its busy share this long

log = logging.getLogger("phalanx.replication")


class JobCollector:
    """DiskStore's ``on_job`` hook: collects the jobs a call applied, per thread, so
    the caller can send exactly those (evictions of a store, jobs of a poll)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, job: Job) -> None:
        jobs: list[Job] | None = getattr(self._local, "jobs", None)
        if jobs is not None:  # None: a call outside collect(), nothing to replicate
            jobs.append(job)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[Job]]:
        jobs: list[Job] = []
        self._local.jobs = jobs
        try:
            yield jobs
        finally:
            self._local.jobs = None


@dataclass
class MaintainReport:
    jobs: dict[str, int] = field(default_factory=dict)  # kind -> jobs applied everywhere
    seconds: float = 0.0
    waits_for_credits: int = 0  # times the lane waited for a peer's window


class Leader:
    def __init__(self, store: DiskStore, collector: JobCollector, source: KVSource,
                 links: dict[int, PeerLink], *, reserve: int,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.source = source
        self.links = links
        self.reserve = reserve
        # the smallest window of the links (all made before rank 0's leader): what
        # maintenance may take is reckoned from it
        self._window = min((ln.window for ln in links.values()), default=0)
        # the credits maintenance leaves free while requests are recent (see the module doc)
        self.busy_reserve = max(reserve, self._window - max(1, self._window // 4))
        self._last_request = float("-inf")  # when a request last left the lane (queued)
        self._collector = collector
        self._order = threading.Lock()
        self._requests = 0  # request-lane calls in progress: maintenance yields to them
        self._req_lock = threading.Lock()
        self._no_requests = threading.Condition(self._req_lock)  # _requests fell to 0
        self._now = now
        self.jobs_sent: collections.Counter[str] = collections.Counter()

    # -- request lane ------------------------------------------------------------------
    @contextlib.contextmanager
    def _request(self) -> Iterator[None]:
        with self._req_lock:
            self._requests += 1
        try:
            yield
        finally:
            with self._req_lock:
                self._requests -= 1
                self._last_request = self._now()
                if not self._requests:
                    self._no_requests.notify_all()

    def _reserve_now(self) -> int:
        """The credits maintenance must leave free now: more while requests are recent."""
        with self._req_lock:
            recent = self._now() - self._last_request < _BUSY_S
        return self.busy_reserve if recent else self.reserve

    def _batch(self, reserve: int) -> int:
        # Refill in batches: wait for a quarter of the lane's credits, not for one (one
        # frame per send and per ack otherwise); never more than the lane can ever get.
        return max(1, (self._window - reserve) // 4) if self.links else 1

    def store_chain(self, chain: KeyChain, from_page: int | None = None,
                    wait: bool = True) -> StoreResult:
        """Store the uncached suffix of ``chain`` (or from ``from_page``) on every rank;
        returns rank 0's result once every peer acked (a peer's failure raises the
        link's error). ``wait=False`` returns once queued (bulk writers: they wait for
        credits first with ``wait_room`` and ``drain`` at the end)."""
        # Maintenance yields while the request decides and queues; not while it waits
        # for acks: what maintenance queues then goes behind the request's op on every
        # link, so it cannot delay it, and the ranks do not idle meanwhile.
        with self._request(), self._order:
            keys = chain.keys
            cached = self.store.lookup(chain)
            start = min(cached, len(keys) - 1)
            if from_page is not None:
                start = min(start, from_page)
            with self._collector.collect() as evicted:
                res = self.store.store(chain, self.source.row(keys, start))
            if not res.stored and not evicted:
                return res
            op_start = res.start_page
            seqs = {}
            for rank, link in self.links.items():
                link.submit_jobs(evicted)
                if res.stored:
                    seqs[rank] = link.submit(lambda s: StoreOp(
                        s, keys[op_start - 1] if op_start else ROOT_KEY, op_start,
                        keys[op_start:]))
            for job in evicted:
                self.jobs_sent[job.kind.value] += 1
        for rank, seq in seqs.items() if wait else ():
            self.links[rank].wait_acked(seq)
        return res

    def wait_room(self, timeout: float | None = None) -> None:
        """Until every link has a credit beyond the reserve (bulk writers' throttle)."""
        for link in self.links.values():
            link.wait(functools.partial(_has_room, link, self.reserve), timeout)

    def load_chain(self, chain: KeyChain, n_pages: int) -> dict[int, int]:
        """Every rank loads pages 0..n-1 of its shard into its KV source; returns the
        crc32 of the bytes each rank loaded (rank -> crc)."""
        keys = chain.keys[:n_pages]
        prefix = KeyChain(keys, chain.page_tokens, chain.fingerprint)
        # maintenance yields while the loads are decided and queued (as for a store)
        with self._request(), self._order:  # peers load before any later eviction
            pins = self.store.lookup_pin([prefix])  # reaches them, and none is decided here
            if pins.pages[0] < n_pages:  # refused before any peer is asked
                self.store.unpin(pins)
                raise NotCachedError(
                    f"load of {n_pages} pages from {self.store.directory}: only "
                    f"{pins.pages[0]} cached; call lookup() first")
            seqs = {r: ln.submit(lambda s: LoadOp(s, keys), want_reply=True)
                    for r, ln in self.links.items()}
        try:  # read outside the order lock: stores and maintenance go on meanwhile
            view = self.store.load(prefix, n_pages)
        finally:
            self.store.unpin(pins)
        self.source.loaded(keys, view)
        crcs = {0: zlib.crc32(view)}
        for rank, seq in seqs.items():
            crcs[rank] = self.links[rank].reply(seq).crc
        return crcs

    def lookup(self, tokens: Tokens | KeyChain) -> int:
        return self.store.lookup(tokens)

    # -- the rank-side API's half on rank 0 (rank_api.py) ------------------------------
    def lookup_pinned(self, prefixes: Sequence[Tokens | KeyChain]
                      ) -> tuple[PrefixPins, dict[int, int]]:
        """Look a batch of prefixes up and pin what was found (until ``store.unpin``);
        also rank -> seq of the last op queued to that peer. Under the order lock: every
        record reported had its store queued to every link before this point, so a peer
        that applied through its seq holds all of them."""
        with self._order:
            pins = self.store.lookup_pin(prefixes)
            through = {r: ln.queued_through() for r, ln in self.links.items()}
        return pins, through

    def store_staged(self, rows: Sequence[tuple[KeyChain, Any]]) -> list[StoreResult]:
        """Store rows whose bytes every rank staged (rank_api.py): rank 0 decides and
        writes them (one store_many), then sends each peer one decision per row, in row
        order: StoreOp(staged) for a row stored, Unstage for one skipped or refused. A
        refusal (bad input, no room) raises after the Unstages and the evictions making
        room were queued; a failed write raises after the rows that made it were sent."""
        with self._request():
            with self._order:
                error: BaseException | None = None
                with self._collector.collect() as evicted:
                    try:
                        results: list[StoreResult | None] = list(self.store.store_many(rows))
                    except (CacheError, OSError) as exc:
                        error = exc
                        results = [self._stored_after_error(chain) for chain, _ in rows]
                pb = self.store.geometry.page_bytes
                decisions: list[Callable[[int], Frame]] = [
                    _decision(chain, row_start(len(chain.keys), row, pb), res)
                    for (chain, row), res in zip(rows, results, strict=True)]
                for link in self.links.values():
                    link.submit_jobs(evicted)
                    for make in decisions:
                        link.submit(make)
                for job in evicted:
                    self.jobs_sent[job.kind.value] += 1
            if error is not None:
                raise error
            return [r for r in results if r is not None]

    def _stored_after_error(self, chain: KeyChain) -> StoreResult | None:
        """After a failed store_many: the row counts as stored if rank 0 now holds all of
        its pages (a peer that holds them already skips it too)."""
        n = len(chain.keys)
        if self.store.lookup(chain) < n:
            return None
        return StoreResult(chain.keys[-1], 0, n, True, 0)

    # -- maintenance lane -------------------------------------------------------------
    def _room(self, reserve: int) -> int:
        rooms = [ln.room() - reserve for ln in self.links.values()]
        return min(rooms, default=1 << 30)

    def poll(self, max_jobs: int) -> int:
        """Decide and replicate at most ``max_jobs`` jobs, as credits allow; 0 when the
        lane must wait (no credits, or requests waiting) or nothing is left to do."""
        return self._poll(max_jobs, self._reserve_now()) or 0

    def _poll(self, max_jobs: int, reserve: int, min_room: int = 1) -> int | None:
        """Jobs decided and queued; None when the lane had to wait (credits, requests)."""
        room = self._room(reserve)
        if room < min_room or self._requests:
            return None
        room = min(room, max_jobs)
        if room <= 0:
            return None
        # Decide and send in chunks: peers start on the first chunk while rank 0 applies
        # the next (sending the whole room at the end kept them idle meanwhile), and a
        # request waits for the order lock at most one chunk.
        chunk = max(1, min(self._window // 8, (self._window - reserve) // 2))
        done = 0
        while done < room:
            want = min(chunk, room - done)
            with self._order:
                with self._collector.collect() as jobs:
                    self.store.poll(want)
                for link in self.links.values():
                    link.submit_jobs(jobs)
            for job in jobs:
                self.jobs_sent[job.kind.value] += 1
            done += len(jobs)
            if len(jobs) < want or self._requests:
                break  # nothing left for now, or requests first
        return done

    def maintain(self, timeout: float | None = None) -> MaintainReport:
        """Run maintenance to completion on every rank (decided, applied, acked)."""
        t0 = self._now()
        before = collections.Counter(self.jobs_sent)
        report = MaintainReport()
        while timeout is None or self._now() - t0 < timeout:
            reserve = self._reserve_now()  # the share changes as requests come and go
            batch = self._batch(reserve)
            n = self._poll(1 << 30, reserve, batch)
            if n == 0:
                break  # the scheduler has nothing left
            if n is not None:
                continue
            if self._requests:  # requests first; they finish within their acks
                with self._no_requests:
                    self._no_requests.wait_for(lambda: not self._requests,
                                               _left(t0, timeout, self._now))
                continue
            report.waits_for_credits += 1
            # A full window means wait for the slowest peer's credits, never "broken".
            # A stalled peer fails its link within job_timeout, which raises here.
            for link in self.links.values():
                link.wait(functools.partial(_has_room, link, reserve + batch - 1),
                          _left(t0, timeout, self._now))
        undrained = self.drain(_left(t0, timeout, self._now))
        if undrained:
            log.warning("maintenance of %s did not drain in time: %s", self.store.directory,
                        undrained)
        report.jobs = dict(self.jobs_sent - before)
        report.seconds = self._now() - t0
        return report

    def drain(self, timeout: float | None) -> dict[int, str]:
        """Wait until every peer acked everything queued; rank -> what did not drain."""
        left: dict[int, str] = {}
        end = None if timeout is None else self._now() + timeout
        for rank, link in self.links.items():
            inflight, pending = link.outstanding()
            target = link.acked + inflight + pending  # seqs after acked are all queued
            if not link.wait_acked(target, None if end is None else max(0.0, end - self._now())):
                left[rank] = link.describe()
        return left

    # -- start-up and shut-down --------------------------------------------------------
    def reconcile(self, peer_sets: dict[int, RecordSet]) -> ReconcilePlan:
        """Make every rank hold rank 0's record set minus what some rank lacks; raises
        ReplicaDivergedError when the ranks still disagree afterwards."""
        states = {0: self.store.record_states()}
        for rank, rs in peer_sets.items():
            states[rank] = dict(zip(rs.keys, rs.thinned, strict=True))
        p = plan(states)
        with self._order:
            for key in p.discard:
                self.store.discard(key)
            for key in p.thin:
                self.store.apply_job(Job(JobKind.THIN, key=key))
            seqs = {r: ln.submit(lambda s: Reconcile(s, p.discard, p.thin), want_reply=True)
                    for r, ln in self.links.items()}
            mine = records_digest(self.store.record_states())
        if not p.empty:
            log.warning("cache %s: start-up reconciliation: %s", self.store.directory,
                        p.summary())
        bad = {r: self.links[r].describe() for r, s in seqs.items()
               if self.links[r].reply(s).digest != mine}
        if bad:
            raise ReplicaDivergedError(
                f"cache {self.store.directory}: after reconciliation ({p.summary()}) peers "
                f"{sorted(bad)} still hold other records than rank 0; the job does not "
                "serve; run `phalanx cache verify` on each rank's directory")
        return p

    def close(self, timeout: float) -> None:
        """Say BYE to every peer and wait, within ``timeout``, until each acked everything
        before it (the links and the store are closed by their owner, RankCache). Raises
        one CleanupError with an error per peer that did not drain: its link failed
        earlier and no caller was told (that error), or it acked nothing more in time
        (LinkStalledError)."""
        end = self._now() + timeout
        errors: list[Exception] = []
        byes: dict[int, int] = {}
        for rank, link in self.links.items():  # BYE to all first: they drain at once
            if link.error is not None:
                # Failed earlier: news only if no caller saw it (every failure is
                # reported once: a maintain() that raised the stall has told it).
                if not link.error_raised:
                    errors.append(link.error)
                continue
            try:
                byes[rank] = link.submit(Bye)
            except ReplicationError as exc:  # failed just now
                errors.append(exc)
        for rank, seq in byes.items():
            link = self.links[rank]
            try:
                if not link.wait_acked(seq, max(0.0, end - self._now())):
                    errors.append(LinkStalledError(
                        f"replication link to {link.describe()}: did not drain and ack BYE "
                        f"within the close deadline ({timeout:.1f}s)"))
            except ReplicationError as exc:
                errors.append(exc)
        if errors:
            raise CleanupError(
                f"rank 0 of cache {self.store.directory}: {len(errors)} of "
                f"{len(self.links)} peers did not close cleanly; their directories may "
                "differ from rank 0's until the next start reconciles them", errors)


def _decision(chain: KeyChain, start: int, res: StoreResult | None) -> Callable[[int], Frame]:
    """The op a peer gets for its staged row (``start`` .. end of ``chain``): store it,
    or drop the copy."""
    keys = chain.keys
    if res is not None and res.stored:
        return lambda s: StoreOp(s, keys[start - 1] if start else ROOT_KEY, start,
                                 keys[start:], staged=True)
    return lambda s: Unstage(s, keys[-1], start)


def _has_room(link: PeerLink, reserve: int) -> bool:
    inflight, pending = link.outstanding()  # called under the link lock: an RLock
    return link.window - inflight - pending > reserve


def _left(t0: float, timeout: float | None, now: Callable[[], float]) -> float | None:
    return None if timeout is None else max(0.0, timeout - (now() - t0))
