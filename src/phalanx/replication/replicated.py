"""``ReplicatedCache``: the TP-N prefix cache, opened on a Worker from the parent.

Rank 0 owns the index and decides every store, load, eviction, expiry and thinning; it
applies each to its own directory and sends it as an op to every peer over an
authenticated TCP link with flow control (link.py); each peer applies the same op to its
own directory with bytes from its own KV source (replica.py). So all ranks' directories
hold the same keys in the same states.

The parent holds only a cache id; stores, links and threads live in the ranks
(_rank_tasks.py). Every call is a task on rank 0 and returns once every peer acked.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from phalanx.kvstore import StoreClosedError
from phalanx.kvstore.geometry import Geometry
from phalanx.kvstore.keys import KeyChain, Tokens
from phalanx.kvstore.store import StoreResult
from phalanx.runtime import Orchestrator, Worker, WorkerError

from . import _rank_tasks as rt
from ._errors import ReplicaDivergedError
from .kv_source import KVSourceFactory, SyntheticSource
from .leader import MaintainReport
from .synth import SynthReport

__all__ = ["ReplicatedCache", "rank_directories"]

_IDS = itertools.count(1)


def rank_directories(directory: str | os.PathLike[str], ranks: int) -> list[str]:
    """The default layout: ``DIR/rank-<i>/`` for each rank."""
    return [os.path.join(os.fspath(directory), f"rank-{r}") for r in range(ranks)]


class _State(enum.Enum):
    OPEN = "open"  # links up, ranks agree; serving
    CLOSED = "closed"  # close() ran; every call raises StoreClosedError


class ReplicatedCache:
    """See the module docstring; open with :meth:`open`."""

    def __init__(self, worker: Worker, cid: str, cfg: rt.OpenConfig,
                 reconciled: dict[str, Any], close_timeout: float) -> None:
        self.worker = worker
        self.cache_id = cid
        self.config = cfg
        self.reconciled = reconciled  # what start-up reconciliation changed
        self.close_timeout = close_timeout
        self._state = _State.OPEN

    @classmethod
    def open(
        cls,
        worker: Worker,
        directory: str | os.PathLike[str],
        *,
        geometry: Geometry,
        fingerprint: str | bytes,
        capacity_bytes: int,
        max_age: float | None = None,
        kv_source_factory: KVSourceFactory = SyntheticSource,
        job_timeout: float = 30.0,
        window: int = 64,
        reserve: int | None = None,
        directories: Sequence[str] | None = None,
        bind_host: str = "127.0.0.1",
        connect_timeout: float = 60.0,
        close_timeout: float = 30.0,
        fsync: bool = False,
    ) -> ReplicatedCache:
        """Open every rank's store (recovery), connect the links, reconcile.

        ``directories`` (one per rank) overrides the default ``DIR/rank-<i>/``.
        ``window`` bounds ops in flight per peer; ``reserve`` (default window/4) of them
        only request-lane ops may take. Returns once all ranks agree on their records;
        raises LinkAuthError, ReplicaDivergedError or the recovery errors otherwise.
        """
        if window < 2 or job_timeout <= 0:
            raise ValueError("window must be >= 2 and job_timeout > 0")
        n = len(worker.ranks)
        dirs = list(directories) if directories is not None else rank_directories(directory, n)
        if len(dirs) != n:
            raise ValueError(f"{len(dirs)} directories for {n} ranks")
        cfg = rt.OpenConfig(
            dirs, geometry, fingerprint, capacity_bytes, max_age, kv_source_factory,
            job_timeout, window, window // 4 if reserve is None else reserve, bind_host,
            fsync)
        cid = f"rc{os.getpid()}-{next(_IDS)}"
        reconciled = worker.run(_open_all, cid, cfg, connect_timeout, close_timeout)
        return cls(worker, cid, cfg, reconciled, close_timeout)

    # -- rank 0's decisions ----------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        if self._state is not _State.OPEN:
            raise StoreClosedError(f"replicated cache {self.cache_id} is closed")
        return self.worker.run(_on_leader, self.cache_id, method, *args)

    def store(self, tokens: Tokens | KeyChain, *, from_page: int | None = None) -> StoreResult:
        """Store the uncached pages of ``tokens`` on every rank (each from its own KV
        source); returns rank 0's result once every peer acked. ``from_page`` makes the
        row start earlier (overlapping cached pages, as older versions wrote)."""
        result: StoreResult = self._call("store", tokens, from_page)
        return result

    def synth(self, records: int, shape: str = "chain", *, seed: int = 0,
              group: int = 1) -> SynthReport:
        """Write ``records`` synthetic records through the replicated store path (run on
        rank 0, so no task round trip per record). ``group`` > 1 writes each row from
        the start of its group of ``group`` records: ``group - 1`` of every ``group``
        rows are redundant (the uncompacted layout of older versions)."""
        report: SynthReport = self._call("synth", records, shape, seed, group)
        return report

    def lookup(self, tokens: Tokens | KeyChain) -> int:
        """Pages of the longest cached prefix (rank 0's index; every rank holds them)."""
        pages: int = self._call("lookup", tokens)
        return pages

    def load(self, tokens: Tokens | KeyChain, n_pages: int) -> dict[int, int]:
        """Every rank loads its shard of pages 0..n-1 into its KV source; returns rank ->
        crc32 of the bytes it loaded."""
        crcs: dict[int, int] = self._call("load", tokens, n_pages)
        return crcs

    def poll(self, max_jobs: int = 32) -> int:
        """One bounded burst of maintenance (as the peers' windows allow)."""
        done: int = self._call("poll", max_jobs)
        return done

    def maintain(self, timeout: float | None = None) -> MaintainReport:
        """Maintenance to completion on every rank (decided, applied, acked)."""
        report: MaintainReport = self._call("maintain", timeout)
        return report

    # -- audit -------------------------------------------------------------------------
    def stats(self) -> dict[int, dict[str, Any]]:
        """rank -> that rank's state: stats, check problems, record digest, links."""
        if self._state is not _State.OPEN:
            raise StoreClosedError(f"replicated cache {self.cache_id} is closed")
        states: dict[int, dict[str, Any]] = self.worker.run(_each_rank, self.cache_id)
        return states

    def check(self) -> list[str]:
        """Every rank's DiskStore.check() plus cross-rank identity of the record sets."""
        states = self.stats()
        problems = [f"rank {r}: {p}" for r, s in states.items() for p in s["problems"]]
        digests = {r: s["digest"] for r, s in states.items()}
        if len(set(digests.values())) > 1:
            problems.append(f"record sets differ across ranks (digests {digests})")
        return problems

    # -- shut-down ---------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> list[str]:
        """Drain outstanding ops within ``timeout``, close links, stores and threads on
        every rank; returns what did not drain or close (empty when clean). Idempotent."""
        if self._state is _State.CLOSED:
            return []
        self._state = _State.CLOSED
        t = self.close_timeout if timeout is None else timeout
        try:
            return list(self.worker.run(_close_all, self.cache_id, t))
        except WorkerError as exc:
            # A rank died (the Worker admits no runs): what the ranks hold goes with
            # their processes when the Worker closes; report it, do not raise.
            return [f"replicated cache {self.cache_id} not closed by its ranks: {exc}; "
                    "its stores and links are released when the Worker closes"]

    def __enter__(self) -> ReplicatedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- orchestration functions (run on a run thread in the parent) -----------------------
def _open_all(o: Orchestrator, cid: str, cfg: rt.OpenConfig, connect_timeout: float,
              close_timeout: float) -> dict[str, Any]:
    peers = [r for r in o.ranks if r != 0]
    try:
        port = o.submit(0, rt.leader_open, cid, cfg).result()
        accept = o.submit(0, rt.leader_accept, cid, cfg, peers, connect_timeout)
        opened = [o.submit(r, rt.replica_open, cid, cfg, cfg.bind_host, port,
                           connect_timeout) for r in peers]
        errors: list[BaseException] = []
        for fut in [accept, *opened]:
            exc = fut.exception()
            if exc is not None:
                errors.append(exc)
        if errors:
            # The leader's error names the cause best (refused peer, divergence); peers
            # fail as a consequence (refused, connection closed).
            lead = next((e for e in errors if isinstance(e, ReplicaDivergedError)), errors[0])
            raise lead
        report: dict[str, Any] = accept.result()
        return report
    except BaseException:
        _close_all(o, cid, close_timeout)  # roll back every rank's half-open state
        raise


def _on_leader(o: Orchestrator, cid: str, method: str, *args: Any) -> Any:
    return o.submit(0, rt.leader_call, cid, method, *args).result()


def _each_rank(o: Orchestrator, cid: str) -> dict[int, dict[str, Any]]:
    futs = {r: o.submit(r, rt.rank_state, cid) for r in o.ranks}
    out: dict[int, dict[str, Any]] = {}
    for r, f in futs.items():
        exc = f.exception()  # a dead rank is reported in its entry, not raised: the
        out[r] = f.result() if exc is None else {  # others' state is still worth reading
            "error": f"{type(exc).__name__}: {exc}", "problems": [f"unreachable: {exc}"],
            "digest": None}
    return out


def _close_all(o: Orchestrator, cid: str, timeout: float) -> list[str]:
    """Rank 0 first (it drains, then says BYE), then the peers; every rank is closed
    even when one fails, and every failure is reported."""
    problems: list[str] = []
    end = time.monotonic() + timeout
    for group in ([0], [r for r in o.ranks if r != 0]):
        futs = {r: o.submit(r, rt.close_rank, cid, max(0.1, end - time.monotonic()))
                for r in group}
        for r, f in futs.items():
            exc = f.exception()
            if exc is not None:
                problems.append(f"rank {r}: closing failed: {exc!r}")
            else:
                problems += [f"rank {r}: {p}" for p in f.result()]
    if problems:
        # reported, never raised: a dead peer must not keep the others open
        problems = [p for p in problems if p]
    return problems

