"""The TCP-store handshake backend: keys in torch's c10d ``TCPStore`` (multi-host).

Rank 0 creates the store (torch's libuv server) and the others join it. Handshakes
use the server's own barrier command, so the release is decided inside the server:
one write and one wake per rank, no round trip between the last arrival and the
release. torch's store-based barrier needs two to three round trips per rank, and
leaves two keys behind per barrier; this leaves none.

Per handshake (alloc id A, tag T), on a pair of connections taken from a pool:

* ``arrive`` sends ``add(mask, 1 << position)`` (who arrived: a timeout names the
  missing; an abort adds a high bit, which the arrival reads in the reply) and
  ``barrier(count, N)`` in one write, then waits for the barrier's wake.
* ``abort`` waits on the rank's abort key of (A, T), which nobody writes unless the
  handshake is aborted: :meth:`StoreBackend.abort` sets it for every participant, so
  a waiter wakes at once. Only a rank still waiting after 2 ms watches it (two more
  requests that tight loops never pay); the key is set, so it is seen however late.
* The leader (first participant) deletes ``mask`` and ``count`` once released; the
  delete replies are read before its next request on that connection (nothing can
  overtake them), so the release path has no round trip at all.

Consistency under aborts and timeouts: a rank that gives up (aborted, or at its
deadline) first deletes ``count``, then cancels its wait, and reads what comes back.
A wake before the cancel's reply means the barrier completed before the delete: every
participant was released, so this rank returns success too. Otherwise the count it
contributed is gone and the barrier can never complete: it raises, and (at a
deadline) sets the others' abort keys so they give up now rather than at theirs. So
no rank succeeds where another gave up: an aborted handshake refuses its arrivals
unless it completes with them, and then it completes for all. A rank that loses its
connection mid-handshake withdraws through torch's client the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from ._errors import HandshakeError, HandshakeTimeoutError, TokenMismatchError
from .handshake import _REMOVE, _aborted, _check, _timeout, publish_point
from .store_wire import STOP_WAITING, WAIT_CANCELED, StoreWire, WireError, wait_readable

__all__ = ["StoreBackend", "job_prefix"]

log = logging.getLogger("phalanx.rendezvous")

_MAX_PARTICIPANTS = 56  # arrival bits of a signed 64-bit counter, under the abort bits
_ABORTED = 1 << 56  # added to a mask by each abort: room for 127 of them
_NO_VALUE = b"\x00"  # a value no key of ours holds: compare_set with it only reads
_DELETE_REPLY = 8  # bytes: an int64 count
# Most handshakes complete within a few hundred microseconds: only one still waiting
# after this starts watching its abort key, which costs two more requests.
_WATCH_ABORTS_AFTER_S = 0.002
_GRACE_S = 5.0  # for the store's answers once a wait has given up


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


@dataclass(frozen=True)
class _Keys:
    """The keys of one handshake."""

    mask: str
    count: str
    abort_prefix: str

    def abort(self, rank: int) -> str:
        return f"{self.abort_prefix}/{rank}"

    def wake_others(self, participants: Sequence[int], rank: int) -> list[bytes]:
        """Requests that set every other participant's abort key (one-way)."""
        return [StoreWire.set_req(self.abort(r), b"1") for r in participants if r != rank]


@dataclass
class _Pair:
    """Two connections: one waits on the barrier, one on the abort key (a connection
    waits for one thing at a time)."""

    arrive: StoreWire
    abort: StoreWire
    abort_armed: bool = False  # a wait on an abort key is registered: cancel it next time

    def close(self) -> None:
        self.arrive.close()
        self.abort.close()


@dataclass
class _Pool:
    """Idle pairs. A handshake takes one (or connects a new one) and gives it back, so
    pairs scale with concurrent handshakes (tasks of concurrent runs), not threads. A
    pair whose state is unknown after an error is dropped, never given back."""

    host: str
    port: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle: list[_Pair] = field(default_factory=list)
    closed: bool = False

    def take(self, deadline: float) -> _Pair:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        timeout = max(0.001, deadline - time.monotonic())
        arrive = StoreWire.connect(self.host, self.port, timeout)
        try:
            timeout = max(0.001, deadline - time.monotonic())
            return _Pair(arrive, StoreWire.connect(self.host, self.port, timeout))
        except BaseException:
            arrive.close()
            raise

    def give(self, pair: _Pair) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(pair)
                return
        pair.close()

    def settle(self, deadline: float) -> None:
        """Read the owed replies of the idle pairs, so the deletes they sent have been
        applied (a pair in a handshake has read its own before anything else)."""
        with self.lock:
            pairs, self.idle = self.idle, []
        error: BaseException | None = None
        for pair in pairs:
            if error is None:
                try:
                    pair.arrive.pay_debts(deadline)
                except BaseException as exc:  # noqa: BLE001  raised once the rest are back
                    pair.close()
                    error = exc
                    continue
            self.give(pair)
        if error is not None:
            raise error

    def close(self) -> None:
        """Close the idle pairs; one in a handshake closes when given back."""
        with self.lock:
            self.closed = True
            pairs, self.idle = self.idle, []
        for pair in pairs:
            pair.close()


@dataclass(frozen=True)
class _Aborted:
    """Woken by an abort (or refused at arrival), and the barrier did not complete."""


@dataclass(frozen=True)
class _TimedOut:
    mask: int  # arrivals when this rank gave up


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
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        self.prefix = job_prefix(token, generation)
        # libuv: its server has the barrier command the handshake is built on
        with _normal_scheduling():  # the server thread takes its creator's policy
            self.store = TCPStore(host, port, None, is_master, timedelta(seconds=timeout),
                                  wait_for_workers=False, use_libuv=True)
        self.port = int(self.store.port)
        job_key = f"{self.prefix}/job"
        if is_master:
            self.store.set(job_key, "1")
        elif not self.store.check([job_key]):
            raise TokenMismatchError(
                f"the TCP store at {host}:{port} holds no job for this job token and generation "
                f"{generation}: refused. Check PHALANX_JOB_TOKEN and the store address")
        self._pool = _Pool(host, self.port)
        # one pair now: the server resolves each new peer's name as it accepts it,
        # which is better paid at start-up than inside a handshake
        self._pool.give(self._pool.take(time.monotonic() + timeout))

    def _keys(self, alloc_id: int, tag: str) -> _Keys:
        base = f"{self.prefix}/hs/{alloc_id}/{tag}"
        return _Keys(f"{base}/mask", f"{base}/count", f"{base}/abort")

    def handshake(self, tag: str, alloc_id: int, participants: Sequence[int], rank: int,
                  timeout: float) -> None:
        _check(tag, participants, rank)
        if len(participants) > _MAX_PARTICIPANTS:
            raise HandshakeError(f"the store backend handshakes at most {_MAX_PARTICIPANTS} "
                                 f"participants, not {len(participants)}")
        keys = self._keys(alloc_id, tag)
        deadline = time.monotonic() + timeout
        publish_point(tag, alloc_id, rank)
        try:
            pair = self._pool.take(deadline)
        except WireError as exc:
            raise HandshakeError(f"handshake {tag!r} of allocation {alloc_id}: rank {rank} "
                                 f"cannot reach the TCP store: {exc}") from exc
        try:
            outcome = self._meet(pair, keys, participants, rank, deadline)
            if outcome is True and rank == participants[0]:
                self._remove(pair, keys, tag, alloc_id, rank)
        except BaseException as exc:
            pair.close()  # its replies are out of step now: never reused
            if isinstance(exc, WireError):
                withdrawn = self._withdraw(keys, participants, rank)
                raise HandshakeError(
                    f"handshake {tag!r} of allocation {alloc_id}: rank {rank} lost the TCP "
                    f"store mid-handshake ({exc}); " + (
                        "its arrival is withdrawn and the others are told to give up (had "
                        "every participant arrived before, they were released)" if withdrawn
                        else "its arrival could not be withdrawn either: the others may "
                        "still complete the handshake without it. Check the store's host "
                        "(rank 0) and the network")) from exc
            raise
        self._pool.give(pair)
        if isinstance(outcome, _Aborted):
            raise _aborted(tag, alloc_id, rank)
        if isinstance(outcome, _TimedOut):
            if outcome.mask >= _ABORTED:
                raise _aborted(tag, alloc_id, rank)
            missing = [r for i, r in enumerate(participants) if not outcome.mask >> i & 1]
            if missing:
                raise _timeout("arrival", tag, alloc_id, rank, missing, timeout)
            raise HandshakeTimeoutError(
                f"handshake {tag!r} of allocation {alloc_id}: rank {rank} waited {timeout:g}s "
                f"at arrival; every participant arrived, but one gave up before the last "
                f"one came (its own error names why)", [])

    @staticmethod
    def _remove(pair: _Pair, keys: _Keys, tag: str, alloc_id: int, rank: int) -> None:
        """The leader, released: delete the handshake's keys (replies read later)."""
        try:
            _REMOVE.hit()
        except OSError as err:
            raise HandshakeError(
                f"rank {rank} (leader) could not remove the keys of handshake {tag!r} of "
                f"allocation {alloc_id}: errno {err.errno} ({err.strerror})") from err
        pair.arrive.send(StoreWire.delete_req(keys.mask), StoreWire.delete_req(keys.count))
        pair.arrive.owed += 2 * _DELETE_REPLY

    def _meet(self, pair: _Pair, keys: _Keys, participants: Sequence[int], rank: int,
              deadline: float) -> Literal[True] | _Aborted | _TimedOut:
        """Arrive and wait: True once released; otherwise this rank's arrival no longer
        counts, and the others are told to give up too."""
        arrive, abort = pair.arrive, pair.abort
        arrive.send(StoreWire.add_req(keys.mask, 1 << participants.index(rank)),
                    StoreWire.barrier_req(keys.count, len(participants)))
        grace = max(deadline, time.monotonic()) + _GRACE_S  # replies due at once
        arrive.pay_debts(grace)
        if arrive.read_i64(grace) >= _ABORTED:  # aborted before this arrival
            return True if self._give_up(arrive, keys, grace) else _Aborted()
        if wait_readable([arrive], min(deadline, time.monotonic() + _WATCH_ABORTS_AFTER_S)):
            arrive.read_wake(grace)
            return True
        # Still waiting: watch this handshake's abort key too. An abort *sets* it, so
        # one that came before this wait is seen at once. (A wait still registered by an
        # earlier handshake is cancelled first: a connection waits for one thing.)
        abort.send(*([StoreWire.cancel_wait_req()] if pair.abort_armed else []),
                   StoreWire.wait_req(keys.abort(rank)))
        if pair.abort_armed:
            _read_cancel(abort, grace)
        pair.abort_armed = True
        ready = wait_readable([arrive, abort], deadline)
        grace = max(deadline, time.monotonic()) + _GRACE_S
        if arrive in ready:
            arrive.read_wake(grace)
            return True
        if abort in ready:
            abort.read_wake(grace)
            pair.abort_armed = False  # the wake consumed the wait
            return True if self._give_up(arrive, keys, grace) else _Aborted()
        if self._give_up(arrive, keys, grace):
            return True
        # the barrier cannot complete now: wake the others rather than let them wait
        arrive.send(*keys.wake_others(participants, rank))
        return _TimedOut(self._peek(arrive, keys.mask, grace))

    @staticmethod
    def _give_up(arrive: StoreWire, keys: _Keys, deadline: float) -> bool:
        """Delete the count, then cancel the wait: True if the barrier completed first."""
        arrive.send(StoreWire.delete_req(keys.count), StoreWire.cancel_wait_req())
        head = arrive.read(_DELETE_REPLY + 1, deadline)
        if head[-1] == WAIT_CANCELED:  # [delete reply][canceled]: no wake came
            return False
        # [wake][delete reply ... ] (the delete reply's last byte is 0): read the rest
        if head[0] != STOP_WAITING or arrive.read(1, deadline)[0] != WAIT_CANCELED:
            raise WireError(f"the TCP store at {arrive.address} answered a cancel with "
                            f"{head!r}")
        return True

    def _withdraw(self, keys: _Keys, participants: Sequence[int], rank: int) -> bool:
        """After losing the connection mid-handshake, on a fresh one: take every arrival
        back (the barrier can no longer complete) and wake the others. Best effort,
        within a few seconds: if the store is gone, so is the handshake."""
        deadline = time.monotonic() + _GRACE_S
        try:
            wire = StoreWire.connect(self._pool.host, self._pool.port, _GRACE_S)
            try:
                wire.send(StoreWire.delete_req(keys.count), *keys.wake_others(participants, rank))
                wire.read_i64(deadline)
            finally:
                wire.close()
        except WireError as exc:
            log.warning("rank %d could not withdraw from handshake %s: %s", rank, keys.count,
                        exc)
            return False
        return True

    @staticmethod
    def _peek(wire: StoreWire, key: str, deadline: float) -> int:
        """A counter's value (0 if missing) without creating it: a ``compare_set`` that
        expects a value no counter holds changes nothing."""
        wire.send(StoreWire.compare_set_req(key, _NO_VALUE, _NO_VALUE))
        got = wire.read_bytes(deadline)
        return 0 if got == _NO_VALUE else int(got)

    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        """Mark each handshake aborted in its mask (an arrival reads it in the reply it
        waits for anyway) and set every participant's abort key (a waiter wakes at once).
        A rank refused this way gives up as at a timeout, so an arrival still completes
        the handshake if it completes the barrier first: then every participant is
        released, never only some."""
        for tag in tags:
            keys = self._keys(alloc_id, tag)
            self.store.add(keys.mask, _ABORTED)
            for r in participants:
                self.store.set(keys.abort(r), "1")

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        removed = 0
        for tag in tags:
            keys = self._keys(alloc_id, tag)
            names = [keys.mask, keys.count, *(keys.abort(r) for r in participants)]
            removed += sum(int(self.store.delete_key(k)) for k in names)
        return removed

    def live_markers(self) -> int:
        """Keys of this job now, once every delete this rank sent has been applied."""
        self._pool.settle(time.monotonic() + 30.0)
        return int(self.store.num_keys())

    def close(self) -> None:
        self._pool.close()
        del self.store


def _read_cancel(wire: StoreWire, deadline: float) -> None:
    """The reply to a cancel: a wake that came first (at most one), then the cancel's."""
    got = wire.read(1, deadline)
    if got[0] == STOP_WAITING:
        got += wire.read(1, deadline)
    if got[-1] != WAIT_CANCELED:
        raise WireError(f"the TCP store at {wire.address} answered a cancel with {got!r}")
