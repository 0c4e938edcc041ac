"""The private parent<->rank control channel: length-prefixed frames on a socketpair.

Frames carry pickled payloads. That is safe only because both ends are a parent and
the children it started, joined by an anonymous AF_UNIX socketpair that nothing else
can reach; anything that crosses a network uses typed frames instead (docs/architecture.md, "No
pickle off the host").
"""

from __future__ import annotations

import enum
import socket
import struct
import threading

from ._errors import MessageTooLargeError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "HEADER", "Kind", "RankChannel", "check_size", "encode"]

# length of payload (u32), kind (u8), 3 pad bytes, message id (u64)
HEADER = struct.Struct("!IB3xQ")
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class Kind(enum.IntEnum):
    HELLO = 1  # rank -> parent: (rank, pid, generation token minted by rank 0 or None)
    INIT = 2  # parent -> rank: start-up settings (sys.path, generation, ...)
    READY = 3  # rank -> parent: the rank serves tasks now
    TASK = 4  # parent -> rank: cloudpickled (fn, args, kwargs)
    RESULT_OK = 5  # rank -> parent: pickled return value
    RESULT_ERR = 6  # rank -> parent: pickled (exception or stand-in, traceback text)
    SHUTDOWN = 7  # parent -> rank: finish, reply BYE, exit 0
    BYE = 8  # rank -> parent: about to exit cleanly
    CONTROL = 9  # parent -> rank: a runtime-internal task (failpoints, domain steps); replies
    # come as RESULT_*. It skips the user-task failpoint so a test can always disarm.
    RDV = 10  # rank -> parent: a hub-backend handshake arrival (pickled request)
    RDV_REPLY = 11  # parent -> rank: pickled list of missing ranks (empty: go)


def check_size(nbytes: int, limit: int, what: str) -> None:
    if nbytes > limit:
        raise MessageTooLargeError(
            f"{what} is {nbytes / 2**20:.1f} MiB, over the control channel's limit of "
            f"{limit / 2**20:.1f} MiB: pass bulk data through a communication domain's window "
            f"or a file, or raise Worker(max_message_bytes=...)"
        )


def encode(kind: Kind, msg_id: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind, msg_id) + payload


class RankChannel:
    """One end of a control channel with blocking, whole-frame reads (the rank's end)."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self._rfile = sock.makefile("rb", buffering=1 << 16)
        self._send_lock = threading.Lock()

    def send(self, kind: Kind, msg_id: int, payload: bytes) -> None:
        frame = encode(kind, msg_id, payload)
        with self._send_lock:
            self.sock.sendall(frame)

    def recv(self) -> tuple[Kind, int, bytes] | None:
        """The next frame, or None at end of stream (the other end is gone)."""
        head = self._rfile.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        length, kind, msg_id = HEADER.unpack(head)
        check_size(length, self.max_message_bytes, f"an incoming frame (kind {kind})")
        payload = self._rfile.read(length)
        if len(payload) < length:
            return None
        return Kind(kind), msg_id, payload

    def close(self) -> None:
        self._rfile.close()
        self.sock.close()
