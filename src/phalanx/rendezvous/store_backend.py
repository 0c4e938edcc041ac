"""The TCP-store handshake backend: keys in torch's c10d ``TCPStore`` (multi-host).

Rank 0 creates the store (torch's libuv server) and the others join it. Only torch's
public ``Store`` API is used (``barrier``, ``add``, ``set``, ``get``, ``wait``,
``delete_key``, ``check``, ``clone``), so a torch release that keeps it works.

A handshake (alloc id A, tag T, N participants) meets on one key, an int64:

    bits 0-6     arrivals: ``Store.barrier(key, N)`` adds one and waits for N
    bits 7-12    aborts: each abort adds one here
    bits 13..    departures: one bit per participant position

On the way through, a participant pays two round trips, and the last to leave a third:

* arrive and wait: ``barrier(key, N, timeout)``. The server counts the arrival and
  wakes every waiter when the N-th comes (or when anything else writes the key: an
  abort), so the release costs no round trip after the last arrival.
* depart: ``add(key, 1 << (13 + position))``, whose reply is the outcome (no abort
  counted: released); the one whose bit completes the departures deletes the key,
  which nobody reads again.

torch's own store barrier pays three or four requests a rank and leaves two keys
behind per barrier; this leaves none.

Consistency invariant: the handshake is released iff its N-th arrival comes before its
first abort in the key's history. Both are writes to one key, so the server orders
them. A participant that reads no abort was woken by the N-th arrival (nothing else
writes the key before a wake): released, and any abort after that is void. The first
aborter learns from its own ``add`` how many had arrived and publishes the verdict
(released iff N had) in a second key, ``verdict``, which every participant that reads
an abort waits for and reads. So every participant reaches the same outcome: none
succeeds where another gave up.

* ``abort`` adds one abort: waiters wake at once, and a later arrival's barrier returns
  at once (the key is past N) and reads the abort.
* a participant that times out aborts the same way: if every participant had arrived
  after all (its timeout raced the last arrival), the abort is void and it succeeds
  with them; otherwise the others wake now rather than at their own deadlines, and its
  error names the ranks whose departures (after the wake) are missing.
* a participant that loses its connection mid-handshake withdraws the same way on a
  fresh one.

``verdict`` holds the outcome and how many participants are done with it: the first
aborter counts those that had departed before the abort (they never read it) and
itself; each later reader adds one; the N-th deletes it. What an abort leaves (the keys
of participants that never came) is removed by ``purge``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._errors import (
    HandshakeAbortedError,
    HandshakeError,
    HandshakeTimeoutError,
    RendezvousError,
    TokenMismatchError,
)
from .handshake import _REMOVE, _aborted, _check, _timeout, publish_point

__all__ = ["StoreBackend", "job_prefix"]

_MAX_PARTICIPANTS = 48  # departure bits of an int64 key, above the two counters
_ARRIVALS = 0x7F
_ABORT = 1 << 7  # one abort
_ABORTS = 0x3F << 7
_DEPARTED_SHIFT = 13
_VERDICT = 1 << 32  # in the verdict key: 1 or 2 times this (released, aborted), plus
_RELEASED, _ABORTED = 1, 2  # the number of participants done with it
_DONE = _VERDICT - 1
_GRACE_S = 5.0  # for the store's answers, and for a verdict to appear
_POLL_S = (0.0002, 0.02)  # first and longest pause when collecting the departures


def job_prefix(token: str, generation: str) -> str:
    """Key namespace of one job: only holders of the token can derive it."""
    mac = hmac.new(token.encode(), generation.encode(), hashlib.sha256).hexdigest()[:24]
    return f"phx/{mac}"


@contextlib.contextmanager
def _normal_scheduling() -> Iterator[None]:
    """Run the block under SCHED_OTHER on this thread. Ranks run SCHED_BATCH (a woken
    rank must not preempt the parent mid fan-out), but the TCPStore server thread rank
    0 starts here serves every rank's requests: under SCHED_BATCH a request waits for
    whatever runs on that core."""
    try:
        policy = os.sched_getscheduler(0)
    except (AttributeError, OSError):
        yield
        return
    if policy == os.SCHED_OTHER:
        yield
        return
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        yield  # not allowed here: the server runs as this thread does
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, os.sched_param(0))


class _Outcome(enum.Enum):
    RELEASED = "released"
    ABORTED = "aborted"


@dataclass(frozen=True)
class _Missing:
    """This rank timed out and aborted the handshake: who had not come (positions);
    empty if every one of them came, but after the abort."""

    positions: list[int]


@dataclass(frozen=True)
class _Where:
    """One participant in one handshake: what every error names."""

    tag: str
    alloc_id: int
    rank: int
    address: str
    key: str
    verdict: str

    def error(self, what: str) -> HandshakeError:
        return HandshakeError(f"handshake {self.tag!r} of allocation {self.alloc_id}: rank "
                              f"{self.rank} {what} (TCP store at {self.address})")


def _departures(value: int, n: int) -> int:
    return value >> _DEPARTED_SHIFT & ((1 << n) - 1)


class _Pool:
    """Idle clones of the store, one connection each: a ``wait`` holds its connection,
    so each concurrent handshake (tasks of concurrent runs) needs its own. A clone
    whose state is unknown after an error is dropped, never given back."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._closed = False

    def take(self) -> Any:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._closed:
                raise HandshakeError("the TCP store backend is closed")
            store = self._store
        clone = store.clone()  # a new connection: outside the lock
        clone.set_timeout(timedelta(seconds=_GRACE_S))  # every reply but a wait's
        return clone

    def give(self, clone: Any) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(clone)

    def close(self) -> None:
        """Drop the idle clones; one in a handshake is dropped when given back."""
        with self._lock:
            self._closed = True
            self._idle.clear()
            self._store = None  # the last reference to the master stops its server


def _check_barrier(store: Any, key: str, address: str) -> None:
    """Check, once at start (rank 0, ~1 ms), what the protocol takes from torch's store
    beyond ``Store.barrier``'s documented contract: the barrier counts in the key's own
    integer (``add`` reads and writes it), returns at once past its world, and any
    write to the key wakes its waiters (that is how an abort wakes them). A torch
    release that changes this fails here, by name, instead of hanging handshakes."""
    from torch.distributed import DistStoreError

    waiter = store.clone()
    woken: list[BaseException | None] = []

    def wait() -> None:
        try:
            waiter.barrier(f"{key}/wake", 3, timedelta(seconds=_GRACE_S))
            woken.append(None)
        except DistStoreError as exc:
            woken.append(exc)

    thread = threading.Thread(target=wait, name="phalanx-store-check", daemon=True)
    try:
        store.add(f"{key}/count", 5)
        waiter.barrier(f"{key}/count", 2, timedelta(seconds=_GRACE_S))  # past: at once
        counted = int(store.add(f"{key}/count", 0))
        thread.start()
        deadline = time.monotonic() + _GRACE_S
        # each add is a write: the first that sees the waiter's arrival wakes it
        while int(store.add(f"{key}/wake", 0)) < 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        thread.join(_GRACE_S + 1)
    except DistStoreError as exc:
        raise RendezvousError(f"the TCP store at {address}: torch's Store.barrier does not "
                              f"return past its world ({exc}); the store backend needs it"
                              ) from exc
    finally:
        for k in ("count", "wake"):
            store.delete_key(f"{key}/{k}")
    if counted != 6 or woken != [None]:
        raise RendezvousError(
            f"the TCP store at {address}: torch's Store.barrier does not count in its key "
            f"(read {counted}, expected 6) or is not woken by a write to it "
            f"({woken[0] if woken else 'still waiting'}); the store backend needs both")


class StoreBackend:
    """Keys in a c10d TCPStore created by rank 0 (``is_master``) and joined by the others.

    TCPStore has no authentication of its own. Every key lives under a prefix derived
    from the job token with HMAC, and a joining peer must find the job's marker key
    there: a peer with the wrong token is refused at connect (TokenMismatchError) and
    cannot name, read or disturb the job's keys.
    """

    name = "store"

    def __init__(self, host: str, port: int, token: str, generation: str, *, is_master: bool,
                 timeout: float = 60.0) -> None:
        from torch.distributed import (  # type: ignore[attr-defined]
            DistError,
            DistStoreError,
            TCPStore,
        )

        self._dist_error: type[Exception] = DistError
        self._store_error: type[Exception] = DistStoreError  # what a wait's timeout raises
        self.prefix = job_prefix(token, generation)
        with _normal_scheduling():  # the server thread takes its creator's policy
            self.store = TCPStore(host, port, None, is_master, timedelta(seconds=timeout),
                                  wait_for_workers=False, use_libuv=True)
        self.host = host
        self.port = int(self.store.port)
        self.address = f"{host}:{self.port}"
        job_key = f"{self.prefix}/job"
        if is_master:
            _check_barrier(self.store, f"{self.prefix}/probe", self.address)
            self.store.set(job_key, "1")
        elif not self.store.check([job_key]):
            raise TokenMismatchError(
                f"the TCP store at {host}:{port} holds no job for this job token and generation "
                f"{generation}: refused. Check PHALANX_JOB_TOKEN and the store address")
        self._lock = threading.Lock()  # for self.store: abort, purge and counts
        self._pool = _Pool(self.store)
        # one clone now: the server resolves each new peer's name as it accepts it
        # (~0.2 s here), which is better paid at start-up than inside a handshake
        self._pool.give(self._pool.take())

    def _where(self, tag: str, alloc_id: int, rank: int) -> _Where:
        base = f"{self.prefix}/hs/{alloc_id}/{tag}"
        return _Where(tag, alloc_id, rank, self.address, f"{base}/meet", f"{base}/verdict")

    # -- the handshake ---------------------------------------------------------------
    def handshake(self, tag: str, alloc_id: int, participants: Sequence[int], rank: int,
                  timeout: float) -> None:
        _check(tag, participants, rank)
        if len(participants) > _MAX_PARTICIPANTS:
            raise HandshakeError(f"the store backend handshakes at most {_MAX_PARTICIPANTS} "
                                 f"participants, not {len(participants)}")
        where = self._where(tag, alloc_id, rank)
        deadline = time.monotonic() + timeout
        publish_point(tag, alloc_id, rank)
        position, n = participants.index(rank), len(participants)
        try:
            store = self._pool.take()
        except self._dist_error as exc:
            raise where.error(f"cannot reach the TCP store: {exc}") from exc
        departing = [False]  # set once this rank sends its departure (never sent twice)
        try:
            outcome = self._meet(store, where, n, position, deadline, departing)
        except HandshakeError:
            self._pool.give(store)  # raised between requests: the connection is in step
            raise
        except self._dist_error as exc:
            # the clone's state is unknown, so it is dropped: withdraw on a fresh one
            outcome = self._withdraw(where, n, position, departing[0], exc)
        else:
            self._pool.give(store)
        # (any other exception drops the clone too: a request may be half done)
        if outcome is _Outcome.RELEASED:
            return
        if outcome is _Outcome.ABORTED:
            raise HandshakeAbortedError(f"{_aborted(tag, alloc_id, rank)} (TCP store at "
                                        f"{self.address})")
        missing = [participants[i] for i in outcome.positions]
        if missing:
            error = _timeout("arrival", tag, alloc_id, rank, missing, timeout)
            raise HandshakeTimeoutError(f"{error} (TCP store at {self.address})", missing)
        raise HandshakeTimeoutError(
            f"handshake {tag!r} of allocation {alloc_id}: rank {rank} waited {timeout:g}s at "
            f"arrival; the others came, but only after it gave up (TCP store at "
            f"{self.address})", [])

    def _meet(self, store: Any, where: _Where, n: int, position: int, deadline: float,
              departing: list[bool]) -> _Outcome | _Missing:
        """Arrive, wait, depart."""
        try:
            # at least 1 ms: never zero, which some torch calls read as "no timeout"
            store.barrier(where.key, n, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except self._store_error:  # the deadline (a lost connection is another error)
            return self._give_up(store, where, n, position, departing)
        return self._depart(store, where, n, position, departing)

    def _depart(self, store: Any, where: _Where, n: int, position: int,
                departing: list[bool], verdict: _Outcome | None = None) -> _Outcome:
        """Set this rank's departure bit and read the outcome; the last one out deletes
        the key. ``verdict``: known already (this rank published it)."""
        departing[0] = True  # whether the add lands or not: a second one would carry
        value = int(store.add(where.key, 1 << (_DEPARTED_SHIFT + position)))
        if verdict is None:
            if value & _ABORTS:
                verdict = self._read_verdict(store, where, n)
            elif value & _ARRIVALS < n:
                raise where.error(f"was woken with {value & _ARRIVALS} of {n} arrivals and "
                                  f"no abort: something else wrote key {where.key!r}")
            else:
                verdict = _Outcome.RELEASED
        if _departures(value, n) == (1 << n) - 1:  # everyone left: nobody reads it again
            self._remove(store, where, where.key)
        return verdict

    def _read_verdict(self, store: Any, where: _Where, n: int) -> _Outcome:
        """Wait for the first aborter's verdict, count this rank done with it (the N-th
        deletes it)."""
        try:
            store.wait([where.verdict], timedelta(seconds=_GRACE_S))
        except self._store_error as exc:
            raise where.error(f"read an abort but no verdict within {_GRACE_S:g}s (the "
                              f"rank that aborted died?)") from exc
        value = int(store.add(where.verdict, 1))
        if value & _DONE == n:
            self._remove(store, where, where.verdict)
        if value // _VERDICT not in (_RELEASED, _ABORTED):
            raise where.error(f"read a verdict {value} that no participant writes")
        return _Outcome.RELEASED if value // _VERDICT == _RELEASED else _Outcome.ABORTED

    def _abort_once(self, store: Any, where: _Where, n: int,
                    position: int | None) -> tuple[_Outcome | None, int]:
        """Add an abort; return the verdict and the arrivals before it. The first
        aborter publishes the verdict (a later one gets None: it reads the verdict when
        it departs). ``position``: this aborter's, if it is a participant that has not
        departed."""
        value = int(store.add(where.key, _ABORT))
        if value & _ABORTS != _ABORT:
            return None, value & _ARRIVALS  # not the first: the first publishes
        verdict = _Outcome.RELEASED if value & _ARRIVALS >= n else _Outcome.ABORTED
        # done with it already: those that departed before the abort (they read no
        # abort and never read the verdict), and this aborter if it is a participant
        done = bin(_departures(value, n)).count("1") + (position is not None)
        if done < n:
            code = _RELEASED if verdict is _Outcome.RELEASED else _ABORTED
            store.set(where.verdict, str(code * _VERDICT + done))  # one-way: wakes readers
        return verdict, value & _ARRIVALS

    def _give_up(self, store: Any, where: _Where, n: int, position: int,
                 departing: list[bool]) -> _Outcome | _Missing:
        """This rank's deadline passed: abort. If every participant had arrived, the
        abort is void and this rank is released with them."""
        verdict, arrived = self._abort_once(store, where, n, position)
        if verdict is None:  # someone else aborted first: a reader like the others
            return self._depart(store, where, n, position, departing)
        if verdict is _Outcome.ABORTED:
            # name the missing once the woken ones have left (before this rank does:
            # the key outlives its poll)
            positions = self._not_departed(store, where, n, position, arrived)
            self._depart(store, where, n, position, departing, verdict)
            return _Missing(positions)
        return self._depart(store, where, n, position, departing, verdict)

    def _not_departed(self, store: Any, where: _Where, n: int, position: int,
                      arrived: int) -> list[int]:
        """Positions whose departure bit is still missing once as many have left as had
        arrived (the others are woken by the abort and leave at once), or after a grace
        period: the ranks that had not arrived."""
        deadline = time.monotonic() + _GRACE_S
        pause = _POLL_S[0]
        while True:
            bits = _departures(int(store.get(where.key)), n) | 1 << position
            if bin(bits).count("1") >= arrived or time.monotonic() > deadline:
                return [i for i in range(n) if not bits >> i & 1]
            time.sleep(pause)  # a poll on the failure path only, with a deadline
            pause = min(pause * 2, _POLL_S[1])

    def _withdraw(self, where: _Where, n: int, position: int, departing: bool,
                  exc: Exception) -> _Outcome | _Missing:
        """The connection failed mid-handshake. On a fresh one, within a few seconds:
        abort (void if every participant had arrived), then depart as everyone does."""
        if departing:
            raise where.error(f"lost the TCP store while departing (the handshake's keys "
                              f"may stay until purged): {exc}") from exc
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        try:
            fresh = TCPStore(self.host, self.port, None, False, timedelta(seconds=_GRACE_S),
                             use_libuv=True)
            verdict, _ = self._abort_once(fresh, where, n, position)
            outcome = self._depart(fresh, where, n, position, [False], verdict)
        except self._dist_error as again:
            raise where.error(
                f"lost the TCP store mid-handshake ({exc}) and could not withdraw its "
                f"arrival ({again}): the others may still complete without it. Check the "
                f"store's host (rank 0) and the network") from exc
        if outcome is _Outcome.RELEASED:
            return outcome  # every participant was released: so is this one
        raise where.error(f"lost the TCP store mid-handshake ({exc}); its arrival is "
                          f"withdrawn and the others are told to give up") from exc

    def _remove(self, store: Any, where: _Where, key: str) -> None:
        """Delete a key nobody reads again (the failpoint is the leader's in the marker
        backend: here, whoever the protocol makes the last reader)."""
        try:
            _REMOVE.hit()
        except OSError as err:
            raise where.error(f"could not remove key {key!r} of the handshake: errno "
                              f"{err.errno} ({err.strerror})") from err
        store.delete_key(key)

    # -- the Backend protocol's other calls -------------------------------------------
    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        """Abort each handshake: a waiter wakes at once, a later arrival is refused; one
        that every participant had reached stays released (the abort is void)."""
        with self._lock:
            for tag in tags:
                self._abort_once(self.store, self._where(tag, alloc_id, rank),
                                 len(participants), None)

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        removed = 0
        for tag in tags:
            where = self._where(tag, alloc_id, -1)
            with self._lock:
                removed += sum(int(self.store.delete_key(k)) for k in (where.key, where.verdict))
        return removed

    def live_markers(self) -> int:
        """Keys of this job now (every delete is answered before its handshake returns)."""
        with self._lock:
            return int(self.store.num_keys())

    def close(self) -> None:
        self._pool.close()
        del self.store
