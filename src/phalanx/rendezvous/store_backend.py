"""The TCP-store handshake backend: keys in torch's c10d ``TCPStore`` (multi-host).

Rank 0 creates the store (torch's libuv server) and the others join it. Handshakes
use the server's own barrier command, so the release is decided inside the server:
one write and one wake per rank, no round trip between the last arrival and the
release. torch's store-based barrier needs two to three round trips per rank, and
leaves two keys behind per barrier; this leaves none.

Per handshake (alloc id A, tag T), on two connections of the calling thread:

* ``arrive`` sends ``add(mask, 1 << position)`` (who arrived: a timeout names the
  missing) and ``barrier(count, N)`` in one write, then waits for the barrier's wake.
* ``abort`` waits on the rank's abort key of (A, T), which nobody writes unless the
  allocation is aborted: :meth:`StoreBackend.abort` sets it for every participant, so
  a waiter wakes at once and a late arrival finds it set.
* The leader (first participant) deletes ``mask`` and ``count`` once released; the
  delete replies are read before its next request on that connection (nothing can
  overtake them), so the release path has no round trip at all.

Consistency under aborts and timeouts: a rank that gives up (woken by an abort, or at
its deadline) first deletes ``count``, then cancels its wait, and reads what comes
back. A wake before the cancel's reply means the barrier completed before the delete:
every participant was released, so this rank returns success too. Otherwise the count
it contributed is gone, the barrier can never complete, and it raises; so no rank
succeeds where another gave up.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from ._errors import HandshakeError, TokenMismatchError
from .handshake import _PUBLISH, _REMOVE, _aborted, _check, _timeout
from .store_wire import STOP_WAITING, WAIT_CANCELED, StoreWire, WireError, wait_readable

__all__ = ["StoreBackend", "job_prefix"]

_MAX_PARTICIPANTS = 62  # the arrival mask is a signed 64-bit counter
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


@dataclass
class _Pair:
    """A thread's two connections: one waits on the barrier, one on its abort key (a
    connection waits for one thing at a time)."""

    arrive: StoreWire
    abort: StoreWire
    abort_armed: bool = False  # a wait on an abort key is registered: cancel it next time
    busy: threading.Lock = field(default_factory=threading.Lock)  # held by its handshake

    def close(self) -> None:
        self.arrive.close()
        self.abort.close()


@dataclass
class _Connections:
    """One pair per thread that handshakes (tasks of concurrent runs may)."""

    host: str
    port: int
    timeout: float
    local: threading.local = field(default_factory=threading.local)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pairs: list[_Pair] = field(default_factory=list)

    def mine(self) -> _Pair:
        pair: _Pair | None = getattr(self.local, "pair", None)
        if pair is None:
            arrive = StoreWire.connect(self.host, self.port, self.timeout)
            try:
                pair = _Pair(arrive, StoreWire.connect(self.host, self.port, self.timeout))
            except BaseException:
                arrive.close()
                raise
            with self.lock:
                self.pairs.append(pair)
            self.local.pair = pair
        return pair

    def drop(self, pair: _Pair) -> None:
        """A pair whose state is unknown after an error: the next handshake reconnects."""
        with self.lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        self.local.pair = None
        pair.close()

    def settle(self, deadline: float) -> None:
        """Read the owed replies of every pair not in a handshake right now, so the
        deletes they sent have been applied (a pair in one has paid them already, or
        is about to)."""
        with self.lock:
            idle = [p for p in self.pairs if p.busy.acquire(blocking=False)]
        for pair in idle:
            try:
                pair.arrive.pay_debts(deadline)
            finally:
                pair.busy.release()

    def close(self) -> None:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for pair in pairs:
            pair.close()


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
        self._conns = _Connections(host, self.port, timeout)

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
        _PUBLISH.hit()
        try:
            pair = self._conns.mine()
        except WireError as exc:
            raise HandshakeError(f"handshake {tag!r} of allocation {alloc_id}: rank {rank} "
                                 f"cannot reach the TCP store: {exc}") from exc
        with pair.busy:
            self._handshake(pair, keys, tag, alloc_id, participants, rank, timeout, deadline)

    def _handshake(self, pair: _Pair, keys: _Keys, tag: str, alloc_id: int,
                   participants: Sequence[int], rank: int, timeout: float,
                   deadline: float) -> None:
        try:
            released = self._meet(pair, keys, participants, rank, deadline)
            if released is None:  # woken by an abort, and the barrier never completed
                raise _aborted(tag, alloc_id, rank)
            if not released:
                mask = self._peek(pair.arrive, keys.mask, deadline + _GRACE_S)
                missing = [r for i, r in enumerate(participants) if not mask >> i & 1]
                raise _timeout("arrival", tag, alloc_id, rank, missing, timeout)
            if rank == participants[0]:
                _REMOVE.hit()
                pair.arrive.send(StoreWire.delete_req(keys.mask), StoreWire.delete_req(keys.count))
                pair.arrive.owed += 2 * _DELETE_REPLY
        except WireError as exc:
            self._conns.drop(pair)
            raise HandshakeError(f"handshake {tag!r} of allocation {alloc_id}: rank {rank} lost "
                                 f"the TCP store: {exc}") from exc

    def _meet(self, pair: _Pair, keys: _Keys, participants: Sequence[int], rank: int,
              deadline: float) -> bool | None:
        """Arrive and wait: True once released, None if aborted, False at the deadline
        (in both of these, this rank's arrival no longer counts)."""
        arrive, abort = pair.arrive, pair.abort
        arrive.send(StoreWire.add_req(keys.mask, 1 << participants.index(rank)),
                    StoreWire.barrier_req(keys.count, len(participants)))
        arrive.pay_debts(deadline)
        arrive.read_i64(deadline)  # the mask after our arrival: nothing to decide on it
        if wait_readable([arrive], min(deadline, time.monotonic() + _WATCH_ABORTS_AFTER_S)):
            arrive.read_wake(deadline)
            return True
        # Still waiting: watch this handshake's abort key too. An abort *sets* it, so
        # one that came before this wait is seen at once. (A wait still registered by an
        # earlier handshake is cancelled first: a connection waits for one thing.)
        abort.send(*([StoreWire.cancel_wait_req()] if pair.abort_armed else []),
                   StoreWire.wait_req(keys.abort(rank)))
        if pair.abort_armed:
            _read_cancel(abort, deadline)
        pair.abort_armed = True
        ready = wait_readable([arrive, abort], deadline)
        if arrive in ready:
            arrive.read_wake(deadline)
            return True
        if abort in ready:
            abort.read_wake(deadline)
            pair.abort_armed = False  # the wake consumed the wait
            return True if self._give_up(arrive, keys, deadline + _GRACE_S) else None
        return self._give_up(arrive, keys, deadline + _GRACE_S)

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

    @staticmethod
    def _peek(wire: StoreWire, key: str, deadline: float) -> int:
        """A counter's value (0 if missing) without creating it: a ``compare_set`` that
        expects a value no counter holds changes nothing."""
        wire.send(StoreWire.compare_set_req(key, _NO_VALUE, _NO_VALUE))
        got = wire.read_bytes(deadline)
        return 0 if got == _NO_VALUE else int(got)

    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        """Set every participant's abort key (this rank's too): a waiter wakes at once,
        and a later arrival finds its key set and gives up at once."""
        for tag in tags:
            keys = self._keys(alloc_id, tag)
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
        self._conns.settle(time.monotonic() + 30.0)
        return int(self.store.num_keys())

    def close(self) -> None:
        self._conns.close()
        del self.store


def _read_cancel(wire: StoreWire, deadline: float) -> None:
    """The reply to a cancel: a wake that came first (at most one), then the cancel's."""
    got = wire.read(1, deadline)
    if got[0] == STOP_WAITING:
        got += wire.read(1, deadline)
    if got[-1] != WAIT_CANCELED:
        raise WireError(f"the TCP store at {wire.address} answered a cancel with {got!r}")
