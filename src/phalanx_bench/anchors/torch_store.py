"""The torch anchor of the rendezvous benchmark: torch's own store-based barrier over a
``FileStore`` or a ``TCPStore``, run as rank tasks beside phalanx's handshakes.

Why an internal: what torch runs to meet its ranks when a process group is made
(``new_group``, ``init_process_group``) is ``distributed_c10d._store_based_barrier``: an
``add`` on a counter per group name, a second ``add`` to read it, a ``set`` of a
"last worker" key by the last arrival, and a ``wait`` on that key. It is private, and
no public torch call runs it alone (``new_group`` also builds a backend). Calling it is
the only way to time torch's handshake itself, with a fresh group name per barrier as
``new_group`` uses. A release that moves or renames it breaks this file only.

The stores themselves (``FileStore``, ``TCPStore``) are torch's public API.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

__all__ = ["barriers", "close", "open_store"]

_STORE: dict[str, Any] = {}  # rank-local: the torch store under test (tasks are functions)


def open_store(kind: str, rank: int, world: int, path: str, port: int) -> int:
    """Open this rank's store (``filestore`` at ``path``, or ``tcpstore``: rank 0 serves
    on a free port, the others join ``port``); return the TCP store's port (0 for a file)."""
    import torch.distributed as dist

    if kind == "filestore":
        _STORE["store"] = dist.FileStore(path, world)  # type: ignore[attr-defined]
        return 0
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,  # type: ignore[attr-defined]
                          timedelta(seconds=60), wait_for_workers=False)
    _STORE["store"] = store
    return int(store.port)


def barriers(first: int, n: int, rank: int, world: int) -> tuple[list[float], int]:
    """``n`` store-based barriers named ``bench<first>``...: each one's seconds, and the
    keys the store holds afterwards (torch leaves two per barrier)."""
    from torch.distributed.distributed_c10d import _store_based_barrier

    store = _STORE["store"]
    samples = []
    for i in range(first, first + n):
        t0 = time.perf_counter()
        _store_based_barrier(rank, store, f"bench{i}", world,  # type: ignore[arg-type]
                             timedelta(seconds=60))
        samples.append(time.perf_counter() - t0)
    return samples, int(store.num_keys())


def close() -> None:
    _STORE.clear()
