"""``phalanx bench rendezvous``: handshake latency and leftovers, phalanx vs torch stores.

Every system runs the same thing in the same rank processes: N back-to-back
handshakes (barriers) among all ranks, each with a fresh id as a domain allocation
would have. torch's side is its store-based barrier (``_store_based_barrier``, what
``new_group`` runs) over a ``FileStore`` and a ``TCPStore``, with a fresh group name
per barrier as ``new_group`` uses. Rank 0's per-handshake times are reported.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from phalanx.rendezvous import BACKENDS, handshake, live_markers
from phalanx.runtime import Orchestrator, Worker

from ._stats import emit, percentile

_TORCH_STORE: dict[str, Any] = {}  # rank-local: the torch store under test


def _phalanx_loop(n: int, ranks: list[int]) -> tuple[list[float], int]:
    samples = []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        handshake("bench", i, ranks)
        samples.append(time.perf_counter() - t0)
    return samples, live_markers()


def _torch_open(kind: str, rank: int, world: int, path: str, port: int) -> int:
    import torch.distributed as dist

    if kind == "filestore":
        _TORCH_STORE["store"] = dist.FileStore(path, world)  # type: ignore[attr-defined]
        return 0
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,  # type: ignore[attr-defined]
                          timedelta(seconds=60), wait_for_workers=False)
    _TORCH_STORE["store"] = store
    return int(store.port)


def _torch_loop(n: int, rank: int, world: int) -> tuple[list[float], int]:
    from torch.distributed.distributed_c10d import _store_based_barrier

    store = _TORCH_STORE["store"]
    samples = []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        _store_based_barrier(rank, store, f"bench{i}", world,  # type: ignore[arg-type]
                             timedelta(seconds=60))
        samples.append(time.perf_counter() - t0)
    return samples, int(store.num_keys())


def _torch_close() -> None:
    _TORCH_STORE.clear()


def _figures(samples: list[float], left: int, left_after_close: int) -> dict[str, float]:
    return {"handshake_us_p50": round(percentile(samples, 50) * 1e6, 1),
            "handshake_us_p99": round(percentile(samples, 99) * 1e6, 1),
            "left_after": left, "left_after_close": left_after_close}


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def _bench_phalanx(backend: str, ranks: int, n: int, tmp: Path) -> dict[str, float]:
    runtime_dir = tmp / f"rt-{backend}"

    def orch(o: Orchestrator) -> tuple[list[float], int]:
        futures = [o.submit(r, _phalanx_loop, n, list(o.ranks)) for r in o.ranks]
        rank0: tuple[list[float], int] = [f.result() for f in futures][0]  # noqa: RUF015
        return rank0

    with Worker(ranks=ranks, rendezvous=backend, runtime_dir=runtime_dir) as w:
        samples, left = w.run(orch)
        if backend != "store":  # count files: what would fill /tmp
            left = _count_files(runtime_dir) - 1  # less the owner record
    return _figures(samples, left, _count_files(runtime_dir))


def _bench_torch(kind: str, ranks: int, n: int, tmp: Path) -> dict[str, float]:
    path = str(tmp / "torch-filestore")

    def orch(o: Orchestrator) -> tuple[list[float], int]:
        port = o.submit(0, _torch_open, kind, 0, ranks, path, 0).result()
        for f in [o.submit(r, _torch_open, kind, r, ranks, path, port) for r in o.ranks[1:]]:
            f.result()
        futures = [o.submit(r, _torch_loop, n, r, ranks) for r in o.ranks]
        result: tuple[list[float], int] = [f.result() for f in futures][0]  # noqa: RUF015
        for f in [o.submit(r, _torch_close) for r in o.ranks]:
            f.result()
        return result

    with Worker(ranks=ranks) as w:
        samples, left = w.run(orch)
    # FileStore's file: is it still there, and how many keys did it hold?
    after = int(os.path.exists(path)) if kind == "filestore" else 0
    return _figures(samples, left, after)


@click.command("rendezvous")
@click.option("--ranks", default=2, show_default=True)
@click.option("--handshakes", default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(ranks: int, handshakes: int, as_json: bool) -> None:
    """Handshake latency p50/p99 and leftovers: phalanx backends vs torch FileStore/TCPStore."""
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="phx-bench-rdv-") as tmp:
        for backend in BACKENDS:
            result[backend] = _bench_phalanx(backend, ranks, handshakes, Path(tmp))
        result["torch_filestore"] = _bench_torch("filestore", ranks, handshakes, Path(tmp))
        result["torch_tcpstore"] = _bench_torch("tcpstore", ranks, handshakes, Path(tmp))
    emit(result, as_json)
