"""Errors of the rendezvous layer (drawn in :mod:`phalanx.errors`).

    PhalanxError
    └── RendezvousError
        ├── UnsafeRuntimeDirError   a symlink, a foreign owner or a non-directory where ours belongs
        ├── HandshakeError          publishing or removing a marker (or key) failed
        │   ├── HandshakeTimeoutError  not every participant arrived (or departed) in time
        │   └── HandshakeAbortedError  a participant gave up the allocation (its own error says why)
        └── TokenMismatchError      a store peer presented the wrong job token
"""

from __future__ import annotations

from phalanx.lifecycle import PhalanxError


class RendezvousError(PhalanxError):
    """Base of the rendezvous layer's errors."""


class UnsafeRuntimeDirError(RendezvousError, PermissionError):
    """A runtime or generation directory cannot be trusted (symlink, other owner, a file)."""


class HandshakeError(RendezvousError):
    """A handshake step failed; the message names rank, tag, allocation id and errno."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """Not every participant reached a handshake phase before its deadline."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing

    def __reduce__(self) -> tuple[type[HandshakeTimeoutError], tuple[str, list[int]]]:
        return (type(self), (str(self), self.missing))


class HandshakeAbortedError(HandshakeError):
    """Another participant aborted this allocation's handshakes after its own step failed."""


class TokenMismatchError(RendezvousError):
    """A TCP-store peer's job token does not match the job that owns the store."""
