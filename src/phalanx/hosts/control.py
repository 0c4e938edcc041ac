"""The control plane between hosts: one authenticated TCP connection per node to node 0.

After the rendezvous, each node's agent connects to node 0's control port (told in the
rendezvous, ``Peer.port``). The connection carries length-prefixed msgpack frames, each a
msgspec Struct of a tagged union decoded into its type: nothing is unpickled.

Authentication, per connection: node 0 sends a :class:`Challenge` with a fresh nonce; the
node answers :class:`Hello` with ``HMAC-SHA256(token, "hello" | nonce | hello without its
proof)``; node 0 answers :class:`Welcome` with ``HMAC(token, "welcome" | nonce | the
hello's proof)``, so each side knows the other holds the job token, which never crosses
the network. A frame after that is trusted as coming from that peer (the network between
a job's hosts is the operator's; the token keeps other jobs and strays out).

Frames after the handshake: :class:`Call` (node 0 asks a rank of the node to run an
importable ``module:function`` on typed arguments), :class:`Reply`, :class:`Beat` (both
ways, every heartbeat; a node's beat names its local ranks found dead), :class:`Stop`
(node 0 ends the job on this node, cleanly or because of a failure it names) and
:class:`Stopped` (the node's ranks are gone).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from typing import Any

import msgspec

from phalanx.rendezvous import RendezvousError

__all__ = [
    "Beat",
    "Call",
    "Challenge",
    "Channel",
    "ChannelClosedError",
    "Frame",
    "Hello",
    "Reply",
    "Stop",
    "Stopped",
    "Welcome",
    "hello_proof",
    "welcome_proof",
]

VERSION = 1
MAX_FRAME = 256 << 20  # one plan or one result; far above either
_LEN = struct.Struct(">I")


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    version: int
    nonce: bytes


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    node_rank: int
    pid: int
    ranks: list[int]  # the global ranks this node runs, all started and ready
    proof: bytes = b""


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    proof: bytes


class Call(msgspec.Struct, tag="call", frozen=True):
    id: int
    rank: int  # global
    fn: str  # "module:qualname"
    args: bytes  # msgpack of the argument list
    timeout: float | None
    host: bool = False  # run in the node's agent, given its LocalRanks (rank: any of its)


class Reply(msgspec.Struct, tag="reply", frozen=True):
    id: int
    ok: bool
    value: bytes = b""  # msgpack of the result
    error: str = ""  # the exception's type name
    message: str = ""
    exitcode: int | None = None  # RankDiedError's, for a dead rank
    rank: int = -1  # the global rank the call ran on


class Beat(msgspec.Struct, tag="beat", frozen=True):
    lost: list[int] = []  # global ranks of this node found dead (with why, below)
    why: list[str] = []


class Stop(msgspec.Struct, tag="stop", frozen=True):
    reason: str
    failed: bool


class Stopped(msgspec.Struct, tag="stopped", frozen=True):
    errors: str = ""


Frame = Challenge | Hello | Welcome | Call | Reply | Beat | Stop | Stopped
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Frame)


def _mac(token: str, kind: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(token.encode(), kind + b"|" + nonce + b"|" + body, hashlib.sha256).digest()


def hello_proof(token: str, nonce: bytes, hello: Hello) -> bytes:
    body = _ENCODER.encode(msgspec.structs.replace(hello, proof=b""))
    return _mac(token, b"hello", nonce, body)


def welcome_proof(token: str, nonce: bytes, hello: Hello) -> bytes:
    return _mac(token, b"welcome", nonce, hello.proof)


def proofs_match(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


class ChannelClosedError(ConnectionError):
    """The peer closed the connection, or it broke (the message says which and why)."""


class Channel:
    """One framed connection. ``send`` from any thread (one lock; a send that cannot
    finish within ``send_timeout`` breaks the channel rather than block its callers);
    ``recv`` from one reader thread."""

    def __init__(self, sock: socket.socket, peer: str, send_timeout: float = 10.0) -> None:
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        # a blocking send with a deadline (the kernel's own wait, no poll loop)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(send_timeout), int(send_timeout % 1 * 1e6)))

    def send(self, frame: Frame) -> None:
        data = _ENCODER.encode(frame)
        if len(data) > MAX_FRAME:
            raise ValueError(f"a {type(frame).__name__} frame to {self.peer} of {len(data)} "
                             f"bytes is over the control plane's limit of {MAX_FRAME}")
        with self._send_lock:
            if self._closed:
                raise ChannelClosedError(f"the connection to {self.peer} is closed")
            try:
                self.sock.sendall(_LEN.pack(len(data)) + data)
            except OSError as exc:
                self._closed = True
                raise ChannelClosedError(f"sending to {self.peer} failed: {exc}") from exc

    def recv(self, timeout: float | None = None) -> Frame:
        """The next frame (``timeout``: for the handshake; None: block)."""
        self.sock.settimeout(timeout)
        try:
            head = self._read(_LEN.size)
            (n,) = _LEN.unpack(head)
            if n > MAX_FRAME:
                raise ChannelClosedError(f"{self.peer} sent a frame of {n} bytes, over the "
                                         f"limit of {MAX_FRAME}: not a phalanx peer?")
            data = self._read(n)
        finally:
            self.sock.settimeout(None)
        try:
            return _DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise RendezvousError(f"{self.peer} sent a frame this node cannot read ({n} "
                                  f"bytes): {exc}. Run the same phalanx version on every "
                                  f"host") from exc

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except TimeoutError:
                raise  # the handshake's deadline: the caller names it
            except OSError as exc:
                raise ChannelClosedError(f"the connection to {self.peer} broke: {exc}"
                                         ) from exc
            if not chunk:
                raise ChannelClosedError(f"{self.peer} closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already gone: the reader sees EOF either way
        self.sock.close()


def encode_args(args: tuple[Any, ...], what: str) -> bytes:
    """Typed arguments for another host: msgpack of what msgspec can encode (None, bool,
    int, float, str, bytes, lists, tuples, dicts, msgspec Structs), else a TypeError."""
    try:
        return _ENCODER.encode(list(args))
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"{what}: an argument cannot cross hosts ({exc}); pass plain "
                        f"values (str, int, float, bytes, lists, dicts)") from exc


def decode_value(data: bytes) -> Any:
    return msgspec.msgpack.decode(data)


def encode_value(value: Any, what: str) -> bytes:
    try:
        return _ENCODER.encode(value)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(f"{what}: its result cannot cross hosts ({exc}); return plain "
                        f"values") from exc
