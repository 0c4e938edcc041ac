"""10,000 allocate/barrier/release cycles in one Worker: OS resources stay flat."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import psutil
import pytest

import phalanx
from leaks import _files_under
from phalanx.comm import DomainView


def _rank_resources() -> tuple[int, int, int]:
    p = psutil.Process()
    return p.num_fds(), threading.active_count(), p.memory_info().rss


def _barrier(d: DomainView) -> None:
    d.barrier()


def _cycle(o: phalanx.Orchestrator) -> None:
    d = o.allocate_domain("cycle", [0, 1], window_size=1 << 16, buffers=[("flags", 64)])
    for f in [o.submit(r, _barrier, d) for r in (0, 1)]:
        f.result()
    o.release_domain(d)


def _sample(w: phalanx.Worker, runtime_dir: Path) -> dict[str, int]:
    parent = psutil.Process()
    ranks = w.run(lambda o: [o.submit(r, _rank_resources).result() for r in (0, 1)])
    return {
        "fds": parent.num_fds() + sum(r[0] for r in ranks),
        "threads": threading.active_count() + sum(r[1] for r in ranks),
        # this Worker's segments: the rest of /dev/shm is the other xdist worker's too
        "shm": sum(n.startswith(f"phx-{w.generation}-") for n in os.listdir("/dev/shm")),
        "runtime_files": len(_files_under(runtime_dir)),
        "rss_mb": (parent.memory_info().rss + sum(r[2] for r in ranks)) >> 20,
        "owned": w.stats().extra["parent_resources"]["owned"],
    }


@pytest.mark.slow
def test_ten_thousand_cycles_stay_flat(tmp_path: Path) -> None:
    samples = []
    with phalanx.Worker(ranks=2, runtime_dir=tmp_path) as w:
        for i in range(1, 10_001):
            w.run(_cycle)
            if i % 500 == 0:
                samples.append(_sample(w, tmp_path))
        assert w.live_domains == []
    # warm-up: imports, the base communicator, and the ledgers' bounded event logs filling
    warm = samples[3]  # after 2,000 cycles
    for s in samples[4:]:
        for key in ("fds", "threads", "shm", "runtime_files", "owned"):
            assert s[key] == warm[key], (key, samples)
        # a leak of even 1 KiB per cycle would show as 8 MiB here
        assert s["rss_mb"] - warm["rss_mb"] <= 4, [x["rss_mb"] for x in samples]
