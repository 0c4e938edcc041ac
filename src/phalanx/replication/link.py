"""One replication link: rank 0's end of the TCP connection to one peer.

Flow control, not failure. At most ``window`` ops are in flight (sent, not acked); the
rest wait in ``pending``, whose size is bounded by what the deciders put there: the
maintenance lane only decides a job while every link has room (leader.py), so pending
only ever holds request-lane ops and the evictions one store needed. A full window is
"wait", never "broken" (the incident in docs/architecture.md; regression test
``test_replication_incident.py::test_recovered_chain_needs_maintenance_everywhere``).

Real faults fail, once, with one error that every waiter sees: the connection closed
(LinkClosedError), the peer reported an error (PeerJobError), or the peer acked nothing
for ``job_timeout`` seconds while ops were outstanding (LinkStalledError). A peer that
pauses for less than the timeout only costs latency.

Threads: a writer (pending -> socket, as credits allow; batches frames into one send)
and a reader (acks -> credits; the progress watchdog). Both exit at close or failure.
"""

from __future__ import annotations

import collections
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence

from phalanx.kvstore.maintenance import Job
from phalanx.lifecycle.failpoints import Failpoint

from ._errors import (
    LinkAuthError,
    LinkClosedError,
    LinkStalledError,
    PeerJobError,
    ReplicationError,
)
from .frames import (
    PROTOCOL_VERSION,
    Ack,
    Challenge,
    Frame,
    FrameReader,
    Hello,
    JobOp,
    RecordSet,
    Refused,
    Welcome,
    encode,
    proof,
)

__all__ = ["PeerLink", "accept_peer", "connect_leader", "listen"]

_FP_CONNECT = Failpoint("cache.link.connect", "a peer is about to connect to rank 0")
_FP_SEND = Failpoint("cache.link.send", "rank 0's link writer is about to send a batch")
_WATCH_S = 0.2  # reader wake-up: how late a stall or a close is noticed


def listen(host: str = "127.0.0.1") -> socket.socket:
    """Rank 0's listening socket on an ephemeral port (127.0.0.1 unless told otherwise)."""
    sock = socket.create_server((host, 0), backlog=64)
    sock.set_inheritable(False)
    return sock


def _read_until(reader: FrameReader, deadline: float, what: str) -> Frame:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LinkStalledError(f"{reader.who}: no {what} within the connect deadline")
        reader.sock.settimeout(min(left, _WATCH_S))
        frame = reader.read()
        if frame is not None:
            return frame


def accept_peer(listener: socket.socket, token: str, expected: set[int], deadline: float,
                cancelled: threading.Event | None = None,
                ) -> tuple[int, str, socket.socket, FrameReader, RecordSet]:
    """Accept and authenticate one peer; returns (rank, host, socket, reader, records).

    A connection that fails the proof is refused with a reason and raises
    LinkAuthError: a job whose peers disagree on the token cannot start. ``cancelled``
    set (a peer's own open failed: its error is the news) ends the wait at once with
    LinkClosedError.
    """
    while True:
        left = deadline - time.monotonic()
        if cancelled is not None and cancelled.is_set():
            raise LinkClosedError(
                f"rank 0: stopped waiting for peers {sorted(expected)}: the open was "
                "cancelled (a peer's own open failed)")
        if left <= 0:
            raise LinkStalledError(
                f"rank 0: peers {sorted(expected)} did not connect before the deadline; "
                "check that they started and can reach rank 0's bind address")
        listener.settimeout(min(left, _WATCH_S))
        try:
            sock, addr = listener.accept()
            break
        except TimeoutError:
            continue
    who = f"connection from {addr[0]}:{addr[1]}"
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = FrameReader(sock, who)
        nonce = secrets.token_bytes(16)
        sock.sendall(encode(Challenge(PROTOCOL_VERSION, nonce)))
        hello = _read_until(reader, deadline, "HELLO")
        if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
            raise LinkAuthError(f"rank 0: {who} sent {type(hello).__name__}, not a HELLO of "
                                f"protocol version {PROTOCOL_VERSION}")
        reader.who = f"peer rank {hello.rank} on {hello.host}"
        good = proof(token, "peer", nonce, hello.rank)
        if not secrets.compare_digest(good, hello.mac) or hello.rank not in expected:
            reason = ("its job-token proof does not match" if hello.rank in expected else
                      f"rank {hello.rank} is not an expected peer {sorted(expected)}")
            sock.sendall(encode(Refused(f"rank 0 refused rank {hello.rank}: {reason}")))
            raise LinkAuthError(
                f"rank 0 refused peer rank {hello.rank} on {hello.host} ({who}): {reason}; "
                "every rank must run with the same job token (the same Worker)"
            )
        sock.sendall(encode(Welcome(proof(token, "leader", hello.nonce, hello.rank))))
        records = _read_until(reader, deadline, "record set")
        if not isinstance(records, RecordSet):
            raise LinkAuthError(f"rank 0: {reader.who} sent {type(records).__name__} "
                                "instead of its record set")
        return hello.rank, hello.host, sock, reader, records
    except BaseException:  # the socket is ours until returned: close it on any failure
        sock.close()
        raise


def connect_leader(host: str, port: int, rank: int, token: str, my_host: str,
                   records: RecordSet, deadline: float) -> tuple[socket.socket, FrameReader]:
    """A peer's side of the handshake: prove the token, check rank 0's proof, send the
    record set. Raises LinkAuthError when refused (the reason names the cause)."""
    _FP_CONNECT.hit()
    who = f"rank 0 at {host}:{port}"
    try:
        left = max(0.01, deadline - time.monotonic())
        sock = socket.create_connection((host, port), timeout=left)
    except OSError as exc:
        raise LinkClosedError(f"peer rank {rank}: cannot connect to {who} ({exc})") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = FrameReader(sock, who)
        challenge = _read_until(reader, deadline, "challenge")
        if not isinstance(challenge, Challenge):
            raise LinkAuthError(f"peer rank {rank}: {who} did not open with a challenge")
        nonce = secrets.token_bytes(16)
        mac = proof(token, "peer", challenge.nonce, rank)
        sock.sendall(encode(Hello(PROTOCOL_VERSION, rank, my_host, nonce, mac)))
        answer = _read_until(reader, deadline, "welcome")
        if isinstance(answer, Refused):
            raise LinkAuthError(f"peer rank {rank}: refused at connect by {who}: "
                                f"{answer.reason}")
        if not isinstance(answer, Welcome) or not secrets.compare_digest(
            answer.mac, proof(token, "leader", nonce, rank)
        ):
            raise LinkAuthError(f"peer rank {rank}: {who} failed to prove the job token; "
                                "not a rank of this job")
        sock.sendall(encode(records))
        return sock, reader
    except BaseException:  # ours until returned
        sock.close()
        raise


class PeerLink:
    """Rank 0's end of the link to peer ``rank``. See the module docstring."""

    def __init__(self, rank: int, host: str, sock: socket.socket, reader: FrameReader,
                 window: int, job_timeout: float) -> None:
        self.rank = rank
        self.host = host
        self.window = window
        self.job_timeout = job_timeout
        self._sock = sock
        self._reader = reader
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # callers waiting for acks or room
        self._wcond = threading.Condition(lock)  # the writer waiting for work/credits
        self._writer_idle = False
        # Invariant: seqs in _inflight < seqs in _pending; both ascending; len(_inflight)
        # <= window; acked < every seq in either.
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque()
        self._inflight: collections.deque[tuple[int, float]] = collections.deque()
        self._next_seq = 1
        self.acked = 0
        self._replies: dict[int, Ack] = {}
        self._want: set[int] = set()  # seqs whose Ack a caller reads (load crc, digest)
        self._last_ack = time.monotonic()
        self._error: ReplicationError | None = None
        self.error_raised = False  # a caller has seen _error (close reports it otherwise)
        self._failed_op: int | None = None  # the first op a peer reported failed
        self._closing = False
        self.sent = 0
        self._threads = [
            threading.Thread(target=self._write_loop, name=f"phalanx-link-w{rank}", daemon=True),
            threading.Thread(target=self._read_loop, name=f"phalanx-link-r{rank}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- callers -----------------------------------------------------------------------
    def submit(self, make: Callable[[int], Frame], want_reply: bool = False) -> int:
        """Queue the op ``make(seq)``; never blocks (the deciders bound what they queue)."""
        with self._cond:
            self._raise_if_failed()
            seq = self._next_seq
            self._next_seq += 1
            if want_reply:
                self._want.add(seq)
            self._pending.append((seq, encode(make(seq))))
            self._wake_writer_locked()
            return seq

    def submit_jobs(self, jobs: Sequence[Job]) -> None:
        """Queue one JobOp per job, in order, under one lock and one writer wake-up."""
        if not jobs:
            return
        with self._cond:
            self._raise_if_failed()
            seq = self._next_seq
            self._next_seq += len(jobs)
            self._pending.extend((seq + i, encode(JobOp(seq + i, job)))
                                 for i, job in enumerate(jobs))
            self._wake_writer_locked()

    def _wake_writer_locked(self) -> None:
        if self._writer_idle and len(self._inflight) < self.window:
            self._writer_idle = False
            self._wcond.notify()

    def queued_through(self) -> int:
        """The seq of the last op queued (0: none yet)."""
        with self._cond:
            return self._next_seq - 1

    def room(self) -> int:
        """Credits not taken by in-flight or pending ops (may be negative)."""
        with self._cond:
            self._raise_if_failed()
            return self.window - len(self._inflight) - len(self._pending)

    def wait(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (under the link's lock) until ``predicate()`` or the link fails."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not predicate():
                self._raise_if_failed()
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(_WATCH_S if left is None else min(left, _WATCH_S))
            return True

    def wait_acked(self, seq: int, timeout: float | None = None) -> bool:
        """Until the peer acked ``seq``; raises the link's error if it failed meanwhile
        (an ack that reported a failed op acks it, and fails the link: its caller must
        learn it now, not at close). No deadline is needed for safety: a peer that stops
        progressing fails the link within job_timeout, which wakes this wait."""
        done = self.wait(lambda: self.acked >= seq, timeout)
        with self._cond:
            # only a failure of an op up to seq: a peer that closed after acking all of
            # them (its orderly close after BYE) did nothing wrong
            if self._failed_op is not None and self._failed_op <= seq:
                self._raise_if_failed()
        return done

    def reply(self, seq: int) -> Ack:
        self.wait_acked(seq)
        with self._cond:
            return self._replies.pop(seq)

    def outstanding(self) -> tuple[int, int]:
        with self._cond:
            return len(self._inflight), len(self._pending)

    @property
    def error(self) -> ReplicationError | None:
        return self._error

    def describe(self) -> str:
        with self._cond:
            return self._describe_locked()

    def _describe_locked(self) -> str:
        now = time.monotonic()
        oldest = f"{now - self._inflight[0][1]:.1f}s" if self._inflight else "none"
        return (f"peer rank {self.rank} on {self.host}: {len(self._inflight)} outstanding "
                f"and {len(self._pending)} pending jobs, oldest outstanding {oldest}")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self.error_raised = True
            raise self._error

    def _fail(self, error: ReplicationError) -> None:
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            self._cond.notify_all()
            self._wcond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a writer blocked in sendall
        except OSError:
            pass  # already disconnected: nothing to wake

    def close(self, timeout: float) -> None:
        """Stop both threads and close the socket (the caller drained and said BYE).
        Raises ReplicationError naming the threads that did not exit within ``timeout``;
        then the socket stays open, owed: a retry joins them again."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._wcond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a writer blocked in sendall
        except OSError:
            pass  # the peer closed first
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise ReplicationError(
                f"replication link to peer rank {self.rank} on {self.host}: threads "
                f"{stuck} did not exit within {timeout:.1f}s; the socket stays open until a "
                "retry")
        self._sock.close()

    # -- threads -----------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing and self._error is None and not (
                    self._pending and len(self._inflight) < self.window
                ):
                    self._writer_idle = True
                    self._wcond.wait()
                self._writer_idle = False
                if self._closing or self._error is not None:
                    return
                batch: list[bytes] = []
                now = time.monotonic()
                while self._pending and len(self._inflight) < self.window:
                    seq, data = self._pending.popleft()
                    self._inflight.append((seq, now))
                    batch.append(data)
            try:
                _FP_SEND.hit()
                self._sock.sendall(b"".join(batch))
                self.sent += len(batch)
            except OSError as exc:
                self._fail(LinkClosedError(
                    f"replication link to {self.describe()}: send failed ({exc}); the peer "
                    "process died or closed its end; restart the job to reconcile"))
                return
            except Exception as exc:  # noqa: BLE001  this side failed: fail the link, saying so
                # (a writer that died of it silently left callers waiting out job_timeout
                # for a LinkStalledError that blamed the peer: test_failpoint_sweep.py)
                error = LinkClosedError(
                    f"rank 0: the writer of the replication link to {self.describe()} "
                    f"failed on this side ({type(exc).__name__}: {exc}); the link is "
                    "closed; restart the job to reconcile")
                error.__cause__ = exc
                self._fail(error)
                return

    def _read_loop(self) -> None:
        self._sock.settimeout(_WATCH_S)
        while True:
            try:
                frame = self._reader.read()
            except ReplicationError as exc:
                if not self._closing:
                    self._fail(type(exc)(
                        f"replication link to {self.describe()}: {exc}; the peer died or "
                        "closed its end; restart the job to reconcile its directory"))
                return
            stalled: LinkStalledError | None = None
            with self._cond:
                if self._closing or self._error is not None:
                    return
                now = time.monotonic()
                if frame is None:
                    since = max(self._last_ack, self._inflight[0][1]) if self._inflight else now
                    if now - since > self.job_timeout:
                        stalled = LinkStalledError(
                            f"replication link to {self._describe_locked()}: no progress for "
                            f"{now - since:.1f}s (job_timeout {self.job_timeout}s); the peer "
                            "is hung or paused; check its process, or raise job_timeout")
                elif isinstance(frame, Ack):  # peers send only acks after the handshake
                    self._on_ack_locked(frame, now)
            if stalled is not None:
                # Fail like a closed connection: shut the socket down too, so a writer
                # blocked in sendall on the hung peer's full buffer wakes and exits (the
                # SIGSTOP hang: test_replication_hung.py).
                self._fail(stalled)
                return

    def _on_ack_locked(self, ack: Ack, now: float) -> None:
        while self._inflight and self._inflight[0][0] <= ack.seq:
            self._inflight.popleft()
        self.acked = max(self.acked, ack.seq)
        self._last_ack = now
        if ack.seq in self._want:
            self._want.discard(ack.seq)
            self._replies[ack.seq] = ack
        if ack.error and self._failed_op is None:
            self._failed_op = ack.seq
        if ack.error and self._error is None:
            self._error = PeerJobError(
                f"replication link to {self._describe_locked()}: the peer failed op "
                f"{ack.seq}: {ack.error}; its directory may differ from rank 0's; restart "
                "the job to reconcile")
            self._wcond.notify_all()
        self._cond.notify_all()
        if self._pending:
            self._wake_writer_locked()
