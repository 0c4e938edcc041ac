"""What one rank process holds for communication: its ledger, the base communicator's
notify pools, and the views of the domains it is a member of.

The base communicator is created lazily by the first domain allocation and owned by
``base`` (not by that domain): a notify pool per rank, mapped by every rank, in which
each live domain *borrows* one slot of flags. Domains come and go; the pools stay,
counted as shared resources, until the Worker closes.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from phalanx import runtime
from phalanx.lifecycle.ledger import Entry, Ledger

__all__ = ["BASE_OWNER", "DOMAIN_SLOTS", "NOTIFY_SLOTS", "SLOT_WORDS", "RankComm", "pid_alive",
           "rank_comm"]

BASE_OWNER = "base communicator"
NOTIFY_SLOTS = 4096  # live domains at once
SLOT_WORDS = 8  # u64 words per slot (64 bytes: one cache line per domain per rank)
POOL_BYTES = NOTIFY_SLOTS * SLOT_WORDS * 8
HEADER_SLOT = NOTIFY_SLOTS - 1  # not lent to domains: word 0 holds the owner rank's pid
DOMAIN_SLOTS = NOTIFY_SLOTS - 1
LIVENESS_CHECK_S = 0.05  # how often a waiter checks that the peer it waits for still lives


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its parent's reaping counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def pool_name(generation: str, rank: int) -> str:
    return f"phx-{generation}-pool-r{rank}"


@dataclass
class RankComm:
    rank: int
    generation: str
    ledger: Ledger
    pool: mmap.mmap | None = None
    pool_entry: Entry | None = None
    flags: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> u64 view of its pool
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid, read from its pool
    views: dict[int, object] = field(default_factory=dict)  # alloc id -> DomainView

    @property
    def base_ready(self) -> bool:
        return self.pool is not None and len(self.flags) > 0


_STATE: RankComm | None = None


def rank_comm() -> RankComm:
    """This rank's communication state (created on first use, lives as long as the rank)."""
    global _STATE
    if _STATE is None:
        rank, gen = runtime.current_rank(), runtime.generation()
        if rank is None or gen is None:
            from ._errors import DomainError

            raise DomainError("domain steps run only inside rank processes")
        _STATE = RankComm(rank, gen, Ledger(f"rank {rank}"))
    return _STATE
