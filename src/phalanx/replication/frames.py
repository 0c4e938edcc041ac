"""The replication link's wire format: typed, versioned, length-prefixed frames.

A frame is ``u32 length | u8 version | msgpack body``; the body is one of the tagged
msgspec Structs below. Nothing here is pickle: a peer can only ever decode these types,
and an unknown tag, a wrong version or an oversized length is a LinkProtocolError.

Authentication (HELLO): the leader sends a random nonce; the peer answers with
HMAC-SHA256(job token, "peer" | nonce | rank) and its own nonce; the leader answers with
HMAC(token, "leader" | peer nonce). The token itself never crosses the wire, and each
side proves it holds it, so neither a stray client nor a stray listener is trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from typing import Union

import msgspec

from phalanx.kvstore.maintenance import Job

from ._errors import LinkClosedError, LinkProtocolError

__all__ = [
    "PROTOCOL_VERSION", "Ack", "Bye", "Challenge", "Frame", "FrameReader", "Hello", "JobOp",
    "LoadOp", "Reconcile", "RecordSet", "Refused", "StoreOp", "Unstage", "Welcome", "encode",
    "proof",
]

PROTOCOL_VERSION = 2  # 2: staged rows (StoreOp.staged, Unstage)
MAX_FRAME_BYTES = 64 << 20  # a store frame carries keys, not rows: far below this
_HEADER = struct.Struct(">IB")


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    version: int
    nonce: bytes


class Hello(msgspec.Struct, tag="hello", frozen=True):
    version: int
    rank: int
    host: str
    nonce: bytes
    mac: bytes  # proof(token, "peer", challenge nonce, rank)


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    mac: bytes  # proof(token, "leader", hello nonce, rank)


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str


class RecordSet(msgspec.Struct, tag="records", frozen=True):
    """A peer's recovered records: keys and whether each is thinned (same order)."""

    keys: list[bytes]
    thinned: list[bool]


class JobOp(msgspec.Struct, tag="job", frozen=True):
    seq: int
    job: Job


class StoreOp(msgspec.Struct, tag="store", frozen=True):
    """Store pages start..end; the peer's row comes from its own KV source."""

    seq: int
    parent: bytes  # key of page start-1 (the root key at page 0)
    start: int
    span: list[bytes]  # keys of pages start..end-1
    row: bytes = b""  # empty: the bytes come from the peer's KV source
    staged: bool = False  # the bytes are the peer's staged copy of this row (staging.py)


class Unstage(msgspec.Struct, tag="unstage", frozen=True):
    """Rank 0 refused or skipped a staged row: the peer drops its copy."""

    seq: int
    key: bytes  # the row's end page key
    start: int  # its start page


class LoadOp(msgspec.Struct, tag="load", frozen=True):
    seq: int
    keys: list[bytes]  # keys of pages 0..n-1


class Reconcile(msgspec.Struct, tag="reconcile", frozen=True):
    seq: int
    discard: list[bytes]
    thin: list[bytes]


class Bye(msgspec.Struct, tag="bye", frozen=True):
    seq: int


class Ack(msgspec.Struct, tag="ack", frozen=True):
    seq: int
    error: str = ""  # non-empty: the peer failed to apply this op
    digest: bytes = b""  # Reconcile: the peer's record-set digest afterwards
    crc: int = 0  # LoadOp: crc32 of the bytes the peer loaded


Frame = Union[Challenge, Hello, Welcome, Refused, RecordSet, JobOp, StoreOp, LoadOp,  # noqa: UP007
              Reconcile, Bye, Ack, Unstage]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    body = _ENCODER.encode(frame)
    return _HEADER.pack(len(body), PROTOCOL_VERSION) + body


def proof(token: str, role: str, nonce: bytes, rank: int) -> bytes:
    msg = role.encode() + b"|" + nonce + b"|" + str(rank).encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).digest()


def records_digest(states: dict[bytes, bool]) -> bytes:
    """Order-independent digest of a record set: equal digests, equal directories."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(states):
        h.update(key + (b"\x01" if states[key] else b"\x00"))
    return h.digest()


class FrameReader:
    """Reads frames from a socket through one buffer (several frames per recv)."""

    def __init__(self, sock: socket.socket, who: str) -> None:
        self.sock = sock
        self.who = who  # "peer rank 1 (host:port)", for errors
        self._buf = bytearray()
        self._pos = 0  # start of the unread bytes: no memmove per frame

    def buffered(self) -> bool:
        """True when a whole frame is already buffered (no recv needed)."""
        have = len(self._buf) - self._pos
        if have < _HEADER.size:
            return False
        n: int = _HEADER.unpack_from(self._buf, self._pos)[0]
        return have >= _HEADER.size + n

    def read(self) -> Frame | None:
        """The next frame; None when the socket timed out before a whole frame came.

        Raises LinkClosedError at EOF, LinkProtocolError on a bad frame.
        """
        while not self.buffered():
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return None
            except OSError as exc:
                raise LinkClosedError(f"{self.who}: connection failed ({exc})") from exc
            if not chunk:
                raise LinkClosedError(f"{self.who}: connection closed by the other side")
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += chunk
            if len(self._buf) >= _HEADER.size:
                n, version = _HEADER.unpack_from(self._buf)
                if version != PROTOCOL_VERSION or n > MAX_FRAME_BYTES:
                    raise LinkProtocolError(
                        f"{self.who}: frame of version {version} and {n} bytes (this side "
                        f"speaks version {PROTOCOL_VERSION}, at most {MAX_FRAME_BYTES} "
                        "bytes); run the same phalanx version on every rank"
                    )
        n, version = _HEADER.unpack_from(self._buf, self._pos)
        if version != PROTOCOL_VERSION:
            raise LinkProtocolError(f"{self.who}: frame of version {version}, this side "
                                    f"speaks {PROTOCOL_VERSION}")
        begin = self._pos + _HEADER.size
        body = memoryview(self._buf)[begin : begin + n]
        self._pos = begin + n
        try:
            with body:
                return _DECODER.decode(body)
        except msgspec.DecodeError as exc:
            raise LinkProtocolError(f"{self.who}: undecodable frame ({exc})") from exc
