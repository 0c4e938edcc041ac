"""The TCP-store handshake backend: keys in torch's c10d ``TCPStore`` (multi-host).

Rank 0 creates the store (torch's libuv server) and the others join it. Only torch's
public ``Store`` API is used (``add``, ``set``, ``wait``, ``compare_set``,
``delete_key``, ``check``, ``clone``), so any torch release that keeps that API works.

A handshake (alloc id A, tag T, N participants) has two keys:

* ``arrivals`` (an int64): bit *i* is participant *i*'s arrival; bit 62 is ABORTED.
* ``release`` (an int64): written once, when the handshake is decided: ``GO`` or
  ``ABORT`` in its high half, and in its low half the number of participants that
  have read it (departed).

Round trips per participant, on the way through:

* arrive: ``add(arrivals, 1 << i)``. Its reply says whether this is the last arrival.
* the last arrival *sets* ``release = GO + 1`` (one-way: torch's ``set`` has no reply)
  and deletes ``arrivals`` (one round trip): every other participant already arrived,
  so nobody adds to it again.
* the others ``wait([release])`` (woken by the set) and depart with
  ``add(release, 1)``, whose reply is the outcome; the one that counts N deletes
  ``release``: every participant has read it, nobody reads it again.

So the last arrival pays two round trips and a send, the others two plus the wake
(and the last to leave one more); torch's store barrier pays three or four and leaves
two keys behind per barrier. This leaves none.

Aborts and timeouts. Consistency invariant, on the ``arrivals`` key: ABORTED is set
only by a ``compare_set`` that saw some arrival bit missing (and no ABORTED), and
arrival bits are only ever added. So "every arrival bit without ABORTED" and
"ABORTED" exclude each other for ever: exactly one of them happens first, its author
writes ``release`` (the last arrival with GO, the aborter with ABORT, create-only),
and every participant's outcome is what ``release`` says. No participant succeeds
where another gave up.

* ``abort`` sets ABORTED unless every participant arrived, then creates ``release``:
  waiters wake at once, a later arrival reads ABORTED in its ``add`` reply.
* a participant that times out does the same: if every participant had arrived after
  all, it succeeds with them; otherwise it has aborted the handshake, so the others
  wake now rather than at their own deadlines, and its error names the ranks whose
  bits were missing.
* a participant that loses its connection before departing withdraws the same way on
  a fresh one.

What an abort leaves (keys of participants that never came) is removed by ``purge``.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import logging
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
    TokenMismatchError,
)
from .handshake import _REMOVE, _aborted, _check, _timeout, publish_point

__all__ = ["StoreBackend", "job_prefix"]

log = logging.getLogger("phalanx.rendezvous")

_MAX_PARTICIPANTS = 56  # arrival bits of an int64 counter, under the ABORTED bit
_ABORTED = 1 << 62  # on the arrivals key
_GO = 1 << 32  # release's high half: the outcome; its low half counts departures
_ABORT = 2 << 32
_DEPARTED = (1 << 32) - 1
_GRACE_S = 5.0  # for the store's answers, and for a decided release to appear


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


class _Decision(enum.Enum):
    """What an attempt to abort a handshake found on its arrivals key."""

    ABORTED_NOW = "aborted now"  # this call set ABORTED: it must write the release
    ABORTED_BEFORE = "aborted before"  # someone else did (and writes the release)
    COMPLETE = "complete"  # every participant had arrived: released, not aborted
    GONE = "gone"  # the key is deleted: its last arrival released it, then removed it


class _Outcome(enum.Enum):
    RELEASED = "released"
    ABORTED = "aborted"


@dataclass(frozen=True)
class _Where:
    """One participant in one handshake: what every error names."""

    tag: str
    alloc_id: int
    rank: int
    address: str
    arrivals: str
    release: str

    def error(self, what: str) -> HandshakeError:
        return HandshakeError(f"handshake {self.tag!r} of allocation {self.alloc_id}: rank "
                              f"{self.rank} {what} (TCP store at {self.address})")


@dataclass
class _Progress:
    """How far this participant got: what a withdrawal must undo."""

    arrived: int | None = None  # the arrivals key's value its arrival made
    departed: bool = False


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
        return _Where(tag, alloc_id, rank, self.address, f"{base}/arrivals", f"{base}/release")

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
        progress = _Progress()
        try:
            store = self._pool.take()
        except self._dist_error as exc:
            raise where.error(f"cannot reach the TCP store: {exc}") from exc
        try:
            outcome = self._meet(store, where, n, position, deadline, progress)
        except HandshakeError:
            self._pool.give(store)  # raised between requests: the connection is in step
            raise
        except self._dist_error as exc:
            # the clone's state is unknown, so it is dropped: withdraw on a fresh one
            outcome = self._withdraw(where, n, progress, exc)
        else:
            self._pool.give(store)
        # (any other exception drops the clone too: a request may be half done)
        if outcome is _Outcome.ABORTED:
            raise _aborted_error(where)
        if isinstance(outcome, list):  # this rank timed out and aborted: who was missing
            missing = [participants[i] for i in outcome]
            error = _timeout("arrival", tag, alloc_id, rank, missing, timeout)
            raise HandshakeTimeoutError(f"{error} (TCP store at {self.address})", missing)

    def _meet(self, store: Any, where: _Where, n: int, position: int, deadline: float,
              progress: _Progress) -> _Outcome | list[int]:
        """Arrive, wait, depart: the outcome, or (when this rank timed out and aborted
        the handshake) the participant positions' ranks that had not arrived."""
        full = (1 << n) - 1
        seen = int(store.add(where.arrivals, 1 << position))
        progress.arrived = seen
        if seen & _ABORTED:  # aborted before this arrival: read the release, leave
            return self._depart_decided(store, where, n, progress)
        if seen & full == full:  # the last arrival: released
            return self._release(store, where, n, progress, written=False)
        while True:
            # at least 1 ms: torch reads a zero timeout as "wait for ever"
            left = timedelta(seconds=max(0.001, deadline - time.monotonic()))
            try:
                store.wait([where.release], left)
            except self._store_error:  # a timeout (a lost connection is another error)
                if time.monotonic() >= deadline - 0.001:  # torch rounds to milliseconds
                    return self._give_up(store, where, n, progress)
                continue
            return self._depart(store, where, n, progress)

    def _release(self, store: Any, where: _Where, n: int, progress: _Progress, *,
                 written: bool) -> _Outcome:
        """The last arrival releases the others: GO, counting itself departed (one-way:
        torch's set has no reply), and removes the arrivals key, which nobody adds to
        again (a participant that timed out meanwhile finds it gone: released)."""
        if not written:
            store.set(where.release, str(_GO + 1))  # wakes every waiter
        progress.departed = True
        self._remove(store, where, [where.arrivals, *([where.release] if n == 1 else [])])
        return _Outcome.RELEASED

    def _give_up(self, store: Any, where: _Where, n: int,
                 progress: _Progress) -> _Outcome | list[int]:
        """This rank's deadline passed: abort unless every participant arrived."""
        decision, value = self._abort_unless_complete(store, where, n, progress.arrived)
        outcome = self._depart_decided(store, where, n, progress)
        if decision is _Decision.ABORTED_NOW:
            return [i for i in range(n) if not value >> i & 1]  # positions; mapped below
        return outcome

    def _depart_decided(self, store: Any, where: _Where, n: int,
                        progress: _Progress) -> _Outcome:
        """Depart a handshake known to be decided, once its release is written (its
        author writes it right after deciding)."""
        if not self._release_appears(store, where):
            raise where.error(f"found the handshake decided but no release written within "
                              f"{_GRACE_S:g}s (the rank that decided it died?)")
        return self._depart(store, where, n, progress)

    def _depart(self, store: Any, where: _Where, n: int, progress: _Progress) -> _Outcome:
        """Read the release and count this rank out; the last one out removes the keys."""
        got = int(store.add(where.release, 1))
        progress.departed = True
        outcome = {_GO: _Outcome.RELEASED, _ABORT: _Outcome.ABORTED}.get(got & ~_DEPARTED)
        if outcome is None:
            raise where.error(f"read a release value {got} that no participant writes")
        if got & _DEPARTED == n:  # everyone read it: nobody reads either key again
            # (a released handshake's arrivals key went with its last arrival)
            self._remove(store, where, [where.release, *(
                [where.arrivals] if outcome is _Outcome.ABORTED else [])])
        return outcome

    def _abort_unless_complete(self, store: Any, where: _Where, n: int,
                               known: int | None) -> tuple[_Decision, int]:
        """Set ABORTED on the arrivals key unless every participant arrived (the
        invariant in the module docstring), and write the release if this call set it.

        ``known`` is the key's value as last seen (a compare_set that expects it never
        creates the key); None creates the key if it is missing, so later arrivals are
        refused. Each mismatch reads the value now; values only grow, and by at most one
        arrival per participant, so this ends within N + 2 tries."""
        full = (1 << n) - 1
        expected = "" if known is None else str(known)
        for _ in range(n + 2):
            desired = str(int(expected or "0") | _ABORTED)
            got = store.compare_set(where.arrivals, expected, desired).decode()
            if got == desired:
                # create-only: a release already written stays as it is
                store.compare_set(where.release, "", str(_ABORT))
                return _Decision.ABORTED_NOW, int(expected or "0")
            if got == expected:  # expected a value, the key is missing: deleted
                return _Decision.GONE, full
            value = int(got)
            if value & _ABORTED:
                return _Decision.ABORTED_BEFORE, value
            if value & full == full:
                return _Decision.COMPLETE, value
            expected = got
        raise where.error(f"could not abort: its arrivals key kept changing ({n + 2} tries)")

    def _withdraw(self, where: _Where, n: int, progress: _Progress,
                  exc: Exception) -> _Outcome:
        """The connection failed mid-handshake. On a fresh one, within a few seconds:
        abort unless every participant arrived, then depart as everyone does. A
        handshake that was released releases this rank too (consistency)."""
        if progress.departed:
            raise where.error(f"lost the TCP store after departing, while removing the "
                              f"handshake's keys: {exc}") from exc
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        full = (1 << n) - 1
        arrived = progress.arrived
        try:
            fresh = TCPStore(self.host, self.port, None, False, timedelta(seconds=_GRACE_S),
                             use_libuv=True)
            if arrived is not None and arrived & (full | _ABORTED) == full:
                # this rank was the last arrival: finish releasing (its set may have
                # landed, and then it counts this rank as departed already)
                return self._release(fresh, where, n, progress, written=fresh.check(
                    [where.release]))
            if not fresh.check([where.release]):  # not decided yet, as far as seen
                decision, _ = self._abort_unless_complete(fresh, where, n, arrived)
                if (decision is _Decision.COMPLETE and arrived is None
                        and not self._release_appears(fresh, where)):
                    # its arrival was the last one, and the reply was lost
                    return self._release(fresh, where, n, progress, written=False)
            outcome = self._depart_decided(fresh, where, n, progress)
        except self._dist_error as again:
            log.warning("rank %d could not withdraw from handshake %r of allocation %d: %s",
                        where.rank, where.tag, where.alloc_id, again)
            raise where.error(
                f"lost the TCP store mid-handshake ({exc}) and could not withdraw its "
                f"arrival ({again}): the others may still complete without it. Check the "
                f"store's host (rank 0) and the network") from exc
        if outcome is _Outcome.RELEASED:
            return outcome
        raise where.error(f"lost the TCP store mid-handshake ({exc}); its arrival is "
                          f"withdrawn and the others are told to give up") from exc

    def _release_appears(self, store: Any, where: _Where) -> bool:
        try:
            store.wait([where.release], timedelta(seconds=_GRACE_S))
        except self._store_error:
            return False
        return True

    def _remove(self, store: Any, where: _Where, keys: list[str]) -> None:
        """Delete keys nobody reads again (the failpoint is the leader's in the marker
        backend: here, whoever the protocol makes the last reader)."""
        for key in keys:
            try:
                _REMOVE.hit()
            except OSError as err:
                raise where.error(f"could not remove key {key!r} of the handshake: errno "
                                  f"{err.errno} ({err.strerror})") from err
            store.delete_key(key)

    # -- the Backend protocol's other calls -------------------------------------------
    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        """Abort each handshake that not every participant has reached: a waiter wakes
        at once, a later arrival is refused; one already complete stays complete."""
        with self._lock:
            for tag in tags:
                self._abort_unless_complete(self.store, self._where(tag, alloc_id, rank),
                                            len(participants), None)

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        removed = 0
        for tag in tags:
            where = self._where(tag, alloc_id, -1)
            with self._lock:
                removed += sum(int(self.store.delete_key(k))
                               for k in (where.arrivals, where.release))
        return removed

    def live_markers(self) -> int:
        """Keys of this job now (every delete is answered before its handshake returns)."""
        with self._lock:
            return int(self.store.num_keys())

    def close(self) -> None:
        self._pool.close()
        del self.store


def _aborted_error(where: _Where) -> HandshakeAbortedError:
    return HandshakeAbortedError(f"{_aborted(where.tag, where.alloc_id, where.rank)} "
                                 f"(TCP store at {where.address})")
