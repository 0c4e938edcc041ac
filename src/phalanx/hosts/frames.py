"""The frames hosts exchange through the store, and the proofs that authenticate them.

Every frame is a msgspec Struct encoded with msgpack and decoded into its declared type
(nothing is unpickled, and a frame of the wrong shape is an error naming who sent it).
Each carries ``version`` first; a peer speaking another version is refused by name
rather than misread.

Proofs: the job token never leaves a host. A joining node proves it holds the token with
``HMAC-SHA256(token, "join" | nonce | its frame without the proof)``; node 0 signs each
verdict the same way (``"verdict"``), so a node also knows node 0 holds the token. The
nonce is fresh per rendezvous (node 0 draws it), so a proof cannot be replayed into
another job or another rendezvous of the same job. Proofs are compared with
``hmac.compare_digest`` (constant time).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TypeVar

import msgspec

from phalanx.rendezvous import RendezvousError

__all__ = [
    "VERSION",
    "JoinFrame",
    "Peer",
    "VerdictFrame",
    "decode_join",
    "decode_verdict",
    "encode",
    "sign_join",
    "sign_verdict",
    "valid_join",
    "valid_verdict",
]

VERSION = 1


class Peer(msgspec.Struct, frozen=True):
    """One node of the job as node 0 admitted it."""

    node_rank: int
    addr: str
    pid: int
    port: int = 0  # its control port (node 0's is where the agents connect); 0: none


class JoinFrame(msgspec.Struct, frozen=True):
    """A node asks to join: who it is, where, and its proof of the token."""

    version: int
    node_rank: int
    nnodes: int
    addr: str
    pid: int
    port: int = 0  # as Peer.port
    proof: bytes = b""


class VerdictFrame(msgspec.Struct, frozen=True):
    """Node 0's answer to one node: admitted with the peers, or not, with why.

    ``code``: ``admitted``; ``wrong_token`` (this node's proof failed); ``refused`` (its
    frame was wrong: nnodes, rank); ``missing`` (``missing`` never arrived in time);
    ``aborted`` (another node was refused)."""

    version: int
    node_rank: int
    code: str
    reason: str
    peers: list[Peer]
    missing: list[int]
    proof: bytes = b""


class _Versioned(msgspec.Struct):
    """What can be read of any frame, whatever its version (unknown fields ignored)."""

    version: int


_ENCODER = msgspec.msgpack.Encoder()
_JOIN = msgspec.msgpack.Decoder(JoinFrame)
_VERDICT = msgspec.msgpack.Decoder(VerdictFrame)
_VERSIONED = msgspec.msgpack.Decoder(_Versioned)


T = TypeVar("T", JoinFrame, VerdictFrame)


def encode(frame: JoinFrame | VerdictFrame) -> bytes:
    return _ENCODER.encode(frame)


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes, what: str) -> T:
    try:
        frame = decoder.decode(data)
    except msgspec.DecodeError as exc:
        try:
            version = _VERSIONED.decode(data).version
        except msgspec.DecodeError:
            raise RendezvousError(f"{what} is not a phalanx frame ({len(data)} bytes): {exc}"
                             ) from exc
        if version != VERSION:
            raise RendezvousError(f"{what} speaks frame version {version}, this node speaks "
                             f"{VERSION}: run the same phalanx version on every host"
                             ) from exc
        raise RendezvousError(f"{what} is malformed: {exc}") from exc
    if frame.version != VERSION:
        raise RendezvousError(f"{what} speaks frame version {frame.version}, this node speaks "
                              f"{VERSION}: run the same phalanx version on every host")
    return frame


def decode_join(data: bytes, what: str) -> JoinFrame:
    return _decode(_JOIN, data, what)


def decode_verdict(data: bytes, what: str) -> VerdictFrame:
    return _decode(_VERDICT, data, what)


def _mac(token: str, kind: bytes, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(token.encode(), kind + b"|" + nonce + b"|" + body, hashlib.sha256).digest()


_Signed = TypeVar("_Signed", JoinFrame, VerdictFrame)


def _sign(token: str, kind: bytes, nonce: bytes, frame: _Signed) -> _Signed:
    """``frame`` with its proof: a MAC of its encoding (proof empty) under the token."""
    body = encode(msgspec.structs.replace(frame, proof=b""))
    return msgspec.structs.replace(frame, proof=_mac(token, kind, nonce, body))


def _valid(token: str, kind: bytes, nonce: bytes, frame: _Signed) -> bool:
    return hmac.compare_digest(_sign(token, kind, nonce, frame).proof, frame.proof)


def sign_join(token: str, nonce: bytes, frame: JoinFrame) -> JoinFrame:
    return _sign(token, b"join", nonce, frame)


def valid_join(token: str, nonce: bytes, frame: JoinFrame) -> bool:
    return _valid(token, b"join", nonce, frame)


def sign_verdict(token: str, nonce: bytes, frame: VerdictFrame) -> VerdictFrame:
    return _sign(token, b"verdict", nonce, frame)


def valid_verdict(token: str, nonce: bytes, frame: VerdictFrame) -> bool:
    return _valid(token, b"verdict", nonce, frame)
