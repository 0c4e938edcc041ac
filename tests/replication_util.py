"""Helpers for the replication tests: a template of synthetic per-rank directories
written once per session through the real replicated path, copied per test."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from phalanx.kvstore import Geometry
from phalanx.replication import ReplicatedCache
from phalanx.runtime import Worker

GEOM = Geometry(layers=1, kv_heads=1, head_dim=4, dtype="float16", page_tokens=4)
FP = "replication-test-model"
RANKS = 3  # rank 0 + 2 peers, as in the incident


def _pid() -> int:
    return os.getpid()


def rank_pid(worker: Worker, rank: int) -> int:
    """The pid of rank ``rank``'s process (to stop or kill it in a fault test)."""
    pid: int = worker.run(lambda o: o.submit(rank, _pid).result())
    return pid


def open_cache(worker: Worker, directory: Path, **kw: Any) -> ReplicatedCache:
    kw.setdefault("capacity_bytes", 1 << 30)
    return ReplicatedCache.open(worker, directory, geometry=GEOM, fingerprint=FP, **kw)


def synth(directory: Path, records: int, shape: str = "chain", group: int = 8) -> None:
    with Worker(ranks=RANKS) as w:
        cache = open_cache(w, directory)
        try:
            cache.synth(records, shape, group=group)
            assert cache.check() == []
        finally:
            cache.close()


def copy_dirs(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest)
    for root, _, files in os.walk(dest):
        for f in files:
            if f == ".lock":
                os.unlink(os.path.join(root, f))
    return dest


def listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((e.name, e.stat().st_size) for e in os.scandir(directory)
                  if e.name.endswith(".kv"))


def assert_identical(directory: Path, ranks: int = RANKS) -> list[tuple[str, int]]:
    """Every rank's directory holds the same record files with the same sizes."""
    first = listing(directory / "rank-0")
    for r in range(1, ranks):
        other = listing(directory / f"rank-{r}")
        assert other == first, f"rank {r} differs from rank 0: {len(other)} vs {len(first)}"
    return first


def dir_bytes(directory: Path) -> int:
    return sum(size for _, size in listing(directory))
