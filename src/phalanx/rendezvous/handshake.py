"""Handshakes: every participant arrives, waits for all, departs; then nothing is left.

One protocol, three backends (the rank side of each):

* :class:`MarkerBackend` — files in the generation directory (one host, or hosts that
  share a file system). Arrival and departure markers are published atomically.
* :class:`~phalanx.rendezvous.store_backend.StoreBackend` — keys in torch's c10d
  ``TCPStore`` (multi-host), created by rank 0 and joined by the others. torch is
  imported only there, only when used.
* :class:`HubBackend` — the local Worker's parent, which already talks to every rank,
  counts arrivals in memory (:class:`HubCoordinator`).

Bounded while alive: a participant publishes its arrival, waits for every arrival,
publishes its departure; the leader (first participant) waits for every departure and
then removes all 2N markers before its call returns. No participant removes a marker
another may still read, markers exist only for handshakes in progress, and allocation
ids are in every name, so concurrent handshakes never collide.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from phalanx.lifecycle.failpoints import Failpoint

from ._errors import (
    HandshakeAbortedError,
    HandshakeError,
    HandshakeTimeoutError,
)

__all__ = [
    "Backend",
    "HubBackend",
    "HubCoordinator",
    "MarkerBackend",
]

_PUBLISH = Failpoint("rendezvous.handshake.publish", "about to publish a marker or key")
_REMOVE = Failpoint("rendezvous.handshake.remove", "the leader is about to remove markers")
_ABORT_MEMORY_S = 300.0  # how long the hub remembers an aborted allocation id


class Backend(Protocol):
    name: str

    def handshake(self, tag: str, alloc_id: int, participants: Sequence[int], rank: int,
                  timeout: float) -> None: ...

    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        """Tell every participant waiting in a handshake of ``alloc_id`` (with one of
        ``tags``) to give up."""

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        """Remove what failed handshakes of ``alloc_id`` left (once nobody waits on them)."""

    def live_markers(self) -> int: ...

    def close(self) -> None: ...


def _aborted(tag: str, alloc_id: int, rank: int) -> HandshakeAbortedError:
    return HandshakeAbortedError(
        f"handshake {tag!r} of allocation {alloc_id}: rank {rank} stopped waiting because "
        f"another participant aborted the allocation (its own error names the cause)")


def publish_point(tag: str, alloc_id: int, rank: int) -> None:
    """The publish failpoint of a backend without files: its error is the handshake's."""
    try:
        _PUBLISH.hit()
    except OSError as err:
        raise HandshakeError(
            f"rank {rank} could not publish its arrival at handshake {tag!r} of "
            f"allocation {alloc_id}: errno {err.errno} ({err.strerror})") from err


def _check(tag: str, participants: Sequence[int], rank: int) -> None:
    if rank not in participants:
        raise HandshakeError(f"rank {rank} is not a participant of handshake {tag!r} "
                             f"(participants {list(participants)})")
    if "/" in tag or "-" in tag:
        raise HandshakeError(f"handshake tag {tag!r} may not contain '/' or '-'")


def _timeout(phase: str, tag: str, alloc_id: int, rank: int, missing: list[int],
             timeout: float) -> HandshakeTimeoutError:
    verb = "arrived" if phase == "arrival" else "departed"
    return HandshakeTimeoutError(
        f"handshake {tag!r} of allocation {alloc_id}: rank {rank} waited {timeout:g}s at "
        f"{phase}; ranks {missing} never {verb}. Check that they are alive and called the same "
        f"handshake (same tag, allocation id and participants)", missing)


class MarkerBackend:
    """Marker files under one generation directory."""

    name = "marker"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, alloc_id: int, tag: str, phase: str, rank: int) -> str:
        return os.path.join(self.directory, f"hs-{alloc_id}-{tag}-{phase}-{rank}")

    def _publish(self, path: str, tag: str, alloc_id: int, rank: int) -> None:
        try:
            _PUBLISH.hit()
            tmp = f"{path}.tmp"
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            os.rename(tmp, path)
        except OSError as err:
            raise HandshakeError(
                f"rank {rank} could not publish its marker for handshake {tag!r} of allocation "
                f"{alloc_id} at {path}: errno {err.errno} ({err.strerror})") from err

    def _wait(self, paths: dict[int, str], deadline: float, phase: str, tag: str,
              alloc_id: int, rank: int, timeout: float) -> None:
        missing = dict(paths)
        abort = self._abort_path(alloc_id)
        delay = 20e-6
        while True:
            if os.path.exists(abort):  # first: markers of ranks that gave up still exist
                raise _aborted(tag, alloc_id, rank)
            missing = {r: p for r, p in missing.items() if not os.path.exists(p)}
            if not missing:
                return
            if time.monotonic() > deadline:
                raise _timeout(phase, tag, alloc_id, rank, sorted(missing), timeout)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def handshake(self, tag: str, alloc_id: int, participants: Sequence[int], rank: int,
                  timeout: float) -> None:
        _check(tag, participants, rank)
        deadline = time.monotonic() + timeout
        arrive = {r: self._path(alloc_id, tag, "a", r) for r in participants}
        depart = {r: self._path(alloc_id, tag, "d", r) for r in participants}
        self._publish(arrive[rank], tag, alloc_id, rank)
        self._wait(arrive, deadline, "arrival", tag, alloc_id, rank, timeout)
        self._publish(depart[rank], tag, alloc_id, rank)
        if rank != participants[0]:
            return
        self._wait(depart, deadline, "departure", tag, alloc_id, rank, timeout)
        for path in [*arrive.values(), *depart.values()]:
            try:
                _REMOVE.hit()
                os.unlink(path)
            except OSError as err:
                raise HandshakeError(
                    f"rank {rank} (leader) could not remove marker {path} of handshake {tag!r} "
                    f"of allocation {alloc_id}: errno {err.errno} ({err.strerror})") from err

    def _abort_path(self, alloc_id: int) -> str:
        return os.path.join(self.directory, f"hs-{alloc_id}-abort")

    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        self._publish(self._abort_path(alloc_id), "abort", alloc_id, rank)

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        prefix = f"hs-{alloc_id}-"
        removed = 0
        for name in os.listdir(self.directory):
            if name.startswith(prefix):
                os.unlink(os.path.join(self.directory, name))
                removed += 1
        return removed

    def live_markers(self) -> int:
        return sum(1 for n in os.listdir(self.directory) if n.startswith("hs-"))

    def close(self) -> None:
        pass


class HubBackend:
    """The rank side of the parent-as-hub backend: one request, one reply."""

    name = "hub"

    def __init__(self, request: Callable[[Any, float], Any]) -> None:
        self._request = request

    def handshake(self, tag: str, alloc_id: int, participants: Sequence[int], rank: int,
                  timeout: float) -> None:
        _check(tag, participants, rank)
        publish_point(tag, alloc_id, rank)
        missing = self._request(("arrive", alloc_id, tag, tuple(participants), rank, timeout),
                                timeout + 5)
        if missing is None:
            raise _aborted(tag, alloc_id, rank)
        if missing:
            raise _timeout("arrival", tag, alloc_id, rank, list(missing), timeout)

    def abort(self, alloc_id: int, rank: int, tags: Sequence[str],
              participants: Sequence[int]) -> None:
        self._request(("abort", alloc_id, "", (), rank, 0.0), 5.0)

    def purge(self, alloc_id: int, tags: Sequence[str], participants: Sequence[int]) -> int:
        return 0  # nothing persists: abort already dropped the hub's entries

    def live_markers(self) -> int:
        return 0

    def close(self) -> None:
        pass


@dataclass
class _Pending:
    participants: tuple[int, ...]
    deadline: float
    arrived: dict[int, int] = field(default_factory=dict)  # rank -> request id


Reply = tuple[int, int, list[int] | None]  # (rank, request id, missing; [] = go, None = abort)


class HubCoordinator:
    """The parent side of the hub backend: arrivals in memory, bounded by handshakes in
    progress (an entry is dropped when it completes or expires)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], _Pending] = {}
        # Allocations aborted recently: a late arrival must not wait for peers that gave up.
        self._aborted: dict[int, float] = {}
        self._dead: set[int] = set()  # ranks that died: nobody waits for them again

    def request(self, request_id: int, op: str, alloc_id: int, tag: str,
                participants: tuple[int, ...], rank: int, timeout: float) -> list[Reply]:
        if op == "abort":
            return self.abort(request_id, alloc_id, rank)
        return self.arrive(request_id, alloc_id, tag, participants, rank, timeout)

    def arrive(self, request_id: int, alloc_id: int, tag: str, participants: tuple[int, ...],
               rank: int, timeout: float) -> list[Reply]:
        if alloc_id in self._aborted:
            return [(rank, request_id, None)]
        dead = sorted(self._dead.intersection(participants))
        if dead:
            return [(rank, request_id, dead)]
        key = (alloc_id, tag)
        entry = self._pending.setdefault(
            key, _Pending(participants, time.monotonic() + timeout))
        if entry.participants != participants:
            return [(rank, request_id, [r for r in participants if r not in entry.participants]
                     or list(participants))]
        entry.arrived[rank] = request_id
        if len(entry.arrived) < len(participants):
            return []
        del self._pending[key]
        return [(r, rid, []) for r, rid in entry.arrived.items()]

    def abort(self, request_id: int, alloc_id: int, rank: int) -> list[Reply]:
        """Abort every handshake of ``alloc_id``; later arrivals for it are aborted too."""
        replies: list[Reply] = [(rank, request_id, [])]
        self._aborted[alloc_id] = time.monotonic() + _ABORT_MEMORY_S
        for key, entry in list(self._pending.items()):
            if key[0] == alloc_id:
                del self._pending[key]
                replies.extend((r, rid, None) for r, rid in entry.arrived.items())
        return replies

    def abort_rank(self, rank: int) -> list[Reply]:
        """A rank died: every handshake waiting for it is aborted."""
        self._dead.add(rank)
        replies: list[Reply] = []
        for key, entry in list(self._pending.items()):
            if rank in entry.participants and rank not in entry.arrived:
                del self._pending[key]
                replies.extend((r, rid, [rank]) for r, rid in entry.arrived.items())
        return replies

    def expire(self, now: float) -> list[Reply]:
        for alloc_id, until in list(self._aborted.items()):
            if now > until:
                del self._aborted[alloc_id]
        replies: list[Reply] = []
        for key, entry in list(self._pending.items()):
            if now > entry.deadline:
                del self._pending[key]
                missing = [r for r in entry.participants if r not in entry.arrived]
                replies.extend((r, rid, missing) for r, rid in entry.arrived.items())
        return replies

    def in_progress(self) -> int:
        return len(self._pending)
