"""Errors of the replication layer (rank 0 decides, peers mirror over links).

    CacheError                        (phalanx.kvstore)
    └── ReplicationError              rank 0 and its peers could not keep their stores identical
        ├── LinkAuthError               a peer's job-token proof (or the leader's) did not match
        ├── LinkProtocolError           a frame of another version, type or size arrived
        ├── LinkClosedError             the connection to a peer closed or failed
        ├── LinkStalledError            a peer made no progress on its jobs for job_timeout
        ├── PeerJobError                a peer applied a job and reported an error
        └── ReplicaDivergedError        after reconciliation the ranks' record sets still differ
"""

from __future__ import annotations

from phalanx.kvstore import CacheError

__all__ = [
    "LinkAuthError",
    "LinkClosedError",
    "LinkProtocolError",
    "LinkStalledError",
    "PeerJobError",
    "ReplicaDivergedError",
    "ReplicationError",
]


class ReplicationError(CacheError):
    """Root of replication failures. Flow control is never one: a full window waits."""


class LinkAuthError(ReplicationError):
    """A peer (or the leader) failed the job-token proof at connect; nothing was applied."""


class LinkProtocolError(ReplicationError):
    """A frame of another protocol version, an unknown type, or over the size limit."""


class LinkClosedError(ReplicationError):
    """The connection to a peer closed (the peer died or closed) with jobs outstanding."""


class LinkStalledError(ReplicationError):
    """A peer made no progress on its outstanding jobs for ``job_timeout`` seconds."""


class PeerJobError(ReplicationError):
    """A peer reported an error applying a job; its directory may now differ."""


class ReplicaDivergedError(ReplicationError):
    """After start-up reconciliation the ranks still disagree; the job does not serve."""
