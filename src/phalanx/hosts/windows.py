"""One-sided access to a window on another host: a window server per member rank.

A domain's view is one-sided: ``put`` writes into a peer's window and ``get`` reads from
it without the peer's task taking part. On one host that is shared memory; across hosts
each member of a domain runs a :class:`WindowServer` (a listening socket on its host's
job address, a thread per connected peer) that applies peers' puts and answers their
gets against its window, and reaches each remote peer through a :class:`WindowClient`.

Wire: a fixed binary header (``op``, ``offset``, ``nbytes``) and the raw bytes, nothing
else: typed, fixed-shape, nothing decoded but integers and payload. A connection starts
with the job token's proof (HMAC-SHA256 over the server's fresh nonce, the domain's id
and the caller's rank), so a process without the token cannot read or write a window.
A put is answered once its bytes are in the window, so after ``put`` returns (and a
barrier) the peer's task sees them, as with shared memory.

Why not gloo's send/recv: a one-sided get needs the target to answer while its own task
does something else; gloo's point-to-point ops need both sides to post them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable

__all__ = ["WindowClient", "WindowError", "WindowServer"]

_HEAD = struct.Struct(">BQQ")  # op, offset, nbytes
_ACK = struct.Struct(">BQ")  # status, nbytes (of the reply's payload, or of the message)
_PUT, _GET = 1, 2
_OK, _REFUSED = 0, 1
_NONCE = 32


class WindowError(ConnectionError):
    """A window server refused a request, or the connection to it broke."""


def _proof(token: str, nonce: bytes, domain_id: int, rank: int) -> bytes:
    body = b"window|%d|%d|" % (domain_id, rank) + nonce
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
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name=f"phalanx-window-{self._domain_id}-peer")
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)  # the handshake's deadline
            nonce = os.urandom(_NONCE)
            conn.sendall(nonce)
            rank, proof = struct.unpack(">q", _read(conn, 8))[0], _read(conn, 32)
            if rank not in self._members or not hmac.compare_digest(
                    proof, _proof(self._token, nonce, self._domain_id, rank)):
                msg = (f"refused: {self._describe()} serves members {sorted(self._members)} "
                       f"holding the job's token").encode()
                conn.sendall(_ACK.pack(_REFUSED, len(msg)) + msg)
                return
            conn.sendall(_ACK.pack(_OK, 0))
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
        except OSError:
            return  # the peer went away, or close() shut this connection
        finally:
            conn.close()

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
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = _read(self._sock, _NONCE)
            self._sock.sendall(struct.pack(">q", rank) + _proof(token, nonce, domain_id, rank))
            self._ack()
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(timeout)  # every request's deadline

    def _ack(self) -> int:
        try:
            status, n = _ACK.unpack(_read(self._sock, _ACK.size))
            if status != _OK:
                raise WindowError(_read(self._sock, n).decode(errors="replace"))
        except TimeoutError as exc:
            raise WindowError(f"{self.peer} did not answer within "
                              f"{self._sock.gettimeout():g}s") from exc
        except OSError as exc:
            if isinstance(exc, WindowError):
                raise
            raise WindowError(f"the connection to the window of {self.peer} broke: "
                              f"{exc}") from exc
        return int(n)

    def put(self, offset: int, data: memoryview) -> None:
        with self._lock:
            try:
                self._sock.sendall(_HEAD.pack(_PUT, offset, len(data)))
                self._sock.sendall(data)
            except OSError as exc:
                raise WindowError(f"writing into the window of {self.peer} failed: "
                                  f"{exc}") from exc
            self._ack()

    def get_into(self, offset: int, out: memoryview) -> None:
        with self._lock:
            try:
                self._sock.sendall(_HEAD.pack(_GET, offset, len(out)))
            except OSError as exc:
                raise WindowError(f"reading the window of {self.peer} failed: {exc}") from exc
            self._ack()
            try:
                _read_exact(self._sock, out)
            except OSError as exc:
                raise WindowError(f"reading the window of {self.peer} failed: {exc}") from exc

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
