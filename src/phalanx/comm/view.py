"""A task's view of a domain: its window, its peers' windows, named buffers, collectives.

Same-host peers are reached through shared memory (:class:`ShmPeer`). The view talks to
peers only through the :class:`Peer` protocol, so the cross-host path (a peer reached
over the network with the same put/get/scratch operations) can be added without
changing what tasks see.
"""

from __future__ import annotations

import mmap
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import collectives
from ._errors import CollectiveError, DomainError, DomainReleasedError
from .spec import DomainSpec
from .waiting import Waited, wait_for

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["DomainView", "Peer", "ShmPeer"]



class Peer(Protocol):
    """One member as seen from another: its window and scratch, and its barrier flag."""

    def window(self) -> memoryview: ...

    def scratch(self) -> memoryview: ...

    def flag(self) -> int: ...


class ShmPeer:
    """A same-host member: its segment mapped into this process."""

    def __init__(self, segment: mmap.mmap, spec: DomainSpec, flags: np.ndarray,
                 pid: int) -> None:
        self._mem = memoryview(segment)
        self._spec = spec
        self._flags = flags
        self.pid = pid

    def window(self) -> memoryview:
        return self._mem[self._spec.window_offset:self._spec.window_offset + self._spec.window_size]

    def scratch(self) -> memoryview:
        return self._mem[:self._spec.scratch_size]

    def flag(self) -> int:
        return int(self._flags[self._spec.slot * 8])

    def drop(self) -> None:
        self._mem.release()


def _reached(peer: ShmPeer, epoch: int) -> bool:
    return peer.flag() >= epoch


class DomainView:
    """What a task on a member rank gets for a domain handle."""

    def __init__(self, spec: DomainSpec, rank: int, peers: dict[int, ShmPeer],
                 own_flags: np.ndarray, timeout: float) -> None:
        self.spec = spec
        self.name = spec.name
        self.members = spec.members
        self.domain_rank = spec.members.index(rank)
        self.domain_size = len(spec.members)
        self.timeout = timeout
        self._peers = peers  # domain rank -> peer (self included, through its own mapping)
        self._own_flags = own_flags
        self._epoch = 0
        self._revoked = False

    def __repr__(self) -> str:
        return (f"<DomainView {self.name!r} id={self.spec.alloc_id} "
                f"rank {self.domain_rank}/{self.domain_size}>")

    def _check(self) -> None:
        if self._revoked:
            raise DomainReleasedError(f"domain {self.name!r} (id {self.spec.alloc_id}) was "
                                      f"released; its view is no longer usable")

    def _peer(self, domain_rank: int) -> ShmPeer:
        self._check()
        try:
            return self._peers[domain_rank]
        except KeyError:
            raise DomainError(f"domain {self.name!r} has no domain rank {domain_rank} (size "
                              f"{self.domain_size})") from None

    # -- memory -----------------------------------------------------------------------
    @property
    def window(self) -> memoryview:
        """This member's window: writable, zero-copy (np.frombuffer / torch.frombuffer)."""
        return self._peer(self.domain_rank).window()

    def array(self, dtype: npt.DTypeLike = np.uint8, domain_rank: int | None = None) -> Any:
        """A numpy array over a window (this member's by default), no copy."""
        rank = self.domain_rank if domain_rank is None else domain_rank
        return np.frombuffer(self._peer(rank).window(), dtype=dtype)

    def tensor(self, dtype: Any = None) -> Any:
        """This member's window as a torch tensor, no copy (imports torch)."""
        import torch

        return torch.frombuffer(self.window, dtype=dtype or torch.uint8)

    def peer_window(self, domain_rank: int) -> memoryview:
        """A same-host peer's window, mapped for direct access."""
        return self._peer(domain_rank).window()

    def buffer(self, name: str) -> Any:
        """A named buffer of this member's window as a uint8 numpy array, no copy."""
        offsets = self.spec.buffer_offsets()
        if name not in offsets:
            raise DomainError(f"domain {self.name!r} has no buffer {name!r} (has "
                              f"{list(offsets)})")
        offset, size = offsets[name]
        return np.frombuffer(self.window[offset:offset + size], dtype=np.uint8)

    def _bounds(self, peer: int, offset: int, nbytes: int) -> memoryview:
        win = self._peer(peer).window()
        if offset < 0 or nbytes < 0 or offset + nbytes > len(win):
            raise DomainError(f"domain {self.name!r}: [{offset}, {offset + nbytes}) is outside "
                              f"the {len(win)}-byte window of domain rank {peer}")
        return win[offset:offset + nbytes]

    def put(self, peer: int, offset: int, data: Any) -> None:
        """Write ``data`` (any buffer) into ``peer``'s window at ``offset``."""
        src = memoryview(data).cast("B")
        self._bounds(peer, offset, len(src))[:] = src

    def get(self, peer: int, offset: int, nbytes: int) -> bytes:
        """Read ``nbytes`` from ``peer``'s window at ``offset``."""
        return bytes(self._bounds(peer, offset, nbytes))

    def get_into(self, peer: int, offset: int, out: Any) -> None:
        """Read ``len(out)`` bytes from ``peer``'s window at ``offset`` into ``out``: no
        allocation, one memcpy (what bulk transfers should use)."""
        dst = memoryview(out).cast("B")
        dst[:] = self._bounds(peer, offset, len(dst))

    # -- synchronisation --------------------------------------------------------------
    def barrier(self, timeout: float | None = None) -> None:
        """Every member arrives before any leaves. Single-writer epoch flags in the notify
        pool: each member bumps its own slot and waits for every peer's to catch up."""
        self._check()
        self._epoch += 1
        # tagged with the alloc id (see rank_ops.pool_handshake): slots are never zeroed
        epoch = self.spec.alloc_id << 32 | self._epoch
        self._own_flags[self.spec.slot * 8] = epoch
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for r, peer in self._peers.items():
            if r == self.domain_rank:
                continue
            waited = wait_for(partial(_reached, peer, epoch), peer.pid, deadline)
            if waited is Waited.DEAD:
                raise CollectiveError(
                    f"domain {self.name!r} barrier {self._epoch}: domain rank {r} (rank "
                    f"{self.members[r]}, pid {peer.pid}) is dead; domain rank "
                    f"{self.domain_rank} (rank {self.members[self.domain_rank]}) stopped waiting")
            if waited is Waited.TIMEOUT:
                late = [m for m, p in self._peers.items() if p.flag() < epoch]
                raise CollectiveError(
                    f"domain {self.name!r} barrier {self._epoch}: domain ranks {late} (ranks "
                    f"{[self.members[m] for m in late]}) did not arrive within "
                    f"{self.timeout:g}s (domain rank {self.domain_rank} waited)")

    def revoke(self) -> None:
        self._revoked = True
        for peer in self._peers.values():
            peer.drop()
        self._peers = {}

    # -- collectives (implemented in collectives.py) -------------------------------------
    def broadcast(self, arr: Any, root: int = 0) -> Any:
        """Copy ``arr`` of domain rank ``root`` into ``arr`` of every member, in place."""
        return collectives.broadcast(self, arr, root)

    def allreduce(self, arr: Any, op: str = "sum") -> Any:
        """Reduce ``arr`` over every member (sum, max, min, prod), in place."""
        return collectives.allreduce(self, arr, op)

    def allgather(self, arr: Any) -> Any:
        """Every member's ``arr`` stacked in domain-rank order."""
        return collectives.allgather(self, arr)
