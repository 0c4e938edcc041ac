"""``ReplicatedCache``: the TP-N prefix cache, opened on a Worker from the parent.

Rank 0 owns the index and decides every store, load, eviction, expiry and thinning; it
applies each to its own directory and sends it as an op to every peer over an
authenticated TCP link with flow control (link.py); each peer applies the same op to its
own directory with bytes from its own KV source (replica.py). So all ranks' directories
hold the same keys in the same states.

The parent holds only a cache id; each rank's side (store, links, threads) is a
:class:`~phalanx.replication.rank_cache.RankCache` in that rank's services. Every call
is one typed task (_rank_tasks.py) on rank 0 and returns once every peer acked; the
engine uses the rank-side API (rank_api.py) from its own tasks instead.

Deadlines: open, stats/check and close submit their tasks with deadlines and read the
outcome of each rank as it comes, so a hung rank (SIGSTOP) costs at most the deadline
and is named in the error; the Worker's close then kills it.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from phalanx.kvstore import StoreClosedError
from phalanx.kvstore.geometry import Geometry
from phalanx.kvstore.keys import KeyChain, Tokens
from phalanx.kvstore.store import StoreResult
from phalanx.lifecycle import CleanupError
from phalanx.runtime import Orchestrator, WaitTimeoutError, Worker, WorkerError

from . import _rank_tasks as rt
from ._errors import LinkAuthError, LinkStalledError, ReplicaDivergedError
from .kv_source import KVSourceFactory, SyntheticSource
from .leader import MaintainReport
from .rank_cache import OpenConfig
from .synth import SynthReport

__all__ = ["ReplicatedCache", "rank_directories"]

P = ParamSpec("P")
T = TypeVar("T")

_IDS = itertools.count(1)
_POLL_S = 0.05  # how often an open looks for a peer that failed
_SETTLE_MARGIN_S = 5.0  # a run whose tasks all have deadlines settles this soon after


def rank_directories(directory: str | os.PathLike[str], ranks: int) -> list[str]:
    """The default layout: ``DIR/rank-<i>/`` for each rank."""
    return [os.path.join(os.fspath(directory), f"rank-{r}") for r in range(ranks)]


class _State(enum.Enum):
    OPEN = "open"  # links up, ranks agree; serving
    CLOSED = "closed"  # close() ran; every call raises StoreClosedError


class ReplicatedCache:
    """See the module docstring; open with :meth:`open`."""

    def __init__(self, worker: Worker, cid: str, cfg: OpenConfig,
                 reconciled: dict[str, Any], close_timeout: float) -> None:
        self.worker = worker
        self.cache_id = cid  # names each rank's side: rank_cache(cache_id) in a task
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
        raises LinkAuthError, ReplicaDivergedError or the recovery errors otherwise
        (every rank's half-open side closed again; a failure of that is a note).
        """
        if window < 2 or job_timeout <= 0:
            raise ValueError("window must be >= 2 and job_timeout > 0")
        n = len(worker.ranks)
        dirs = list(directories) if directories is not None else rank_directories(directory, n)
        if len(dirs) != n:
            raise ValueError(f"{len(dirs)} directories for {n} ranks")
        cfg = OpenConfig(
            dirs, geometry, fingerprint, capacity_bytes, max_age, kv_source_factory,
            job_timeout, window, window // 4 if reserve is None else reserve, bind_host,
            fsync)
        cid = f"rc{os.getpid()}-{next(_IDS)}"
        # submit, not run: a rank hung mid-open holds the run's fence until the Worker's
        # close kills it; the outcome is known once every task's deadline passed
        handle = worker.submit(_open_all, cid, cfg, worker.job_token, connect_timeout,
                               close_timeout)
        settle = connect_timeout + close_timeout + 2 * _SETTLE_MARGIN_S
        if not handle.wait(settle):
            raise LinkStalledError(
                f"replicated cache {cid}: opening did not finish within {settle:.0f}s (a "
                "rank is hung in recovery?); the Worker's close stops the ranks")
        reconciled: dict[str, Any] = handle.result()
        return cls(worker, cid, cfg, reconciled, close_timeout)

    # -- rank 0's decisions ----------------------------------------------------------
    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise StoreClosedError(f"replicated cache {self.cache_id} is closed")

    def _on_leader(self, fn: Callable[Concatenate[str, P], T], *args: P.args,
                   **kwargs: P.kwargs) -> T:
        """``fn(cache_id, *args)`` as a task on rank 0; its value or its error."""
        self._check_open()
        return cast(T, self.worker.run(_on_leader, fn, self.cache_id, *args, **kwargs))

    def store(self, tokens: Tokens | KeyChain, *, from_page: int | None = None) -> StoreResult:
        """Store the uncached pages of ``tokens`` on every rank (each from its own KV
        source); returns rank 0's result once every peer acked. ``from_page`` makes the
        row start earlier (overlapping cached pages, as older versions wrote)."""
        return self._on_leader(rt.leader_store, tokens, from_page)

    def synth(self, records: int, shape: str = "chain", *, seed: int = 0,
              group: int = 1) -> SynthReport:
        """Write ``records`` synthetic records through the replicated store path (run on
        rank 0, so no task round trip per record). ``group`` > 1 writes each row from
        the start of its group of ``group`` records: ``group - 1`` of every ``group``
        rows are redundant (the uncompacted layout of older versions)."""
        return self._on_leader(rt.leader_synth, records, shape, seed, group)

    def lookup(self, tokens: Tokens | KeyChain) -> int:
        """Pages of the longest cached prefix (rank 0's index; every rank holds them)."""
        return self._on_leader(rt.leader_lookup, tokens)

    def load(self, tokens: Tokens | KeyChain, n_pages: int) -> dict[int, int]:
        """Every rank loads its shard of pages 0..n-1 into its KV source; returns rank ->
        crc32 of the bytes it loaded."""
        return self._on_leader(rt.leader_load, tokens, n_pages)

    def poll(self, max_jobs: int = 32) -> int:
        """One bounded burst of maintenance (as the peers' windows allow)."""
        return self._on_leader(rt.leader_poll, max_jobs)

    def maintain(self, timeout: float | None = None) -> MaintainReport:
        """Maintenance to completion on every rank (decided, applied, acked). A peer that
        stalls fails it within ``job_timeout`` (LinkStalledError naming the peer)."""
        return self._on_leader(rt.leader_maintain, timeout)

    # -- audit -------------------------------------------------------------------------
    def stats(self, timeout: float | None = None) -> dict[int, dict[str, Any]]:
        """rank -> that rank's state: stats, check problems, record digest, links. A rank
        that does not answer within ``timeout`` (default close_timeout) is reported in
        its entry (``error``, ``problems``), not waited for."""
        self._check_open()
        t = self.close_timeout if timeout is None else timeout
        out: dict[int, dict[str, Any]] = {}
        handle = self.worker.submit(_each_rank, self.cache_id, t, out)
        handle.wait(t + _SETTLE_MARGIN_S)
        for r in self.worker.ranks:  # a rank the run never reached
            out.setdefault(r, _unreachable(f"no answer within {t:.1f}s"))
        return dict(sorted(out.items()))

    def check(self, timeout: float | None = None) -> list[str]:
        """Every rank's DiskStore.check() plus cross-rank identity of the record sets."""
        return check_states(self.stats(timeout))

    # -- shut-down ---------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Close every rank's side within ``timeout`` (default close_timeout): rank 0
        drains and says BYE, then the peers stop. Every rank is asked even when one
        fails; raises one CleanupError with an error per rank that failed (named in the
        message and in a note on each), a hung rank included (its TaskTimeoutError).
        What a rank could not close stays owed in its services and is retried at its
        shutdown. Idempotent: a second call does nothing."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        t = self.close_timeout if timeout is None else timeout
        failures: dict[int, BaseException] = {}
        try:
            handle = self.worker.submit(_close_all, self.cache_id, t, failures)
        except WorkerError as exc:
            # The Worker admits no runs (a rank died): each live rank closes its side at
            # its shutdown when the Worker closes; say so rather than pretend it closed.
            raise CleanupError(
                f"replicated cache {self.cache_id}: its ranks were not asked to close "
                f"({exc}); each live rank closes its side when the Worker closes", [exc],
            ) from None
        if not handle.wait(t + _SETTLE_MARGIN_S):
            failures.setdefault(-1, WorkerError(
                f"replicated cache {self.cache_id}: the close run did not settle within "
                f"{t + _SETTLE_MARGIN_S:.1f}s"))
        raise_failures(f"replicated cache {self.cache_id}: closing", failures)

    def __enter__(self) -> ReplicatedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_states(states: dict[int, dict[str, Any]]) -> list[str]:
    """The problems in every rank's state (``RankCache.state``): each rank's own check,
    and record sets that differ across ranks."""
    problems = [f"rank {r}: {p}" for r, s in states.items() for p in s["problems"]]
    digests = {r: s["digest"] for r, s in states.items()}
    if len(set(digests.values())) > 1:
        problems.append(f"record sets differ across ranks (digests {digests})")
    return problems


def raise_failures(what: str, failures: dict[int, BaseException]) -> None:
    """Raise one CleanupError for ``failures`` (rank -> its error), if any."""
    if not failures:
        return
    errors: list[Exception] = []
    for rank, exc in sorted(failures.items()):
        err = exc if isinstance(exc, Exception) else WorkerError(repr(exc))
        err.add_note(f"rank {rank}" if rank >= 0 else "the parent")
        errors.append(err)
    names = "; ".join(f"rank {r}: {_summary(e)}" for r, e in sorted(failures.items()))
    raise CleanupError(f"{what} failed on {len(failures)} rank(s): {names}", errors)


def _summary(exc: BaseException) -> str:
    """The errors inside ``exc`` (groups flattened), one short line each."""
    if isinstance(exc, BaseExceptionGroup):
        return ", ".join(_summary(e) for e in exc.exceptions)
    line = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {line[:240]}"


def _unreachable(why: str) -> dict[str, Any]:
    return {"error": why, "problems": [f"unreachable: {why}"], "digest": None}


# -- orchestration functions (run on a run thread in the parent) -----------------------
def _on_leader(o: Orchestrator, fn: Callable[..., T], cid: str, *args: Any,
               **kwargs: Any) -> T:
    return cast(T, o.submit(0, fn, cid, *args, **kwargs).result())


def _open_all(o: Orchestrator, cid: str, cfg: OpenConfig, token: str,
              connect_timeout: float, close_timeout: float) -> dict[str, Any]:
    peers = [r for r in o.ranks if r != 0]
    # the peers recover and connect within connect_timeout (rank 0 accepts no longer):
    # their tasks need no longer deadline than that, and a hung one fails at it
    oc = o.options(timeout=connect_timeout + _SETTLE_MARGIN_S)
    try:
        port = o.submit(0, rt.leader_open, cid, cfg).result()
        accept = oc.submit(0, rt.leader_accept, cid, peers, token, connect_timeout)
        opened = [oc.submit(r, rt.replica_open, cid, cfg, cfg.bind_host, port, token,
                            connect_timeout) for r in peers]
        # A peer whose own open fails (recovery, connect) is the news: rank 0 stops
        # waiting for it at once rather than wait out connect_timeout.
        peer_errors: dict[int, BaseException] = {}
        pending = dict(zip(peers, opened, strict=True))
        while pending and not accept.done():
            for r, fut in list(pending.items()):
                if fut.done():
                    del pending[r]
                    exc = fut.exception()
                    if exc is not None and not peer_errors:
                        o.control(0, rt.leader_cancel_accept, cid).result()
                    if exc is not None:
                        peer_errors[r] = exc
            with contextlib.suppress(WaitTimeoutError):
                accept.exception(_POLL_S)  # a short wait: then look at the peers again
        lead_error = accept.exception()
        for r, fut in pending.items():
            exc = fut.exception()
            if exc is not None:
                peer_errors[r] = exc
        if lead_error is not None or peer_errors:
            raise _open_error(lead_error, peer_errors)
        report: dict[str, Any] = accept.result()
        return report
    except BaseException as exc:
        failures: dict[int, BaseException] = {}
        _close_all(o, cid, close_timeout, failures)  # roll back every rank's half-open side
        try:
            raise_failures(f"replicated cache {cid}: rolling back the open", failures)
        except CleanupError as cleanup:
            exc.add_note(f"and {cleanup}")
        raise


def _open_error(lead: BaseException | None, peers: dict[int, BaseException]) -> BaseException:
    """The error an open raises: rank 0's when it decided (a refused peer, diverged
    records), else a peer's own (rank 0's timeout or cancelled wait is its consequence);
    the rest as notes."""
    if lead is not None and (isinstance(lead, LinkAuthError | ReplicaDivergedError)
                             or not peers):
        first, rest = lead, list(peers.items())
    else:
        r0 = min(peers)
        first, rest = peers[r0], [(r, e) for r, e in peers.items() if r != r0]
        if lead is not None:
            rest.insert(0, (0, lead))
    for r, exc in rest:
        first.add_note(f"and rank {r}: {_summary(exc)}")
    return first


def _each_rank(o: Orchestrator, cid: str, timeout: float,
               out: dict[int, dict[str, Any]]) -> None:
    futs = {r: o.options(timeout=timeout).submit(r, rt.rank_state, cid) for r in o.ranks}
    for r, f in futs.items():
        exc = f.exception()  # a dead or hung rank is reported in its entry, not raised:
        out[r] = f.result() if exc is None else _unreachable(  # the others' state is
            f"{type(exc).__name__}: {exc}")  # still worth reading


def _close_all(o: Orchestrator, cid: str, timeout: float,
               failures: dict[int, BaseException]) -> None:
    """Rank 0 first (it drains, then says BYE), then the peers; every rank is asked
    even when one fails, each within what is left of ``timeout``; ``failures`` gets
    rank -> error (filled in place: the caller reads it even if the run fails)."""
    end = time.monotonic() + timeout
    for group in ([0], [r for r in o.ranks if r != 0]):
        left = max(0.5, end - time.monotonic())
        futs = {r: o.options(timeout=left).submit(r, rt.close_rank, cid, left * 0.9)
                for r in group}
        for r, f in futs.items():
            exc = f.exception()
            if exc is not None:
                failures[r] = exc
