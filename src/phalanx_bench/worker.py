"""``phalanx bench worker``: Worker start/close and task round trip vs multiprocessing.Pool.

Both sides are measured in the same run, on the same machine state, with the same
task (``abs`` of an int) so the ratio is what counts, not the absolute figures.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import click

from phalanx.runtime import Orchestrator, Worker

from ._stats import emit, percentile


def _rtt_samples(o: Orchestrator, n: int) -> list[float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        o.submit(i % len(o.ranks), abs, -i).result()
        samples.append(time.perf_counter() - t0)
    return samples


def _phalanx(ranks: int, starts: int, tasks: int, scheduler: str) -> dict[str, float]:
    start, close, rtt = [], [], []
    for i in range(starts):
        t0 = time.perf_counter()
        w = Worker(ranks=ranks, rank_scheduler=scheduler)
        t1 = time.perf_counter()
        if i == 0:
            w.run(_rtt_samples, 200)  # warm-up
            rtt = w.run(_rtt_samples, tasks)
        t2 = time.perf_counter()
        w.close()
        close.append(time.perf_counter() - t2)
        start.append(t1 - t0)
    return _figures(start, close, rtt)


def _pool(ranks: int, starts: int, tasks: int) -> dict[str, float]:
    ctx = multiprocessing.get_context()  # the platform default, as users get it
    start, close, rtt = [], [], []
    for i in range(starts):
        t0 = time.perf_counter()
        pool = ctx.Pool(ranks)
        pool.apply(abs, (-1,))  # Pool starts lazily: count the first round trip as start
        t1 = time.perf_counter()
        if i == 0:
            for j in range(200 + tasks):
                a = time.perf_counter()
                pool.apply(abs, (-j,))
                if j >= 200:
                    rtt.append(time.perf_counter() - a)
        t2 = time.perf_counter()
        pool.close()
        pool.join()
        close.append(time.perf_counter() - t2)
        start.append(t1 - t0)
    return _figures(start, close, rtt)


def _figures(start: list[float], close: list[float], rtt: list[float]) -> dict[str, float]:
    return {
        "start_ms_p50": round(percentile(start, 50) * 1e3, 2),
        "close_ms_p50": round(percentile(close, 50) * 1e3, 2),
        "task_rtt_us_p50": round(percentile(rtt, 50) * 1e6, 1),
        "task_rtt_us_p99": round(percentile(rtt, 99) * 1e6, 1),
    }


@click.command("worker")
@click.option("--ranks", type=click.IntRange(1), default=2, show_default=True)
@click.option("--starts", type=click.IntRange(1), default=10, show_default=True,
              help="start/close cycles per side")
@click.option("--tasks", type=click.IntRange(1), default=5000, show_default=True,
              help="round trips per side")
@click.option("--rank-scheduler", type=click.Choice(["batch", "other"]), default="batch",
              show_default=True, help="the ranks' CPU scheduling policy (Worker's option)")
@click.option("--json", "as_json", is_flag=True, help="print only the JSON line")
def command(ranks: int, starts: int, tasks: int, rank_scheduler: str, as_json: bool) -> None:
    """Start/close time and task round trip: phalanx Worker vs multiprocessing.Pool."""
    # Interleave the sides so drift on a noisy machine hits both alike.
    result: dict[str, Any] = {"pool": _pool(ranks, starts, tasks),
                              "phalanx": _phalanx(ranks, starts, tasks, rank_scheduler)}
    result["ratio_rtt_p50"] = round(
        result["phalanx"]["task_rtt_us_p50"] / result["pool"]["task_rtt_us_p50"], 3)
    result["ranks"] = ranks
    result["rank_scheduler"] = rank_scheduler
    emit(result, as_json)
