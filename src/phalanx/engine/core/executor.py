"""What the engine loop drives: the TP ranks behind one protocol, :class:`Executor`.

Two backends implement it: ``worker/local.py``'s ``RankGroup`` (ranks on this host,
one long-lived Worker run) and ``multihost/executor.py``'s ``HostRankGroup`` (ranks on
several hosts, over a ``MultiHostWorker``). The loop, its scheduler and the disk tier
never know which, nor how many hosts there are.

What crosses this edge is typed: a step is an encoded plan (``core/plan.py``) and rank
0's encoded result; each rank reports what it holds once, as a :class:`RankMemory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = ["Executor", "RankMemory"]

T = TypeVar("T")


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, as its runner reported it when it opened."""

    rank: int
    tp: int
    weight_bytes: int   # as held: quantized weights at 4 or 8 bits
    bytes_read: int     # read from the checkpoint
    kv_bytes: int       # the KV page pool
    rss_bytes: int      # the process's resident set when it opened
    kv_heads_local: int
    heads_local: int
    threads: int
    device: str


class Executor(Protocol):
    """The TP ranks of one engine; see the module docstring."""

    tp: int
    memory: list[RankMemory]      # one per rank, in rank order
    dead: BaseException | None    # why the ranks are unusable, once they are

    def execute(self, plan: bytes, loads: object | None = None) -> bytes:
        """Run one encoded plan on every rank; rank 0's encoded result. ``loads``: what
        the ranks read from the disk tier for it (the connector's, opaque here)."""
        ...

    def on_rank0(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on rank 0 between two steps (the disk tier's lookups)."""
        ...

    def on_each_rank(self, fn: Callable[..., T], *args: Any, timeout: float
                     ) -> dict[int, T | BaseException]:
        """``fn(*args)`` on every rank at once, beside the steps (gauges): each rank's
        result, or the error of a rank that failed or did not answer in ``timeout``."""
        ...

    def parent_uncertain(self) -> int:
        """Resources of the executor's own process whose release is uncertain."""
        ...

    def alive_ranks(self) -> list[int]: ...

    def lost_ranks(self) -> str | None:
        """A sentence naming the ranks that are gone (checked without a step), or None."""
        ...

    def wait_quiet(self, gap: float, timeout: float) -> bool:
        """Until no step or lookup has run for ``gap`` seconds (True), or ``timeout``."""
        ...

    def close(self, timeout: float = 60.0) -> None: ...
