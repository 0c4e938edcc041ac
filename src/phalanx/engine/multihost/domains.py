"""Same-host ranks of a multi-host TP group keep their shared-memory path.

In a job of several hosts with more than one rank on each (2 hosts x 2 ranks), the ranks
of a host reduce over a phalanx domain of that host (shared memory, ~15 µs), and only
the host sums cross the network (:class:`~phalanx.engine.worker.tp.HostTieredComm`,
which ``worker/rank.py`` builds). The domain is a host-level resource:
:func:`open_host_domain` runs in the host's agent (node 0: its own process), where a
run of the host's Worker allocates it and holds it until :func:`release_host_domain`
(or the agent's close) ends the run; the ranks reach their view by the domain's id
(:func:`phalanx.comm.view_of`), a typed value that crosses hosts.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

__all__ = ["open_host_domain", "release_host_domain"]

# -- host level (in the agent; ``local`` is its LocalRanks) -------------------------------

def open_host_domain(local: Any, name: str, window: int, timeout: float) -> int:
    """Allocate a domain of this host's ranks, held by a run until released; its id."""
    ready: concurrent.futures.Future[int] = concurrent.futures.Future()
    release = threading.Event()

    def hold(o: Any) -> None:
        try:
            domain = o.allocate_domain(name, ranks=list(o.ranks), window_size=window)
        except BaseException as exc:
            ready.set_exception(exc)
            raise
        ready.set_result(domain.alloc_id)
        release.wait()
        o.release_domain(domain)  # its memory goes at the run's fence, after its tasks

    handle = local.worker.submit(hold)
    alloc_id = ready.result(timeout=timeout)

    def end() -> None:
        release.set()
        handle.result(timeout=timeout)

    local.hold(f"domain/{name}", end)
    return alloc_id


def release_host_domain(local: Any, name: str) -> bool:
    """End the run holding domain ``name`` (after every rank closed what maps it)."""
    return bool(local.release(f"domain/{name}"))
