"""``phalanx bench domains``: domain cycles and barriers vs torch.distributed gloo.

phalanx: from the parent, one run per cycle that allocates a domain over the ranks,
runs a barrier task on each member and releases it (the fence frees it). gloo: in the
same rank processes, ``new_group(ranks)`` + ``barrier(group)`` +
``destroy_process_group(group)`` per cycle, timed on rank 0. Barrier latency: a loop
of barriers inside a task (phalanx: the domain barrier; gloo: ``dist.barrier()``).
Window bandwidth: a 64 MiB put and get between two members' windows against an
in-process memcpy of the same size (numpy copyto between pre-touched buffers).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import click
import numpy as np
import psutil

from phalanx.comm import DomainOrchestrator, DomainView, Worker

from ._stats import emit, percentile

_GLOO: dict[str, Any] = {}


def _resources() -> dict[str, int]:
    p = psutil.Process()
    return {"fds": p.num_fds(), "threads": threading.active_count(),
            "shm": len(os.listdir("/dev/shm")), "rss_kb": p.memory_info().rss // 1024}


def _sum(parts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = v if k == "shm" else out.get(k, 0) + v
    return out


def _barrier_loop(view: DomainView, n: int) -> float:
    for _ in range(100):
        view.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        view.barrier()
    return (time.perf_counter() - t0) / n


def _bandwidth(view: DomainView, nbytes: int, reps: int) -> tuple[float, float]:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        view.put(1, 0, src)
        view.get_into(1, 0, dst)
        ts.append((time.perf_counter() - t0) / 2)
    assert (dst == 1).all()
    scratch = np.zeros(nbytes, dtype=np.uint8)
    mc = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(scratch, src)
        mc.append(time.perf_counter() - t0)
    return nbytes / min(ts) / 1e9, nbytes / min(mc) / 1e9


def _phalanx(ranks: int, cycles: int, barriers: int) -> tuple[dict[str, Any], float]:
    members = list(range(ranks))

    def cycle(o: DomainOrchestrator) -> None:
        d = o.allocate_domain("cycle", members)
        for f in [o.submit(r, DomainView.barrier, d) for r in members]:
            f.result()
        o.release_domain(d)

    with Worker(ranks=ranks) as w:
        for _ in range(20):  # warm-up: base communicator, imports
            w.run(cycle)
        before = _sum([_resources(), *w.run(lambda o: [o.submit(r, _resources).result()
                                                       for r in members])])
        samples = []
        for _ in range(cycles):
            t0 = time.perf_counter()
            w.run(cycle)
            samples.append(time.perf_counter() - t0)
        after = _sum([_resources(), *w.run(lambda o: [o.submit(r, _resources).result()
                                                      for r in members])])

        def measure(o: DomainOrchestrator) -> tuple[float, tuple[float, float]]:
            d = o.allocate_domain("bench", members, window_size=64 << 20)
            lat = [o.submit(r, _barrier_loop, d, barriers) for r in members]
            bar = lat[0].result()
            for f in lat[1:]:
                f.result()
            bw = o.submit(0, _bandwidth, d, 64 << 20, 5).result()
            return bar, bw

        barrier, (window_gbps, memcpy_gbps) = w.run(measure)
    return {"cycle_us_p50": round(percentile(samples, 50) * 1e6, 1),
            "cycle_us_p99": round(percentile(samples, 99) * 1e6, 1),
            "barrier_us_p50": round(barrier * 1e6, 2),
            "window_gbps": round(window_gbps, 2),
            "resources_before": before, "resources_after": after}, memcpy_gbps


def _gloo_init(rank: int, world: int, port: int) -> int:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,  # type: ignore[attr-defined]
                          timedelta(seconds=60), wait_for_workers=False)
    _GLOO["store"] = store
    return int(store.port)


def _gloo_join(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=_GLOO["store"], rank=rank, world_size=world)


def _gloo_cycles(n: int, world: int) -> list[float]:
    import torch.distributed as dist

    members = list(range(world))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        g = dist.new_group(members)
        dist.barrier(group=g)
        dist.destroy_process_group(g)
        samples.append(time.perf_counter() - t0)
    return samples


def _gloo_barriers(n: int) -> float:
    import torch.distributed as dist

    for _ in range(50):
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.barrier()
    return (time.perf_counter() - t0) / n


def _gloo_done() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    _GLOO.clear()


def _gloo(ranks: int, cycles: int, barriers: int) -> dict[str, Any]:
    members = list(range(ranks))

    def orch(o: DomainOrchestrator) -> dict[str, Any]:
        port = o.submit(0, _gloo_init, 0, ranks, 0).result()
        for r in members[1:]:
            o.submit(r, _gloo_init, r, ranks, port).result()
        for f in [o.submit(r, _gloo_join, r, ranks) for r in members]:
            f.result()
        before = _sum([o.submit(r, _resources).result() for r in members])
        runs = [o.submit(r, _gloo_cycles, cycles, ranks) for r in members]
        samples = [f.result() for f in runs][0]  # noqa: RUF015  (wait for every rank)
        after = _sum([o.submit(r, _resources).result() for r in members])
        lat = [o.submit(r, _gloo_barriers, barriers) for r in members]
        barrier = [f.result() for f in lat][0]  # noqa: RUF015  (wait for every rank)
        for f in [o.submit(r, _gloo_done) for r in members]:
            f.result()
        return {"cycle_us_p50": round(percentile(samples, 50) * 1e6, 1),
                "cycle_us_p99": round(percentile(samples, 99) * 1e6, 1),
                "barrier_us_p50": round(barrier * 1e6, 2),
                "resources_before": before, "resources_after": after}

    with Worker(ranks=ranks) as w:
        result: dict[str, Any] = w.run(orch)
    return result


@click.command("domains")
@click.option("--ranks", type=click.IntRange(1), default=2, show_default=True)
@click.option("--cycles", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--barriers", type=click.IntRange(1), default=2000, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(ranks: int, cycles: int, barriers: int, as_json: bool) -> None:
    """Allocate/barrier/release cycles and barrier latency: phalanx domains vs gloo."""
    phalanx, memcpy = _phalanx(ranks, cycles, barriers)
    gloo = _gloo(ranks, cycles, barriers)
    result = {"phalanx": phalanx, "gloo": gloo, "memcpy_gbps": round(memcpy, 2),
              "ratio_cycle_gloo_over_phalanx": round(gloo["cycle_us_p50"]
                                                     / phalanx["cycle_us_p50"], 1),
              "ratio_barrier_gloo_over_phalanx": round(gloo["barrier_us_p50"]
                                                       / phalanx["barrier_us_p50"], 1),
              "window_fraction_of_memcpy": round(phalanx["window_gbps"] / memcpy, 3)}
    emit(result, as_json)
