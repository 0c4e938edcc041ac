"""A pipelining client for the wire protocol of torch's c10d ``TCPStore`` (libuv server).

torch's own client sends one request and blocks for its reply, and a ``wait`` blocks
the connection until it is woken. The server does not: it processes a connection's
requests in order and answers a wait only when woken, so a client may send several
requests in one write and read the replies later, in order, as long as it knows which
replies to expect. :class:`StoreWire` does exactly that for the handful of commands the
store handshake uses; the store itself (server, job key, counting keys) stays torch's.

Replies a caller chose not to read yet are *owed*: they are read before the reply of
the next request, since nothing on the connection can overtake them.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from dataclasses import dataclass

from ._errors import RendezvousError

__all__ = ["STOP_WAITING", "WAIT_CANCELED", "StoreWire", "WireError", "wait_readable"]

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp (torch 2.13): QueryType and friends
_VALIDATE, _SET, _COMPARE_SET, _ADD, _WAIT, _DELETE_KEY, _CANCEL_WAIT, _PING, _BARRIER = (
    0, 1, 2, 4, 6, 8, 12, 13, 18)
_VALIDATION_MAGIC = 0x3C85F7CE
STOP_WAITING, WAIT_CANCELED = 0, 1
_KEY_PREFIX = "/"  # torch's client prefixes every key: ours must name the same keys
_I64 = struct.Struct("=q")
_U64 = struct.Struct("=Q")
_READ_CHUNK = 65536


class WireError(RendezvousError):
    """The store connection failed or answered something the protocol does not allow."""


def _key(key: str) -> bytes:
    raw = (_KEY_PREFIX + key).encode()
    return _U64.pack(len(raw)) + raw


def _payload(value: bytes) -> bytes:
    return _U64.pack(len(value)) + value


@dataclass
class StoreWire:
    """One connection to the store. Requests are built by the ``*_req`` functions and
    sent together with :meth:`send`; replies are read with the ``read_*`` methods."""

    sock: socket.socket
    address: str
    _buf: bytearray
    owed: int = 0  # bytes of replies sent for but not read yet

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> StoreWire:
        address = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise WireError(f"cannot connect to the TCP store at {address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # every read below has its own deadline
        wire = cls(sock, address, bytearray())
        nonce = int(time.monotonic_ns()) & 0xFFFFFFFF
        try:
            wire.send(struct.pack("=BI", _VALIDATE, _VALIDATION_MAGIC),
                      struct.pack("=BI", _PING, nonce))
            echoed = struct.unpack("=I", wire.read(4, time.monotonic() + timeout))[0]
            if echoed != nonce:
                raise WireError(f"the TCP store at {address} does not speak torch 2.13's "
                                f"store protocol (ping echoed {echoed}, sent {nonce})")
        except BaseException:
            wire.close()
            raise
        return wire

    # -- requests ------------------------------------------------------------------
    @staticmethod
    def set_req(key: str, value: bytes) -> bytes:
        """No reply (one-way); wakes whoever waits on ``key``."""
        return bytes([_SET]) + _key(key) + _payload(value)

    @staticmethod
    def add_req(key: str, value: int) -> bytes:
        """Reply: the new value (``read_i64``)."""
        return bytes([_ADD]) + _key(key) + _I64.pack(value)

    @staticmethod
    def barrier_req(key: str, world: int) -> bytes:
        """Count one arrival at ``key``; reply ``STOP_WAITING`` once the count reaches
        ``world`` (at once for the arrival that reaches it), nothing before."""
        return bytes([_BARRIER]) + _key(key) + _I64.pack(world)

    @staticmethod
    def delete_req(key: str) -> bytes:
        """Reply: how many keys were deleted, 0 or 1 (``read_i64``). Wakes nobody."""
        return bytes([_DELETE_KEY]) + _key(key)

    @staticmethod
    def wait_req(key: str) -> bytes:
        """Reply ``STOP_WAITING`` when ``key`` is next written (or at once if it exists)."""
        return bytes([_WAIT]) + _U64.pack(1) + _key(key)

    @staticmethod
    def compare_set_req(key: str, expected: bytes, desired: bytes) -> bytes:
        """Reply: the value now (``read_bytes``); for a missing key, ``expected``."""
        return bytes([_COMPARE_SET]) + _key(key) + _payload(expected) + _payload(desired)

    @staticmethod
    def cancel_wait_req() -> bytes:
        """Drop this connection's wait; reply ``WAIT_CANCELED`` (after any wake sent)."""
        return bytes([_CANCEL_WAIT])

    # -- I/O -----------------------------------------------------------------------
    def send(self, *requests: bytes) -> None:
        try:
            self.sock.sendall(b"".join(requests))
        except OSError as exc:
            raise WireError(f"the TCP store at {self.address} dropped the connection: "
                            f"{exc}") from exc

    def pay_debts(self, deadline: float) -> None:
        """Read the owed replies (each an ``int64`` delete count: nothing to check)."""
        if self.owed:
            n, self.owed = self.owed, 0
            self.read(n, deadline)

    def has_data(self) -> bool:
        return bool(self._buf)

    def read(self, n: int, deadline: float) -> bytes:
        while len(self._buf) < n:
            self._fill(deadline)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def read_i64(self, deadline: float) -> int:
        return int(_I64.unpack(self.read(8, deadline))[0])

    def read_bytes(self, deadline: float) -> bytes:
        (n,) = _U64.unpack(self.read(8, deadline))
        return self.read(n, deadline)

    def read_wake(self, deadline: float) -> None:
        if (b := self.read(1, deadline)[0]) != STOP_WAITING:
            raise WireError(f"the TCP store at {self.address} answered a wait with {b}")

    def _fill(self, deadline: float) -> None:
        if not wait_readable([self], deadline):
            raise WireError(f"no reply from the TCP store at {self.address} in time")
        try:
            chunk = self.sock.recv(_READ_CHUNK)
        except OSError as exc:
            raise WireError(f"reading from the TCP store at {self.address} failed: "
                            f"{exc}") from exc
        if not chunk:
            raise WireError(f"the TCP store at {self.address} closed the connection "
                            f"(its rank 0 stopped?)")
        self._buf += chunk

    def close(self) -> None:
        self.sock.close()


def wait_readable(wires: list[StoreWire], deadline: float) -> list[StoreWire]:
    """The connections with a reply to read, waiting until ``deadline`` at most."""
    ready = [w for w in wires if w.has_data()]
    if ready:
        return ready
    poller = select.poll()  # not select(): descriptors may be above 1024
    for w in wires:
        poller.register(w.sock, select.POLLIN)
    left_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
    fds = {fd for fd, _ in poller.poll(left_ms)}
    return [w for w in wires if w.sock.fileno() in fds]
