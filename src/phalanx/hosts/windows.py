"""One-sided access to a window on another host: a window server per member rank.

A domain's view is one-sided: ``put`` writes into a peer's window and ``get`` reads from
it without the peer's task taking part. On one host that is shared memory; across hosts
each member of a domain runs a :class:`WindowServer` (a listening socket on its host's
job address, a thread per connected peer) that applies peers' puts and answers their
gets against its window, and reaches each remote peer through a :class:`WindowClient`.

Wire: a fixed binary header (``op``, ``offset``, ``nbytes``) and the raw bytes, nothing
else: typed, fixed-shape, nothing decoded but integers and payload. A connection starts
with proofs of the job token both ways (HMAC-SHA256 over the other side's fresh nonce,
the domain's id and the caller's rank), so a process without the token can neither
read or write a window nor pose as a member's server (its address comes from the
unauthenticated store). A client whose request failed part-way is closed, never reused:
its stream would be out of step.
A put is answered once its bytes are in the window, so after ``put`` returns (and a
barrier) the peer's task sees them, as with shared memory.

Why not gloo's send/recv: a one-sided get needs the target to answer while its own task
does something else; gloo's point-to-point ops need both sides to post them.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator

__all__ = ["WindowClient", "WindowError", "WindowServer"]

_HEAD = struct.Struct(">BQQ")  # op, offset, nbytes
_ACK = struct.Struct(">BQ")  # status, nbytes (of the reply's payload, or of the message)
_PUT, _GET = 1, 2
_OK, _REFUSED = 0, 1
_NONCE = 32
_MAX_MESSAGE = 64 << 10  # a refusal's text; more is not a phalanx peer
_SEND_CHUNK = 16 << 20  # a put's bytes go in chunks: the timeout then bounds progress


class WindowError(ConnectionError):
    """A window server refused a request, or the connection to it broke."""


def _proof(token: str, side: bytes, nonce: bytes, domain_id: int, rank: int) -> bytes:
    body = b"window|%s|%d|%d|" % (side, domain_id, rank) + nonce
    return hmac.new(token.encode(), body, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, out: memoryview) -> None:
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_exact(sock, memoryview(buf))
    return bytes(buf)


class WindowServer:
    """Serves one member's window to the domain's other members; see the module
    docstring. ``close`` stops accepting, closes every connection and joins every
    thread."""

    def __init__(self, window: memoryview, addr: str, token: str, domain_id: int,
                 members: list[int], describe: Callable[[], str]) -> None:
        self._window = window
        self._token, self._domain_id, self._members = token, domain_id, set(members)
        self._describe = describe
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._listener = socket.create_server((addr, 0), backlog=len(members) + 4)
        self.address = f"{addr}:{self._listener.getsockname()[1]}"
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name=f"phalanx-window-{domain_id}")
        self._accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name=f"phalanx-window-{self._domain_id}-peer")
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
                self._threads.append(t)
            try:
                t.start()
            except RuntimeError:  # no thread to be had: refuse this peer, keep serving
                self._forget(conn, t)
                conn.close()

    def _forget(self, conn: socket.socket, thread: threading.Thread) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
            if thread in self._threads:
                self._threads.remove(thread)

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)  # the handshake's deadline
            nonce = os.urandom(_NONCE)
            conn.sendall(nonce)
            head = _read(conn, 8 + 32 + _NONCE)
            rank, proof, theirs = struct.unpack(">q", head[:8])[0], head[8:40], head[40:]
            if rank not in self._members or not hmac.compare_digest(
                    proof, _proof(self._token, b"client", nonce, self._domain_id, rank)):
                msg = (f"refused: {self._describe()} serves members {sorted(self._members)} "
                       f"holding the job's token").encode()
                conn.sendall(_ACK.pack(_REFUSED, len(msg)) + msg)
                return
            conn.sendall(_ACK.pack(_OK, 32) +
                         _proof(self._token, b"server", theirs, self._domain_id, rank))
            conn.settimeout(None)  # requests come when the peer's task sends them
            while True:
                op, offset, nbytes = _HEAD.unpack(_read(conn, _HEAD.size))
                if offset + nbytes > len(self._window) or op not in (_PUT, _GET):
                    # the view checks bounds before it sends: this is not a phalanx peer
                    # of this version, and what follows the header cannot be trusted
                    msg = (f"{self._describe()}: op {op} [{offset}, {offset + nbytes}) is "
                           f"outside its {len(self._window)}-byte window").encode()
                    conn.sendall(_ACK.pack(_REFUSED, len(msg)) + msg)
                    return
                if op == _PUT:
                    _read_exact(conn, self._window[offset:offset + nbytes])
                    conn.sendall(_ACK.pack(_OK, 0))
                else:
                    conn.sendall(_ACK.pack(_OK, nbytes))
                    conn.sendall(self._window[offset:offset + nbytes])
        except (OSError, ValueError):
            return  # the peer went away, or close() shut this connection (and the window)
        finally:
            conn.close()
            self._forget(conn, threading.current_thread())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its thread
        self._accepter.join(10)
        for t in threads:
            t.join(10)
        self._window.release()


class WindowClient:
    """This rank's connection to one remote member's window (one request at a time)."""

    def __init__(self, address: str, token: str, domain_id: int, rank: int,
                 peer: str, timeout: float) -> None:
        self.peer = peer  # for errors: "domain rank 2 (rank 2, 10.77.0.3:40123)"
        host, port = address.rsplit(":", 1)
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise WindowError(f"cannot reach the window of {peer}: {exc}") from exc
        self.broken: str | None = None
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            mine = os.urandom(_NONCE)
            with self._request("the handshake with"):
                nonce = _read(self._sock, _NONCE)
                self._sock.sendall(struct.pack(">q", rank) +
                                   _proof(token, b"client", nonce, domain_id, rank) + mine)
                if self._ack() != 32 or not hmac.compare_digest(
                        _read(self._sock, 32), _proof(token, b"server", mine, domain_id, rank)):
                    raise WindowError(f"{peer} did not prove the job's token: not this "
                                      f"job's member (a stale address in the store?)")
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(timeout)  # every request's deadline

    @contextlib.contextmanager
    def _request(self, what: str) -> Iterator[None]:
        """One request's errors as WindowError naming the peer; after any failure the
        connection is closed for good (a torn request leaves the stream out of step)."""
        if self.broken is not None:
            raise WindowError(f"the connection to the window of {self.peer} is closed: "
                              f"{self.broken}")
        try:
            yield
        except BaseException as exc:
            self.broken = f"{what} failed: {exc}"
            self.close()
            if isinstance(exc, WindowError):
                raise
            if isinstance(exc, TimeoutError):
                raise WindowError(f"{what} {self.peer}: no answer within "
                                  f"{self._sock.gettimeout()}s") from exc
            if isinstance(exc, (OSError, ValueError, struct.error)):
                raise WindowError(f"{what} {self.peer} failed: {exc}") from exc
            raise

    def _ack(self) -> int:
        status, n = _ACK.unpack(_read(self._sock, _ACK.size))
        if status != _OK:
            raise WindowError(_read(self._sock, min(n, _MAX_MESSAGE)).decode(errors="replace"))
        return int(n)

    def put(self, offset: int, data: memoryview) -> None:
        with self._lock, self._request("writing into the window of"):
            self._sock.sendall(_HEAD.pack(_PUT, offset, len(data)))
            for at in range(0, len(data), _SEND_CHUNK):
                self._sock.sendall(data[at:at + _SEND_CHUNK])
            self._ack()

    def get_into(self, offset: int, out: memoryview) -> None:
        with self._lock, self._request("reading the window of"):
            self._sock.sendall(_HEAD.pack(_GET, offset, len(out)))
            self._ack()
            _read_exact(self._sock, out)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
