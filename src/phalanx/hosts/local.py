"""One host's ranks in a multi-host job: a local Worker, addressed by global rank.

Node 0's :class:`~phalanx.hosts.worker.MultiHostWorker` and every other node's
:class:`~phalanx.hosts.agent.HostAgent` hold one. Work arrives as ``module:function``
with msgpack arguments and leaves as a msgpack result, on node 0 as on the others, so a
function behaves the same on whichever host its rank is.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

from .control import decode_value, encode_value
from .functions import run_on_rank

__all__ = ["LocalRanks"]

log = logging.getLogger("phalanx.hosts")

_MAX_CALLS = 64  # calls in progress on this host (each holds one local run)


class LocalRanks:
    """``count`` ranks, global ranks ``node * count ..``; started on construction."""

    def __init__(self, count: int, node: int, *, runtime_dir: str | None,
                 env: dict[str, str] | None, start_timeout: float, task_timeout: float,
                 close_timeout: float, node_addr: str, token: str) -> None:
        from phalanx.comm import Worker

        self.count, self.node, self.addr = count, node, node_addr
        self.first = node * count
        # each rank learns where it is (torch.distributed's gloo binds to this address)
        # and the job's token (the replication links between hosts prove it): the token
        # reaches a rank by its environment, never in a frame
        rank_env = {"PHALANX_NODE_ADDR": node_addr, "PHALANX_NODE_RANK": str(node),
                    "PHALANX_JOB_TOKEN": token, **(env or {})}
        self.worker = Worker(ranks=count, start_timeout=start_timeout,
                             task_timeout=task_timeout, close_timeout=close_timeout,
                             runtime_dir=runtime_dir, env=rank_env)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            _MAX_CALLS, thread_name_prefix=f"phalanx-node{node}-call")

    def global_ranks(self) -> list[int]:
        return list(range(self.first, self.first + self.count))

    def submit(self, rank: int, name: str, args: bytes, timeout: float | None
               ) -> concurrent.futures.Future[Any]:
        """``name(*args)`` on global ``rank`` (of this host); the decoded result."""
        def call() -> Any:
            return decode_value(self.execute(rank, name, args, timeout))

        return self._pool.submit(call)

    def execute(self, rank: int, name: str, args: bytes, timeout: float | None) -> bytes:
        """Run it here and now; the msgpack-encoded result (raises what the task raised)."""
        local = rank - self.first
        if not 0 <= local < self.count:
            raise ValueError(f"rank {rank} is not on node {self.node} (ranks "
                             f"{self.first}..{self.first + self.count - 1})")
        value = run_on_rank(self.worker, local, name, list(decode_value(args)), timeout)
        return encode_value(value, f"{name} on rank {rank}")

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._pool

    def lost(self) -> set[int]:
        """Global ranks of this host that died."""
        alive = set(self.worker.alive_ranks())
        return {self.first + r for r in range(self.count) if r not in alive}

    def close(self, timeout: float | None = None) -> None:
        """Stop the ranks (``timeout``: the Worker's close deadline; tasks still running
        then are killed with their rank)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.worker.close(timeout)
        finally:
            self._pool.shutdown(wait=True)
            log.debug("node %d: local ranks closed (pid %d)", self.node, os.getpid())
