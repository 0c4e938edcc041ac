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
import threading
from collections.abc import Callable
from typing import Any

from .control import decode_value, encode_value
from .functions import resolve, run_on_rank, typed_args

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
        self._lock = threading.Lock()
        self._held: dict[str, Callable[[], None]] = {}
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

    def execute_host(self, name: str, args: bytes) -> bytes:
        """``name(self, *args)`` here, in this host's agent (or node 0's process), not in
        a rank: a host-level step such as a domain of this host's ranks (the function
        owns what it makes through :meth:`hold`)."""
        fn = resolve(name)
        value = fn(self, *typed_args(fn, [None, *decode_value(args)], name)[1:])
        return encode_value(value, f"{name} on node {self.node}")

    def hold(self, key: str, release: Callable[[], None]) -> None:
        """Own a host-level resource until :meth:`release` (or close, before the ranks
        stop: a domain's run must end before its ranks do)."""
        with self._lock:
            if key in self._held:
                raise ValueError(f"node {self.node}: {key!r} is held already")
            self._held[key] = release

    def release(self, key: str) -> bool:
        with self._lock:
            release = self._held.pop(key, None)
        if release is None:
            return False
        release()
        return True

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return self._pool

    def lost(self) -> set[int]:
        """Global ranks of this host that died."""
        alive = set(self.worker.alive_ranks())
        return {self.first + r for r in range(self.count) if r not in alive}

    def close(self, timeout: float | None = None) -> None:
        """Release what the host holds, then stop the ranks (``timeout``: the Worker's
        close deadline; tasks still running then are killed with their rank). Raises
        one WorkerError naming every failure; the ranks are stopped either way."""
        from phalanx.runtime import WorkerError

        self._pool.shutdown(wait=False, cancel_futures=True)
        errors: list[str] = []
        for key in list(self._held):
            try:
                self.release(key)
            except Exception as exc:  # noqa: BLE001  the ranks stop either way
                errors.append(f"releasing {key}: {exc}")
        try:
            self.worker.close(timeout)
        except Exception as exc:  # noqa: BLE001  reported with the others
            errors.append(f"closing its ranks: {exc}")
        finally:
            self._pool.shutdown(wait=True)
        if errors:
            raise WorkerError(f"node {self.node} (pid {os.getpid()}): " + "; ".join(errors))
